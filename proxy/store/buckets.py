"""Token-bucket arithmetic of `Store.take`, shared by the memory and SQLite stores (the Redis store
runs the same steps in Lua, `proxy.store.redis._TAKE`; the store contract tests hold the three to
one behaviour).

A bucket's stored state is `b"<tokens> <time>"`: its tokens after the last take and the store
clock's time of that take. Between takes it refills at `rate` tokens a second up to `capacity`;
an absent bucket is full. A take needs one token from every bucket it names; when one holds
less, nothing changes and the wait reported is the longest any of the short buckets needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from proxy.errors import StoreError
from proxy.store.base import Bucket, Taken

# Float error must not refuse a token that has just refilled exactly: with wall-clock stamps
# (1.7e9 s) the refill of a wait computed here comes out up to ~1e-8 short of a whole token.
EPSILON = 1e-6


def level(state: bytes | None, bucket: Bucket, now: float) -> float:
    """The tokens `bucket` holds at `now`, from its stored state (None: full). A clock that went
    back (another process's, on SQLite) refills nothing. Raises StoreError on a state that is
    not a bucket's (refused, never guessed)."""
    if state is None:
        return bucket.capacity
    try:
        tokens_text, stamp_text = state.split(b" ", 1)
        tokens, stamp = float(tokens_text), float(stamp_text)
    except ValueError:
        raise StoreError(f"unreadable token bucket state at {bucket.key!r}") from None
    return min(bucket.capacity, tokens + max(0.0, now - stamp) * bucket.rate)


def encode(tokens: float, now: float) -> bytes:
    return f"{tokens!r} {now!r}".encode()


def take(states: Sequence[bytes | None], buckets: Sequence[Bucket], now: float) -> tuple[Taken, list[bytes]]:
    """What a take at `now` decides, and the states to write (one per bucket; none when
    refused)."""
    levels = [level(state, bucket, now) for state, bucket in zip(states, buckets, strict=True)]
    wait, which = 0.0, -1
    for i, (tokens, bucket) in enumerate(zip(levels, buckets, strict=True)):
        if tokens < 1.0 - EPSILON:
            needed = (1.0 - tokens) / bucket.rate if bucket.rate > 0 else math.inf
            if needed > wait:
                wait, which = needed, i
    if which >= 0:
        return Taken(False, wait, which), []
    return Taken(True), [encode(max(0.0, tokens - 1.0), now) for tokens in levels]


def give(state: bytes | None, bucket: Bucket, now: float) -> bytes | None:
    """The state of `bucket` after a token is given back at `now` (at most its capacity); None
    when it is absent (already full: nothing to write)."""
    if state is None:
        return None
    return encode(min(bucket.capacity, level(state, bucket, now) + 1.0), now)
