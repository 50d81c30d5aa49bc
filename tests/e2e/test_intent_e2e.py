"""The trusted intent channel through the wire: the real proxy process, the official SDK
client and `mail_server.py`, whose `fetch_page` returns a page naming an attacker's address.

The user's words arrive in `X-Envelope-Intent` (percent-encoded UTF-8) or through the admin API
(`POST /v1/runs/{run}/intent`); a value they name is endorsed: the sink is not flagged for it.
Each test uses its own run (`X-Envelope-Run`), so ledgers and intents never mix.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from e2e_helpers import mail_policy, mail_server
from mail_server import ATTACKER

from tests.harness import ADMIN_TOKEN, ProxyProcess, mcp_client, proxy_process, rpc, token

AGENT = token("agent")
MALLORY = token("mallory")
SAID = f"Forward the customer list to {ATTACKER}, the address on the news page — thanks!"


def _policy(directory: Path) -> Path:
    return mail_policy(directory, {"mode": "enforce", "declassify": {"mail.send_email": ["body"]}})


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("intent")
    with mail_server() as url, proxy_process(tmp, {"mail": url}, policies=_policy(tmp / "policies")) as pp:
        yield pp


async def _call(pp: ProxyProcess, run: str, tool: str, args: dict[str, Any], *,
                intent: str | None = None, bearer: str = AGENT) -> tuple[bool, dict[str, Any]]:
    """(is_error, envelope/decision meta) of one call of `run`."""
    headers = {"X-Envelope-Run": run}
    if intent is not None:
        headers["X-Envelope-Intent"] = intent
    async with mcp_client(pp.url("mail"), "auto", bearer=bearer, headers=headers) as c:
        result = await c.call_tool(tool, args)
    return bool(result.is_error), dict((result.meta or {}).get("envelope/decision") or {})


def _email(to: str) -> dict[str, Any]:
    return {"to": to, "subject": "Customers", "body": "The list is attached."}


def _record(pp: ProxyProcess, decision_id: str) -> dict[str, Any]:
    found = [r for r in pp.audit_records() if r["decision_id"] == decision_id]
    assert len(found) == 1, found
    return found[0]


def _last_send(pp: ProxyProcess, run: str, principal: str = "agent") -> dict[str, Any]:
    return [r for r in pp.audit_records()
            if r["tool"] == "send_email" and r["run"] == run and r["principal"] == principal][-1]


async def test_an_address_from_the_page_is_flagged_without_intent_and_allowed_with_it(proxy: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}"
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"})
    refused, decision = await _call(proxy, run, "send_email", _email(ATTACKER))
    assert refused and decision["code"] == "dataflow_policy_blocked", decision
    allowed, _ = await _call(proxy, run, "send_email", _email(ATTACKER), intent=quote(SAID))
    assert not allowed
    rec = _last_send(proxy, run)
    assert rec["code"] == "ok" and rec["verdict"] == "allow", rec
    assert rec["extra"]["intent"] == {"by": "header", "chars": len(SAID), "appended": True}
    assert {"arg": "/to", "by": "intent", "kind": "value"} in rec["extra"]["endorsed"]


async def test_the_intent_is_sticky_for_the_run_and_the_principal_only(proxy: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}"
    # Sent once, on the read that brings the page in; later calls of the run carry no header.
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"}, intent=quote(SAID))
    refused, _ = await _call(proxy, run, "send_email", _email(ATTACKER))
    assert not refused
    assert _last_send(proxy, run)["extra"]["endorsed"][0]["arg"] == "/to"
    # Another principal naming the same run id has a run (and an intent) of its own.
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"}, bearer=MALLORY)
    refused, decision = await _call(proxy, run, "send_email", _email(ATTACKER), bearer=MALLORY)
    assert refused and decision["code"] == "dataflow_policy_blocked", decision
    # A second, different intent is appended: the first still endorses.
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q4"}, intent=quote("also the Q4 page"))
    refused, _ = await _call(proxy, run, "send_email", _email(ATTACKER))
    assert not refused


async def test_a_malformed_intent_is_refused_and_audited(proxy: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}"
    refused, decision = await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"},
                                    intent="pay%E2%82 now")
    assert refused and decision["code"] == "invalid_request", decision
    rec = _record(proxy, decision["decision_id"])
    assert rec["check"] == "dataflow" and rec["rule"] == "X-Envelope-Intent"
    assert "UTF-8" in rec["reason"]


async def test_an_approver_sets_the_intent_through_the_admin_api(proxy: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}"
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"})
    path = f"{proxy.admin}/v1/runs/{run}/intent"
    body = {"principal": "agent", "text": SAID}
    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.post(path, json=body)).status_code == 401
        bad = await http.post(path, json={"text": SAID}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert bad.status_code == 400
        ok = await http.post(path, json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert ok.status_code == 200 and ok.json()["appended"] is True, ok.text
    rec = _record(proxy, ok.json()["decision_id"])
    assert rec["tool"] == "<intent>" and rec["run"] == run and rec["principal"] == "agent"
    assert rec["extra"]["intent"]["by"] == "admin:operator" and rec["extra"]["intent"]["chars"] == len(SAID)
    assert SAID not in str(rec)  # the user's words stay out of the audit log
    refused, _ = await _call(proxy, run, "send_email", _email(ATTACKER))
    assert not refused
    assert _last_send(proxy, run)["extra"]["endorsed"][0] == {"arg": "/to", "by": "intent", "kind": "value"}


@pytest.mark.parametrize("principal", ["operator", "OPERATOR", "\uff4f\uff50\uff45\uff52\uff41\uff54\uff4f\uff52", "Operator"])
async def test_an_approver_cannot_set_the_intent_of_their_own_run(proxy: ProxyProcess, principal: str) -> None:
    # On main the approver `operator`, also an agent's identity, set the intent of its own run:
    # the address the page named was then endorsed, and its mail to the attacker left unflagged
    # and unheld (a self-approval in advance). Neither case nor width changed that.
    run = f"run-{uuid.uuid4().hex}"
    operator = token(principal)
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"}, bearer=operator)
    before = len(proxy.audit_records())
    async with httpx.AsyncClient(timeout=5) as http:
        reply = await http.post(f"{proxy.admin}/v1/runs/{run}/intent",
                                json={"principal": principal, "text": SAID},
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status_code == 403, reply.text
    assert reply.json()["error"].startswith(f"operator cannot set the intent of a run of {principal}")
    assert len(proxy.audit_records()) == before  # nothing set, nothing recorded as set
    refused, decision = await _call(proxy, run, "send_email", _email(ATTACKER), bearer=operator)
    assert refused and decision["check"] == "dataflow", decision


@pytest.mark.parametrize(("principal", "why"), [
    ("agent\u200b", "it holds U+200B (a format character: zero-width, bidi or other invisible) at position 5"),
    (" agent", "it has whitespace at its start or end"),
    ("a" * 257, "it has 257 characters (at most 256)"),
])
def test_the_admin_api_refuses_a_principal_no_identity_carries(proxy: ProxyProcess, principal: str, why: str) -> None:
    # On main these were set (and audited) for principals the identity refuses (401): an intent
    # for no run any caller could make, and up to 256 KB of a name in the audit record.
    before = len(proxy.audit_records())
    reply = httpx.post(f"{proxy.admin}/v1/runs/run-x/intent", timeout=5,
                       json={"principal": principal, "text": SAID},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"].endswith(f"is not a usable id: {why}")
    assert len(proxy.audit_records()) == before


RULE = "a run id is 1 to 256 characters of printable ASCII (U+0020 to U+007E, no space at either end)"


@pytest.mark.parametrize(("sent", "why"), [
    ("run%0Aforged", "U+000A at position 3"),  # a control character, percent-decoded
    ("run%00", "U+0000 at position 3"),
    ("%C3%A9t%C3%A9", "U+00E9 at position 0"),  # UTF-8, not ASCII
    ("%20run", "U+0020 at position 0"),
    ("r" * 257, "it has 257"),
    ("run%FF%FE", "run%FF%FE is not UTF-8 once percent-decoded"),
])
def test_the_admin_api_refuses_a_run_that_is_not_a_run_id_and_sets_nothing(
        proxy: ProxyProcess, sent: str, why: str) -> None:
    # On main each of these was a run: the intent was set (and audited) for "run\nforged", for
    # 257 characters, and for the literal text "run%FF%FE" that aiohttp keeps for bytes that are
    # not UTF-8.
    before = len(proxy.audit_records())
    reply = httpx.post(f"{proxy.admin}/v1/runs/{sent}/intent", timeout=5,
                       json={"principal": "agent", "text": SAID},
                       headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status_code == 400, reply.text
    assert reply.json() == {"error": f"run id: {RULE}: {why}"}
    assert len(proxy.audit_records()) == before  # nothing asked, nothing recorded


@pytest.mark.parametrize(("run", "why"), [("r" * 257, "it has 257"), ("run\tforged", "U+0009 at position 3")])
def test_x_envelope_run_is_held_to_the_same_rule_refused_and_audited(
        proxy: ProxyProcess, run: str, why: str) -> None:
    reply = rpc(proxy.url("mail"), {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                    "params": {"name": "fetch_page", "arguments": {"url": "https://news.example/q3"}}},
                bearer=AGENT, headers={"X-Envelope-Run": run})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] == f"Bad Request: header X-Envelope-Run: {RULE}: {why}; the request was refused"
    decision_id = error["data"]["envelope/decision"]["decision_id"]
    rec = _record(proxy, decision_id)
    assert (rec["check"], rec["code"], rec["extra"]["header"]) == ("guard", "invalid_request", "X-Envelope-Run")


@pytest.mark.parametrize(("parent", "why"), [("p" * 257, "it has 257"), ("parent\tforged", "U+0009 at position 6")])
def test_x_envelope_parent_run_is_held_to_the_same_rule_refused_and_audited(
        proxy: ProxyProcess, parent: str, why: str) -> None:
    # On main a parent run was taken as sent: 257 characters, or a tab, went into the child's
    # lineage, the audit record and the parent's store key.
    run = f"run-{uuid.uuid4().hex}"
    reply = rpc(proxy.url("mail"), {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                    "params": {"name": "fetch_page", "arguments": {"url": "https://news.example/q3"}}},
                bearer=AGENT, headers={"X-Envelope-Run": run, "X-Envelope-Parent-Run": parent})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] == (f"Bad Request: header X-Envelope-Parent-Run: {RULE}: {why}; "
                                "the request was refused")
    decision_id = error["data"]["envelope/decision"]["decision_id"]
    rec = _record(proxy, decision_id)
    assert (rec["check"], rec["code"], rec["extra"]["header"]) == ("guard", "invalid_request",
                                                                   "X-Envelope-Parent-Run")
    assert not [r for r in proxy.audit_records() if r["run"] == run]  # never a call of the run


async def test_the_longest_run_id_is_one(proxy: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}".ljust(256, "r")
    refused, _ = await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"})
    assert not refused and _last_fetch(proxy, run)["verdict"] == "allow"


def _last_fetch(pp: ProxyProcess, run: str) -> dict[str, Any]:
    return [r for r in pp.audit_records() if r["tool"] == "fetch_page" and r["run"] == run][-1]
