"""Request framing the proxy refuses that aiohttp's request parser lets through.

A front proxy or an upstream that reads a request's framing another way than the proxy does can
be handed a request the envelope never saw (request smuggling). aiohttp's parser and llhttp
(under the fast listener) already refuse `Content-Length` with `Transfer-Encoding`, two
`Content-Length`s, obs-fold lines, bare LF and malformed chunk sizes (a second `Host`: aiohttp's
parser, and the fast listener itself); both accept two things this module refuses, for every
listener (the fast listener in its parser callback, aiohttp's in `proxy.app.listener`'s server,
before the application):

- a `Transfer-Encoding` other than `chunked` alone (`gzip, chunked`, `identity, chunked`): the
  proxy would read the chunked bytes as the body while a peer that applies the other coding reads
  something else (RFC 9112 §6.1 lets a server refuse a coding it does not implement);
- an HTTP version other than 1.0 and 1.1 (`HTTP/2.0` in a request line is not HTTP/2, and a
  peer that reads it as HTTP/0.9 frames nothing at all).

Each is answered 400 and the connection closed: what follows on the wire cannot be trusted."""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion, HttpVersion10, HttpVersion11

__all__ = ["bad_framing", "request_bad_framing"]


def bad_framing(version: HttpVersion, transfer_encoding: str | None) -> str | None:
    """Why a request with this version and `Transfer-Encoding` value is refused, or None."""
    if version != HttpVersion11 and version != HttpVersion10:
        return f"Bad Request: HTTP/{version.major}.{version.minor} is not supported"
    if transfer_encoding is not None and transfer_encoding.strip().lower() != "chunked":
        return "Bad Request: only Transfer-Encoding: chunked is supported"
    return None


def request_bad_framing(request: web.BaseRequest) -> str | None:
    """`bad_framing` of an aiohttp request."""
    return bad_framing(request.version, request.headers.get(hdrs.TRANSFER_ENCODING))
