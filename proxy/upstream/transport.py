"""A lean upstream transport: raw asyncio Protocols + httptools, HTTP/1.1 over plain TCP.

`FastForwarder` is a drop-in `proxy.upstream.forwarder.Forwarder` (it subclasses it, so every front that
takes a `Forwarder` takes it unchanged) that spends ~4x less CPU per proxied request than an
aiohttp `ClientSession` (see bench/transport_bench.py). It only speaks plain `http://`; any
other URL (https://, or one carrying user:password@) is delegated to the inherited aiohttp
forwarder, so nothing is lost by switching.

Connection pool
    One keep-alive pool per (host, port), bounded by `limit_per_host` open connections (idle +
    busy). Waiting for a free slot and connecting together are bounded by `connect_timeout`.
    A connection goes back to the pool only once its response was received completely (the
    parser saw the end of the message) and both sides agreed to keep it alive; a response closed
    before that (`close()` mid-body, a cancelled task, a timeout, a parse error) aborts its
    connection. Idle connections are dropped when the server closes them (EOF / transport lost
    is noticed at once) and after `keepalive_timeout` seconds unused.

Framing
    llhttp refuses two Content-Lengths, Content-Length with Transfer-Encoding, obs-fold and bare
    LF; a response `proxy.upstream.forwarder.refused_response` refuses (another
    Transfer-Encoding, an unasked 101, a header value that is not ASCII) raises `UpstreamError`
    before `open` returns. 1xx answers before the final one are skipped. Bytes after a complete
    response (in the same read or while the connection is idle) abort the connection; once it
    carries the next request, HTTP/1.1 cannot tell them from that request's answer.

Long-lived streams
    `open(..., long_lived=True)` (standalone GET streams) never uses the pool: it opens a fresh
    connection counted against the host's `stream_limit_per_host`, refused at once with
    `UpstreamBusy` past it, and closed (never pooled) when the response is closed, which frees
    its slot. However many streams are open, calls keep their `limit_per_host` connections.

The stale keep-alive race
    A server may close an idle keep-alive connection at the very moment we send a new request
    on it. We cannot tell whether such a request was processed: an upstream that read a
    `tools/call` and then dropped the connection looks exactly the same. So a request is sent
    again only when the caller says it may be (`open(..., resend=True)`: read-only or
    idempotent calls) and the failure (write error, reset, EOF) happened on a connection
    *reused from the pool* *before a single response byte arrived*: then it is sent once more,
    on a fresh connection, and the response's `attempts` is 2. Otherwise (`resend=False`, the
    default) the caller gets `UpstreamError` with `attempts` 1: the request may have been
    performed. A failure on a fresh connection, or after any response byte, is never retried.
    A request that never left (connection refused, no connection within `connect_timeout`)
    raises `cannot connect to upstream ...` with `attempts` 0; callers retry on that prefix.

Timeouts
    `connect_timeout` bounds the wait for a pool slot plus the TCP connect; `read_timeout`
    (None: no limit) bounds each wait for bytes: for the status line and headers, then for each
    piece of the body. Expiry raises `UpstreamTimeout`; refusal, reset or EOF before the response
    is complete raise `UpstreamError` naming host:port.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from urllib.parse import quote, urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.errors import ReplyTooLarge, UpstreamBusy, UpstreamError, UpstreamTimeout
from proxy.upstream.forwarder import (
    REPLY_SETTING,
    Forwarder,
    UpstreamResponse,
    counted,
    refused_response,
)
from proxy.upstream.urls import strip_credentials

__all__ = ["FastForwarder", "FastResponse"]

# Unconsumed body bytes above which the socket stops being read until the consumer catches up.
HIGH_WATER = 1 << 20
# Request headers the transport computes itself; whatever the caller gives for them is dropped.
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
# Methods that get `Content-Length: 0` when sent without a body (as aiohttp does).
_BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"})
_URL_CACHE_MAX = 1024


class _Target:
    __slots__ = ("host", "host_header", "key", "label", "port", "target")

    def __init__(self, host: str, port: int, host_header: str, target: str):
        self.host = host
        self.port = port
        self.key = (host, port)
        self.label = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self.host_header = host_header
        self.target = target


def _parse_url(url: str) -> _Target | None:
    """Split a plain http:// URL; None when it must go through the aiohttp forwarder."""
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError as exc:
        raise UpstreamError(f"invalid upstream URL {strip_credentials(url)!r}: {exc}") from exc
    if parts.scheme.lower() != "http" or parts.username is not None or parts.password is not None:
        return None
    host = parts.hostname
    if not host:
        raise UpstreamError(f"invalid upstream URL {strip_credentials(url)!r}: no host")
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port == 80 else f"{shown}:{port}"
    path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        path += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return _Target(host, port, host_header, path)


