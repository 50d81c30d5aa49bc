"""SQLite store: the embedded default. One file in the state directory, shared by every worker.

Every sqlite call runs on one worker thread the store owns (the connection lives there), so the
event loop never waits on disk or on another process's lock. One exception, the warm sink check's
read: a small `hash_since` (at most `INLINE_ENTRIES` entries, `INLINE_BYTES`) is answered on the event loop's
thread by a read-only connection of its own with busy timeout 0 (a WAL reader waits for no
writer; anything that would make it wait goes to the worker), and not read at all while
`PRAGMA data_version` shows no commit by any connection since its last answer found nothing new
(a thread hop cost ~100 µs of the ~250 µs that read took; the skip costs ~10 µs). Each plain operation is one SQL
statement in autocommit mode, which makes `add` and `cas` atomic across threads and processes.
Expiry is wall-clock (`time.time()`), because several processes read the same rows; expired rows
are invisible to reads and removed by an occasional purge.

Token buckets (`take`) are `kv` rows; a take is one `BEGIN IMMEDIATE` transaction that reads
and rewrites its few rows, on the wall clock of the process that takes (one host's clock).

Hashes live apart from `kv`: a `hash` row per field and a `hash_meta` row per hash holding its
expiry and its number of fields, kept exact so that a cap check never counts rows. A write to a
hash is one `BEGIN IMMEDIATE` transaction (the write lock is taken up front, so two processes
cannot both count the same free room under a cap); a read is one read transaction (one snapshot
across its chunks). Fields are named in `IN (...)` lists of at most `_IN_CHUNK`, so every hash
operation costs what its own fields cost, never what the hash holds. A log (`hash_append`) is a
hash whose fields are 8-byte big-endian sequence numbers plus its counter field: an append is
one write step (with the hash set alongside, `also`), `hash_since` one read transaction over a
range of the primary key.

Group commit: hash writes (`hash_append`, `hash_put`, `hash_delete`) queue up, and the worker
takes every queued one into a single `BEGIN IMMEDIATE` transaction, applied in the order they
came (each exactly as it would be alone: caps and sequence numbers see the writes before it).
Each caller is answered only after that transaction committed, so an output is still recorded
before it is delivered; concurrent calls share one commit and one thread hop (a batch is handed
to the worker on the event loop's next turn, so the answers that arrived together share it). A
batch fails as one: every caller in it gets the StoreError and nothing of it is kept.

Failure: the file is opened lazily, on the first operation, so an unusable path (an unwritable
directory, a path under a regular file) raises StoreError from the first call (`ping` included),
not from the constructor; the next call tries again. Any sqlite error raises StoreError, and so
does an operation that takes longer than `timeout` seconds (another process holding the write
lock, a stalled disk). An operation that timed out may still complete on the worker thread.
"""

from __future__ import annotations

import asyncio
import math
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from proxy.errors import StoreError
from proxy.store import buckets as arithmetic
from proxy.store.base import (
    LOG_COUNTER,
    Bucket,
    HashPut,
    LogRead,
    Store,
    Taken,
    log_counter,
    log_field,
)

T = TypeVar("T")

