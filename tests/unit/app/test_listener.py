"""The listener's connection timeouts (`proxy.app.listener.ListenerRunner`), seen from a raw
socket on loopback: a request head that does not arrive in time closes the connection (the
first request's and a later one's), an idle keep-alive connection closes after its own
timeout, and nothing in the middle of a request or a response is ever cut."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from proxy.app.listener import ListenerRunner

# Far apart, so that a loaded machine's pauses (tenths of a second) cannot make a head's
# timeout look like the idle one, nor a head sent in pieces miss its timeout.
HEAD = 0.5
IDLE = 3.0
GET = b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class Listener:
    def __init__(self, port: int, timeouts: list[float]):
        self.port = port
        self.timeouts = timeouts  # when each late head was reported

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _upload(request: web.Request) -> web.Response:
    return web.Response(text=str(len(await request.read())))


async def _slow_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(4):
        await asyncio.sleep(HEAD)
        await resp.write(b"tick\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    app = web.Application()
    app.router.add_get("/ok", _ok)
    app.router.add_post("/upload", _upload)
    app.router.add_get("/slow", _slow_stream)
    timeouts: list[float] = []
    runner = ListenerRunner(app, header_timeout=HEAD, keepalive_timeout=IDLE, access_log=None,
                            on_header_timeout=lambda: timeouts.append(time.monotonic()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield Listener(runner.addresses[0][1], timeouts)
    await runner.cleanup()


async def _closed_after(reader: asyncio.StreamReader, started: float, limit: float = 10.0) -> float:
    """Seconds from `started` until the server closed the connection (everything it sent is
    drained first)."""
    async with asyncio.timeout(limit):
        while await reader.read(65536):
            pass
    return time.monotonic() - started


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    return await reader.readexactly(length)


async def test_half_a_request_line_is_closed_after_the_header_timeout(listener: Listener) -> None:
    reader, writer = await listener.connect()
    started = time.monotonic()
    writer.write(b"GET /ok HT")
    elapsed = await _closed_after(reader, started)
    assert HEAD * 0.9 <= elapsed < IDLE, elapsed  # the head's timeout, not the idle one
    assert len(listener.timeouts) == 1
    writer.close()


async def test_a_trickled_head_does_not_reset_the_timer(listener: Listener) -> None:
    reader, writer = await listener.connect()
    started = time.monotonic()

    async def trickle() -> None:
        for byte in GET[:-2]:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)

    feeder = asyncio.create_task(trickle())
    elapsed = await _closed_after(reader, started)
    feeder.cancel()
    assert elapsed < IDLE, elapsed
    writer.close()


async def test_a_later_requests_late_head_is_closed_and_idle_keep_alive_is_closed(listener: Listener) -> None:
    reader, writer = await listener.connect()
    for _ in range(2):  # keep-alive: answered, the connection stays open
        writer.write(GET)
        assert await _answer(reader) == b"ok"
    started = time.monotonic()
    writer.write(b"GET /ok HTTP/1.1\r\nHost: 1")  # a later request's head, never finished
    elapsed = await _closed_after(reader, started)
    assert HEAD * 0.9 <= elapsed < IDLE, elapsed
    writer.close()

    reader, writer = await listener.connect()
    writer.write(GET)
    assert await _answer(reader) == b"ok"
    started = time.monotonic()  # idle from here: the keep-alive timeout, not the head's
    elapsed = await _closed_after(reader, started)
    assert IDLE * 0.9 <= elapsed < IDLE + 2, elapsed
    writer.close()
    assert len(listener.timeouts) == 1  # an idle close is not a late head


async def test_a_slow_body_and_a_long_response_are_never_cut(listener: Listener) -> None:
    reader, writer = await listener.connect()
    writer.write(b"POST /upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\n")
    for byte in b"hello":  # the body takes longer than a head may
        await asyncio.sleep(HEAD / 2)
        writer.write(bytes([byte]))
    assert await _answer(reader) == b"5"
    writer.write(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    async with asyncio.timeout(10):
        await reader.readuntil(b"\r\n\r\n")
        body = await reader.readuntil(b"0\r\n\r\n")  # chunked, four ticks over 4 * HEAD
    assert body.count(b"tick") == 4
    writer.write(GET)  # still usable
    assert await _answer(reader) == b"ok"
    writer.close()
    assert listener.timeouts == []


async def test_a_head_in_pieces_within_the_timeout_is_answered(listener: Listener) -> None:
    reader, writer = await listener.connect()
    for piece in (GET[:5], GET[5:20], GET[20:]):
        writer.write(piece)
        await asyncio.sleep(HEAD / 10)
    assert await _answer(reader) == b"ok"
    await asyncio.sleep(HEAD * 2)  # no leftover timer from the first head closes it
    writer.write(GET)
    assert await _answer(reader) == b"ok"
    writer.close()


@pytest.mark.parametrize("told", [True, False], ids=["on_missing_host", "aiohttp's own"])
async def test_an_http11_request_without_host_is_answered_by_on_missing_host(told: bool) -> None:
    """aiohttp's parser refuses it before any route runs; `on_missing_host` picks the answer
    (the MCP listener: the guard's refusal), else aiohttp's plain 400. Both close the connection;
    HTTP/1.0, which needs no Host, is served."""
    app = web.Application()
    app.router.add_get("/ok", _ok)
    refusals: list[str] = []

    def refuse() -> web.Response:
        refusals.append("no host")
        response = web.Response(status=400, text="refused here")
        response.force_close()
        return response

    runner = ListenerRunner(app, header_timeout=IDLE, keepalive_timeout=IDLE, access_log=None,
                            on_missing_host=refuse if told else None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ok HTTP/1.1\r\n\r\n" + GET)  # the second is never answered
        async with asyncio.timeout(10):
            answer = await reader.read()  # to the close
        writer.close()
        # One answer (aiohttp writes a refusal from its parser as HTTP/1.0, its own too).
        assert answer.startswith(b"HTTP/1.0 400 ") and answer.count(b"HTTP/1.") == 1, answer
        assert answer.endswith(b"refused here") == told, answer
        assert refusals == (["no host"] if told else [])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ok HTTP/1.0\r\n\r\n")
        assert await _answer(reader) == b"ok"
        writer.close()
    finally:
        await runner.cleanup()