class _Conn(asyncio.Protocol):
    """One upstream TCP connection and the parse state of the response in flight on it."""

    __slots__ = (
        "_loop", "buf", "buf_size", "busy", "closed", "complete", "exc", "got_bytes", "head_only",
        "headers", "headers_done", "idle_since", "informational", "keep_alive", "long_lived",
        "parser", "paused", "pool", "reused", "status", "transport", "until_close", "waiter",
    )

    def __init__(self, pool: _Host, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.long_lived = False  # counted in the host's streams, never pooled
        self.busy = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future[bool] | None = None
        self._reset(False)

    def _reset(self, head_only: bool) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.headers_done = False
        self.informational = False
        self.complete = False
        self.keep_alive = False
        self.until_close = False
        self.head_only = head_only
        self.got_bytes = False
        self.exc: UpstreamError | None = None
        self.buf: list[bytes] = []
        self.buf_size = 0
        self.paused = False

    # ---- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            if not self.head_only or not self.busy:
                # Bytes nobody asked for: the connection is out of step, never reuse it.
                self.keep_alive = False
                self._lost(None)
                if self.transport is not None:
                    self.transport.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.complete and self.exc is None:  # else a callback said why
                self.exc = UpstreamError(
                    f"upstream {self.pool.label} sent an invalid HTTP response: {exc}")
            self.keep_alive = False
            self._wake()

    def eof_received(self) -> bool:
        self._lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    def _lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.keep_alive = False
            if self.busy:
                if not self.complete and self.exc is None:
                    if self.headers_done and self.until_close and exc is None:
                        self.complete = True  # a body delimited by the end of the connection
                    elif not self.got_bytes:
                        why = f": {exc}" if exc else ""
                        self.exc = UpstreamError(
                            f"upstream {self.pool.label} closed the connection before "
                            f"responding{why}")
                    else:
                        why = f": {exc}" if exc else ""
                        self.exc = UpstreamError(
                            f"upstream {self.pool.label} closed the connection before the "
                            f"response was complete{why}")
                self._wake()
            else:
                self.pool.forget_idle(self)

    # ---- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            # A second response to one request: out of step, stop parsing, never reuse.
            self.keep_alive = False
            raise _Stray()
        self.headers = CIMultiDict()
        self.informational = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.headers_done:  # after the headers: chunked trailers, dropped like aiohttp
            self.headers.add(name.decode("utf-8", "surrogateescape"),
                             value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.informational = True  # 100 Continue / 103 Early Hints: wait for the real one
            return
        # (A 101 is refused here: llhttp would go on to stop with HttpParserUpgrade, which is
        # no HttpParserError.)
        refused = refused_response(status, self.headers)
        if refused is not None:
            self.exc = UpstreamError(f"upstream {self.pool.label} {refused}")
            self.keep_alive = False
            raise _Stray()
        self.status = status
        self.headers_done = True
        if self.head_only:
            # The parser does not know the request was HEAD and would wait for a body that never
            # comes: the response ends here, and the connection is not reused.
            self.complete = True
            self.keep_alive = False
        elif status not in (204, 304):
            # `chunked` alone, if anything (refused_response)
            self.until_close = ("Transfer-Encoding" not in self.headers
                                and "Content-Length" not in self.headers)
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.head_only:
            return
        self.buf.append(body)
        self.buf_size += len(body)
        if self.buf_size > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        if not self.complete:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # ---- used by the forwarder and the response ----------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def send(self, data: bytes, head_only: bool) -> None:
        self._reset(head_only)
        self.busy = True
        assert self.transport is not None
        self.transport.write(data)

    async def wait(self, limit: float | None) -> bool:
        """Wait for news (bytes, the end, an error); False when `limit` seconds passed first.

        A bare future + call_later: cheaper than asyncio.timeout on this per-request path.
        """
        fut: asyncio.Future[bool] = self._loop.create_future()
        self.waiter = fut
        handle = None if limit is None else self._loop.call_later(limit, _expire, fut)
        try:
            return await fut
        finally:
            self.waiter = None
            if handle is not None:
                handle.cancel()

    def take(self) -> bytes:
        buf = self.buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        self.buf = []
        self.buf_size = 0
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        return data

    def abort(self) -> None:
        self.keep_alive = False
        if self.busy and not self.complete and self.exc is None:
            self.exc = UpstreamError(f"the connection to upstream {self.pool.label} was closed")
            self._wake()
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Stray(Exception):
    """Raised from a parser callback to stop parsing: bytes nobody asked for, or a response
    refused (`_Conn.exc` says why)."""


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class _Host:
    """The pool of one (host, port), and the count of its long-lived streams."""

    __slots__ = ("conns", "count", "idle", "label", "limit", "stream_limit", "streams", "waiters")

    def __init__(self, label: str, limit: int, stream_limit: int, conns: set[_Conn]):
        self.label = label
        self.limit = limit
        self.stream_limit = stream_limit
        self.conns = conns  # every open connection of the forwarder
        self.count = 0  # open or opening connections, idle or busy (streams not included)
        self.streams = 0  # open or opening long-lived stream connections
        self.idle: list[_Conn] = []
        self.waiters: list[asyncio.Future[None]] = []

    def forget_idle(self, conn: _Conn) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            return
        if conn in self.conns:
            self.conns.discard(conn)
            self.count -= 1
        self.wake_one()

    def wake_one(self) -> None:
        while self.waiters:
            fut = self.waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                return


class FastResponse(UpstreamResponse):
    """Same interface as `UpstreamResponse`; the body is read from the connection on demand."""

    __slots__ = ("_conn", "_eof", "_fwd", "_read_timeout")

    def __init__(self, fwd: FastForwarder, conn: _Conn, read_timeout: float | None,
                 attempts: int = 1):
        self._fwd = fwd
        self._conn: _Conn | None = conn
        self._eof = False
        self._read_timeout = read_timeout
        self.status = conn.status
        self.headers = CIMultiDictProxy(conn.headers)
        self.attempts = attempts

    async def _next(self) -> bytes:
        """The next piece of the body; b"" at its end."""
        conn = self._conn
        if conn is None:
            if self._eof:
                return b""
            raise UpstreamError("the response was closed before its body was read")
        while True:
            if conn.buf:
                data = conn.take()
                if conn.complete:
                    self._finish()
                return data
            if conn.complete:
                self._finish()
                return b""
            if conn.exc is not None:
                exc = conn.exc
                self._drop()
                raise exc
            try:
                got = await conn.wait(self._read_timeout)
            except BaseException:  # cancelled: abort the upstream request
                self._drop()
                raise
            if not got:
                self._drop()
                raise UpstreamTimeout(
                    f"upstream {conn.pool.label} sent nothing for {self._read_timeout}s "
                    "while sending its response")

    async def read(self, limit: int | None = None, setting: str = REPLY_SETTING) -> bytes:
        conn = self._conn
        if conn is not None and conn.complete and not conn.exc:
            data = conn.take() if conn.buf else b""  # the usual case: it all came in already
            self._finish()
            if limit is not None and len(data) > limit:
                raise ReplyTooLarge(limit, setting)
            return data
        if limit is not None:
            length = self.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise ReplyTooLarge(limit, setting)
        parts: list[bytes] = []
        size = 0
        while True:
            data = await self._next()
            if not data:
                return b"".join(parts)
            size += len(data)
            if limit is not None and size > limit:
                raise ReplyTooLarge(limit, setting)
            parts.append(data)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (no buffering beyond what the socket delivered)."""
        while True:
            data = await self._next()
            if not data:
                return
            yield data

    def _finish(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            self._eof = True
            self._fwd._release(conn)

    def _drop(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()
            self._fwd._release(conn)

    def close(self) -> None:
        conn = self._conn
        if conn is None:
            return
        if conn.complete and conn.exc is None:
            self._finish()  # all received (even if not consumed): the connection is clean
        else:
            self._drop()  # mid-body: abort, which is how the upstream learns we are gone

    async def __aenter__(self) -> FastResponse:
        return self

    def __del__(self) -> None:
        if getattr(self, "_conn", None) is not None:
            try:
                self._drop()  # never closed: abort, so the slot is not lost
            except Exception:  # the loop may be gone already
                pass


class FastForwarder(Forwarder):
    """`Forwarder` on asyncio Protocols + httptools for http:// upstreams.

    https:// (and URLs with credentials) are served by the inherited aiohttp forwarder.
    """

    def __init__(self, limit_per_host: int = 256, keepalive_timeout: float = 30.0,
                 stream_limit_per_host: int = 128):
        super().__init__(limit_per_host, stream_limit_per_host)
        self._keepalive = keepalive_timeout
        self._hosts: dict[tuple[str, int], _Host] = {}
        self._urls: dict[str, _Target | None] = {}
        self._conns: set[_Conn] = set()
        self._started = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        await super().start()
        self._loop = asyncio.get_running_loop()
        self._started = True
        self._sweeper = self._loop.call_later(self._keepalive, self._sweep)

    async def close(self) -> None:
        self._started = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()
        for host in self._hosts.values():
            host.idle.clear()
            host.count = 0
            host.streams = 0
            for fut in host.waiters:
                if not fut.done():
                    fut.set_result(None)
        self._hosts.clear()
        await super().close()

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
        request may be sent a second time after the stale keep-alive race (module docstring);
        otherwise it is written at most once. The response's `attempts` says how many times.
        `long_lived`: a stream that may stay open indefinitely, on a connection of the host's
        streams' budget (module docstring), never the pool's.
        Raises UpstreamError / UpstreamTimeout, with `attempts` set: 0 (and a message starting
        with `cannot connect to upstream`) when the request was never written; UpstreamBusy
        (attempts 0) when `long_lived` and the streams' budget is spent.
        """
        if not self._started:
            raise counted(UpstreamError("forwarder is not started"), 0)
        try:
            target = self._urls[url]
        except KeyError:
            try:
                target = _parse_url(url)
            except UpstreamError as exc:
                exc.attempts = 0
                raise
            if len(self._urls) >= _URL_CACHE_MAX:
                self._urls.clear()
            self._urls[url] = target
        if target is None:
            return await super().open(method, url, headers, body, connect_timeout=connect_timeout,
                                      read_timeout=read_timeout, resend=resend,
                                      long_lived=long_lived)

        lines = [f"{method} {target.target} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
        for name, value in headers.items():
            if name.lower() in _OWN_HEADERS:
                continue
            lines.append(f"{name}: {value}\r\n")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}\r\n")
        elif method not in _BODILESS_METHODS:
            lines.append("Content-Length: 0\r\n")
        lines.append("\r\n")
        head = "".join(lines)
        if head.count("\n") != len(lines) + 1 or head.count("\r") != len(lines) + 1:
            raise counted(UpstreamError(
                "refusing to send a header name or value containing CR or LF"), 0)
        data = head.encode("utf-8", "surrogateescape")
        if body:
            data += body
        head_only = method == "HEAD"

        attempts = 0
        first: UpstreamError | None = None  # the first send's failure, once resending
        while True:
            try:
                if long_lived:
                    conn = await self._acquire_stream(target, connect_timeout)
                else:
                    conn = await self._acquire(target, connect_timeout, fresh=first is not None)
            except UpstreamError as exc:
                if first is not None:  # the first send was written: not a connect failure
                    raise counted(type(exc)(f"{first}; resending it failed: {exc}"),
                                  attempts) from exc
                exc.attempts = 0
                raise
            conn.send(data, head_only)
            attempts += 1
            while not conn.headers_done:
                if conn.exc is not None:
                    failure = conn.exc
                    stale = resend and conn.reused and not conn.got_bytes and first is None
                    conn.abort()
                    self._release(conn)
                    if stale:
                        first = failure
                        break  # the stale keep-alive race: once more, on a new connection
                    raise counted(failure, attempts)
                try:
                    got = await conn.wait(read_timeout)
                except BaseException:  # cancelled: abort the upstream request
                    conn.abort()
                    self._release(conn)
                    raise
                if not got:
                    conn.abort()
                    self._release(conn)
                    raise counted(UpstreamTimeout(
                        f"upstream {target.label} did not answer within {read_timeout}s ({strip_credentials(url)})"),
                        attempts)
            else:
                return FastResponse(self, conn, read_timeout, attempts)

    # ---- the pool ------------------------------------------------------------------------

    def _host(self, target: _Target) -> _Host:
        host = self._hosts.get(target.key)
        if host is None:
            host = self._hosts[target.key] = _Host(target.label, self._limit, self._stream_limit,
                                                   self._conns)
        return host

    async def _acquire_stream(self, target: _Target, connect_timeout: float) -> _Conn:
        """A fresh connection for a long-lived stream, from the host's streams' budget."""
        host = self._host(target)
        if host.streams >= host.stream_limit:
            raise UpstreamBusy(f"upstream {target.label} already has {host.stream_limit} "
                               "long-lived streams open (limits.max_upstream_streams)")
        host.streams += 1
        try:
            async with asyncio.timeout(connect_timeout):
                conn = await self._connect(target, host)
        except TimeoutError as exc:
            host.streams -= 1
            raise UpstreamTimeout(
                f"cannot connect to upstream {target.label}: no connection within "
                f"{connect_timeout}s") from exc
        except BaseException:
            host.streams -= 1
            raise
        conn.long_lived = True
        return conn

    async def _acquire(self, target: _Target, connect_timeout: float, fresh: bool) -> _Conn:
        host = self._host(target)
        if not fresh:
            idle = host.idle
            while idle:
                conn = idle.pop()
                if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                    conn.reused = True
                    return conn
                host.count -= 1
                self._conns.discard(conn)
                conn.abort()
        try:
            async with asyncio.timeout(connect_timeout):
                while host.count >= host.limit:
                    if host.idle:  # a connection came back while we waited
                        conn = host.idle.pop()
                        if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                            conn.reused = True
                            return conn
                        host.count -= 1
                        self._conns.discard(conn)
                        conn.abort()
                        continue
                    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    host.waiters.append(fut)
                    try:
                        await fut
                    except BaseException:
                        if fut.done() and not fut.cancelled():
                            host.wake_one()  # pass on the wake-up this task cannot use
                        raise
                    finally:
                        if not fut.done():
                            fut.cancel()
                    if not self._started:
                        raise UpstreamError("forwarder is closed")
                host.count += 1
                try:
                    return await self._connect(target, host)
                except BaseException:
                    host.count -= 1
                    host.wake_one()
                    raise
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"cannot connect to upstream {target.label}: no connection within "
                f"{connect_timeout}s") from exc

    async def _connect(self, target: _Target, host: _Host) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: _Conn(host, loop), target.host, target.port)
        except OSError as exc:
            raise UpstreamError(
                f"cannot connect to upstream {target.label}: {exc.strerror or exc}") from exc
        self._conns.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        """Back to the pool when clean, else closed; either way its slot is free again."""
        conn.busy = False
        host = conn.pool
        if conn.long_lived:  # a stream's connection is never pooled: closed, its slot freed
            if not conn.closed:
                conn.abort()
            if conn in self._conns:
                self._conns.discard(conn)
                host.streams -= 1
            return
        if (conn.keep_alive and conn.complete and not conn.closed and self._started
                and conn.transport is not None and not conn.transport.is_closing()):
            conn.idle_since = conn._loop.time()
            host.idle.append(conn)
        else:
            if not conn.closed:
                conn.abort()
            if conn in self._conns:
                self._conns.discard(conn)
                host.count -= 1
        host.wake_one()

    def _sweep(self) -> None:
        """Close connections idle for longer than keepalive_timeout."""
        if not self._started or self._loop is None:
            return
        limit = self._loop.time() - self._keepalive
        for host in self._hosts.values():
            old = [c for c in host.idle if c.idle_since <= limit]
            for conn in old:
                host.idle.remove(conn)
                host.count -= 1
                self._conns.discard(conn)
                conn.abort()
        self._sweeper = self._loop.call_later(max(self._keepalive / 2, 0.5), self._sweep)
