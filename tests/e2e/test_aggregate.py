"""The aggregated endpoint `/mcp`: two SDK servers (`a` answers with SSE, `b` with JSON) and a
down one (`c`) presented as one MCP server, to the official SDK client in both protocol
families. Listing and refusals must be exactly those of the per-upstream routes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import write_policy
from mcp import MCPError

from tests.harness import (
    ProxyProcess,
    free_port,
    mcp_client,
    proxy_process,
    rpc,
    token,
    upstream_server,
)

OPS = token("ops", tenant="acme")
READER = token("reader")
MODES = ["legacy", "auto"]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("aggregate")
    with upstream_server("sse") as a, upstream_server("json") as b:
        policies = write_policy(tmp / "policies", {"a": {}, "b": {}, "c": {"timeout": "2s"}})
        urls = {"a": a.url, "b": b.url, "c": f"http://127.0.0.1:{free_port()}/mcp"}
        config = {"aggregate": {"enabled": True, "upstreams": ["a", "b", "c"]}, "health_interval": 0}
        with proxy_process(tmp, urls, policies=policies, config=config) as pp:
            yield pp


@pytest.fixture
def agg(proxy: ProxyProcess) -> str:
    return f"{proxy.base}/mcp"


async def names(url: str, mode: str, bearer: str) -> set[str]:
    async with mcp_client(url, mode=mode, bearer=bearer) as c:
        return {t.name for t in (await c.list_tools()).tools}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("who", [OPS, READER], ids=["ops", "reader"])
async def test_list_merges_and_filters_like_the_per_upstream_routes(proxy: ProxyProcess, agg: str,
                                                                     mode: str, who: str) -> None:
    expected = set()
    for up in ("a", "b"):
        expected |= {f"{up}.{n}" for n in await names(proxy.url(up), mode, who)}
    got = await names(agg, mode, who)
    assert got == expected
    assert {"a.echo", "b.echo", "a.search_notes", "b.search_notes"} <= got
    assert not any(n.startswith("c.") for n in got)  # c is down: missing, the others listed
    if who == READER:
        assert "a.write_note" not in got  # read-only principals do not see writers


@pytest.mark.parametrize("mode", MODES)
async def test_calls_route_to_each_upstream(agg: str, mode: str) -> None:
    async with mcp_client(agg, mode=mode, bearer=OPS) as c:
        r = await c.call_tool("a.echo", {"text": "via a"})
        assert not r.is_error and r.content[0].text == "via a"
        r = await c.call_tool("b.search_notes", {"query": "welcome"})
        assert not r.is_error, r
        assert "Welcome to the envelope-proxy demo." in r.content[0].text
        r = await c.call_tool("b.write_note", {"title": "t", "body": "x", "folder": "drafts"})
        assert not r.is_error and r.structured_content["saved"] == "t"


@pytest.mark.parametrize("mode", MODES)
async def test_refusal_is_the_per_upstream_refusal_and_audited(proxy: ProxyProcess, agg: str, mode: str) -> None:
    args = {"title": "t", "body": "x", "folder": "secret-stuff"}
    async with mcp_client(proxy.url("b"), mode=mode, bearer=OPS) as c:
        direct = await c.call_tool("write_note", args)
    before = len(proxy.audit_records())
    async with mcp_client(agg, mode=mode, bearer=OPS) as c:
        r = await c.call_tool("b.write_note", args)
    assert r.is_error and direct.is_error
    assert r.content[0].text == direct.content[0].text
    assert r.content[0].text.startswith("Blocked by policy (capability_blocked): secret folders are off limits")
    meta, direct_meta = r.meta["envelope/decision"], direct.meta["envelope/decision"]
    assert {k: v for k, v in meta.items() if k != "decision_id"} == {
        k: v for k, v in direct_meta.items() if k != "decision_id"}
    [rec] = [x for x in proxy.audit_records()[before:] if x["decision_id"] == meta["decision_id"]]
    assert (rec["upstream"], rec["tool"], rec["verdict"], rec["code"], rec["rule"]) == (
        "b", "write_note", "deny", "capability_blocked", "no-secret-folder")

    before = len(proxy.audit_records())
    async with mcp_client(agg, mode=mode, bearer=READER) as c:
        r = await c.call_tool("a.write_note", {"title": "t", "body": "x"})
    assert r.is_error and r.content[0].text.startswith("Blocked by policy (capability_blocked)")
    [rec] = proxy.audit_records()[before:]
    assert (rec["upstream"], rec["tool"], rec["principal"]) == ("a", "write_note", "reader")


@pytest.mark.parametrize("mode", MODES)
async def test_unknown_tools(agg: str, mode: str) -> None:
    async with mcp_client(agg, mode=mode, bearer=OPS) as c:
        for name in ("zzz.echo", "echo", "a.no_such_tool"):
            with pytest.raises(MCPError) as err:
                await c.call_tool(name, {})
            assert err.value.error.code == -32602
            assert f"Unknown tool: {name}" in err.value.error.message


@pytest.mark.parametrize("mode", MODES)
async def test_down_upstream_is_a_tool_error_naming_it(proxy: ProxyProcess, agg: str, mode: str) -> None:
    before = len(proxy.audit_records())
    async with mcp_client(agg, mode=mode, bearer=OPS) as c:
        r = await c.call_tool("c.echo", {"text": "x"})
        assert r.is_error
        assert r.content[0].text.startswith("Blocked by policy (upstream_error): upstream 'c' failed")
        ok = await c.call_tool("a.echo", {"text": "still here"})
        assert ok.content[0].text == "still here"
    rec = proxy.audit_records()[before]
    assert (rec["upstream"], rec["tool"], rec["code"]) == ("c", "echo", "upstream_error")
    async with httpx.AsyncClient(timeout=5) as http:
        s = (await http.get(f"{proxy.admin}/readyz")).json()["upstreams"]
    assert s["c"]["state"] == "down" and s["a"]["state"] == "up"


def test_unsupported_methods_are_method_not_found(agg: str) -> None:
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}
    for method in ("resources/list", "prompts/list"):
        resp = rpc(agg, {"jsonrpc": "2.0", "id": 7, "method": method, "params": {"_meta": meta}},
                   bearer=OPS, headers={"Mcp-Method": method})
        assert resp.status_code == 404
        err = resp.json()["error"]
        assert err["code"] == -32601 and "/mcp/<upstream>" in err["message"]


def test_legacy_sessions(agg: str) -> None:
    hdrs = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
            "Authorization": f"Bearer {OPS}"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    resp = httpx.post(agg, json=init, headers=hdrs, timeout=10)
    assert resp.status_code == 200 and resp.json()["result"]["protocolVersion"] == "2025-06-18"
    sid = resp.headers["Mcp-Session-Id"]
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    assert httpx.post(agg, json=listing, headers=hdrs, timeout=10).status_code == 400  # no session
    bogus = httpx.post(agg, json=listing, headers={**hdrs, "Mcp-Session-Id": "nope"}, timeout=10)
    assert bogus.status_code == 404
    other = {**hdrs, "Mcp-Session-Id": sid, "Authorization": f"Bearer {READER}"}
    assert httpx.post(agg, json=listing, headers=other, timeout=10).status_code == 404  # not theirs
    mine = {**hdrs, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-06-18"}
    with httpx.stream("GET", agg, headers={**mine, "Accept": "text/event-stream"}, timeout=10) as stream:
        assert stream.status_code == 200
        assert stream.headers["Content-Type"].startswith("text/event-stream")
    assert httpx.delete(agg, headers=mine, timeout=10).status_code == 200
    assert httpx.post(agg, json=listing, headers=mine, timeout=10).status_code == 404


def test_no_aggregate_route_unless_enabled(tmp_path: Any, sse_upstream: Any) -> None:
    policies = write_policy(tmp_path / "policies", {"a": {}})
    with proxy_process(tmp_path, {"a": sse_upstream.url}, policies=policies) as pp:
        resp = rpc(f"{pp.base}/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, bearer=OPS)
        assert resp.status_code == 404


ANNOUNCER = '''
import sys
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("announcer")

@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def announce(ctx: Context) -> str:
    """Tell the session its tool list changed (legacy: on the GET stream)."""
    await ctx.session.send_tool_list_changed()
    return "announced"

server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]), json_response=True)
'''


def test_list_changed_fans_out_to_the_aggregated_get_stream(tmp_path: Any) -> None:
    import queue
    import subprocess
    import sys
    import threading

    from tests.harness import stop, wait_port

    script = tmp_path / "announcer.py"
    script.write_text(ANNOUNCER)
    port = free_port()
    server = subprocess.Popen([sys.executable, str(script), str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, server)
        policies = write_policy(tmp_path / "policies", {"x": {}}, tools={"notes.announce": {"effect": "read"}})
        config = {"aggregate": {"enabled": True}, "health_interval": 0}
        with proxy_process(tmp_path, {"x": f"http://127.0.0.1:{port}/mcp"}, policies=policies, config=config) as pp:
            agg = f"{pp.base}/mcp"
            hdrs = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                    "Authorization": f"Bearer {OPS}"}
            init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                    "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                               "clientInfo": {"name": "t", "version": "1"}}}
            sid = httpx.post(agg, json=init, headers=hdrs, timeout=10).headers["Mcp-Session-Id"]
            mine = {**hdrs, "Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-11-25"}
            lines: queue.Queue[str] = queue.Queue()

            def follow() -> None:
                with httpx.stream("GET", agg, headers={**mine, "Accept": "text/event-stream"},
                                  timeout=httpx.Timeout(10, read=None)) as stream:
                    for line in stream.iter_lines():
                        lines.put(line)

            threading.Thread(target=follow, daemon=True).start()
            call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "x.announce", "arguments": {}}}
            for _ in range(20):  # until the upstream GET stream is open behind ours
                reply = httpx.post(agg, json=call, headers=mine, timeout=10).json()
                assert reply["result"]["content"][0]["text"] == "announced", reply
                try:
                    line = lines.get(timeout=0.5)
                    while not line.startswith("data:"):
                        line = lines.get(timeout=0.5)
                except queue.Empty:
                    continue
                assert '"notifications/tools/list_changed"' in line, line
                break
            else:
                raise AssertionError("no list_changed on the aggregated GET stream")
            httpx.delete(agg, headers=mine, timeout=10)
    finally:
        stop(server)


def test_the_aggregated_route_refuses_id_less_calls_and_header_mismatches(agg: str) -> None:
    call = {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "a.echo", "arguments": {"text": "x"}}}
    resp = rpc(agg, call, bearer=OPS)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == -32600
    resp = rpc(agg, {**call, "id": 3}, bearer=OPS, headers={"Mcp-Method": "tools/list"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == -32020
