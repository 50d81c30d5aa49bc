"""The Store contract, run against every backend: memory, SQLite (a temp file) and Redis (a real
redis-server started here). Then what only one backend can show: SQLite shared by several
instances and processes, a locked or unusable file; Redis killed, hung and restarted."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import StoreError
from proxy.store.base import Bucket, HashPut, Store, Taken
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore
from proxy.store.resp import MAX_WAITING
from proxy.store.sqlite import SqliteStore
from tests.redis_server import RedisServer, running_redis

ROOT = Path(__file__).resolve().parents[2]
TTL = 0.2
# Every namespace in use, plain and hash: none may see another's keys.
NAMESPACES = ["approval", "approval_by_call", "grant", "idem", "shadow", "run", "rate", "ledger", "ledger_fp", "ledger_log"]

Opener = Callable[[], Store]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["memory", "sqlite", "redis"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens another handle on the same state (memory: the same instance)."""
    if request.param == "memory":
        memory = MemoryStore()
        return lambda: memory
    if request.param == "sqlite":
        path = tmp_path / "state" / "state.db"
        return lambda: SqliteStore(path, timeout=5.0)
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"test-{uuid.uuid4().hex[:8]}:"  # one server for the module, a prefix per test
    return lambda: RedisStore(server.url, prefix=prefix, timeout=5.0)


@pytest.fixture
async def stores(opener: Opener) -> AsyncIterator[list[Store]]:
    opened: list[Store] = []
    yield opened
    for store in {id(s): s for s in opened}.values():
        await store.close()


@pytest.fixture
async def store(opener: Opener, stores: list[Store]) -> Store:
    stores.append(opener())
    return stores[0]


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def until_expired(store: Store, ns: str, key: str) -> None:
    async def gone() -> bool:
        return await store.get(ns, key) is None

    await eventually(gone)


