"""FastForwarder and the aiohttp Forwarder side by side on real servers: an aiohttp app on
loopback, the official MCP SDK demo server (json and sse modes) and a raw socket upstream that
hangs up after reading a request. Both must see the same."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.errors import ReplyTooLarge, UpstreamBusy, UpstreamError
from proxy.upstream.forwarder import Forwarder, UpstreamResponse
from proxy.upstream.transport import FastForwarder
from tests.harness import ROOT, free_port, stop, wait_port
from tests.unit.test_transport import Handler, Server, answer_once_then_hang_up, read_request

MCP_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "MCP-Protocol-Version": "2025-06-18",
}
INITIALIZE = orjson.dumps({
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
               "clientInfo": {"name": "transport-test", "version": "0"}},
})


@pytest.fixture
async def forwarders() -> AsyncIterator[tuple[Forwarder, FastForwarder]]:
    slow, fast = Forwarder(), FastForwarder()
    await slow.start()
    await fast.start()
    yield slow, fast
    await slow.close()
    await fast.close()


async def exchange(fwd: Forwarder, method: str, url: str, headers: dict[str, str],
                   body: bytes | None, stream: bool = False) -> tuple[int, Any, bytes, list[bytes]]:
    resp: UpstreamResponse = await fwd.open(method, url, headers, body, connect_timeout=5,
                                            read_timeout=10)
    async with resp:
        if stream:
            chunks = [c async for c in resp.chunks()]
            data = b"".join(chunks)
        else:
            chunks, data = [], await resp.read()
        return resp.status, resp.headers.copy(), data, chunks


# ---- a real aiohttp server ---------------------------------------------------------------

async def _json(request: web.Request) -> web.Response:
    body = await request.read()
    seen = {"method": request.method, "path": request.path_qs, "body": body.decode(),
            "x-custom": request.headers.getall("X-Custom", []),
            "content-length": request.headers.get("Content-Length")}
    resp = web.json_response(seen, headers={"Mcp-Session-Id": "abc"})
    resp.headers.add("Set-Cookie", "a=1")
    resp.headers.add("Set-Cookie", "b=2")
    return resp


async def _sse(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(f"data: {{\"n\":{i}}}\n\n".encode())
        await asyncio.sleep(0.02)
    await resp.write_eof()
    return resp


async def _big(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * 3_000_000, content_type="application/octet-stream")


async def _big_chunked(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for _ in range(30):
        await resp.write(b"x" * 100_000)
    await resp.write_eof()
    return resp


async def _empty(request: web.Request) -> web.Response:
    return web.Response(status=202)


@pytest.fixture
async def aiohttp_upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/json", _json)
    app.router.add_post("/sse", _sse)
    app.router.add_get("/big", _big)
    app.router.add_get("/big-chunked", _big_chunked)
    app.router.add_route("*", "/empty", _empty)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


DROP = {"date", "server"}


def comparable(headers: Any) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in headers.items() if k.lower() not in DROP]


async def test_aiohttp_server_same_answers(forwarders: tuple[Forwarder, FastForwarder],
                                          aiohttp_upstream: str) -> None:
    slow, fast = forwarders
    cases: list[tuple[str, str, dict[str, str], bytes | None]] = [
        ("POST", "/json?q=1", {"X-Custom": "one", "Content-Type": "application/json"}, b'{"id":1}'),
        ("POST", "/json", {}, None),
        ("GET", "/json", {"X-Custom": "g"}, None),
        ("DELETE", "/json", {}, None),
        ("GET", "/big", {}, None),
        ("POST", "/empty", {}, b"{}"),
    ]
    for _ in range(2):  # the second round runs on pooled connections
        for method, path, headers, body in cases:
            a = await exchange(slow, method, aiohttp_upstream + path, headers, body)
            b = await exchange(fast, method, aiohttp_upstream + path, headers, body)
            assert a[0] == b[0], path
            assert a[2] == b[2], path
            assert comparable(a[1]) == comparable(b[1]), path
    a = await exchange(slow, "POST", aiohttp_upstream + "/sse", {}, b"{}", stream=True)
    b = await exchange(fast, "POST", aiohttp_upstream + "/sse", {}, b"{}", stream=True)
    assert a[0] == b[0] == 200
    assert a[2] == b[2] == b'data: {"n":0}\n\ndata: {"n":1}\n\ndata: {"n":2}\n\n'
    assert len(b[3]) >= 3  # streamed event by event, not buffered whole
    assert a[1]["Content-Type"] == b[1]["Content-Type"]


# ---- the MCP SDK demo server ---------------------------------------------------------------

def _demo(mode: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.examples.demo_server", "--port", str(port), "--mode", mode],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)


@pytest.fixture
def demo_json() -> Iterator[str]:
    yield from _demo("json")


@pytest.fixture
def demo_sse() -> Iterator[str]:
    yield from _demo("sse")


def sse_payloads(data: bytes) -> list[Any]:
    out = []
    for line in data.replace(b"\r\n", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            out.append(orjson.loads(line[5:].strip()))
    return out


async def _session(fwd: Forwarder, url: str) -> tuple[tuple[int, Any, bytes, list[bytes]], dict[str, str]]:
    init = await exchange(fwd, "POST", url, MCP_HEADERS, INITIALIZE)
    headers = dict(MCP_HEADERS, **{"Mcp-Session-Id": init[1]["Mcp-Session-Id"]})
    note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
    status, *_ = await exchange(fwd, "POST", url, headers, note)
    assert status == 202
    return init, headers


TOOLS_LIST = orjson.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}})


async def test_demo_server_json_mode(forwarders: tuple[Forwarder, FastForwarder], demo_json: str) -> None:
    slow, fast = forwarders
    a_init, a_headers = await _session(slow, demo_json)
    b_init, b_headers = await _session(fast, demo_json)
    assert a_init[0] == b_init[0] == 200
    assert a_init[1]["Content-Type"] == b_init[1]["Content-Type"]
    assert a_init[1]["Content-Type"].startswith("application/json")
    assert a_init[2] == b_init[2]
    a = await exchange(slow, "POST", demo_json, a_headers, TOOLS_LIST)
    b = await exchange(fast, "POST", demo_json, b_headers, TOOLS_LIST)
    assert a[0] == b[0] == 200
    assert a[1]["Content-Type"] == b[1]["Content-Type"]
    assert a[2] == b[2]
    assert {t["name"] for t in orjson.loads(b[2])["result"]["tools"]} >= {"echo", "search_notes"}


async def test_demo_server_sse_mode(forwarders: tuple[Forwarder, FastForwarder], demo_sse: str) -> None:
    slow, fast = forwarders
    a_init, a_headers = await _session(slow, demo_sse)
    b_init, b_headers = await _session(fast, demo_sse)
    assert a_init[0] == b_init[0] == 200
    assert a_init[1]["Content-Type"] == b_init[1]["Content-Type"]
    assert a_init[1]["Content-Type"].startswith("text/event-stream")
    assert sse_payloads(a_init[2]) == sse_payloads(b_init[2])
    a = await exchange(slow, "POST", demo_sse, a_headers, TOOLS_LIST, stream=True)
    b = await exchange(fast, "POST", demo_sse, b_headers, TOOLS_LIST, stream=True)
    assert a[0] == b[0] == 200
    assert a[1]["Content-Type"] == b[1]["Content-Type"]
    assert sse_payloads(a[2]) == sse_payloads(b[2])
    assert sse_payloads(b[2])[0]["result"]["tools"]
    # an unknown session: both see the same refusal
    bad = dict(MCP_HEADERS, **{"Mcp-Session-Id": "no-such-session"})
    a = await exchange(slow, "POST", demo_sse, bad, TOOLS_LIST)
    b = await exchange(fast, "POST", demo_sse, bad, TOOLS_LIST)
    assert a[0] == b[0]
    assert a[2] == b[2]


# ---- resending: a raw upstream that answers once, then reads a request and hangs up ---------
# (what a stale keep-alive connection and an upstream that dies performing a destructive call
# both look like)

def both(forwarders: tuple[Forwarder, FastForwarder]) -> list[tuple[str, Forwarder]]:
    return [("aiohttp", forwarders[0]), ("fast", forwarders[1])]


@pytest.mark.parametrize("method", ["POST", "DELETE", "PUT", "GET"])
async def test_a_request_that_reached_the_upstream_is_sent_once_by_default(
        forwarders: tuple[Forwarder, FastForwarder], method: str) -> None:
    for name, fwd in both(forwarders):
        box: list[Server] = []
        async with Server(answer_once_then_hang_up(box)) as srv:
            box.append(srv)
            async with await fwd.open(method, srv.url, {}, b"{}", connect_timeout=5,
                                      read_timeout=5) as resp:  # pooled
                assert await resp.read() == b"ok" and resp.attempts == 1
            with pytest.raises(UpstreamError) as err:
                await fwd.open(method, srv.url, {}, b'{"call":"delete_repo"}', connect_timeout=5,
                               read_timeout=5)
            assert err.value.attempts == 1, name
            assert not str(err.value).startswith("cannot connect to upstream"), name
            await asyncio.sleep(0.1)
            bodies = [body for _, body in srv.requests]
            assert bodies == [b"{}", b'{"call":"delete_repo"}'], name  # exactly once
            assert srv.connections == 1, name


@pytest.mark.parametrize("method", ["POST", "DELETE"])
async def test_a_resend_allowed_by_the_caller_is_sent_at_most_twice(
        forwarders: tuple[Forwarder, FastForwarder], method: str) -> None:
    for name, fwd in both(forwarders):
        box: list[Server] = []
        async with Server(answer_once_then_hang_up(box)) as srv:
            box.append(srv)
            async with await fwd.open(method, srv.url, {}, b"{}", connect_timeout=5,
                                      read_timeout=5, resend=True) as resp:
                assert await resp.read() == b"ok"
            with pytest.raises(UpstreamError) as err:
                await fwd.open(method, srv.url, {}, b'{"n":2}', connect_timeout=5,
                               read_timeout=5, resend=True)
            assert err.value.attempts == 2, name
            await asyncio.sleep(0.1)
            assert [body for _, body in srv.requests] == [b"{}", b'{"n":2}', b'{"n":2}'], name


async def test_a_resend_that_succeeds_says_so(forwarders: tuple[Forwarder, FastForwarder]) -> None:
    for name, fwd in both(forwarders):
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await read_request(reader)  # connection 1 drops the second request unanswered

        async with Server(handler) as srv:
            for attempts in (1, 2):
                async with await fwd.open("POST", srv.url, {}, b"{}", connect_timeout=5,
                                          read_timeout=5, resend=True) as resp:
                    assert await resp.read() == b"ok"
                    assert resp.attempts == attempts, name


async def test_a_refused_connection_is_a_connect_failure(
        forwarders: tuple[Forwarder, FastForwarder]) -> None:
    port = free_port()
    for name, fwd in both(forwarders):
        for method in ("POST", "GET"):
            with pytest.raises(UpstreamError) as err:
                await fwd.open(method, f"http://127.0.0.1:{port}/mcp", {}, None, connect_timeout=5,
                               read_timeout=5)
            assert str(err.value).startswith("cannot connect to upstream"), name
            assert err.value.attempts == 0, name


async def test_a_resend_that_cannot_connect_is_not_a_connect_failure(
        forwarders: tuple[Forwarder, FastForwarder]) -> None:
    for name, fwd in both(forwarders):
        box: list[Server] = []
        srv = Server(answer_once_then_hang_up(box))
        box.append(srv)
        async with srv:
            async with await fwd.open("POST", srv.url, {}, b"{}", connect_timeout=5,
                                      read_timeout=5, resend=True) as resp:
                assert await resp.read() == b"ok"
            assert srv.server is not None
            srv.server.close()  # stop listening: the resend's connection is refused
            await srv.server.wait_closed()
            with pytest.raises(UpstreamError) as err:
                await fwd.open("POST", srv.url, {}, b"{}", connect_timeout=5, read_timeout=5,
                               resend=True)
        # Written once: callers must not retry it as a request that never left.
        assert err.value.attempts == 1, name
        assert not str(err.value).startswith("cannot connect to upstream"), name
        assert "resending it failed: cannot connect to upstream" in str(err.value), name


# ---- bounds: the streams' own budget, capped reads (both forwarders) -----------------------

def streams_and_calls(closed: list[int]) -> Handler:
    """GET: an SSE stream held open until the client closes it (its connection number is then
    in `closed`); anything else: `ok`, keep-alive."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            head, _ = await read_request(reader)
            if head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata:\n\r\n")
                await writer.drain()
                try:
                    await reader.read(1)
                finally:
                    closed.append(n)
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    return handler


