"""Authorization gaps found by the adversarial pass, through the real process:

- the Rule of Two on content reads: a principal whose profile denies sensitive data or untrusted
  input cannot reach that leg by reading a resource or getting a prompt instead of calling a
  tool (the read is refused `capability_blocked`, never forwarded, and its audit record says
  why); a read the profile allows is delivered;
- a request with two `Authorization` headers is refused 401 (read one way or refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc
from hostile_upstream import HostileUpstream, hostile_server

from tests.harness import proxy_process, token

VAULT = "vault entry: the launch code is 0000"
INBOX = "an email from a stranger"
HANDBOOK = "the team handbook"


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    with hostile_server() as up:
        yield up


@pytest.fixture()
def proxy(tmp_path: Path, hostile: HostileUpstream) -> Iterator[Any]:
    hostile.control.reset()
    hostile.control.texts(resources={"note://vault/1": VAULT, "note://inbox/1": INBOX,
                                     "note://handbook/1": HANDBOOK},
                          prompts={"summarise": INBOX, "house_style": HANDBOOK})
    doc = {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"h.write_note": {"effect": "write"}},
        "resources": {"h.note://vault/": {"sensitivity": "secret", "output": "trusted"},
                      "h.note://handbook/": {"output": "trusted"}},
        "prompts": {"h.house_style": {"output": "trusted"}},
        "principals": {"nosecret": {"rule_of_two": {"sensitive_data": False}},
                       "noinput": {"rule_of_two": {"untrusted_input": False}}},
    }
    with proxy_process(tmp_path, {"h": hostile.url}, policies=write_doc(tmp_path / "p", doc)) as pp:
        yield pp


def read(pp: Any, who: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """One stateless request of `who`; its JSON-RPC answer."""
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}
    response = httpx.post(pp.url("h"), timeout=15, json={
        "jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta}}, headers={
        "Authorization": f"Bearer {token(who)}", "MCP-Protocol-Version": "2026-07-28",
        "Accept": "application/json, text/event-stream", "Content-Type": "application/json"})
    answer: dict[str, Any] = response.json()
    return answer


def refused(pp: Any, answer: dict[str, Any], text: str, rule: str) -> None:
    assert text not in str(answer), answer
    [rec] = [r for r in pp.audit_records() if r.get("rule") == rule]
    assert (rec["verdict"], rec["code"], rec["check"]) == ("deny", "capability_blocked", "capability")


@pytest.mark.parametrize(("method", "params", "text"), [
    ("resources/read", {"uri": "note://vault/1"}, VAULT),
])
def test_no_sensitive_data_refuses_a_secret_read(proxy: Any, hostile: HostileUpstream, method: str,
                                                  params: dict[str, Any], text: str) -> None:
    refused(proxy, read(proxy, "nosecret", method, params), text,
            "principals.nosecret.rule_of_two.sensitive_data")
    assert HANDBOOK in str(read(proxy, "nosecret", "resources/read", {"uri": "note://handbook/1"}))


@pytest.mark.parametrize(("method", "params", "text"), [
    ("resources/read", {"uri": "note://inbox/1"}, INBOX),
    ("prompts/get", {"name": "summarise"}, INBOX),
])
def test_no_untrusted_input_refuses_an_untrusted_read(proxy: Any, method: str, params: dict[str, Any],
                                                      text: str) -> None:
    refused(proxy, read(proxy, "noinput", method, params), text,
            "principals.noinput.rule_of_two.untrusted_input")
    assert HANDBOOK in str(read(proxy, "noinput", "resources/read", {"uri": "note://handbook/1"}))
    assert HANDBOOK in str(read(proxy, "noinput", "prompts/get", {"name": "house_style"}))


def test_two_authorization_headers_are_refused(proxy: Any) -> None:
    """The proxy verified the first token and a `forward_authorization` upstream could act on the
    second: a request carrying two is refused 401 before anything is forwarded."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
    headers = [("Authorization", f"Bearer {token('noinput')}"),
               ("Authorization", f"Bearer {token('nosecret')}"),
               ("MCP-Protocol-Version", "2026-07-28"), ("Content-Type", "application/json"),
               ("Accept", "application/json, text/event-stream")]
    response = httpx.post(proxy.url("h"), timeout=15, json=body, headers=headers)
    assert response.status_code == 401, response.text
    one = httpx.post(proxy.url("h"), timeout=15, json=body, headers=headers[1:])
    assert one.status_code == 200, one.text


def test_a_capability_header_given_twice_narrows_when_either_says_read_only(proxy: Any) -> None:
    """`X-Envelope-Capability` can only narrow: given twice, `read-only` in either narrows (the
    proxy read only the first, so `read-write` before it kept the call read-write)."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "write_note", "arguments": {"title": "t", "text": "x"}, "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
    headers = [("Authorization", f"Bearer {token('alice')}"),
               ("X-Envelope-Capability", "read-write"), ("X-Envelope-Capability", "read-only"),
               ("MCP-Protocol-Version", "2026-07-28"), ("Content-Type", "application/json"),
               ("Accept", "application/json, text/event-stream")]
    answer = httpx.post(proxy.url("h"), timeout=15, json=body, headers=headers).json()
    decision = answer["result"]["_meta"]["envelope/decision"]
    assert (decision["code"], decision["rule"]) == ("capability_blocked", "request:X-Envelope-Capability")
    [rec] = [r for r in proxy.audit_records() if r.get("tool") == "write_note"]
    assert rec["code"] == "capability_blocked"
