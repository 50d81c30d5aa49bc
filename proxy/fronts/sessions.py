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

`SharedOwners` keeps the same binding for `/mcp/<upstream>` in the state store, so that every
worker and replica sharing it (and the process after a restart, on a persistent store) knows
whose a session is: a session another worker saw created is refused to another principal here
too. A session no proxy sharing the store saw created is relayed, and its upstream decides.

`SharedUpstreamSessions` keeps, for the aggregated `/mcp`, which upstream session each client
session uses with each upstream, so that the worker or replica taking a client session up uses
the same upstream session instead of opening its own (an upstream that keeps state per session
would otherwise see one client session split in several). The store holds it sealed (AES-GCM
under a key the workers share, bound to the entry's key): an upstream session id is a bearer
string, so a reader of the store learns none and cannot move one to another client session.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import orjson

from proxy.store.base import Store

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


NS = "sessions"
# How long the store keeps a binding: a session idle for longer, unknown in memory, is relayed as
# one no proxy saw created (its upstream decides), as every session was before the store held them.
BINDING_TTL = 7 * 24 * 3600.0


def digest(session: str) -> str:
    """What the store holds of a session id: a digest (an id is a bearer string)."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"mcp-session").hexdigest()


class SharedOwners:
    """The principal that created each session, in the state store (see the module docstring),
    and whether its client takes in-band questions (elicitation, from its `initialize`), for
    the worker that takes the session up. Keys are a digest of the session id (an id is a bearer
    string: the store holds no usable one); a value is "1" or "0" (elicitation) then the
    owner's id. Raises `StoreError` when the store cannot answer: callers refuse (fail closed)."""

    def __init__(self, store: Store, ttl: float = BINDING_TTL):
        self.store = store
        self.ttl = ttl

    @staticmethod
    def _key(upstream: str, session: str) -> str:
        return f"{upstream}/{digest(session)}"

    async def claim(self, upstream: str, session: str, owner: str, elicitation: bool = False) -> None:
        value = (b"1" if elicitation else b"0") + owner.encode("utf-8", "surrogatepass")
        await self.store.put(NS, self._key(upstream, session), value, ttl=self.ttl)

    async def binding(self, upstream: str, session: str) -> tuple[str, bool] | None:
        """(owner, whether its client takes in-band questions), or None: no proxy sharing the
        store saw the session created."""
        found = await self.store.get(NS, self._key(upstream, session))
        if not found:
            return None
        return found[1:].decode("utf-8", "surrogatepass"), found[:1] == b"1"

    async def owner(self, upstream: str, session: str) -> str | None:
        """Who created the session (None: no proxy sharing the store saw it created)."""
        bound = await self.binding(upstream, session)
        return None if bound is None else bound[0]

    async def release(self, upstream: str, session: str, owner: str) -> None:
        """Forget the binding, if it is still `owner`'s."""
        key = self._key(upstream, session)
        for flag in (b"0", b"1"):
            await self.store.delete_if(NS, key, flag + owner.encode("utf-8", "surrogatepass"))


UPSTREAM_NS = "upstream_sessions"
_NONCE = 12


@dataclass(frozen=True, slots=True)
class StoredSession:
    """What the store holds for one client session and upstream: `raw` as stored, and the
    upstream session id and revision it seals (`session_id` None: sealed under another key, by
    a proxy that shares the store but not the secret)."""

    raw: bytes
    session_id: str | None
    protocol: str = ""


class SharedUpstreamSessions:
    """The upstream session each aggregate client session uses per upstream, in the state store
    (see the module docstring). `key` is 32 bytes the workers (and replicas configured with one
    `approvals.in_band_secret_env`) share. Raises `StoreError` when the store cannot answer."""

    def __init__(self, store: Store, key: bytes, ttl: float = BINDING_TTL):
        # Imported here, not with the module: the default serve path (no aggregate) starts
        # without `cryptography` (tests/unit/app/test_startup_imports.py).
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.store = store
        self._aead = AESGCM(key)
        self._invalid: tuple[type[Exception], ...] = (InvalidTag, ValueError, TypeError)
        self.ttl = ttl

    @staticmethod
    def _key(route: str, session: str, upstream: str) -> str:
        return f"{route}/{digest(session)}/{upstream}"

    def seal(self, route: str, session: str, upstream: str, session_id: str, protocol: str) -> bytes:
        nonce = os.urandom(_NONCE)
        aad = self._key(route, session, upstream).encode("utf-8", "surrogatepass")
        return nonce + self._aead.encrypt(nonce, orjson.dumps([session_id, protocol]), aad)

    def _open(self, key: str, raw: bytes) -> StoredSession:
        try:
            plain = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], key.encode("utf-8", "surrogatepass"))
            session_id, protocol = orjson.loads(plain)
        except self._invalid:
            return StoredSession(raw, None)
        if not isinstance(session_id, str) or not isinstance(protocol, str):
            return StoredSession(raw, None)
        return StoredSession(raw, session_id, protocol)

    async def get(self, route: str, session: str, upstream: str) -> StoredSession | None:
        key = self._key(route, session, upstream)
        raw = await self.store.get(UPSTREAM_NS, key)
        return None if not raw else self._open(key, raw)

    async def claim(self, route: str, session: str, upstream: str, sealed: bytes,
                    replacing: bytes | None) -> bool:
        """Store `sealed` if the entry is still `replacing` (None: if there is none); whether it
        was stored (False: another worker stored its own first)."""
        key = self._key(route, session, upstream)
        if replacing is None:
            return await self.store.add(UPSTREAM_NS, key, sealed, ttl=self.ttl)
        return await self.store.cas(UPSTREAM_NS, key, replacing, sealed, ttl=self.ttl)

    async def forget(self, route: str, session: str, upstreams: Sequence[str]) -> None:
        for upstream in upstreams:
            await self.store.delete(UPSTREAM_NS, self._key(route, session, upstream))
