"""Fakes shared by unit tests: a clock a test moves by hand, and a MemoryStore that reads it."""

from __future__ import annotations

from proxy.store.memory import MemoryStore


class Clock:
    """A monotonic clock at 1000.0 until the test moves `now`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def clocked_store(clock: Clock) -> MemoryStore:
    """A MemoryStore whose expiries and buckets follow `clock`."""
    store = MemoryStore()
    store._now = clock
    return store