# Seconds between purges of expired rows (each purge is one indexed DELETE).
PURGE_INTERVAL = 60.0

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv ("
    " ns TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, expires REAL NULL,"
    " PRIMARY KEY (ns, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_expires ON kv (expires) WHERE expires IS NOT NULL",
    "CREATE TABLE IF NOT EXISTS hash ("
    " ns TEXT NOT NULL, key TEXT NOT NULL, field BLOB NOT NULL, value BLOB NOT NULL,"
    " PRIMARY KEY (ns, key, field)) WITHOUT ROWID",
    # `size` is the hash's number of fields. A field row exists only while its meta row does.
    "CREATE TABLE IF NOT EXISTS hash_meta ("
    " ns TEXT NOT NULL, key TEXT NOT NULL, expires REAL NULL, size INTEGER NOT NULL,"
    " PRIMARY KEY (ns, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS hash_meta_expires ON hash_meta (expires) WHERE expires IS NOT NULL",
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

_HASH_META = "SELECT expires, size FROM hash_meta WHERE ns = ? AND key = ?"
_HASH_SET_META = (
    "INSERT INTO hash_meta (ns, key, expires, size) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (ns, key) DO UPDATE SET expires = excluded.expires, size = excluded.size"
)
_HASH_SET_SIZE = "UPDATE hash_meta SET size = ? WHERE ns = ? AND key = ?"
_HASH_DROP_META = "DELETE FROM hash_meta WHERE ns = ? AND key = ?"
_HASH_CLEAR = "DELETE FROM hash WHERE ns = ? AND key = ?"
_HASH_UPSERT = (
    "INSERT INTO hash (ns, key, field, value) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (ns, key, field) DO UPDATE SET value = excluded.value"
)
# Completed with `field IN (?, ...)` per chunk of fields.
_HASH_INSERT_NEW = "INSERT OR IGNORE INTO hash (ns, key, field, value) VALUES (?, ?, ?, ?)"
_HASH_REPLACE = "UPDATE hash SET value = ? WHERE ns = ? AND key = ? AND field = ? AND value IS NOT ?"
_HASH_FIELDS = "SELECT field FROM hash WHERE ns = ? AND key = ? AND field IN "
_HASH_VALUES = "SELECT field, value FROM hash WHERE ns = ? AND key = ? AND field IN "
_HASH_REMOVE = "DELETE FROM hash WHERE ns = ? AND key = ? AND field IN "
_HASH_ALL = "SELECT field, value FROM hash WHERE ns = ? AND key = ? LIMIT ?"
_LOG_SINCE = (
    "SELECT value FROM hash WHERE ns = ? AND key = ? AND field > ? AND field <= ?"
    " AND length(field) = 8 ORDER BY field"
)
_LOG_SIZE = (
    "SELECT coalesce(sum(length(value)), 0) FROM hash WHERE ns = ? AND key = ? AND field > ?"
    " AND field <= ? AND length(field) = 8"
)
# Fields before their meta rows, inside one transaction: no field outlives its meta row.
_HASH_PURGE = (
    "DELETE FROM hash WHERE (ns, key) IN"
    " (SELECT ns, key FROM hash_meta WHERE expires IS NOT NULL AND expires <= ?)"
)
_HASH_PURGE_META = "DELETE FROM hash_meta WHERE expires IS NOT NULL AND expires <= ?"

# Most log entries `hash_since` reads on the event loop's thread (a warm view asks for the few
# recorded since its last check; a larger read goes to the worker thread), and how many logs'
# last quiet answers it remembers (`PRAGMA data_version` skips the read while they hold).
INLINE_ENTRIES = 8
INLINE_BYTES = 64 * 1024
QUIET_LOGS = 4096

# Fields per `IN (...)` list: well under SQLite's bound-parameter limit (999 before 3.32).
_IN_CHUNK = 500
# Most fields of an uncapped `hash_put` that reads what they hold before writing (fewer
# statements for a few fields; a large put writes without looking first).
_SMALL_PUT = 16


def _in_chunks(fields: Sequence[bytes]) -> Iterator[tuple[str, Sequence[bytes]]]:
    """`(?, ..., ?)` and the fields it binds, at most `_IN_CHUNK` at a time."""
    for start in range(0, len(fields), _IN_CHUNK):
        chunk = fields[start : start + _IN_CHUNK]
        yield "(" + ", ".join("?" * len(chunk)) + ")", chunk


def _transaction(conn: sqlite3.Connection, begin: str, fn: Callable[[], T]) -> T:
    """Run `fn` between `begin` and COMMIT; roll back when it (or the commit) fails."""
    conn.execute(begin)
    try:
        result = fn()
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


def _writable_meta(conn: sqlite3.Connection, now: float, ns: str, key: str) -> tuple[Any, ...] | None:
    """A hash's (expires, size) row before a write in the caller's transaction, or None when
    it has none; an expired hash is cleared first (it starts afresh: no fields, no expiry,
    before the write counts anything)."""
    meta = conn.execute(_HASH_META, (ns, key)).fetchone()
    if meta is not None and not _live(meta[0], now):
        conn.execute(_HASH_CLEAR, (ns, key))
        conn.execute(_HASH_DROP_META, (ns, key))
        return None
    return tuple(meta) if meta is not None else None


def _hash_put(conn: sqlite3.Connection, now: float, ns: str, key: str, fields: Mapping[bytes, bytes],
              ttl: float | None, replace: bool = True, cap: int | None = None) -> HashPut:
    """`Store.hash_put` inside the caller's write transaction."""
    items = list(fields.items())
    names = [field for field, _ in items]
    meta = _writable_meta(conn, now, ns, key)
    expires, size = (None, 0) if meta is None else (meta[0], int(meta[1]))
    if cap is None and len(items) <= _SMALL_PUT:
        # A few fields (a ledger's flags and sources, mostly unchanged since the run's last
        # output): one read of what they hold, then only new or changed ones written (three
        # statements where the passes below take eight: ~50 µs of each recorded output).
        held: dict[bytes, bytes] = {}
        if meta is not None and items:
            marks = "(" + ", ".join("?" * len(names)) + ")"
            held = {bytes(f): bytes(v) for f, v in conn.execute(_HASH_VALUES + marks, (ns, key, *names))}
        writes = [(ns, key, f, v) for f, v in items if f not in held or (replace and held[f] != v)]
        if writes:
            conn.executemany(_HASH_UPSERT, writes)
        added = sum(1 for f in names if f not in held)
        if added or ttl is not None:
            expires = expires if ttl is None else now + ttl
            conn.execute(_HASH_SET_META, (ns, key, expires, size + added))
        return HashPut(added, 0)
    if cap is None or size + len(items) <= cap:
        # Every field fits: insert the new ones in one pass (changes() counts them), and
        # only when some existed, replace those in a second; no lookup before writing.
        before = conn.total_changes
        conn.executemany(_HASH_INSERT_NEW, [(ns, key, f, v) for f, v in items])
        added = conn.total_changes - before
        if replace and added < len(items):
            conn.executemany(_HASH_REPLACE, [(v, ns, key, f, v) for f, v in items])
        if added or ttl is not None:
            expires = expires if ttl is None else now + ttl
            conn.execute(_HASH_SET_META, (ns, key, expires, size + added))
        return HashPut(added, 0)
    existing: set[bytes] = set()
    for marks, chunk in _in_chunks(names):
        existing.update(bytes(row[0]) for row in conn.execute(_HASH_FIELDS + marks, (ns, key, *chunk)))
    new = [(field, value) for field, value in items if field not in existing]
    # The first new fields (in the caller's order) that fit under the cap are added.
    room = len(new) if cap is None else max(0, min(len(new), cap - size))
    writes = [(ns, key, field, value) for field, value in new[:room]]
    if replace:
        writes += [(ns, key, field, value) for field, value in items if field in existing]
    conn.executemany(_HASH_UPSERT, writes)
    if room or ttl is not None:
        expires = expires if ttl is None else now + ttl
        conn.execute(_HASH_SET_META, (ns, key, expires, size + room))
    return HashPut(room, len(new) - room)


def _hash_append(conn: sqlite3.Connection, now: float, ns: str, key: str, value: bytes, ttl: float | None,
                 weight: int, cap: int | None, also: tuple[str, Mapping[bytes, bytes]] | None,
                 drop: Sequence[bytes], if_refused: Mapping[bytes, bytes] | None) -> int:
    """`Store.hash_append` inside the caller's write transaction."""
    meta = _writable_meta(conn, now, ns, key)
    expires, size = (None, 0) if meta is None else (meta[0], int(meta[1]))
    expires = expires if ttl is None else now + ttl
    row = conn.execute(_HASH_VALUES + "(?)", (ns, key, LOG_COUNTER)).fetchone()
    seq, total = log_counter(None if row is None else bytes(row[1]))
    if cap is not None and total + weight > cap:
        if ttl is not None and meta is not None:
            conn.execute(_HASH_SET_META, (ns, key, expires, size))
        seq, fields = 0, if_refused
    else:
        seq += 1
        conn.execute(_HASH_UPSERT, (ns, key, log_field(seq), value))
        conn.execute(_HASH_UPSERT, (ns, key, LOG_COUNTER, b"%d %d" % (seq, total + weight)))
        conn.execute(_HASH_SET_META, (ns, key, expires, size + 1 + (row is None)))
        fields = also[1] if also is not None else None
    if also is not None and fields is not None:
        _hash_put(conn, now, also[0], key, fields, ttl)
        if drop:
            _hash_remove(conn, now, also[0], key, drop)
    return seq


def _hash_remove(conn: sqlite3.Connection, now: float, ns: str, key: str, fields: Sequence[bytes]) -> None:
    """`Store.hash_delete` inside the caller's write transaction."""
    meta = conn.execute(_HASH_META, (ns, key)).fetchone()
    if meta is None or not _live(meta[0], now):
        return  # absent, or expired (the next put or purge clears it)
    expires, size = meta[0], int(meta[1])
    for marks, chunk in _in_chunks(fields):
        size -= conn.execute(_HASH_REMOVE + marks, (ns, key, *chunk)).rowcount
    if size <= 0 and expires is None:
        conn.execute(_HASH_DROP_META, (ns, key))  # an empty hash without expiry is no hash
    else:
        conn.execute(_HASH_SET_SIZE, (max(0, size), ns, key))


def _live(expires: float | None, now: float) -> bool:
    return expires is None or expires > now


@dataclass(frozen=True, slots=True)
class _Write:
    """One caller's hash write (`hash_append`, `hash_put`, `hash_delete`), queued for the
    worker's next batch (`SqliteStore._flush`): `work` runs inside the batch's transaction."""

    what: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    work: Callable[[sqlite3.Connection, float], Any]


def _settle(settled: list[tuple[asyncio.Future[Any], Any]], error: Exception | None) -> None:
    """On the event loop: hand each caller of a batch its answer, or the batch's error (a
    caller that gave up, timed out or was cancelled, is skipped)."""
    for future, answer in settled:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(answer)


class _TooLarge(Exception):
    """A read larger than the event loop's thread may do (`SqliteStore._since_inline`)."""


def _log_since(conn: sqlite3.Connection, ns: str, key: str, after: int, limit: int,
               with_hash: str | None, now: float, most: int | None = None) -> tuple[LogRead, float]:
    """`hash_since` inside a read transaction, and until when the answer holds without a commit
    (the sooner expiry of the two hashes). Raises `_TooLarge` when it would read more than
    `most` entries."""
    until = math.inf
    meta = conn.execute(_HASH_META, (ns, key)).fetchone()
    last, entries = 0, []
    if meta is not None and _live(meta[0], now):
        until = min(until, math.inf if meta[0] is None else meta[0])
        row = conn.execute(_HASH_VALUES + "(?)", (ns, key, LOG_COUNTER)).fetchone()
        last = log_counter(None if row is None else bytes(row[1]))[0]
        start = max(0, after)
        end = min(last, start + max(0, limit))
        if most is not None and end > start:
            if end - start > most:
                raise _TooLarge
            # length() reads a blob's header, not its pages: one entry can hold a 10 MB page's
            # fingerprints, more than the event loop should copy.
            size = conn.execute(_LOG_SIZE, (ns, key, log_field(start), log_field(end))).fetchone()[0]
            if size > INLINE_BYTES:
                raise _TooLarge
        if end > start:
            rows = conn.execute(_LOG_SINCE, (ns, key, log_field(start), log_field(end)))
            entries = [bytes(value) for (value,) in rows]
    fields: dict[bytes, bytes] = {}
    if with_hash is not None:
        meta = conn.execute(_HASH_META, (with_hash, key)).fetchone()
        if meta is not None and _live(meta[0], now):
            until = min(until, math.inf if meta[0] is None else meta[0])
            fields = {bytes(f): bytes(v) for f, v in conn.execute(_HASH_ALL, (with_hash, key, 10_000))}
    return LogRead(last, entries, fields), until


class SqliteStore(Store):
    """`kv`, `hash` and `hash_meta` tables in one WAL-mode SQLite file; safe for several processes on one host."""

    kind = "sqlite"

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None  # touched only on the executor's thread
        self._pid = os.getpid()
        self._next_purge = 0.0
        self._closed = False
        # Hash writes waiting for the worker's next batch, and whether a batch is already queued
        # on the worker (a new write then only joins the list: one thread hop per batch).
        self._writes: list[_Write] = []
        self._writes_lock = threading.Lock()
        self._flush_queued = False
        # The event loop thread's read-only connection (`_since_inline`) and, per (log, hash
        # read with it), the last answer that found nothing new: (data_version, last sequence
        # number, valid until (wall time), the hash's fields).
        self._read_conn: sqlite3.Connection | None = None
        self._read_thread: int | None = None
        self._quiet: OrderedDict[tuple[str, str, str | None],
                                 tuple[int, int, float, dict[bytes, bytes]]] = OrderedDict()

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
            self._set_up(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _set_up(self, conn: sqlite3.Connection) -> None:
        # Two processes opening a new file at once: sqlite can refuse the switch to WAL as
        # "locked" straight away, without waiting on the busy timeout. The set-up is idempotent,
        # so it is tried again until the busy timeout has passed.
        deadline = time.monotonic() + self._busy_timeout()
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
                for statement in _SCHEMA:
                    conn.execute(statement)
                return
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                    raise
            time.sleep(0.01)

    def _busy_timeout(self) -> float:
        # A little under the operation timeout, so a locked database fails inside the worker
        # (freeing the thread) before the caller gives up on it.
        return max(0.0, self.timeout * 0.9)

    def _maybe_purge(self, conn: sqlite3.Connection, now: float) -> None:
        if now >= self._next_purge:
            self._next_purge = now + PURGE_INTERVAL
            conn.execute(_PURGE, (now,))

            def purge_hashes() -> None:
                conn.execute(_HASH_PURGE, (now,))
                conn.execute(_HASH_PURGE_META, (now,))

            _transaction(conn, "BEGIN IMMEDIATE", purge_hashes)

    def _close_conn(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    # ---- event loop side --------------------------------------------------------------------

    def _pool(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():
            # Forked after first use: the parent's thread and connection do not exist here.
            self._pid, self._executor, self._conn = os.getpid(), None, None
            self._read_conn, self._read_thread = None, None  # not closed: the parent's
            self._quiet.clear()
            self._writes, self._writes_lock, self._flush_queued = [], threading.Lock(), False
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

    # ---- hashes -------------------------------------------------------------------------------

    async def hash_put(self, ns: str, key: str, fields: Mapping[bytes, bytes], ttl: float | None = None,
                       *, replace: bool = True, cap: int | None = None) -> HashPut:
        return await self._write("hash_put", lambda conn, now: _hash_put(conn, now, ns, key, fields, ttl,
                                                                        replace, cap))

    async def hash_append(self, ns: str, key: str, value: bytes, ttl: float | None = None, *,
                          weight: int = 0, cap: int | None = None,
                          also: tuple[str, Mapping[bytes, bytes]] | None = None,
                          drop: Sequence[bytes] = (),
                          if_refused: Mapping[bytes, bytes] | None = None) -> int:
        return await self._write("hash_append", lambda conn, now: _hash_append(
            conn, now, ns, key, value, ttl, weight, cap, also, drop, if_refused))

    async def _write(self, what: str, work: Callable[[sqlite3.Connection, float], T]) -> T:
        """Group commit: `work` joins the writes that the worker thread takes all at once into
        one write transaction (`_flush`); the caller is answered once that transaction has
        committed (so an output is recorded before it is delivered, as with a transaction of
        its own). Concurrent calls' writes share one BEGIN/COMMIT and one thread hop."""
        if self._closed:
            raise StoreError(f"sqlite store {self.path}: closed")
        loop = asyncio.get_running_loop()
        pool = self._pool()
        future: asyncio.Future[T] = loop.create_future()
        with self._writes_lock:
            self._writes.append(_Write(what, loop, future, work))
            first, self._flush_queued = not self._flush_queued, True
        if first:
            # Submitted on the loop's next turn, not now: the calls the loop runs in this turn
            # (answers that arrived together) add their writes to the same batch first. A lone
            # call loses nothing: the loop has nothing else to run before it.
            loop.call_soon(self._start_flush, pool)
        try:
            async with asyncio.timeout(self.timeout):
                return await future
        except TimeoutError as exc:
            raise StoreError(f"sqlite store {self.path}: {what} timed out after {self.timeout}s") from exc
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"sqlite store {self.path}: {what} failed: {exc}") from exc

    def _start_flush(self, pool: ThreadPoolExecutor) -> None:
        try:
            pool.submit(self._flush)
        except RuntimeError:  # the store closed in the meantime: its worker takes no more work
            with self._writes_lock:
                batch, self._writes, self._flush_queued = self._writes, [], False
            error = StoreError(f"sqlite store {self.path}: closed")
            _settle([(job.future, None) for job in batch], error)

    def _flush(self) -> None:
        """On the worker thread: every queued write in one write transaction, in the order they
        came, then each caller woken (one wake-up of each event loop for the whole batch). A
        failure anywhere rolls the whole batch back and every caller in it gets the error: none
        of their outputs is delivered (fail closed)."""
        with self._writes_lock:
            batch, self._writes, self._flush_queued = self._writes, [], False
        if not batch:
            return  # taken by an earlier flush (`close` drains the queue itself)
        answers: list[Any] = []
        error: Exception | None = None
        try:
            conn = self._connect()
            now = time.time()
            answers = _transaction(conn, "BEGIN IMMEDIATE", lambda: [job.work(conn, now) for job in batch])
            self._maybe_purge(conn, now)
        except Exception as exc:  # every caller of the batch gets it (sqlite, OS or a bug)
            error = exc
        loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for i, job in enumerate(batch):
            loops.setdefault(job.loop, []).append((job.future, answers[i] if answers else None))
        for loop, settled in loops.items():
            try:
                loop.call_soon_threadsafe(_settle, settled, error)
            except RuntimeError:
                pass  # that loop has closed: nobody waits for these answers any more

    async def hash_since(self, ns: str, key: str, after: int, limit: int = 256, *,
                         with_hash: str | None = None) -> LogRead:
        # A warm sink check asks this once per call, mostly for nothing new: answered on the
        # event loop's thread when the read is small (`_since_inline`), else by the worker.
        found = self._since_inline(ns, key, after, limit, with_hash)
        if found is not None:
            return found
        # One read transaction: the log and the hash read with it are one snapshot.
        return await self._run("hash_since", lambda conn: _transaction(
            conn, "BEGIN", lambda: _log_since(conn, ns, key, after, limit, with_hash, time.time())[0]))

    def _reader(self) -> sqlite3.Connection | None:
        """The event loop thread's own connection (read-only), or None where it cannot serve."""
        if self._closed or self._conn is None or self._pid != os.getpid():
            return None  # the worker has not set the file up yet, or a fork: the worker path
        if self._read_conn is not None:
            return self._read_conn if self._read_thread == threading.get_ident() else None
        try:
            # Busy timeout 0: a WAL reader waits for no writer; whatever would make it wait
            # (a recovery, a lock) sends the read to the worker instead of stalling the loop.
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=0.0)
            conn.execute("PRAGMA query_only = 1")
        except sqlite3.Error:
            return None
        self._read_conn, self._read_thread = conn, threading.get_ident()
        return conn

    def _since_inline(self, ns: str, key: str, after: int, limit: int,
                      with_hash: str | None) -> LogRead | None:
        """`hash_since` on the event loop's thread, or None (the worker answers instead).

        Bounded: at most `INLINE_ENTRIES` entries of `INLINE_BYTES` in all (a larger read goes
        to the worker), and no
        read at all when `PRAGMA data_version` says no connection committed since this one last
        read the same log and hash, found nothing after `after`, and neither can have expired
        since (SQLite guarantees the version changes on any other connection's commit, this
        process's worker included; this connection never writes). Any sqlite error drops the
        connection and leaves the call to the worker, which fails closed as ever."""
        conn = self._reader()
        if conn is None:
            return None
        try:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            now = time.time()
            quiet = self._quiet.get((ns, key, with_hash))
            if quiet is not None and quiet[0] == version and quiet[1] == after and now < quiet[2]:
                return LogRead(after, [], dict(quiet[3]))
            read = _transaction(conn, "BEGIN",
                                lambda: _log_since(conn, ns, key, after, limit, with_hash, now, INLINE_ENTRIES))
        except _TooLarge:
            return None
        except sqlite3.Error:
            self._close_reader()
            return None
        found, until = read
        self._quiet[(ns, key, with_hash)] = (version, found.last, until, dict(found.fields))
        self._quiet.move_to_end((ns, key, with_hash))
        while len(self._quiet) > QUIET_LOGS:
            self._quiet.popitem(last=False)
        return found

    def _close_reader(self) -> None:
        conn, self._read_conn, self._read_thread = self._read_conn, None, None
        self._quiet.clear()
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error:
                pass  # closing is best effort: the connection is dropped either way

    async def hash_get(self, ns: str, key: str, fields: Sequence[bytes]) -> list[bytes | None]:
        if not fields:
            return []

        def read(conn: sqlite3.Connection) -> list[bytes | None]:
            meta = conn.execute(_HASH_META, (ns, key)).fetchone()
            if meta is None or not _live(meta[0], time.time()):
                return [None] * len(fields)
            found: dict[bytes, bytes] = {}
            for marks, chunk in _in_chunks(fields):
                rows = conn.execute(_HASH_VALUES + marks, (ns, key, *chunk))
                found.update((bytes(field), bytes(value)) for field, value in rows)
            return [found.get(field) for field in fields]

        # One read transaction: every chunk sees the same snapshot.
        return await self._run("hash_get", lambda conn: _transaction(conn, "BEGIN", lambda: read(conn)))

    async def hash_all(self, ns: str, key: str, limit: int = 10_000) -> dict[bytes, bytes]:
        def read(conn: sqlite3.Connection) -> dict[bytes, bytes]:
            meta = conn.execute(_HASH_META, (ns, key)).fetchone()
            if meta is None or not _live(meta[0], time.time()):
                return {}
            rows = conn.execute(_HASH_ALL, (ns, key, max(0, limit)))
            return {bytes(field): bytes(value) for field, value in rows}

        return await self._run("hash_all", lambda conn: _transaction(conn, "BEGIN", lambda: read(conn)))

    async def hash_delete(self, ns: str, key: str, fields: Sequence[bytes]) -> None:
        if not fields:
            return

        await self._write("hash_delete", lambda conn, now: _hash_remove(conn, now, ns, key, fields))

    # ---- token buckets ------------------------------------------------------------------------

    async def take(self, ns: str, buckets: Sequence[Bucket]) -> Taken:
        def decide(conn: sqlite3.Connection) -> Taken:
            now = time.time()  # read under the lock: stamps only move forward
            states: list[bytes | None] = []
            for bucket in buckets:
                row = conn.execute(_GET, (ns, bucket.key, now)).fetchone()
                states.append(None if row is None else bytes(row[0]))
            taken, writes = arithmetic.take(states, buckets, now)
            conn.executemany(_PUT, [(ns, bucket.key, state, now + bucket.ttl)
                                    for bucket, state in zip(buckets, writes, strict=False)])
            return taken

        def op(conn: sqlite3.Connection) -> Taken:
            # The write lock up front: two processes cannot both read the same last token.
            taken = _transaction(conn, "BEGIN IMMEDIATE", lambda: decide(conn))
            self._maybe_purge(conn, time.time())
            return taken

        return await self._run("take", op)

    async def ping(self) -> None:
        def op(conn: sqlite3.Connection) -> None:
            conn.execute("SELECT 1 FROM kv LIMIT 1").fetchall()

        await self._run("ping", op)

    async def close(self) -> None:
        """Close the connection and stop the worker thread; later calls raise StoreError."""
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid() and self._read_thread == threading.get_ident():
            self._close_reader()
        executor, self._executor = self._executor, None
        if executor is None or self._pid != os.getpid():
            return
        loop = asyncio.get_running_loop()
        if self._flush_queued:
            executor.submit(self._flush)  # writes queued this turn commit before the connection closes
        try:
            async with asyncio.timeout(self.timeout):
                await loop.run_in_executor(executor, self._close_conn)
        except (TimeoutError, sqlite3.Error) as exc:
            raise StoreError(f"sqlite store {self.path}: close failed: {exc or 'timed out'}") from exc
        finally:
            executor.shutdown(wait=False)
