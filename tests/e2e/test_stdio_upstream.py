"""Stdio upstreams end to end: the real `envelope-proxy serve` launching MCP servers as child
processes (`command:`), reached by the official `mcp` SDK client at `/mcp/<upstream>` in both
protocol families (`legacy`: a 2025-11-25 session; `auto`: 2026-07-28 stateless).

Upstreams: `tests/e2e/stdio_server.py` (the cases a test must script: crash mid-call, a broken
line, elicitation, stderr), and the npm reference servers `server-everything` (stdio mode) and
`server-filesystem` (Node >= 22 from `tests/node`; skipped with the reason without it, failed
under ENVELOPE_REQUIRE_NODE=1).

The pool bound is answered at once: the session past `max_processes` gets HTTP 503 with a
JSON-RPC error naming the bound (the SDK raises it as an `MCPError`), never a wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from e2e_helpers import write_doc
from test_real_clients import MODULES, node22, require_package

from tests.harness import (
    ADMIN_TOKEN,
    ProxyProcess,
    mcp_client,
    metric_value,
    proxy_process,
    rpc,
    token,
    wait_port,
)

MODES = ("legacy", "auto")
SERVER = Path(__file__).resolve().parent / "stdio_server.py"
EVERYTHING = MODULES / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
FILESYSTEM = MODULES / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"
STATIC = {"mode": "static", "principal": "agent"}
READ_TOOLS = ("echo", "pid", "crash", "garbage", "ask", "slow", "shout", "progress")


def fixture_policy(directory: Path, state: Path, **upstream: Any) -> Path:
    tools: dict[str, Any] = {f"fix.{t}": {"effect": "read"} for t in READ_TOOLS}
    tools["fix.echo"]["rules"] = [{"forbid": 'args.text == "forbidden"', "reason": "not that"}]
    tools["fix.write_note"] = {
        "effect": "write", "approval": {"required": True, "wait": "1s"},
        "rules": [{"forbid": 'args.text.startsWith("secret")', "reason": "no secrets in notes"}]}
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"fix": {"command": [sys.executable, str(SERVER)], "timeout": "30s",
                              "env": {"STDIO_STATE": str(state)}, **upstream}},
        "defaults": {"unknown_tools": "deny", "log_args": True},
        "tools": tools,
    })


@dataclass
class World:
    proxy: ProxyProcess
    state: Path

    @property
    def url(self) -> str:
        return self.proxy.url("fix")

    def notes(self) -> list[str]:
        path = self.state / "notes"
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("stdio")
    state = tmp / "child"
    state.mkdir()
    policies = fixture_policy(tmp / "policies", state)
    with proxy_process(tmp, {}, policies=policies, identity=STATIC,
                       config={"aggregate": {"enabled": True}}) as pp:
        yield World(pp, state)


@contextlib.asynccontextmanager
async def callback_client(url: str, mode: str, **callbacks: Any) -> AsyncIterator[Any]:
    """An SDK client that answers server requests (`elicitation_callback`, ...)."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    http = create_mcp_http_client()
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode,
                            cache=None, **callbacks) as client:
        yield client


def text(result: Any) -> str:
    return str(result.content[0].text)


