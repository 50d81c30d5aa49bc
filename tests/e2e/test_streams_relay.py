"""Streaming MCP through the real proxy process, against the official SDK fixture server
(`stream_server.py`) and official SDK clients in both revision families.

`legacy` is the session-based 2025-11-25 revision; `auto` is the stateless 2026-07-28 one. What
is asserted is what the client and the upstream see: progress and logging notifications, sampling
and elicitation round trips, the standalone GET stream, resumption with `Last-Event-ID`,
cancellation and disconnects (with the audit record), no buffering, a 10 MB result, and 100
concurrent sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from stream_server import StreamUpstream, big_text, sha256_text, stream_upstream

from tests.harness import ProxyProcess, proxy_process

MODES = ("legacy", "auto")
TOOLS = ("progress", "log_messages", "sample", "elicit", "big", "slow", "broadcast", "counts")
LEGACY = "2025-11-25"
STATELESS = "2026-07-28"


def write_stream_policy(directory: Path, upstream: str = "streams") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tools = "\n".join(f"  {upstream}.{t}:\n    effect: read" for t in TOOLS)
    (directory / "streams.yaml").write_text(
        f"version: 1\nupstreams:\n  {upstream}:\n    url: \"http://127.0.0.1:1/mcp\"\n    timeout: 60s\n"
        f"defaults:\n  log_args: true\ntools:\n{tools}\n"
    )
    return directory


class World:
    def __init__(self, proxy: ProxyProcess, upstream: StreamUpstream):
        self.proxy = proxy
        self.upstream = upstream

    @property
    def url(self) -> str:
        return self.proxy.url("streams")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("streams")
    with stream_upstream(tmp / "upstream", mode="sse", event_store=True) as up:
        policies = write_stream_policy(tmp / "policies")
        with proxy_process(tmp, {"streams": up.url}, policies=policies,
                           identity={"mode": "static", "principal": "agent"}) as pp:
            yield World(pp, up)


@contextlib.asynccontextmanager
async def sdk_client(url: str, mode: str, max_sse_event_size: int | None = None,
                     **callbacks: Any) -> AsyncIterator[Any]:
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    kw: dict[str, Any] = {}
    if max_sse_event_size is not None:
        kw["max_sse_event_size"] = max_sse_event_size
    http = create_mcp_http_client()
    async with http, Client(streamable_http_client(url, http_client=http, **kw), mode=mode,
                            cache=None, **callbacks) as client:
        yield client


def tag_of(test: str, mode: str) -> str:
    return f"{test}-{mode}-{time.monotonic_ns()}"


async def wait_for(predicate: Any, timeout: float, what: str) -> Any:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def records_for(proxy: ProxyProcess, tag: str) -> list[dict[str, Any]]:
    return [r for r in proxy.audit_records() if (r.get("args") or {}).get("tag") == tag]


# ---- raw HTTP: what a client puts on the wire ------------------------------------------------

BASE_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
CLIENT_INFO = {"name": "raw-test", "version": "0"}


def stateless_request(id: Any, method: str, params: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    meta = {"io.modelcontextprotocol/protocolVersion": STATELESS,
            "io.modelcontextprotocol/clientInfo": CLIENT_INFO,
            "io.modelcontextprotocol/clientCapabilities": {}}
    headers = {**BASE_HEADERS, "MCP-Protocol-Version": STATELESS, "Mcp-Method": method}
    if method == "tools/call":
        headers["Mcp-Name"] = params["name"]
    body = {"jsonrpc": "2.0", "id": id, "method": method,
            "params": {**params, "_meta": {**params.get("_meta", {}), **meta}}}
    return headers, body


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Parse an SSE body event by event: {"id", "event", "data" (str), "json" (or None)}."""
    buf = ""
    async for text in resp.aiter_text():
        buf += text.replace("\r\n", "\n")
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            ev: dict[str, Any] = {"id": None, "event": None, "data": None}
            data: list[str] = []
            for line in block.split("\n"):
                if not line or line.startswith(":"):
                    continue
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "data":
                    data.append(value)
                elif field in ("id", "event", "retry"):
                    ev[field] = value
            ev["data"] = "\n".join(data) if data else None
            ev["json"] = json.loads(ev["data"]) if ev["data"] else None
            yield ev


async def legacy_session(client: httpx.AsyncClient, url: str) -> dict[str, str]:
    """initialize + notifications/initialized; the headers every later request carries."""
    body = {"jsonrpc": "2.0", "id": "init-1", "method": "initialize",
            "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": CLIENT_INFO}}
    resp = await client.post(url, json=body, headers=BASE_HEADERS)
    assert resp.status_code == 200, resp.text
    session = resp.headers["mcp-session-id"]
    headers = {**BASE_HEADERS, "Mcp-Session-Id": session, "MCP-Protocol-Version": LEGACY}
    resp = await client.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers)
    assert resp.status_code == 202, resp.text
    return headers


