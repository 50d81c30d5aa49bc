"""The stdio bridge: its listener credential (only this process's bridge reaches the route, and
the credential never reaches the route's handler, so never an upstream), and the bridge itself
against a scripted route (what reaches stdout, what the route is sent)."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.fronts.stdio import BRIDGE_HEADER, StdioBridge, credential_middleware

SECRET = "s3cret-credential"
SEEN = web.AppKey("seen", list)


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async def echo_headers(request: web.Request) -> web.Response:
        return web.json_response({"headers": sorted(k.lower() for k in request.headers),
                                  "upstream": request.match_info["upstream"]})

    app = web.Application(middlewares=[credential_middleware(SECRET)])
    app.router.add_route("*", "/mcp/{upstream}", echo_headers)
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.mark.parametrize("given", [None, "", "wrong", SECRET + "x", SECRET[:-1]])
async def test_without_the_credential_is_403(client: TestClient[Any, Any], given: str | None) -> None:
    headers = {BRIDGE_HEADER: given} if given is not None else {}
    resp = await client.post("/mcp/notes", data=b"{}", headers=headers)
    assert resp.status == 403
    body = await resp.json()
    assert body["error"]["message"] == "Forbidden: this listener serves its stdio bridge only"


async def test_with_the_credential_the_route_sees_no_credential(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/mcp/notes", data=b"{}", headers={BRIDGE_HEADER: SECRET, "X-Other": "1"})
    assert resp.status == 200
    body = await resp.json()
    assert body["upstream"] == "notes"
    assert "x-other" in body["headers"] and BRIDGE_HEADER.lower() not in body["headers"]


# ---- the bridge against a scripted route ---------------------------------------------------


async def scripted_route(request: web.Request) -> web.StreamResponse:
    """A stand-in for `/mcp/<upstream>`: answers by method, records what it was sent."""
    request.app[SEEN].append((request.method, dict(request.headers), await request.read()))
    if request.method == "GET":
        return web.Response(status=405)
    if request.method == "DELETE":
        return web.Response(status=200)
    body = json.loads(await request.read())
    method, rpc_id = body.get("method"), body.get("id")
    if method == "initialize":
        return web.json_response({"jsonrpc": "2.0", "id": rpc_id, "result": {"protocolVersion": "2025-11-25"}},
                                 headers={"Mcp-Session-Id": "s-1"})
    if method == "boom":
        return web.Response(status=500, text="<html>Internal Server Error</html>", content_type="text/html")
    if method == "streamed":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"id: 0\ndata: \n\n")  # a priming event: no message
        await resp.write(b'data: {"jsonrpc":"2.0","method":"notifications/progress",\ndata: "params":{"progress":1}}\n\n')
        await resp.write(b'data: {"jsonrpc":"2.0","id":' + json.dumps(rpc_id).encode() + b',"result":{}}\n\n')
        return resp
    if method == "cut":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"jsonrpc":"2.0","method":"notifications/message","params":{}}\n\n')
        return resp  # the stream ends without the answer
    return web.Response(status=202)


async def bridge_session(lines: list[bytes], max_message_bytes: int = 1024) -> tuple[list[dict[str, Any]], list[Any]]:
    """Run a bridge over `lines` as stdin against the scripted route; (stdout messages, requests seen)."""
    app = web.Application(middlewares=[credential_middleware(SECRET)])
    app[SEEN] = []
    app.router.add_route("*", "/mcp/{upstream}", scripted_route)
    async with TestServer(app) as server:
        read_end, write_end = os.pipe()
        os.write(write_end, b"".join(lines))
        os.close(write_end)
        stdout = io.BytesIO()
        with os.fdopen(read_end, "rb") as stdin:
            bridge = StdioBridge(str(server.make_url("/mcp/notes")), SECRET, stdin, stdout,
                                 max_message_bytes=max_message_bytes, max_event_bytes=4096)
            await asyncio.wait_for(bridge.run(), 10)
    out = stdout.getvalue()
    assert out.endswith(b"\n")
    return [json.loads(line) for line in out.splitlines()], app[SEEN]


def line(**message: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n"


INIT = line(id=1, method="initialize", params={"protocolVersion": "2025-11-25", "capabilities": {},
                                                "clientInfo": {"name": "t", "version": "0"}})


async def test_session_headers_and_sse_messages_in_order() -> None:
    out, seen = await bridge_session([INIT, line(method="notifications/initialized"),
                                      line(id="two", method="streamed")])
    assert out == [
        {"jsonrpc": "2.0", "id": 1, "result": {"protocolVersion": "2025-11-25"}},
        {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}},
        {"jsonrpc": "2.0", "id": "two", "result": {}},
    ]
    posts = [headers for method, headers, _ in seen if method == "POST"]
    assert "Mcp-Session-Id" not in posts[0]
    assert all(h["Mcp-Session-Id"] == "s-1" and h["MCP-Protocol-Version"] == "2025-11-25" for h in posts[1:])
    # End of stdin: the request in flight was answered first, then the session ended.
    assert [m for m, _, _ in seen][-1] == "DELETE"


async def test_failures_are_answered_with_the_request_id() -> None:
    out, _ = await bridge_session([INIT, line(method="notifications/initialized"),
                                   line(id=5, method="boom"), b"{not json\n", line(id=6, method="cut"),
                                   b'{"jsonrpc":"2.0","id":7,"method":"x","params":"' + b"a" * 2000 + b'"}\n'])
    answers = {m.get("id"): m for m in out if "id" in m and m["id"] != 1}
    assert answers[5]["error"]["code"] == -32603  # an HTML 500 page is never written out
    assert answers[6]["error"]["message"] == "envelope-proxy: the request ended without a response"
    errors = [m["error"]["code"] for m in out if m.get("id") is None and "error" in m]
    assert errors == [-32700, -32600]  # the line that is not JSON, the line past the cap
    assert {"jsonrpc": "2.0", "method": "notifications/message", "params": {}} in out


async def test_invalid_utf8_is_a_parse_error_and_a_last_line_without_newline_is_answered() -> None:
    out, seen = await bridge_session([INIT, line(method="notifications/initialized"),
                                      b'{"jsonrpc":"2.0","id":8,"method":"x","params":{"a":"\xff\xfe"}}\n',
                                      line(id=9, method="streamed").rstrip(b"\n")])  # EOF mid-line
    assert {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32700, "message": "Parse error: not a JSON message"}} in out
    assert out[-1] == {"jsonrpc": "2.0", "id": 9, "result": {}}
    assert not [body for method, _, body in seen if method == "POST" and b'"id":8' in body]
