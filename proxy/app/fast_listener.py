"""The lean MCP listener (`listener: fast`): an asyncio protocol with httptools serving the same
aiohttp `web.Application` that aiohttp's own server serves.

Why: aiohttp's server costs ~120 µs of CPU per request on this machine, more than a call's
whole budget, against ~14 µs for a bare httptools protocol. This protocol parses with
httptools and builds, per request, the same `web.Request` aiohttp would (via
`app._make_request`, with aiohttp's `StreamReader` as the body and its `StreamWriter` as the
writer), then runs the application's own `_handle` (router, middlewares, every front and the
guard, unchanged) in one task. A plain `web.Response` with a bytes body is serialised here in
one `transport.write`; anything else (a `StreamResponse` relaying SSE, cookies, compression,
a `Payload` body, `on_response_prepare` hooks) goes through aiohttp's `prepare`/`write_eof` on
the same writer, so streaming and backpressure are aiohttp's.

The hot route (a POST to `/mcp` or `/mcp/<name>` in origin form with a fixed Content-Length up to
64 KiB and no Content-Encoding, Transfer-Encoding, Expect or upgrade) skips aiohttp's request side: its
body is buffered whole, and the route's guarded handler (found by the application's own router,
once per distinct path) is called with a `LeanRequest` (the attributes the guard and the fronts
read, and what `StreamResponse.prepare` needs for SSE) instead of a `web.Request` over a
`StreamReader` after the router's match; a JSON answer comes back from the front as a
`proxy.fronts.plain.PlainAnswer` (status, headers, body: no `web.Response`) and is written as
that response would be (`_write_plain`). Any other request, and every
request when the application has middlewares or `on_response_prepare` hooks, goes through
`app._handle` as above.

Measured (callgrind, repeatable; `bench/listener_hello.py --instructions 300`,
`bench/instructions.py`; bench/RESULTS.md "The fast listener"): a hello-world POST costs 207k
instructions with aiohttp's server, ~131k with this one, 8k with a bare httptools protocol; the
full envelope ~0.88 of aiohttp's server (round 4). What remains on the hot route is the
application's own work and one task per request.

What a connection does, as aiohttp's `RequestHandler` does it:

- HTTP/1.1 keep-alive, HTTP/1.0 (keep-alive only when asked), `Connection: close`.
- Pipelined requests are answered in order, one at a time: heads parsed ahead wait in a queue
  with their bodies; past `_MAX_QUEUED` of them parsing stops (the rest of the read waits,
  unparsed) and reading pauses until the queue drains. When reading stops (a late body, a bad
  head), every request queued before that is still answered, then the connection closes.
- A hot-route body (at most 64 KiB, framed by its Content-Length) is buffered whole before its
  request is answered; a connection receiving one is busy (no idle close). When the router
  sends its path elsewhere, the buffered body is fed to a `StreamReader` for aiohttp's request.
  One not whole `header_timeout` after the read that brought its head (checked by the
  listener's once-a-second tick, so within one second more: no timer per request) goes to the
  application with a reader that fails `TimeoutError`: the fronts' `read_body` answers it 408 as
  a late body it reads itself. While the proxy itself holds the rest back (pipelined requests
  queued), it is not late.
- Other bodies (fixed-length or chunked) are fed as they arrive into the request's `StreamReader`,
  whose flow control pauses reading when its buffer passes its limit. A `gzip`/`deflate`
  body is decoded as read by aiohttp's `DeflateBuffer` in bounded steps (compressed bytes
  that arrive while the reader is full wait, undecoded, in a backlog bounded by one read);
  other codings are left undecoded for the guard to refuse (415).
- A request line longer than 8,190 bytes answers 400, a header field longer than 8,190 bytes,
  more than 128 headers or a head over 64 KiB answer 431; a malformed request answers 400, and
  so do framings llhttp accepts that the proxy refuses (`proxy.framing`: a Transfer-Encoding
  other than `chunked`, an HTTP version other than 1.0 and 1.1) and a second Host field.
  Each closes the connection after the responses before it, and is told to `on_bad_request`.
- An upgrade request is answered by its route like any other request; the connection then
  closes (nothing after it is read: no protocol switch is offered).
- `web.HTTPException` from the router or a handler is its response; any other exception is
  logged and answered 500, and the connection closes.
- A client that disconnects cancels its handler (aiohttp's `handler_cancellation=True`); a
  client that half-closes (sends FIN) counts as gone, as with aiohttp.
- Timeouts: a request head must arrive within `header_timeout` of the connection opening or
  of the first byte of a later head (else the connection closes, counted by
  `on_header_timeout`); a body must arrive whole within `header_timeout` of its head (the
  fronts' `read_body` answers 408; a hot-route body is sent there by the listener's tick); an idle
  connection closes after `keepalive_timeout`.
- Shutdown (`cleanup`): stop accepting, close idle connections, let in-flight requests finish
  within `shutdown_timeout`, cancel the rest, close every connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from types import MappingProxyType
from typing import Any, Final, cast

import httptools
from aiohttp import hdrs, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import must_be_empty_body, should_remove_content_length
from aiohttp.http import HttpVersion, HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.http_parser import DeflateBuffer, RawRequestMessage
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_urldispatcher import AbstractResource, DynamicResource, PlainResource
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.framing import bad_framing
from proxy.fronts.plain import PlainAnswer

__all__ = ["FastListener", "LeanRequest"]

log = logging.getLogger("envelope")

_MAX_LINE: Final = 8190  # aiohttp's max_line_size
_MAX_FIELD: Final = 8190  # aiohttp's max_field_size
_MAX_HEADERS: Final = 128
_MAX_HEAD: Final = 64 * 1024  # a whole head, however it is split into fields
_READ_LIMIT: Final = 2**16  # a body's StreamReader pauses reading past twice this
_MAX_QUEUED: Final = 8  # pipelined requests parsed ahead of the one being answered
_SLICE: Final = 4096  # bytes parsed at a time while checking that bound
_DECODED: Final = frozenset({"gzip", "deflate"})  # what DeflateBuffer decodes here
_VERSIONS: Final = {"1.1": HttpVersion11, "1.0": HttpVersion10}
_LEAN_BODY: Final = 2**16  # a hot-route body up to this size is buffered whole, then answered
# The hot routes' resources, by their canonical path: the aggregate `/mcp` and `/mcp/{upstream}`.
_HOT_PATH: Final = re.compile(r"/mcp(?:/\{[^{}/]+\})?")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _HeadError(Exception):
    """A request head this listener refuses: answered `status` and the connection closed."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _error_bytes(status: int, reason: str) -> bytes:
    body = f"{status} {reason}".encode()
    phrase = _phrase(status)
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nDate: {formatdate(usegmt=True)}\r\n"
            "Connection: close\r\n\r\n"
            ).encode("latin-1") + body


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


