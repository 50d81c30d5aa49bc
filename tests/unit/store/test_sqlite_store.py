"""SqliteStore's group commit of hash writes (`hash_append`, `hash_put`, `hash_delete`): writes
queued together go in one transaction, each caller answered only once it committed, and a batch
that fails refuses every caller in it (nothing of the batch is kept). A batch commits on the event
loop's thread (inline) unless it is large, or another connection holds the write lock (then the
worker thread commits it, once); the `store` fixture has inline writes off, to hold batches
behind a busy worker."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import StoreError
from proxy.store import sqlite as sqlite_module
from proxy.store.base import LOG_COUNTER, Store, log_field
from proxy.store.memory import MemoryStore
from proxy.store.sqlite import INLINE_WRITE_BYTES, INLINE_WRITES, SqliteStore


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db", timeout=10.0, inline_writes=False)
    yield opened
    await opened.close()


@pytest.fixture
async def inline(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db", timeout=10.0, inline_writes=True)
    await opened.ping()  # the worker has set the file up: the loop's connection can open
    yield opened
    await opened.close()


def _threads_applying(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the threads that apply a write batch from now on (one entry per batch)."""
    threads: list[int] = []
    real = sqlite_module._apply

    def spying(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(sqlite_module, "_apply", spying)
    return threads


async def _worker_held(store: SqliteStore) -> tuple[threading.Event, asyncio.Task[object]]:
    """Keep the store's worker thread busy until the event is set, so that the appends made
    meanwhile queue up and are taken as one batch."""
    await store.ping()  # the file exists: the batch's work is only its own
    release, started = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> bool:
        started.set()
        return release.wait(5.0)

    held = asyncio.create_task(store._run("hold", hold))
    assert await asyncio.to_thread(started.wait, 5.0)
    return release, held


def _assert_sizes_exact(path: Path) -> None:
    """Every hash's meta row counts exactly the fields it has (the caps rely on it), read by
    another connection, as another process would."""
    conn = sqlite3.connect(path)
    try:
        sizes = conn.execute("SELECT m.ns, m.key, m.size, (SELECT count(*) FROM hash AS h"
                             " WHERE h.ns = m.ns AND h.key = m.key) FROM hash_meta AS m").fetchall()
    finally:
        conn.close()
    assert sizes and all(size == rows for _, _, size, rows in sizes), sizes


def _log(path: Path, key: str) -> dict[bytes, bytes]:
    """The log as another process reads it: its own connection to the file, after the fact."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT field, value FROM hash WHERE ns = 'log' AND key = ?", (key,))
        return {bytes(f): bytes(v) for f, v in rows}
    finally:
        conn.close()


async def test_concurrent_appends_share_a_batch_and_are_all_durable(store: SqliteStore) -> None:
    release, held = await _worker_held(store)
    appends = [asyncio.create_task(store.hash_append("log", "run", b"entry %d" % i, ttl=60.0, weight=1,
                                                     also=("meta", {b"u": b"1"})))
               for i in range(5)]
    marker = asyncio.create_task(store.hash_put("meta", "run", {b"p:d1": b"9"}, ttl=60.0))
    await asyncio.sleep(0.01)
    assert not any(task.done() for task in [*appends, marker])  # nobody is answered before the commit
    assert len(store._writes) == 6  # queued behind the busy worker: one batch
    release.set()
    assert await held is True
    seqs = await asyncio.gather(*appends)
    assert (await marker).added == 1
    assert sorted(seqs) == [1, 2, 3, 4, 5]
    # Committed when the callers were answered: another connection sees every entry.
    log = _log(store.path, "run")
    assert sorted(v for f, v in log.items() if f != LOG_COUNTER) == [b"entry %d" % i for i in range(5)]
    assert log[LOG_COUNTER] == b"5 5"
    replica = SqliteStore(store.path, timeout=10.0)
    try:
        read = await replica.hash_since("log", "run", 0, with_hash="meta")
    finally:
        await replica.close()
    assert read.last == 5 and len(read.entries) == 5 and read.fields == {b"u": b"1", b"p:d1": b"9"}


async def test_a_failing_batch_refuses_every_caller_and_keeps_nothing(store: SqliteStore) -> None:
    await store.hash_append("log", "run", b"before", ttl=60.0)
    release, held = await _worker_held(store)
    good = asyncio.create_task(store.hash_append("log", "run", b"good", ttl=60.0))
    put = asyncio.create_task(store.hash_put("meta", "run", {b"p:d2": b"1"}, ttl=60.0))
    # A value sqlite cannot bind: this append fails inside the batch's transaction.
    bad = asyncio.create_task(store.hash_append("log", "run", b"bad", ttl=60.0,
                                                also=("meta", {b"u": object()})))  # type: ignore[dict-item]
    await asyncio.sleep(0.01)
    release.set()
    await held
    for task, what in ((good, "hash_append"), (put, "hash_put"), (bad, "hash_append")):
        with pytest.raises(StoreError, match=f"{what} failed"):
            await task
    assert await store.hash_all("meta", "run") == {}
    # Rolled back as one: neither entry is in the log, and the next append follows "before".
    assert sorted(_log(store.path, "run").values()) == [b"1 0", b"before"]
    assert await store.hash_append("log", "run", b"after", ttl=60.0) == 2


async def test_a_cancelled_caller_does_not_stop_the_others(store: SqliteStore) -> None:
    release, held = await _worker_held(store)
    gone = asyncio.create_task(store.hash_append("log", "run", b"a", ttl=60.0))
    kept = asyncio.create_task(store.hash_append("log", "run", b"b", ttl=60.0))
    await asyncio.sleep(0.01)
    gone.cancel()
    release.set()
    await held
    assert await kept in (1, 2)
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_appends_from_a_closed_store_are_refused(store: SqliteStore) -> None:
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.hash_append("log", "run", b"x")


async def test_writes_queued_when_the_store_closes_are_committed_first(store: SqliteStore) -> None:
    await store.ping()
    append = asyncio.create_task(store.hash_append("log", "run", b"last", ttl=60.0))
    await asyncio.sleep(0)  # queued; its batch not yet handed to the worker
    await store.close()
    assert await append == 1
    assert _log(store.path, "run")[log_field(1)] == b"last"


async def _one_batch_of_writes(store: Store, hold: bool) -> list[object]:
    """Appends, puts and removals on one run's log and flags hash (and on a hash that expired
    before them), each reading what the ones before it left: caps, sizes, sequence numbers, a
    removed and re-added flag, fields written beside a log's counter. With `hold`, all of them
    are queued behind the busy worker and go in as one batch."""
    await store.hash_put("meta", "old", {b"z": b"1"}, ttl=0.05)
    await asyncio.sleep(0.1)
    writes: list[Callable[[], Awaitable[object]]] = [
        lambda: store.hash_append("log", "run", b"e1", ttl=60.0, weight=2, cap=5, also=("meta", {b"u": b"1"})),
        lambda: store.hash_put("meta", "run", {b"p:a": b"9"}),
        lambda: store.hash_append("log", "run", b"e2", ttl=60.0, weight=2, cap=5,
                                  also=("meta", {b"u": b"1", b"s": b"1"}), drop=[b"p:a"]),
        lambda: store.hash_put("meta", "run", {b"p:b": b"9"}),
        lambda: store.hash_append("log", "run", b"e3", ttl=60.0, weight=2, cap=5, also=("meta", {b"u": b"1"}),
                                  drop=[b"p:b"], if_refused={b"u": b"1", b"o": b"1"}),
        lambda: store.hash_put("meta", "run", {b"u": b"1", b"s": b"2"}),
        lambda: store.hash_delete("meta", "run", [b"s"]),
        lambda: store.hash_put("meta", "run", {b"s": b"2"}),
        lambda: store.hash_put("meta", "run", {b"s": b"3", b"x": b"1"}, cap=3),
        lambda: store.hash_put("meta", "run", {b"s": b"3", b"y": b"1"}),
        lambda: store.hash_put("log", "run", {b"side": b"1"}),
        lambda: store.hash_append("log", "run", b"e4", ttl=60.0, weight=1),
        lambda: store.hash_put("meta", "old", {b"a": b"1"}),
        lambda: store.hash_delete("meta", "old", [b"a", b"z"]),
        lambda: store.hash_put("meta", "old", {b"a": b"2"}),
        lambda: store.hash_put("meta", "old", {b"a": b"2"}, replace=False),
    ]
    if hold:
        assert isinstance(store, SqliteStore)
        release, held = await _worker_held(store)
        tasks = [asyncio.create_task(write()) for write in writes]
        await asyncio.sleep(0.01)
        assert len(store._writes) == len(writes)  # one batch
        release.set()
        await held
        answers = list(await asyncio.gather(*tasks))
    else:
        answers = [await write() for write in writes]
    since = await store.hash_since("log", "run", 0, with_hash="meta")
    return [*answers, since, await store.hash_get("log", "run", [LOG_COUNTER, b"side"]),
            await store.hash_all("meta", "old")]


async def test_one_batch_of_writes_answers_as_the_same_writes_one_by_one(store: SqliteStore) -> None:
    expected = await _one_batch_of_writes(MemoryStore(), hold=False)
    assert await _one_batch_of_writes(store, hold=True) == expected
    _assert_sizes_exact(store.path)


async def test_one_batch_of_writes_inline_answers_as_the_same_writes_one_by_one(inline: SqliteStore) -> None:
    expected = await _one_batch_of_writes(MemoryStore(), hold=False)
    assert await _one_batch_of_writes(inline, hold=False) == expected


async def test_a_batch_commits_on_the_event_loops_thread(inline: SqliteStore,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _threads_applying(monkeypatch)
    appends = [inline.hash_append("log", "run", b"entry %d" % i, ttl=60.0, weight=1, also=("meta", {b"u": b"1"}))
               for i in range(5)]
    assert sorted(await asyncio.gather(*appends)) == [1, 2, 3, 4, 5]
    assert threads == [threading.get_ident()]  # one batch, no thread hop
    assert sorted(v for f, v in _log(inline.path, "run").items() if f != LOG_COUNTER) == [
        b"entry %d" % i for i in range(5)]


@pytest.mark.parametrize("switch", ["argument", "environment"])
async def test_the_same_batch_commits_on_the_worker_when_inline_writes_are_off(
        switch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `inline_writes=False`, or the operator's escape hatch ENVELOPE_SQLITE_INLINE=0 (README).
    if switch == "environment":
        monkeypatch.setenv("ENVELOPE_SQLITE_INLINE", "0")
        store = SqliteStore(tmp_path / "state.db", timeout=10.0)
    else:
        store = SqliteStore(tmp_path / "state.db", timeout=10.0, inline_writes=False)
    try:
        await store.ping()
        threads = _threads_applying(monkeypatch)
        assert await store.hash_append("log", "run", b"x", ttl=60.0) == 1
        assert threads and threading.get_ident() not in threads
    finally:
        await store.close()


async def test_inline_writes_are_on_unless_the_environment_turns_them_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENVELOPE_SQLITE_INLINE", raising=False)
    assert SqliteStore(tmp_path / "a.db", timeout=1.0).inline_writes
    monkeypatch.setenv("ENVELOPE_SQLITE_INLINE", "0")
    assert not SqliteStore(tmp_path / "b.db", timeout=1.0).inline_writes


async def test_large_batches_commit_on_the_worker(inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _threads_applying(monkeypatch)
    assert await inline.hash_append("log", "big", b"x" * (INLINE_WRITE_BYTES + 1), ttl=60.0) == 1
    many = [inline.hash_append("log", "many", b"e", ttl=60.0) for _ in range(INLINE_WRITES + 1)]
    assert sorted(await asyncio.gather(*many)) == list(range(1, INLINE_WRITES + 2))
    assert len(threads) == 2 and threading.get_ident() not in threads
    assert await inline.hash_append("log", "big", b"small", ttl=60.0) == 2
    assert threads[-1] == threading.get_ident()


@pytest.mark.parametrize("held", ["briefly", "long"])
async def test_a_batch_meeting_a_held_write_lock_is_committed_once_and_in_order(
        held: str, inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # Briefly (a checkpoint's RESTART holds the write lock for tens of ms): the batch is tried
    # again on the loop, and the worker stays free for reads meanwhile (it used to wait for the
    # lock there). Long (another process), past the loop's patience: the worker takes it.
    on_loop = held == "briefly"
    monkeypatch.setattr(sqlite_module, "_LOCK_PATIENCE", 60.0 if on_loop else 0.0)
    threads = _threads_applying(monkeypatch)
    other = sqlite3.connect(inline.path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # as a checkpoint or another process would
        first = asyncio.create_task(inline.hash_append("log", "run", b"a", ttl=60.0, also=("meta", {b"u": b"1"})))
        await asyncio.sleep(0.05)
        assert not first.done()  # waiting, not refused, not committed
        if on_loop:
            assert await asyncio.wait_for(inline.hash_all("meta", "run"), 5.0) == {}  # the worker answers
        # A later batch follows the first, never overtakes it.
        second = asyncio.create_task(inline.hash_append("log", "run", b"b", ttl=60.0))
        await asyncio.sleep(0.05)
        assert not second.done()
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert await first == 1 and await second == 2
    if on_loop:
        assert threads and set(threads) == {threading.get_ident()}
    else:
        assert len(threads) == 2 and threading.get_ident() not in threads
    assert _log(inline.path, "run") == {LOG_COUNTER: b"2 0", log_field(1): b"a", log_field(2): b"b"}
    # And the loop commits the next batch itself.
    assert await inline.hash_append("log", "run", b"c", ttl=60.0) == 3
    assert threads[-1] == threading.get_ident()


class _Tracked(sqlite3.Connection):
    """A connection that remembers being closed."""

    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


async def test_a_loop_connection_that_cannot_be_set_up_is_closed_and_its_batch_goes_to_the_worker(
        inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _threads_applying(monkeypatch)
    opened: list[_Tracked] = []
    real_connect = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real_connect(*args, factory=_Tracked, **kwargs)
        opened.append(conn)
        return conn

    monkeypatch.setattr(sqlite_module.sqlite3, "connect", connect)
    pragmas = inline._loop_writer.pragmas
    # A pragma that fails (as one may on a file the loop's connection cannot set up).
    monkeypatch.setattr(inline._loop_writer, "pragmas", (*pragmas, "SELECT no_such_function()"))
    assert await inline.hash_append("log", "run", b"a", ttl=60.0) == 1
    assert threads and threading.get_ident() not in threads  # committed, by the worker
    assert [conn.closed for conn in opened] == [True]  # closed, not left open
    assert inline._loop_writer.conn is None
    # The next batch tries again, and once the connection sets up the loop commits.
    monkeypatch.setattr(inline._loop_writer, "pragmas", pragmas)
    assert await inline.hash_append("log", "run", b"b", ttl=60.0) == 2
    assert threads[-1] == threading.get_ident()
    assert inline._loop_writer.conn is opened[-1] and not opened[-1].closed
    assert _log(inline.path, "run") == {LOG_COUNTER: b"2 0", log_field(1): b"a", log_field(2): b"b"}


async def test_reads_and_writes_are_answered_while_a_checkpoint_is_under_way(
        inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint takes tens of ms: on the worker, every read queued behind it waited.
    monkeypatch.setattr(sqlite_module, "CHECKPOINT_COMMITS", 2)
    started, release = threading.Event(), threading.Event()
    real = SqliteStore._checkpoint

    def held(self: SqliteStore) -> None:
        started.set()
        release.wait(10.0)
        real(self)

    monkeypatch.setattr(SqliteStore, "_checkpoint", held)
    try:
        for i in range(2):
            assert await inline.hash_append("log", "run", b"e%d" % i, ttl=60.0) == i + 1
        assert await asyncio.to_thread(started.wait, 5.0)  # the checkpoint is under way, held
        assert len(await asyncio.wait_for(inline.hash_all("log", "run"), 5.0)) == 3
        assert await asyncio.wait_for(inline.hash_append("log", "run", b"e2", ttl=60.0), 5.0) == 3
    finally:
        release.set()


class _CheckpointModes:
    """A connection that notes the mode of every checkpoint it runs."""

    def __init__(self, conn: sqlite3.Connection, modes: list[str]) -> None:
        self._conn, self._modes = conn, modes

    def execute(self, sql: str, *args: Any) -> Any:
        if "wal_checkpoint" in sql:
            self._modes.append(sql.split("(")[1].rstrip(")"))
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _wal_frames(path: Path) -> int:
    """Frames in the WAL since it last started over, as another connection sees them."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return int(conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])
    finally:
        conn.close()


