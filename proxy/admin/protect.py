"""What the admin listener trusts less than a caller would like: its Host, and upstream URLs.

- `host_guard`: a middleware for the whole admin application refusing (421) a request whose Host
  is not a loopback name, the admin listen address, one of `admin_allowed_hosts` or an IP
  address. A page on any web site can make a browser send requests to loopback through a DNS
  name of its own that resolves there (DNS rebinding); the Host header still carries that name,
  so it is refused. An IP literal cannot be rebound (the browser sends the name it resolved),
  and is what kubelet probes and Prometheus send when they address a pod by its IP.

Upstream URLs are shown without their credentials (`proxy.upstream.urls.strip_credentials`).
`read_body` reads an admin POST's body whole, within a size limit and a deadline (the approvals
and intent APIs).
Every refusal is the admin API's JSON (`refusal`: `{"error": ...}`), aiohttp's own 404 and 405
included (`routing_refusal`).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable, Iterable

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.expect import UNSUPPORTED, continue_or_refuse

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
# Seconds an admin request's body has to arrive whole (`read_body`): the admin application's
# `listener.header_timeout` (`build_admin_app`), the listeners' one bound on a slow client.
BODY_TIMEOUT = web.AppKey("envelope.admin.body_timeout", float)
DEFAULT_BODY_TIMEOUT = 10.0  # `listener.header_timeout`'s default

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_hosts(listen_host: str, configured: Iterable[str]) -> frozenset[str]:
    """The Host names the admin listener answers: loopback, its listen address (unless it is a
    wildcard), and the configured ones (lower-case; "*" allows any)."""
    names = set(LOOPBACK_HOSTS) | {h.lower().strip("[]") for h in configured}
    if listen_host not in ("0.0.0.0", "::", ""):
        names.add(listen_host.lower().strip("[]"))
    return frozenset(names)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _host_name(host: str) -> str:
    """The name part of a Host header value (no port, no IPv6 brackets), lower-case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.index("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_guard(allowed: frozenset[str]) -> Middleware:
    """The admin application's Host check (see the module docstring): 421 with a JSON error."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if "*" not in allowed:
            # An absent Host (HTTP/1.0) is refused too: the check cannot be made.
            name = _host_name(request.headers.get("Host", ""))
            if name not in allowed and not _is_ip(name):
                return refusal(421, f"misdirected request: host "
                                    f"{request.headers.get('Host', '')!r} is not allowed")
        return await handler(request)

    return guard


async def expect(request: web.Request) -> web.StreamResponse | None:
    """The `Expect` handler of every admin route (`expect_handler=`; `proxy.expect`): 417 in the
    admin API's JSON for an expectation other than `100-continue`."""
    if await continue_or_refuse(request):
        return None
    return refusal(417, UNSUPPORTED)


async def read_body(request: web.Request, limit: int) -> bytes | web.Response:
    """The whole request body of an admin POST (decoded from its Content-Encoding by aiohttp),
    or the admin API's JSON refusal: 413 once more than `limit` bytes arrived, 400 when it
    cannot be read (invalid in its Content-Encoding or its chunked framing), 408 when it has not
    arrived whole within the application's `BODY_TIMEOUT` (`Connection: close`).

    One `read(n)` returns what has arrived so far, not the whole body: a body sent in two TCP
    segments would be cut and refused as not JSON, so the body is read to its end. The listener's
    header timeout ends at the head: without a deadline of its own, a client sending one byte a
    second would hold the handler as long as it liked."""
    buf = bytearray()
    try:
        async with asyncio.timeout(request.app.get(BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT)):
            async for chunk in request.content.iter_any():
                buf += chunk
                if len(buf) > limit:
                    return refusal(413, f"body larger than {limit} bytes")
    except TimeoutError:
        # The handler reads no more and the answer closes the connection (aiohttp drains what
        # the client still sends for at most its lingering time, 10 s, before closing, so the
        # client can read the answer rather than meet a reset).
        refused = refusal(408, f"the body did not arrive within "
                               f"{request.app.get(BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT):g} s "
                               f"(listener.header_timeout); {len(buf)} bytes arrived")
        refused.force_close()
        return refused
    except web.RequestPayloadError as exc:
        # The rest of the body cannot be read either: the connection closes after the answer,
        # and the body counts as read (aiohttp would otherwise read on after the answer, meet
        # the error again and log it at ERROR as an unhandled exception).
        request.content.feed_eof()
        why = getattr(exc.__cause__, "message", None) or str(exc)
        refused = refusal(400, f"the body cannot be read: {' '.join(str(why).split())}")
        refused.force_close()
        return refused
    return bytes(buf)


def refusal(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An admin refusal: `{"error": message}` as JSON, never cached."""
    return web.Response(body=orjson.dumps({"error": message}), status=status,
                        content_type="application/json",
                        headers={"Cache-Control": "no-store", **(headers or {})})


def routing_refusal(request: web.Request, exc: web.HTTPException) -> web.Response | None:
    """aiohttp's plain-text 404 (no such route, or a handler's `HTTPNotFound`) or 405 (a route
    without that method, its `Allow` kept) as an admin refusal; None for any other exception."""
    # The path as sent (percent-encoded, so no control character is echoed), cut short.
    where = f"{request.method[:20]} {request.rel_url.raw_path[:200]}"
    if isinstance(exc, web.HTTPNotFound):
        return refusal(404, f"not found: {where}")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return refusal(405, f"method not allowed: {where} (allowed: {allowed})", {"Allow": allowed})
    return None