async def _stream(fwd: Forwarder, url: str) -> UpstreamResponse:
    resp = await fwd.open("GET", url, {"Accept": "text/event-stream"}, None, connect_timeout=2,
                          read_timeout=None, long_lived=True)
    assert resp.status == 200 and await anext(resp.chunks()) == b"data:\n"
    return resp


@pytest.mark.parametrize("kind", ["aiohttp", "fast"])
async def test_long_lived_streams_never_take_a_calls_connection(kind: str) -> None:
    # One connection for calls, two for streams: the third stream is refused at once, and
    # calls keep their connection however many streams are open.
    fwd = (Forwarder if kind == "aiohttp" else FastForwarder)(1, stream_limit_per_host=2)
    await fwd.start()
    closed: list[int] = []
    try:
        async with Server(streams_and_calls(closed)) as srv:
            streams = [await _stream(fwd, srv.url) for _ in range(2)]
            with pytest.raises(UpstreamBusy, match=r"already has 2 long-lived streams open "
                                                   r"\(limits\.max_upstream_streams\)") as busy:
                await asyncio.wait_for(fwd.open("GET", srv.url, {}, None, connect_timeout=2,
                                                read_timeout=None, long_lived=True), 1)
            assert busy.value.attempts == 0
            for _ in range(3):  # calls: the pool's one connection, never waiting on the streams
                async with await fwd.open("POST", srv.url, {}, b"{}", connect_timeout=0.5,
                                          read_timeout=2) as resp:
                    assert await resp.read() == b"ok"
            streams[0].close()  # a stream that ends frees its slot (and its connection)
            for _ in range(100):
                if closed:
                    break
                await asyncio.sleep(0.02)
            assert len(closed) == 1
            streams[0] = await _stream(fwd, srv.url)
            for resp in streams:
                resp.close()
            assert srv.connections == 4  # three streams and one call connection
    finally:
        await fwd.close()