async def hold_for(seconds: float, check: Callable[[], Awaitable[bool]]) -> None:
    """`check` stays true for `seconds` (polled)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert await check()
        await asyncio.sleep(0.05)


# ---- the contract ---------------------------------------------------------------------------


async def test_get_put_replace(store: Store) -> None:
    assert await store.get("idem", "k") is None
    await store.put("idem", "k", b"\x00one\xff")
    assert await store.get("idem", "k") == b"\x00one\xff"
    await store.put("idem", "k", b"two")
    assert await store.get("idem", "k") == b"two"
    assert await store.get("shadow", "k") is None
    await store.put("idem", "with:colon/and*glob?", b"v")
    assert await store.get("idem", "with:colon/and*glob?") == b"v"
    await store.ping()


async def test_ttl_expiry(store: Store) -> None:
    await store.put("run", "short", b"v", ttl=TTL)
    await store.put("run", "long", b"v", ttl=60)
    assert await store.get("run", "short") == b"v"
    await until_expired(store, "run", "short")
    assert await store.get("run", "long") == b"v"

    # A put without ttl clears an earlier expiry.
    await store.put("run", "kept", b"v", ttl=TTL)
    await store.put("run", "kept", b"w")

    async def kept() -> bool:
        return await store.get("run", "kept") == b"w"

    await hold_for(TTL * 2, kept)


async def test_add_only_if_absent(store: Store) -> None:
    assert await store.add("approval", "a", b"first") is True
    assert await store.add("approval", "a", b"second") is False
    assert await store.get("approval", "a") == b"first"
    assert await store.add("grant", "a", b"other-ns") is True

    assert await store.add("approval", "t", b"old", ttl=TTL) is True
    assert await store.add("approval", "t", b"blocked", ttl=TTL) is False
    await until_expired(store, "approval", "t")
    assert await store.add("approval", "t", b"new") is True
    assert await store.get("approval", "t") == b"new"

    # The fresh value took no expiry from the expired one.
    async def kept() -> bool:
        return await store.get("approval", "t") == b"new"

    await hold_for(TTL * 2, kept)


async def test_cas(store: Store) -> None:
    assert await store.cas("approval", "c", b"x", b"y") is False  # absent
    assert await store.get("approval", "c") is None
    await store.put("approval", "c", b"pending")
    assert await store.cas("approval", "c", b"wrong", b"approved") is False
    assert await store.get("approval", "c") == b"pending"
    assert await store.cas("approval", "c", b"pending", b"approved") is True
    assert await store.get("approval", "c") == b"approved"

    # cas with a ttl sets the expiry; cas without one clears it.
    assert await store.cas("approval", "c", b"approved", b"expiring", ttl=TTL) is True
    await until_expired(store, "approval", "c")
    assert await store.cas("approval", "c", b"expiring", b"late") is False  # expired counts as absent
    assert await store.get("approval", "c") is None

    await store.put("approval", "d", b"1", ttl=TTL)
    assert await store.cas("approval", "d", b"1", b"2") is True

    async def kept() -> bool:
        return await store.get("approval", "d") == b"2"

    await hold_for(TTL * 2, kept)


async def test_delete(store: Store) -> None:
    await store.put("shadow", "k", b"v")
    await store.delete("shadow", "k")
    assert await store.get("shadow", "k") is None
    await store.delete("shadow", "k")  # absent: no error
    await store.delete("nothing-here", "k")
    assert await store.add("shadow", "k", b"again") is True


async def test_items(store: Store) -> None:
    for i in range(5):
        await store.put("grant", f"live-{i}", f"v{i}".encode())
    await store.put("grant", "short", b"gone", ttl=TTL)
    await store.put("granted", "other-ns", b"x")  # a namespace sharing a prefix
    await store.put("idem", "other-ns", b"x")

    assert sorted(await store.items("grant")) == sorted([("short", b"gone")] + [(f"live-{i}", f"v{i}".encode()) for i in range(5)])
    await until_expired(store, "grant", "short")
    live = sorted(await store.items("grant"))
    assert live == [(f"live-{i}", f"v{i}".encode()) for i in range(5)]

    some = await store.items("grant", limit=3)
    assert len(some) == 3 and set(some) <= set(live)
    assert await store.items("empty") == []
    assert await store.items("granted") == [("other-ns", b"x")]


async def test_concurrent_add_exactly_one_wins(opener: Opener, stores: list[Store]) -> None:
    stores.extend([opener(), opener()])  # two handles: two connections/threads where it matters
    a, b = stores
    results = await asyncio.gather(*(
        (a if i % 2 else b).add("idem", "race", f"w{i}".encode(), ttl=30) for i in range(50)
    ))
    assert results.count(True) == 1
    winner = results.index(True)
    assert await a.get("idem", "race") == f"w{winner}".encode()
    assert await b.get("idem", "race") == f"w{winner}".encode()


async def test_concurrent_cas_increments(opener: Opener, stores: list[Store]) -> None:
    stores.extend([opener(), opener()])
    a, b = stores
    await a.put("run", "counter", b"0")

    async def increment(store: Store) -> int:
        tries = 0
        while True:
            tries += 1
            current = await store.get("run", "counter")
            assert current is not None
            if await store.cas("run", "counter", current, str(int(current) + 1).encode()):
                return tries

    tries = await asyncio.gather(*(increment(a if i % 2 else b) for i in range(50)))
    assert await b.get("run", "counter") == b"50"
    assert sum(tries) >= 50


# ---- the contract: hashes --------------------------------------------------------------------


async def hash_gone(store: Store, ns: str, key: str, fields: list[bytes]) -> None:
    async def gone() -> bool:
        return await store.hash_get(ns, key, fields) == [None] * len(fields)

    await eventually(gone)


async def test_hash_put_get_in_order(store: Store) -> None:
    fields = {b"a": b"1", b"\x00b\xff": b"\x00two\xff", b"c": b"3"}
    assert await store.hash_put("ledger", "run-1", fields) == HashPut(added=3, refused=0)
    assert await store.hash_get("ledger", "run-1", [b"c", b"absent", b"a", b"\x00b\xff", b"c"]) == [
        b"3", None, b"1", b"\x00two\xff", b"3",
    ]
    assert await store.hash_get("ledger", "run-1", []) == []
    assert await store.hash_all("ledger", "run-1") == fields
    # Another key, another namespace: another hash.
    assert await store.hash_get("ledger", "run-2", [b"a"]) == [None]
    assert await store.hash_get("ledger_fp", "run-1", [b"a"]) == [None]
    assert await store.hash_all("ledger_fp", "run-1") == {}
    await store.hash_put("ledger", "with:colon/and*glob?", {b"f": b"v"})
    assert await store.hash_get("ledger", "with:colon/and*glob?", [b"f"]) == [b"v"]


async def test_hash_replace_or_keep(store: Store) -> None:
    await store.hash_put("ledger", "r", {b"a": b"1", b"b": b"1"})
    assert await store.hash_put("ledger", "r", {b"a": b"2", b"c": b"2"}) == HashPut(1, 0)
    assert await store.hash_get("ledger", "r", [b"a", b"b", b"c"]) == [b"2", b"1", b"2"]
    assert await store.hash_put("ledger", "r", {b"a": b"3", b"d": b"3"}, replace=False) == HashPut(1, 0)
    assert await store.hash_get("ledger", "r", [b"a", b"d"]) == [b"2", b"3"]  # a kept (HSETNX)
    assert await store.hash_put("ledger", "r", {b"a": b"4"}, replace=False) == HashPut(0, 0)
    assert await store.hash_all("ledger", "r") == {b"a": b"2", b"b": b"1", b"c": b"2", b"d": b"3"}


async def test_hash_cap(store: Store) -> None:
    assert await store.hash_put("ledger_fp", "r", {b"a": b"1", b"b": b"1"}, cap=3) == HashPut(2, 0)
    # At the cap: the first new field fits, the later ones are refused; an existing one is replaced.
    put = await store.hash_put("ledger_fp", "r", {b"a": b"2", b"c": b"2", b"d": b"2", b"e": b"2"}, cap=3)
    assert put == HashPut(added=1, refused=2)
    assert await store.hash_get("ledger_fp", "r", [b"a", b"b", b"c", b"d", b"e"]) == [b"2", b"1", b"2", None, None]
    assert await store.hash_all("ledger_fp", "r") == {b"a": b"2", b"b": b"1", b"c": b"2"}
    # Full: existing fields are still replaced (or kept with replace=False), nothing refused.
    assert await store.hash_put("ledger_fp", "r", {b"b": b"3"}, cap=3) == HashPut(0, 0)
    assert await store.hash_put("ledger_fp", "r", {b"c": b"3"}, cap=3, replace=False) == HashPut(0, 0)
    assert await store.hash_get("ledger_fp", "r", [b"b", b"c"]) == [b"3", b"2"]
    assert await store.hash_put("ledger_fp", "r", {b"d": b"3", b"b": b"4"}, cap=3) == HashPut(0, 1)
    assert await store.hash_get("ledger_fp", "r", [b"b", b"d"]) == [b"4", None]
    # The cap is per call: a larger one lets more in, none lets everything in.
    assert await store.hash_put("ledger_fp", "r", {b"d": b"5", b"e": b"5"}, cap=4) == HashPut(1, 1)
    assert await store.hash_put("ledger_fp", "r", {b"e": b"6"}) == HashPut(1, 0)
    assert len(await store.hash_all("ledger_fp", "r")) == 5
    assert await store.hash_put("ledger_fp", "zero", {b"a": b"1"}, cap=0) == HashPut(0, 1)
    assert await store.hash_all("ledger_fp", "zero") == {}


async def test_log_append_and_read_since(stores: list[Store], opener: Opener) -> None:
    one, two = opener(), opener()
    stores += [one, two]
    assert (await one.hash_since("ledger_log", "r", 0))[:2] == (0, [])
    # Two handles (two replicas) append to one log: sequence numbers go on from each other's.
    assert await one.hash_append("ledger_log", "r", b"a\x00", weight=2, cap=5) == 1
    assert await two.hash_append("ledger_log", "r", b"", weight=2, cap=5) == 2
    assert await one.hash_append("ledger_log", "r", b"c" * 1000, weight=0, cap=5) == 3
    # Beyond the cap on the total weight: refused, nothing written; a weight that fits still goes in.
    assert await two.hash_append("ledger_log", "r", b"d", weight=2, cap=5) == 0
    assert await two.hash_append("ledger_log", "r", b"e", weight=1, cap=5) == 4
    assert (await two.hash_since("ledger_log", "r", 0))[:2] == (4, [b"a\x00", b"", b"c" * 1000, b"e"])
    assert (await one.hash_since("ledger_log", "r", 2))[:2] == (4, [b"c" * 1000, b"e"])
    assert (await one.hash_since("ledger_log", "r", 1, limit=2))[:2] == (4, [b"", b"c" * 1000])
    assert (await one.hash_since("ledger_log", "r", 4))[:2] == (4, [])
    assert (await one.hash_since("ledger_log", "other", 0))[:2] == (0, [])
    # Sequence numbers sort as numbers past one byte (8 bytes big-endian).
    for _ in range(300):
        await one.hash_append("ledger_log", "many", b"x")
    last, found, _ = await two.hash_since("ledger_log", "many", 250, limit=1000)
    assert (last, len(found)) == (300, 50)
    # Read with a hash (the run's flags): one snapshot of both; an absent hash reads empty.
    await two.hash_put("ledger", "r", {b"u": b"1", b"src:\x00": b"untrusted|web.fetch"})
    assert await one.hash_since("ledger_log", "r", 3, with_hash="ledger") == (
        4, [b"e"], {b"u": b"1", b"src:\x00": b"untrusted|web.fetch"})
    assert await one.hash_since("ledger_log", "absent", 0, with_hash="ledger") == (0, [], {})
    assert await one.hash_since("ledger_log", "absent", 0, with_hash="ledger_fp") == (0, [], {})
    await two.hash_put("ledger", "absent", {b"u": b"1"})
    assert await one.hash_since("ledger_log", "absent", 0, with_hash="ledger") == (0, [], {b"u": b"1"})


async def test_log_append_sets_a_hash_with_the_entry(store: Store) -> None:
    flags = {b"u": b"1", b"n:32w4l": b"1"}
    assert await store.hash_append("ledger_log", "r", b"a", ttl=TTL, weight=2, cap=3, also=("ledger", flags)) == 1
    assert await store.hash_all("ledger", "r") == flags
    # Refused: the hash is left alone.
    assert await store.hash_append("ledger_log", "r", b"b", weight=2, cap=3, also=("ledger", {b"s": b"1"})) == 0
    assert await store.hash_all("ledger", "r") == flags
    # Both expire together (the ttl applies to the hash too).
    await hash_gone(store, "ledger", "r", [b"u"])
    assert (await store.hash_since("ledger_log", "r", 0))[:2] == (0, [])


async def test_log_append_removes_fields_of_the_hash_with_the_entry(store: Store) -> None:
    """`drop`: a ledger's pending marker goes in the same step as the entry recording its
    output, after the flags are set; a refused entry removes nothing."""
    await store.hash_put("ledger", "r", {b"p:d1": b"1", b"p:d2": b"2"}, ttl=TTL)
    assert await store.hash_append("ledger_log", "r", b"a", ttl=TTL, weight=2, cap=3,
                                   also=("ledger", {b"u": b"1"}), drop=[b"p:d1", b"p:absent"]) == 1
    assert await store.hash_all("ledger", "r") == {b"u": b"1", b"p:d2": b"2"}
    assert await store.hash_append("ledger_log", "r", b"b", weight=2, cap=3,
                                   also=("ledger", {b"s": b"1"}), drop=[b"p:d2"]) == 0
    assert await store.hash_all("ledger", "r") == {b"u": b"1", b"p:d2": b"2"}
    # A field set and removed in the same step is removed; the last fields removed empty the hash.
    assert await store.hash_append("ledger_log", "r", b"c", weight=1, cap=3,
                                   also=("ledger", {b"p:d2": b"3"}), drop=[b"p:d2", b"u"]) == 2
    assert await store.hash_all("ledger", "r") == {}
    assert (await store.hash_since("ledger_log", "r", 0))[:2] == (2, [b"a", b"c"])


async def test_log_append_refused_sets_the_fields_given_for_it(store: Store) -> None:
    """`if_refused`: an entry the cap refuses sets those fields instead (a ledger's flags with
    its overflow flag), with the expiry, and still removes `drop`, in the same step; an
    appended entry sets `also`'s fields and never those."""
    await store.hash_put("ledger", "r", {b"p:d1": b"1", b"p:d2": b"2"})
    assert await store.hash_append("ledger_log", "r", b"a", weight=2, cap=3, also=("ledger", {b"u": b"1"}),
                                   drop=[b"p:d1"], if_refused={b"x": b"1"}) == 1
    assert await store.hash_all("ledger", "r") == {b"u": b"1", b"p:d2": b"2"}
    assert await store.hash_append("ledger_log", "r", b"b", ttl=TTL, weight=2, cap=3,
                                   also=("ledger", {b"s": b"1"}), drop=[b"p:d2"],
                                   if_refused={b"s": b"1", b"o": b"1"}) == 0
    assert await store.hash_all("ledger", "r") == {b"u": b"1", b"s": b"1", b"o": b"1"}
    assert (await store.hash_since("ledger_log", "r", 0))[:2] == (1, [b"a"])
    # The refused step set the expiry of both.
    await hash_gone(store, "ledger", "r", [b"u", b"s", b"o"])
    assert (await store.hash_since("ledger_log", "r", 0))[:2] == (0, [])


