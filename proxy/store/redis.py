"""Redis store: state shared by several proxy replicas.

Keys are `<prefix><ns>:<key>`; expiry is Redis's own (`PX`, milliseconds, rounded up). `add` is
`SET NX PX`, `cas` a Lua script (atomic on the server), `items` a bounded `SCAN` plus `MGET`.

Failure: every operation is bounded by `timeout` seconds (socket timeouts and an overall
deadline), and any Redis error, connection error or timeout raises StoreError naming the server
URL without its password. A dropped connection is retried once, immediately, so the first call
after a server restart succeeds; the client reconnects by itself, the store needs no reopening.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.errors import StoreError
from proxy.store.base import Store

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

# Keys asked for per SCAN round trip.
_SCAN_COUNT = 500


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

    def _key(self, ns: str, key: str) -> str:
        return f"{self.prefix}{ns}:{key}"

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self.timeout):
                return await fn()
        except TimeoutError as exc:
            raise StoreError(f"redis store {self.url}: {what} timed out after {self.timeout}s") from exc
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

    async def ping(self) -> None:
        await self._call("ping", self._client.ping)

    async def close(self) -> None:
        """Close the client's connections. Raises StoreError if that fails."""
        await self._call("close", self._client.aclose)
