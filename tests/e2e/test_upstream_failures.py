"""Upstreams that are down, slow, broken or that forgot the session: what the client sees and
what the audit log records. Every failed call is audited with its upstream outcome."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from e2e_helpers import write_policy

from tests.harness import ProxyProcess, free_port, metric_value, proxy_process, rpc, token

OPS = token("ops", tenant="acme")
ECHO_ONLY = {"notes.echo": {"effect": "read"}}
# Far past the `slow` upstream's 1 s timeout, so the bound on the refusal (SLOW_SECONDS - 1)
# leaves a loaded CI machine seconds of room and still tells the timeout from the answer.
SLOW_SECONDS = 10


class FakeUpstreams:
    """A tiny aiohttp server in a thread: /slow sleeps past the timeout, /garbage answers 500."""

    def __init__(self) -> None:
        self.port = free_port()
        self.hits: dict[str, int] = {"slow": 0, "garbage": 0, "reset": 0}
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _slow(self, request: web.Request) -> web.Response:
        self.hits["slow"] += 1
        await request.read()
        await asyncio.sleep(SLOW_SECONDS)
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {"content": [], "isError": False}})

    async def _garbage(self, request: web.Request) -> web.Response:
        self.hits["garbage"] += 1
        await request.read()
        return web.Response(status=500, text="<html>Internal Server Error: oops</html>", content_type="text/html")

    async def _reset(self, request: web.Request) -> web.StreamResponse:
        """Start the call's SSE stream, send a progress event, then drop the connection."""
        self.hits["reset"] += 1
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/progress",'
                         b'"params":{"progressToken":1,"progress":1}}\n\n')
        await asyncio.sleep(0.2)
        assert request.transport is not None
        request.transport.abort()  # a reset, not a clean end of stream
        return resp

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/reset/mcp", self._reset)
        app.router.add_post("/slow/mcp", self._slow)
        app.router.add_post("/garbage/mcp", self._garbage)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:  # the slow handler may still be sleeping
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}/mcp"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("upstream-failures")
    fakes = FakeUpstreams()
    fakes.start()
    try:
        policies = write_policy(
            tmp / "policies",
            {"down": {}, "slow": {"timeout": "1s"}, "garbage": {}, "reset": {}, "notes": {}},
            tools=ECHO_ONLY,
        )
        urls = {"down": f"http://127.0.0.1:{free_port()}/mcp", "slow": fakes.url("slow"),
                "garbage": fakes.url("garbage"), "reset": fakes.url("reset"), "notes": sse_upstream.url}
        with proxy_process(tmp, urls, policies=policies) as pp:
            pp.extra["fakes"] = fakes
            yield pp
    finally:
        fakes.stop()


def echo_call(upstream_id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": upstream_id, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"text": "x"},
                       "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                                 "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
                                 "io.modelcontextprotocol/clientCapabilities": {}}}}


def call(pp: ProxyProcess, upstream: str, **kw: Any) -> httpx.Response:
    return rpc(pp.url(upstream), echo_call(), bearer=OPS,
               headers={"Mcp-Method": "tools/call", "Mcp-Name": "echo"}, **kw)


def the_record(pp: ProxyProcess, before: int) -> dict[str, Any]:
    new = pp.audit_records()[before:]
    assert len(new) == 1, new
    return new[0]


def refusal_of(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, (resp.status_code, resp.text)
    body = resp.json()
    result = body["result"]
    assert result["isError"] is True
    assert body["id"] == 1
    return result


def test_upstream_down(proxy: ProxyProcess) -> None:
    before = len(proxy.audit_records())
    result = refusal_of(call(proxy, "down"))
    text = result["content"][0]["text"]
    assert text.startswith("Blocked by policy (upstream_error): ")
    assert "'down'" in text
    meta = result["_meta"]["envelope/decision"]
    assert meta["code"] == "upstream_error"
    assert meta["check"] == "forward"
    rec = the_record(proxy, before)
    assert rec["decision_id"] == meta["decision_id"]
    assert (rec["verdict"], rec["code"], rec["upstream"]) == ("error", "upstream_error", "down")
    assert metric_value(proxy.metrics(), "envelope_upstream_requests_total", upstream="down", outcome="error") >= 1


def test_upstream_too_slow(proxy: ProxyProcess) -> None:
    before = len(proxy.audit_records())
    started = time.monotonic()
    result = refusal_of(call(proxy, "slow"))
    took = time.monotonic() - started
    assert 0.9 <= took < SLOW_SECONDS - 1, took
    assert proxy.extra["fakes"].hits["slow"] == 1
    meta = result["_meta"]["envelope/decision"]
    assert meta["code"] == "upstream_timeout"
    assert result["content"][0]["text"].startswith("Blocked by policy (upstream_timeout): ")
    assert "'slow'" in meta["reason"] and "1s" in meta["reason"]
    rec = the_record(proxy, before)
    assert (rec["decision_id"], rec["verdict"], rec["code"]) == (meta["decision_id"], "error", "upstream_timeout")
    assert metric_value(proxy.metrics(), "envelope_upstream_requests_total", upstream="slow", outcome="timeout") == 1


def test_upstream_500_is_audited(proxy: ProxyProcess) -> None:
    before = len(proxy.audit_records())
    resp = call(proxy, "garbage")
    assert resp.status_code == 200  # a tool result the model reads, not the upstream's HTML
    rec = the_record(proxy, before)
    assert (rec["verdict"], rec["code"], rec["upstream_status"]) == ("error", "upstream_error", 500)
    assert "500" in rec["reason"]


def test_upstream_500_garbage_is_a_readable_refusal(proxy: ProxyProcess) -> None:
    result = refusal_of(call(proxy, "garbage"))
    meta = result["_meta"]["envelope/decision"]
    assert meta["code"] == "upstream_error"
    assert "'garbage'" in meta["reason"]


def test_unknown_session_404_is_passed_through(proxy: ProxyProcess) -> None:
    before = len(proxy.audit_records())
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"text": "x"}}}
    resp = rpc(proxy.url("notes"), body, bearer=OPS,
               headers={"Mcp-Session-Id": "bogus-session-0123", "MCP-Protocol-Version": "2025-11-25"})
    assert resp.status_code == 404, resp.text  # the client must re-initialize
    rec = the_record(proxy, before)
    assert (rec["verdict"], rec["code"], rec["upstream_status"]) == ("error", "upstream_error", 404)
    assert rec["session"] == "bogus-session-0123"


def test_upstream_resets_mid_stream(proxy: ProxyProcess) -> None:
    """The progress already relayed stays; the call ends with a readable refusal event naming
    the upstream (the SSE stream was open, so the refusal is its last event)."""
    before = len(proxy.audit_records())
    resp = call(proxy, "reset")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [e for e in resp.text.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert "notifications/progress" in events[0]
    last = json.loads(events[-1].split("data: ", 1)[1])
    assert last["id"] == 1 and last["result"]["isError"] is True
    text = last["result"]["content"][0]["text"]
    assert text.startswith("Blocked by policy (upstream_error): ") and "'reset'" in text
    rec = the_record(proxy, before)
    assert (rec["verdict"], rec["code"], rec["upstream"]) == ("error", "upstream_error", "reset")
    # Other upstreams are unaffected.
    ok = call(proxy, "notes")
    assert ok.status_code == 200 and "Blocked" not in ok.text
