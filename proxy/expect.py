"""How every aiohttp route of the proxy answers an `Expect` header.

aiohttp runs a route's `expect_handler` before its middlewares and handler; its default answers an
expectation it does not know with a text holding the header's value, which fails (a 500) on a
non-ASCII byte. The admin routes (`proxy.admin.protect.expect`) and the guarded MCP and HTTP routes
(`proxy.fronts.guard.Guard.expect_handler`) answer through `continue_or_refuse` instead, each
rendering the refusal in its own format."""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11

UNSUPPORTED = "Expectation Failed: only 100-continue is supported"


async def continue_or_refuse(request: web.Request) -> bool:
    """True when the request may go on: `100-continue` on HTTP/1.1 has had its 100 (as aiohttp's
    default does), or the request is HTTP/1.0, which has no expectations. False: an expectation
    the proxy does not support; the caller answers 417 (RFC 9110) without echoing it."""
    if request.version != HttpVersion11:
        return True
    if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
        return False
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the response proper has not started
    return True
