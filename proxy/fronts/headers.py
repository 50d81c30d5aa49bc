"""Which header fields cross the proxy, in both directions (RFC 9110 §7.6.1, header smuggling).

- **Hop-by-hop fields** are never forwarded: `Connection`, every field a `Connection` header
  names, and the standard ones (`HOP_BY_HOP`). Not a client's toward an upstream, not an
  upstream's toward the client (JSON and SSE answers alike).
- **A `Connection` that names a field the proxy reads or sets itself** (`Authorization`, `Host`,
  `Mcp-*`, `X-Envelope-*`, `X-Forwarded-*`, trace context: `protected`), or more than
  `MAX_NOMINATED` fields, is refused 400 by the guard, as Envoy refuses a nominated
  `X-Forwarded-*`: removing such a field would leave the proxy and the upstream with two
  readings of one request. The proxy's own headers toward an upstream (its credential, the
  session, trace context) are added after the client's are filtered, so no name a client
  sends removes them.
- **A request field whose name holds `_`** (`X_Envelope_Run`): CGI/WSGI and other upstream
  frameworks read `_` and `-` as one character, so it can pass for a field the proxy strips or
  sets. `listener.underscore_headers` says what happens: `drop` (default: not forwarded,
  counted), `reject` (400 from the guard), `allow` (forwarded, except a spelling of a field the
  proxy strips or sets, which is still dropped). The proxy itself reads only exact names (a
  case-insensitive map that does not fold `_`), whatever the mode.

Drops are counted in `envelope_headers_dropped_total{direction, reason}`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Literal

from multidict import MultiMapping, istr

__all__ = [
    "HOP_BY_HOP", "MAX_NOMINATED", "UnderscoreAction", "connection_refusal", "layered", "nominated",
    "protected", "underscored",
]

UnderscoreAction = Literal["drop", "reject", "allow"]

# RFC 9110 §7.6.1 plus what Envoy and nginx also treat as hop-by-hop (`Proxy-*`), and the
# framing the proxy writes itself (`Content-Length`, `Host`).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "content-length", "host",
})
# A `Connection` naming more fields than this is refused (Envoy's bound).
MAX_NOMINATED = 10
# Fields the proxy reads or sets: a client must not make them hop-by-hop.
_PROTECTED = frozenset({
    "authorization", "host", "content-length", "content-type", "content-encoding", "accept", "origin", "cookie",
    "last-event-id", "idempotency-key", "forwarded", "traceparent", "tracestate", "baggage",
})
_PROTECTED_PREFIXES = ("mcp-", "x-envelope-", "x-forwarded-")
# `Connection` options that name no field, and the hop-by-hop fields (dropped anyway).
_OPTIONS = (HOP_BY_HOP - {"host", "content-length"}) | {"close", "http2-settings"}
_NONE: frozenset[str] = frozenset()
# `Connection` values as clients send them that name no field (any other spelling is parsed).
_PLAIN = frozenset({"close", "keep-alive", "Close", "Keep-Alive", "keep-alive, close"})
_CONNECTION = istr("Connection")  # folded once, not per lookup


def protected(name: str) -> bool:
    """Whether `name` (lower case) is a field the proxy reads or sets itself."""
    return name in _PROTECTED or name.startswith(_PROTECTED_PREFIXES)


def nominated(headers: MultiMapping[str]) -> frozenset[str]:
    """The field names (lower case) every `Connection` header of `headers` names, besides the
    options and hop-by-hop fields (`close`, `keep-alive`, ...: dropped anyway)."""
    if _CONNECTION not in headers:  # the cheapest test (measured): most answers have none
        return _NONE
    values = headers.getall(_CONNECTION)
    if len(values) == 1 and values[0] in _PLAIN:  # most requests: no lower-casing, one lookup
        return _NONE
    return frozenset(t for v in values for t in (p.strip().lower() for p in v.split(",")) if t) - _OPTIONS


def connection_refusal(named: frozenset[str]) -> str | None:
    """Why a request whose `Connection` names `named` (`nominated`) is refused (a protected
    field, or too many), or None."""
    if len(named) > MAX_NOMINATED:
        return f"the Connection header names more than {MAX_NOMINATED} fields"
    for name in sorted(named):
        if protected(name):
            return (f"the Connection header names {name[:100]}, a field the proxy reads or sets "
                    "itself; it cannot be made hop-by-hop")
    return None


def underscored(raw_headers: Collection[tuple[bytes, bytes]]) -> str | None:
    """The first field name holding `_`, or None (one C-speed scan in the common case)."""
    if b"_" not in b"\t".join(name for name, _ in raw_headers):
        return None
    return next(name.decode("latin-1") for name, _ in raw_headers if b"_" in name)


def layered(*layers: Mapping[str, str]) -> dict[str, str]:
    """Header layers merged by field name, whatever its case: a later layer's field replaces an
    earlier one's (so `X-Api-Key` from an agent's header parameter, or the agent's forwarded
    `Authorization`, is never sent beside the upstream's configured `x-api-key` or
    `authorization`, where a server reading the first field would take it)."""
    merged: dict[str, tuple[str, str]] = {}
    for layer in layers:
        for name, value in layer.items():
            merged[name.lower()] = (name, value)
    return dict(merged.values())
