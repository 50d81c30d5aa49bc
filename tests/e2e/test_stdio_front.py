"""`envelope-proxy stdio`: the real command as the server an MCP client launches.

The official Python SDK stdio client (`stdio_client` + `ClientSession`) starts
`envelope-proxy stdio` in front of the demo notes server (over HTTP with `--url`); the tests
assert what the client sees (tools, results, refusal texts, the in-band approval question),
the audit records in the state directory, that stdout carries nothing but JSON-RPC for a whole
session, and that the process exits 0 once stdin closes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc

from tests.harness import ADMIN_TOKEN, ROOT, Upstream, free_port, metric_value

pytestmark = pytest.mark.timeout(120)


def proxy_command() -> list[str]:
    exe = Path(sys.executable).with_name("envelope-proxy")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "proxy"]


def child_env() -> dict[str, str]:
    """What the SDK adds to its minimal inherited environment: this checkout's `proxy`."""
    return {"PYTHONPATH": str(ROOT)}


def notes_policy(directory: Path, upstream: str = "notes") -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {upstream: {"url": "http://127.0.0.1:1/mcp", "timeout": "20s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {
            f"{upstream}.search_notes": {"effect": "read"},
            f"{upstream}.write_note": {
                "effect": "write",
                "rules": [{"id": "no-secret", "forbid": 'has(args.folder) && args.folder == "secret"',
                           "reason": "secret folders are off limits"}],
                "fallback": "allow",
            },
            f"{upstream}.delete_note": {
                "effect": "destructive", "approval": {"required": True, "in_band": True, "wait": "1s"}},
        },
    })


def audit_records(state: Path) -> list[dict[str, Any]]:
    path = state / "audit" / "audit.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answering(action: str, content: dict[str, Any] | None, asked: list[Any]) -> Any:
    from mcp_types import ElicitResult

    async def on_elicitation(ctx: Any, params: Any) -> Any:
        asked.append(params)
        return ElicitResult(action=action, content=content)  # type: ignore[arg-type]

    return on_elicitation


@contextlib.asynccontextmanager
async def stdio_session(args: list[str], errlog: Any, **callbacks: Any) -> AsyncIterator[Any]:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    command, *first = proxy_command()
    params = StdioServerParameters(command=command, args=[*first, "stdio", *args], env=child_env())
    async with stdio_client(params, errlog=errlog) as (read, write), \
            ClientSession(read, write, **callbacks) as session:
        await session.initialize()
        yield session


@pytest.fixture
def errlog(tmp_path: Path) -> Iterator[Any]:
    """The proxy's stderr (its log) as the SDK client passes it on."""
    with open(tmp_path / "stderr.log", "w") as f:
        yield f


def text(result: Any) -> str:
    return str(result.content[0].text)


# ---- in front of an HTTP server (--url) ----------------------------------------------------


async def test_sdk_client_lists_calls_is_refused_and_approves_in_band(
        tmp_path: Path, sse_upstream: Upstream, errlog: Any) -> None:
    policies = notes_policy(tmp_path / "policies")
    state = tmp_path / "state"
    asked: list[Any] = []
    async with stdio_session(["--policies", str(policies), "--state-dir", str(state), "--name", "notes",
                              "--url", sse_upstream.url], errlog,
                             elicitation_callback=answering("accept", {"approve": True}, asked)) as s:
        tools = {t.name for t in (await s.list_tools()).tools}
        assert tools == {"search_notes", "write_note", "delete_note"}  # echo: not in the policy
        r = await s.call_tool("write_note", {"title": "stdio-a", "body": "x"})
        assert r.is_error is False and r.structured_content["saved"] == "stdio-a"
        r = await s.call_tool("write_note", {"title": "stdio-b", "body": "x", "folder": "secret"})
        assert r.is_error is True
        assert text(r) == "Blocked by policy (capability_blocked): secret folders are off limits"
        r = await s.call_tool("delete_note", {"title": "stdio-a"})
        assert r.is_error is False, r
        assert r.structured_content == {"deleted": "stdio-a", "existed": True}
    errlog.flush()
    assert len(asked) == 1 and "delete_note" in asked[0].message
    recs = audit_records(state)
    assert [(r["tool"], r["verdict"], r["code"]) for r in recs] == [
        ("write_note", "allow", "ok"), ("write_note", "deny", "capability_blocked"),
        ("delete_note", "allow", "ok")]
    assert {r["principal"] for r in recs} == {"local"}
    assert recs[2]["extra"]["in_band"] is True and recs[2]["extra"]["approver"] == "user:local"
    log = (tmp_path / "stderr.log").read_text()
    assert "stdio front for upstream 'notes' ready" in log


