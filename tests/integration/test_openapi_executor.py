"""The executor's HTTP seam and the MCP routes of an HTTP upstream, in-process: the runtime's own
wiring against a scripted aiohttp REST service whose every answer the test writes.

What is asserted is what the client, the service and a reviewer see: retries only for calls
that may be repeated, the headers that reach the service (the proxy's credential wins, the
agent's token only for `forward_authorization`), the reply cap, the relayed bytes (`relay`)
kept only when the inspection changed nothing, and what the proxy answers itself.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.app.runtime import Runtime
from proxy.config import Config
from proxy.envelope.types import Principal, RequestInfo, RunContext, ToolCall
from proxy.fronts.forwarded import Downstream, UpstreamRequest
from proxy.upstream.openapi import HttpCall

SECRET = "AKIAIOSFODNN7EXAMPLE"
SPEC = """
openapi: 3.0.3
info: {title: items, version: "1"}
paths:
  /items/{id}:
    get:
      operationId: getItem
      parameters:
        - {name: id, in: path, required: true, schema: {type: integer}}
        - {name: X-Key, in: header, schema: {type: string}}
  /items:
    post:
      operationId: addItem
      requestBody:
        required: true
        content: {application/json: {schema: {type: object, properties: {name: {type: string}}}}}
"""
POLICY = """
version: 1
upstreams:
  api: {url: "http://127.0.0.1:1/v1", openapi: spec.yaml, timeout: 2s, headers: {X-Key: proxy-key}}
  fwd: {url: "http://127.0.0.1:1/v1", openapi: spec.yaml, timeout: 2s, forward_authorization: true}
defaults:
  unknown_tools: allow
  guardrails: [{detector: secrets, action: redact}]
