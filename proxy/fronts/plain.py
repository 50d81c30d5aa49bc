"""A plain answer: status, headers and body, for a server that writes it itself.

`render.respond` hands one to a server whose request says `plain_answers` (the fast
listener's hot route, `proxy.app.fast_listener.LeanRequest`) in place of an aiohttp
`web.Response` for a JSON answer: the same three things, without building the response object
(its headers copied into a new multidict, its body and status set through properties, then
read back one by one to be written). Nothing else here: the listener imports it, and it
imports nothing of the proxy.
"""

from __future__ import annotations

from collections.abc import Mapping


class PlainAnswer:
    """A whole answer: `status`, `headers` (never changed by the server that writes them;
    `Content-Length`, `Date` and `Connection` are the server's to add) and `body`."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body
