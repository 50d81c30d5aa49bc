"""In-band approval through the wire: the real proxy process, the official SDK client with and
without an elicitation callback, the demo notes server (its `delete_note` answers `existed`, so
a second deletion would show).

`notes` points at the demo server directly; `rec` points at a recording pass-through in front
of it, so the tests can assert what the upstream received (never the proxy's own
`inputResponses` / `requestState`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from e2e_helpers import upstream_server, write_doc

from tests.harness import ProxyProcess, free_port, metric_value, proxy_process, rpc, token

OPS = token("ops")
STATELESS = "2026-07-28"


class Recorder:
    """A pass-through upstream (own thread and loop) recording every JSON body it forwards."""

    def __init__(self, target: str):
        self.target = target
        self.bodies: list[dict[str, Any]] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def calls(self) -> list[dict[str, Any]]:
        return [b for b in self.bodies if b.get("method") == "tools/call"]

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if raw:
            with contextlib.suppress(ValueError):
                self.bodies.append(json.loads(raw))
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")}
        async with aiohttp.ClientSession() as s, s.request(request.method, self.target, data=raw or None,
                                                           headers=headers) as resp:
            body = await resp.read()
            out = {k: v for k, v in resp.headers.items()
                   if k.lower() in ("content-type", "mcp-session-id")}
            return web.Response(status=resp.status, body=body, headers=out)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/mcp", self._handle)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _policy(directory: Path) -> Path:
    tools: dict[str, Any] = {}
    for upstream in ("notes", "rec"):
        tools[f"{upstream}.delete_note"] = {
            "effect": "destructive", "approval": {"required": True, "in_band": True, "wait": "5s"}}
        tools[f"{upstream}.write_note"] = {"effect": "write"}
        tools[f"{upstream}.search_notes"] = {"effect": "read"}
    # Same tool without in_band: the client is never asked.
    tools["plain.delete_note"] = {"effect": "destructive", "approval": {"required": True, "wait": "1s"}}
    tools["plain.write_note"] = {"effect": "write"}
    doc = {
        "version": 1,
        "upstreams": {u: {"url": "http://127.0.0.1:1/mcp", "timeout": "20s"} for u in ("notes", "rec", "plain")},
        "defaults": {"unknown_tools": "deny"},
        "tools": tools,
    }
    return write_doc(directory, doc)


class World:
    def __init__(self, proxy: ProxyProcess, recorder: Recorder):
        self.proxy = proxy
        self.recorder = recorder


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("inband")
    with upstream_server("sse") as up:
        recorder = Recorder(up.url)
        try:
            config = {"approvals": {"poll_interval": "100ms"}}
            with proxy_process(tmp, {"notes": up.url, "plain": up.url, "rec": recorder.url},
                               policies=_policy(tmp / "policies"), config=config) as pp:
                yield World(pp, recorder)
        finally:
            recorder.close()


@contextlib.asynccontextmanager
async def client(url: str, mode: str, **callbacks: Any) -> AsyncIterator[Any]:
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    http = create_mcp_http_client(headers={"Authorization": f"Bearer {OPS}"})
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode, cache=None,
                            **callbacks) as c:
        yield c


def answering(action: str, content: dict[str, Any] | None = None,
              asked: list[Any] | None = None) -> Any:
    from mcp_types import ElicitResult

    async def on_elicitation(ctx: Any, params: Any) -> Any:
        if asked is not None:
            asked.append(params)
        return ElicitResult(action=action, content=content)  # type: ignore[arg-type]

    return on_elicitation


def decision(result: Any) -> dict[str, Any]:
    return dict((result.meta or {})["envelope/decision"])


def records(world: World, tool: str = "delete_note") -> list[dict[str, Any]]:
    return [r for r in world.proxy.audit_records() if r["tool"] == tool]


def record(world: World, decision_id: str) -> dict[str, Any]:
    found = [r for r in world.proxy.audit_records() if r["decision_id"] == decision_id]
    assert len(found) == 1, found
    return found[0]


# -- sessions (2025-11-25): elicitation/create on the call's stream ----------------------------


async def test_legacy_accept_performs_the_call_once(world: World) -> None:
    asked: list[Any] = []
    cb = answering("accept", {"approve": True, "reason": "cleanup"}, asked)
    async with client(world.proxy.url("notes"), "legacy", elicitation_callback=cb) as c:
        await c.call_tool("write_note", {"title": "inband-a", "body": "x"})
        r = await c.call_tool("delete_note", {"title": "inband-a"})
        assert r.is_error is False, r
        assert r.structured_content == {"deleted": "inband-a", "existed": True}
        meta = decision(r) if r.meta and "envelope/decision" in r.meta else None
        assert meta is None  # a forwarded result carries the upstream's own _meta only
        again = await c.call_tool("search_notes", {"query": "inband-a"})
        assert "inband-a" not in json.dumps(again.structured_content)
    assert len(asked) == 1
    assert "delete_note" in asked[0].message and "notes" in asked[0].message
    assert "sha256:" in asked[0].message and "inband-a" in asked[0].message
    schema = asked[0].requested_schema
    assert schema["properties"]["approve"]["type"] == "boolean"
    recs = [r for r in records(world) if r["upstream"] == "notes" and r["verdict"] == "allow"]
    assert len(recs) == 1, recs
    extra = recs[0]["extra"]
    assert extra["approver"] == "user:ops" and extra["in_band"] is True
    assert extra["approval_id"].startswith("apr-")


async def test_legacy_decline_is_denied(world: World) -> None:
    async with client(world.proxy.url("notes"), "legacy",
                      elicitation_callback=answering("decline")) as c:
        await c.call_tool("write_note", {"title": "inband-b", "body": "x"})
        r = await c.call_tool("delete_note", {"title": "inband-b"})
        assert r.is_error is True
        d = decision(r)
        assert d["code"] == "approval_denied", d
        assert "user:ops" in d["reason"]
        rec = record(world, d["decision_id"])
        assert rec["extra"]["in_band"] is True and rec["extra"]["approver"] == "user:ops"
        # Not performed: the note is still there.
        found = await c.call_tool("search_notes", {"query": "inband-b"})
        assert "inband-b" in json.dumps(found.structured_content)


async def test_legacy_approve_false_is_denied(world: World) -> None:
    async with client(world.proxy.url("notes"), "legacy",
                      elicitation_callback=answering("accept", {"approve": False, "reason": "no"})) as c:
        r = await c.call_tool("delete_note", {"title": "inband-c"})
        assert decision(r)["code"] == "approval_denied"
        assert "no" in decision(r)["reason"]


async def test_legacy_without_elicitation_falls_back(world: World) -> None:
    async with client(world.proxy.url("notes"), "legacy") as c:
        r = await asyncio.wait_for(c.call_tool("delete_note", {"title": "inband-d"}), 20)
    d = decision(r)
    assert d["code"] == "approval_pending", d
    assert "apr-" in d["reason"]
    rec = record(world, d["decision_id"])
    assert rec["extra"]["approval_id"].startswith("apr-")
    assert "in_band" not in rec["extra"]


async def test_policy_without_in_band_never_asks(world: World) -> None:
    asked: list[Any] = []
    async with client(world.proxy.url("plain"), "legacy",
                      elicitation_callback=answering("accept", {"approve": True}, asked)) as c:
        r = await c.call_tool("delete_note", {"title": "inband-e"})
    assert decision(r)["code"] == "approval_pending"
    assert asked == []


# -- stateless (2026-07-28): input_required --------------------------------------------------


async def test_stateless_round_trip_hides_the_proxy_state(world: World) -> None:
    asked: list[Any] = []
    cb = answering("accept", {"approve": True}, asked)
    before = len(world.recorder.calls())
    async with client(world.proxy.url("rec"), "auto", elicitation_callback=cb) as c:
        await c.call_tool("write_note", {"title": "inband-s", "body": "x"})
        r = await c.call_tool("delete_note", {"title": "inband-s"})
    assert r.is_error is False, r
    assert r.structured_content == {"deleted": "inband-s", "existed": True}
    assert len(asked) == 1 and "delete_note" in asked[0].message
    calls = world.recorder.calls()[before:]
    deletes = [b for b in calls if b["params"]["name"] == "delete_note"]
    assert len(deletes) == 1  # the input_required round never reached the upstream
    params = deletes[0]["params"]
    assert "requestState" not in params
    assert "envelope/approval" not in (params.get("inputResponses") or {})
    recs = [r for r in records(world) if r["upstream"] == "rec"]
    assert [(r["code"], r["extra"].get("in_band")) for r in recs] == [
        ("approval_pending", "input_required"), ("ok", True)]
    assert recs[1]["extra"]["approver"] == "user:ops"


def _stateless_call(world: World, title: str, id: str, **params: Any) -> Any:
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "delete_note", "arguments": {"title": title},
        "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                  "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
                  "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}},
        **params}}
    resp = rpc(world.proxy.url("rec"), body, bearer=OPS,
               headers={"Mcp-Method": "tools/call", "Mcp-Name": "delete_note"})
    assert resp.status_code == 200, resp.text
    return resp.json()["result"]


def test_stateless_forged_and_replayed_state_is_refused(world: World) -> None:
    first = _stateless_call(world, "inband-f", "f-1")
    assert first["resultType"] == "input_required"
    ask = first["inputRequests"]["envelope/approval"]
    assert ask["method"] == "elicitation/create" and ask["params"]["mode"] == "form"
    state = first["requestState"]
    accept = {"envelope/approval": {"action": "accept", "content": {"approve": True}}}
    # Forged: signature changed.
    forged = state[:-4] + ("AAAA" if not state.endswith("AAAA") else "BBBB")
    r = _stateless_call(world, "inband-f", "f-2", inputResponses=accept, requestState=forged)
    assert r["isError"] is True and r["_meta"]["envelope/decision"]["code"] == "approval_denied"
    # A state for another call (other arguments) is refused too.
    r = _stateless_call(world, "inband-other", "f-3", inputResponses=accept, requestState=state)
    assert r["_meta"]["envelope/decision"]["code"] == "approval_denied"
    # An answer without the state.
    r = _stateless_call(world, "inband-f", "f-4", inputResponses=accept)
    assert r["_meta"]["envelope/decision"]["code"] == "approval_denied"
    # The genuine answer goes through, once.
    before = len(world.recorder.calls())
    r = _stateless_call(world, "inband-f", "f-5", inputResponses=accept, requestState=state)
    assert r.get("isError") is False, r
    # Replayed: the same state again is refused (and nothing reaches the upstream).
    r = _stateless_call(world, "inband-f", "f-6", inputResponses=accept, requestState=state)
    assert r["_meta"]["envelope/decision"]["code"] == "approval_denied"
    assert "could not be verified" in r["content"][0]["text"]
    calls = world.recorder.calls()[before:]
    assert len(calls) == 1 and "requestState" not in calls[0]["params"]


def test_stateless_state_handed_out_before_a_reload_opens_after_it(world: World) -> None:
    """One signer per process, not per policy revision: a SIGHUP reload between the question
    and the answer does not turn the person's approval into a refusal."""
    first = _stateless_call(world, "inband-r", "r-1")
    assert first["resultType"] == "input_required"
    reloads = metric_value(world.proxy.metrics(), "envelope_policy_reloads_total", result="success")
    world.proxy.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while metric_value(world.proxy.metrics(), "envelope_policy_reloads_total",
                       result="success") == reloads:
        assert time.monotonic() < deadline, "the proxy did not reload"
        time.sleep(0.1)
    accept = {"envelope/approval": {"action": "accept", "content": {"approve": True}}}
    r = _stateless_call(world, "inband-r", "r-2", inputResponses=accept,
                        requestState=first["requestState"])
    assert r.get("isError") is False, r
    assert r["structuredContent"] == {"deleted": "inband-r", "existed": False}
    last = [rec for rec in records(world) if rec["upstream"] == "rec"][-1]
    assert (last["code"], last["extra"]["approver"], last["extra"]["in_band"]) == ("ok", "user:ops", True)


