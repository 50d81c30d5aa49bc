"""The forwarder's transport seam: one pooled HTTP client for every upstream.

Everything upstream-bound goes through `Forwarder.open`, so the transport can be swapped (a
leaner client was measured against aiohttp's in bench/) without touching a front. Errors are
mapped at this boundary: `UpstreamTimeout` when the upstream is too slow, `UpstreamError` when
it cannot be reached or breaks the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import aiohttp
from multidict import CIMultiDictProxy

from proxy.errors import UpstreamError, UpstreamTimeout


class UpstreamResponse:
    """A response whose body has not been read yet; always `close()` it (or use `async with`)."""

    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status: int = resp.status
        self.headers: CIMultiDictProxy[str] = resp.headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream timed out while sending its response") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream broke off its response: {exc}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (no buffering beyond the socket read)."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream timed out while streaming") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream broke off the stream: {exc}") from exc

    def close(self) -> None:
        self._resp.close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Forwarder:
    """A keep-alive connection pool shared by all upstreams of one process."""

    def __init__(self, limit_per_host: int = 256):
        self._limit = limit_per_host
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self._limit, keepalive_timeout=30, ttl_dns_cache=60
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # relay bytes as they are; we never ask for compression
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        *,
        connect_timeout: float,
        read_timeout: float | None,
    ) -> UpstreamResponse:
        """Send a request and return once the status line and headers arrived.

        `read_timeout` bounds each wait for bytes (None for long-lived streams).
        Raises UpstreamError / UpstreamTimeout.
        """
        if self._session is None:
            raise UpstreamError("forwarder is not started")
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        try:
            resp = await self._session.request(
                method, url, headers=headers, data=body, timeout=timeout,
                allow_redirects=False, compress=None,
            )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"upstream did not answer in time ({url})") from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(f"cannot connect to upstream: {exc.os_error or exc}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"upstream request failed: {exc}") from exc
        except asyncio.CancelledError:
            raise
        return UpstreamResponse(resp)