async def test_log_expires_and_starts_again(store: Store) -> None:
    assert await store.hash_append("ledger_log", "r", b"a", ttl=TTL, weight=3, cap=3) == 1
    assert await store.hash_append("ledger_log", "r", b"b", ttl=TTL, weight=1, cap=3) == 0

    async def gone() -> bool:
        return (await store.hash_since("ledger_log", "r", 0))[:2] == (0, [])

    await eventually(gone)
    # Afresh: numbered from 1, the weight counted from zero, the old entry gone.
    assert await store.hash_append("ledger_log", "r", b"c", weight=3, cap=3) == 1
    assert (await store.hash_since("ledger_log", "r", 0))[:2] == (1, [b"c"])


async def test_hash_ttl_expires_the_whole_hash(store: Store) -> None:
    await store.hash_put("ledger", "short", {b"a": b"1", b"b": b"1"}, ttl=TTL, cap=2)
    await store.hash_put("ledger", "long", {b"a": b"1"}, ttl=60)
    assert await store.hash_get("ledger", "short", [b"a", b"b"]) == [b"1", b"1"]
    await hash_gone(store, "ledger", "short", [b"a", b"b"])
    assert await store.hash_all("ledger", "short") == {}
    assert await store.hash_get("ledger", "long", [b"a"]) == [b"1"]

    # An expired hash starts afresh: the cap counts from zero, no old field comes back, and
    # the new hash takes no expiry from the old one.
    assert await store.hash_put("ledger", "short", {b"c": b"2", b"d": b"2"}, cap=2) == HashPut(2, 0)
    assert await store.hash_all("ledger", "short") == {b"c": b"2", b"d": b"2"}

    async def kept() -> bool:
        return await store.hash_all("ledger", "short") == {b"c": b"2", b"d": b"2"}

    await hold_for(TTL * 2, kept)


async def test_hash_put_without_ttl_keeps_the_expiry(store: Store) -> None:
    await store.hash_put("ledger", "r", {b"a": b"1"}, ttl=TTL)
    await store.hash_put("ledger", "r", {b"b": b"1"})  # no ttl: the earlier expiry stays
    await store.hash_put("ledger", "r", {b"a": b"2"}, replace=False)
    await hash_gone(store, "ledger", "r", [b"a", b"b"])

    # A ttl sets the expiry again, also with no fields; a delete leaves it alone.
    await store.hash_put("ledger", "s", {b"a": b"1", b"b": b"1"}, ttl=TTL)
    assert await store.hash_put("ledger", "s", {}, ttl=60) == HashPut(0, 0)
    await store.hash_delete("ledger", "s", [b"b"])

    async def kept() -> bool:
        return await store.hash_get("ledger", "s", [b"a", b"b"]) == [b"1", None]

    await hold_for(TTL * 2, kept)
    await store.hash_put("ledger", "s", {}, ttl=TTL)
    await hash_gone(store, "ledger", "s", [b"a"])


