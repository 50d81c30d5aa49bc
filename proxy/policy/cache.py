"""A bounded LRU for compiled policy artefacts kept across revisions (CEL programs, schemas)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """A bounded, thread-safe least-recently-used map (reloads compile in a worker thread).

    `get_or_build(key, build)` runs `build()` outside the lock: two threads may both build one
    key, and the later result wins, which is harmless for immutable compiled objects. An
    exception from `build` propagates and caches nothing (a failing expression is re-checked
    on every load, so its problems are always reported).
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return self._data[key]
            self.misses += 1
        value = build()
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return value