# ---- notifications ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_progress_and_logging_reach_the_client_callbacks(world: World, mode: str) -> None:
    progress: list[tuple[float, float | None, str | None]] = []
    logs: list[Any] = []

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        progress.append((p, total, message))

    async def on_log(params: Any) -> None:
        logs.append((params.level, params.logger, params.data))

    async with sdk_client(world.url, mode, logging_callback=on_log, log_level="debug") as c:
        r = await c.call_tool("progress", {"n": 4, "interval": 0.1}, progress_callback=on_progress)
        assert r.is_error is False and r.content[0].text == "progressed 4"
        assert progress == [(float(i), 4.0, f"step {i}") for i in range(1, 5)]
        r = await c.call_tool("log_messages", {"n": 3})
        assert r.is_error is False and r.content[0].text == "logged 3"
    assert logs == [("info", "fixture", f"log line {i}") for i in range(1, 4)]


# ---- server-to-client requests ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_sampling_and_elicitation_round_trip(world: World, mode: str) -> None:
    from mcp_types import CreateMessageResult, ElicitResult, TextContent

    asked: list[tuple[str, Any]] = []

    async def on_sampling(ctx: Any, params: Any) -> CreateMessageResult:
        asked.append(("sampling", params.messages[0].content.text))
        return CreateMessageResult(role="assistant", content=TextContent(type="text", text=f"llm says {mode} ü"),
                                   model="fixture-model")

    async def on_elicitation(ctx: Any, params: Any) -> ElicitResult:
        asked.append(("elicitation", params.message))
        return ElicitResult(action="accept", content={"answer": f"user says {mode}"})

    before = len(world.proxy.audit_records())
    async with sdk_client(world.url, mode, sampling_callback=on_sampling,
                          elicitation_callback=on_elicitation) as c:
        r = await c.call_tool("sample", {"prompt": "what is 6 x 7?"})
        assert r.is_error is False, r
        assert r.content[0].text == f"sampled: llm says {mode} ü (model fixture-model)"
        r = await c.call_tool("elicit", {"question": "your name?"})
        assert r.is_error is False, r
        assert r.content[0].text == f"elicited: user says {mode}"
    assert asked == [("sampling", "what is 6 x 7?"), ("elicitation", "your name?")]
    recs = world.proxy.audit_records()[before:]
    # Legacy: one call each (answers are POSTs without a method). 2026-07-28: the input_required
    # round and the retry with inputResponses are two tools/call requests each, all audited.
    assert [r["tool"] for r in recs] == (["sample", "elicit"] if mode == "legacy"
                                         else ["sample", "sample", "elicit", "elicit"])
    assert all(r["verdict"] == "allow" and r["code"] == "ok" for r in recs)


# ---- the standalone GET stream and resumption (legacy) ----------------------------------------


async def test_standalone_get_stream_is_relayed(world: World) -> None:
    async with httpx.AsyncClient(timeout=20) as client:
        headers = await legacy_session(client, world.url)
        got: list[dict[str, Any]] = []
        opened = asyncio.Event()

        async def listen() -> None:
            async with client.stream("GET", world.url, headers={**headers, "Accept": "text/event-stream"}) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                opened.set()
                async for ev in sse_events(resp):
                    got.append(ev)
                    if ev["json"] and ev["json"].get("method") == "notifications/message":
                        return

        task = asyncio.create_task(listen())
        await asyncio.wait_for(opened.wait(), 10)
        # The server registers the GET stream some time after the response started (a fixed
        # 0.3 s pause was short on a loaded machine): broadcast until the stream relays one.
        deadline = time.monotonic() + 15
        for n in range(1000):
            resp = await client.post(world.url, headers=headers, json={
                "jsonrpc": "2.0", "id": f"b-{n}", "method": "tools/call",
                "params": {"name": "broadcast", "arguments": {"text": "to everyone"}}})
            assert resp.status_code == 200
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done or time.monotonic() > deadline:
                break
        await asyncio.wait_for(task, 10)
        note = got[-1]["json"]
        assert note["params"]["data"] == "to everyone" and note["params"]["logger"] == "broadcast"
        resp = await client.delete(world.url, headers=headers)
        assert resp.status_code in (200, 204)


