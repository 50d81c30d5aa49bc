"""The MCP listener's guard: what a request must satisfy before any front reads it.

`Guard.wrap(handler)` wraps every MCP route's handler (a plain wrapper rather than an aiohttp
middleware: aiohttp's middleware plumbing alone cost ~40k instructions per call, measured
with callgrind), checking, in this order:

- **Header values** are RFC 9110 field values made of visible ASCII, space and tab (no
  control characters, and no obs-text: MCP clients send non-ASCII values base64-encoded as
  `=?base64?...?=`). A value with any other byte is refused with HTTP 400 before anything else
  reads it, and the refusal is audited (`invalid_request`, check `guard`, the header's name and
  its value escaped): an undecodable byte can never reach a check, the upstream or the audit
  log's serialiser.
- **The runs** a client names (its run, `X-Envelope-Run`, and a child run's parent,
  `X-Envelope-Parent-Run`) must be run ids (`proxy.envelope.types.run_id_problem`: 1 to 256
  printable ASCII characters), refused and audited like a bad header value otherwise; the admin
  API checks its run with the same rule. A child agent's name (`X-Envelope-Agent`) must be an
  id by the principal and `delegates:` rule (`proxy.identity.name_problem`: 1 to 256
  characters), refused the same way.
- **Header names** (`proxy.fronts.headers`): a `Connection` header that names a field the
  proxy reads or sets (`Authorization`, `Mcp-*`, `X-Envelope-*`, `X-Forwarded-*`, ...) or
  more than 10 fields, and, under `listener.underscore_headers: reject`, a field name holding
  `_`, are refused with HTTP 400 and audited (`invalid_request`, check `guard`, the header's
  name).
- **Host** must be present on an HTTP/1.1 request (400, connection closed: RFC 9112) and be a
  configured or loopback name (421; DNS rebinding).
- **Origin**, when present, must be configured or loopback (403).
- A declared body larger than the cap is refused at once (413); `read_body` enforces the cap
  on what actually arrives, and a deadline on when it arrives: a body not whole within
  `listener.header_timeout` is refused 408 (`body_timeout`), the connection closed.

Request bodies in a content coding: aiohttp decodes `gzip` and `deflate` (and `br`, `zstd` when
their libraries are installed) as the body is read, in bounded steps. The proxy inspects and
forwards the decoded bytes, so the cap applies to the decoded size (a small gzip bomb is refused
413 before it inflates into memory) and the client's `Content-Encoding` is not passed upstream
(`body_decoded`). A body in any other coding is refused 415: the proxy never forwards bytes it
could not read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11

from proxy.envelope.pipeline import Envelope
from proxy.envelope.types import run_id_problem
from proxy.expect import UNSUPPORTED, continue_or_refuse
from proxy.fronts import jsonrpc
from proxy.fronts.headers import connection_refusal, nominated, underscored
from proxy.fronts.jsonrpc import BadMessage
from proxy.fronts.render import rpc_error
from proxy.identity import name_problem
from proxy.observability import tracing
from proxy.observability.metrics import Metrics, RejectReason

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# Set on a request the route's `expect_handler` checked and let go on (`Guard.wrap` skips it).
_PASSED = web.RequestKey("envelope.guard.passed", bool)
# The headers naming a run (`run_id_problem` holds both): the call's own, and its parent's.
_RUN_HEADERS = ("X-Envelope-Run", "X-Envelope-Parent-Run")
# Bytes a header value may hold: HTAB, SP and visible ASCII.
_FIELD_VALUE = bytes([0x09, *range(0x20, 0x7F)])

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class GuardSettings:
    max_body_bytes: int
    allowed_hosts: frozenset[str]  # lower-case host names without port; "*" allows any
    allowed_origins: frozenset[str]  # exact origins ("https://app.example"); loopback always ok
    reject_underscores: bool = False  # `listener.underscore_headers: reject`


def invalid_header(request: web.Request) -> tuple[str, bytes] | None:
    """The first header whose value holds a byte outside a field value, or None."""
    for name, value in request.raw_headers:
        if value.translate(None, _FIELD_VALUE):
            return name.decode("latin-1"), value
    return None


def _host_allowed(request: web.Request, allowed: frozenset[str]) -> str | None:
    """None when the Host is allowed; else the host as sent."""
    if "*" in allowed:
        return None
    host = (request.host or "").lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if host.startswith("[") and "]" in host:
        name = host[: host.index("]") + 1]
    if name in allowed or name.strip("[]") in allowed:
        return None
    return host


def missing_host(metrics: Metrics) -> web.Response:
    """The refusal of an HTTP/1.1 request with no Host, counted `bad_host`: 400, and the
    connection closed. RFC 9112 3.2 requires the 400 (nginx and Envoy send it); served, the
    request would take the listening socket's address as its host. `Guard.check` answers it
    under `listener: fast`; under `listener: aiohttp` aiohttp's parser refuses the request
    before any route sees it, and the listener answers with this instead (`proxy.app.listener`),
    so a client and /metrics see the same refusal from either listener."""
    metrics.rejected("bad_host")
    refused = rpc_error(400, None, jsonrpc.INVALID_REQUEST,
                        "Bad Request: an HTTP/1.1 request must carry a Host header")
    refused.force_close()
    return refused


class Guard:
    """The checks above, for one listener (see the module docstring)."""

    def __init__(self, settings: GuardSettings, envelope: Envelope, metrics: Metrics):
        self.settings = settings
        self.envelope = envelope
        self.metrics = metrics

    def wrap(self, handler: Handler) -> Handler:
        """`handler`, run only for requests that pass the guard (once: a request the route's
        `expect_handler` passed is not checked again)."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            if not request.get(_PASSED, False):
                refused = self.check(request)
                if refused is not None:
                    return refused
            if tracing.TRACER is None or request.method != "POST":  # GET streams, DELETE: no MCP request
                return await handler(request)
            return await tracing.server(request, handler)

        return guarded

    def expect_handler(self, shown: Callable[[web.Response], web.StreamResponse] | None = None
                       ) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
        """aiohttp's `Expect` handler for a guarded route (`expect_handler=` of its route). aiohttp
        runs it before the route's handler, so the guard runs here first: a request whose header
        values are not field values is refused (400, audited) before anything answers its
        expectation (`proxy.expect.continue_or_refuse`: 100 for `100-continue`, else 417 in
        JSON-RPC). `shown`: how the route renders a refusal (problem details on the HTTP front)."""

        async def expect(request: web.Request) -> web.StreamResponse | None:
            refused = self.check(request)
            if refused is None:
                if await continue_or_refuse(request):
                    request[_PASSED] = True
                    return None
                refused = rpc_error(417, None, jsonrpc.INVALID_REQUEST, UNSUPPORTED)
            return shown(refused) if shown is not None else refused

        return expect

    def check(self, request: web.Request) -> web.Response | None:
        """None when the request may be read; else the refusal to send."""
        settings, metrics = self.settings, self.metrics
        values = b"\t".join(value for _, value in request.raw_headers)
        if values.translate(None, _FIELD_VALUE):  # one pass over every value; then find which
            return self._invalid_header(request)
        headers = request.headers
        for field in _RUN_HEADERS:
            run = headers.get(field)
            if run:  # empty: none named (`calls.run_id` falls back to the session; no parent)
                why = run_id_problem(run)
                if why is not None:
                    return self._refused_header(request, "invalid_header", field,
                                                f"header {field}: {why}")
        agent = headers.get("X-Envelope-Agent")
        if agent:  # compared with `delegates:` names, kept in lineage and audit: held to their rule
            why = name_problem(agent)
            if why is not None:
                return self._refused_header(request, "invalid_header", "X-Envelope-Agent",
                                            f"header X-Envelope-Agent: not an agent name: {why}")
        named = nominated(request.headers)
        if named:
            reason = connection_refusal(named)
            if reason is not None:
                return self._refused_header(request, "hop_by_hop_header", "Connection", reason)
        if settings.reject_underscores:
            name = underscored(request.raw_headers)
            if name is not None:
                return self._refused_header(
                    request, "underscore_header", name,
                    f"header {name[:100]} has an underscore in its name (listener.underscore_headers: reject)")
        if request.version >= HttpVersion11 and hdrs.HOST not in request.headers:
            return missing_host(metrics)  # the fast listener's parser lets it through to here
        host = _host_allowed(request, settings.allowed_hosts)
        if host is not None:
            metrics.rejected("bad_host")
            return rpc_error(421, None, jsonrpc.INVALID_REQUEST, f"Misdirected request: host {host!r} is not allowed")
        origin = request.headers.get("Origin")
        if origin is not None and origin not in settings.allowed_origins:
            hostname = (urlsplit(origin).hostname or "").lower()
            if hostname not in LOOPBACK_HOSTS:
                metrics.rejected("bad_origin")
                return rpc_error(403, None, jsonrpc.INVALID_REQUEST, f"Forbidden: origin {origin!r} is not allowed")
        length = request.content_length
        if length is not None and length > settings.max_body_bytes:
            metrics.rejected("too_large")
            response = rpc_error(413, None, jsonrpc.INVALID_REQUEST,
                                 f"Request body larger than {settings.max_body_bytes} bytes")
            response.headers["Connection"] = "close"
            return response
        return None

    def _invalid_header(self, request: web.Request) -> web.Response:
        """Refuse (400) and audit a request carrying a header value that is not a field value."""
        bad = invalid_header(request)
        assert bad is not None
        name, value = bad
        position = next(i for i, b in enumerate(value) if bytes([b]).translate(None, _FIELD_VALUE))
        shown = value.decode("latin-1").encode("ascii", "backslashreplace").decode("ascii")
        reason = (f"header {name} holds a byte that is not allowed in a field value "
                  f"(0x{value[position]:02x} at position {position}); the request was refused")
        return self._refused_header(request, "invalid_header", name, reason, {"value": shown[:200]})

    def _refused_header(self, request: web.Request, metric: RejectReason, name: str, reason: str,
                        extra: dict[str, str] | None = None) -> web.Response:
        """Refuse (400) and audit a request for one of its headers (`name`)."""
        if not reason.endswith("refused"):
            reason += "; the request was refused"
        self.metrics.rejected(metric)
        decision_id = self.envelope.reject(
            upstream=request.match_info.get("upstream"), method=request.method,
            path=request.rel_url.raw_path, reason=reason,
            extra={"header": name[:100], **(extra or {})})
        return rpc_error(400, None, jsonrpc.INVALID_REQUEST, f"Bad Request: {reason}",
                         {"envelope/decision": {"code": "invalid_request", "check": "guard",
                                                "rule": None, "reason": reason,
                                                "decision_id": decision_id}})