dataflow: {mode: off}
"""

Script = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Service:
    """A scripted REST service: `script` answers; `seen` is every request that reached it."""

    def __init__(self) -> None:
        self.script: Script | None = None
        self.seen: list[dict[str, Any]] = []
        self.body = b""  # what a script may answer with

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append({"method": request.method, "path": request.path_qs,
                          "headers": dict(request.headers), "body": body})
        assert self.script is not None
        return await self.script(request)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[tuple[Runtime, Service, str, aiohttp.ClientSession]]:
    service = Service()
    app = web.Application()
    app.router.add_route("*", "/v1/{tail:.*}", service.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    policies = tmp_path / "policy"
    policies.mkdir()
    (policies / "p.yaml").write_text(POLICY)
    (policies / "spec.yaml").write_text(SPEC)
    config = Config.model_validate({
        "policies": str(policies), "state_dir": str(tmp_path / "state"), "store": {"kind": "memory"},
        "upstreams": {"api": {"url": url}, "fwd": {"url": url}},
        "aggregate": {"enabled": True}, "retry": {"attempts": 3, "backoff": "10ms"},
        "health_interval": 0, "reload_interval": 0,
        "limits": {"max_upstream_reply_bytes": 4096},
    })
    runtime = Runtime(config)
    runtime.load_policy()
    await runtime.forwarder.start()
    proxy = web.AppRunner(runtime.build_mcp_app())
    await proxy.setup()
    await web.TCPSite(proxy, "127.0.0.1", 0).start()
    async with aiohttp.ClientSession() as http:
        yield runtime, service, f"http://127.0.0.1:{proxy.addresses[0][1]}", http
    assert runtime.fronts is not None
    await proxy.cleanup()
    await runtime.fronts.close()
    await runtime.forwarder.close()
    runtime.audit.close()
    await runner.cleanup()


async def _post(http: aiohttp.ClientSession, url: str, method: str, params: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    hdrs = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28",
            **(headers or {})}
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    async with http.post(url, json=body, headers=hdrs) as resp:
        return resp.status, json.loads(await resp.text())


def _records(runtime: Runtime, tool: str) -> list[dict[str, Any]]:
    path = runtime.config.audit_dir / "audit.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["tool"] == tool]


ROUTES = [("/mcp/api", ""), ("/mcp", "api.")]


@pytest.mark.parametrize(("route", "prefix"), ROUTES)
async def test_a_read_is_retried_a_writer_never(stack: Any, route: str, prefix: str) -> None:
    runtime, service, base, http = stack
    answers = iter([503, 503, 200])

    async def flaky(request: web.Request) -> web.StreamResponse:
        status = next(answers, 503)
        if status != 200:
            return web.Response(status=status, text="busy", headers={"Retry-After": "0"})
        return web.json_response({"id": 7})

    service.script = flaky
    status, reply = await _post(http, base + route, "tools/call", {"name": f"{prefix}getItem", "arguments": {"id": 7}})
    assert status == 200 and reply["result"]["structuredContent"] == {"id": 7}
    assert [s["path"] for s in service.seen] == ["/v1/items/7"] * 3
    [rec] = _records(runtime, "getItem")
    assert (rec["code"], rec["upstream_status"], rec["extra"]["attempts"]) == ("ok", 200, 3)

    status, reply = await _post(http, base + route, "tools/call", {"name": f"{prefix}addItem", "arguments": {"name": "x"}})
    assert status == 200 and reply["result"] == {"content": [{"type": "text", "text": "HTTP 503: busy"}],
                                                 "isError": True, "resultType": "complete"}
    assert [s["method"] for s in service.seen].count("POST") == 1
    assert json.loads(service.seen[-1]["body"]) == {"name": "x"}
    [rec] = _records(runtime, "addItem")
    assert rec["upstream_status"] == 503 and "attempts" not in rec.get("extra", {})


async def test_the_proxys_credential_wins_and_the_agents_token_stays_home(stack: Any) -> None:
    _, service, base, http = stack

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    service.script = ok
    agent = {"Authorization": "Bearer agent-token"}
    await _post(http, f"{base}/mcp/api", "tools/call",
                {"name": "getItem", "arguments": {"id": 1, "X-Key": "agent-chosen"}}, agent)
    sent = service.seen[-1]["headers"]
    assert sent["X-Key"] == "proxy-key" and "Authorization" not in sent
    await _post(http, f"{base}/mcp/fwd", "tools/call", {"name": "getItem", "arguments": {"id": 1, "X-Key": "k"}}, agent)
    sent = service.seen[-1]["headers"]
    assert sent["Authorization"] == "Bearer agent-token" and sent["X-Key"] == "k"


async def test_a_reply_past_the_cap_is_refused(stack: Any) -> None:
    runtime, service, base, http = stack

    async def huge(request: web.Request) -> web.StreamResponse:
        return web.Response(text="x" * 10_000)

    service.script = huge
    _, reply = await _post(http, f"{base}/mcp/api", "tools/call", {"name": "getItem", "arguments": {"id": 1}})
    decision = reply["result"]["_meta"]["envelope/decision"]
    assert decision["code"] == "upstream_error" and "exceeds 4096 bytes" in decision["reason"]
    assert _records(runtime, "getItem")[-1]["code"] == "upstream_error"


async def test_the_proxy_answers_what_an_http_upstream_cannot(stack: Any) -> None:
    _, service, base, http = stack
    status, reply = await _post(http, f"{base}/mcp/api", "resources/list", {})
    assert status == 404 and reply["error"]["code"] == -32601
    status, reply = await _post(http, f"{base}/mcp/api", "ping", {})
    assert status == 200 and reply["result"] == {"resultType": "complete"}
    async with http.get(f"{base}/mcp/api", headers={"Accept": "text/event-stream"}) as resp:
        assert resp.status == 405
    assert service.seen == []  # nothing of MCP reached the REST service


async def _run(runtime: Runtime) -> Any:
    """Decide and execute one `getItem` call with `relay=True`, as the plain HTTP front does."""
    call = ToolCall(decision_id=uuid.uuid4().hex, upstream="api", tool="getItem", arguments={"id": 3},
                    principal=Principal("agent"), run=RunContext("r", "agent"), request=RequestInfo("tools/call"))
    pending = await runtime.envelope.begin(call)
    target = runtime.target("api")
    assert target is not None and runtime.fronts is not None
    request = UpstreamRequest(target, b"", {}, "rid", http=HttpCall("GET", "/items/3", {}, None, relay=True))
    return await runtime.fronts.executor.run(pending, request, Downstream())


async def test_relay_keeps_the_services_bytes_unless_a_guardrail_rewrote_them(stack: Any) -> None:
    runtime, service, _, _ = stack
    plain = b'{"name":  "widget"}'

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(body=service.body, content_type="application/json", status=201)

    service.script = answer
    service.body = plain
    outcome = await _run(runtime)
    assert (outcome.kind, outcome.status, outcome.raw) == ("deliver", 201, plain)
    assert outcome.message["result"]["structuredContent"] == {"name": "widget"}
    service.body = json.dumps({"name": SECRET}).encode()
    outcome = await _run(runtime)
    assert outcome.kind == "deliver" and outcome.raw is None
    assert outcome.message["result"]["structuredContent"] == {"name": "[REDACTED:aws_access_key_id]"}
