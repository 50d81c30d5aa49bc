"""In-process store: for unit tests and single-process trials. State dies with the process."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from proxy.store import buckets as arithmetic
from proxy.store.base import (
    LOG_COUNTER,
    Bucket,
    HashPut,
    LogRead,
    Store,
    Taken,
    log_counter,
    log_field,
)


class MemoryStore(Store):
    """A dict per namespace with lazy expiry. Not shared between processes."""

    kind = "memory"

    def __init__(self) -> None:
        self._data: dict[str, dict[str, tuple[bytes, float | None]]] = {}
        # ns -> key -> [fields, expiry]
        self._hashes: dict[str, dict[str, tuple[dict[bytes, bytes], list[float | None]]]] = {}
        self._now = time.monotonic
        self.fail: Exception | None = None  # tests: make every call raise this

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    def _live(self, ns: str, key: str) -> bytes | None:
        entry = self._data.get(ns, {}).get(key)
        if entry is None:
            return None
        value, expires = entry
        if expires is not None and expires <= self._now():
            del self._data[ns][key]
            return None
        return value

    def _expiry(self, ttl: float | None) -> float | None:
        return None if ttl is None else self._now() + ttl

    async def get(self, ns: str, key: str) -> bytes | None:
        self._check()
        return self._live(ns, key)

    async def put(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> None:
        self._check()
        self._data.setdefault(ns, {})[key] = (value, self._expiry(ttl))

    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        self._check()
        if self._live(ns, key) is not None:
            return False
        self._data.setdefault(ns, {})[key] = (value, self._expiry(ttl))
        return True

    async def cas(self, ns: str, key: str, expected: bytes, value: bytes, ttl: float | None = None) -> bool:
        self._check()
        if self._live(ns, key) != expected:
            return False
        self._data[ns][key] = (value, self._expiry(ttl))
        return True

    async def delete(self, ns: str, key: str) -> None:
        self._check()
        self._data.get(ns, {}).pop(key, None)

    async def delete_if(self, ns: str, key: str, expected: bytes) -> bool:
        self._check()
        if self._live(ns, key) != expected:
            return False
        del self._data[ns][key]
        return True

    async def items(self, ns: str, limit: int = 1000) -> list[tuple[str, bytes]]:
        self._check()
        out: list[tuple[str, bytes]] = []
        for key in list(self._data.get(ns, {})):
            if len(out) >= limit:
                break
            value = self._live(ns, key)
            if value is not None:
                out.append((key, value))
        return out

    def _hash(self, ns: str, key: str) -> tuple[dict[bytes, bytes], list[float | None]] | None:
        entry = self._hashes.get(ns, {}).get(key)
        if entry is not None and entry[1][0] is not None and entry[1][0] <= self._now():
            del self._hashes[ns][key]
            return None
        return entry

    async def hash_put(self, ns: str, key: str, fields: Mapping[bytes, bytes], ttl: float | None = None,
                       *, replace: bool = True, cap: int | None = None) -> HashPut:
        self._check()
        entry = self._hash(ns, key)
        if entry is None:
            entry = self._hashes.setdefault(ns, {})[key] = ({}, [None])
        values, expiry = entry
        added = refused = 0
        for field, value in fields.items():
            if field in values:
                if replace:
                    values[field] = value
            elif cap is not None and len(values) >= cap:
                refused += 1
            else:
                values[field] = value
                added += 1
        if ttl is not None:
            expiry[0] = self._expiry(ttl)
        return HashPut(added, refused)

    async def hash_get(self, ns: str, key: str, fields: Sequence[bytes]) -> list[bytes | None]:
        self._check()
        entry = self._hash(ns, key)
        values = entry[0] if entry is not None else {}
        return [values.get(f) for f in fields]

    async def hash_all(self, ns: str, key: str, limit: int = 10_000) -> dict[bytes, bytes]:
        self._check()
        entry = self._hash(ns, key)
        if entry is None:
            return {}
        return dict(list(entry[0].items())[: max(0, limit)])

    async def hash_append(self, ns: str, key: str, value: bytes, ttl: float | None = None, *,
                          weight: int = 0, cap: int | None = None,
                          also: tuple[str, Mapping[bytes, bytes]] | None = None,
                          drop: Sequence[bytes] = (),
                          if_refused: Mapping[bytes, bytes] | None = None) -> int:
        self._check()
        entry = self._hash(ns, key)
        if entry is None:
            entry = self._hashes.setdefault(ns, {})[key] = ({}, [None])
        values, expiry = entry
        seq, total = log_counter(values.get(LOG_COUNTER))
        if ttl is not None:
            expiry[0] = self._expiry(ttl)
        refused = cap is not None and total + weight > cap
        if not refused:
            seq += 1
            values[log_field(seq)] = value
            values[LOG_COUNTER] = b"%d %d" % (seq, total + weight)
        fields = if_refused if refused else also[1] if also is not None else None
        if also is not None and fields is not None:
            # One step, as on the others (no await in between: nothing interleaves).
            await MemoryStore.hash_put(self, also[0], key, fields, ttl)
            await MemoryStore.hash_delete(self, also[0], key, drop)
        return 0 if refused else seq

    async def hash_since(self, ns: str, key: str, after: int, limit: int = 256, *,
                         with_hash: str | None = None) -> LogRead:
        self._check()
        entry = self._hash(ns, key)
        values = entry[0] if entry is not None else {}
        last = log_counter(values.get(LOG_COUNTER))[0]
        end = min(last, after + max(0, limit))
        fields = {} if with_hash is None else await self.hash_all(with_hash, key)
        return LogRead(last, [values[log_field(seq)] for seq in range(max(0, after) + 1, end + 1)], fields)

    async def hash_delete(self, ns: str, key: str, fields: Sequence[bytes]) -> None:
        self._check()
        entry = self._hash(ns, key)
        if entry is not None:
            for f in fields:
                entry[0].pop(f, None)

    async def take(self, ns: str, buckets: Sequence[Bucket]) -> Taken:
        self._check()
        now = self._now()
        states = [self._live(ns, b.key) for b in buckets]
        taken, writes = arithmetic.take(states, buckets, now)
        for bucket, state in zip(buckets, writes, strict=False):  # none when refused
            self._data.setdefault(ns, {})[bucket.key] = (state, now + bucket.ttl)
        return taken

    async def give(self, ns: str, bucket: Bucket) -> None:
        self._check()
        now = self._now()
        state = arithmetic.give(self._live(ns, bucket.key), bucket, now)
        if state is not None:
            _, expires = self._data[ns][bucket.key]
            self._data[ns][bucket.key] = (state, expires)

    async def ping(self) -> None:
        self._check()
