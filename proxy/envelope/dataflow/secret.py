"""The pick secret: the key of the signatures by which a word of the intent picks one entry of a
trusted listing run-wide (`endorse.pick_signature_keys`).

The gate waiver relies on two entries that one word picks in two listings of a run (the user's
inbox and a folder the attacker's mail lands in) having different signatures. An unkeyed hash
of a few bits lets the attacker, who writes the second entry, grind a collision offline; keyed
with a secret the attacker never sees, a collision can only be guessed. A listing recorded by
one worker process or replica is checked by another, so the secret lives in the state store
they share: created once with an atomic set-if-absent (the first writer's wins everywhere),
then read once per process and store and cached. No operator configuration: a store that is
wiped or evicts it gets a new one, and entries recorded under the old one then differ from
those recorded under the new one (a word picks none: more escalation, never less).
"""

from __future__ import annotations

import secrets
import weakref

from proxy.envelope.dataflow.endorse import PICK_SECRET_BYTES
from proxy.errors import StoreError
from proxy.store.base import Store

NS = "dataflow"
KEY = "pick_secret"

# Per store object: a process holds one store, tests hold several (each its own backend).
_cache: weakref.WeakKeyDictionary[Store, bytes] = weakref.WeakKeyDictionary()


async def pick_secret(store: Store) -> bytes:
    """The store's pick secret, created on first use by whichever process asks first. Raises
    StoreError (or TimeoutError) when the store cannot give it, and for a value that is not a
    secret this module wrote: the caller records no picks (fail closed), never an unkeyed
    signature. Nothing is cached on failure."""
    held = _cache.get(store)
    if held is not None:
        return held
    fresh = secrets.token_bytes(PICK_SECRET_BYTES)
    if await store.add(NS, KEY, fresh):
        held = fresh
    else:
        held = await store.get(NS, KEY)
    if held is None or len(held) != PICK_SECRET_BYTES:
        # Absent right after a set-if-absent lost (expired or deleted in between), or not ours.
        raise StoreError(f"the data-flow pick secret ({NS}/{KEY}) cannot be read from the state store")
    _cache[store] = held
    return held
