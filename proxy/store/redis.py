"""Redis store: state shared by several proxy replicas.

Keys are `<prefix><ns>:<key>`; expiry is Redis's own (`PX`, milliseconds, rounded up). `add` is
`SET NX PX`, `cas` and `delete_if` Lua scripts (atomic on the server), `items` a bounded
`SCAN` plus `MGET`.

Hashes are Redis hashes at `<prefix>#hash:<ns>:<key>`. No namespace starts with `#`, so a hash key
never equals a plain key nor matches the `<prefix><ns>:*` pattern of `items`, and the reverse.
`hash_put` is a Lua script (HLEN once, then HSET/HSETNX per field under the cap, PEXPIRE): atomic
for up to `_HASH_PUT_CHUNK` fields. A larger put runs as several scripts, each atomic and each
re-reading the size, so the cap holds against concurrent writers, but a reader may see a part of
the put and the expiry is set again by each part. `hash_get` is `HMGET`, `hash_delete` `HDEL`.
Redis keeps no empty hash: one emptied by `hash_delete`, or given a ttl but no field, is no key
and has no expiry, so a later put without a ttl makes a hash that does not expire (memory and
SQLite keep the earlier expiry there). A log (`hash_append`, `hash_since`) is a Redis hash read
and written by one Lua script per call; with `also` / `with_hash` the script touches a second
hash of the same key (two keys: one slot in a Cluster only with hash tags, like `take`).
`hash_since` is the warm sink check's one store call and `hash_append` the one write that
records an output before it is delivered: on a plain TCP server both are sent as `EVALSHA` on a
raw connection of their own (`proxy.store.resp.Lane`, a third of redis-py's cost per call), and
through redis-py whenever that connection cannot answer (not connected, the script not loaded,
any error reply), under the same deadline.

`take` (token buckets) is one Lua script over the buckets' plain keys, on the server's clock
(`TIME`), so every replica sees one bucket; its keys are several, so a Redis Cluster would need
them in one slot (the proxy targets one server or a replicated primary).

Failure: every operation is bounded by `timeout` seconds (socket timeouts and an overall
deadline), and any Redis error, connection error or timeout raises StoreError naming the server
URL without its password. A dropped connection is retried once, immediately, so the first call
after a server restart succeeds; the client reconnects by itself, the store needs no reopening.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from itertools import islice
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.errors import StoreError
from proxy.store.base import Bucket, HashPut, LogRead, Store, Taken, bounded
from proxy.store.resp import Lane, LaneError

T = TypeVar("T")

# KEYS[1] the key; ARGV: expected, new value, expiry in ms ("" for none). 1 when replaced.
_CAS = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[3] == '' then
    redis.call('SET', KEYS[1], ARGV[2])
  else
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  end
  return 1
end
return 0
"""

# KEYS[1] the key; ARGV[1] expected. 1 when deleted.
_DELETE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS[1] the hash; ARGV: replace ("1"/"0"), cap ("" for none), expiry in ms ("" for none), then
# field, value pairs. {added, refused}. The size is read once and counted here, never recounted.
_HASH_PUT = """
local replace = ARGV[1] == '1'
local cap = tonumber(ARGV[2])
local size = redis.call('HLEN', KEYS[1])
local added, refused = 0, 0
for i = 4, #ARGV, 2 do
  if cap == nil or size < cap then
    local new
    if replace then
      new = redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    else
      new = redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
    end
    size = size + new
    added = added + new
  elseif redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    if replace then
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    end
  else
    refused = refused + 1
  end
end
if ARGV[3] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return {added, refused}
"""

# `be(n)`: a log entry's field, `log_field` of `proxy.store.base` (8 bytes big-endian).
_LUA_BE = """
local function be(n)
  local s = ''
  for _ = 1, 8 do
    s = string.char(n % 256) .. s
    n = math.floor(n / 256)
  end
  return s
end
"""

