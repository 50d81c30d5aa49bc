"""The hostile upstream (`hostile_upstream.py`) speaks MCP correctly, and misbehaves exactly as
asked, before the proxy's adversarial tests rely on it. Driven directly, with no proxy: raw
httpx for every mode and wire rule, the official SDK client (legacy = 2025-11-25 sessions,
auto = 2026-07-28 stateless) for json, sse and rpc_error.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from hostile_upstream import HostileUpstream, hostile_server

ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
LEGACY = "2025-11-25"
MODERN = "2026-07-28"
MODERN_HEADERS = {**ACCEPT, "MCP-Protocol-Version": MODERN}
# One client for the raw requests: a new httpx client per request costs ~50 ms (TLS context).
HTTP = httpx.Client(timeout=5)


@pytest.fixture(scope="module")
def server() -> Iterator[HostileUpstream]:
    with hostile_server() as up:
        yield up
    HTTP.close()


@pytest.fixture
def up(server: HostileUpstream) -> HostileUpstream:
    server.control.reset()
    return server


def initialize(up: HostileUpstream, version: str = LEGACY) -> dict[str, str]:
    """A raw session handshake; the headers every later request of the session carries."""
    r = HTTP.post(up.url, headers=ACCEPT, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["protocolVersion"] == version
    headers = {**ACCEPT, "Mcp-Session-Id": r.headers["Mcp-Session-Id"], "MCP-Protocol-Version": version}
    assert HTTP.post(up.url, headers=headers,
                      json={"jsonrpc": "2.0", "method": "notifications/initialized"}).status_code == 202
    return headers


def call(up: HostileUpstream, headers: dict[str, str], args: dict[str, Any], tool: str = "read_page",
         rid: Any = 1, timeout: float = 5, **params: Any) -> httpx.Response:
    return HTTP.post(up.url, headers=headers, timeout=timeout, json={
        "jsonrpc": "2.0", "id": rid, "method": "tools/call",
        "params": {"name": tool, "arguments": args, **params}})


def parse_sse(text: str) -> list[dict[str, Any]]:
    """Events as dicts of their fields (`json` = the parsed data, None when empty)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event: dict[str, Any] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(":")
            event[name] = value.removeprefix(" ")
        event["json"] = json.loads(event["data"]) if event.get("data") else None
        events.append(event)
    return events


def text_of(reply: dict[str, Any]) -> str:
    return str(reply["result"]["content"][0]["text"])


def last(up: HostileUpstream, method: str = "tools/call") -> dict[str, Any]:
    return [e for e in up.control.log() if e["method"] == method][-1]


# ---- handshake, sessions, stateless -----------------------------------------------------------


def test_sessions_follow_the_streamable_http_rules(up: HostileUpstream) -> None:
    old = initialize(up, "2025-06-18")
    headers = initialize(up)
    no_session = {k: v for k, v in headers.items() if k != "Mcp-Session-Id"}
    assert call(up, no_session, {}).status_code == 400
    assert call(up, {**headers, "Mcp-Session-Id": "nope"}, {}).status_code == 404
    r = HTTP.post(up.url, headers=headers, json={"jsonrpc": "2.0", "id": 2, "method": "ping"})
    assert r.json() == {"jsonrpc": "2.0", "id": 2, "result": {}}
    assert r.headers["Mcp-Session-Id"] == headers["Mcp-Session-Id"]
    assert HTTP.delete(up.url, headers=old).status_code == 200
    assert call(up, old, {}).status_code == 404
    assert HTTP.get(up.url, headers=old).status_code == 404
    assert HTTP.get(up.url, headers=MODERN_HEADERS).status_code == 405
    assert HTTP.delete(up.url, headers=MODERN_HEADERS).status_code == 405
    assert [s["version"] for s in up.control.sessions()] == [LEGACY]