async def test_hash_delete_frees_room_under_the_cap(store: Store) -> None:
    assert await store.hash_put("ledger_fp", "r", {b"a": b"1", b"b": b"1"}, cap=2) == HashPut(2, 0)
    assert await store.hash_put("ledger_fp", "r", {b"c": b"1"}, cap=2) == HashPut(0, 1)
    await store.hash_delete("ledger_fp", "r", [b"a", b"absent", b"a"])
    await store.hash_delete("ledger_fp", "r", [])
    await store.hash_delete("ledger_fp", "no-such-hash", [b"a"])
    assert await store.hash_get("ledger_fp", "r", [b"a", b"b"]) == [None, b"1"]
    assert await store.hash_put("ledger_fp", "r", {b"c": b"2", b"d": b"2"}, cap=2) == HashPut(1, 1)
    assert await store.hash_all("ledger_fp", "r") == {b"b": b"1", b"c": b"2"}

    # Emptied, then filled again: counts from zero.
    await store.hash_delete("ledger_fp", "r", [b"b", b"c"])
    assert await store.hash_all("ledger_fp", "r") == {}
    assert await store.hash_put("ledger_fp", "r", {b"x": b"3", b"y": b"3", b"z": b"3"}, cap=2) == HashPut(2, 1)


async def test_hash_all_limit(store: Store) -> None:
    # More fields than Redis keeps in a compact encoding, so HSCAN really pages.
    fields = {f"f{i}".encode(): f"v{i}".encode() for i in range(600)}
    await store.hash_put("ledger", "r", fields)
    assert await store.hash_all("ledger", "r") == fields
    for limit in (1, 10, 550):
        some = await store.hash_all("ledger", "r", limit=limit)
        assert len(some) == limit and some.items() <= fields.items()
    assert await store.hash_all("ledger", "r", limit=0) == {}
    assert await store.hash_all("ledger", "absent") == {}


async def test_hash_keys_apart_from_plain_keys(store: Store) -> None:
    for ns in NAMESPACES:
        await store.put(ns, "same", b"plain")
        await store.hash_put(ns, "same", {b"f": b"hash"})
        await store.hash_put(ns, "hash-only", {b"f": b"hash"})
    for ns in NAMESPACES:
        assert await store.items(ns) == [("same", b"plain")]
        assert await store.get(ns, "same") == b"plain"
        assert await store.get(ns, "hash-only") is None
        assert await store.hash_get(ns, "same", [b"f"]) == [b"hash"]

    await store.delete("ledger", "same")
    assert await store.hash_all("ledger", "same") == {b"f": b"hash"}
    await store.put("ledger", "same", b"again")
    await store.hash_delete("ledger", "same", [b"f"])
    assert await store.get("ledger", "same") == b"again"
    assert await store.hash_all("ledger", "same") == {}


async def test_concurrent_hash_put_never_exceeds_the_cap(opener: Opener, stores: list[Store]) -> None:
    stores.extend([opener(), opener()])
    a, b = stores
    cap = 50
    puts = await asyncio.gather(*(
        (a if i % 2 else b).hash_put(
            "ledger_fp", "race", {f"{i}-{j}".encode(): b"x" for j in range(7)}, ttl=30, cap=cap
        )
        for i in range(40)
    ))
    assert sum(p.added for p in puts) == cap
    assert sum(p.refused for p in puts) == 40 * 7 - cap
    assert len(await a.hash_all("ledger_fp", "race")) == cap
    assert len(await b.hash_all("ledger_fp", "race")) == cap


async def test_hash_large_put_and_get(store: Store) -> None:
    fields = {f"fp-{i:05}".encode(): f"source-{i % 7}".encode() for i in range(20_000)}
    assert await store.hash_put("ledger_fp", "big", fields, ttl=60) == HashPut(20_000, 0)
    wanted = [f"fp-{i:05}".encode() for i in range(19_999, 0, -8)]  # 2 500 present, reversed
    wanted += [f"absent-{i}".encode() for i in range(2_500)]
    values = await store.hash_get("ledger_fp", "big", wanted)
    assert len(values) == 5_000
    assert values == [fields.get(f) for f in wanted]

    # A large put under a cap: the cap holds across however many pieces the backend makes.
    more = {f"more-{i:05}".encode(): b"m" for i in range(20_000)}
    assert await store.hash_put("ledger_fp", "big", more, cap=25_000) == HashPut(5_000, 15_000)
    assert len(await store.hash_all("ledger_fp", "big", limit=100_000)) == 25_000


# ---- the contract: token buckets -------------------------------------------------------------


async def test_take_burst_then_refused_with_the_wait(store: Store) -> None:
    bucket = Bucket("principal/p", capacity=3, rate=0.5, ttl=60)  # 30/min, burst 3
    for _ in range(3):
        assert await store.take("rate", [bucket]) == Taken(True)
    refused = await store.take("rate", [bucket])
    assert (refused.granted, refused.bucket) == (False, 0)
    # One token at 0.5/s, less what refilled in the (up to 1 s, on a loaded CI) four takes.
    assert 1.0 < refused.wait <= 2.0
    # Another key, another namespace: other buckets, full.
    assert (await store.take("rate", [bucket._replace(key="principal/q")])).granted
    assert (await store.take("other", [bucket])).granted


async def test_take_refills_at_the_rate_up_to_the_capacity(store: Store) -> None:
    # 2/s: a take refills half a token only after 0.25 s, so back-to-back takes on a loaded CI
    # machine still see the bucket empty (at 10/s, 0.1 s between two takes refilled one).
    bucket = Bucket("tool/demo.echo/p", capacity=2, rate=2.0, ttl=60)
    assert (await store.take("rate", [bucket])).granted
    assert (await store.take("rate", [bucket])).granted
    refused = await store.take("rate", [bucket])
    assert not refused.granted and 0 < refused.wait <= 0.5
    await asyncio.sleep(refused.wait + 0.05)
    assert (await store.take("rate", [bucket])).granted
    # A long quiet spell (two tokens' worth and more) refills to the capacity, never beyond it.
    await asyncio.sleep(1.5)
    assert [(await store.take("rate", [bucket])).granted for _ in range(3)] == [True, True, False]


