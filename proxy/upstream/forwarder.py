"""The forwarder's transport seam: one pooled HTTP client for every upstream.

Everything upstream-bound goes through `Forwarder.open`, so the transport can be swapped (a
leaner client was measured against aiohttp's in bench/) without touching a front. Errors are
mapped at this boundary: `UpstreamTimeout` when the upstream is too slow, `UpstreamError` when
it cannot be reached or breaks the connection.

Resending
    A request written to an upstream is written again only when the caller passes
    `resend=True` (it knows the call is safe to perform twice: read-only, or a tool the
    policy declares idempotent). Without it, a connection that fails after the write (a pooled keep-alive connection
    the server closed at that very moment, a reset, EOF) raises `UpstreamError`: the request
    may or may not have been performed, and only the caller can decide what to do. A request
    that provably never left (the TCP connection could not be made) raises an error whose
    message starts with `cannot connect to upstream`, and callers may retry that whatever the
    method. The response's `attempts` (and a raised `UpstreamError.attempts`) says how many
    times the request was written: 2 means the upstream may have performed it twice.

    aiohttp by itself resends GET, HEAD, OPTIONS, TRACE, PUT and DELETE once when a connection
    breaks before the response (`ClientSession._request`, "retry_persistent_connection"); a
    per-request client middleware refuses that second send, so the resend decision is the
    caller's alone, on both transports.

Long-lived streams and caps
    A standalone GET stream may stay open for hours. `open(..., long_lived=True)` gives it a
    connection from a budget of its own per host:port (`stream_limit_per_host`), so streams
    never hold the connections calls need, however many a client opens; past the budget it
    raises `UpstreamBusy` at once. `read(limit)` refuses a body larger than `limit`
    (`ReplyTooLarge`) as soon as that is known, holding no more than `limit` bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDictProxy, MultiMapping

from proxy.errors import ReplyTooLarge, UpstreamBusy, UpstreamError, UpstreamTimeout
from proxy.upstream.urls import scrub, strip_credentials

# The setting a capped `read` names when the body is larger (callers pass theirs).
REPLY_SETTING = "limits.max_upstream_reply_bytes"


def refused_response(status: int, headers: MultiMapping[str]) -> str | None:
    """Why a response with this status and these headers is refused before its body is read
    (the caller raises `UpstreamError`; the lean transport never reuses the connection), or None.

    - 101: no Upgrade is ever sent, so what follows is no HTTP answer to the call.
    - A `Transfer-Encoding` other than `chunked` alone: the body is in a coding neither client
      undoes (llhttp frames `gzip` by the connection's end, `gzip` then `chunked` as chunked),
      and a peer that applies the coding reads other bytes than the envelope inspected.
    - A header value that is not ASCII: header values go to the client as they are (MCP sends
      non-ASCII values base64-encoded); the listeners could not write it back (the fast one
      failed with a 500) or wrote bytes nobody inspected."""
    if status == 101:
        return "switched protocols (HTTP 101) unasked"
    codings = headers.getall("Transfer-Encoding", ())
    if codings and (len(codings) > 1 or codings[0].strip().lower() != "chunked"):
        return f"sent a response in Transfer-Encoding {', '.join(codings)!r}: only chunked is read"
    for name, value in headers.items():
        if not value.isascii():
            return f"sent a {name} header value that is not ASCII"
    return None


def counted(exc: UpstreamError, attempts: int) -> UpstreamError:
    """`exc` saying how many times the request was written to the upstream."""
    exc.attempts = attempts
    return exc


class UpstreamResponse:
    """A response whose body has not been read yet; always `close()` it (or use `async with`).

    `attempts`: how many times the request was written to the upstream (2 after a resend).
    """

    __slots__ = ("_release", "_resp", "attempts", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse, attempts: int = 1,
                 release: Callable[[], None] | None = None):
        self._resp = resp
        self._release = release  # frees a long-lived stream's slot, once, on close
        self.status: int = resp.status
        self.headers: CIMultiDictProxy[str] = resp.headers
        self.attempts = attempts

    async def read(self, limit: int | None = None, setting: str = REPLY_SETTING) -> bytes:
        """The whole body; `ReplyTooLarge` (naming `setting`) as soon as it is known to be larger
        than `limit` bytes: from Content-Length before reading, else once that much arrived."""
        try:
            if limit is None:
                return await self._resp.read()
            length = self._resp.content_length
            if length is not None and length > limit:
                raise ReplyTooLarge(limit, setting)
            parts: list[bytes] = []
            size = 0
            async for chunk in self._resp.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise ReplyTooLarge(limit, setting)
                parts.append(chunk)
            return b"".join(parts)
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
        release, self._release = self._release, None
        if release is not None:
            release()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        release = getattr(self, "_release", None)
        if release is not None:  # never closed: its stream slot must not be lost
            self._release = None
            release()


class Forwarder:
    """A keep-alive connection pool shared by all upstreams of one process.

    Long-lived streams (`open(..., long_lived=True)`: standalone GET streams) never take a
    call's connection: they go through a session of their own, at most `stream_limit_per_host`
    at once per host:port, and past that are refused at once (`UpstreamBusy`), never queued.
    """

    def __init__(self, limit_per_host: int = 256, stream_limit_per_host: int = 128):
        self._limit = limit_per_host
        self._stream_limit = stream_limit_per_host
        self._session: aiohttp.ClientSession | None = None
        self._stream_session: aiohttp.ClientSession | None = None
        self._streams: dict[tuple[str, int], int] = {}  # open long-lived streams per host:port

    @staticmethod
    def _new_session(limit_per_host: int) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=limit_per_host, keepalive_timeout=30, ttl_dns_cache=60
        )
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # relay bytes as they are; we never ask for compression
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def start(self) -> None:
        self._session = self._new_session(self._limit)
        self._stream_session = self._new_session(self._stream_limit)

    async def close(self) -> None:
        for session in (self._session, self._stream_session):
            if session is not None:
                await session.close()
        self._session = self._stream_session = None
        self._streams.clear()

    def _take_stream(self, url: str) -> Callable[[], None]:
        """A long-lived stream's slot on its host (UpstreamBusy past the budget); returns what
        frees it."""
        parts = urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError as exc:
            raise counted(UpstreamError(f"invalid upstream URL {strip_credentials(url)!r}: {exc}"), 0) from exc
        key = (parts.hostname or "", port)
        if self._streams.get(key, 0) >= self._stream_limit:
            raise counted(UpstreamBusy(
                f"upstream {key[0]}:{port} already has {self._stream_limit} long-lived streams "
                "open (limits.max_upstream_streams)"), 0)
        self._streams[key] = self._streams.get(key, 0) + 1
        streams = self._streams

        def release() -> None:
            left = streams.get(key, 0) - 1
            if left > 0:
                streams[key] = left
            else:
                streams.pop(key, None)

        return release

    async def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        *,
        connect_timeout: float,
        read_timeout: float | None,
        resend: bool = False,
        long_lived: bool = False,
    ) -> UpstreamResponse:
        """Send a request and return once the status line and headers arrived.

        `read_timeout` bounds each wait for bytes (None for long-lived streams). `resend`: the
        request may be written a second time when the connection breaks before any response
        (see the module docstring); otherwise it is written at most once. The response's
        `attempts` says how many times it was written. `long_lived`: a stream that may stay
        open indefinitely (a standalone GET): it takes a slot of the streams' budget, not a
        call's connection, until the response is closed.
        Raises UpstreamError / UpstreamTimeout, with `attempts` set: 0 (and a message starting
        with `cannot connect to upstream`) when the request was never written; UpstreamBusy
        (attempts 0) when `long_lived` and the host's streams' budget is spent.
        """
        if self._session is None or self._stream_session is None:
            raise counted(UpstreamError("forwarder is not started"), 0)
        try:
            if not long_lived:
                return await self._open(self._session, method, url, headers, body,
                                        connect_timeout, read_timeout, resend)
            release = self._take_stream(url)
            try:
                resp = await self._open(self._stream_session, method, url, headers, body,
                                        connect_timeout, read_timeout, resend)
            except BaseException:
                release()
                raise
        except UpstreamError as exc:
            # aiohttp's messages quote the URL; these reach refusal reasons, audit and /readyz.
            exc.args = (scrub(str(exc), url),)
            raise
        resp._release = release
        return resp

    async def _open(self, session: aiohttp.ClientSession, method: str, url: str,
                    headers: Mapping[str, str], body: bytes | None, connect_timeout: float,
                    read_timeout: float | None, resend: bool) -> UpstreamResponse:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        attempts = 0
        first: str | None = None  # the first attempt's failure, once resending
        while True:
            sends = _OneSend()
            try:
                resp = await session.request(
                    method, url, headers=headers, data=body, timeout=timeout,
                    allow_redirects=False, compress=None, middlewares=(sends,),
                )
            except asyncio.CancelledError:
                raise
            except aiohttp.ClientConnectorError as exc:
                raise _unsent(UpstreamError(
                    f"cannot connect to upstream: {exc.os_error or exc}"), first, attempts) from exc
            except aiohttp.ConnectionTimeoutError as exc:
                raise _unsent(UpstreamTimeout(
                    f"cannot connect to upstream: no connection within {connect_timeout}s"),
                    first, attempts) from exc
            except TimeoutError as exc:
                raise counted(UpstreamTimeout(
                    f"upstream did not answer in time ({strip_credentials(url)})"), attempts + 1) from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # Written, then the connection broke before any response: resent only when
                # the caller said it may be, and only once.
                attempts += 1
                if resend and first is None:
                    first = f"upstream request failed: {exc}"
                    continue
                raise counted(UpstreamError(
                    f"upstream request failed: {exc}"), attempts) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise counted(UpstreamError(
                    f"upstream request failed: {exc}"), attempts + 1) from exc
            refused = refused_response(resp.status, resp.headers)
            if refused is not None:
                resp.close()  # and its connection, unless aiohttp pooled it on reading the end
                raise counted(UpstreamError(f"upstream {refused} ({strip_credentials(url)})"),
                              attempts + 1)
            return UpstreamResponse(resp, attempts + 1)


def _unsent(exc: UpstreamError, first: str | None, attempts: int) -> UpstreamError:
    """A connect failure: nothing written this time; but a resend's failure must not read as one
    (callers retry `cannot connect to upstream` errors whatever the method)."""
    if first is not None:
        exc = type(exc)(f"{first}; resending it failed: {exc}")
    return counted(exc, attempts)


class _OneSend:
    """aiohttp client middleware: one send per `session.request`, aiohttp's own resend refused.

    The second call (aiohttp retrying after a broken connection) raises the first send's error
    again, which aiohttp then raises to `open`, as for a method it does not resend.
    """

    __slots__ = ("error", "sent")

    def __init__(self) -> None:
        self.sent = False
        self.error: BaseException | None = None

    async def __call__(
        self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        if self.sent:
            raise self.error or aiohttp.ServerDisconnectedError()
        self.sent = True
        try:
            return await handler(request)
        except BaseException as exc:
            self.error = exc
            raise