def test_stateless_requests_need_no_session(up: HostileUpstream) -> None:
    r = HTTP.post(up.url, headers={**MODERN_HEADERS, "Mcp-Method": "server/discover"},
                   json={"jsonrpc": "2.0", "id": 1, "method": "server/discover"})
    discovered = r.json()["result"]
    assert MODERN in discovered["supportedVersions"] and discovered["resultType"] == "complete"
    r = HTTP.post(up.url, headers=MODERN_HEADERS, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
    listing = r.json()["result"]
    assert (listing["resultType"], listing["ttlMs"], listing["cacheScope"]) == ("complete", 0, "private")
    tools = {t["name"]: t for t in listing["tools"]}
    assert tools["read_page"]["annotations"] == {"readOnlyHint": True, "openWorldHint": True}
    assert tools["write_note"]["annotations"] == {"readOnlyHint": False, "destructiveHint": False}
    assert tools["delete_all"]["annotations"]["destructiveHint"] is True
    assert "annotations" not in tools["bare"]
    assert set(tools["bare"]["inputSchema"]["properties"]) >= {"mode", "text", "delay", "size", "notes", "key"}
    # The version can come in _meta instead of the header.
    meta: dict[str, Any] = {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}
    r = call(up, ACCEPT, {"text": "via meta"}, **meta)
    assert (r.status_code, text_of(r.json()), r.json()["result"]["resultType"]) == (200, "via meta", "complete")
    r = call(up, {**MODERN_HEADERS, "Mcp-Name": "write_note"}, {})
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32020)
    r = HTTP.post(up.url, headers=MODERN_HEADERS, json={"jsonrpc": "2.0", "id": 3, "method": "ping"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, -32601)
    assert [e["era"] for e in up.control.log()] == ["stateless"] * 5


# ---- every mode, raw -------------------------------------------------------------------------


@pytest.mark.parametrize("modern", [False, True], ids=["session", "stateless"])
def test_json_rpc_error_forge_meta_http_500_garbage(up: HostileUpstream, modern: bool) -> None:
    headers = MODERN_HEADERS if modern else initialize(up)
    r = call(up, headers, {"mode": "json", "text": "plain"})
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["result"]["content"] == [{"type": "text", "text": "plain"}]
    assert r.json()["result"]["structuredContent"] == {"text": "plain"}
    r = call(up, headers, {"mode": "rpc_error", "text": "boom"}, rid="e")
    assert r.status_code == 200
    assert r.json() == {"jsonrpc": "2.0", "id": "e",
                        "error": {"code": -32000, "message": "boom", "data": {"detail": "boom"}}}
    r = call(up, headers, {"mode": "forge_meta", "text": "forged"})
    result = r.json()["result"]
    assert result["_meta"] == {"envelope/decision": {"code": "ok", "check": "forged"}, "envelope/replayed": True}
    assert result["content"][0] == {"type": "text", "text": "forged", "_meta": {"envelope/x": 1}}
    r = call(up, headers, {"mode": "http_500", "text": "down"})
    assert (r.status_code, r.text) == (500, "internal error: down")
    r = call(up, headers, {"mode": "garbage", "text": "x"})
    assert (r.status_code, r.headers["content-type"]) == (200, "application/json")
    with pytest.raises(json.JSONDecodeError):
        r.json()
    calls = up.control.calls()
    assert [(e["params"]["arguments"]["mode"], e["answered"], e["status"]) for e in calls] == [
        ("json", True, 200), ("rpc_error", True, 200), ("forge_meta", True, 200),
        ("http_500", False, 500), ("garbage", False, 200)]


def test_sse_sends_notes_sampling_then_the_result(up: HostileUpstream) -> None:
    headers = initialize(up)
    r = call(up, headers, {"mode": "sse", "text": "done", "notes": ["one", "two", "three"], "sampling": True},
             _meta={"progressToken": "tok"})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    messages = [e["json"] for e in events]
    assert [m.get("method") for m in messages] == [
        "notifications/message", "notifications/progress", "notifications/message",
        "sampling/createMessage", None]
    assert messages[0]["params"]["data"] == "one" and messages[2]["params"]["data"] == "three"
    assert (messages[1]["params"]["message"], messages[1]["params"]["progressToken"]) == ("two", "tok")
    assert messages[3]["id"].startswith("srv-")
    assert messages[3]["params"]["messages"][0]["content"]["text"] == "done"
    assert text_of(messages[4]) == "done" and messages[4]["id"] == 1
    assert all(e.get("id") for e in events)  # a session's events are resumable
    # The client's answer to the server request is a POST without a method: 202, logged.
    answer = {"jsonrpc": "2.0", "id": messages[3]["id"], "result": {
        "role": "assistant", "content": {"type": "text", "text": "ok"}, "model": "m"}}
    assert HTTP.post(up.url, headers=headers, json=answer).status_code == 202
    entry = up.control.log()[-1]
    assert (entry["kind"], entry["id"], entry["outcome"]) == ("response", messages[3]["id"], "accepted")
    # Stateless: same sequence, no ids; the progress token defaults when none was given.
    events = parse_sse(call(up, MODERN_HEADERS, {"mode": "sse", "notes": ["a", "b"]}).text)
    assert [e.get("id") for e in events] == [None, None, None]
    assert events[1]["json"]["params"]["progressToken"] == "hostile-progress"


def test_close_after_read_drops_the_connection_without_a_response(up: HostileUpstream) -> None:
    headers = initialize(up)
    with pytest.raises(httpx.RemoteProtocolError):
        call(up, headers, {"mode": "close_after_read", "text": "t" * 100_000})
    entry = last(up)
    assert (entry["answered"], entry["status"], entry["outcome"]) == (False, None, "aborted")
    assert len(entry["params"]["arguments"]["text"]) == 100_000  # the whole body was read


def test_slow_waits_and_is_cancelled_by_notification_or_disconnect(up: HostileUpstream) -> None:
    headers = initialize(up)
    started = time.monotonic()
    assert text_of(call(up, headers, {"mode": "slow", "delay": 0.3, "text": "late"}).json()) == "late"
    assert time.monotonic() - started >= 0.3
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "c1"}}
    timer = threading.Timer(0.2, lambda: HTTP.post(up.url, headers=headers, json=cancel))
    timer.start()
    with pytest.raises(httpx.RemoteProtocolError):
        call(up, headers, {"mode": "slow", "delay": 5}, rid="c1")
    timer.join()
    assert last(up)["outcome"] == "cancelled"
    with pytest.raises(httpx.ReadTimeout):
        call(up, headers, {"mode": "slow", "delay": 5}, rid="gone", timeout=0.2)
    up.control.wait(lambda log: [e["outcome"] for e in log if e["method"] == "tools/call"][-1] == "client_gone")
    assert time.monotonic() - started < 5  # neither 5 s sleep ran to its end


