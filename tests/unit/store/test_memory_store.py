"""MemoryStore semantics, fast and without I/O: expiry is driven by a fake clock."""

from __future__ import annotations

import pytest

from proxy.errors import StoreError
from proxy.store.memory import MemoryStore
from tests.unit.fakes import Clock, clocked_store


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> MemoryStore:
    return clocked_store(clock)


async def test_put_get_replace_and_namespaces(store: MemoryStore) -> None:
    assert await store.get("idem", "k") is None
    await store.put("idem", "k", b"1")
    await store.put("idem", "k", b"2")
    assert await store.get("idem", "k") == b"2"
    assert await store.get("shadow", "k") is None
    assert store.kind == "memory"


async def test_expiry_is_exact(store: MemoryStore, clock: Clock) -> None:
    await store.put("run", "k", b"v", ttl=10)
    clock.now += 9.999
    assert await store.get("run", "k") == b"v"
    clock.now += 0.001
    assert await store.get("run", "k") is None
    await store.put("run", "k", b"v", ttl=10)
    await store.put("run", "k", b"w")  # no ttl: the earlier expiry is gone
    clock.now += 1e6
    assert await store.get("run", "k") == b"w"


async def test_add(store: MemoryStore, clock: Clock) -> None:
    assert await store.add("approval", "a", b"1", ttl=5) is True
    assert await store.add("approval", "a", b"2") is False
    assert await store.get("approval", "a") == b"1"
    clock.now += 5
    assert await store.add("approval", "a", b"3") is True
    assert await store.get("approval", "a") == b"3"


async def test_cas(store: MemoryStore, clock: Clock) -> None:
    assert await store.cas("approval", "c", b"x", b"y") is False
    await store.put("approval", "c", b"pending", ttl=5)
    assert await store.cas("approval", "c", b"other", b"approved") is False
    assert await store.cas("approval", "c", b"pending", b"approved", ttl=100) is True
    clock.now += 50
    assert await store.get("approval", "c") == b"approved"
    clock.now += 50
    assert await store.cas("approval", "c", b"approved", b"late") is False
    assert await store.get("approval", "c") is None


async def test_delete_and_items(store: MemoryStore, clock: Clock) -> None:
    await store.delete("grant", "absent")
    for i in range(4):
        await store.put("grant", f"k{i}", b"v", ttl=1 if i == 0 else None)
    await store.put("granted", "x", b"v")
    await store.delete("grant", "k3")
    clock.now += 1
    assert sorted(k for k, _ in await store.items("grant")) == ["k1", "k2"]
    assert len(await store.items("grant", limit=1)) == 1
    assert await store.items("nothing") == []


async def test_fail_switch_raises_on_every_method(store: MemoryStore) -> None:
    store.fail = StoreError("down")
    calls = [
        store.get("n", "k"), store.put("n", "k", b""), store.add("n", "k", b""),
        store.cas("n", "k", b"", b""), store.delete("n", "k"), store.items("n"), store.ping(),
    ]
    for call in calls:
        with pytest.raises(StoreError, match="down"):
            await call
    store.fail = None
    await store.ping()
    await store.close()
