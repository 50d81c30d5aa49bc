"""The fast listener's hot route (`LeanRequest`): which requests it serves without aiohttp's
`web.Request`, what a client sees when it does (plain and SSE answers, pipelining), that every
other request still goes through the application as before, and that `LeanRequest` has every
attribute the guard and the fronts read."""

from __future__ import annotations

import ast
import asyncio
import gzip
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import cast

import pytest
from aiohttp import web
from fast_served import fast_served
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.app.fast_listener import FastListener, LeanRequest
from proxy.fronts.guard import read_body
from proxy.fronts.plain import PlainAnswer
from proxy.fronts.render import writes_plain

ROOT = Path(__file__).resolve().parents[3]
# Every module that reads a request the MCP listener's handlers receive: the fronts, the app
# (the fast listener answers with it) and the tracing wrapper the guard hands it to.
SCANNED = sorted([*(ROOT / "proxy" / "fronts").glob("*.py"), *(ROOT / "proxy" / "app").glob("*.py"),
                  ROOT / "proxy" / "observability" / "tracing.py"])


def request_attributes(source: str) -> set[str]:
    """`request.<attr>` read in every function taking a `request` annotated as aiohttp's request,
    except aiohttp middlewares (the hot route is off in an application that has one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if any("middleware" in ast.unparse(d) for d in node.decorator_list):
            continue
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        if not any(a.arg == "request" and a.annotation is not None
                   and "web.Request" in ast.unparse(a.annotation) for a in args):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                    and sub.value.id == "request":
                found.add(sub.attr)
    return found


def test_lean_request_has_every_attribute_the_fronts_read() -> None:
    read = set().union(*(request_attributes(path.read_text()) for path in SCANNED))
    assert {"headers", "raw_headers", "method", "match_info", "content_length", "rel_url",
            "host", "path"} <= read  # the scan sees the guard, the fronts and tracing
    missing = sorted(attr for attr in read if not hasattr(LeanRequest, attr))
    assert not missing, f"fronts read request attributes LeanRequest lacks: {missing}"


def request_type_tests(source: str) -> list[str]:
    """`isinstance(x, web.Request)` (or BaseRequest) calls: false for a LeanRequest."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance" and len(node.args) == 2
            and any(name in ast.unparse(node.args[1]) for name in ("web.Request", "web.BaseRequest"))]


def test_no_front_tells_a_request_by_its_type() -> None:
    found = {path.name: request_type_tests(path.read_text()) for path in SCANNED}
    assert not {name: calls for name, calls in found.items() if calls}
    assert request_type_tests("isinstance(r, web.Request)") == ["isinstance(r, web.Request)"]


def test_the_scan_finds_an_attribute_lean_request_lacks() -> None:
    source = "async def handle(request: web.Request) -> None:\n    request.cookies.get('a')\n"
    found = request_attributes(source)
    assert found == {"cookies"} and not hasattr(LeanRequest, "cookies")


def test_lean_request_has_what_stream_response_prepare_reads() -> None:
    for attr in ("method", "version", "keep_alive", "headers", "_payload_writer", "_prepare_hook"):
        assert hasattr(LeanRequest, attr), attr


async def _who(request: web.Request) -> web.Response:
    body = await read_body(request, 1 << 20, 10.0)
    return web.Response(text=f"{type(request).__name__}|{dict(request.match_info)}|{len(body)}")


async def _sse(request: web.Request) -> web.StreamResponse:
    await read_body(request, 1 << 20, 10.0)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for n in range(3):
        await response.write(b"data: %d\n\n" % n)
    return response


