"""proxy.upstream.transport.FastForwarder against raw asyncio servers scripting byte-exact responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.errors import ReplyTooLarge, UpstreamBusy, UpstreamError, UpstreamTimeout
from proxy.upstream.forwarder import Forwarder
from proxy.upstream.transport import HIGH_WATER, FastForwarder, FastResponse

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request off the wire: (head without the blank line, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return head[:-4], body


class Server:
    """A loopback server running `handler(reader, writer, connection_number)` per connection."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.tasks.discard(task)
            writer.close()

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"


def keep_answering(response: bytes, server_box: list[Server]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            try:
                req = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            server_box[0].requests.append(req)
            writer.write(response)
            await writer.drain()
    return handler


async def serve_fixed(response: bytes) -> Server:
    box: list[Server] = []
    server = Server(keep_answering(response, box))
    box.append(server)
    return server


@pytest.fixture
async def fwd() -> AsyncIterator[FastForwarder]:
    f = FastForwarder()
    await f.start()
    yield f
    await f.close()


async def post(fwd: FastForwarder, url: str, body: bytes | None = b'{"a":1}',
               headers: dict[str, str] | None = None, method: str = "POST",
               read_timeout: float | None = 5.0, resend: bool = False) -> FastResponse:
    resp = await fwd.open(method, url, headers or {}, body, connect_timeout=2.0,
                          read_timeout=read_timeout, resend=resend)
    assert isinstance(resp, FastResponse)
    return resp


async def test_content_length_body_and_request_serialization(fwd: FastForwarder) -> None:
    async with await serve_fixed(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello"
    ) as srv:
        headers = {"Accept": "application/json", "Host": "evil", "Content-Length": "99",
                   "Transfer-Encoding": "chunked", "Connection": "close", "X-Req": "r"}
        async with await post(fwd, srv.url + "?x=1&y=%20z", headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"] == "application/json"
            assert await resp.read() == b"hello"
        head, body = srv.requests[0]
        assert head == (
            f"POST /mcp?x=1&y=%20z HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
            "Accept: application/json\r\nX-Req: r\r\nContent-Length: 7"
        ).encode()
        assert body == b'{"a":1}'
        # POST without a body still says how long it is
        async with await post(fwd, srv.url, body=None) as resp:
            assert await resp.read() == b"hello"
        assert srv.requests[1][0].endswith(b"\r\nContent-Length: 0")
        async with await post(fwd, srv.url, body=None, method="GET") as resp:
            assert await resp.read() == b"hello"
        assert b"content-length" not in srv.requests[2][0].lower()


async def test_chunked_body_with_extensions_and_trailers(fwd: FastForwarder) -> None:
    async with await serve_fixed(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n6;x\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    ) as srv:
        for _ in range(2):
            async with await post(fwd, srv.url) as resp:
                assert await resp.read() == b"hello world"
                assert "X-Trailer" not in resp.headers
        assert srv.connections == 1  # reused after a chunked body with trailers


async def test_body_read_until_close(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"part two")
        await writer.drain()
        writer.close()

    async with Server(handler) as srv:
        async with await post(fwd, srv.url) as resp:
            assert await resp.read() == b"part one, part two"
        async with await post(fwd, srv.url) as resp:  # not pooled: a new connection
            assert await resp.read() == b"part one, part two"
        assert srv.connections == 2


async def test_duplicate_headers_kept(fwd: FastForwarder) -> None:
    async with await serve_fixed(
        b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nset-cookie: b=2\r\nMcp-Session-Id: s\r\n"
        b"Content-Length: 0\r\n\r\n"
    ) as srv:
        async with await post(fwd, srv.url) as resp:
            assert resp.headers.getall("Set-Cookie") == ["a=1", "b=2"]
            assert resp.headers["mcp-session-id"] == "s"
            assert await resp.read() == b""


async def test_keep_alive_reuse(fwd: FastForwarder) -> None:
    async with await serve_fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as srv:
        for _ in range(5):
            async with await post(fwd, srv.url) as resp:
                assert await resp.read() == b"ok"
        # fully received but never consumed: the connection is still clean
        async with await post(fwd, srv.url) as resp:
            assert resp.status == 200
        async with await post(fwd, srv.url) as resp:
            chunks = [c async for c in resp.chunks()]
            assert b"".join(chunks) == b"ok"
        assert srv.connections == 1
        assert len(srv.requests) == 7


async def test_http10_and_connection_close_not_reused(fwd: FastForwarder) -> None:
    async with await serve_fixed(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    ) as srv:
        for _ in range(2):
            async with await post(fwd, srv.url) as resp:
                assert await resp.read() == b"ok"
        assert srv.connections == 2


async def test_half_read_connection_is_discarded(fwd: FastForwarder) -> None:
    first_closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
            await writer.drain()
            if await reader.read(1) == b"":
                first_closed.set()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read(1)

    async with Server(handler) as srv:
        resp = await post(fwd, srv.url)
        it = resp.chunks()
        assert await anext(it) == b"0123456789"
        resp.close()
        await asyncio.wait_for(first_closed.wait(), 2)
        async with await post(fwd, srv.url) as resp2:
            assert await resp2.read() == b"ok"
        assert srv.connections == 2
        with pytest.raises(UpstreamError, match="closed before its body"):
            await resp.read()


def answer_once_then_hang_up(server: list[Server]) -> Handler:
    """Connection 1 answers its first request, then reads the next and closes without a word
    (the stale keep-alive race, or an upstream that dies performing the call); every later
    connection reads one request and closes the same way."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            server[0].requests.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        server[0].requests.append(await read_request(reader))
    return handler


async def test_stale_pooled_connection_is_resent_once_when_allowed(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if n == 1:
            # the race: the next request arrives as the server drops the idle connection
            await read_request(reader)
            return
        await read_request(reader)

    async with Server(handler) as srv:
        async with await post(fwd, srv.url, resend=True) as resp:
            assert await resp.read() == b"ok" and resp.attempts == 1
        async with await post(fwd, srv.url, resend=True) as resp:
            assert await resp.read() == b"ok"
            assert resp.attempts == 2  # the caller learns it was sent twice
        assert srv.connections == 2


@pytest.mark.parametrize("method", ["POST", "DELETE", "GET"])
async def test_a_request_the_upstream_read_is_never_resent_by_default(
        fwd: FastForwarder, method: str) -> None:
    box: list[Server] = []
    async with Server(answer_once_then_hang_up(box)) as srv:
        box.append(srv)
        async with await post(fwd, srv.url, method=method) as resp:
            assert await resp.read() == b"ok"
        with pytest.raises(UpstreamError, match="closed the connection before responding") as err:
            await post(fwd, srv.url, body=b'{"call":"delete_repo"}', method=method)
        assert err.value.attempts == 1
        assert not str(err.value).startswith("cannot connect to upstream")
        await asyncio.sleep(0.05)
        assert srv.connections == 1 and len(srv.requests) == 2  # received exactly once


async def test_a_resend_is_sent_at_most_twice(fwd: FastForwarder) -> None:
    box: list[Server] = []
    async with Server(answer_once_then_hang_up(box)) as srv:
        box.append(srv)
        async with await post(fwd, srv.url, resend=True) as resp:
            assert await resp.read() == b"ok"
        with pytest.raises(UpstreamError, match="closed the connection before responding") as err:
            await post(fwd, srv.url, body=b'{"n":2}', resend=True)
        assert err.value.attempts == 2
        await asyncio.sleep(0.05)
        assert srv.connections == 2
        assert [body for _, body in srv.requests] == [b'{"a":1}', b'{"n":2}', b'{"n":2}']


async def test_a_resend_that_cannot_connect_is_not_a_connect_failure(fwd: FastForwarder) -> None:
    box: list[Server] = []
    srv = Server(answer_once_then_hang_up(box))
    box.append(srv)
    async with srv:
        async with await post(fwd, srv.url, resend=True) as resp:
            assert await resp.read() == b"ok"
        assert srv.server is not None
        srv.server.close()  # stop listening: the resend's connection is refused
        await srv.server.wait_closed()
        with pytest.raises(UpstreamError) as err:
            await post(fwd, srv.url, resend=True)
    # Written once: callers must not take it for a request that never left.
    assert err.value.attempts == 1
    assert str(err.value).startswith(f"upstream 127.0.0.1:{srv.port} closed the connection")
    assert "resending it failed: cannot connect to upstream" in str(err.value)


async def test_failure_on_fresh_connection_is_not_retried(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)  # and hang up without a word

    async with Server(handler) as srv:
        with pytest.raises(UpstreamError, match=f"127.0.0.1:{srv.port} closed the connection before responding"):
            await post(fwd, srv.url)
        assert srv.connections == 1


async def test_reused_connection_failing_after_response_bytes_is_not_retried(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 O")  # half a status line, then gone
        await writer.drain()

    async with Server(handler) as srv:
        async with await post(fwd, srv.url) as resp:
            assert await resp.read() == b"ok"
        with pytest.raises(UpstreamError, match="before the response was complete"):
            await post(fwd, srv.url)
        assert srv.connections == 1


async def test_idle_connection_closed_by_server_is_not_reused(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        # closes while idle, without having said Connection: close

    async with Server(handler) as srv:
        async with await post(fwd, srv.url) as resp:
            assert await resp.read() == b"ok"
        await asyncio.sleep(0.1)
        host = fwd._hosts[("127.0.0.1", srv.port)]
        assert host.idle == [] and host.count == 0  # noticed at once
        async with await post(fwd, srv.url) as resp:
            assert await resp.read() == b"ok"
        assert srv.connections == 2


async def test_connection_refused(fwd: FastForwarder) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    for resend in (False, True):
        with pytest.raises(UpstreamError, match=f"^cannot connect to upstream 127.0.0.1:{port}") as err:
            await post(fwd, f"http://127.0.0.1:{port}/mcp", resend=resend)
        assert err.value.attempts == 0  # never written: safe to retry whatever the method
    assert fwd._hosts[("127.0.0.1", port)].count == 0


async def test_slow_headers_time_out(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with Server(handler) as srv:
        with pytest.raises(UpstreamTimeout, match=f"127.0.0.1:{srv.port}"):
            await post(fwd, srv.url, read_timeout=0.2)


async def test_slow_body_times_out(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await asyncio.sleep(5)

    async with Server(handler) as srv:
        async with await post(fwd, srv.url, read_timeout=0.2) as resp:
            with pytest.raises(UpstreamTimeout):
                await resp.read()


async def test_eof_mid_body_is_an_error(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()

    async with Server(handler) as srv:
        async with await post(fwd, srv.url) as resp:
            with pytest.raises(UpstreamError, match="before the response was complete"):
                await resp.read()


async def test_sse_chunks_arrive_before_the_stream_ends(fwd: FastForwarder) -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        ev1 = b'event: message\r\ndata: {"n":1}\r\n\r\n'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(ev1), ev1))
        await writer.drain()
        await asyncio.wait_for(release.wait(), 5)
        ev2 = b'data: {"n":2}\r\n\r\n'
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(ev2), ev2))
        await writer.drain()
        await reader.read(1)

    async with Server(handler) as srv:
        async with await post(fwd, srv.url, read_timeout=None) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            got = []
            async for chunk in resp.chunks():
                got.append(chunk)
                if len(got) == 1:
                    assert chunk == b'event: message\r\ndata: {"n":1}\r\n\r\n'
                    release.set()
            assert b"".join(got[1:]) == b'data: {"n":2}\r\n\r\n'


async def test_ten_megabytes_intact_with_bounded_buffering(fwd: FastForwarder) -> None:
    blob = bytes(range(256)) * (10 * 1024 * 1024 // 256)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(blob) + blob)
            await writer.drain()

    async with Server(handler) as srv:
        async with await post(fwd, srv.url) as resp:
            assert await resp.read() == blob
        async with await post(fwd, srv.url) as resp:
            parts = []
            async for chunk in resp.chunks():
                parts.append(chunk)
                await asyncio.sleep(0.01)  # a slow consumer: the socket must be paused meanwhile
            assert b"".join(parts) == blob
            assert max(len(p) for p in parts) <= HIGH_WATER + 512 * 1024
        assert srv.connections == 1


async def test_close_mid_stream_closes_the_upstream_connection(fwd: FastForwarder) -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata:\n\r\n")
        await writer.drain()
        try:
            if await reader.read(1) == b"":
                gone.set()
        except ConnectionError:
            gone.set()

    async with Server(handler) as srv:
        resp = await post(fwd, srv.url, read_timeout=None)
        assert await anext(resp.chunks()) == b"data:\n"
        resp.close()
        await asyncio.wait_for(gone.wait(), 2)
        assert fwd._hosts[("127.0.0.1", srv.port)].count == 0


async def test_cancelling_the_request_closes_the_upstream_connection(fwd: FastForwarder) -> None:
    gone = asyncio.Event()
    got_request = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        got_request.set()
        try:
            if await reader.read(1) == b"":
                gone.set()
        except ConnectionError:
            gone.set()

    async with Server(handler) as srv:
        task = asyncio.create_task(post(fwd, srv.url, read_timeout=None))
        await asyncio.wait_for(got_request.wait(), 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(gone.wait(), 2)
        assert fwd._hosts[("127.0.0.1", srv.port)].count == 0


async def test_no_body_statuses_and_head(fwd: FastForwarder) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            head, _ = await read_request(reader)
            if head.startswith(b"HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            elif head.startswith(b"DELETE"):
                writer.write(b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 204 No Content\r\nMcp-Session-Id: s\r\n\r\n")
            await writer.drain()

    async with Server(handler) as srv:
        for _ in range(2):
            async with await post(fwd, srv.url) as resp:
                assert resp.status == 204
                assert await resp.read() == b""
        async with await post(fwd, srv.url, body=None, method="DELETE") as resp:
            assert resp.status == 304
            assert [c async for c in resp.chunks()] == []
        assert srv.connections == 1
        async with await post(fwd, srv.url, body=None, method="HEAD") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Length"] == "1000"
            assert await asyncio.wait_for(resp.read(), 2) == b""


async def test_informational_responses_are_skipped(fwd: FastForwarder) -> None:
    async with await serve_fixed(
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    ) as srv:
        async with await post(fwd, srv.url) as resp:
            assert resp.status == 200
            assert "Link" not in resp.headers
            assert await resp.read() == b"ok"


async def test_garbage_response_is_an_upstream_error(fwd: FastForwarder) -> None:
    async with await serve_fixed(b"SSH-2.0-OpenSSH_9.6\r\n\r\n") as srv:
        with pytest.raises(UpstreamError, match="invalid HTTP response"):
            await post(fwd, srv.url)


async def test_pool_is_bounded_per_host() -> None:
    fwd = FastForwarder(limit_per_host=1)
    await fwd.start()
    try:
        async with await serve_fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as srv:
            first = await post(fwd, srv.url)
            # the only connection is busy: a second request waits, bounded by connect_timeout
            with pytest.raises(UpstreamTimeout, match="no connection within"):
                await fwd.open("POST", srv.url, {}, b"", connect_timeout=0.2, read_timeout=1)
            second = asyncio.create_task(post(fwd, srv.url))
            await asyncio.sleep(0.05)
            assert not second.done()
            assert await first.read() == b"ok"  # frees the connection for the waiter
            resp = await asyncio.wait_for(second, 2)
            assert await resp.read() == b"ok"
            assert srv.connections == 1
    finally:
        await fwd.close()


async def test_header_injection_refused(fwd: FastForwarder) -> None:
    with pytest.raises(UpstreamError, match="CR or LF"):
        await post(fwd, "http://127.0.0.1:9/mcp", headers={"X-A": "v\r\nX-Evil: 1"})


async def test_not_started_and_https_delegation() -> None:
    fwd = FastForwarder()
    with pytest.raises(UpstreamError, match="not started"):
        await post(fwd, "http://127.0.0.1:9/mcp")
    await fwd.start()
    try:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        # https:// goes through the inherited aiohttp forwarder (and fails like it)
        with pytest.raises(UpstreamError, match="cannot connect to upstream"):
            await fwd.open("POST", f"https://127.0.0.1:{port}/mcp", {}, b"{}",
                           connect_timeout=1, read_timeout=1)
        assert fwd._hosts == {}
    finally:
        await fwd.close()


async def test_close_aborts_streams_in_flight() -> None:
    fwd = FastForwarder()
    await fwd.start()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read(1)

    async with Server(handler) as srv:
        resp = await post(fwd, srv.url, read_timeout=None)
        it = resp.chunks()
        assert await anext(it) == b"a"

        async def next_chunk() -> bytes:
            return await anext(it)

        pending = asyncio.create_task(next_chunk())
        await asyncio.sleep(0.05)
        await fwd.close()
        with pytest.raises(UpstreamError, match="was closed"):
            await asyncio.wait_for(pending, 2)


async def test_a_long_lived_stream_is_counted_apart_and_never_pooled() -> None:
    fwd = FastForwarder(limit_per_host=1, stream_limit_per_host=1)
    await fwd.start()
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        _head, _ = await read_request(reader)
        # A stream that ends on its own, complete and keep-alive: still not pooled.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 6\r\n\r\ndata:\n")
        await writer.drain()
        if await reader.read(1) == b"":
            gone.set()

    try:
        async with Server(handler) as srv:
            resp = await fwd.open("GET", srv.url, {}, None, connect_timeout=1, read_timeout=None,
                                  long_lived=True)
            host = fwd._hosts[("127.0.0.1", srv.port)]
            assert (host.streams, host.count) == (1, 0)
            with pytest.raises(UpstreamBusy, match=r"limits\.max_upstream_streams"):
                await fwd.open("GET", srv.url, {}, None, connect_timeout=1, read_timeout=None,
                               long_lived=True)
            assert await resp.read() == b"data:\n"
            resp.close()
            await asyncio.wait_for(gone.wait(), 2)  # closed, not kept for a call
            assert (host.streams, host.count, host.idle) == (0, 0, [])
    finally:
        await fwd.close()


async def test_a_capped_read_stops_before_the_body_arrives(fwd: FastForwarder) -> None:
    sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        # Announces 100 MB, sends 1 KB and waits: the cap is known from the head alone.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n" + b"x" * 1024)
        await writer.drain()
        sent.set()
        await reader.read(1)

    async with Server(handler) as srv:
        async with await post(fwd, srv.url) as resp:
            await sent.wait()
            with pytest.raises(ReplyTooLarge, match=r"reply exceeds 65536 bytes"):
                await asyncio.wait_for(resp.read(65536), 1)
        assert fwd._hosts[("127.0.0.1", srv.port)].count == 0  # aborted, not pooled


@pytest.mark.parametrize("transport", ["fast", "aiohttp"])
@pytest.mark.parametrize("response", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, identity\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nX-Note: a\xffb\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nMcp-Session-Id: \xc3\xa9\r\nContent-Length: 2\r\n\r\nok",
], ids=["gzip", "gzip-then-chunked", "chunked-identity", "101", "obs-text", "utf-8"])
async def test_a_response_framed_or_headed_beyond_what_is_relayed_is_refused(
        transport: str, response: bytes) -> None:
    """Both forwarders refuse it before the body is read (`refused_response`); the lean one
    never reuses its connection (aiohttp's pools it again when the body it framed had arrived
    whole)."""
    f = FastForwarder() if transport == "fast" else Forwarder()
    await f.start()
    try:
        async with await serve_fixed(response) as srv:
            for _ in range(2):
                with pytest.raises(UpstreamError, match=r"unasked|Transfer-Encoding|not ASCII"):
                    await f.open("POST", srv.url, {}, b"{}", connect_timeout=2.0, read_timeout=5.0)
            assert srv.connections == 2 or transport == "aiohttp"
    finally:
        await f.close()
