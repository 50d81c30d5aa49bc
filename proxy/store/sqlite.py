"""SQLite store: the embedded default. One file in the state directory, shared by every worker.

Every sqlite call runs on one worker thread the store owns (the connection lives there), so the
event loop never waits on disk or on another process's lock. Each operation is one SQL statement
in autocommit mode, which makes `add` and `cas` atomic across threads and processes. Expiry is
wall-clock (`time.time()`), because several processes read the same rows; expired rows are
invisible to reads and removed by an occasional purge.

Failure: the file is opened lazily, on the first operation, so an unusable path (an unwritable
directory, a path under a regular file) raises StoreError from the first call (`ping` included),
not from the constructor; the next call tries again. Any sqlite error raises StoreError, and so
does an operation that takes longer than `timeout` seconds (another process holding the write
lock, a stalled disk). An operation that timed out may still complete on the worker thread.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from proxy.errors import StoreError
from proxy.store.base import Store

T = TypeVar("T")

# Seconds between purges of expired rows (each purge is one indexed DELETE).
PURGE_INTERVAL = 60.0

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv ("
    " ns TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, expires REAL NULL,"
    " PRIMARY KEY (ns, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_expires ON kv (expires) WHERE expires IS NOT NULL",
)
_LIVE = "(expires IS NULL OR expires > ?)"
_GET = f"SELECT value FROM kv WHERE ns = ? AND key = ? AND {_LIVE}"
_PUT = (
    "INSERT INTO kv (ns, key, value, expires) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (ns, key) DO UPDATE SET value = excluded.value, expires = excluded.expires"
)
# Insert, or take over a row only when it has expired: one statement, so exclusive across
# processes; changes() says which happened.
_ADD = _PUT + " WHERE kv.expires IS NOT NULL AND kv.expires <= ?"
_CAS = f"UPDATE kv SET value = ?, expires = ? WHERE ns = ? AND key = ? AND value = ? AND {_LIVE}"
_DELETE = "DELETE FROM kv WHERE ns = ? AND key = ?"
_ITEMS = f"SELECT key, value FROM kv WHERE ns = ? AND {_LIVE} LIMIT ?"
_PURGE = "DELETE FROM kv WHERE expires IS NOT NULL AND expires <= ?"


class SqliteStore(Store):
    """A `kv` table in one WAL-mode SQLite file; safe for several processes on one host."""

    kind = "sqlite"

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None  # touched only on the executor's thread
        self._pid = os.getpid()
        self._next_purge = 0.0
        self._closed = False

    # ---- worker thread ----------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit: every statement is its own transaction. The connection never leaves the
        # worker thread, so sqlite's same-thread check stays on as a guard. `timeout` is the
        # busy timeout, set before anything else: switching to WAL and creating the table take
        # the write lock, which another worker may hold while it does the same.
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=self._busy_timeout())
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            for statement in _SCHEMA:
                conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _busy_timeout(self) -> float:
        # A little under the operation timeout, so a locked database fails inside the worker
        # (freeing the thread) before the caller gives up on it.
        return max(0.0, self.timeout * 0.9)

    def _maybe_purge(self, conn: sqlite3.Connection, now: float) -> None:
        if now >= self._next_purge:
            self._next_purge = now + PURGE_INTERVAL
            conn.execute(_PURGE, (now,))

    def _close_conn(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    # ---- event loop side --------------------------------------------------------------------

    def _pool(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():
            # Forked after first use: the parent's thread and connection do not exist here.
            self._pid, self._executor, self._conn = os.getpid(), None, None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envelope-sqlite")
        return self._executor

    async def _run(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise StoreError(f"sqlite store {self.path}: closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                return await loop.run_in_executor(self._pool(), lambda: fn(self._connect()))
        except TimeoutError as exc:
            raise StoreError(f"sqlite store {self.path}: {what} timed out after {self.timeout}s") from exc
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"sqlite store {self.path}: {what} failed: {exc}") from exc

    @staticmethod
    def _expiry(now: float, ttl: float | None) -> float | None:
        return None if ttl is None else now + ttl

    async def get(self, ns: str, key: str) -> bytes | None:
        def op(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute(_GET, (ns, key, time.time())).fetchone()
            return None if row is None else bytes(row[0])

        return await self._run("get", op)

    async def put(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> None:
        def op(conn: sqlite3.Connection) -> None:
            now = time.time()
            conn.execute(_PUT, (ns, key, value, self._expiry(now, ttl)))
            self._maybe_purge(conn, now)

        await self._run("put", op)

    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            now = time.time()
            changed = conn.execute(_ADD, (ns, key, value, self._expiry(now, ttl), now)).rowcount
            self._maybe_purge(conn, now)
            return changed == 1

        return await self._run("add", op)

    async def cas(self, ns: str, key: str, expected: bytes, value: bytes, ttl: float | None = None) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            now = time.time()
            params = (value, self._expiry(now, ttl), ns, key, expected, now)
            return conn.execute(_CAS, params).rowcount == 1

        return await self._run("cas", op)

    async def delete(self, ns: str, key: str) -> None:
        def op(conn: sqlite3.Connection) -> None:
            conn.execute(_DELETE, (ns, key))

        await self._run("delete", op)

    async def items(self, ns: str, limit: int = 1000) -> list[tuple[str, bytes]]:
        def op(conn: sqlite3.Connection) -> list[tuple[str, bytes]]:
            rows = conn.execute(_ITEMS, (ns, time.time(), max(0, limit))).fetchall()
            return [(str(k), bytes(v)) for k, v in rows]

        return await self._run("items", op)

    async def ping(self) -> None:
        def op(conn: sqlite3.Connection) -> None:
            conn.execute("SELECT 1 FROM kv LIMIT 1").fetchall()

        await self._run("ping", op)

    async def close(self) -> None:
        """Close the connection and stop the worker thread; later calls raise StoreError."""
        if self._closed:
            return
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is None or self._pid != os.getpid():
            return
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                await loop.run_in_executor(executor, self._close_conn)
        except (TimeoutError, sqlite3.Error) as exc:
            raise StoreError(f"sqlite store {self.path}: close failed: {exc or 'timed out'}") from exc
        finally:
            executor.shutdown(wait=False)
