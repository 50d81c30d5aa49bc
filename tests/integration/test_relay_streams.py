"""Byte relaying through the real proxy process against a scripted aiohttp upstream:
SSE streamed event by event (never buffered whole), GET streams with Last-Event-ID, DELETE,
header hygiene both ways, and a tools/call whose result arrives after progress events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.harness import free_port, proxy_process

POLICY = """
version: 1
upstreams:
  raw:
    url: "http://127.0.0.1:1/mcp"
    timeout: 20s
    headers: {X-Upstream-Credential: proxy-own-secret}
tools:
  raw.slow:
    effect: read
"""


class Scripted:
    """An upstream whose answers the test steps through with events."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        self.release = asyncio.Event()
        self.finished_at: float | None = None
        self.cancelled: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, dict(request.headers), body))
        if request.method == "DELETE":
            return web.Response(status=200, headers={"Mcp-Session-Id": "s-1"})
        if request.method == "GET":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Mcp-Session-Id": "s-1"})
            await resp.prepare(request)
            await resp.write(b'id: 7\nevent: message\ndata: {"jsonrpc":"2.0","method":"notifications/message","params":{"n":1}}\n\n')
            await asyncio.wait_for(self.release.wait(), 15)
            await resp.write(b'id: 8\ndata: {"jsonrpc":"2.0","method":"notifications/message",\ndata: "params":{"n":2}}\n\n')
            self.finished_at = asyncio.get_running_loop().time()
            await resp.write_eof()
            return resp
        msg = json.loads(body)
        if msg.get("method") == "notifications/cancelled":
            self.cancelled.append(msg["params"])
            return web.Response(status=202)
        if msg["params"].get("arguments", {}).get("answer") == "json":
            await asyncio.wait_for(self.release.wait(), 15)
            return web.json_response({"jsonrpc": "2.0", "id": msg["id"], "result": {
                "content": [{"type": "text", "text": "done"}], "isError": False}})
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Mcp-Session-Id": "s-1", "Connection": "keep-alive",
        })
        await resp.prepare(request)
        await resp.write(b": keep-alive comment\r\n\r\n")
        await resp.write(
            b'event: message\r\ndata: {"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":1,"progress":1}}\r\n\r\n'
        )
        await asyncio.wait_for(self.release.wait(), 15)
        result = {"jsonrpc": "2.0", "id": msg["id"], "result": {"content": [{"type": "text", "text": "done"}], "isError": False}}
        await resp.write(b"event: message\r\ndata: " + json.dumps(result).encode() + b"\r\n\r\n")
        self.finished_at = asyncio.get_running_loop().time()
        await resp.write_eof()
        return resp


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Scripted, int]]:
    scripted = Scripted()
    app = web.Application()
    app.router.add_route("*", "/mcp", scripted.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield scripted, port
    await runner.cleanup()


@pytest.fixture
def proxy(tmp_path: Path, upstream: tuple[Scripted, int]) -> Any:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "raw.yaml").write_text(POLICY)
    with proxy_process(tmp_path, {"raw": f"http://127.0.0.1:{upstream[1]}/mcp"}, policies=policies,
                       identity={"mode": "static", "principal": "agent"},
                       config={"health_interval": 0}) as p:  # only the test's requests upstream
        yield p


HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
           "MCP-Protocol-Version": "2025-11-25", "Mcp-Session-Id": "s-1"}


