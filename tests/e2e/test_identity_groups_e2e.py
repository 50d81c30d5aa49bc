"""A JWT's groups claim through the real proxy: a rule forbidding a group holds whatever shape
the token gives its groups in. A token naming the group as one string (or objects) was read
as no groups, and the forbidden call was performed; it is now refused 401, unaudited as a call
(nothing was decided), and the upstream never sees it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from e2e_helpers import upstream_server, write_doc

from tests.harness import JWT_SECRET, ProxyProcess, mcp_client, metric_value, proxy_process, rpc

POLICY = {
    "version": 1,
    "upstreams": {"notes": {"url": "http://127.0.0.1:1/mcp"}},
    "defaults": {"unknown_tools": "deny"},
    "tools": {"notes.echo": {"effect": "read", "rules": [
        {"id": "no-contractors", "forbid": '"contractors" in principal.groups',
         "reason": "contractors may not call echo"},
        {"id": "anyone-else", "allow": "true"}]}},
}


def signed(groups: Any) -> str:
    return jwt.encode({"sub": "carl", "groups": groups, "exp": int(time.time()) + 3600},
                      JWT_SECRET, algorithm="HS256")


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("groups")
    with upstream_server("sse") as up, proxy_process(
            tmp, {"notes": up.url}, policies=write_doc(tmp / "policies", POLICY)) as pp:
        yield pp


async def _echo(proxy: ProxyProcess, groups: Any) -> Any:
    async with mcp_client(proxy.url("notes"), "auto", bearer=signed(groups)) as c:
        return await c.call_tool("echo", {"text": "hi"})


async def test_a_group_the_rule_forbids_is_refused_and_another_is_served(proxy: ProxyProcess) -> None:
    refused = await _echo(proxy, ["staff", "contractors"])
    assert refused.is_error and refused.meta["envelope/decision"]["rule"] == "no-contractors"
    served = await _echo(proxy, ["staff"])
    assert not served.is_error and served.content[0].text == "hi"


@pytest.mark.parametrize("groups", ["contractors", "staff contractors", [{"name": "contractors"}]],
                         ids=["one string", "space separated", "objects"])
def test_a_group_named_in_another_shape_does_not_escape_the_rule(
        proxy: ProxyProcess, groups: Any) -> None:
    before = [r for r in proxy.audit_records() if r.get("tool") == "echo"]
    rejected = metric_value(proxy.metrics(), "envelope_rejected_requests_total", reason="unauthenticated") or 0
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "echo", "arguments": {"text": "hi"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {},
                  "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
    resp = rpc(proxy.url("notes"), body, bearer=signed(groups),
               headers={"Mcp-Method": "tools/call", "Mcp-Name": "echo"})
    assert resp.status_code == 401, resp.text
    assert "groups claim 'groups' is not a list of strings" in resp.json()["error"]["message"]
    assert [r for r in proxy.audit_records() if r.get("tool") == "echo"] == before  # nothing performed
    assert metric_value(proxy.metrics(), "envelope_rejected_requests_total", reason="unauthenticated") == rejected + 1
