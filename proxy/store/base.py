"""State behind one interface: memory (tests), SQLite (embedded default), Redis (replicas).

The store is a small namespaced key-value store with expiry, compare-and-set and
compare-and-delete: enough for
approvals, grants, idempotency records, shadow records and run flags, whose logic lives once
above it (never per backend). Values are bytes (the callers store JSON). Every method raises
`proxy.errors.StoreError` when the backend cannot answer: callers fail closed.

Beside the plain values, a store keeps **hashes**: a key holding many small fields (bytes ->
bytes) that are added, read and removed a few at a time, with one expiry for the whole hash and
an optional cap on its number of fields. They exist for the data-flow ledgers, whose cost must
follow the size of a call, never the size of what a run has read (Redis HSET/HMGET, SQLite rows
keyed by field), and for **logs** (`hash_append`, `hash_since`), read by sequence number. Hash keys live apart from plain keys: `delete` and `items` do not see them.

Beside them, **token buckets** (`take`): one atomic operation that takes a token from each of
a few buckets, or from none, on the backend's own clock (`give` puts one back) (`proxy.store.buckets` has the
arithmetic; Redis runs the same steps in one Lua script, SQLite in one transaction). A bucket's
state is a plain value of its namespace.

Namespaces in use: `approval`, `approval_arguments`, `approval_by_call`, `grant`, `idem`,
`idem_unknown`, `shadow`, `run`, `rate` (buckets); hashes: `approval_pending`, `grant_index`, `ledger` (a run's flags and sources), `ledger_fp` (a run's fingerprints,
one field each: ledgers written before the log), `ledger_log` (a log: one entry per recorded
output holding its sorted fingerprints).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from typing import NamedTuple, TypeVar

T = TypeVar("T")

# A log's entries are fields named by their sequence number (8 bytes, big-endian: they sort
# in order); its counter is one more field, "<last sequence number> <total weight>" in ASCII.
LOG_COUNTER = b"#"


def log_field(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def log_counter(value: bytes | None) -> tuple[int, int]:
    """(last sequence number, total weight) of a log's counter field (absent: an empty log)."""
    if value is None:
        return 0, 0
    seq, _, total = value.partition(b" ")
    return int(seq), int(total or 0)


class LogRead(NamedTuple):
    """What `hash_since` read: the log's last sequence number, the entries asked for, and the
    fields of the hash it was asked to read with them (`with_hash`; else empty)."""

    last: int
    entries: list[bytes]
    fields: dict[bytes, bytes]


class HashPut(NamedTuple):
    """What `hash_put` did: fields newly added, and fields left out because of the cap."""

    added: int
    refused: int


class Bucket(NamedTuple):
    """One token bucket of a `take`: at most `capacity` tokens (the burst), refilled at `rate`
    tokens a second (0: never refilled, a budget that only counts down). Its state lives `ttl`
    seconds after a take that changed it; an absent (or expired) bucket is full."""

    key: str
    capacity: float
    rate: float
    ttl: float


class Taken(NamedTuple):
    """What `take` did: `granted` (every bucket gave a token), or refused: `bucket`, the index of
    the bucket that needs the longest to hold a token again, and `wait`, those seconds (inf:
    never, a spent budget). Granted: `wait` 0 and `bucket` -1."""

    granted: bool
    wait: float = 0.0
    bucket: int = -1