async def test_held_approval_without_elicitation_is_a_refusal(tmp_path: Path, sse_upstream: Upstream,
                                                             errlog: Any) -> None:
    policies = notes_policy(tmp_path / "policies")
    state = tmp_path / "state"
    async with stdio_session(["--policies", str(policies), "--state-dir", str(state), "--name", "notes",
                              "--url", sse_upstream.url, "--principal", "alice"], errlog) as s:
        r = await s.call_tool("delete_note", {"title": "stdio-held"})
    assert r.is_error is True
    assert text(r).startswith("Blocked by policy (approval_pending): approval apr-")
    # No admin listener and no elicitation: the refusal says how to get it approved.
    assert "answer the client's approval question" in text(r)
    assert "set `admin:` and `approvals.approvers` in the --config file" in text(r)
    approval_id = text(r).split("approval ", 1)[1].split(" ", 1)[0]
    assert f"`envelope-proxy approvals approve {approval_id}`" in text(r)
    [rec] = audit_records(state)
    assert (rec["principal"], rec["code"]) == ("alice", "approval_pending")


def listening_ports(pid: int) -> set[tuple[str, int]]:
    """The TCP (IPv4) addresses process `pid` listens on, from /proc (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
            ip_hex, port_hex = fields[1].split(":")
            ip = ".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
            found.add((ip, int(port_hex, 16)))
    return found


def _lines(proc: subprocess.Popen[bytes], want_id: int, seen: list[bytes], timeout: float = 30) -> dict[str, Any]:
    """Read stdout lines (kept in `seen`) until the response with `want_id`."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        message = json.loads(line)
        if message.get("id") == want_id and ("result" in message or "error" in message):
            return dict(message)
    raise AssertionError(f"no response {want_id}; stdout so far: {seen!r}")


def test_stdout_carries_only_protocol_and_stdin_eof_exits_cleanly(tmp_path: Path, sse_upstream: Upstream) -> None:
    policies = notes_policy(tmp_path / "policies")
    state = tmp_path / "state"
    errlog = open(tmp_path / "stderr.log", "wb")
    proc = subprocess.Popen(
        [*proxy_command(), "stdio", "--policies", str(policies), "--state-dir", str(state),
         "--name", "notes", "--url", sse_upstream.url, "--log-level", "debug"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdin is not None
    seen: list[bytes] = []

    def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        proc.stdin.flush()

    try:
        send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}})
        init = _lines(proc, 1, seen)
        assert init["result"]["serverInfo"]["name"]
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/list"})
        listed = _lines(proc, 2, seen)
        assert {t["name"] for t in listed["result"]["tools"]} == {"search_notes", "write_note", "delete_note"}
        send({"id": "three", "method": "tools/call",
              "params": {"name": "write_note", "arguments": {"title": "t", "body": "b", "folder": "secret"}}})
        refused = _lines(proc, "three", seen)
        assert refused["result"]["isError"] is True
        send({"id": 4, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "hi"}}})
        unknown = _lines(proc, 4, seen)
        assert unknown["error"]["code"] == -32602
        proc.stdin.write(b"this is not json\n")
        proc.stdin.flush()
        assert _lines(proc, None, seen)["error"]["code"] == -32700
        send({"id": 5, "method": "ping"})
        assert _lines(proc, 5, seen)["result"] == {}
        # The loopback listener serves the bridge alone: without its credential, 403.
        log = (tmp_path / "stderr.log").read_text()
        listener = re.search(r"the bridge's listener: (http://127\.0\.0\.1:\d+/mcp/notes)", log)
        assert listener is not None, log
        other = httpx.post(listener.group(1), json={"jsonrpc": "2.0", "id": 9, "method": "tools/list"},
                           headers={"Accept": "application/json, text/event-stream"}, timeout=5)
        assert other.status_code == 403
        # That listener is the only one: no admin listener unless the config file asks.
        port = int(listener.group(1).split(":")[2].split("/")[0])
        assert listening_ports(proc.pid) == {("127.0.0.1", port)}
        proc.stdin.close()
        started = time.monotonic()
        assert proc.wait(15) == 0
        assert time.monotonic() - started < 5  # within the SDK client's 2 s grace plus slack
        assert proc.stdout is not None
        seen.extend(proc.stdout.read().splitlines(keepends=True))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        errlog.close()
    assert seen and all(line.endswith(b"\n") for line in seen)
    for line in seen:
        message = json.loads(line)
        assert isinstance(message, dict) and message["jsonrpc"] == "2.0", line
    log = (tmp_path / "stderr.log").read_text()
    assert "session ended" in log and "shutdown complete" in log
    assert [r["code"] for r in audit_records(state)] == ["capability_blocked", "unknown_tool"]