async def resume_after_drop(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST `body`, drop the connection after two progress notifications, resume with GET and
    Last-Event-ID; the JSON-RPC messages of the resumed stream up to the response."""
    async with httpx.AsyncClient(timeout=30) as client:
        headers = await legacy_session(client, url)
        first: list[dict[str, Any]] = []
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for ev in sse_events(resp):
                first.append(ev)
                if sum(1 for e in first if e["json"]) == 2:
                    break  # drop the connection after two progress notifications
        assert all(e["id"] for e in first), f"every event carries an id: {first}"
        progress = [e["json"]["params"]["progress"] for e in first if e["json"]]
        assert progress == [1, 2]
        last_id = first[-1]["id"]
        rest: list[dict[str, Any]] = []
        async with client.stream("GET", url, headers={**headers, "Accept": "text/event-stream",
                                                      "Last-Event-ID": last_id}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for ev in sse_events(resp):
                rest.append(ev)
                if ev["json"] and ev["json"].get("id") == body["id"]:
                    break
        return [e["json"] for e in rest if e["json"]]


def progress_of(messages: list[dict[str, Any]]) -> list[Any]:
    return [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]


# Seen failing once under a fully loaded 2-core machine and never in isolation: the SDK
# upstream's replay of stored events and its live stream race. One rerun keeps CI honest
# (a proxy that loses the stream fails every attempt).
@pytest.mark.flaky(reruns=1)
async def test_resumption_with_last_event_id_of_a_relayed_stream(world: World) -> None:
    """prompts/get is relayed byte for byte: its stream resumes through the proxy."""
    messages = await resume_after_drop(world.url, {
        "jsonrpc": "2.0", "id": "r-1", "method": "prompts/get",
        "params": {"name": "progress_prompt", "arguments": {"n": "6", "interval": "0.4"},
                   "_meta": {"progressToken": "tok-r"}}})
    assert progress_of(messages) == [3, 4, 5, 6]
    assert messages[-1]["result"]["messages"][0]["content"]["text"] == "prompt after 6 steps"


# The same upstream race as above, seen once (2026-12-01, load ~3) and not in five reruns.
@pytest.mark.flaky(reruns=1)
async def test_resumption_with_last_event_id_of_a_tools_call(world: World) -> None:
    messages = await resume_after_drop(world.url, {
        "jsonrpc": "2.0", "id": "r-1", "method": "tools/call",
        "params": {"name": "progress", "arguments": {"n": 6, "interval": 0.4, "tag": "resume"},
                   "_meta": {"progressToken": "tok-r"}}})
    assert progress_of(messages) == [3, 4, 5, 6]
    assert messages[-1]["result"]["content"][0]["text"] == "progressed 6"


# ---- cancellation and disconnects -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_sdk_client_cancelling_a_call_cancels_the_upstream(world: World, mode: str) -> None:
    """Legacy: the SDK sends notifications/cancelled. 2026-07-28: it closes the response stream."""
    tag = tag_of("sdkcancel", mode)
    async with sdk_client(world.url, mode) as c:
        with anyio.move_on_after(20):
            async with anyio.create_task_group() as tg:
                async def call() -> None:
                    await c.call_tool("slow", {"seconds": 30, "tag": tag})

                tg.start_soon(call)
                await wait_for(lambda: world.upstream.lines(f"started-{tag}"), 10, "the slow tool started")
                tg.cancel_scope.cancel()
        await wait_for(lambda: world.upstream.lines(f"cancelled-{tag}"), 5, "the upstream observed the cancellation")
        # The session is still usable afterwards.
        r = await c.call_tool("counts", {})
        assert r.structured_content["cancelled"] >= 1
    assert not world.upstream.lines(f"finished-{tag}")


async def test_notifications_cancelled_reaches_the_upstream(world: World) -> None:
    tag = tag_of("cancel", "legacy")
    async with httpx.AsyncClient(timeout=30) as client:
        headers = await legacy_session(client, world.url)
        body = {"jsonrpc": "2.0", "id": "c-1", "method": "tools/call",
                "params": {"name": "slow", "arguments": {"seconds": 30, "tag": tag}}}
        events: list[dict[str, Any]] = []

        async def call() -> None:
            async with client.stream("POST", world.url, json=body, headers=headers) as resp:
                async for ev in sse_events(resp):
                    events.append(ev)

        task = asyncio.create_task(call())
        await wait_for(lambda: world.upstream.lines(f"started-{tag}"), 10, "the slow tool started")
        resp = await client.post(world.url, headers=headers, json={
            "jsonrpc": "2.0", "method": "notifications/cancelled",
            "params": {"requestId": "c-1", "reason": "user pressed stop"}})
        assert resp.status_code == 202
        await wait_for(lambda: world.upstream.lines(f"cancelled-{tag}"), 5, "the upstream observed the cancellation")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("mode", MODES)
async def test_client_disconnect_mid_call_cancels_upstream_and_is_audited(world: World, mode: str) -> None:
    tag = tag_of("disconnect", mode)
    disconnects_before = world.upstream.disconnects()
    async with httpx.AsyncClient(timeout=30) as client:
        args = {"name": "slow", "arguments": {"seconds": 30, "tag": tag}, "_meta": {"progressToken": "d"}}
        if mode == "legacy":
            headers = await legacy_session(client, world.url)
            body = {"jsonrpc": "2.0", "id": "d-1", "method": "tools/call", "params": args}
        else:
            headers, body = stateless_request("d-1", "tools/call", args)
        async with client.stream("POST", world.url, json=body, headers=headers) as resp:
            assert resp.status_code == 200
            await wait_for(lambda: world.upstream.lines(f"started-{tag}"), 10, "the slow tool started")
            # leaving the block closes the connection while the tool still sleeps
    started = time.monotonic()

    def upstream_noticed() -> bool:
        return bool(world.upstream.lines(f"cancelled-{tag}")) or world.upstream.disconnects() > disconnects_before

    await wait_for(upstream_noticed, 5, "the upstream observed a cancellation or a closed stream")
    [record] = await wait_for(lambda: records_for(world.proxy, tag), 5, "an audit record for the call")
    assert record["extra"]["client_disconnected"] is True
    if mode == "auto":  # 2026-07-28: closing the response stream is the cancellation
        await wait_for(lambda: world.upstream.lines(f"cancelled-{tag}"), 5, "the upstream cancelled the call")
        assert (record["tool"], record["verdict"], record["code"], record["check"]) == (
            "slow", "error", "client_disconnected", "forward")
        assert not world.upstream.lines(f"finished-{tag}")
    else:
        # This upstream keeps an event store: its stream is resumable, and 2025-11-25 says a
        # disconnect is not a cancellation then (the client may resume with Last-Event-ID).
        # The non-resumable case (cancelled) is tests/integration/test_relay_streams.py.
        assert not world.upstream.lines(f"cancelled-{tag}")
        assert (record["tool"], record["verdict"], record["code"]) == ("slow", "allow", "ok")
        # The result may reach the client later, on a resumed stream: it is inspected and
        # recorded then (tests/e2e/test_response_path.py), so the run is not made coarse now.
        assert "resumable" in record["reason"] and "lost" not in record["extra"].get("dataflow_recorded", {})
    assert time.monotonic() - started < 10


# ---- no buffering -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_first_progress_arrives_before_the_upstream_sends_the_last(world: World, mode: str) -> None:
    tag = tag_of("nobuffer", mode)
    received: list[float] = []

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        received.append(time.time())

    async with sdk_client(world.url, mode) as c:
        r = await c.call_tool("progress", {"n": 5, "interval": 0.6, "tag": tag}, progress_callback=on_progress)
    assert r.content[0].text == "progressed 5"
    assert len(received) == 5
    last_sent = float((world.upstream.state / f"progress-last-{tag}").read_text())
    # 2.4 s separate the first and the last notification upstream; a buffering relay would
    # deliver the first one after the last was sent.
    assert received[0] < last_sent - 1.5, (received[0], last_sent)


# ---- a big result -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_ten_megabyte_result_passes_intact(world: World, mode: str) -> None:
    size = 10 * 1024 * 1024
    expected = sha256_text(big_text(size))
    async with sdk_client(world.url, mode, max_sse_event_size=64 * 1024 * 1024) as c:
        r = await c.call_tool("big", {"size": size})
    assert r.is_error is False
    text = r.content[0].text
    assert len(text) == size
    assert sha256_text(text) == expected


# ---- many sessions ----------------------------------------------------------------------------


async def test_hundred_concurrent_legacy_sessions(world: World) -> None:
    async def one(i: int) -> str:
        async with sdk_client(world.url, "legacy") as c:
            names = {t.name for t in (await c.list_tools()).tools}
            assert set(TOOLS) <= names
            r = await c.call_tool("progress", {"n": 2, "interval": 0.05, "tag": f"many-{i}"})
            return r.content[0].text

    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(100))), 60)
    assert results == ["progressed 2"] * 100
    assert time.monotonic() - started < 60
    recs = [r for r in world.proxy.audit_records() if str((r.get("args") or {}).get("tag", "")).startswith("many-")]
    assert len(recs) == 100 and all(r["code"] == "ok" for r in recs)
