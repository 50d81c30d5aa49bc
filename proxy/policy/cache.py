"""A bounded LRU for compiled policy artefacts kept across revisions (CEL programs, schemas)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar, cast

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """A bounded, thread-safe least-recently-used map (reloads compile in a worker thread).

    `get_or_build(key, build)` runs `build()` outside the lock: two threads may both build one
    key, and the later result wins, which is harmless for immutable compiled objects. An
    exception from `build` propagates and caches nothing (a failing expression is re-checked
    on every load, so its problems are always reported).
    """

    def __init__(self, maxsize: int, weigh: Callable[[K, V], int] | None = None,
                 release: Callable[[V], None] | None = None):
        """`maxsize` bounds the entries' total weight: `weigh(key, value)`, 1 each by default.
        `release(value)` is handed each evicted value, outside the lock, as its only holder (to
        free a large one in pieces: `proxy.policy.yamlload.release_parsed`)."""
        self.maxsize = maxsize
        self._weigh = weigh
        self._release = release
        self._weights: dict[K, int] = {}
        self._total = 0
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._weights.clear()
            self._total = 0

    def _find(self, key: K) -> tuple[bool, V | None]:
        """(True, the value kept for `key`, now the most recent) or (False, None); counted."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return True, self._data[key]
            self.misses += 1
        return False, None

    def get(self, key: K) -> V | None:
        """The value kept for `key` (now the most recent), or None."""
        return self._find(key)[1]

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        found, kept = self._find(key)
        if found:
            return cast(V, kept)  # found: the kept value
        value = build()
        self.put(key, value)
        return value

    def put(self, key: K, value: V) -> None:
        """Keep `value` for `key` (replacing any), evicting the least recent beyond `maxsize`."""
        weight = self._weigh(key, value) if self._weigh is not None else 1
        evicted: list[V] = []
        with self._lock:
            self._total += weight - self._weights.get(key, 0)
            self._weights[key] = weight
            self._data[key] = value
            self._data.move_to_end(key)
            while self._total > self.maxsize and len(self._data) > 1:
                old, gone = self._data.popitem(last=False)
                self._total -= self._weights.pop(old)
                evicted.append(gone)
                del gone  # a released value's one holder is then the call below
        if self._release is not None:
            while evicted:
                self._release(evicted.pop())