def test_admin_listener_from_config_approves_out_of_band(tmp_path: Path, sse_upstream: Upstream) -> None:
    """With `admin:` in the config file, a held call is approved through the admin API while
    the client waits, and the decision is counted on the admin listener's /metrics."""
    import hashlib

    policies = notes_policy(tmp_path / "policies")
    doc = json.loads((policies / "policy.yaml").read_text())
    doc["tools"]["notes.delete_note"]["approval"] = {"required": True, "wait": "20s"}
    write_doc(policies, doc)
    admin_port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "admin": f"127.0.0.1:{admin_port}", "state_dir": str(tmp_path / "state"),
        "approvals": {"poll_interval": "100ms", "approvers": {
            "operator": {"token_sha256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()}}},
    }))
    errlog = open(tmp_path / "stderr.log", "wb")
    proc = subprocess.Popen(
        [*proxy_command(), "stdio", "--policies", str(policies), "--config", str(config),
         "--name", "notes", "--url", sse_upstream.url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdin is not None
    seen: list[bytes] = []

    def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        proc.stdin.flush()

    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        _lines(proc, 1, seen)
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/call", "params": {"name": "delete_note", "arguments": {"title": "oob"}}})
        pending: list[dict[str, Any]] = []
        deadline = time.monotonic() + 15
        while not pending and time.monotonic() < deadline:
            time.sleep(0.2)
            listed = httpx.get(f"http://127.0.0.1:{admin_port}/v1/approvals", headers=auth, timeout=5).json()
            pending = [a for a in listed["approvals"] if a["state"] == "pending"]
        assert pending, "no pending approval listed by the admin API"
        assert len(listening_ports(proc.pid)) == 2  # the bridge's listener and the admin listener
        assert ("127.0.0.1", admin_port) in listening_ports(proc.pid)
        assert pending[0]["principal"] == "local" and pending[0]["tool"] == "delete_note"
        r = httpx.post(f"http://127.0.0.1:{admin_port}/v1/approvals/{pending[0]['id']}/approve",
                       headers=auth, json={"reason": "ok"}, timeout=5)
        assert r.status_code == 200, r.text
        done = _lines(proc, 2, seen)
        assert done["result"].get("isError") is not True, done
        assert done["result"]["structuredContent"] == {"deleted": "oob", "existed": False}
        metrics = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=5).text
        assert metric_value(metrics, "envelope_decisions_total", upstream="notes", tool="delete_note",
                            verdict="allow", code="ok") == 1
        proc.stdin.close()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        errlog.close()


# ---- in front of a stdio server (-- command) -----------------------------------------------

STDIO_SERVER = ROOT / "tests" / "e2e" / "stdio_server.py"


def stdio_server_policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        # The runtime entry `-- command` makes wins; the policy only names the upstream.
        "upstreams": {"server": {"command": ["false"], "timeout": "20s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {
            "server.echo": {"effect": "read"},
            "server.pid": {"effect": "read"},
            "server.ask": {"effect": "read"},
            "server.progress": {"effect": "read"},
            "server.slow": {"effect": "read"},
            "server.write_note": {
                "effect": "destructive",
                "approval": {"required": True, "in_band": True, "wait": "1s"},
                "rules": [{"id": "no-secrets", "forbid": 'args.text.contains("secret")',
                           "reason": "no secrets in notes"}],
                "fallback": "allow",
            },
        },
    })


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