# The reason phrase aiohttp's response gives a status (`web.StreamResponse.reason`).
_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}


def _reason(status: int) -> str:
    return _REASONS.get(status, "")


class _LeanBody:
    """A hot-route body received whole: what `proxy.fronts.guard.read_body` (and a handler's
    `request.read()`) reads of aiohttp's `StreamReader`. It carries no `total_compressed_bytes`:
    a hot-route body is never in a content coding."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes):
        self._data = data

    def is_eof(self) -> bool:
        return True  # received whole: `read_body` needs no deadline to read it

    async def readexactly(self, n: int) -> bytes:
        if n != len(self._data):  # Content-Length framed it: only a caller's bug gets here
            raise asyncio.IncompleteReadError(self._data[:n], n)
        return self._data

    async def iter_any(self) -> AsyncIterator[bytes]:
        if self._data:
            yield self._data

    async def read(self) -> bytes:
        return self._data


class LeanRequest:
    """What the guard and the MCP fronts read of a request on the hot route (a POST to `/mcp` or
    `/mcp/<name>` whose whole body arrived), plus what `web.StreamResponse.prepare` reads to
    answer it as SSE, without aiohttp's `web.Request`, `StreamReader` and router match (about
    40k instructions per request). Built only when the application has no middlewares and no
    `on_response_prepare` hooks (nothing else would read it); tests/unit/app/test_lean_request.py
    fails when a front starts reading an attribute this class lacks."""

    __slots__ = ("_conn", "_message", "_writer", "content", "content_length", "match_info")

    # A handler may answer with a `PlainAnswer` (`proxy.fronts.render.writes_plain`): written
    # by `_write_plain` without an aiohttp response.
    plain_answers: Final = True

    def __init__(self, conn: _Connection, message: RawRequestMessage, body: bytes,
                 match_info: Mapping[str, str]):
        self._conn = conn
        self._message = message
        self._writer: StreamWriter | None = None
        self.content = _LeanBody(body)
        self.content_length = len(body)  # the Content-Length that framed it
        self.match_info = match_info

    @property
    def method(self) -> str:
        return self._message.method

    @property
    def version(self) -> HttpVersion:
        return self._message.version

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self._message.headers

    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return self._message.raw_headers

    @property
    def host(self) -> str | None:
        return self._message.headers.get(hdrs.HOST)  # present and not empty on the hot route

    @property
    def rel_url(self) -> URL:
        return self._message.url  # origin form on the hot route: already relative

    @property
    def path(self) -> str:
        return self._message.url.path

    @property
    def query(self) -> Any:
        return self._message.url.query

    @property
    def keep_alive(self) -> bool:
        return not self._message.should_close

    @property
    def can_read_body(self) -> bool:
        return self.content_length > 0

    async def read(self) -> bytes:
        return await self.content.read()

    @property
    def _payload_writer(self) -> StreamWriter:
        # Made only for a streamed answer (SSE): a plain one is written by `_write_response`.
        if self._writer is None:
            self._writer = StreamWriter(self._conn, self._conn._loop)
        return self._writer

    @property
    def writer(self) -> StreamWriter:
        # As `web.Request.writer` (what an `Expect` answer writes on; the hot route never
        # carries an Expect, but the request the fronts read has every attribute of aiohttp's).
        return self._payload_writer

    def get(self, key: object, default: Any = None) -> Any:
        # As `web.Request`'s storage, which nothing fills before the route's handler on this
        # path: the one key read there is set by an `Expect` handler, and the hot route never
        # carries an Expect.
        return default

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        return  # the application has no on_response_prepare hooks (checked at setup)

    def _finish(self) -> None:
        return  # no multipart form files to release


class _Buffered:
    """A hot-route request whose whole body was received: answered without aiohttp's request."""

    __slots__ = ("body", "message")

    def __init__(self, message: RawRequestMessage, body: bytes):
        self.message = message
        self.body = body