def records(pp: ProxyProcess, tool: str, since: int = 0) -> list[dict[str, Any]]:
    return [r for r in pp.audit_records()[since:] if r["tool"] == tool]


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        ppid = re.search(r"^PPid:\s+(\d+)", status, re.M)
        state = re.search(r"^State:\s+(\w)", status, re.M)
        if ppid and int(ppid.group(1)) == pid and not (state and state.group(1) == "Z"):
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = re.search(r"^State:\s+(\w)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return False
    return not (state and state.group(1) == "Z")


async def wait_until(predicate: Any, timeout: float, what: str) -> None:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def upstream_state(pp: ProxyProcess, name: str) -> str:
    body = httpx.get(f"{pp.admin}/readyz", timeout=5).json()
    return str(body["upstreams"][name]["state"])


# ---- the envelope in front of a stdio server ------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_tools_list_and_an_allowed_call(world: World, mode: str) -> None:
    before = len(world.proxy.audit_records())
    async with mcp_client(world.url, mode=mode) as c:
        listed = await c.list_tools()
        assert sorted(t.name for t in listed.tools) == sorted([*READ_TOOLS, "write_note"])
        r = await c.call_tool("echo", {"text": f"hello {mode} ü"})
        assert (r.is_error, text(r)) == (False, f"hello {mode} ü")
    [rec] = records(world.proxy, "echo", before)
    assert (rec["upstream"], rec["verdict"], rec["code"], rec["upstream_status"]) == (
        "fix", "allow", "ok", 200)


@pytest.mark.parametrize("mode", MODES)
async def test_the_aggregate_serves_a_stdio_upstream(world: World, mode: str) -> None:
    async with mcp_client(f"{world.proxy.base}/mcp", mode=mode) as c:
        listed = await c.list_tools()
        assert "fix.echo" in {t.name for t in listed.tools}
        r = await c.call_tool("fix.echo", {"text": f"aggregated {mode}"})
        assert (r.is_error, text(r)) == (False, f"aggregated {mode}")
        r = await c.call_tool("fix.echo", {"text": "forbidden"})
        assert (r.is_error, text(r)) == (True, "Blocked by policy (capability_blocked): not that")


@pytest.mark.parametrize("mode", MODES)
async def test_refused_call_never_reaches_the_child(world: World, mode: str) -> None:
    before = len(world.proxy.audit_records())
    async with mcp_client(world.url, mode=mode) as c:
        r = await c.call_tool("write_note", {"text": f"secret plan {mode}"})
        assert r.is_error is True
        assert text(r) == "Blocked by policy (capability_blocked): no secrets in notes"
        r = await c.call_tool("echo", {"text": "forbidden"})
        assert (r.is_error, text(r)) == (True, "Blocked by policy (capability_blocked): not that")
    assert not any("secret" in n for n in world.notes())
    recs = world.proxy.audit_records()[before:]
    assert [(r["tool"], r["code"], r["upstream_status"]) for r in recs] == [
        ("write_note", "capability_blocked", None), ("echo", "capability_blocked", None)]


@pytest.mark.parametrize("mode", MODES)
async def test_writer_is_held_for_approval_and_performed_once(world: World, mode: str) -> None:
    note = f"note {mode} {uuid.uuid4().hex[:8]}"
    async with mcp_client(world.url, mode=mode) as c:
        r = await c.call_tool("write_note", {"text": note})
        assert r.is_error is True and "(approval_pending)" in text(r), text(r)
        assert note not in world.notes()
        approval = re.search(r"approval (apr-[0-9a-f]+)", text(r))
        assert approval is not None
        async with httpx.AsyncClient(timeout=10) as http:
            decided = await http.post(
                f"{world.proxy.admin}/v1/approvals/{approval.group(1)}/approve",
                json={"reason": "fine"}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert decided.status_code == 200, decided.text
        r = await c.call_tool("write_note", {"text": note})
        assert (r.is_error, text(r)) == (False, f"noted: {note}")
    assert world.notes().count(note) == 1
    [performed] = [r for r in records(world.proxy, "write_note") if r["code"] == "ok"
                   and (r.get("args") or {}).get("text") == note]
    assert performed["extra"]["approver"] == "operator"


@pytest.mark.parametrize("mode", MODES)
async def test_elicitation_from_the_child_reaches_the_calling_client(world: World, mode: str) -> None:
    from mcp_types import ElicitResult

    asked: dict[str, list[str]] = {"a": [], "b": []}

    def answering(who: str) -> Any:
        async def on_elicitation(ctx: Any, params: Any) -> ElicitResult:
            asked[who].append(params.message)
            await asyncio.sleep(0.2)  # both questions are open at once
            return ElicitResult(action="accept", content={"answer": f"{who} says {mode}"})
        return on_elicitation

    async def one(who: str) -> str:
        async with callback_client(world.url, mode, elicitation_callback=answering(who)) as c:
            r = await c.call_tool("ask", {"question": f"question for {who}?"})
            assert r.is_error is False, r
            return text(r)

    got = await asyncio.gather(one("a"), one("b"))
    assert got == [f"answered: a says {mode}", f"answered: b says {mode}"]
    assert asked == {"a": ["question for a?"], "b": ["question for b?"]}


@pytest.mark.parametrize("mode", MODES)
async def test_progress_reaches_the_calling_client(world: World, mode: str) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    async with mcp_client(world.url, mode=mode) as c:
        r = await c.call_tool("progress", {"n": 3}, progress_callback=on_progress)
        assert (r.is_error, text(r)) == (False, "progressed 3")
    assert seen == [(1, 3, "step 1"), (2, 3, "step 2"), (3, 3, "step 3")]


@pytest.mark.parametrize("mode", MODES)
async def test_cancelling_a_call_cancels_it_in_the_child(world: World, mode: str) -> None:
    """Legacy: the SDK sends notifications/cancelled (relayed as is). 2026-07-28: it closes the
    response stream, and the proxy sends the child notifications/cancelled for its own id."""
    tag = f"cancel-{mode}-{uuid.uuid4().hex[:8]}"
    async with mcp_client(world.url, mode=mode) as c:
        with anyio.move_on_after(30):
            async with anyio.create_task_group() as tg:
                async def call() -> None:
                    await c.call_tool("slow", {"seconds": 60, "tag": tag})

                tg.start_soon(call)
                await wait_until(lambda: (world.state / f"started-{tag}").exists(), 20,
                                 "the slow tool started")
                tg.cancel_scope.cancel()
        await wait_until(lambda: (world.state / f"cancelled-{tag}").exists(), 10,
                         "the child cancelled the call")
        r = await c.call_tool("echo", {"text": "still here"})  # the session goes on
        assert text(r) == "still here"


# ---- crashes, broken children, stderr -------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_child_crash_mid_call_is_refused_audited_shown_and_restarted(world: World, mode: str) -> None:
    pp = world.proxy
    before = len(pp.audit_records())
    delay = world.state / "start_delay"
    async with mcp_client(world.url, mode=mode) as c:
        first = text(await c.call_tool("pid", {}))
        delay.write_text("3")  # the restarted child takes 3 s to serve: health is watched meanwhile
        try:
            r = await c.call_tool("crash", {"code": 3})
            assert r.is_error is True
            assert text(r) == "Blocked by policy (upstream_error): upstream 'fix' closed the stream without a result"
            assert upstream_state(pp, "fix") == "down"
            assert metric_value(pp.metrics(), "envelope_upstream_up", upstream="fix") == 0
        finally:
            delay.unlink()
        r = await c.call_tool("pid", {})
        assert r.is_error is False and text(r) != first  # a new child answered
    assert not alive(int(first))
    assert upstream_state(pp, "fix") == "up"
    assert metric_value(pp.metrics(), "envelope_upstream_up", upstream="fix") == 1
    [rec] = records(pp, "crash", before)
    assert (rec["verdict"], rec["code"], rec["check"]) == ("error", "upstream_error", "forward")
    assert "stdio upstream fix: " in pp.log() and "exited with code 3" in pp.log()


@pytest.mark.parametrize("mode", MODES)
async def test_a_line_that_is_not_json_breaks_the_child(world: World, mode: str) -> None:
    before = len(world.proxy.audit_records())
    async with mcp_client(world.url, mode=mode) as c:
        r = await c.call_tool("garbage", {})
        assert r.is_error is True and "(upstream_error)" in text(r), text(r)
        r = await c.call_tool("echo", {"text": "after"})
        assert (r.is_error, text(r)) == (False, "after")
    [rec] = records(world.proxy, "garbage", before)
    assert rec["code"] == "upstream_error"
    assert "wrote a line that is not JSON: stopping it" in world.proxy.log()


async def test_stderr_goes_to_the_proxy_log_tagged_with_the_upstream(world: World) -> None:
    marker = f"to-stderr-{uuid.uuid4().hex}"
    async with mcp_client(world.url, mode="legacy") as c:
        pid = text(await c.call_tool("pid", {}))
        r = await c.call_tool("shout", {"text": marker})
        assert text(r) == marker
    await wait_until(lambda: marker in world.proxy.log(), 5, "the stderr line in the log")
    assert f"stdio upstream fix [{pid}] stderr: {marker}" in world.proxy.log()


# ---- the pool: bound, idle reaping, shutdown ------------------------------------------------


# ---- several workers -------------------------------------------------------------------------

def _session_rpc(url: str, bearer: str, method: str, params: dict[str, Any], session: str | None = None,
                 notify: bool = False) -> httpx.Response:
    """One 2025-11-25 request on a new connection (with `workers: 2`, either worker may take it)."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "MCP-Protocol-Version": "2025-11-25", "Authorization": f"Bearer {bearer}"}
    if session:
        headers["Mcp-Session-Id"] = session
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if not notify:
        body["id"] = uuid.uuid4().hex
    return httpx.post(url, json=body, headers=headers, timeout=30)


def _answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON-RPC answer of a response, JSON or the last `data:` event of an SSE stream."""
    assert response.status_code == 200, (response.status_code, response.text)
    if response.headers["content-type"].startswith("application/json"):
        return dict(response.json())
    events = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    return dict(json.loads(events[-1]))


def _workers_policy(tmp_path: Path) -> tuple[Path, Path]:
    """The fixture child as upstream `fix` (its state directory: the notes it wrote), with a
    redaction guardrail on `echo`; (policy directory, state directory)."""
    state = tmp_path / "child"
    state.mkdir()
    policies = write_doc(tmp_path / "policies", {
        "version": 1,
        "upstreams": {"fix": {"command": [sys.executable, str(SERVER)], "timeout": "30s",
                              "env": {"STDIO_STATE": str(state)}}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"fix.pid": {"effect": "read"}, "fix.echo": {"effect": "read", "guardrails": [
            {"id": "aws-key", "pattern": "AKIA[0-9A-Z]{16}", "action": "redact"}]}, "fix.write_note": {"effect": "write"}},
    })
    return policies, state


def test_a_stdio_session_is_served_on_every_worker(tmp_path: Path) -> None:
    # A session's child is a process of the worker that started it; a request of the session on
    # a new connection lands on either worker. Before, the other worker answered 404 (the SDK
    # clients failed mid-session; only a start-up warning said so). Now the worker that does not
    # hold the session hands the request to the one that does, after its own envelope: every call
    # reaches the same child, once, with one audit record each; another principal gets 404.
    policies, state = _workers_policy(tmp_path)
    alice, mallory = token("alice"), token("mallory")
    with proxy_process(tmp_path, {}, policies=policies, config={"workers": 2}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)  # the second worker serves too
        url = pp.url("fix")
        opened = _session_rpc(url, alice, "initialize", {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
        session = opened.headers["Mcp-Session-Id"]
        assert _answer(opened)["result"]["serverInfo"]["name"] == "stdio-fixture"
        assert _session_rpc(url, alice, "notifications/initialized", {}, session, notify=True).status_code == 202
        pids = {_answer(_session_rpc(url, alice, "tools/call", {"name": "pid", "arguments": {}}, session))
                ["result"]["content"][0]["text"] for _ in range(16)}
        assert len(pids) == 1, pids  # one child: the session's, on whichever worker took the request
        # What comes back through the worker that handed the call on is inspected there.
        for i in range(6):
            echoed = _answer(_session_rpc(url, alice, "tools/call", {
                "name": "echo", "arguments": {"text": f"key {i} AKIAIOSFODNN7EXAMPLE"}}, session))
            assert "AKIAIOSFODNN7EXAMPLE" not in json.dumps(echoed), echoed
        # A writer: each call reaches the child once.
        for i in range(6):
            assert _answer(_session_rpc(url, alice, "tools/call", {
                "name": "write_note", "arguments": {"text": f"note {i}"}}, session))["result"]["isError"] is False
        assert sorted((state / "notes").read_text().splitlines()) == [f"note {i}" for i in range(6)]
        for _ in range(8):  # the session is alice's on every worker
            refused = _session_rpc(url, mallory, "tools/call", {"name": "pid", "arguments": {}}, session)
            assert refused.status_code == 404, refused.text
        # One audit record per call, in the log of the worker whose envelope took it (both used).
        logs = pp.worker_audit_records()
        assert all(any(r["tool"] == "pid" for r in log) for log in logs)
        records = [r for log in logs for r in log if r["tool"] in ("pid", "echo", "write_note")]
        assert [r["tool"] for r in records].count("pid") == 16
        assert [r["tool"] for r in records].count("echo") == 6
        assert [r["tool"] for r in records].count("write_note") == 6
        assert all(r.get("principal") == "alice" for r in records)
        # Ending the session on either worker ends it on both.
        ended = httpx.delete(url, headers={"Authorization": f"Bearer {alice}", "Mcp-Session-Id": session,
                                           "MCP-Protocol-Version": "2025-11-25"}, timeout=10)
        assert ended.status_code == 200, ended.text
        for _ in range(6):
            gone = _session_rpc(url, alice, "tools/call", {"name": "pid", "arguments": {}}, session)
            assert gone.status_code == 404, gone.text


def test_an_aggregate_session_reaches_one_child_on_every_worker(tmp_path: Path) -> None:
    # On `/mcp` the proxy is the client's MCP server and opens the upstream session itself. Before,
    # each worker that served a client session opened its own session with the stdio upstream, so
    # one client session's calls reached two children (two pids); now the session the first
    # worker opened is kept (sealed) in the store and the other worker uses it, its requests
    # handed to the worker holding the child. A DELETE on either worker ends the child's session.
    policies, state = _workers_policy(tmp_path)
    alice = token("alice")
    with proxy_process(tmp_path, {}, policies=policies,
                       config={"workers": 2, "aggregate": {"enabled": True}}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        url = f"{pp.base}/mcp"
        children = []
        for round_ in range(2):
            opened = _session_rpc(url, alice, "initialize", {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}})
            session = opened.headers["Mcp-Session-Id"]
            pids = {_answer(_session_rpc(url, alice, "tools/call", {"name": "fix.pid", "arguments": {}}, session))
                    ["result"]["content"][0]["text"] for _ in range(12)}
            assert len(pids) == 1, pids  # one child for the client session, whichever worker took each call
            for i in range(4):  # what the child answers, through either worker, is inspected
                echoed = _answer(_session_rpc(url, alice, "tools/call", {
                    "name": "fix.echo", "arguments": {"text": f"key {i} AKIAIOSFODNN7EXAMPLE"}}, session))
                assert echoed["result"]["isError"] is False and f"key {i}" in json.dumps(echoed), echoed
                assert "AKIAIOSFODNN7EXAMPLE" not in json.dumps(echoed), echoed
            for i in range(4):  # a writer reaches that child once per call
                assert _answer(_session_rpc(url, alice, "tools/call", {
                    "name": "fix.write_note", "arguments": {"text": f"note {round_}.{i}"}}, session))[
                        "result"]["isError"] is False
            children.append(pids.pop())
            ended = httpx.delete(url, headers={"Authorization": f"Bearer {alice}", "Mcp-Session-Id": session,
                                               "MCP-Protocol-Version": "2025-11-25"}, timeout=10)
            assert ended.status_code == 200, ended.text
        assert len(set(children)) == 2
        assert sorted((state / "notes").read_text().splitlines()) == [f"note {r}.{i}" for r in range(2) for i in range(4)]
        logs = pp.worker_audit_records()
        assert all(any(r["tool"] == "pid" for r in log) for log in logs)  # both workers served calls
        assert sum(r["tool"] == "pid" for log in logs for r in log) == 24
        assert sum(r["tool"] == "write_note" for log in logs for r in log) == 8
        assert sum(r["tool"] == "echo" for log in logs for r in log) == 8


async def test_an_sdk_session_with_questions_is_served_on_every_worker(tmp_path: Path) -> None:
    # The official SDK's legacy client, on a new connection per request (so either worker takes
    # each): its session's calls, the child's question (elicitation) on the call's stream, and
    # the client's answer POSTed on a connection of its own all reach the one child. Before, the
    # first request on the other worker failed the session (404).
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp_types import ElicitResult

    state = tmp_path / "child"
    state.mkdir()
    policies = fixture_policy(tmp_path / "policies", state)
    asked: list[str] = []

    async def on_elicitation(ctx: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        return ElicitResult(action="accept", content={"answer": f"answer {len(asked)}"})

    with proxy_process(tmp_path, {}, policies=policies, identity=STATIC, config={"workers": 2}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        for round_ in range(3):
            http = httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=0),
                                      timeout=httpx2.Timeout(30, read=300))
            async with http, Client(streamable_http_client(pp.url("fix"), http_client=http), mode="legacy",
                                    cache=None, elicitation_callback=on_elicitation) as c:
                pids = {text(await c.call_tool("pid", {})) for _ in range(6)}
                assert len(pids) == 1, pids
                answered = await c.call_tool("ask", {"question": f"round {round_}?"})
                assert answered.is_error is False, answered
                assert text(answered) == f"answered: answer {len(asked)}"
                assert text(await c.call_tool("echo", {"text": f"still round {round_}"})) == f"still round {round_}"
        assert asked == [f"round {r}?" for r in range(3)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("stdio-pool")
    state = tmp / "child"
    state.mkdir()
    # One principal may take the whole pool here: this fixture tests the pool's bound.
    policies = fixture_policy(tmp / "policies", state, max_processes=8,
                              max_processes_per_principal=8, idle_timeout="2s")
    with proxy_process(tmp, {}, policies=policies, identity=STATIC) as pp:
        yield World(pp, state)


async def test_fifty_concurrent_sessions_on_a_pool_of_eight(pool: World) -> None:
    """The 9th session at once is refused at once with a clear error; never more than 8
    children; every session either worked or was told why."""
    from mcp import MCPError

    proxy_pid = pool.proxy.proc.pid
    most = 0
    sampling = True

    async def sample() -> None:
        nonlocal most
        while sampling:
            most = max(most, len(children(proxy_pid)))
            await asyncio.sleep(0.05)

    async def session(i: int) -> str:
        try:
            async with mcp_client(pool.url, mode="legacy") as c:
                r = await c.call_tool("slow", {"seconds": 1.0})
                assert (r.is_error, text(r)) == (False, "slept 1.0")
                return "ok"
        except BaseException as exc:  # the SDK wraps it in exception groups
            found = _mcp_error(exc, MCPError)
            if found is None:
                raise
            assert found.error.code == -32000
            assert str(found.error.message) == ("stdio upstream 'fix' runs as many processes as it "
                                                "may (max_processes: 8); try again later")
            return "refused"

    sampler = asyncio.create_task(sample())
    try:
        async with asyncio.timeout(120):
            outcomes = await asyncio.gather(*(session(i) for i in range(50)))
    finally:
        sampling = False
        await sampler
    assert outcomes.count("ok") >= 8 and outcomes.count("refused") >= 1
    assert outcomes.count("ok") + outcomes.count("refused") == 50
    assert 1 <= most <= 8
    # Closed sessions give their processes back: a new session works at once.
    async with mcp_client(pool.url, mode="legacy") as c:
        assert text(await c.call_tool("echo", {"text": "again"})) == "again"
        assert metric_value(pool.proxy.metrics(), "envelope_stdio_processes", upstream="fix") == 1
    await wait_until(lambda: metric_value(pool.proxy.metrics(), "envelope_stdio_processes",
                                          upstream="fix") == 0, 10, "every process given back")


def _mcp_error(exc: BaseException, kind: type[Any]) -> Any:
    if isinstance(exc, kind):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _mcp_error(inner, kind)
        if found is not None:
            return found
    return None


async def test_an_idle_child_is_reaped(pool: World) -> None:
    async with mcp_client(pool.url, mode="legacy") as c:
        pid = int(text(await c.call_tool("pid", {})))
        assert alive(pid)
        await wait_until(lambda: not alive(pid), 10, "the idle child stopped (idle_timeout 2s)")
    assert "idle for 2s: stopping its child" in pool.proxy.log()


async def test_one_principal_cannot_take_another_principals_process(tmp_path: Path) -> None:
    """A pool of 2: one principal holds its share (half, by default) and its next session is
    refused naming the share; another principal's session still gets a child, on the
    per-upstream route and on the aggregate alike."""
    from mcp import MCPError

    share = ("holds as many processes of stdio upstream 'fix' as one principal may "
             "(max_processes_per_principal: 1); end a session or try again later")
    state = tmp_path / "child"
    state.mkdir()
    policies = fixture_policy(tmp_path / "policies", state, max_processes=2)
    with proxy_process(tmp_path, {}, policies=policies,
                       config={"aggregate": {"enabled": True}}) as pp:
        async with mcp_client(pp.url("fix"), mode="legacy", bearer=token("hog")) as held:
            await held.call_tool("pid", {})
            with pytest.raises(BaseException) as refused:  # the SDK wraps it in exception groups
                async with mcp_client(pp.url("fix"), mode="legacy", bearer=token("hog")) as c:
                    await c.call_tool("pid", {})
            found = _mcp_error(refused.value, MCPError)
            assert found is not None, refused.value
            assert str(found.error.message) == f"principal 'hog' {share}"
            async with mcp_client(pp.url("fix"), mode="legacy", bearer=token("other")) as c:
                assert alive(int(text(await c.call_tool("pid", {}))))
        await wait_until(lambda: metric_value(pp.metrics(), "envelope_stdio_processes",
                                              upstream="fix") == 0, 10, "both given back")
        # The aggregate opens its upstream session for the client session's principal.
        aggregate = f"{pp.base}/mcp"
        async with mcp_client(aggregate, mode="legacy", bearer=token("hog")) as held:
            assert alive(int(text(await held.call_tool("fix.pid", {}))))
            async with mcp_client(aggregate, mode="legacy", bearer=token("hog")) as c:
                r = await c.call_tool("fix.pid", {})
                assert r.is_error is True and share in text(r), text(r)
            async with mcp_client(aggregate, mode="legacy", bearer=token("other")) as c:
                assert alive(int(text(await c.call_tool("fix.pid", {}))))


async def test_the_one_principal_of_a_static_identity_has_the_whole_pool(tmp_path: Path) -> None:
    """Under `identity: {mode: static}` every caller is the one principal: a share of half the
    pool would only halve the sidecar's sessions. A pool of 2 serves two sessions at once."""
    state = tmp_path / "child"
    state.mkdir()
    policies = fixture_policy(tmp_path / "policies", state, max_processes=2)
    with proxy_process(tmp_path, {}, policies=policies, identity=STATIC) as pp:
        async with mcp_client(pp.url("fix"), mode="legacy") as first:
            async with mcp_client(pp.url("fix"), mode="legacy") as second:
                pids = {int(text(await c.call_tool("pid", {}))) for c in (first, second)}
                assert len(pids) == 2 and all(alive(pid) for pid in pids)


CRASH_AT_START = "import os, sys; open(sys.argv[1], 'a').write('started\\n'); sys.exit(3)"


async def test_a_server_failing_at_start_up_is_not_restarted_for_every_retry(tmp_path: Path) -> None:
    """A command that exits before it answers `initialize`: the first session gets 502; while
    the backoff runs (0.25 s doubling) new sessions are refused 503 with the reason and a
    Retry-After, without starting a process. 30 retries back to back start a handful of
    processes, not 30, and every refusal counts as an upstream error."""
    starts = tmp_path / "starts"
    policies = write_doc(tmp_path / "policies", {
        "version": 1,
        "upstreams": {"crashy": {"command": [sys.executable, "-c", CRASH_AT_START, str(starts)]}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"crashy.echo": {"effect": "read"}},
    })
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "retrier", "version": "1"}}}
    with proxy_process(tmp_path, {}, policies=policies, identity=STATIC) as pp:
        statuses = []
        refusal: httpx.Response | None = None
        for _ in range(30):
            r = await asyncio.to_thread(rpc, pp.url("crashy"), init,
                                        headers={"MCP-Protocol-Version": "2025-11-25"})
            statuses.append(r.status_code)
            if r.status_code == 503:
                refusal = r
        assert statuses[0] == 502, statuses
        assert set(statuses) == {502, 503}, statuses
        assert refusal is not None
        message = refusal.json()["error"]["message"]
        assert re.fullmatch(r"stdio upstream 'crashy' failed to start \d+ times in a row \(last: "
                            r"the process exited before it answered initialize\); the next start "
                            r"is in \d+\.\ds", message), message
        assert int(refusal.headers["Retry-After"]) >= 1
        started = starts.read_text().count("started")
        assert started == statuses.count(502) and started <= 10, (started, statuses)
        assert metric_value(pp.metrics(), "envelope_upstream_requests_total", upstream="crashy",
                            outcome="error") == 30
    assert "a session's child failed at start-up" in pp.log()


async def test_shutdown_leaves_no_child(tmp_path: Path) -> None:
    state = tmp_path / "child"
    state.mkdir()
    policies = fixture_policy(tmp_path / "policies", state)
    with proxy_process(tmp_path, {}, policies=policies, identity=STATIC) as pp:
        pids = []
        async with mcp_client(pp.url("fix"), mode="auto") as c:
            pids.append(int(text(await c.call_tool("pid", {}))))
        async with mcp_client(pp.url("fix"), mode="legacy") as c:
            pids.append(int(text(await c.call_tool("pid", {}))))
            assert all(alive(p) for p in pids)
            assert set(pids) <= set(children(pp.proc.pid))
            pp.proc.send_signal(signal.SIGTERM)
            assert pp.proc.wait(20) == 0
    assert not [p for p in pids if alive(p)]
    assert "shutdown complete" in pp.log()


async def test_reload_replaces_the_children_of_a_changed_command_only(tmp_path: Path) -> None:
    state = tmp_path / "child"
    state.mkdir()
    policies = fixture_policy(tmp_path / "policies", state)
    with proxy_process(tmp_path, {}, policies=policies, identity=STATIC) as pp:
        async with mcp_client(pp.url("fix"), mode="auto") as c:
            first = int(text(await c.call_tool("pid", {})))
            # A change elsewhere in the policy keeps the child.
            reloads = pp.log().count("loaded (change")
            fixture_policy(tmp_path / "policies", state, timeout="25s")
            await wait_until(lambda: pp.log().count("loaded (change") > reloads, 10, "a reload")
            assert int(text(await c.call_tool("pid", {}))) == first
            # A changed command (its environment) stops it; the next call starts the new one.
            reloads = pp.log().count("loaded (change")
            fixture_policy(tmp_path / "policies", state, timeout="25s", env={
                "STDIO_STATE": str(state), "EXTRA": "1"})
            await wait_until(lambda: pp.log().count("loaded (change") > reloads, 10, "a reload")
            await wait_until(lambda: not alive(first), 10, "the old child stopped")
            second = int(text(await c.call_tool("pid", {})))
            assert second != first and alive(second)
        shown = pp.admin_get("/v1/upstreams").json()
        assert shown["upstreams"]["fix"]["url"] == f"stdio:{sys.executable}"


# ---- the npm reference servers --------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, Path]]:
    node = node22()
    require_package(EVERYTHING, "@modelcontextprotocol/server-everything")
    require_package(FILESYSTEM, "@modelcontextprotocol/server-filesystem")
    tmp = tmp_path_factory.mktemp("stdio-reference")
    data = tmp / "data"
    data.mkdir()
    (data / "hello.txt").write_text("hello from a file\n")
    policies = write_doc(tmp / "policies", {
        "version": 1,
        "upstreams": {
            "everything": {"command": [node, str(EVERYTHING), "stdio"], "timeout": "30s"},
            "files": {"command": [node, str(FILESYSTEM), str(data)], "timeout": "30s"},
        },
        "defaults": {"unknown_tools": "deny"},
        "tools": {
            "everything.echo": {"effect": "read"},
            "everything.get-sum": {"effect": "read", "rules": [
                {"forbid": "args.a > 1000", "reason": "no big sums"}]},
            "files.read_text_file": {"effect": "read"},
            "files.list_directory": {"effect": "read"},
            "files.write_file": {"effect": "write", "approval": {"required": False}, "rules": [
                {"forbid": 'args.path.endsWith(".secret")', "reason": "no secret files"}]},
        },
    })
    with proxy_process(tmp, {}, policies=policies, identity=STATIC) as pp:
        yield pp, data


@pytest.mark.parametrize("mode", MODES)
async def test_server_everything_over_stdio(reference: tuple[ProxyProcess, Path], mode: str) -> None:
    pp, _ = reference
    async with mcp_client(pp.url("everything"), mode=mode) as c:
        listed = sorted(t.name for t in (await c.list_tools()).tools)
        assert listed == ["echo", "get-sum"]  # every tool without a policy is hidden
        r = await c.call_tool("echo", {"message": f"hi {mode}"})
        assert (r.is_error, text(r)) == (False, f"Echo: hi {mode}")
        r = await c.call_tool("get-sum", {"a": 2, "b": 3})
        assert r.is_error is False and "5" in text(r)
        r = await c.call_tool("get-sum", {"a": 2000, "b": 3})
        assert (r.is_error, text(r)) == (True, "Blocked by policy (capability_blocked): no big sums")
    if mode == "auto":
        # server-everything speaks only the handshake revisions: the 2026-07-28 client was
        # served statelessly by a child the proxy initialised, not by a session of its own.
        assert re.search(r"stdio upstream everything: shared child \d+ speaks 2025-11-25: "
                         r"initialised by the proxy for stateless callers", pp.log())


@pytest.mark.parametrize("mode", MODES)
async def test_server_filesystem_over_stdio(reference: tuple[ProxyProcess, Path], mode: str) -> None:
    pp, data = reference
    async with mcp_client(pp.url("files"), mode=mode) as c:
        r = await c.call_tool("read_text_file", {"path": str(data / "hello.txt")})
        assert (r.is_error, text(r)) == (False, "hello from a file\n")
        r = await c.call_tool("write_file", {"path": str(data / f"{mode}.secret"), "content": "x"})
        assert (r.is_error, text(r)) == (True, "Blocked by policy (capability_blocked): no secret files")
        r = await c.call_tool("write_file", {"path": str(data / f"{mode}.txt"), "content": mode})
        assert r.is_error is False, text(r)
    assert not (data / f"{mode}.secret").exists()
    assert (data / f"{mode}.txt").read_text() == mode