async def test_sdk_client_through_stdio_front_to_stdio_server(tmp_path: Path, errlog: Any) -> None:
    """`envelope-proxy stdio -- python stdio_server.py`: the default upstream name `server`; the
    server's own elicitation and the proxy's approval question both reach the client's callback;
    the server's environment comes from the client's launch; the child is gone afterwards."""
    from mcp_types import ElicitResult

    policies = stdio_server_policy(tmp_path / "policies")
    state = tmp_path / "state"
    notes = tmp_path / "notes-dir"
    notes.mkdir()
    asked: list[Any] = []

    async def on_elicitation(ctx: Any, params: Any) -> Any:
        asked.append(params.message)
        if "approve" in json.dumps(params.requested_schema):
            return ElicitResult(action="accept", content={"approve": True})
        return ElicitResult(action="accept", content={"answer": "forty-two"})

    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    command, *first = proxy_command()
    params = StdioServerParameters(
        command=command, cwd=tmp_path,
        args=[*first, "stdio", "--policies", str(policies), "--state-dir", str(state),
              "--", sys.executable, str(STDIO_SERVER)],
        env={**child_env(), "STDIO_STATE": str(notes)})
    async with stdio_client(params, errlog=errlog) as (read, write), \
            ClientSession(read, write, elicitation_callback=on_elicitation) as s:
        await s.initialize()
        tools = {t.name for t in (await s.list_tools()).tools}
        assert tools == {"echo", "pid", "ask", "write_note", "progress", "slow"}  # crash, garbage, shout: hidden
        r = await s.call_tool("echo", {"text": "hello ü"})
        assert r.is_error is False and text(r) == "hello ü"
        child = int(text(await s.call_tool("pid", {})))
        r = await s.call_tool("write_note", {"text": "my secret"})
        assert r.is_error is True
        assert text(r) == "Blocked by policy (capability_blocked): no secrets in notes"
        r = await s.call_tool("write_note", {"text": "approved note"})
        assert r.is_error is False, r
        assert text(r) == "noted: approved note"
        r = await s.call_tool("ask", {"question": "meaning?"})
        assert r.is_error is False and text(r) == "answered: forty-two"
        steps: list[tuple[float, float | None, str | None]] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            steps.append((progress, total, message))

        r = await s.call_tool("progress", {"n": 3}, progress_callback=on_progress)
        assert text(r) == "progressed 3"
        assert steps == [(1, 3, "step 1"), (2, 3, "step 2"), (3, 3, "step 3")]
    assert (notes / "notes").read_text() == "approved note\n"  # the refused note never arrived
    assert len(asked) == 2 and "write_note" in asked[0]
    assert _gone(child), f"the server child {child} outlived the proxy"
    recs = audit_records(state)
    assert [(r["upstream"], r["tool"], r["code"]) for r in recs] == [
        ("server", "echo", "ok"), ("server", "pid", "ok"), ("server", "write_note", "capability_blocked"),
        ("server", "write_note", "ok"), ("server", "ask", "ok"), ("server", "progress", "ok")]
    assert recs[3]["extra"]["approver"] == "user:local"


# ---- the TypeScript SDK client -------------------------------------------------------------


def test_typescript_sdk_client_through_stdio_front(tmp_path: Path, sse_upstream: Upstream) -> None:
    """The TypeScript SDK's `StdioClientTransport` launches `envelope-proxy stdio` in front of
    the HTTP notes server: tools, an allowed call, a refusal, an in-band approval."""
    from test_real_clients import NODE_DIR, TS_SDK, node22, require_package

    node = node22()
    require_package(TS_SDK, "@modelcontextprotocol/sdk")
    policies = notes_policy(tmp_path / "policies")
    state = tmp_path / "state"
    command, *first = proxy_command()
    server = {"command": command, "cwd": str(tmp_path), "env": child_env(),
              "args": [*first, "stdio", "--policies", str(policies), "--state-dir", str(state),
                       "--name", "notes", "--url", sse_upstream.url]}
    calls = [["write_note", {"title": "ts-a", "body": "x"}],
             ["write_note", {"title": "ts-b", "body": "x", "folder": "secret"}],
             ["delete_note", {"title": "ts-a"}]]
    done = subprocess.run([node, str(NODE_DIR / "stdio_client.mjs"), json.dumps(server), json.dumps(calls)],
                          cwd=NODE_DIR, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out["tools"]) == {"search_notes", "write_note", "delete_note"}
    assert out["calls"][0] == {"tool": "write_note", "isError": False, "text": out["calls"][0]["text"]}
    assert '"saved":"ts-a"' in out["calls"][0]["text"].replace(" ", "")
    assert out["calls"][1] == {"tool": "write_note", "isError": True,
                               "text": "Blocked by policy (capability_blocked): secret folders are off limits"}
    assert out["calls"][2]["isError"] is False and '"existed":true' in out["calls"][2]["text"].replace(" ", "")
    assert len(out["elicitations"]) == 1 and "delete_note" in out["elicitations"][0]
    assert "stdio front for upstream 'notes' ready" in out["stderr"]
    recs = audit_records(state)
    assert [(r["principal"], r["tool"], r["code"]) for r in recs] == [
        ("local", "write_note", "ok"), ("local", "write_note", "capability_blocked"),
        ("local", "delete_note", "ok")]


