"""Sessions bound to the principal that created them, bounded in all and per principal.

A session id is a bearer string, never identity: whoever holds another principal's id must not
reach that session. Both MCP routes remember which principal created each session they saw
(`/mcp/<upstream>` from the relayed `initialize` answer, the aggregated `/mcp` its own sessions)
in an `OwnedLRU`, and answer a request that carries another principal's session with 404
"Session not found", exactly as for a session that does not exist.

The memory is bounded twice, so that no principal can push another's sessions out by opening
many of its own: past `max_per_owner` a principal's own least recently used session goes; past
`max_items` (many principals at once) the least recently used session of the principal holding
the most goes. Whatever is pushed out is handed back to the caller (the aggregate closes its
upstream sessions).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class OwnedLRU(Generic[K, V]):
    """A map of keys, each owned by one principal, with the two bounds above."""

    def __init__(self, max_items: int, max_per_owner: int):
        if max_items < 1 or max_per_owner < 1:
            raise ValueError("bounds must be at least 1")
        self.max_items = max_items
        self.max_per_owner = max_per_owner
        self._items: dict[K, tuple[str, V]] = {}
        # Per owner, its keys from least to most recently used.
        self._owned: dict[str, OrderedDict[K, None]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def values(self) -> Iterator[V]:
        return (value for _, value in list(self._items.values()))

    def owned(self, owner: str) -> int:
        """How many keys `owner` holds."""
        keys = self._owned.get(owner)
        return len(keys) if keys is not None else 0

    def put(self, key: K, owner: str, value: V) -> list[tuple[K, str, V]]:
        """Remember `key` as `owner`'s (replacing what it was); the entries pushed out, oldest
        first."""
        self.pop(key)
        self._items[key] = (owner, value)
        self._owned.setdefault(owner, OrderedDict())[key] = None
        evicted: list[tuple[K, str, V]] = []
        while self.owned(owner) > self.max_per_owner:
            evicted.append(self._evict(owner))
        while len(self._items) > self.max_items:
            # Only when many principals hold sessions at once: the biggest holder gives one up.
            biggest = max(self._owned, key=lambda o: len(self._owned[o]))
            evicted.append(self._evict(biggest))
        return evicted

    def get(self, key: K, touch: bool = True) -> tuple[str, V] | None:
        """(owner, value) of `key`, now its owner's most recently used unless `touch` is False;
        None when unknown."""
        found = self._items.get(key)
        if found is not None and touch:
            self._owned[found[0]].move_to_end(key)
        return found

    def owner(self, key: K) -> str | None:
        """Who created `key` (None: unknown here); counts as a use."""
        found = self.get(key)
        return found[0] if found is not None else None

    def pop(self, key: K) -> V | None:
        found = self._items.pop(key, None)
        if found is None:
            return None
        owner, value = found
        keys = self._owned[owner]
        del keys[key]
        if not keys:
            del self._owned[owner]
        return value

    def _evict(self, owner: str) -> tuple[K, str, V]:
        key = next(iter(self._owned[owner]))
        _, value = self._items[key]
        self.pop(key)
        return key, owner, value