def _app(middleware: bool = False) -> web.Application:
    @web.middleware
    async def passthrough(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        return await handler(request)

    app = web.Application(middlewares=[passthrough] if middleware else [])
    app.router.add_route("*", "/mcp/{upstream}", _who)
    app.router.add_route("*", "/mcp", _sse)
    app.router.add_route("*", "/mcpx", _who)  # not a hot route, though its path starts alike
    return app


@pytest.fixture
async def served() -> AsyncIterator[FastListener]:
    async with fast_served(_app()) as listener:
        yield listener


async def exchange(listener: FastListener, data: bytes) -> bytes:
    """Send `data`, then read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.addresses[0][1])
    writer.write(data)
    try:
        async with asyncio.timeout(5):
            return await reader.read(-1)
    finally:
        writer.close()


def post(path: str, body: bytes, *extra: str, close: bool = True) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def test_a_hot_route_post_is_answered_with_a_lean_request(served: FastListener) -> None:
    out = await exchange(served, post("/mcp/files", b'{"jsonrpc":"2.0"}'))
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"LeanRequest|{'upstream': 'files'}|17"), out
    assert b"Connection: close" in out


async def test_pipelined_hot_route_posts_are_answered_in_order(served: FastListener) -> None:
    out = await exchange(served, post("/mcp/a", b"1", close=False) + post("/mcp/b", b"22", close=False)
                         + post("/mcp/c", b"333"))
    assert out.count(b"HTTP/1.1 200 ") == 3, out
    assert out.index(b"'a'}|1") < out.index(b"'b'}|2") < out.index(b"'c'}|3"), out


async def test_an_sse_answer_to_a_lean_request_is_chunked_and_the_connection_reused(
        served: FastListener) -> None:
    out = await exchange(served, post("/mcp", b"{}", close=False) + post("/mcp/a", b"1"))
    first, _, rest = out.partition(b"0\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 ") and b"Transfer-Encoding: chunked" in first, out
    assert b"data: 2" in first, out
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"LeanRequest|{'upstream': 'a'}|1"), out


@pytest.mark.parametrize(("data", "ends"), [
    # Another route, its body buffered then handed to aiohttp's request.
    (post("/mcpx", b"hello"), b"Request|{}|5"),
    # A body larger than what the hot route buffers.
    (post("/mcp/a", b"x" * 70_000), b"Request|{'upstream': 'a'}|70000"),
    # Chunked, in a content coding, with Expect, not a POST.
    (b"POST /mcp/a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
     b"3\r\nabc\r\n0\r\n\r\n", b"Request|{'upstream': 'a'}|3"),
    (post("/mcp/a", gzip.compress(b"hello"), "Content-Encoding: gzip"), b"Request|{'upstream': 'a'}|5"),
    (post("/mcp/a", b"hello", "Expect: 100-continue"), b"Request|{'upstream': 'a'}|5"),
    (b"PUT /mcp/a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
     b"Request|{'upstream': 'a'}|2"),
])
async def test_other_requests_get_aiohttps_request(served: FastListener, data: bytes, ends: bytes) -> None:
    out = await exchange(served, data)
    assert out.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 100 ")) and out.endswith(ends), out
    assert not out.endswith(b"Lean" + ends)


async def test_a_path_no_route_matches_is_answered_by_the_router(served: FastListener) -> None:
    out = await exchange(served, post("/mcp/a/b", b"{}"))
    assert out.startswith(b"HTTP/1.1 404 "), out


async def test_an_application_with_a_middleware_never_gets_a_lean_request() -> None:
    async with fast_served(_app(middleware=True)) as listener:
        assert not listener.lean
        out = await exchange(listener, post("/mcp/files", b"{}"))
        assert out.endswith(b"Request|{'upstream': 'files'}|2") and b"Lean" not in out, out


# -- plain answers: what `render.respond` returns on the hot route ------------------------------

ANSWERS = {
    "relay": (200, {"Content-Type": "application/json", "Mcp-Session-Id": "s-1"}),  # upstream's own
    "json": (200, {"Content-Type": "application/json"}),
    "bare": (200, {"X-Other": "1"}),  # no Content-Type: the server adds octet-stream
    "lost": (404, {"Content-Type": "application/json"}),  # not 2xx: written as a web.Response
}
RETURNED: list[str] = []


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await read_body(request, 1 << 20, 10.0)
    status, headers = ANSWERS[request.match_info["upstream"]]
    reply = b'{"jsonrpc":"2.0","id":1,"result":' + body + b"}"
    if writes_plain(request):
        RETURNED.append("plain")
        return cast(web.StreamResponse, PlainAnswer(status, CIMultiDictProxy(CIMultiDict(headers)), reply))
    RETURNED.append("response")
    return web.Response(status=status, body=reply, headers=headers)


def _undated(out: bytes) -> bytes:
    return re.sub(rb"\r\nDate: [^\r]*", b"", out)


@pytest.mark.parametrize("name", sorted(ANSWERS))
@pytest.mark.parametrize("extra", [(), ("Connection: keep-alive",)])
async def test_a_plain_answer_is_written_as_its_web_response_would_be(name: str, extra: tuple[str, ...]) -> None:
    app = web.Application()
    app.router.add_route("*", "/mcp/{upstream}", _answer)
    async with fast_served(app) as listener:
        RETURNED.clear()
        lean = await exchange(listener, post(f"/mcp/{name}", b"{}", *extra, close=False)
                              + post(f"/mcp/{name}", b"[1]"))
        # The same requests chunked: aiohttp's request, a web.Response.
        chunked = await exchange(listener, b"".join(
            f"POST /mcp/{name} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n{h}\r\n"
            f"{len(b):x}\r\n{b}\r\n0\r\n\r\n".encode()
            for h, b in ((("".join(f"{e}\r\n" for e in extra)), "{}"), ("Connection: close\r\n", "[1]"))))
        assert RETURNED == ["plain", "plain", "response", "response"]
        assert lean.count(b"HTTP/1.1 ") == 2 and b"\r\nDate: " in lean, lean
        assert _undated(lean) == _undated(chunked), (lean, chunked)


async def test_a_plain_answer_with_a_line_break_in_a_header_is_a_500() -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        assert writes_plain(request)
        return cast(web.StreamResponse, PlainAnswer(200, {"X-Bad": "a\r\nSet-Cookie: b"}, b"{}"))

    app = web.Application()
    app.router.add_route("*", "/mcp/{upstream}", broken)
    async with fast_served(app) as listener:
        out = await exchange(listener, post("/mcp/a", b"{}"))
        assert out.startswith(b"HTTP/1.1 500 ") and b"Set-Cookie" not in out, out
