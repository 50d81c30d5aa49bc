"""The listeners' connection timeouts: a header-read timeout on top of aiohttp's keep-alive one.

aiohttp closes a keep-alive connection that stays idle past `keepalive_timeout`, but nothing
bounds how long a client may take to send a request head: a connection that sends half a
request line and waits holds a socket and a task until that timer fires (aiohttp's default is
an hour), so a few thousand such connections exhaust the process's descriptors.

`ListenerRunner` is `web.AppRunner` with its connections' protocol (`RequestHandler`) extended
by one timer: armed when the connection opens, and again when the first byte of a later
request arrives on an idle keep-alive connection; cleared as soon as a whole head has been
parsed. When it fires first, the connection is closed (nothing is sent: the client is not
reading a reply to a request it never finished). A connection in the middle of a request or a
response (a body being read, a stream being written) is never touched by it.

Its server also refuses, before the application sees them, the request framings aiohttp's parser
accepts and the proxy does not (`proxy.framing`): 400, and the connection closed. This covers the
MCP listener under `listener: aiohttp` and the admin listener; the fast listener refuses the same
in its parser callback.

An HTTP/1.1 request with no Host goes the other way: aiohttp's parser refuses it (400, plain
text) before the application, and so the guard, sees it. Given `on_missing_host`, the listener
answers with what that returns instead (the MCP listener: the guard's refusal, counted
`bad_host`), as the fast listener's guard does.

Every other request refused before the application (bytes aiohttp's parser does not take as
HTTP: a TLS hello, a bad method, version or header, a bad pipelined request; and the framings
above) is told to `on_bad_request`, as the fast listener tells its own.

Cost: one timer per connection (set on open, cancelled at the first head); on a keep-alive
connection whose head arrives in one read (every client's usual case), nothing but two
attribute reads per `data_received`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from proxy.framing import request_bad_framing

__all__ = ["ListenerRunner"]

log = logging.getLogger("envelope.listener")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
# What aiohttp's parsers (C and Python) raise for an HTTP/1.1 request with no Host.
_NO_HOST = "Missing 'Host' header in request."


class _HeadTimedHandler(RequestHandler):
    """aiohttp's connection protocol, closing a connection whose request head is late (and
    answering a request with no Host as `on_missing_host` says)."""

    __slots__ = ("_head_timeout", "_head_timer", "_on_bad_request", "_on_head_timeout",
                 "_on_missing_host")

    def __init__(self, manager: web.Server, *, head_timeout: float,
                 on_head_timeout: Callable[[], None] | None,
                 on_missing_host: Callable[[], web.StreamResponse] | None,
                 on_bad_request: Callable[[], None] | None, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._on_head_timeout = on_head_timeout
        self._on_missing_host = on_missing_host
        self._on_bad_request = on_bad_request

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if (self._on_missing_host is not None and isinstance(exc, BadHttpMessage)
                and exc.message == _NO_HOST):
            return self._on_missing_host()  # closes the connection, as aiohttp's answer would
        if isinstance(exc, HttpProcessingError) and self._on_bad_request is not None:
            self._on_bad_request()  # the parser's refusal; a handler's own exception is not
        return super().handle_error(request, status, exc, message)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            # The client's bytes are not HTTP the parser takes (a TLS hello, a port scan, a bad
            # method, version or header): aiohttp answers 400 and closes, and logged each at
            # ERROR with a traceback, ~1 KB of log for a 40-byte request from anyone who
            # reaches the port, and an error alert for nothing wrong in the proxy. One line at
            # DEBUG, as the fast listener says nothing; a handler's own exception stays ERROR.
            log.debug("malformed request answered 400: %s", exc.message)
            return
        super().log_exception(*args, **kw)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_timer = self._loop.call_later(self._head_timeout, self._head_expired)

    def data_received(self, data: bytes) -> None:
        # Idle between requests: the protocol's task waits for the next head.
        idle = self._waiter is not None and not self._waiter.done()
        super().data_received(data)
        timer = self._head_timer
        if timer is not None:
            if self._messages:  # a whole head was parsed (or a malformed one, answered 400)
                timer.cancel()
                self._head_timer = None
        elif idle and data and not self._messages:  # the first bytes of a later request's head
            self._head_timer = self._loop.call_later(self._head_timeout, self._head_expired)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._messages or self._request_in_progress or self.transport is None:
            return
        if self._on_head_timeout is not None:
            self._on_head_timeout()
        self.force_close()


def _framed(handler: Handler, on_bad_request: Callable[[], None] | None) -> Handler:
    """`handler`, run only for a request whose framing the proxy accepts (`proxy.framing`);
    any other is answered 400 and told to `on_bad_request`."""

    async def framed(request: web.BaseRequest) -> web.StreamResponse:
        refused = request_bad_framing(request)
        if refused is None:
            return await handler(request)
        if on_bad_request is not None:
            on_bad_request()
        response = web.Response(status=400, text=refused)
        response.force_close()  # the bytes after this request cannot be framed with certainty
        return response

    return framed


class _HeadTimedServer(web.Server):
    """`web.Server` whose connections are `_HeadTimedHandler`s, and which refuses the framings
    `proxy.framing` names."""

    def __init__(self, base: web.Server, head_timeout: float,
                 on_head_timeout: Callable[[], None] | None,
                 on_missing_host: Callable[[], web.StreamResponse] | None,
                 on_bad_request: Callable[[], None] | None):
        super().__init__(_framed(base.request_handler, on_bad_request),
                         request_factory=base.request_factory,
                         handler_cancellation=base.handler_cancellation, **base._kwargs)
        self.head_timeout = head_timeout
        self.on_head_timeout = on_head_timeout
        self.on_missing_host = on_missing_host
        self.on_bad_request = on_bad_request

    def __call__(self) -> RequestHandler:
        return _HeadTimedHandler(self, head_timeout=self.head_timeout,
                                 on_head_timeout=self.on_head_timeout,
                                 on_missing_host=self.on_missing_host,
                                 on_bad_request=self.on_bad_request, loop=self._loop,
                                 **self._kwargs)


class ListenerRunner(web.AppRunner):
    """`web.AppRunner` whose connections must send each request head within `header_timeout`
    seconds and are closed when idle for `keepalive_timeout` seconds (see the module
    docstring). `on_header_timeout` is told of every connection closed for a late head;
    `on_missing_host` (None: aiohttp's own 400) answers an HTTP/1.1 request with no Host;
    `on_bad_request` is told of every other request refused before the application (400)."""

    __slots__ = ("_header_timeout", "_on_bad_request", "_on_header_timeout", "_on_missing_host")

    def __init__(self, app: web.Application, *, header_timeout: float, keepalive_timeout: float,
                 on_header_timeout: Callable[[], None] | None = None,
                 on_missing_host: Callable[[], web.StreamResponse] | None = None,
                 on_bad_request: Callable[[], None] | None = None, **kwargs: Any):
        super().__init__(app, keepalive_timeout=keepalive_timeout, **kwargs)
        self._header_timeout = header_timeout
        self._on_header_timeout = on_header_timeout
        self._on_missing_host = on_missing_host
        self._on_bad_request = on_bad_request

    async def _make_server(self) -> web.Server:
        # The server aiohttp builds (startup hooks run, the app frozen, its handler arguments
        # applied), rebuilt with the same arguments as one whose connections time heads.
        base = await super()._make_server()
        return _HeadTimedServer(base, self._header_timeout, self._on_header_timeout,
                                self._on_missing_host, self._on_bad_request)