async def test_take_is_all_or_nothing(store: Store) -> None:
    small = Bucket("principal/p", capacity=1, rate=0.001, ttl=60)
    large = Bucket("tool/demo.echo/p", capacity=2, rate=0.001, ttl=60)
    assert await store.take("rate", [small, large]) == Taken(True)
    refused = await store.take("rate", [large, small])
    assert (refused.granted, refused.bucket) == (False, 1)  # the index in this take's order
    assert 990 < refused.wait <= 1000
    # The refused take charged nothing: `large` still holds the one token the first take left.
    assert (await store.take("rate", [large])).granted
    assert not (await store.take("rate", [large])).granted


async def test_take_reports_the_longest_wait(store: Store) -> None:
    slow = Bucket("slow", capacity=1, rate=0.01, ttl=600)
    fast = Bucket("fast", capacity=1, rate=1.0, ttl=60)
    budget = Bucket("run/r", capacity=1, rate=0.0, ttl=60)
    assert (await store.take("rate", [fast, slow, budget])).granted
    refused = await store.take("rate", [fast, slow])
    assert (refused.granted, refused.bucket) == (False, 1) and 90 < refused.wait <= 100
    # A spent budget never refills: it waits forever, longer than any bucket.
    refused = await store.take("rate", [fast, budget, slow])
    assert (refused.granted, refused.bucket, refused.wait) == (False, 1, float("inf"))


async def test_take_state_expires_into_a_full_bucket(store: Store) -> None:
    budget = Bucket("run/short", capacity=1, rate=0.0, ttl=TTL)
    assert (await store.take("rate", [budget])).granted
    assert not (await store.take("rate", [budget])).granted

    async def full() -> bool:
        return (await store.take("rate", [budget])).granted

    await eventually(full)  # the run's budget is new again once its state expired
    assert not (await store.take("rate", [budget])).granted


@pytest.mark.parametrize("state", [b"not a bucket", b"1.5 later", b"x 12", b"3"])
async def test_take_and_give_refuse_a_state_that_is_not_a_bucket(store: Store, state: bytes) -> None:
    await store.put("rate", "principal/garbled", state)
    garbled = Bucket("principal/garbled", capacity=5, rate=1.0, ttl=60)
    with pytest.raises(StoreError):
        await store.take("rate", [garbled])
    with pytest.raises(StoreError):
        await store.give("rate", garbled)
    assert await store.get("rate", "principal/garbled") == state


async def test_give_returns_a_token_never_beyond_the_capacity(store: Store) -> None:
    budget = Bucket("calls/run-g", capacity=2, rate=0.0, ttl=60)
    await store.give("rate", budget)  # absent: full, nothing written
    assert await store.get("rate", "calls/run-g") is None
    assert (await store.take("rate", [budget])).granted
    assert (await store.take("rate", [budget])).granted
    assert not (await store.take("rate", [budget])).granted
    await store.give("rate", budget)
    assert (await store.take("rate", [budget])).granted  # the token given back
    assert not (await store.take("rate", [budget])).granted
    await store.give("rate", budget)
    await store.give("rate", budget)
    await store.give("rate", budget)  # one more than was taken: capped at the capacity
    assert [(await store.take("rate", [budget])).granted for _ in range(3)] == [True, True, False]


async def test_give_keeps_the_expiry(store: Store) -> None:
    budget = Bucket("calls/run-short", capacity=1, rate=0.0, ttl=TTL)
    assert (await store.take("rate", [budget])).granted
    await store.give("rate", budget)
    assert (await store.take("rate", [budget])).granted

    async def gone() -> bool:
        return await store.get("rate", "calls/run-short") is None

    await eventually(gone)  # the give did not make it live on


async def test_concurrent_gives_and_takes_never_overdraw(opener: Opener, stores: list[Store]) -> None:
    stores.extend([opener(), opener()])
    a, b = stores
    budget = Bucket("calls/run-race", capacity=5, rate=0.0, ttl=60)
    assert all([(await a.take("rate", [budget])).granted for _ in range(5)])
    await asyncio.gather(*((a if i % 2 else b).give("rate", budget) for i in range(3)))
    taken = await asyncio.gather(*((a if i % 2 else b).take("rate", [budget]) for i in range(10)))
    assert sum(t.granted for t in taken) == 3


async def test_concurrent_takes_never_overdraw(opener: Opener, stores: list[Store]) -> None:
    stores.extend([opener(), opener()])  # two handles: two connections/threads where it matters
    a, b = stores
    shared = Bucket("principal/p", capacity=20, rate=0.0, ttl=60)
    own = Bucket("tool/demo.echo/p", capacity=30, rate=0.0, ttl=60)
    taken = await asyncio.gather(*((a if i % 2 else b).take("rate", [own, shared]) for i in range(60)))
    assert sum(t.granted for t in taken) == 20
    assert all(t.bucket == 1 and t.wait == float("inf") for t in taken if not t.granted)
    # The 40 refused takes charged `own` nothing: 10 of its 30 tokens are left.
    rest = await asyncio.gather(*((a if i % 2 else b).take("rate", [own]) for i in range(15)))
    assert sum(t.granted for t in rest) == 10


# ---- SQLite: one file, several instances and processes ----------------------------------------

CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    from pathlib import Path
    from proxy.store.sqlite import SqliteStore

    async def main(path, n, start_at):
        store = SqliteStore(Path(path), timeout=10.0)
        await store.ping()
        time.sleep(max(0.0, start_at - time.time()))
        won = await store.add("idem", "race", f"child-{n}".encode())
        await store.put("from-child", str(n), b"hello")
        seen = await store.get("from-parent", "k")
        await store.close()
        print(json.dumps({"won": won, "seen": seen.decode() if seen else None}))

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
""")


async def test_sqlite_shared_by_instances_and_processes(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "state.db"  # parent directories are created
    a, b = SqliteStore(path, timeout=10.0), SqliteStore(path, timeout=10.0)
    try:
        await a.put("from-parent", "k", b"parent")
        assert await b.get("from-parent", "k") == b"parent"
        await b.put("other", "k", b"b-wrote")
        assert await a.get("other", "k") == b"b-wrote"

        start_at = time.time() + 1.5  # after the children have imported and opened the file
        children = await _children(CHILD, path, start_at)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        ours = await asyncio.gather(a.add("idem", "race", b"parent-a"), b.add("idem", "race", b"parent-b"))
        reports = await _reports(children)

        assert [r["won"] for r in reports].count(True) + list(ours).count(True) == 1
        assert all(r["seen"] == "parent" for r in reports)
        assert sorted(k for k, _ in await a.items("from-child")) == ["0", "1", "2"]
        winner = await b.get("idem", "race")
        assert winner in {b"parent-a", b"parent-b", b"child-0", b"child-1", b"child-2"}
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        await a.close()
        await b.close()



async def _children(script: str, path: Path, start_at: float, count: int = 3) -> list[asyncio.subprocess.Process]:
    """`count` processes running `script` on the database at `path`, each told its number and
    when to start."""
    return [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, str(path), str(n), str(start_at),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
        )
        for n in range(count)
    ]


async def _reports(children: list[asyncio.subprocess.Process]) -> list[dict[str, Any]]:
    """Each child's JSON report (every child must have exited 0)."""
    outputs = await asyncio.gather(*(c.communicate() for c in children))
    for child, (_out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err.decode()
    return [json.loads(out) for out, _ in outputs]


HASH_CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    from pathlib import Path
    from proxy.store.sqlite import SqliteStore

    async def main(path, n, start_at):
        store = SqliteStore(Path(path), timeout=10.0)
        await store.ping()
        time.sleep(max(0.0, start_at - time.time()))
        added = 0
        for batch in range(10):
            fields = {f"{n}-{batch}-{j}".encode(): b"x" for j in range(20)}
            added += (await store.hash_put("ledger_fp", "race", fields, ttl=60, cap=300)).added
        await store.close()
        print(json.dumps({"added": added}))

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
""")


async def test_sqlite_hash_cap_holds_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout=10.0)
    try:
        await store.ping()
        start_at = time.time() + 1.5
        children = await _children(HASH_CHILD, path, start_at)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        ours = 0
        for batch in range(10):
            fields = {f"parent-{batch}-{j}".encode(): b"x" for j in range(20)}
            ours += (await store.hash_put("ledger_fp", "race", fields, ttl=60, cap=300)).added
        reports = await _reports(children)
        assert ours + sum(r["added"] for r in reports) == 300
        assert len(await store.hash_all("ledger_fp", "race")) == 300
        with sqlite3.connect(path) as conn:  # the kept size is the real one
            assert conn.execute("SELECT size FROM hash_meta").fetchall() == [(300,)]
            assert conn.execute("SELECT COUNT(*) FROM hash").fetchone() == (300,)
    finally:
        await store.close()


TAKE_CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    from pathlib import Path
    from proxy.store.base import Bucket
    from proxy.store.sqlite import SqliteStore

    async def main(path, n, start_at):
        store = SqliteStore(Path(path), timeout=10.0)
        await store.ping()
        time.sleep(max(0.0, start_at - time.time()))
        bucket = Bucket("run/shared", capacity=50, rate=0.0, ttl=60)
        granted = [(await store.take("rate", [bucket])).granted for _ in range(40)]
        await store.close()
        print(json.dumps({"granted": granted.count(True)}))

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
""")


async def test_sqlite_take_never_overdraws_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout=10.0)
    try:
        await store.ping()
        start_at = time.time() + 1.5
        children = await _children(TAKE_CHILD, path, start_at, count=2)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        bucket = Bucket("run/shared", capacity=50, rate=0.0, ttl=60)
        ours = [(await store.take("rate", [bucket])).granted for _ in range(40)].count(True)
        reports = await _reports(children)
        assert ours + sum(r["granted"] for r in reports) == 50  # 120 takes, 50 tokens
    finally:
        await store.close()


async def test_sqlite_purge_drops_expired_hashes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout=5.0)
    try:
        await store.hash_put("ledger", "short", {b"a": b"1", b"b": b"1"}, ttl=TTL)
        await store.hash_put("ledger", "long", {b"a": b"1"}, ttl=60)
        await hash_gone(store, "ledger", "short", [b"a", b"b"])
        store._next_purge = 0.0  # the next write purges
        await store.put("run", "k", b"v")
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT key, field FROM hash").fetchall() == [("long", b"a")]
            assert conn.execute("SELECT key, size FROM hash_meta").fetchall() == [("long", 1)]
    finally:
        await store.close()