def test_stateless_without_elicitation_falls_back(world: World) -> None:
    body = {"jsonrpc": "2.0", "id": "n-1", "method": "tools/call", "params": {
        "name": "delete_note", "arguments": {"title": "inband-g"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                  "io.modelcontextprotocol/clientCapabilities": {}}}}
    resp = rpc(world.proxy.url("rec"), body, bearer=OPS, timeout=20,
               headers={"Mcp-Method": "tools/call", "Mcp-Name": "delete_note"})
    result = resp.json()["result"]
    assert result.get("resultType") == "complete"
    assert result["_meta"]["envelope/decision"]["code"] == "approval_pending"


def test_stateless_state_replayed_in_another_run_or_by_another_principal_is_refused(world: World) -> None:
    """A state minted for one run and principal releases nothing elsewhere: the same call (same
    arguments) in another run, or by another principal, is refused and reaches no upstream."""
    accept = {"envelope/approval": {"action": "accept", "content": {"approve": True}}}

    def call(id: str, bearer: str, run: str, **params: Any) -> Any:
        body = {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "delete_note", "arguments": {"title": "inband-x"},
            "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                      "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
                      "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}},
            **params}}
        resp = rpc(world.proxy.url("rec"), body, bearer=bearer,
                   headers={"Mcp-Method": "tools/call", "Mcp-Name": "delete_note", "X-Envelope-Run": run})
        assert resp.status_code == 200, resp.text
        return resp.json()["result"]

    first = call("x-1", OPS, "run-x")
    assert first["resultType"] == "input_required"
    state = first["requestState"]
    before = len(world.recorder.calls())
    for id, bearer, run in (("x-2", OPS, "run-y"), ("x-3", token("dev"), "run-x")):
        r = call(id, bearer, run, inputResponses=accept, requestState=state)
        assert r["isError"] is True, r
        assert r["_meta"]["envelope/decision"]["code"] == "approval_denied"
        assert "could not be verified" in r["content"][0]["text"]
    assert world.recorder.calls()[before:] == []
    # Its own run and principal still take it, once.
    r = call("x-4", OPS, "run-x", inputResponses=accept, requestState=state)
    assert r.get("isError") is False, r
    assert len(world.recorder.calls()[before:]) == 1
