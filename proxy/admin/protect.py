"""What the admin listener trusts less than a caller would like: its Host, and upstream URLs.

- `host_guard`: a middleware for the whole admin application refusing (421) a request whose Host
  is not a loopback name, the admin listen address, one of `admin_allowed_hosts` or an IP
  address. A page on any web site can make a browser send requests to loopback through a DNS
  name of its own that resolves there (DNS rebinding); the Host header still carries that name,
  so it is refused. An IP literal cannot be rebound (the browser sends the name it resolved),
  and is what kubelet probes and Prometheus send when they address a pod by its IP.
- `strip_credentials`: an upstream URL as the admin API shows it, without the secrets operators
  put in URLs (userinfo, query parameters named like a token, key, secret or password, and the
  fragment).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
REDACTED = "REDACTED"
# Query parameter names whose values are credentials (case-insensitive, anywhere in the name:
# `api_key`, `access_token`, `X-Amz-Signature` (sig), `client_secret`, `passwd`...).
_SECRET_PARAM = re.compile(r"token|key|secret|passw|pwd|auth|sig|credential", re.IGNORECASE)

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
                return web.Response(
                    body=orjson.dumps({"error": f"misdirected request: host "
                                                f"{request.headers.get('Host', '')!r} is not allowed"}),
                    status=421, content_type="application/json",
                    headers={"Cache-Control": "no-store"})
        return await handler(request)

    return guard


def strip_credentials(url: str | None) -> str | None:
    """`url` without userinfo and with credential-named query values replaced by `REDACTED`;
    a URL that cannot be parsed is shown as `REDACTED` whole (it may hold anything)."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return REDACTED
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if port is not None:
        netloc = f"{netloc}:{port}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if _SECRET_PARAM.search(k) else v) for k, v in pairs],
                          safe=REDACTED)
    # The fragment is never sent to the upstream; it can only hold what should not be shown.
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