async def test_get_stream_is_relayed_event_by_event_with_last_event_id(proxy: Any, upstream: tuple[Scripted, int]) -> None:
    scripted, _ = upstream
    async with httpx.AsyncClient(timeout=20) as client, client.stream(
        "GET", proxy.url("raw"), headers={**HEADERS, "Last-Event-ID": "6", "Authorization": "Bearer agent-token"}
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["mcp-session-id"] == "s-1"
        chunks = resp.aiter_bytes()
        first = b""
        while b"\n\n" not in first:
            first += await chunks.__anext__()
        # The first event reached the client while the upstream still holds the stream open.
        assert b"id: 7" in first and scripted.finished_at is None
        scripted.release.set()
        rest = b"".join([c async for c in chunks])
    assert b'id: 8\ndata: {"jsonrpc":"2.0","method":"notifications/message",\ndata: "params":{"n":2}}\n\n' in first + rest
    method, headers, _ = scripted.seen[-1]
    assert method == "GET"
    assert headers["Last-Event-ID"] == "6" and headers["Mcp-Session-Id"] == "s-1"
    # The agent's credential stays at the proxy; the proxy's own credential goes upstream.
    assert "Authorization" not in headers
    assert headers["X-Upstream-Credential"] == "proxy-own-secret"


async def test_tools_call_progress_arrives_before_the_upstream_finishes(proxy: Any, upstream: tuple[Scripted, int]) -> None:
    scripted, _ = upstream
    body = {"jsonrpc": "2.0", "id": "c-1", "method": "tools/call",
            "params": {"name": "slow", "arguments": {}, "_meta": {"progressToken": 1}}}
    events: list[bytes] = []
    async with httpx.AsyncClient(timeout=20) as client, client.stream(
        "POST", proxy.url("raw"), json=body, headers={**HEADERS, "Mcp-Param-Region": "eu"}
    ) as resp:
        assert resp.status_code == 200
        buf = b""
        async for chunk in resp.aiter_bytes():
            buf += chunk.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                events.append(event)
                if b"notifications/progress" in event:
                    assert scripted.finished_at is None  # streamed, not buffered
                    assert proxy.audit_records() == []  # the result is not there yet
                    scripted.release.set()
    # A comment keeps the stream alive; its text is upstream text no client reads, so it does
    # not pass (a lenient client could show it): it becomes the proxy's own keep-alive.
    assert events[0] == b": keep-alive"
    assert b"notifications/progress" in events[1]
    result = json.loads(events[2].split(b"data: ", 1)[1])
    assert result["id"] == "c-1" and result["result"]["content"][0]["text"] == "done"
    [record] = proxy.audit_records()
    assert (record["tool"], record["verdict"], record["code"], record["upstream_status"]) == ("slow", "allow", "ok", 200)
    assert record["session"] == "s-1"
    _, headers, sent = scripted.seen[-1]
    assert json.loads(sent) == body  # the body reaches the upstream unchanged
    assert headers["Mcp-Param-Region"] == "eu"


def pending_markers(state: Path) -> list[bytes]:
    """The pending markers in the run ledgers of the proxy's SQLite store."""
    with contextlib.closing(sqlite3.connect(state / "state.db")) as db:
        return [bytes(f) for (f,) in db.execute("SELECT field FROM hash WHERE ns = 'ledger'")
                if bytes(f).startswith(b"p:")]


@pytest.mark.parametrize("answer", ["sse", "json"])
async def test_a_session_call_marks_its_output_pending_only_when_the_answer_is_a_stream(
        proxy: Any, upstream: tuple[Scripted, int], tmp_path: Path, answer: str) -> None:
    """A session's stream may be resumed with GET + Last-Event-ID, possibly on another replica:
    while the upstream holds a streamed answer, the run's ledger says an output is on its way
    (written before the stream reached the client). A JSON answer, which only this process
    delivers, costs no marker (no store write before the call is forwarded). Once the result
    is delivered, no marker is left."""
    scripted, _ = upstream
    body = {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
            "params": {"name": "slow", "arguments": {"answer": answer}}}
    async with httpx.AsyncClient(timeout=20) as client:
        call = asyncio.create_task(client.post(proxy.url("raw"), json=body, headers=HEADERS))
        for _ in range(200):
            if any(m == "POST" and b'"tools/call"' in b for m, _, b in scripted.seen):
                break
            await asyncio.sleep(0.025)
        await asyncio.sleep(0.3)  # the proxy has the streamed answer's headers by now
        held = pending_markers(tmp_path / "state")
        scripted.release.set()
        resp = await call
    assert resp.status_code == 200 and "done" in resp.text
    assert len(held) == (1 if answer == "sse" else 0), held
    assert pending_markers(tmp_path / "state") == []


async def test_delete_is_relayed(proxy: Any, upstream: tuple[Scripted, int]) -> None:
    scripted, _ = upstream
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.delete(proxy.url("raw"), headers=HEADERS)
    assert resp.status_code == 200 and resp.headers["mcp-session-id"] == "s-1"
    assert scripted.seen[-1][0] == "DELETE" and scripted.seen[-1][1]["Mcp-Session-Id"] == "s-1"


async def test_tools_call_without_id_never_reaches_the_upstream(proxy: Any, upstream: tuple[Scripted, int]) -> None:
    scripted, _ = upstream
    body = {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "slow", "arguments": {}}}
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(proxy.url("raw"), json=body, headers=HEADERS)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == -32600
    assert "must be a request" in resp.json()["error"]["message"]
    assert scripted.seen == []


async def test_client_disconnect_on_a_non_resumable_stream_cancels_the_upstream_call(
    proxy: Any, upstream: tuple[Scripted, int]
) -> None:
    scripted, _ = upstream
    body = {"jsonrpc": "2.0", "id": "c-9", "method": "tools/call", "params": {"name": "slow", "arguments": {}}}
    async with httpx.AsyncClient(timeout=20) as client, client.stream(
        "POST", proxy.url("raw"), json=body, headers=HEADERS
    ) as resp:
        async for chunk in resp.aiter_bytes():
            if b"notifications/progress" in chunk:
                break  # leave while the upstream still holds the call (its events carry no ids)
    for _ in range(100):
        if scripted.cancelled and proxy.audit_records():
            break
        await asyncio.sleep(0.05)
    # 2025-11-25: a dropped connection is not a cancellation, so the proxy sends one itself.
    assert scripted.cancelled == [{"requestId": "c-9", "reason": "client disconnected"}]
    [record] = proxy.audit_records()
    assert (record["verdict"], record["code"], record["check"]) == ("error", "client_disconnected", "forward")
    scripted.release.set()