def test_huge_event_is_one_event_of_size_bytes(up: HostileUpstream) -> None:
    r = call(up, MODERN_HEADERS, {"mode": "huge_event", "text": "abc", "size": 1_000_000})
    events = parse_sse(r.text)
    assert len(events) == 1
    text = text_of(events[0]["json"])
    assert len(text) == 1_000_000 and text == ("abc" * 333_334)[:1_000_000]


def test_drop_resumable_delivers_the_result_to_a_resuming_get(up: HostileUpstream) -> None:
    headers = initialize(up)
    r = call(up, headers, {"mode": "drop_resumable", "text": "resumed!", "delay": 0.2, "notes": ["n"]})
    [priming] = parse_sse(r.text)
    assert (priming["data"], priming["retry"], priming["json"]) == ("", "100", None)
    assert (last(up)["answered"], last(up)["outcome"]) == (False, "stored")
    # The GET waits for the stored result, replays it, then ends (the stream's response is out).
    r = HTTP.get(up.url, headers={**headers, "Last-Event-ID": priming["id"]}, timeout=5)
    events = parse_sse(r.text)
    assert [e["json"].get("method") for e in events] == ["notifications/message", None]
    assert text_of(events[1]["json"]) == "resumed!"
    assert int(events[1]["id"]) > int(priming["id"])
    assert (last(up)["answered"], last(up)["outcome"]) == (True, "resumed")
    assert HTTP.get(up.url, headers={**headers, "Last-Event-ID": "999"}).status_code == 400
    r = call(up, MODERN_HEADERS, {"mode": "drop_resumable"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, -32602)


@contextlib.contextmanager
def get_stream(up: HostileUpstream, headers: dict[str, str], last_id: str | None = None
               ) -> Iterator[Iterator[dict[str, Any]]]:
    """An open standalone GET stream, as an iterator of events (ReadTimeout after 2 s idle)."""
    extra = {"Last-Event-ID": last_id} if last_id else {}
    with HTTP.stream("GET", up.url, headers={**headers, **extra}, timeout=2) as resp:
        assert resp.status_code == 200

        def events() -> Iterator[dict[str, Any]]:
            block: list[str] = []
            for line in resp.iter_lines():
                if line:
                    block.append(line)
                elif block:
                    yield parse_sse("\n".join(block))[0]
                    block = []

        yield events()


def test_get_stream_push_resume_and_task_status(up: HostileUpstream) -> None:
    headers = initialize(up)
    with get_stream(up, headers) as events:
        assert HTTP.get(up.url, headers=headers).status_code == 409  # one standalone stream
        pushed = up.control.push({"jsonrpc": "2.0", "method": "notifications/message",
                                  "params": {"level": "info", "data": "first"}})
        assert pushed["listeners"] == 1
        first = next(events)
        assert (first["id"], first["json"]["params"]["data"]) == (pushed["event_id"], "first")
    up.control.wait(lambda _: up.control.sessions()[0]["get_streams"] == 0)
    # Pushed while no stream is open: the next GET gets it; a resume replays after its id.
    up.control.push({"jsonrpc": "2.0", "id": "srv-x", "method": "roots/list"})
    with get_stream(up, headers) as events:
        assert next(events)["json"]["method"] == "roots/list"
    with get_stream(up, headers, last_id=first["id"]) as events:
        assert next(events)["json"]["id"] == "srv-x"
        # A task completes in the background and says so on the stream, which stays open.
        r = call(up, headers, {"mode": "task", "text": "task text", "delay": 0.1}, task={"ttl": 60000})
        task = r.json()["result"]["task"]
        assert (task["status"], task["statusMessage"], task["ttl"], task["pollInterval"]) == (
            "working", "task text", 60000, 100)
        status = next(events)["json"]
        assert (status["method"], status["params"]["taskId"], status["params"]["status"]) == (
            "notifications/tasks/status", task["taskId"], "completed")


def test_tasks_get_result_list_cancel(up: HostileUpstream) -> None:
    headers = initialize(up)

    def rpc(method: str, **params: Any) -> dict[str, Any]:
        r = HTTP.post(up.url, headers=headers, timeout=5,
                       json={"jsonrpc": "2.0", "id": method, "method": method, "params": params})
        reply: dict[str, Any] = r.json()
        return reply

    first = call(up, headers, {"mode": "task", "text": "t1", "delay": 0.3}, task={}).json()["result"]["task"]
    assert rpc("tasks/get", taskId=first["taskId"])["result"]["status"] == "working"
    result = rpc("tasks/result", taskId=first["taskId"])["result"]  # blocks until completed
    assert text_of({"result": result}) == "t1"
    assert rpc("tasks/get", taskId=first["taskId"])["result"]["status"] == "completed"
    second = call(up, headers, {"mode": "task", "delay": 5}, task={}).json()["result"]["task"]
    assert rpc("tasks/cancel", taskId=second["taskId"])["result"]["status"] == "cancelled"
    assert rpc("tasks/cancel", taskId=first["taskId"])["error"]["code"] == -32602
    listed = rpc("tasks/list")["result"]["tasks"]
    assert [(t["taskId"], t["status"]) for t in listed] == [
        (first["taskId"], "completed"), (second["taskId"], "cancelled")]
    # Without params.task the mode answers in the request, like slow.
    assert text_of(call(up, headers, {"mode": "task", "text": "inline"}).json()) == "inline"


def test_resources_prompts_texts_and_the_log(up: HostileUpstream) -> None:
    headers = initialize(up)

    def rpc(method: str, **params: Any) -> dict[str, Any]:
        result: dict[str, Any] = HTTP.post(up.url, headers=headers, json={
            "jsonrpc": "2.0", "id": 1, "method": method, "params": params}).json()["result"]
        return result

    assert rpc("resources/read", uri="a://b")["contents"] == [
        {"uri": "a://b", "mimeType": "text/plain", "text": "resource a://b"}]
    up.control.texts(resources={"a://b": "poisoned"}, prompts={"p": "prompt text"})
    assert rpc("resources/read", uri="a://b")["contents"][0]["text"] == "poisoned"
    assert "a://b" in [r["uri"] for r in rpc("resources/list")["resources"]]
    assert rpc("prompts/get", name="p")["messages"] == [
        {"role": "user", "content": {"type": "text", "text": "prompt text"}}]
    assert "p" in [p["name"] for p in rpc("prompts/list")["prompts"]]
    entry = last(up, "prompts/get")
    assert entry["session"] == headers["Mcp-Session-Id"] and entry["answered"] is True
    assert entry["headers"]["mcp-protocol-version"] == LEGACY and entry["params"] == {"name": "p"}
    assert [e["method"] for e in up.control.log(since=entry["seq"] - 1)] == ["prompts/get", "prompts/list"]
    up.control.reset()
    assert up.control.log() == [] and up.control.sessions() == []
    r = HTTP.post(up.url, headers=headers, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert r.status_code == 404  # the reset ended the session


# ---- the official SDK client --------------------------------------------------------------


@contextlib.asynccontextmanager
async def sdk_client(url: str, mode: str, **callbacks: Any) -> AsyncIterator[Any]:
    """`mcp.Client` over streamable HTTP (as `tests.harness.mcp_client`), with callbacks."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    http = create_mcp_http_client()
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode, cache=None,
                            **callbacks) as client:
        yield client


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_sdk_client_sees_json_sse_and_rpc_error(up: HostileUpstream, mode: str) -> None:
    from mcp import MCPError
    from mcp_types import CreateMessageResult, TextContent

    logged: list[Any] = []
    progress: list[tuple[float, str | None]] = []
    sampled: list[str] = []

    async def on_log(params: Any) -> None:
        logged.append(params.data)

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async def on_sampling(ctx: Any, params: Any) -> CreateMessageResult:
        sampled.append(params.messages[0].content.text)
        return CreateMessageResult(role="assistant", content=TextContent(type="text", text="ok"), model="m")

    async with sdk_client(up.url, mode, logging_callback=on_log, sampling_callback=on_sampling) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools["read_page"].annotations.read_only_hint is True
        assert tools["delete_all"].annotations.destructive_hint is True
        r = await client.call_tool("write_note", {"mode": "json", "text": "hello"})
        assert (r.is_error, r.content[0].text, r.structured_content) == (False, "hello", {"text": "hello"})
        r = await client.call_tool("read_page", {"mode": "sse", "text": "streamed", "notes": ["n1", "n2"]},
                                   progress_callback=on_progress)
        assert (r.is_error, r.content[0].text) == (False, "streamed")
        assert (logged, progress) == (["n1"], [(2, "n2")])
        with pytest.raises(MCPError) as err:
            await client.call_tool("delete_all", {"mode": "rpc_error", "text": "refused upstream"})
        assert (err.value.error.code, err.value.error.message) == (-32000, "refused upstream")
        if mode == "legacy":
            # A server request on the call's stream (legacy only): the SDK answers with a POST.
            r = await client.call_tool("read_page", {"mode": "sse", "text": "ask", "sampling": True})
            assert (r.content[0].text, sampled) == ("ask", ["ask"])
            # SSE polling: the SDK follows the priming event's id with a resuming GET.
            r = await client.call_tool("write_note", {"mode": "drop_resumable", "text": "polled", "delay": 0.1})
            assert r.content[0].text == "polled"
    log = up.control.log()
    assert {e["era"] for e in log} == {"session" if mode == "legacy" else "stateless"}
    calls = [(e["params"]["name"], e["outcome"]) for e in log if e["method"] == "tools/call"]
    assert calls == [("write_note", "json"), ("read_page", "sse"), ("delete_all", "error"),
                     *([("read_page", "sse"), ("write_note", "resumed")] if mode == "legacy" else [])]
    if mode == "legacy":
        entries = up.control.wait(lambda entries: any(e["kind"] == "response" for e in entries))
        answer = next(e for e in entries if e["kind"] == "response")
        assert answer["message"]["result"]["content"]["text"] == "ok"