class Store(ABC):
    """Namespaced bytes with optional expiry (seconds). Keys and namespaces are short strings."""

    #: "memory", "sqlite" or "redis" (metrics label, readiness reason)
    kind: str = "store"

    @abstractmethod
    async def get(self, ns: str, key: str) -> bytes | None:
        """The value, or None when absent or expired."""

    @abstractmethod
    async def put(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> None:
        """Set the value (replacing any), expiring after `ttl` seconds when given."""

    @abstractmethod
    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        """Set the value only when the key is absent (or expired). True when it was set."""

    @abstractmethod
    async def cas(self, ns: str, key: str, expected: bytes, value: bytes, ttl: float | None = None) -> bool:
        """Replace the value only when it currently equals `expected`. True when replaced."""

    @abstractmethod
    async def delete(self, ns: str, key: str) -> None:
        """Remove the key (no error when absent)."""

    @abstractmethod
    async def delete_if(self, ns: str, key: str, expected: bytes) -> bool:
        """Remove the key only when its value currently equals `expected` (compare-and-delete).
        True when removed; False when absent, expired or holding another value."""

    @abstractmethod
    async def items(self, ns: str, limit: int = 1000) -> list[tuple[str, bytes]]:
        """Unexpired (key, value) pairs of a namespace, at most `limit`, in no set order."""

    # -- hashes -------------------------------------------------------------------------

    @abstractmethod
    async def hash_put(self, ns: str, key: str, fields: Mapping[bytes, bytes], ttl: float | None = None,
                       *, replace: bool = True, cap: int | None = None) -> HashPut:
        """Set fields of the hash, atomically. `replace=False` keeps the value of a field that
        exists (HSETNX). With `cap`, a new field that would take the hash beyond `cap` fields is
        left out (counted in `refused`); existing fields are still replaced. With `ttl`, the
        whole hash expires `ttl` seconds after this call (also when `fields` is empty); without,
        its expiry is left as it was. An expired hash reads as empty and starts afresh."""

    @abstractmethod
    async def hash_get(self, ns: str, key: str, fields: Sequence[bytes]) -> list[bytes | None]:
        """The values of `fields` (None where absent), in order. Cost follows len(fields)."""

    @abstractmethod
    async def hash_all(self, ns: str, key: str, limit: int = 10_000) -> dict[bytes, bytes]:
        """At most `limit` fields of the hash (for small hashes: flags, markers)."""

    @abstractmethod
    async def hash_delete(self, ns: str, key: str, fields: Sequence[bytes]) -> None:
        """Remove fields (no error when absent); expiry unchanged."""

    # -- append-only hashes (logs) ----------------------------------------------------------
    #
    # A hash written only through `hash_append` is a log: each entry gets the next sequence
    # number (1, 2, ...), so a reader that holds entries up to n asks for those after n and reads
    # only what was added since (the data-flow ledger's per-process view). The log also keeps the
    # sum of its entries' weights, for a cap. It expires like any hash; one that expired starts
    # again at 1 (a reader that held n sees fewer entries than it had: `hash_since` says so).

    @abstractmethod
    async def hash_append(self, ns: str, key: str, value: bytes, ttl: float | None = None, *,
                          weight: int = 0, cap: int | None = None,
                          also: tuple[str, Mapping[bytes, bytes]] | None = None,
                          drop: Sequence[bytes] = (),
                          if_refused: Mapping[bytes, bytes] | None = None) -> int:
        """Append `value` as the log's next entry, atomically; its sequence number, or 0 when
        `weight` would take the log's total weight beyond `cap` (then nothing is written but
        the expiry). With `ttl`, the whole log expires `ttl` seconds after this call. With
        `also` (a namespace and fields), those fields of the hash `<namespace>`/`key` are set
        in the same step when the entry is appended (as `hash_put` with `ttl`: one round trip
        for a ledger's entry and its flags), and not at all when it is refused; `drop` names
        fields of that hash removed in the same step, after it is set (as `hash_delete`: a
        ledger's pending marker, cleared with the entry that records its output), and only
        when the entry is appended. With `if_refused` (fields), a refused entry sets those
        fields of `also`'s hash instead, with the same expiry, and still removes `drop` after
        them, in the same step (a ledger's flags with its overflow flag, and the marker: one
        round trip for an output the cap refuses too)."""

    @abstractmethod
    async def hash_since(self, ns: str, key: str, after: int, limit: int = 256, *,
                         with_hash: str | None = None) -> LogRead:
        """The log's last sequence number and at most `limit` entries after `after`, in order
        (a last sequence number below `after` means the log expired and started again); with
        `with_hash`, also every field of the hash `with_hash`/`key`, read at the same moment
        (one round trip: a sink check reads the run's flags and new fingerprints at once)."""

    # -- token buckets -----------------------------------------------------------------------

    @abstractmethod
    async def take(self, ns: str, buckets: Sequence[Bucket]) -> Taken:
        """Take one token from every bucket (distinct keys), atomically across processes and
        replicas: from all of them, or, when one holds less than a token, from none (nothing is
        written). Time is the backend's clock (Redis: the server's), so replicas share it."""

    @abstractmethod
    async def give(self, ns: str, bucket: Bucket) -> None:
        """Give one token back to `bucket` (a take's token that was not used), atomically across
        processes and replicas: never beyond its capacity; an absent (expired) bucket is full
        and stays absent. The bucket's expiry is kept: a token given back does not extend it."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise StoreError when the backend cannot serve (readiness)."""

    async def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release connections and files."""


async def bounded(awaitable: Awaitable[T], deadline: float) -> T:
    """`awaitable`'s result, or TimeoutError at `deadline` (the loop's time), the awaitable
    then cancelled. Unlike `asyncio.timeout`, which cancels the task that entered it, this
    cancels nothing but what it awaits: a call's completion starts eagerly in the caller's task
    and may go on in a task of its own (`proxy.envelope.outcome`), where a timeout bound to the
    caller's task would cancel the caller (its client got no reply, the call no audit record)
    and leave the store operation waiting. Every store operation's deadline goes through here."""
    future = asyncio.ensure_future(awaitable)
    expired = False

    def expire() -> None:
        nonlocal expired
        if not future.done():
            expired = True
            future.cancel()

    timer = asyncio.get_running_loop().call_at(deadline, expire)
    try:
        return await future
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if expired and (task is None or not task.cancelling()):
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()