@pytest.mark.parametrize("kind", ["aiohttp", "fast"])
async def test_a_capped_read_refuses_a_larger_body(kind: str, aiohttp_upstream: str) -> None:
    fwd = Forwarder() if kind == "aiohttp" else FastForwarder()
    await fwd.start()
    try:
        for path in ("/big", "/big-chunked"):  # 3 MB, with and without Content-Length
            async with await fwd.open("GET", aiohttp_upstream + path, {}, None, connect_timeout=2,
                                      read_timeout=5) as resp:
                with pytest.raises(ReplyTooLarge, match=r"^reply exceeds 1000000 bytes \(x\.cap\)$"):
                    await resp.read(1_000_000, "x.cap")
            async with await fwd.open("GET", aiohttp_upstream + path, {}, None, connect_timeout=2,
                                      read_timeout=5) as resp:
                assert len(await resp.read(3_000_000)) == 3_000_000  # at the cap: whole
    finally:
        await fwd.close()


# ---- credentials in upstream URLs never reach an error message ------------------------------

async def test_an_upstream_error_does_not_quote_the_credentials_of_its_url(
        forwarders: tuple[Forwarder, FastForwarder]) -> None:
    """Refusal reasons, audit records and /readyz carry these messages: a URL's userinfo and
    credential query values are removed (the aiohttp path for userinfo URLs, the fast path for
    plain ones), whatever the library quoted."""

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for fwd, url in [(forwarders[0], f"http://agent:hunter2pass@127.0.0.1:{port}/mcp?api_key=k3yk3y"),
                         (forwarders[1], f"http://127.0.0.1:{port}/mcp?api_key=k3yk3y&region=eu"),
                         (forwarders[1], f"http://agent:hunter2pass@127.0.0.1:{port}/mcp")]:
            with pytest.raises(UpstreamError) as err:
                await fwd.open("POST", url, {}, b"{}", connect_timeout=2, read_timeout=0.3)
            message = str(err.value)
            assert "hunter2pass" not in message and "k3yk3y" not in message, message
            assert "did not answer" in message, message
        with pytest.raises(UpstreamError) as err:
            await forwarders[1].open("POST", "http://u:hunter2pass@127.0.0.1:notaport/mcp", {}, b"{}",
                                     connect_timeout=2, read_timeout=0.3)
        assert "hunter2pass" not in str(err.value)
    finally:
        server.close()
        await server.wait_closed()