async def test_a_checkpoint_takes_the_write_lock_only_when_the_wal_passes_its_bound(
        inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(20):
        await inline.hash_append("log", f"run{i}", b"entry %d" % i, ttl=60.0, also=("meta", {b"u": b"1"}))
    modes: list[str] = []
    conn = sqlite3.connect(inline.path, isolation_level=None, check_same_thread=False)
    monkeypatch.setattr(inline, "_checkpoint_conn", _CheckpointModes(conn, modes))
    try:
        # Nothing committed while it copies: PASSIVE copies it all (a second pass finds nothing
        # new), no write lock is taken, and the loop's next commit starts the WAL over.
        before = _wal_frames(inline.path)
        await asyncio.to_thread(inline._checkpoint)
        assert modes and set(modes) == {"PASSIVE"}
        assert await inline.hash_append("log", "run0", b"next", ttl=60.0) == 2
        assert _wal_frames(inline.path) < before
        # Past the bound, RESTART (under the write lock) has the WAL started over.
        monkeypatch.setattr(sqlite_module, "WAL_RESTART_BYTES", 0)
        modes.clear()
        await asyncio.to_thread(inline._checkpoint)
        assert modes[-1] == "RESTART"
    finally:
        conn.close()


async def test_the_wal_stays_bounded_under_many_inline_commits(inline: SqliteStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _threads_applying(monkeypatch)
    for i in range(20_000):
        await inline.hash_append("log", "run", b"entry %d " % i + b"x" * 200, ttl=600.0, weight=1,
                                 also=("meta", {b"u": b"1"}))
    # The loop commits nearly all of them (a batch meeting the lock of the worker's purge or
    # checkpoint goes to the worker).
    assert sum(t == threading.get_ident() for t in threads) > 19_000
    # Unchecked (or with PASSIVE checkpoints only), 20,000 commits of a few 4 KB pages each leave
    # a WAL of about 300 MB; with the RESTART past `WAL_RESTART_BYTES` (32 MB), it stays under 40 MB.
    assert await asyncio.to_thread(os.path.getsize, f"{inline.path}-wal") < 64 * 1024 * 1024


class _FailingWrites:
    """A connection whose writes to `hash` fail as a full or broken disk makes them fail."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.startswith("INSERT INTO hash "):
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def test_a_failing_inline_batch_refuses_every_caller_and_keeps_nothing(
        inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = _threads_applying(monkeypatch)
    assert await inline.hash_append("log", "run", b"before", ttl=60.0) == 1
    real = inline._loop_writer.conn
    assert real is not None
    monkeypatch.setattr(inline._loop_writer, "conn", _FailingWrites(real))
    calls = [inline.hash_append("log", "run", b"one", ttl=60.0),
             inline.hash_put("meta", "run", {b"p:d2": b"1"}, ttl=60.0),
             inline.hash_append("log", "run", b"two", ttl=60.0)]
    for result, what in zip(await asyncio.gather(*calls, return_exceptions=True),
                            ("hash_append", "hash_put", "hash_append"), strict=True):
        assert isinstance(result, StoreError) and f"{what} failed: disk I/O error" in str(result)
    assert set(threads) == {threading.get_ident()}
    assert await inline.hash_all("meta", "run") == {}
    assert sorted(_log(inline.path, "run").values()) == [b"1 0", b"before"]
    monkeypatch.setattr(inline._loop_writer, "conn", real)
    assert await inline.hash_append("log", "run", b"after", ttl=60.0) == 2


class _Counted:
    """A connection that records every statement it runs (first word and table)."""

    def __init__(self, conn: sqlite3.Connection, ran: list[str]) -> None:
        self._conn, self._ran = conn, ran

    def execute(self, sql: str, *args: Any) -> Any:
        self._ran.append(sql)
        return self._conn.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> Any:
        self._ran.append(sql)
        return self._conn.executemany(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def test_a_runs_next_output_reads_nothing_its_last_batch_left(inline: SqliteStore,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A ledger records each output of a run as an append to its log with the run's flags beside
    # it; the next output's batch knows the log's meta row, counter and flags from the last one
    # (nothing else committed since): it writes, and reads nothing.
    assert await inline.hash_append("log", "run", b"one", ttl=60.0, weight=1, also=("meta", {b"u": b"1"})) == 1
    ran: list[str] = []
    real = inline._loop_writer.conn
    assert real is not None
    monkeypatch.setattr(inline._loop_writer, "conn", _Counted(real, ran))
    assert await inline.hash_append("log", "run", b"two", ttl=60.0, weight=1, also=("meta", {b"u": b"1"})) == 2
    assert [sql for sql in ran if sql.startswith("SELECT")] == []
    assert any(sql.startswith("INSERT INTO hash ") for sql in ran)
    monkeypatch.setattr(inline._loop_writer, "conn", real)
    assert _log(inline.path, "run") == {LOG_COUNTER: b"2 2", log_field(1): b"one", log_field(2): b"two"}


async def test_a_write_by_another_connection_is_read_afresh(inline: SqliteStore, tmp_path: Path) -> None:
    # Two stores on one file (two worker processes): each one's batches carry what they left,
    # but a commit by the other makes every carried row stale. Appends interleaved across both
    # must number the log without a gap or a repeat, total the weights, keep the cap and see
    # the other's flags, exactly as one store would.
    other = SqliteStore(tmp_path / "state.db", timeout=10.0, inline_writes=True)
    await other.ping()
    try:
        seqs = []
        for i in range(12):
            writer = inline if i % 3 else other
            seqs.append(await writer.hash_append("log", "run", b"e%d" % i, ttl=60.0, weight=1, cap=10,
                                                 also=("meta", {b"u": b"1", b"n": b"%d" % (i % 4)})))
        assert seqs == [*range(1, 11), 0, 0]  # the cap of 10 holds across both
        assert await inline.hash_all("meta", "run") == {b"u": b"1", b"n": b"1"}
        assert await other.hash_get("log", "run", [LOG_COUNTER]) == [b"10 10"]
        # A flag one store drops is gone for the other's next write too.
        await other.hash_delete("meta", "run", [b"n"])
        await inline.hash_put("meta", "run", {b"u": b"1"})
        assert await inline.hash_all("meta", "run") == {b"u": b"1"}
    finally:
        await other.close()
    _assert_sizes_exact(inline.path)


async def test_a_hash_that_expired_between_batches_starts_afresh(inline: SqliteStore) -> None:
    # What a batch carries includes the log's expiry: the next batch, after it passed, finds the
    # log expired and starts it over, as a store that reads it would (the memory store).
    memory = MemoryStore()
    for store in (inline, memory):
        assert await store.hash_append("log", "run", b"a", ttl=0.2, weight=1, also=("meta", {b"u": b"1"})) == 1
        assert await store.hash_append("log", "run", b"b", ttl=0.2, weight=1) == 2
    await asyncio.sleep(0.3)
    for store in (inline, memory):
        assert await store.hash_append("log", "run", b"c", ttl=60.0, weight=1, also=("meta", {b"u": b"1"})) == 1
    assert _log(inline.path, "run") == {LOG_COUNTER: b"1 1", log_field(1): b"c"}
    assert await inline.hash_since("log", "run", 0, with_hash="meta") == await memory.hash_since(
        "log", "run", 0, with_hash="meta")


async def test_what_a_long_run_carries_stays_as_small_as_its_hashes(inline: SqliteStore) -> None:
    # Each streamed call puts a pending marker in the run's flags hash and removes it after: a
    # run of many such calls must not pile up the removed markers in what is carried from batch
    # to batch (memory growing with the run's calls), only what the hash holds.
    for i in range(300):
        await inline.hash_put("meta", "run", {b"p:%d" % i: b"1"}, ttl=60.0)
        await inline.hash_append("log", "run", b"e", ttl=60.0, weight=1, also=("meta", {b"u": b"1"}),
                                 drop=[b"p:%d" % i])
    carried = inline._carried.take("meta", "run")
    assert carried is not None and carried[0] is not None and carried[0][1] == 1  # one field: u
    assert carried[2] == {b"u": b"1"}
    assert await inline.hash_all("meta", "run") == {b"u": b"1"}


async def test_a_streamed_calls_pending_marker_reads_nothing_when_the_flags_are_all_known(
        inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # A streamed call's pending marker is a new field of the run's flags hash. Once the batches
    # know every field that hash holds (as many as its size), a field not among them is absent:
    # the marker is written without reading the hash first.
    await inline.hash_append("log", "run", b"e0", ttl=60.0, weight=1, also=("meta", {b"u": b"1"}))
    ran: list[str] = []
    real = inline._loop_writer.conn
    assert real is not None
    monkeypatch.setattr(inline._loop_writer, "conn", _Counted(real, ran))
    for i in range(3):
        await inline.hash_put("meta", "run", {b"p:%d" % i: b"9"}, ttl=60.0)
        await inline.hash_append("log", "run", b"e", ttl=60.0, weight=1, also=("meta", {b"u": b"1"}),
                                 drop=[b"p:%d" % i])
    assert [sql for sql in ran if sql.startswith("SELECT")] == []
    monkeypatch.setattr(inline._loop_writer, "conn", real)
    # And what the hash holds is exactly what one store reading everything would have left.
    memory = MemoryStore()
    await memory.hash_append("log", "run", b"e0", ttl=60.0, weight=1, also=("meta", {b"u": b"1"}))
    for i in range(3):
        await memory.hash_put("meta", "run", {b"p:%d" % i: b"9"}, ttl=60.0)
        await memory.hash_append("log", "run", b"e", ttl=60.0, weight=1, also=("meta", {b"u": b"1"}),
                                 drop=[b"p:%d" % i])
    assert await inline.hash_since("log", "run", 0, with_hash="meta") == await memory.hash_since(
        "log", "run", 0, with_hash="meta")


async def test_what_is_carried_is_bounded_the_least_recently_written_dropped_first(
        inline: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs beyond CARRIED_HASHES: memory stays bounded, and a run dropped from what is carried
    # is read afresh (its next output still numbers on from the table).
    monkeypatch.setattr(sqlite_module, "CARRIED_HASHES", 4)
    for r in range(6):
        assert await inline.hash_append("log", f"run{r}", b"e", ttl=60.0, weight=1,
                                        also=("meta", {b"u": b"1"})) == 1
    assert list(inline._carried.hashes) == [("log", "run4"), ("meta", "run4"), ("log", "run5"), ("meta", "run5")]
    assert await inline.hash_append("log", "run0", b"e", ttl=60.0, weight=1, also=("meta", {b"u": b"1"})) == 2
    assert len(inline._carried.hashes) == 4