# KEYS[1] the log, KEYS[2] (optional) a hash set with the entry; ARGV: the entry, its weight,
# cap ("" for none), expiry in ms ("" for none), the number d of the hash's fields to remove, the
# number a of field, value pairs set when the entry is appended, the number r of pairs set instead
# when it is refused (-1: the hash is then left alone), the d fields, the a pairs, the r pairs.
# The entry's sequence number, or 0 when the weight would exceed the cap. Fields as in
# `proxy.store.base` (`log_field`: 8 bytes big-endian; the counter "#": "<seq> <weight>").
_LOG_APPEND = _LUA_BE + """
local counter = redis.call('HGET', KEYS[1], '#')
local seq, total = 0, 0
if counter then
  local a, b = string.match(counter, '^(%d+) (%d+)$')
  seq, total = tonumber(a), tonumber(b)
end
local weight, cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local drop, appended, refused = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local result, first, pairs = 0, 8 + drop, appended
if cap == nil or total + weight <= cap then
  seq = seq + 1
  redis.call('HSET', KEYS[1], be(seq), ARGV[1], '#', string.format('%d %d', seq, total + weight))
  result = seq
else
  first, pairs = 8 + drop + 2 * appended, refused
end
if KEYS[2] and pairs >= 0 then
  for i = first, first + 2 * pairs - 1, 2 do
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
  if ARGV[4] ~= '' then
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
  end
  if drop > 0 then
    redis.call('HDEL', KEYS[2], unpack(ARGV, 8, 7 + drop))
  end
end
if ARGV[4] ~= '' then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return result
"""

# KEYS[1] the log, KEYS[2] (optional) a hash read with it; ARGV: after, limit. {last sequence
# number, the hash's fields and values flattened (HGETALL; empty without KEYS[2]), entries
# after `after`...}.
_LOG_SINCE = _LUA_BE + """
local counter = redis.call('HGET', KEYS[1], '#')
local last = 0
if counter then
  last = tonumber(string.match(counter, '^(%d+)'))
end
local out = {last, {}}
if KEYS[2] then
  out[2] = redis.call('HGETALL', KEYS[2])
end
local after, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
for seq = after + 1, math.min(last, after + limit) do
  out[#out + 1] = redis.call('HGET', KEYS[1], be(seq)) or ''
end
return out
"""

# KEYS: the buckets; ARGV: capacity, rate (tokens a second), expiry in ms of each bucket, in
# order. The steps of `proxy.store.buckets.take`, on the server's clock (TIME), so replicas share
# one (`_BUCKET`, the prefix of both scripts: the clock and a state's parse). {1} when granted;
# {0, bucket (1-based), wait in seconds as text ("inf": never)} when not, and then nothing is
# written. A state that is not a bucket's is an error (refused upstream).
_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- A bucket's tokens now: its state ("level stamp") refilled at rate up to cap; nil when the
-- state is not a bucket's.
local function tokens_of(state, cap, rate)
  local space = string.find(state, ' ', 1, true)
  if not space then
    return nil
  end
  local level, stamp = tonumber(string.sub(state, 1, space - 1)), tonumber(string.sub(state, space + 1))
  if not level or not stamp then
    return nil
  end
  return math.min(cap, level + math.max(0, now - stamp) * rate)
end
"""
_TAKE = _BUCKET + """
local levels = {}
local wait, which = 0, 0
for i = 1, #KEYS do
  local cap, rate = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1])
  local tokens = cap
  local state = redis.call('GET', KEYS[i])
  if state then
    tokens = tokens_of(state, cap, rate)
    if not tokens then
      return redis.error_reply('unreadable token bucket state at ' .. KEYS[i])
    end
  end
  levels[i] = tokens
  if tokens < 1 - 1e-6 then
    local needed = math.huge
    if rate > 0 then
      needed = (1 - tokens) / rate
    end
    if needed > wait then
      wait, which = needed, i
    end
  end
end
if which > 0 then
  if wait == math.huge then
    return {0, which, 'inf'}
  end
  return {0, which, string.format('%.17g', wait)}
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], string.format('%.17g %.6f', math.max(0, levels[i] - 1), now), 'PX', ARGV[3 * i])
end
return {1}
"""

# `Store.give`: one token back, capped at the capacity (ARGV[1]), the rate (ARGV[2]) refilling
# first as in _TAKE; an absent bucket is full (nothing written); the expiry is kept.
_GIVE = _BUCKET + """
local state = redis.call('GET', KEYS[1])
if not state then
  return 0