async def test_sqlite_log_reads_on_the_loop_see_every_commit_and_expiry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm `hash_since` is answered on the event loop's thread, and skips the read while no
    connection committed (`PRAGMA data_version`): it must still see what another process or
    another connection commits, the hash read with it changing alone, and an expiry."""
    path = tmp_path / "state.db"
    store, other = SqliteStore(path, timeout=5.0), SqliteStore(path, timeout=5.0)
    worker_reads: list[str] = []
    run = store._run

    async def counted(what: str, fn: Any) -> Any:
        worker_reads.append(what)
        return await run(what, fn)

    monkeypatch.setattr(store, "_run", counted)
    try:
        assert await store.hash_append("ledger_log", "r", b"a", ttl=60, also=("ledger", {b"u": b"1"})) == 1
        worker_reads.clear()
        for _ in range(3):  # warm and quiet: answered on the loop, the worker never asked
            assert await store.hash_since("ledger_log", "r", 1, with_hash="ledger") == (1, [], {b"u": b"1"})
        assert worker_reads == []
        # Another connection (another worker or replica) appends: seen by the next read.
        assert await other.hash_append("ledger_log", "r", b"b", ttl=60) == 2
        assert await store.hash_since("ledger_log", "r", 1, with_hash="ledger") == (2, [b"b"], {b"u": b"1"})
        # The flags alone change: seen too.
        await other.hash_put("ledger", "r", {b"s": b"1"})
        assert await store.hash_since("ledger_log", "r", 2, with_hash="ledger") == (
            2, [], {b"u": b"1", b"s": b"1"})
        # Another process commits.
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", textwrap.dedent(f"""
                import asyncio
                from pathlib import Path
                from proxy.store.sqlite import SqliteStore
                async def main():
                    store = SqliteStore(Path({str(path)!r}), timeout=5.0)
                    await store.hash_append("ledger_log", "r", b"c")
                    await store.close()
                asyncio.run(main())
            """), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = await asyncio.wait_for(child.communicate(), 60)
        assert child.returncode == 0, err.decode()
        assert await store.hash_since("ledger_log", "r", 2, with_hash="ledger") == (
            3, [b"c"], {b"u": b"1", b"s": b"1"})
        assert worker_reads == []
        # More entries than the loop's thread reads go to the worker, with the same answer.
        for i in range(20):
            await other.hash_append("ledger_log", "r", b"%d" % i)
        assert await store.hash_since("ledger_log", "r", 3) == (23, [b"%d" % i for i in range(20)], {})
        assert worker_reads == ["hash_since"]
        # So does one entry larger than the loop's thread copies (a huge page's fingerprints).
        await other.hash_append("ledger_log", "r", b"z" * 70_000)
        assert await store.hash_since("ledger_log", "r", 23) == (24, [b"z" * 70_000], {})
        assert worker_reads == ["hash_since", "hash_since"]
        assert await store.hash_since("ledger_log", "r", 24) == (24, [], {})
        assert worker_reads == ["hash_since", "hash_since"]
        # Nothing commits, but the hashes expire: the next read says so.
        await other.hash_append("ledger_log", "short", b"x", ttl=TTL, also=("ledger", {b"u": b"1"}))
        assert await store.hash_since("ledger_log", "short", 1, with_hash="ledger") == (1, [], {b"u": b"1"})
        await asyncio.sleep(TTL * 1.5)
        assert await store.hash_since("ledger_log", "short", 1, with_hash="ledger") == (0, [], {})
    finally:
        await store.close()
        await other.close()
    with pytest.raises(StoreError, match="closed"):
        await store.hash_since("ledger_log", "r", 0)


async def test_sqlite_locked_file_is_a_store_error_within_timeout(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout=0.5)
    await store.put("run", "k", b"before")
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process holding the write lock
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"state\.db"):
            await store.put("run", "k", b"blocked")
        assert time.monotonic() - started < 0.5 + 4  # the timeout, not the lock, ends it (slack: a loaded CI)
        assert await store.get("run", "k") == b"before"  # WAL: readers are not blocked
        other.execute("COMMIT")
        await store.put("run", "k", b"after")
        assert await store.get("run", "k") == b"after"
    finally:
        other.close()
        await store.close()


async def test_sqlite_unusable_path_fails_on_first_use(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = SqliteStore(blocker / "sub" / "state.db", timeout=1.0)  # constructing opens nothing
    try:
        with pytest.raises(StoreError, match="a-file"):
            await store.ping()
        with pytest.raises(StoreError):
            await store.put("run", "k", b"v")
        with pytest.raises(StoreError):
            await store.get("run", "k")
    finally:
        await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.get("run", "k")


async def test_delete_if(store: Store) -> None:
    # Compare-and-delete: only the value expected goes; anything else stays as it is.
    assert await store.delete_if("idem", "k", b"unknown") is False  # absent
    await store.put("idem", "k", b"unknown", ttl=60)
    assert await store.delete_if("idem", "k", b"done") is False
    assert await store.get("idem", "k") == b"unknown"
    assert await store.delete_if("idem", "k", b"unknown") is True
    assert await store.get("idem", "k") is None
    assert await store.delete_if("idem", "k", b"unknown") is False  # already gone
    assert await store.add("idem", "k", b"again") is True  # the key is free for a new claim
    await store.put("idem", "e", b"old", ttl=TTL)
    await until_expired(store, "idem", "e")
    assert await store.delete_if("idem", "e", b"old") is False  # expired counts as absent


# ---- Redis: killed, hung, restarted -------------------------------------------------------------

OPS: list[tuple[str, Callable[[Store], Awaitable[object]]]] = [
    ("get", lambda s: s.get("run", "k")),
    ("put", lambda s: s.put("run", "k", b"v", ttl=5)),
    ("add", lambda s: s.add("run", "k2", b"v")),
    ("cas", lambda s: s.cas("run", "k", b"v", b"w")),
    ("delete", lambda s: s.delete("run", "k")),
    ("delete_if", lambda s: s.delete_if("run", "k", b"v")),
    ("items", lambda s: s.items("run")),
    ("hash_put", lambda s: s.hash_put("ledger", "k", {b"f": b"v"}, ttl=5, cap=10)),
    ("hash_get", lambda s: s.hash_get("ledger", "k", [b"f"])),
    ("hash_all", lambda s: s.hash_all("ledger", "k")),
    ("hash_delete", lambda s: s.hash_delete("ledger", "k", [b"f"])),
    ("hash_since", lambda s: s.hash_since("ledger_log", "k", 0, with_hash="ledger")),
    ("take", lambda s: s.take("rate", [Bucket("principal/p", 5, 1.0, 60)])),
    ("ping", lambda s: s.ping()),
]


async def assert_every_op_fails_fast(store: Store, limit: float) -> None:
    for name, op in OPS:
        started = time.monotonic()
        with pytest.raises(StoreError) as info:
            await asyncio.wait_for(op(store), limit + 10)  # a hang fails the test, not CI
        elapsed = time.monotonic() - started
        # The store's timeout ends it (measured: limit + 2 ms); the slack is for a loaded CI.
        assert elapsed < limit + 2, f"{name} took {elapsed:.2f}s"
        assert "redis store redis://127.0.0.1:" in str(info.value), str(info.value)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


async def test_redis_killed_then_restarted(own_redis: RedisServer) -> None:
    store = RedisStore(own_redis.url, prefix="kill:", timeout=0.5)
    try:
        await store.put("run", "k", b"v")
        assert await store.get("run", "k") == b"v"
        own_redis.kill()
        await assert_every_op_fails_fast(store, 0.5)
        own_redis.start()  # same port, empty (no persistence)
        assert await store.get("run", "k") is None
        await store.put("run", "k", b"again")
        assert await store.cas("run", "k", b"again", b"cas-ok") is True  # script reloaded
        assert await store.items("run") == [("k", b"cas-ok")]
        assert await store.hash_put("ledger", "k", {b"f": b"v"}, cap=10) == HashPut(1, 0)  # script reloaded
        assert await store.take("rate", [Bucket("principal/p", 1, 1.0, 60)]) == Taken(True)  # script reloaded
        # The warm read's own connection (`resp.Lane`) was dropped with the server: made again.
        assert await store.hash_append("ledger_log", "k", b"e", also=("ledger", {b"u": b"1"})) == 1
        assert await store.hash_since("ledger_log", "k", 0, with_hash="ledger") == (
            1, [b"e"], {b"f": b"v", b"u": b"1"})
    finally:
        await store.close()


async def test_redis_hung_server_times_out(own_redis: RedisServer) -> None:
    store = RedisStore(own_redis.url, prefix="hang:", timeout=0.5)
    try:
        await store.put("run", "k", b"v")
        await store.hash_append("ledger_log", "before", b"old", also=("ledger", {b"n": b"old"}))
        await store.hash_append("ledger_log", "after", b"new", also=("ledger", {b"n": b"new"}))
        await store.hash_since("ledger_log", "before", 0)  # the script is loaded: the lane serves
        own_redis.pause()
        try:
            await assert_every_op_fails_fast(store, 0.5)
            with pytest.raises(StoreError):
                await store.hash_since("ledger_log", "before", 0, with_hash="ledger")
        finally:
            own_redis.resume()
        # The replies to the reads that timed out arrive late on the warm read's connection
        # (`resp.Lane`), here after the next read was sent: each read gets its own answer.
        assert await store.hash_since("ledger_log", "after", 0, with_hash="ledger") == (
            1, [b"new"], {b"n": b"new"})
        await eventually(lambda: _answers(store))
        assert await store.get("run", "k") == b"v"
        assert await store.hash_since("ledger_log", "after", 0, with_hash="ledger") == (
            1, [b"new"], {b"n": b"new"})
    finally:
        await store.close()


async def _answers(store: Store) -> bool:
    try:
        await store.ping()
    except StoreError:
        return False
    return True


async def test_redis_warm_read_answers_through_its_own_connection_and_falls_back(
        own_redis: RedisServer) -> None:
    """`hash_since` (the sink check's read) goes through a raw connection (`resp.Lane`); a
    server that lost the script (SCRIPT FLUSH) or a connection the server closed is answered
    through redis-py instead, and the next read uses the raw connection again."""
    store = RedisStore(own_redis.url, prefix="lane:", timeout=2.0)
    try:
        await store.hash_append("ledger_log", "r", b"a", also=("ledger", {b"u": b"1"}))
        assert await store.hash_since("ledger_log", "r", 0, with_hash="ledger") == (1, [b"a"], {b"u": b"1"})
        assert store._lane is not None and store._lane._protocol is not None
        await store._client.script_flush()
        assert await store.hash_since("ledger_log", "r", 0, with_hash="ledger") == (1, [b"a"], {b"u": b"1"})
        await store._client.client_kill_filter(_type="normal", skipme=True)  # every other connection
        await store.hash_append("ledger_log", "r", b"b")
        assert await store.hash_since("ledger_log", "r", 1, with_hash="ledger") == (2, [b"b"], {b"u": b"1"})
        # Concurrent reads share the connection and each gets its own reply, in order.
        found = await asyncio.gather(*(store.hash_since("ledger_log", "r", i % 3) for i in range(30)))
        assert [f.entries for f in found] == [[b"a", b"b"], [b"b"], []] * 10
        protocol = store._lane._protocol
        assert protocol is not None and not protocol.lost and not protocol.waiting
        # A hung server: the replies owed are bounded (`MAX_WAITING`), then the connection goes.
        own_redis.pause()
        try:
            hung = await asyncio.gather(*(store.hash_since("ledger_log", "r", 0) for _ in range(MAX_WAITING + 1)),
                                        return_exceptions=True)
        finally:
            own_redis.resume()
        assert all(isinstance(r, StoreError) for r in hung)
        assert protocol.lost and not protocol.waiting
        assert await store.hash_since("ledger_log", "r", 1) == (2, [b"b"], {})
    finally:
        await store.close()


async def test_redis_warm_read_connection_times_out_each_call_at_its_own_deadline(
        own_redis: RedisServer) -> None:
    """The raw connection (`resp.Lane`) bounds each call itself, with one timer for the
    connection: on a hung server every caller fails at its own deadline (whatever the order
    they were sent in), and once the server answers again each later call gets its own reply."""
    store = RedisStore(own_redis.url, prefix="deadline:", timeout=2.0)
    try:
        await store.hash_append("ledger_log", "r", b"a")  # the connection is made
        lane = store._lane
        assert lane is not None
        loop = asyncio.get_running_loop()
        own_redis.pause()
        try:
            start = loop.time()

            async def hung(after: float) -> float:
                with pytest.raises(TimeoutError):
                    await lane.call("PING", deadline=start + after)
                return loop.time() - start

            took = await asyncio.gather(*(hung(after) for after in (1.5, 0.3, 0.9)))
        finally:
            own_redis.resume()
        # Each at its deadline, not at another caller's (slack: a loaded CI, under the spacing).
        for after, elapsed in zip((1.5, 0.3, 0.9), took, strict=True):
            assert after <= elapsed < after + 0.5, (after, elapsed)
        assert await lane.call("ECHO", "mine", deadline=loop.time() + 2) == b"mine"
        assert await store.hash_since("ledger_log", "r", 0) == (1, [b"a"], {})
    finally:
        await store.close()


async def test_redis_log_append_goes_through_its_own_connection_and_falls_back(
        own_redis: RedisServer) -> None:
    """`hash_append` (recording an output) is sent on the raw connection too; a server that lost
    the script or a connection the server closed is answered through redis-py, once."""
    store = RedisStore(own_redis.url, prefix="lane-append:", timeout=2.0)
    try:
        assert await store.hash_append("ledger_log", "r", b"a", ttl=60, also=("ledger", {b"u": b"1"})) == 1
        assert store._lane is not None and store._lane._protocol is not None  # made by the append
        await store._client.script_flush()
        assert await store.hash_append("ledger_log", "r", b"b", also=("ledger", {b"s": b"1"})) == 2
        await store._client.client_kill_filter(_type="normal", skipme=True)  # every other connection
        assert await store.hash_append("ledger_log", "r", b"c", weight=1, cap=1) == 3
        assert await store.hash_append("ledger_log", "r", b"d", weight=1, cap=1) == 0
        assert await store.hash_since("ledger_log", "r", 0, with_hash="ledger") == (
            3, [b"a", b"b", b"c"], {b"u": b"1", b"s": b"1"})
    finally:
        await store.close()


def test_redis_warm_read_uses_its_own_connection_under_uvloop(own_redis: RedisServer) -> None:
    """The proxy runs on uvloop, whose TCP transport is not an `asyncio.Transport` subclass:
    the raw connection must serve there too (not fall back, not fail the check)."""
    import uvloop

    async def main() -> None:
        store = RedisStore(own_redis.url, prefix="uv:", timeout=2.0)
        try:
            await store.hash_append("ledger_log", "r", b"a", also=("ledger", {b"u": b"1"}))
            await store.hash_since("ledger_log", "r", 0)  # loads the script: the lane serves next
            assert await store.hash_since("ledger_log", "r", 0, with_hash="ledger") == (1, [b"a"], {b"u": b"1"})
            lane = store._lane
            assert lane is not None and lane._protocol is not None and not lane._protocol.lost
            deadline = asyncio.get_running_loop().time() + 2.0
            assert await lane.call("PING", deadline=deadline) in (b"PONG", "PONG")
        finally:
            await store.close()

    uvloop.run(main())


async def test_redis_error_message_hides_password(own_redis: RedisServer) -> None:
    store = RedisStore(f"redis://user:s3cret@127.0.0.1:{own_redis.port}/0", prefix="pw:", timeout=0.5)
    try:
        with pytest.raises(StoreError) as info:
            await store.ping()  # AUTH fails: the server has no such user
        assert "s3cret" not in str(info.value)
        with pytest.raises(StoreError) as info:
            await store.hash_since("ledger_log", "k", 0)  # its own connection's AUTH fails too
        assert "s3cret" not in str(info.value)
        assert f"redis://user:***@127.0.0.1:{own_redis.port}/0" in str(info.value)
    finally:
        await store.close()