async def test_sdk_auto_client_speaks_2026_07_28_through_the_stdio_front(tmp_path: Path, errlog: Any) -> None:
    """The SDK's `Client(mode="auto")` over stdio negotiates 2026-07-28 (`server/discover`):
    the bridge relays it without a session, and the in-band approval is an `input_required`
    round the client answers with its elicitation callback; the server gets the call once."""
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp_types import ElicitResult

    policies = stdio_server_policy(tmp_path / "policies")
    state = tmp_path / "state"
    notes = tmp_path / "notes-dir"
    notes.mkdir()
    asked: list[str] = []

    async def on_elicitation(ctx: Any, params: Any) -> Any:
        asked.append(params.message)
        return ElicitResult(action="accept", content={"approve": True})

    command, *first = proxy_command()
    params = StdioServerParameters(
        command=command, cwd=tmp_path,
        args=[*first, "stdio", "--policies", str(policies), "--state-dir", str(state),
              "--", sys.executable, str(STDIO_SERVER)],
        env={**child_env(), "STDIO_STATE": str(notes)})
    async with Client(stdio_client(params, errlog=errlog), mode="auto", cache=None,
                      elicitation_callback=on_elicitation) as c:
        assert c.protocol_version == "2026-07-28"
        assert {t.name for t in (await c.list_tools()).tools} == {"echo", "pid", "ask", "write_note",
                                                                   "progress", "slow"}
        r = await c.call_tool("write_note", {"text": "stateless note"})
        assert r.is_error is False and text(r) == "noted: stateless note"
    assert len(asked) == 1 and "write_note" in asked[0]
    assert (notes / "notes").read_text() == "stateless note\n"
    recs = audit_records(state)
    assert [(r["code"], r["extra"].get("in_band")) for r in recs] == [
        ("approval_pending", "input_required"), ("ok", True)]