class _Connection(BaseProtocol):
    """One client connection: parses requests, runs each through the application in turn."""

    __slots__ = (
        "_backlog", "_closing", "_eof_pending", "_head_size", "_head_timer", "_headers",
        "_in_head", "_keep_timer", "_last_active", "_lean", "_lean_body", "_lean_since", "_listener",
        "_queue",
        "_request_parser",
        "_sink", "_stopped", "_tail", "_task", "_transport_paused", "_url", "peername", "sockname",
    )

    ssl_context = None
    max_field_size = _MAX_FIELD
    max_headers = _MAX_HEADERS

    def __init__(self, listener: FastListener):
        super().__init__(listener.loop)
        self._listener = listener
        self._request_parser = httptools.HttpRequestParser(self)
        # The head being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0
        self._in_head = False
        # Where the body being parsed goes: its StreamReader, or a DeflateBuffer in front of it.
        self._sink: StreamReader | DeflateBuffer | None = None
        self._backlog: list[bytes] = []  # compressed bytes waiting for the reader to drain
        self._eof_pending = False  # the message ended while its backlog was not yet decoded
        # A hot-route request whose body is being received whole (see `LeanRequest`).
        self._lean: RawRequestMessage | None = None
        self._lean_body = bytearray()
        self._lean_since = 0.0  # when it was found not whole after a read (0: it was not, yet)
        # Requests parsed and not yet answered: (message, body), a hot-route request with its
        # whole body, or an error to answer.
        self._queue: deque[tuple[RawRequestMessage, StreamReader] | _Buffered | _HeadError] = deque()
        self._task: asyncio.Task[None] | None = None
        self._tail = b""  # received, not yet parsed: held back while the queue is full
        self._stopped = False  # nothing more is parsed (an error, an upgrade, a close)
        self._closing = False  # close once the request in progress is answered
        self._head_timer: asyncio.TimerHandle | None = None
        self._keep_timer: asyncio.TimerHandle | None = None
        self._last_active = 0.0
        self._transport_paused = False
        self.peername: Any = None
        self.sockname: Any = None

    # ---- asyncio protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not aiohttp's `BaseProtocol.connection_made`: its `tcp_nodelay` (a socket object and a
        # setsockopt per connection) repeats what the loop did. asyncio's selector transport and
        # uvloop's TCP transport both set TCP_NODELAY on every accepted TCP socket, so SSE events
        # go out at once all the same (tests/unit/app/test_fast_listener.py checks the socket).
        self.transport = cast(asyncio.Transport, transport)
        self.peername = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")
        listener = self._listener
        listener.connections.add(self)
        if listener.closing:
            self._close()
            return
        self._head_timer = self._loop.call_later(listener.header_timeout, self._head_expired)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._listener.connections.discard(self)
        super().connection_lost(exc)
        self._stopped = True
        for timer in (self._head_timer, self._keep_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._keep_timer = None
        if self._sink is not None:  # a body cut short: its reader says so
            self._reader(self._sink).set_exception(
                web.RequestPayloadError("the client closed the connection mid-body"))
            self._sink = None
        self._end_lean()  # a hot-route body cut short: never answered
        self._queue.clear()
        if self._task is not None:  # the client left: its handler is cancelled
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        if self._tail:  # parsing is held (the queue is full): what follows waits behind it
            self._tail += data
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse `data` in slices, holding the rest back while the queue of parsed requests is
        full: one read of tiny pipelined requests must not become thousands of queued ones."""
        parser = self._request_parser
        view = memoryview(data)
        for start in range(0, len(data), _SLICE):
            if self._stopped:
                return
            if len(self._queue) >= _MAX_QUEUED:
                self._tail = bytes(view[start:])
                self._pause_reading_for_buffer()
                return
            chunk = view[start:start + _SLICE]
            try:
                parser.feed_data(chunk)
            except httptools.HttpParserUpgrade:
                # Upgrades are not offered: the request is answered by its route, then the
                # connection closes, and nothing after it is read.
                self._stop_reading()
                return
            except httptools.HttpParserCallbackError as exc:
                cause = exc.__context__
                self._refuse(cause if isinstance(cause, _HeadError)
                             else _HeadError(400, "Bad Request"))
                return
            except httptools.HttpParserError as exc:
                self._refuse(_HeadError(400, f"Bad Request: {exc}"))
                return
            if self._in_head:  # a head not complete after this slice: its bytes are bounded
                self._head_size += len(chunk)
                if self._head_size > _MAX_HEAD:
                    self._refuse(_HeadError(431, "Request Header Fields Too Large"))
                    return
                if self._head_timer is None:
                    self._head_timer = self._loop.call_later(self._listener.header_timeout,
                                                             self._head_expired)
        if self._lean is not None and not self._lean_since:
            # A hot-route body not whole after this read (one that comes with its head never
            # gets here): its deadline starts now, kept by the listener's tick (`body_late`).
            self._lean_since = self._loop.time()
            self._listener.receiving.add(self)

    def _pause_transport_reading(self) -> None:
        if not self._transport_paused:
            self._transport_paused = True
            super()._pause_transport_reading()

    def _resume_transport_reading(self) -> None:
        # A body's reader asks for more after every read it serves: a syscall-free no-op
        # unless reading was paused (uvloop re-registers the socket otherwise).
        if self._transport_paused:
            self._transport_paused = False
            super()._resume_transport_reading()

    def pause_reading(self) -> None:
        # A body's StreamReader is full (BaseProtocol's version also pauses aiohttp's parser).
        self._reading_paused = True
        self._pause_transport_reading()

    def resume_reading(self, resume_parser: bool = True) -> None:
        self._reading_paused = False
        if self._backlog or self._eof_pending:
            self._drain_backlog()
        if not self._reading_paused and not self._buffer_paused and not self._stopped:
            self._resume_transport_reading()

    # ---- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_size = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > _MAX_LINE:
            raise _HeadError(400, "Bad Request: request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > _MAX_FIELD:
            raise _HeadError(431, "Request Header Fields Too Large: a header field is too long")
        headers = self._headers
        headers.append((name, value))
        if len(headers) > _MAX_HEADERS:
            raise _HeadError(431, "Request Header Fields Too Large: too many header fields")

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        parser = self._request_parser
        raw = tuple(self._headers)
        headers = CIMultiDictProxy(CIMultiDict(
            [(n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
             for n, v in raw]))
        method = parser.get_method().decode("ascii", "surrogateescape")
        version = _VERSIONS.get(parser.get_http_version())
        coding = headers.get(hdrs.TRANSFER_ENCODING)
        if version is None or coding is not None:  # framing llhttp accepts and the proxy refuses
            if version is None:
                major, _, minor = parser.get_http_version().partition(".")
                version = HttpVersion(int(major), int(minor or 0))
            refused = bad_framing(version, coding)
            if refused is not None:
                raise _HeadError(400, refused)
        if len(headers.getall(hdrs.HOST, ())) > 1:
            # As aiohttp's parser: a front proxy may route by the other one.
            raise _HeadError(400, "Bad Request: more than one Host header")
        target = self._url.decode("utf-8", "surrogateescape")
        url = _url(target)
        encoding = headers.get(hdrs.CONTENT_ENCODING, "").lower()
        compression = encoding if encoding in _DECODED else None
        chunked = coding is not None  # `chunked` alone: bad_framing refused any other
        length = headers.get(hdrs.CONTENT_LENGTH)
        upgrade = parser.should_upgrade()
        message = RawRequestMessage(method, target, version, headers, raw,
                                    not parser.should_keep_alive(), compression, upgrade,
                                    chunked, url)
        if (method == "POST" and length is not None and not upgrade and self._listener.lean
                and target.startswith("/mcp") and length.isdigit()
                and int(length) <= _LEAN_BODY and headers.get(hdrs.HOST)
                and hdrs.CONTENT_ENCODING not in headers and hdrs.TRANSFER_ENCODING not in headers
                and hdrs.EXPECT not in headers):
            # Maybe the hot route (the router decides, in `_respond_lean`): the body, bounded
            # by its Content-Length, is received whole before the request is answered. Origin
            # form only: for an absolute-form target the host the guard checks is the
            # target's authority (aiohttp's `request.host`), not the Host header.
            self._lean = message
            self._lean_body = bytearray()
            self._sink = None
            return
        payload: StreamReader
        if chunked or (length is not None and length != "0"):
            payload = StreamReader(self, _READ_LIMIT, loop=self._loop)
            self._sink = DeflateBuffer(payload, compression) if compression else payload
            self._eof_pending = False
        else:
            payload = EMPTY_PAYLOAD
            self._sink = None
        self._queue.append((message, payload))
        if self._task is None:
            self._next()

    def on_body(self, body: bytes) -> None:
        if self._lean is not None:
            self._lean_body += body  # at most its Content-Length (<= _LEAN_BODY): httptools frames it
            return
        sink = self._sink
        if sink is None:
            return
        if self._backlog or self._reading_paused:
            # The reader is full: keep the compressed bytes (what one read brought) undecoded.
            if isinstance(sink, DeflateBuffer):
                self._backlog.append(body)
                return
        try:
            more = sink.feed_data(body, len(body))
            while more and not self._reading_paused:
                more = sink.feed_data(b"", 0)
        except ContentEncodingError:
            self._bad_body("the body cannot be decoded from its Content-Encoding")
            return
        if more:
            self._backlog.append(b"")  # decoded output still pending: resume_reading goes on

    def on_message_complete(self) -> None:
        if self._lean is not None:
            if self._lean_since:
                self._lean_since = 0.0
                self._listener.receiving.discard(self)
            self._queue.append(_Buffered(self._lean, bytes(self._lean_body)))
            self._lean = None
            self._lean_body = bytearray()
            if self._task is None:
                self._next()
            return
        sink = self._sink
        if sink is None:
            return
        if self._backlog:
            self._eof_pending = True
            return
        self._sink = None
        try:
            sink.feed_eof()
        except ContentEncodingError:
            self._sink = sink
            self._bad_body("the body cannot be decoded from its Content-Encoding")

    # ---- bodies ----------------------------------------------------------------------------

    @staticmethod
    def _reader(sink: StreamReader | DeflateBuffer) -> StreamReader:
        return sink.out if isinstance(sink, DeflateBuffer) else sink

    def _drain_backlog(self) -> None:
        """Decode compressed bytes that waited for the reader, while it has room."""
        sink = self._sink
        if not isinstance(sink, DeflateBuffer):
            self._backlog.clear()
            return
        try:
            while self._backlog and not self._reading_paused:
                more = sink.feed_data(self._backlog.pop(0), 0)
                while more and not self._reading_paused:
                    more = sink.feed_data(b"", 0)
                if more:
                    self._backlog.insert(0, b"")
            if not self._backlog and self._eof_pending:
                self._eof_pending = False
                self._sink = None
                sink.feed_eof()
        except ContentEncodingError:
            self._sink = sink
            self._bad_body("the body cannot be decoded from its Content-Encoding")

    def _bad_body(self, reason: str) -> None:
        """The body in progress cannot be read: its reader fails, and nothing more is parsed."""
        assert self._sink is not None
        self._reader(self._sink).set_exception(web.RequestPayloadError(reason))
        self._sink = None
        self._backlog.clear()
        self._eof_pending = False
        self._closing = True
        self._stop_reading()

    # ---- requests --------------------------------------------------------------------------

    def _next(self) -> None:
        """Answer the next queued request (none is in progress)."""
        queue = self._queue
        if not queue:
            return
        entry = queue.popleft()
        if isinstance(entry, _HeadError):
            self._write_error(entry)
            return
        if isinstance(entry, _Buffered):
            self._task = self._loop.create_task(self._respond_lean(entry))
        else:
            self._task = self._loop.create_task(self._respond(*entry))
        if len(queue) < _MAX_QUEUED // 2:
            if self._tail:  # room again: parse what was held back
                tail, self._tail = self._tail, b""
                self._feed(tail)
            if self._buffer_paused and not self._tail:
                self._resume_reading_for_buffer()

    async def _respond(self, message: RawRequestMessage, payload: StreamReader) -> None:
        listener = self._listener
        writer = StreamWriter(self, self._loop)
        request = listener.app._make_request(message, payload, self, writer,  # type: ignore[arg-type]
                                             asyncio.current_task())  # type: ignore[arg-type]
        await self._run(request, listener.handler, payload)

    async def _respond_lean(self, buffered: _Buffered) -> None:
        """A request whose whole body arrived: the hot route's guarded handler is called directly
        with a `LeanRequest`; any other route is answered the usual way."""
        listener = self._listener
        message = buffered.message
        lean = LeanRequest(self, message, buffered.body, _NO_MATCH)
        request = cast(web.Request, lean)  # it has what the guard and the MCP fronts read
        path = message.url.raw_path
        hot = listener.hot[path] if path in listener.hot else await listener.resolve_hot(request)
        if hot is None:  # not the hot route: aiohttp's request, its body fed from the buffer
            payload = StreamReader(self, _READ_LIMIT, loop=self._loop)
            if buffered.body:
                payload.feed_data(buffered.body)
            payload.feed_eof()
            await self._respond(message, payload)
            return
        handler, lean.match_info = hot
        await self._run(request, handler, None)

    async def _run(self, request: web.Request, handler: Handler, payload: StreamReader | None) -> None:
        """Answer `request` with `handler`, then go on with the connection."""
        listener = self._listener
        keep_alive = False
        try:
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # raised by the router or a handler: its response
                response = exc
            if self.transport is not None:
                keep_alive = await self._send(request, response)
        except asyncio.CancelledError:
            if self.transport is not None and not listener.closing:
                raise  # cancelled from elsewhere, not by the client leaving or a shutdown
        except Exception as exc:
            if self.transport is None or isinstance(exc, ConnectionError):
                # The client left while its answer was being written (a session client closing
                # its GET stream when it is done): nothing to answer, and no error of ours.
                log.debug("MCP listener: connection lost while answering: %r", exc)
            else:
                log.exception("MCP listener: unhandled error answering %s %s", request.method,
                              request.rel_url.raw_path)
                writer = request._payload_writer
                if not (isinstance(writer, StreamWriter) and writer._headers_written):
                    # Else the client sees the connection close.
                    self.transport.write(_error_bytes(500, "Internal Server Error"))
        finally:
            self._task = None
            request._finish()
            if payload is not None and payload is not EMPTY_PAYLOAD and not payload.is_eof():
                keep_alive = False  # the rest of an unread body is still on the wire
            self._done(keep_alive)

    async def _send(self, request: web.Request, response: web.StreamResponse) -> bool:
        """Write `response`; whether the connection may stay open afterwards."""
        answer: object = response  # a PlainAnswer when the request said `plain_answers`
        if type(answer) is PlainAnswer:
            return self._write_plain(request, answer)
        if (type(response) is web.Response or isinstance(response, web.HTTPException)) \
                and not response.prepared and not response._cookies \
                and not response._compression and not response.chunked \
                and isinstance(response._body, bytes | bytearray | None) \
                and not self._listener.prepare_hooks:
            return self._write_response(request, response)
        await response.prepare(request)
        await response.write_eof()
        return bool(response.keep_alive)

    def _write_plain(self, request: web.Request, answer: PlainAnswer) -> bool:
        """Write a plain answer in one write: the bytes `_write_response` writes for a
        `web.Response` of the same status, headers and body."""
        status, headers, body = answer.status, answer.headers, answer.body
        if not (200 <= status < 300 and status != 204 and body):  # aiohttp's rules: as a response
            return self._write_response(request, web.Response(status=status, body=body, headers=headers))
        fields = [f"{name}: {value}" for name, value in headers.items()]
        if hdrs.CONTENT_LENGTH not in headers:
            fields.append(f"Content-Length: {len(body)}")
        if hdrs.CONTENT_TYPE not in headers:
            fields.append("Content-Type: application/octet-stream")
        if hdrs.DATE not in headers:
            fields.append(f"Date: {self._listener.date}")
        keep_alive = request.keep_alive
        version = request.version
        if hdrs.CONNECTION not in headers:
            # Closing (reading stopped) ends the connection after the last request parsed, not
            # before those still queued (a pipelined late body's 408 among them).
            if keep_alive and not (self._closing and not self._queue) and not self._listener.closing:
                if version == HttpVersion10:
                    fields.append("Connection: keep-alive")
            else:
                keep_alive = False
                if version == HttpVersion11:
                    fields.append("Connection: close")
        self._write_head(version, status, _reason(status), fields, body)
        return keep_alive

    def _write_response(self, request: web.Request, response: web.Response) -> bool:
        """Serialise a plain response (status line, headers, body) in one write."""
        method, status = request.method, response.status
        headers = response.headers
        body = cast(bytes, response._body or b"")  # bytes or bytearray (checked by _send)
        if 200 <= status < 300 and status != 204 and method != "HEAD" and method != "CONNECT":
            # The common case in straight lines: a body, its length, its type.
            if hdrs.CONTENT_LENGTH not in headers:
                headers[hdrs.CONTENT_LENGTH] = str(len(body))
            if body and hdrs.CONTENT_TYPE not in headers:
                headers[hdrs.CONTENT_TYPE] = "application/octet-stream"
        else:  # aiohttp's rules for the statuses and methods that carry no body
            if hdrs.CONTENT_LENGTH in headers:
                if should_remove_content_length(method, status):
                    del headers[hdrs.CONTENT_LENGTH]
            elif body or (status != 304 and method != hdrs.METH_HEAD):
                headers[hdrs.CONTENT_LENGTH] = str(len(body))
            if must_be_empty_body(method, status):
                headers.pop(hdrs.TRANSFER_ENCODING, None)
                body = b""
            elif body:
                headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
        if hdrs.DATE not in headers:
            headers[hdrs.DATE] = self._listener.date
        keep_alive = response._keep_alive
        if keep_alive is None:
            keep_alive = request.keep_alive
        version = request.version
        if hdrs.CONNECTION not in headers:
            # As in `_write_plain`: the requests still queued are answered first.
            if keep_alive and not (self._closing and not self._queue) and not self._listener.closing:
                if version == HttpVersion10:
                    headers[hdrs.CONNECTION] = "keep-alive"
            else:
                keep_alive = False
                if version == HttpVersion11:
                    headers[hdrs.CONNECTION] = "close"
        self._write_head(version, status, response.reason,
                         [f"{name}: {value}" for name, value in headers.items()], body)
        response._eof_sent = True
        return keep_alive

    def _write_head(self, version: HttpVersion, status: int, reason: str, fields: list[str],
                    body: bytes) -> None:
        """The status line, `fields` and `body` in one write; ValueError (nothing written) when
        a field holds a line break."""
        probe = "".join(fields)
        if "\r" in probe or "\n" in probe:  # a header injected into the response: refuse
            raise ValueError("a response header holds a line break")
        head = (f"HTTP/{version.major}.{version.minor} {status} {reason}\r\n"
                + "\r\n".join(fields) + "\r\n\r\n")
        transport = self.transport
        assert transport is not None
        transport.write(head.encode("utf-8") + body if body else head.encode("utf-8"))

    def _done(self, keep_alive: bool) -> None:
        """The request in progress was answered: the next one, or close, or wait idle."""
        if self.transport is None:
            return
        if not keep_alive or self._listener.closing:
            self._close()
            return
        if self._queue:
            self._next()
            return
        if self._closing:
            self._close()
            return
        self._last_active = self._loop.time()
        if self._keep_timer is None:
            self._keep_timer = self._loop.call_later(self._listener.keepalive_timeout,
                                                     self._keep_expired)

    def _refuse(self, error: _HeadError) -> None:
        """Answer `error` after the requests before it, then close; parse nothing more."""
        if self._sink is not None:
            self._reader(self._sink).set_exception(web.RequestPayloadError(error.reason))
            self._sink = None
        self._in_head = False
        self._end_lean()
        self._stop_reading()
        on_bad_request = self._listener.on_bad_request
        if on_bad_request is not None:
            on_bad_request()
        self._queue.append(error)
        if self._task is None:
            self._next()

    def _write_error(self, error: _HeadError) -> None:
        if self.transport is not None:
            self.transport.write(_error_bytes(error.status, error.reason))
        self._close()

    def _stop_reading(self) -> None:
        """Parse nothing more; close once the requests already parsed are answered."""
        self._stopped = True
        self._closing = True
        self._pause_transport_reading()

    def _close(self) -> None:
        self._stopped = True
        if self.transport is not None:
            self.transport.close()  # what was written is still sent

    # ---- timers and shutdown ---------------------------------------------------------------

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport is None:
            return
        if self._task is not None or self._queue:
            # A request in progress is never cut off; a head pipelined behind it is timed again.
            if self._in_head:
                self._head_timer = self._loop.call_later(self._listener.header_timeout,
                                                         self._head_expired)
            return
        on_timeout = self._listener.on_header_timeout
        if on_timeout is not None:
            on_timeout()
        self.transport.abort()  # nothing is sent: the client never finished a request

    def _end_lean(self) -> None:
        """Forget a hot-route body being received (and its deadline)."""
        self._lean = None
        self._lean_body = bytearray()
        if self._lean_since:
            self._lean_since = 0.0
            self._listener.receiving.discard(self)

    def body_late(self, now: float) -> None:
        """The listener's tick: a hot-route body not whole `header_timeout` after its deadline
        started (`_feed`) is late. Its request goes to the application the usual way with a body
        reader that fails `TimeoutError`, which the MCP fronts' `read_body` refuses as it
        refuses a late body it reads itself (408, `body_timeout`, the connection closed), and
        nothing more is read on this connection."""
        message = self._lean
        if message is None or self.transport is None:
            self._end_lean()
            return
        if now - self._lean_since < self._listener.header_timeout:
            return
        if self._tail:  # the proxy holds the rest back (pipelined requests queued): not late
            self._lean_since = now
            return
        self._end_lean()
        payload = StreamReader(self, _READ_LIMIT, loop=self._loop)
        payload.set_exception(TimeoutError(
            f"the body did not arrive within {self._listener.header_timeout:g} s"))
        self._stop_reading()
        self._queue.append((message, payload))
        if self._task is None:
            self._next()

    def _keep_expired(self) -> None:
        self._keep_timer = None
        if self._task is not None or self._queue or self._in_head or self._lean is not None \
                or self.transport is None:
            return  # busy, or a head is arriving (its own timer): armed again when idle
        left = self._last_active + self._listener.keepalive_timeout - self._loop.time()
        if left > 0:
            self._keep_timer = self._loop.call_later(left, self._keep_expired)
        else:
            self._close()

    def close_if_idle(self) -> bool:
        """Close the connection now unless a request is in progress; whether it was idle."""
        if self._task is None and not self._queue and self._lean is None:
            self._close()
            return True
        self._closing = True
        return False

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


_NO_MATCH: Final[Mapping[str, str]] = MappingProxyType({})
HotRoute = tuple[Handler, Mapping[str, str]]

_URLS: dict[str, URL] = {}  # request target -> its URL: clients repeat a handful of paths
_MAX_URLS: Final = 1024


def _url(target: str) -> URL:
    """The request target as aiohttp's parser builds it (origin form, else as given); parsed
    once per distinct target (yarl's parse is ~10% of a request's cost here). URLs are
    immutable, so sharing one between requests is safe; the cache is bounded by emptying it."""
    url = _URLS.get(target)
    if url is None:
        url = _parse_url(target)
        if len(_URLS) >= _MAX_URLS:
            _URLS.clear()
        _URLS[target] = url
    return url


def _parse_url(target: str) -> URL:
    if target[:1] == "/":
        path, _, query = target.partition("?")
        query, _, fragment = query.partition("#")
        if not query and "#" in path:
            path, _, fragment = path.partition("#")
        return URL.build(path=path, query_string=query, fragment=fragment, encoded=True)
    try:
        return URL(target, encoded=True)
    except ValueError as exc:
        raise _HeadError(400, "Bad Request: invalid request target") from exc


class FastListener:
    """Serves one `web.Application` on one socket with `_Connection`s; the MCP listener's
    `web.AppRunner` + `web.TCPSite` when `listener.kind` is `fast`."""

    def __init__(self, app: web.Application, *, header_timeout: float, keepalive_timeout: float,
                 shutdown_timeout: float, on_header_timeout: Callable[[], None] | None = None,
                 on_bad_request: Callable[[], None] | None = None):
        self.app = app
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.shutdown_timeout = shutdown_timeout
        self.on_header_timeout = on_header_timeout
        # Told of every request the parser refuses (400, or 431 for a head too large).
        self.on_bad_request = on_bad_request
        self.connections: set[_Connection] = set()
        # Connections receiving a hot-route body that did not come with its head (`body_late`).
        self.receiving: set[_Connection] = set()
        self.closing = False
        self.prepare_hooks = False
        self.handler: Handler = app._handle
        # The hot route's resources (see `LeanRequest`), and the router's answer per path.
        self.lean = False
        self.hot_resources: frozenset[AbstractResource] = frozenset()
        self.hot: dict[str, HotRoute | None] = {}
        self._server: asyncio.base_events.Server | None = None
        self._started = False
        self.loop = asyncio.get_event_loop()
        # The `Date` header value, refreshed every second by a timer rather than per response.
        self.date = formatdate(usegmt=True)
        self._clock: asyncio.TimerHandle | None = None

    async def setup(self) -> None:
        """Run the application's startup hooks and freeze it, as `web.AppRunner.setup` does."""
        self.loop = loop = asyncio.get_running_loop()
        app = self.app
        app._set_loop(loop)
        app.on_startup.freeze()
        await app.startup()
        app.freeze()
        self._started = True
        self.prepare_hooks = bool(app.on_response_prepare)
        self.handler = app._handle
        router = app.router
        self.hot_resources = frozenset(
            r for r in router.resources()
            if isinstance(r, PlainResource | DynamicResource) and _HOT_PATH.fullmatch(r.canonical))
        # A middleware, a prepare hook or a domain-matched sub-application would read more of
        # the request than `LeanRequest` offers: then every request goes through `app._handle`.
        self.lean = bool(self.hot_resources) and not app.middlewares and not self.prepare_hooks \
            and not router._matched_sub_app_resources
        self._tick()

    async def resolve_hot(self, request: web.Request) -> HotRoute | None:
        """The guarded handler and match of the hot route `request` reaches, or None for any
        other route: the application's router decides, once per distinct path."""
        match_info = await self.app.router.resolve(request)
        route = match_info.route
        hot: HotRoute | None = None
        if match_info.http_exception is None and route.resource in self.hot_resources:
            hot = (route.handler, MappingProxyType(dict(match_info)))
        if len(self.hot) >= _MAX_URLS:
            self.hot.clear()
        self.hot[request.rel_url.raw_path] = hot
        return hot

    def _tick(self) -> None:
        self.date = formatdate(usegmt=True)
        if self.receiving:
            now = self.loop.time()
            for conn in list(self.receiving):
                conn.body_late(now)
        self._clock = self.loop.call_at(math.floor(self.loop.time()) + 1.0, self._tick)

    async def start(self, host: str, port: int, *, reuse_port: bool | None = None,
                    backlog: int = 1024) -> None:
        """Listen on `host:port` (OSError when it cannot)."""
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_port=reuse_port, backlog=backlog,
            reuse_address=True)

    @property
    def addresses(self) -> list[Any]:
        server = self._server
        if server is None:
            return []
        return [s.getsockname() for s in server.sockets if s.family in (socket.AF_INET, socket.AF_INET6)]

    async def cleanup(self) -> None:
        """Stop accepting, close idle connections, let in-flight requests finish within
        `shutdown_timeout`, cancel what remains, close every connection, run the app's
        shutdown and cleanup hooks."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        await asyncio.sleep(0)  # connections accepted just now are made before they are counted
        for conn in list(self.connections):
            conn.close_if_idle()
        if self._started:
            await self.app.shutdown()
        busy = self._tasks()
        if busy:
            await asyncio.wait(busy, timeout=self.shutdown_timeout)
        for conn in list(self.connections):
            conn.cancel()
        busy = self._tasks()
        if busy:  # cancelled handlers finish (their audit records)
            await asyncio.wait(busy, timeout=1.0)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None
        if self._started:
            await self.app.cleanup()
            self._started = False

    def _tasks(self) -> set[asyncio.Task[None]]:
        return {conn._task for conn in self.connections if conn._task is not None}
