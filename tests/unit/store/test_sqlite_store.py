"""SqliteStore's group commit of hash writes (`hash_append`, `hash_put`, `hash_delete`): writes
queued while the worker is busy go in one transaction, each caller answered only once it
committed, and a batch that fails refuses every caller in it (nothing of the batch is kept)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from proxy.errors import StoreError
from proxy.store.base import LOG_COUNTER, Store, log_field
from proxy.store.memory import MemoryStore
from proxy.store.sqlite import SqliteStore


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db", timeout=10.0)
    yield opened
    await opened.close()


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
    # Every hash's meta row counts exactly the fields it has (the caps rely on it).
    conn = sqlite3.connect(store.path)
    try:
        sizes = conn.execute("SELECT m.ns, m.key, m.size, (SELECT count(*) FROM hash AS h"
                             " WHERE h.ns = m.ns AND h.key = m.key) FROM hash_meta AS m").fetchall()
    finally:
        conn.close()
    assert sizes and all(size == rows for _, _, size, rows in sizes), sizes