def test_stdio_server_stderr_goes_to_the_log_and_sigterm_stops_cleanly(tmp_path: Path) -> None:
    """In front of a stdio server: what the server writes to stderr lands in the proxy's stderr,
    never on stdout; SIGTERM (how clients stop a server that ignores stdin) ends the session,
    exits 0 and takes the child with it."""
    import signal

    policies = stdio_server_policy(tmp_path / "policies")
    doc = json.loads((policies / "policy.yaml").read_text())
    doc["tools"]["server.shout"] = {"effect": "read"}
    write_doc(policies, doc)
    errlog = open(tmp_path / "stderr.log", "wb")
    proc = subprocess.Popen(
        [*proxy_command(), "stdio", "--policies", str(policies), "--state-dir", str(tmp_path / "state"),
         "--", sys.executable, str(STDIO_SERVER)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdin is not None
    seen: list[bytes] = []

    def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        proc.stdin.flush()

    try:
        send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        assert _lines(proc, 1, seen)["result"]["protocolVersion"] == "2025-06-18"
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/call", "params": {"name": "shout", "arguments": {"text": "LOUD-7f3a"}}})
        assert _lines(proc, 2, seen)["result"]["content"][0]["text"] == "LOUD-7f3a"
        send({"id": 3, "method": "tools/call", "params": {"name": "pid", "arguments": {}}})
        child = int(_lines(proc, 3, seen)["result"]["content"][0]["text"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert proc.stdout is not None
        seen.extend(proc.stdout.read().splitlines(keepends=True))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        errlog.close()
    assert _gone(child), f"the server child {child} outlived the proxy"
    for line in seen:
        assert json.loads(line)["jsonrpc"] == "2.0", line
    assert sum(b"LOUD-7f3a" in line for line in seen) == 1  # only in the tool's result
    log = (tmp_path / "stderr.log").read_text()
    assert "LOUD-7f3a" in log and "shutdown complete" in log


def test_session_lost_upstream_is_renewed_like_a_client_would(tmp_path: Path) -> None:
    """The HTTP server restarts (its sessions gone: 404): the bridge initializes a new session
    with the client's own `initialize`, and the client's next request is answered on it."""
    from tests.harness import stop, wait_port

    port = free_port()

    def notes_server() -> subprocess.Popen[bytes]:
        server = subprocess.Popen([sys.executable, "-m", "proxy.examples.demo_server", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        wait_port(port, server)
        return server

    server = notes_server()
    policies = notes_policy(tmp_path / "policies")
    errlog = open(tmp_path / "stderr.log", "wb")
    proc = subprocess.Popen(
        [*proxy_command(), "stdio", "--policies", str(policies), "--state-dir", str(tmp_path / "state"),
         "--name", "notes", "--url", f"http://127.0.0.1:{port}/mcp"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    seen: list[bytes] = []

    def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        proc.stdin.flush()

    try:
        send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        _lines(proc, 1, seen)
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/call", "params": {"name": "write_note",
                                                           "arguments": {"title": "before", "body": "x"}}})
        before = _lines(proc, 2, seen)["result"]["structuredContent"]["count"]
        stop(server)
        server = notes_server()
        send({"id": 3, "method": "tools/call", "params": {"name": "write_note",
                                                           "arguments": {"title": "after", "body": "x"}}})
        after = _lines(proc, 3, seen)
        assert after["result"]["isError"] is False, after
        # The new server knows nothing of the note written before the restart.
        assert after["result"]["structuredContent"] == {"saved": "after", "folder": "inbox", "count": before}
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        errlog.close()
        stop(server)
    assert [json.loads(line)["id"] for line in seen] == [1, 2, 3]  # the renewal's answer stays inside
    assert "the session expired (HTTP 404): initializing a new one" in (tmp_path / "stderr.log").read_text()


def test_cancelled_call_reaches_the_server_and_gets_no_stand_in_answer(tmp_path: Path) -> None:
    """`notifications/cancelled` from the client cancels the call in the server; the bridge
    writes no error of its own for it (the client gave up on it) and the session goes on."""
    policies = stdio_server_policy(tmp_path / "policies")
    marks = tmp_path / "marks"
    marks.mkdir()
    errlog = open(tmp_path / "stderr.log", "wb")
    proc = subprocess.Popen(
        [*proxy_command(), "stdio", "--policies", str(policies), "--state-dir", str(tmp_path / "state"),
         "--", sys.executable, str(STDIO_SERVER)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "STDIO_STATE": str(marks)})
    seen: list[bytes] = []

    def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
        proc.stdin.flush()

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 15
        while not path.exists():
            assert time.monotonic() < deadline, f"{path.name} never appeared"
            time.sleep(0.05)

    try:
        send({"id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        _lines(proc, 1, seen)
        send({"method": "notifications/initialized"})
        send({"id": 7, "method": "tools/call", "params": {"name": "slow", "arguments": {"seconds": 30, "tag": "c1"}}})
        wait_for(marks / "started-c1")
        send({"method": "notifications/cancelled", "params": {"requestId": 7, "reason": "user left"}})
        wait_for(marks / "cancelled-c1")
        time.sleep(0.5)  # room for a stray answer to id 7 to arrive before the ping's
        send({"id": 8, "method": "ping"})
        assert _lines(proc, 8, seen)["result"] == {}
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(15) == 0
        assert proc.stdout is not None
        seen.extend(proc.stdout.read().splitlines(keepends=True))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        errlog.close()
    assert [json.loads(line)["id"] for line in seen] == [1, 8]
    recs = [r for r in audit_records(tmp_path / "state") if r["tool"] == "slow"]
    assert len(recs) == 1, recs  # the cancelled call is audited once


def test_a_state_dir_another_process_writes_is_exit_2_said_on_stderr(tmp_path: Path) -> None:
    # A client that launches two servers through `stdio` with one --state-dir: the second finds
    # the audit log held, says so on stderr (never on stdout, the protocol's) and exits 2.
    policies = notes_policy(tmp_path / "policies")
    audit = tmp_path / "state" / "audit"
    audit.mkdir(parents=True)
    with open(audit / "audit.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = subprocess.run(
            [*proxy_command(), "stdio", "--policies", str(policies), "--state-dir", str(tmp_path / "state"),
             "--name", "notes", "--url", "http://127.0.0.1:1/mcp"],
            input=b"", capture_output=True, timeout=60, env={**os.environ, **child_env()})
    assert done.returncode == 2, done.stderr
    assert done.stdout == b""
    assert b"Traceback" not in done.stderr, done.stderr
    assert b"another process is writing this audit log" in done.stderr, done.stderr
