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

from tests.harness import ADMIN_TOKEN, ProxyProcess, mcp_client, proxy_process, token

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
