"""`FastListener` serving a small aiohttp application on a loopback port: what a client sees
for the cases the proxy's own routes cannot be made to produce (a handler that crashes, HEAD,
Expect: 100-continue, a gzip bomb, pipelining far past the queue bound, shutdown with a request in
flight). The wire behaviour shared with aiohttp is tests/e2e/test_fast_listener.py."""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from fast_served import fast_served

from proxy.app.fast_listener import FastListener


async def _crash(request: web.Request) -> web.Response:
    raise RuntimeError("a bug")


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(body=b"%d:" % len(body) + body[:20], content_type="text/plain")


async def _count(request: web.Request) -> web.Response:
    # What the body's reader held at most at once: iter_any hands over its whole buffer.
    total = largest = 0
    async for chunk in request.content.iter_any():
        total += len(chunk)
        largest = max(largest, len(chunk))
    return web.Response(text=f"{total}:{largest}")


async def _refuse(request: web.Request) -> web.Response:
    raise web.HTTPConflict(text="no")


async def _stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for n in range(3):
        await response.write(b"data: %d\n\n" % n)
    return response


# Set when a /slow request's handler starts (a test waits for its request to be in flight
# instead of guessing how long that takes).
SLOW_STARTED: list[asyncio.Event] = []


async def _slow(request: web.Request) -> web.Response:
    for started in SLOW_STARTED:
        started.set()
    await asyncio.sleep(float(request.query.get("s", "0.3")))
    return web.Response(text="done")


async def _nodelay(request: web.Request) -> web.Response:
    assert request.transport is not None
    sock = request.transport.get_extra_info("socket")
    return web.Response(text=str(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))


@pytest.fixture
async def served() -> AsyncIterator[FastListener]:
    app = web.Application()
    app.router.add_route("*", "/crash", _crash)
    app.router.add_route("*", "/echo", _echo)
    app.router.add_post("/count", _count)
    app.router.add_route("*", "/refuse", _refuse)
    app.router.add_get("/stream", _stream)
    app.router.add_get("/slow", _slow)
    app.router.add_get("/nodelay", _nodelay)
    async with fast_served(app) as listener:
        yield listener


async def exchange(listener: FastListener, data: bytes, seconds: float = 5) -> bytes:
    """Send `data`, then read until the server closes the connection."""
    port = listener.addresses[0][1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        async with asyncio.timeout(seconds):
            return await reader.read(-1)
    finally:
        writer.close()


async def test_accepted_connections_have_tcp_nodelay(served: FastListener) -> None:
    # The listener leaves TCP_NODELAY to the loop (asyncio and uvloop set it on accept): an SSE
    # event must not wait for Nagle's algorithm.
    reply = await exchange(served, b"GET /nodelay HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert reply.endswith(b"\r\n\r\n1")


async def test_a_crashing_handler_answers_500_and_closes(served: FastListener) -> None:
    out = await exchange(served, b"GET /crash HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 500 "), out
    assert b"Connection: close" in out and out.count(b"HTTP/1.1") == 1  # the second is not read


async def test_http_exceptions_and_the_router_answer_their_own_status(served: FastListener) -> None:
    out = await exchange(served, b"GET /refuse HTTP/1.1\r\nHost: x\r\n\r\n"
                                 b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 409 ") and b"HTTP/1.1 404 " in out, out


async def test_head_has_no_body_and_expect_continue_is_answered(served: FastListener) -> None:
    out = await exchange(served, b"HEAD /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"\r\n\r\n"), out
    port = served.addresses[0][1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n"
                 b"Connection: close\r\n\r\n")
    async with asyncio.timeout(5):
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        out = await reader.read(-1)
    writer.close()
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"5:hello"), out


async def test_a_streamed_response_is_chunked_and_the_connection_reused(served: FastListener) -> None:
    out = await exchange(served, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
                                 b"GET /slow?s=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    first, _, rest = out.partition(b"0\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in first and b"data: 2" in first, out
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"done"), out


async def test_a_gzip_bomb_is_decoded_in_bounded_steps(served: FastListener) -> None:
    # 64 MiB of zeros in ~64 KB: the reader pauses the decoder, the handler reads it all in
    # bounded chunks; nothing holds the whole inflated body but the handler's own read.
    bomb = gzip.compress(b"\0" * (64 * 2**20), compresslevel=9)
    head = (b"POST /count HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(bomb))
    out = await exchange(served, head + bomb, seconds=30)
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    total, largest = map(int, out.rsplit(b"\r\n\r\n", 1)[1].split(b":"))
    assert total == 64 * 2**20 and largest <= 2**20, (total, largest)
    bad = b"not gzip at all"
    out = await exchange(served, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(bad), bad))
    assert out.startswith(b"HTTP/1.1 500 ") or out.startswith(b"HTTP/1.1 400 "), out


async def test_hundreds_of_pipelined_requests_in_one_write_are_answered_in_order(served: FastListener) -> None:
    requests = b"".join(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n%03d" % n
                        for n in range(300))
    out = await exchange(served, requests + b"GET /slow?s=0 HTTP/1.1\r\nConnection: close\r\n\r\n")
    bodies = [part.rsplit(b"\r\n\r\n", 1)[-1] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
    assert bodies == [b"3:%03d" % n for n in range(300)] + [b"done"]


async def test_cleanup_lets_a_request_in_flight_finish_and_closes_idle_connections(
        served: FastListener) -> None:
    port = served.addresses[0][1]
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    started = asyncio.Event()
    SLOW_STARTED.append(started)
    try:
        in_flight = asyncio.create_task(exchange(served, b"GET /slow?s=0.5 HTTP/1.1\r\nHost: x\r\n\r\n"))
        await asyncio.wait_for(started.wait(), 10)  # the request is in its handler
    finally:
        SLOW_STARTED.remove(started)
    await served.cleanup()
    out = await in_flight
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"done"), out
    async with asyncio.timeout(2):
        assert await idle_reader.read() == b""
    idle_writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_an_upgrade_request_is_answered_by_its_route_then_the_connection_closes(
        served: FastListener) -> None:
    out = await exchange(served, b"GET /slow?s=0 HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                                 b"Upgrade: websocket\r\n\r\n\x81\x85garbage frames")
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"done"), out