end
local cap = tonumber(ARGV[1])
local tokens = tokens_of(state, cap, tonumber(ARGV[2]))
if not tokens then
  return redis.error_reply('unreadable token bucket state at ' .. KEYS[1])
end
tokens = math.min(cap, tokens + 1)
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then
  redis.call('SET', KEYS[1], string.format('%.17g %.6f', tokens, now), 'PX', ttl)
else
  redis.call('SET', KEYS[1], string.format('%.17g %.6f', tokens, now))
end
return 1
"""

# Keys asked for per SCAN round trip (and fields per HSCAN round trip).
_SCAN_COUNT = 500

# Fields per hash_put script: one script holds the server for its whole run.
_HASH_PUT_CHUNK = 2000


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***` (for messages and logs)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparsable redis url>"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _bytes(value: bytes | str) -> bytes:
    # The client never decodes (no decode_responses); the typing allows str regardless.
    return value if isinstance(value, bytes) else value.encode()


def _px(ttl: float) -> int:
    # Rounded up, at least 1 ms: Redis refuses PX 0, and a record must not expire early.
    return max(1, math.ceil(ttl * 1000))


class RedisStore(Store):
    """One `redis.asyncio` client (a connection pool) per store."""

    kind = "redis"

    def __init__(self, url: str, prefix: str, timeout: float) -> None:
        self.url = redact_url(url)
        self.prefix = prefix
        self.timeout = timeout
        try:
            self._client = aioredis.Redis.from_url(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 1),
            )
        except (ValueError, RedisError) as exc:
            raise StoreError(f"redis store {self.url}: invalid url: {exc}") from exc
        self._cas = self._client.register_script(_CAS)
        self._delete_if = self._client.register_script(_DELETE_IF)
        self._hash_put = self._client.register_script(_HASH_PUT)
        self._log_append = self._client.register_script(_LOG_APPEND)
        self._log_since = self._client.register_script(_LOG_SINCE)
        self._take = self._client.register_script(_TAKE)
        self._give = self._client.register_script(_GIVE)
        # The warm sink check's read goes through a raw connection of its own when the server
        # is plain TCP (`proxy.store.resp`: a third of redis-py's cost per call).
        self._lane: Lane | None = None
        pool = self._client.connection_pool
        options = pool.connection_kwargs
        if pool.connection_class is aioredis.Connection and "host" in options \
                and options.get("credential_provider") is None:
            self._lane = Lane(str(options["host"]), int(options.get("port") or 6379),
                              db=int(options.get("db") or 0), username=options.get("username"),
                              password=options.get("password"))

    def _key(self, ns: str, key: str) -> str:
        return f"{self.prefix}{ns}:{key}"

    def _hash_key(self, ns: str, key: str) -> str:
        return f"{self.prefix}#hash:{ns}:{key}"

    def _timed_out(self, what: str) -> StoreError:
        return StoreError(f"redis store {self.url}: {what} timed out after {self.timeout}s")

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]], deadline: float | None = None) -> T:
        """`fn()` within the store's timeout (or by `deadline`, the loop's time); a failure or
        the timeout is StoreError."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.timeout
        try:
            return await bounded(fn(), deadline)
        except TimeoutError as exc:
            raise self._timed_out(what) from exc
        except (RedisError, OSError) as exc:
            raise StoreError(f"redis store {self.url}: {what} failed: {exc}") from exc

    async def get(self, ns: str, key: str) -> bytes | None:
        value = await self._call("get", lambda: self._client.get(self._key(ns, key)))
        return None if value is None else _bytes(value)

    async def put(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> None:
        px = None if ttl is None else _px(ttl)
        await self._call("put", lambda: self._client.set(self._key(ns, key), value, px=px))

    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        px = None if ttl is None else _px(ttl)
        done = await self._call("add", lambda: self._client.set(self._key(ns, key), value, px=px, nx=True))
        return bool(done)

    async def cas(self, ns: str, key: str, expected: bytes, value: bytes, ttl: float | None = None) -> bool:
        px = b"" if ttl is None else str(_px(ttl)).encode()
        done = await self._call(
            "cas", lambda: self._cas(keys=[self._key(ns, key)], args=[expected, value, px])
        )
        return int(done) == 1

    async def delete(self, ns: str, key: str) -> None:
        await self._call("delete", lambda: self._client.delete(self._key(ns, key)))

    async def delete_if(self, ns: str, key: str, expected: bytes) -> bool:
        done = await self._call(
            "delete_if", lambda: self._delete_if(keys=[self._key(ns, key)], args=[expected])
        )
        return int(done) == 1

    async def items(self, ns: str, limit: int = 1000) -> list[tuple[str, bytes]]:
        head = self._key(ns, "")
        match = _glob_escape(head) + "*"

        async def scan() -> list[tuple[str, bytes]]:
            keys: dict[bytes, None] = {}  # SCAN may return a key twice; keep first-seen order
            cursor: Any = 0
            while len(keys) < limit:
                cursor, batch = await self._client.scan(cursor, match=match, count=_SCAN_COUNT)
                keys.update(dict.fromkeys(_bytes(k) for k in batch))
                if int(cursor) == 0:
                    break
            names = list(keys)[: max(0, limit)]
            if not names:
                return []
            values = await self._client.mget(names)
            skip = len(head.encode())
            # A key that expired between SCAN and MGET reads as None: left out.
            return [(k[skip:].decode(), _bytes(v)) for k, v in zip(names, values, strict=True) if v is not None]

        return await self._call("items", scan)

    # ---- hashes -------------------------------------------------------------------------------

    async def hash_put(self, ns: str, key: str, fields: Mapping[bytes, bytes], ttl: float | None = None,
                       *, replace: bool = True, cap: int | None = None) -> HashPut:
        name = self._hash_key(ns, key)
        head: list[bytes] = [
            b"1" if replace else b"0",
            b"" if cap is None else str(cap).encode(),
            b"" if ttl is None else str(_px(ttl)).encode(),
        ]
        items = list(fields.items())

        async def put() -> HashPut:
            added = refused = 0
            # At least one script, so that an empty put still sets the expiry.
            for start in range(0, max(1, len(items)), _HASH_PUT_CHUNK):
                args = list(head)
                for field, value in items[start : start + _HASH_PUT_CHUNK]:
                    args += (field, value)
                done = await self._hash_put(keys=[name], args=args)
                added, refused = added + int(done[0]), refused + int(done[1])
            return HashPut(added, refused)

        return await self._call("hash_put", put)

    async def hash_append(self, ns: str, key: str, value: bytes, ttl: float | None = None, *,
                          weight: int = 0, cap: int | None = None,
                          also: tuple[str, Mapping[bytes, bytes]] | None = None,
                          drop: Sequence[bytes] = (),
                          if_refused: Mapping[bytes, bytes] | None = None) -> int:
        removed = list(drop) if also is not None else []
        fields = also[1] if also is not None else {}
        instead = if_refused if also is not None and if_refused is not None else None
        args: list[bytes] = [value, str(weight).encode(), b"" if cap is None else str(cap).encode(),
                             b"" if ttl is None else str(_px(ttl)).encode(), str(len(removed)).encode(),
                             str(len(fields)).encode(), b"-1" if instead is None else str(len(instead)).encode(),
                             *removed]
        keys = [self._hash_key(ns, key)]
        if also is not None:
            keys.append(self._hash_key(also[0], key))
            for pairs in (fields, instead or {}):
                for field, field_value in pairs.items():
                    args += (field, field_value)

        # An entry the server took before the lane's connection dropped is appended again by
        # redis-py (which also retries once on a dropped connection): the same fingerprints
        # twice, which a view holds once and the cap counts twice (the run overflows sooner,
        # never later).
        done = await self._script("hash_append", self._log_append, keys, args)
        return int(done)

    async def _script(self, what: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a registered script as `_call` does (one deadline, StoreError): over the raw RESP
        lane (EVALSHA), else through redis-py: the script not loaded (a restarted or flushed
        server), a dropped connection, any lane error, and redis-py answers (it loads the
        script, retries, maps errors) in the time left. The lane bounds its own wait (no
        `asyncio.timeout` per call: `proxy.store.resp`)."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        if self._lane is not None:
            try:
                return await self._lane.call("EVALSHA", script.sha, len(keys), *keys, *args,
                                             deadline=deadline)
            except LaneError:
                pass
            except TimeoutError as exc:
                raise self._timed_out(what) from exc
        return await self._call(what, lambda: script(keys=keys, args=args), deadline)

    async def hash_since(self, ns: str, key: str, after: int, limit: int = 256, *,
                         with_hash: str | None = None) -> LogRead:
        keys = [self._hash_key(ns, key)]
        if with_hash is not None:
            keys.append(self._hash_key(with_hash, key))
        args = [max(0, after), max(0, limit)]

        found = await self._script("hash_since", self._log_since, keys, args)
        # Bytes as read (neither client decodes replies): used as they are.
        flat = found[1]
        return LogRead(int(found[0]), found[2:], dict(zip(flat[::2], flat[1::2], strict=True)))

    async def hash_get(self, ns: str, key: str, fields: Sequence[bytes]) -> list[bytes | None]:
        if not fields:
            return []
        name = self._hash_key(ns, key)
        values = await self._call("hash_get", lambda: self._client.hmget(name, list(fields)))
        return [None if v is None else _bytes(v) for v in values]

    async def hash_all(self, ns: str, key: str, limit: int = 10_000) -> dict[bytes, bytes]:
        name = self._hash_key(ns, key)

        async def read() -> dict[bytes, bytes]:
            if limit <= 0:
                return {}
            if await self._client.hlen(name) <= limit:
                # The hash may grow between the two calls: still cut at `limit`.
                found = await self._client.hgetall(name)
                return {_bytes(f): _bytes(v) for f, v in islice(found.items(), limit)}
            out: dict[bytes, bytes] = {}
            cursor: Any = 0
            while len(out) < limit:
                cursor, batch = await self._client.hscan(name, cursor, count=_SCAN_COUNT)
                pairs = cast("dict[bytes, bytes]", batch)  # a field list only with no_values=True
                out.update((_bytes(f), _bytes(v)) for f, v in pairs.items())
                if int(cursor) == 0:
                    break
            return dict(islice(out.items(), limit))

        return await self._call("hash_all", read)

    async def hash_delete(self, ns: str, key: str, fields: Sequence[bytes]) -> None:
        if not fields:
            return
        name = self._hash_key(ns, key)
        await self._call("hash_delete", lambda: self._client.hdel(name, *fields))

    # ---- token buckets ------------------------------------------------------------------------

    async def take(self, ns: str, buckets: Sequence[Bucket]) -> Taken:
        keys = [self._key(ns, b.key) for b in buckets]
        args: list[bytes] = []
        for b in buckets:
            args += (repr(float(b.capacity)).encode(), repr(float(b.rate)).encode(), str(_px(b.ttl)).encode())
        done = await self._call("take", lambda: self._take(keys=keys, args=args))
        if int(done[0]) == 1:
            return Taken(True)
        return Taken(False, float(_bytes(done[2])), int(done[1]) - 1)

    async def give(self, ns: str, bucket: Bucket) -> None:
        args = [repr(float(bucket.capacity)).encode(), repr(float(bucket.rate)).encode()]
        await self._call("give", lambda: self._give(keys=[self._key(ns, bucket.key)], args=args))

    async def ping(self) -> None:
        """A write, not a PING: a server that answers but refuses writes (a read-only replica
        after a failover, `-OOM` at `maxmemory`) refuses every gated, keyed, limited and
        recorded call, so it is not ready either. One short-lived key per ping (`<prefix>#ready`:
        no namespace starts with `#`)."""
        await self._call("ping", lambda: self._client.set(f"{self.prefix}#ready", b"1", px=60_000))

    async def close(self) -> None:
        """Close the client's connections. Raises StoreError if that fails."""
        if self._lane is not None:
            self._lane.close()
        await self._call("close", self._client.aclose)
