"""Token-bucket arithmetic (`proxy.store.buckets`), exact, on a fake clock: refill, burst, the
wait reported, all-or-nothing takes, budgets that never refill; and the memory store's `take`
on the same clock."""

from __future__ import annotations

import math

import pytest

from proxy.errors import StoreError
from proxy.store.base import Bucket, Taken
from proxy.store.buckets import encode, level, take
from proxy.store.memory import MemoryStore

PER_MIN_3 = Bucket("principal/p", capacity=3, rate=3 / 60, ttl=61)  # 3/min
BURST_10 = Bucket("principal/p", capacity=10, rate=1.0, ttl=11)  # 1/s, burst 10


def test_an_absent_bucket_is_full() -> None:
    assert level(None, PER_MIN_3, 1000.0) == 3


def test_refill_follows_the_rate_and_stops_at_the_capacity() -> None:
    state = encode(0.0, 1000.0)
    assert level(state, PER_MIN_3, 1000.0) == 0
    assert level(state, PER_MIN_3, 1010.0) == pytest.approx(0.5)  # 10 s of 3/min
    assert level(state, PER_MIN_3, 1020.0) == pytest.approx(1.0)
    assert level(state, PER_MIN_3, 1060.0) == pytest.approx(3.0)
    assert level(state, PER_MIN_3, 5000.0) == 3  # never beyond the burst
    # A clock that went back (another process's) refills nothing, and takes nothing.
    assert level(encode(1.5, 1000.0), PER_MIN_3, 990.0) == 1.5


def test_burst_then_the_wait_for_the_next_token() -> None:
    states: list[bytes | None] = [None]
    granted = 0
    for _ in range(5):
        taken, writes = take(states, [PER_MIN_3], 1000.0)
        if taken.granted:
            granted += 1
            states = list(writes)
    assert granted == 3  # the burst is the rate's count
    taken, writes = take(states, [PER_MIN_3], 1000.0)
    assert taken == Taken(False, pytest.approx(20.0), 0) and writes == []  # 60 s / 3
    taken, _ = take(states, [PER_MIN_3], 1012.6)
    assert not taken.granted and taken.wait == pytest.approx(7.4)
    taken, writes = take(states, [PER_MIN_3], 1020.0)  # exactly one token refilled
    assert taken.granted
    assert level(writes[0], PER_MIN_3, 1020.0) == pytest.approx(0.0)


def test_a_burst_larger_than_the_rate() -> None:
    states: list[bytes | None] = [None]
    for _ in range(10):
        taken, writes = take(states, [BURST_10], 0.0)
        assert taken.granted
        states = list(writes)
    taken, _ = take(states, [BURST_10], 0.0)
    assert taken.wait == pytest.approx(1.0)
    # 2.5 s later: 2 calls pass, the third waits for the half token missing.
    for _ in range(2):
        taken, writes = take(states, [BURST_10], 2.5)
        assert taken.granted
        states = list(writes)
    taken, _ = take(states, [BURST_10], 2.5)
    assert not taken.granted and taken.wait == pytest.approx(0.5)


def test_float_error_never_refuses_an_exactly_refilled_token() -> None:
    bucket = Bucket("k", capacity=1, rate=0.3, ttl=4)
    # In floats these refill to just under one token (1 - 1e-16, and 1 - 2.4e-8 with a
    # wall-clock stamp); a client that waited exactly the wait reported still gets its token.
    assert 0.1 + (3.0 - 0.0) * 0.3 < 1.0
    assert take([encode(0.1, 0.0)], [bucket], 3.0)[0].granted
    stamp = 1722334455.1
    waited = stamp + take([encode(0.0, stamp)], [bucket], stamp)[0].wait
    assert level(encode(0.0, stamp), bucket, waited) < 1.0
    assert take([encode(0.0, stamp)], [bucket], waited)[0].granted


def test_all_or_nothing_and_the_longest_wait() -> None:
    principal = Bucket("principal/p", capacity=5, rate=1.0, ttl=6)
    tool = Bucket("tool/demo.echo/p", capacity=1, rate=0.1, ttl=11)
    budget = Bucket("run/r", capacity=2, rate=0.0, ttl=3600)
    taken, writes = take([None, None, None], [principal, tool, budget], 0.0)
    assert taken.granted
    assert [level(w, b, 0.0) for w, b in zip(writes, [principal, tool, budget], strict=True)] == [4, 0, 1]
    taken, writes = take(writes, [principal, tool, budget], 1.0)
    assert taken == Taken(False, pytest.approx(9.0), 1) and writes == []
    # A spent budget: the wait is forever, and it wins over any bucket.
    spent = encode(0.0, 0.0)
    taken, _ = take([encode(0.0, 0.0), spent], [tool, budget], 1.0)
    assert (taken.bucket, taken.wait) == (1, math.inf)


def test_garbage_state_is_a_store_error() -> None:
    for bad in (b"", b"1.0", b"x y", b"1.0 nope"):
        with pytest.raises(StoreError, match="principal/p"):
            level(bad, PER_MIN_3, 0.0)


async def test_memory_store_take_on_a_fake_clock() -> None:
    now = [1000.0]
    store = MemoryStore()
    store._now = lambda: now[0]
    assert [(await store.take("rate", [PER_MIN_3])).granted for _ in range(4)] == [True, True, True, False]
    now[0] += 20.0
    assert (await store.take("rate", [PER_MIN_3])).granted
    refused = await store.take("rate", [PER_MIN_3])
    assert refused == Taken(False, pytest.approx(20.0), 0)
    # The state expires `ttl` after the take that changed it: the bucket is full again.
    now[0] += PER_MIN_3.ttl
    assert await store.get("rate", PER_MIN_3.key) is None
    assert [(await store.take("rate", [PER_MIN_3])).granted for _ in range(4)] == [True, True, True, False]
    store.fail = StoreError("down")
    with pytest.raises(StoreError):
        await store.take("rate", [PER_MIN_3])
