"""A hostile stdio upstream (`hostile_stdio.py`) behind the real `envelope-proxy serve`: what the
agent gets and what is audited when the child answers twice, answers ids nobody asked for,
writes id-less results, invalid UTF-8, answers after the timeout, or exits at start-up; and an
agent that reuses a request id while it is in flight in its session.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc

from tests.harness import ProxyProcess, proxy_process

SERVER = Path(__file__).resolve().parent / "hostile_stdio.py"
SECRET = "AKIAIOSFODNN7EXAMPLE"
LEGACY = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
MODERN = {**LEGACY, "MCP-Protocol-Version": "2026-07-28"}
READS = ("echo", "twice", "stranger", "idless", "badutf8", "dupkey", "late", "ask")


@dataclass
class World:
    proxy: ProxyProcess
    state: Path

    def writes(self) -> list[str]:
        path = self.state / "writes"
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("hostile-stdio")
    state = tmp / "child"
    state.mkdir()
    tools: dict[str, Any] = {f"h.{t}": {"effect": "read", "output": "untrusted"} for t in READS}
    tools["h.write"] = {"effect": "write"}
    tools["dead.echo"] = {"effect": "read"}
    command = [sys.executable, str(SERVER)]
    policies = write_doc(tmp / "policies", {
        "version": 1,
        "upstreams": {"h": {"command": command, "timeout": "3s", "env": {"HOSTILE_STATE": str(state)}},
                      "dead": {"command": command, "timeout": "3s", "env": {"HOSTILE_EXIT": "3"}}},
        "defaults": {"unknown_tools": "deny", "guardrails": [{"detector": "secrets", "action": "redact"}]},
        "tools": tools,
    })
    with proxy_process(tmp, {}, policies=policies, identity={"mode": "static", "principal": "agent"},
                       config={"aggregate": {"enabled": True}}) as pp:
        yield World(pp, state)


def call(url: str, tool: str, args: dict[str, Any], headers: dict[str, str] = MODERN,
         rid: Any = 1) -> httpx.Response:
    return httpx.post(url, headers=headers, timeout=30, json={
        "jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": tool, "arguments": args}})


def messages(response: httpx.Response) -> list[dict[str, Any]]:
    if response.headers["Content-Type"].startswith("application/json"):
        return [response.json()]
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def initialize(url: str) -> dict[str, str]:
    r = httpx.post(url, headers=LEGACY, timeout=30, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}})
    assert r.status_code == 200, r.text
    headers = {**LEGACY, "Mcp-Session-Id": r.headers["Mcp-Session-Id"], "MCP-Protocol-Version": "2025-11-25"}
    httpx.post(url, headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return headers


def records(pp: ProxyProcess, tool: str, since: int) -> list[dict[str, Any]]:
    return [r for r in pp.audit_records()[since:] if r["tool"] == tool]


@pytest.mark.parametrize(("tool", "args", "texts", "code"), [
    # The second reply to one id, and a reply to an id nobody asked for, are dropped.
    ("twice", {"text": SECRET}, ["first: [REDACTED:aws_access_key_id]"], "ok"),
    ("stranger", {"text": SECRET}, ["real: [REDACTED:aws_access_key_id]"], "ok"),
    # A result without an id reaches the stream of the one call in flight, inspected like it.
    ("idless", {"text": SECRET}, ["idless: [REDACTED:aws_access_key_id]", "real: [REDACTED:aws_access_key_id]"], "ok"),
    # A result naming `content` twice: the child's line is read once (orjson keeps the last) and
    # written on re-serialised, so the agent reads the one block the envelope inspected.
    ("dupkey", {"text": SECRET}, ["clean"], "ok"),
    # Invalid UTF-8 is a line that is not JSON: the child is broken and killed.
    ("badutf8", {}, ["Blocked by policy (upstream_error): upstream 'h' closed the stream without a result"],
     "upstream_error"),
    # An answer after the upstream's timeout reaches nobody.
    ("late", {"seconds": 4, "text": "too late"}, ["Blocked by policy (upstream_timeout): upstream 'h' did not "
                                                  "answer within 3s"], "upstream_timeout"),
])
def test_misbehaving_child_answers_are_inspected_refused_and_audited_once(
        world: World, tool: str, args: dict[str, Any], texts: list[str], code: str) -> None:
    before = len(world.proxy.audit_records())
    r = call(world.proxy.url("h"), tool, args)
    assert r.status_code == 200
    assert [m["result"]["content"][0]["text"] for m in messages(r)] == texts
    assert SECRET not in r.text
    [rec] = records(world.proxy, tool, before)
    assert rec["code"] == code
    after = call(world.proxy.url("h"), "echo", {"text": "after"})  # the upstream serves on
    assert messages(after)[-1]["result"]["content"][0]["text"] == "after"


def test_a_request_id_reused_in_flight_in_a_session_is_refused_and_never_reaches_the_child(
        world: World) -> None:
    """MCP forbids reusing an id within a session. The writer sent with the id of a call still
    in flight is refused and never written to the child; the first call keeps its own result
    (it used to be handed to the second, and the first to time out)."""
    pp, url = world.proxy, world.proxy.url("h")
    headers = initialize(url)
    before = len(pp.audit_records())
    first: list[httpx.Response] = []
    reader = threading.Thread(target=lambda: first.append(call(url, "late", {"seconds": 1, "text": "A"},
                                                               headers, rid=7)))
    reader.start()
    try:
        started = world.state / "started-A"
        for _ in range(200):  # the child runs the first call: its id is in flight
            if started.exists():
                break
            time.sleep(0.05)
        second = call(url, "write", {"text": "B"}, headers, rid=7)
    finally:
        reader.join()
    [reply] = messages(second)
    assert reply == {"jsonrpc": "2.0", "id": 7, "error": {
        "code": -32600, "message": "request id 7 is already in flight in this session"}}
    assert messages(first[0])[-1]["result"]["content"][0]["text"] == "late: A"
    assert world.writes() == []
    [rec] = records(pp, "late", before)
    assert (rec["code"], rec["extra"]["is_error"]) == ("ok", False)


def test_a_child_that_exits_at_start_up_answers_initialize_with_a_json_rpc_error(world: World) -> None:
    r = httpx.post(world.proxy.url("dead"), headers=LEGACY, timeout=30, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}})
    assert (r.status_code, "Mcp-Session-Id" in r.headers) == (502, False)
    assert r.json() == {"jsonrpc": "2.0", "id": 0, "error": {
        "code": -32603, "message": "stdio upstream 'dead': the process exited before it answered"}}
    # Reported down, and kept down by the relayed 502 (a relayed answer of 500 or more is a
    # failure, as on every other path: it used to count as traffic that reached the upstream).
    readyz = httpx.get(f"{world.proxy.admin}/readyz", timeout=5).json()
    assert readyz["upstreams"]["dead"]["state"] == "down", readyz
    # The stateless caller of the same upstream gets a refusal too, never a hang.
    r = call(world.proxy.url("dead"), "echo", {"text": "x"})
    assert r.status_code == 502 and "stdio upstream 'dead'" in r.text


@pytest.mark.parametrize("mode", ["legacy", "stateless"])
def test_a_server_request_on_the_aggregate_is_refused_to_the_upstream_not_left_unanswered(
        world: World, mode: str) -> None:
    """`/mcp` relays no server requests (its client gets JSON only): the upstream's request is
    answered with a JSON-RPC error at once, so its tool fails or goes on without, instead of
    waiting until the call times out."""
    url = f"{world.proxy.base}/mcp"
    headers = MODERN
    if mode == "legacy":
        r = httpx.post(url, headers=LEGACY, timeout=30, json={
            "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {"sampling": {}},
                "clientInfo": {"name": "raw", "version": "1"}}})
        headers = {**LEGACY, "Mcp-Session-Id": r.headers["Mcp-Session-Id"], "MCP-Protocol-Version": "2025-11-25"}
    [reply] = messages(call(url, "h.ask", {"text": "which?"}, headers))
    assert reply["result"]["content"][0]["text"] == "answered: " + json.dumps({
        "code": -32601, "message": "sampling/createMessage is not relayed by the aggregated endpoint "
                                   "/mcp (use /mcp/h to be asked)"})