def body_decoded(request: web.Request) -> bool:
    """Whether aiohttp decodes the request body from its Content-Encoding as it is read: the
    bytes the proxy reads (and forwards) are then no longer in that coding."""
    # Set on the body's stream by aiohttp's decoder (`DeflateBuffer`) and only by it.
    return getattr(request.content, "total_compressed_bytes", None) is not None


async def read_body(request: web.Request, limit: int, deadline: float | None) -> bytes:
    """The request body (decoded from its Content-Encoding, see the module docstring), refused
    (BadMessage) with 413 as soon as more than `limit` bytes arrive (decoded bytes), 415 in a
    coding the proxy cannot decode, 400 when it cannot be decoded, and 408 when it has not
    arrived whole within `deadline` seconds of the handler's start (`listener.header_timeout`;
    None: no deadline); 413 and 408 close the connection (`BadMessage.close`: the rest of the
    body may still be on the wire).

    The header timeout ends at the head: without a deadline of its own, a client sending its
    body one byte a second would hold the handler (and its connection) as long as it liked. A
    body already whole when the handler starts (the fast listener's hot route, whose body is
    buffered under the same deadline by the listener: `proxy.app.fast_listener`; and most small
    bodies, which arrive with their head) is read without a timer. A reader that fails with
    `TimeoutError` (the fast listener's, for a hot-route body that came too late) is refused as
    late too."""
    if deadline is not None and not request.content.is_eof():
        try:
            async with asyncio.timeout(deadline):
                return await read_body(request, limit, None)
        except TimeoutError as exc:
            raise BadMessage(jsonrpc.INVALID_REQUEST, f"Request Timeout: the body did not arrive "
                             f"whole within {deadline:g} s (listener.header_timeout)",
                             "body_timeout", status=408, close=True) from exc
    decoded = body_decoded(request)
    if not decoded:
        coding = request.headers.get("Content-Encoding", "").strip().lower()
        if coding not in ("", "identity"):
            raise BadMessage(jsonrpc.INVALID_REQUEST, "Unsupported Media Type: the proxy cannot "
                             f"read a body in content coding {coding[:40]!r}", "invalid_request",
                             status=415)
    length = request.content_length
    try:
        # Framed by Content-Length and not decoded (a decoded body's length is not the length of
        # what it inflates to): read it in one go.
        if length is not None and length <= limit and not decoded:
            try:
                return await request.content.readexactly(length)
            except asyncio.IncompleteReadError as exc:
                raise BadMessage(jsonrpc.PARSE_ERROR, "Parse error: the body ended before its "
                                 "Content-Length", "parse_error") from exc
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise BadMessage(jsonrpc.INVALID_REQUEST,
                                 f"Request body larger than {limit} bytes", "too_large",
                                 status=413, close=True)
    except web.RequestPayloadError as exc:  # invalid in its Content-Encoding or its framing
        what = "decoded from its Content-Encoding" if decoded else "read"
        raise BadMessage(jsonrpc.PARSE_ERROR, f"Parse error: the body cannot be {what}",
                         "parse_error") from exc
    return bytes(buf)
