"""An approver's `scope` under attack, through the real process and the admin API.

A scope pattern is `<upstream>.<tool>` (globs in either part). MCP tool names may hold `.`
(`admin.delete_all`), and the pattern used to be matched against the joined text
`<upstream>.<tool>` as one glob: the upstream part's `*` (or `?`) then swallowed the dot and
the start of the tool's name, so `*.delete_*` ("any upstream's delete_ tools", the README's
own example) let its approver decide `bank`'s `admin.delete_all`, a call outside the scope.
Each part of the pattern now matches its own part of the call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc
from hostile_upstream import HostileUpstream, hostile_server

from tests.harness import ProxyProcess, proxy_process, token

# Approver name -> scope; each one's token is "<name>-token".
SCOPES = {"carol": ["*.delete_*"], "erin": ["bank?admin.*"]}
GATED = {"effect": "destructive", "approval": {"required": True, "wait": "0s"}}
STATELESS = "2026-07-28"


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    tools = {"admin.delete_all": {"readOnlyHint": False, "destructiveHint": True},
             "delete_account": {"readOnlyHint": False, "destructiveHint": True}}
    with hostile_server(tools) as up:
        yield up


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, hostile: HostileUpstream) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("approver_scope")
    doc = {
        "version": 1,
        "upstreams": {"bank": {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"bank.admin.delete_all": GATED, "bank.delete_account": GATED},
    }
    config = {"approvals": {"poll_interval": "100ms", "approvers": {
        name: {"token_sha256": hashlib.sha256(f"{name}-token".encode()).hexdigest(), "scope": scope}
        for name, scope in SCOPES.items()}}}
    with proxy_process(tmp, {"bank": hostile.url}, policies=write_doc(tmp / "p", doc),
                       config=config) as pp:
        yield pp


def call(pp: ProxyProcess, tool: str, text: str) -> dict[str, Any]:
    """One stateless `tools/call` of principal ops; its JSON-RPC answer."""
    meta = {"io.modelcontextprotocol/protocolVersion": STATELESS,
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}
    response = httpx.post(pp.url("bank"), timeout=15, json={
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": tool, "arguments": {"text": text}, "_meta": meta}}, headers={
        "Authorization": f"Bearer {token('ops')}", "MCP-Protocol-Version": STATELESS,
        "Mcp-Method": "tools/call", "Mcp-Name": tool,
        "Accept": "application/json, text/event-stream", "Content-Type": "application/json"})
    answer: dict[str, Any] = response.json()
    return answer


def held(pp: ProxyProcess, tool: str, text: str) -> str:
    """Make the gated call, see it held; the id of its pending approval."""
    answer = call(pp, tool, text)
    assert answer["result"]["_meta"]["envelope/decision"]["code"] == "approval_pending", answer
    r = httpx.get(f"{pp.admin}/v1/approvals?state=pending", timeout=10,
                  headers={"Authorization": "Bearer carol-token"})
    assert r.status_code == 200, r.text
    [approval] = [a for a in r.json()["approvals"] if a["arguments"].get("text") == text]
    assert (approval["upstream"], approval["tool"]) == ("bank", tool)
    return str(approval["id"])


def decide(pp: ProxyProcess, approver: str, approval_id: str) -> httpx.Response:
    return httpx.post(f"{pp.admin}/v1/approvals/{approval_id}/approve", timeout=10,
                      json={"reason": "looks fine"},
                      headers={"Authorization": f"Bearer {approver}-token"})


@pytest.mark.parametrize("approver", sorted(SCOPES))
def test_a_scope_glob_never_reaches_a_tool_whose_name_holds_a_dot(
        proxy: ProxyProcess, hostile: HostileUpstream, approver: str) -> None:
    approval_id = held(proxy, "admin.delete_all", f"wipe-{approver}")
    r = decide(proxy, approver, approval_id)
    assert r.status_code == 403, r.text
    assert "may not decide calls of bank.admin.delete_all" in r.json()["error"]
    # Refused and audited as refused; the approval still waits and the call never ran.
    [record] = [rec for rec in proxy.audit_records() if rec.get("method") == "<approval>"
                and rec["extra"].get("approval_id") == approval_id]
    assert (record["verdict"], record["extra"]["approver"], record["extra"]["refused"]) == \
        ("deny", approver, True)
    state = httpx.get(f"{proxy.admin}/v1/approvals/{approval_id}", timeout=10,
                      headers={"Authorization": f"Bearer {approver}-token"}).json()["state"]
    assert state == "pending"
    answer = call(proxy, "admin.delete_all", f"wipe-{approver}")
    assert answer["result"]["_meta"]["envelope/decision"]["code"] == "approval_pending", answer
    assert not [c for c in hostile.control.calls("admin.delete_all")
                if (c["params"]["arguments"] or {}).get("text") == f"wipe-{approver}"]


def test_a_scope_still_covers_the_calls_it_names(proxy: ProxyProcess, hostile: HostileUpstream) -> None:
    approval_id = held(proxy, "delete_account", "close-1")
    r = decide(proxy, "carol", approval_id)  # `*.delete_*` names bank.delete_account
    assert r.status_code == 200 and r.json()["approver"] == "carol", r.text
    answer = call(proxy, "delete_account", "close-1")
    assert answer["result"]["content"] == [{"type": "text", "text": "close-1"}], answer
    assert [c for c in hostile.control.calls("delete_account")
            if (c["params"]["arguments"] or {}).get("text") == "close-1"]
