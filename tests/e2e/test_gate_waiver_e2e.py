"""Gate waiver through the wire (`dataflow.waive_gate: intent`): the real proxy process, the
official SDK client and `mail_server.py`.

`delete_message` is destructive and gated (`approval.required`, no wait, so a held call answers
`approval_pending` at once; `on_tainted: allow`, so in a tainted run only the gate stops it);
`waive_gate` waives its gate, and only its, when the run's intent
(the user's words, `X-Envelope-Intent`) asks for the deletion and names the message. `reply` is
gated too and not waived. What reached the upstream is read back from its `trash`. Each test
uses its own run (`X-Envelope-Run`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from e2e_helpers import mail_server, write_doc

from proxy.envelope.dataflow.endorse import _hash, entry_forms
from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, token

AGENT = token("agent")
LAST_META: dict[str, Any] = {}  # the `_meta` of the last answer `_call` read


def _policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"mail": {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"}},
        "tools": {
            "mail.fetch_page": {"effect": "read"},
            "mail.read_message": {"effect": "read"},
            "mail.trash": {"effect": "read", "output": "trusted"},
            "mail.list_folder": {"effect": "read", "output": "trusted"},
            "mail.delete_message": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}},
            "mail.reply": {"effect": "external", "approval": {"required": True, "wait": "0s"}},
        },
        "dataflow": {
            "mode": "enforce",
            # delete_message is left to its gate in tainted runs: what stops an injected
            # deletion there is the gate, and the waiver must not open it.
            "on_tainted": {"default": "approve", "mail.delete_message": "allow"},
            "declassify": {"mail.reply": ["body"]},
            "waive_gate": {"default": "never", "mail.delete_message": "intent"},
        },
    })


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("waiver")
    with mail_server() as url, proxy_process(tmp, {"mail": url}, policies=_policy(tmp / "policies")) as pp:
        yield pp


async def _call(pp: ProxyProcess, run: str, tool: str, args: dict[str, Any], *,
                intent: str | None = None) -> tuple[bool, dict[str, Any]]:
    """(is_error, envelope/decision meta) of one call of `run`."""
    headers = {"X-Envelope-Run": run}
    if intent is not None:
        headers["X-Envelope-Intent"] = quote(intent)
    async with mcp_client(pp.url("mail"), "auto", bearer=AGENT, headers=headers) as c:
        result = await c.call_tool(tool, args)
    LAST_META.clear()
    LAST_META.update(result.meta or {})
    return bool(result.is_error), dict((result.meta or {}).get("envelope/decision") or {})


async def _trash(pp: ProxyProcess) -> list[str]:
    async with mcp_client(pp.url("mail"), "auto", bearer=AGENT,
                          headers={"X-Envelope-Run": f"trash-{uuid.uuid4().hex}"}) as c:
        result = await c.call_tool("trash", {})
    text = " ".join(getattr(item, "text", "") for item in result.content)
    return list(json.loads(text)["deleted"])


def _records(pp: ProxyProcess, run: str, tool: str) -> list[dict[str, Any]]:
    return [r for r in pp.audit_records() if r["tool"] == tool and r["run"] == run]


def _pending(pp: ProxyProcess, run: str) -> list[dict[str, Any]]:
    approvals = pp.admin_get("/v1/approvals?state=pending").json()["approvals"]
    return [a for a in approvals if a["run"] == run]


async def test_the_users_own_request_needs_no_person_and_is_audited(proxy: ProxyProcess) -> None:
    before = metric_value(proxy.metrics(), "envelope_gates_waived_total", tool="delete_message")
    run = f"run-{uuid.uuid4().hex}"
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-301"},
                                    intent="Delete m-301, it's a duplicate of Mei's note.")
    assert not refused, decision
    assert "m-301" in await _trash(proxy)
    [rec] = _records(proxy, run, "delete_message")
    assert rec["code"] == "ok", rec
    assert rec["extra"]["gate_waived"] == {
        "by": "dataflow.waive_gate", "action": "delete", "endorsed": [{"arg": "/message_id", "by": "intent"}]}
    assert "approval_id" not in rec["extra"] and not _pending(proxy, run)
    assert metric_value(proxy.metrics(), "envelope_gates_waived_total", tool="delete_message") == before + 1


async def test_an_injected_deletion_of_another_message_still_asks_a_person(proxy: ProxyProcess) -> None:
    """The attack the gate exists for: the user asked to delete m-301, a page the agent read
    says to delete m-302 too (an id with no text to match)."""
    run = f"run-{uuid.uuid4().hex}"
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"},
                intent="Delete m-301, it's a duplicate.")
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-302"})
    assert refused and decision["code"] == "approval_pending", decision
    assert "m-302" not in await _trash(proxy)
    [rec] = _records(proxy, run, "delete_message")
    assert rec["extra"]["gate_waiver"] == {"waived": False, "action": "delete", "unnamed": ["/message_id"]}
    assert "gate_waived" not in rec["extra"]
    assert len(_pending(proxy, run)) == 1
    # The message the user named is still waived in the same (tainted) run.
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-301"})
    assert not refused, decision


@pytest.mark.parametrize("said", [
    "Archive m-301, do not delete it.",         # negated
    "Read m-301 and tell me what Mei wants.",   # the object, not the action
    "Delete the duplicate message.",            # the action, not the object
])
async def test_what_the_user_did_not_ask_for_goes_to_the_gate(proxy: ProxyProcess, said: str) -> None:
    run = f"run-{uuid.uuid4().hex}"
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-301"}, intent=said)
    assert refused and decision["code"] == "approval_pending", decision
    [rec] = _records(proxy, run, "delete_message")
    assert rec["extra"]["gate_waiver"]["waived"] is False, rec["extra"]
    assert len(_pending(proxy, run)) == 1


async def test_a_run_without_intent_and_a_tool_not_listed_keep_their_gate(proxy: ProxyProcess) -> None:
    run = f"run-{uuid.uuid4().hex}"
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-302"})
    assert refused and decision["code"] == "approval_pending", decision
    # `reply` is gated and its verb is in the intent, but waive_gate names only delete_message.
    run = f"run-{uuid.uuid4().hex}"
    refused, decision = await _call(proxy, run, "reply", {"message_id": "m-301", "body": "Thanks!"},
                                    intent="Reply to m-301 saying thanks.")
    assert refused and decision["code"] == "approval_pending", decision
    [rec] = _records(proxy, run, "reply")
    assert "gate_waived" not in rec["extra"] and "gate_waiver" not in rec["extra"]


async def test_a_waived_deletion_reaches_the_upstream_once(proxy: ProxyProcess) -> None:
    """Promise 3: the waived call keeps its idempotency claim; the agent's retry is answered
    from the first call's stored result, never forwarded again."""
    run = f"run-{uuid.uuid4().hex}"
    said = "Please delete message m-302."
    before = (await _trash(proxy)).count("m-302")
    replayed = []
    for _ in range(2):
        refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-302"}, intent=said)
        assert not refused, decision
        replayed.append(LAST_META.get("envelope/replayed"))
    assert (await _trash(proxy)).count("m-302") == before + 1
    assert replayed == [None, True]
    first, _ = _records(proxy, run, "delete_message")
    assert first["extra"]["gate_waived"]["action"] == "delete"


@pytest.mark.parametrize("said", [
    "Should I delete m-377? Summarise the page first.",                 # a question
    "Delete m-377 if the page says it is spam.",                        # a condition the page asserts
    "Mei deleted m-377 by mistake. Tell me what the page says.",        # what happened
    "Do NOT, under any circumstances, delete m-377. Read the page.",    # negated before the clause
    "Delete the replies to m-377 that the page lists.",                 # another thing m-377 relates to
    "Delete every message apart from m-377.",                           # set apart
    "Delete the reminder for room 377.",                                # a number of another kind
])
async def test_words_that_ask_for_nothing_do_not_open_the_gate_to_an_injection(proxy: ProxyProcess,
                                                                             said: str) -> None:
    """Adversarial pass (issue 13): the user's honest words write the verb and the object, but
    ask for nothing to be done to it now; the page the agent reads says to delete it. The
    gate holds the injected deletion (before the fix, each was waived and reached the
    upstream)."""
    run = f"run-{uuid.uuid4().hex}"
    target = "377" if "room" in said else "m-377"
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"}, intent=said)
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": target})
    assert refused and decision["code"] == "approval_pending", decision
    assert target not in await _trash(proxy)
    [rec] = _records(proxy, run, "delete_message")
    assert "gate_waived" not in rec["extra"] and rec["extra"]["gate_waiver"]["waived"] is False, rec["extra"]
    assert len(_pending(proxy, run)) == 1


async def test_words_that_pick_an_entry_in_each_of_two_listings_pick_none(proxy: ProxyProcess) -> None:
    """Adversarial pass (issue 13): "Delete the Acme newsletter" picks m-401 of the inbox, and
    the attacker's m-409 of promotions (its own listing, where it is the one Acme newsletter).
    The page says to delete m-409: the gate holds it (before the fix it was waived), and holds
    m-401 too (which one the user meant is a person's call); with the inbox alone, m-401 is
    the user's pick and waived."""
    said = "Delete the Acme newsletter."
    run = f"run-{uuid.uuid4().hex}"
    await _call(proxy, run, "list_folder", {"folder": "inbox"}, intent=said)
    await _call(proxy, run, "list_folder", {"folder": "promotions"})
    await _call(proxy, run, "fetch_page", {"url": "https://news.example/q3"})
    for target in ("m-409", "m-401"):
        refused, decision = await _call(proxy, run, "delete_message", {"message_id": target})
        assert refused and decision["code"] == "approval_pending", (target, decision)
        assert target not in await _trash(proxy)
    assert all("gate_waived" not in r["extra"] for r in _records(proxy, run, "delete_message"))
    run = f"run-{uuid.uuid4().hex}"
    await _call(proxy, run, "list_folder", {"folder": "inbox"}, intent=said)
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-401"})
    assert not refused, decision
    [rec] = _records(proxy, run, "delete_message")
    assert rec["extra"]["gate_waived"]["endorsed"][0]["by"] == "intent+trusted_listing", rec["extra"]


async def test_an_attacker_entry_ground_to_collide_is_still_held(proxy: ProxyProcess) -> None:
    """The attacker's m-557 (folder "offers") was ground offline so that the unkeyed 8-bit
    signature of its entry's values equals m-401's: the pick signature is keyed with the
    store's secret now, so "Delete the Acme newsletter" still picks one entry in each listing
    and the injected deletion of m-557 is held for a person."""
    inbox = "m-401 Acme newsletter, November"
    offers = "m-557 Acme newsletter special offer"
    assert _unkeyed(entry_forms(inbox)) == _unkeyed(entry_forms(offers))  # the ground collision
    said = "Delete the Acme newsletter."
    run = f"run-{uuid.uuid4().hex}"
    await _call(proxy, run, "list_folder", {"folder": "inbox"}, intent=said)
    await _call(proxy, run, "list_folder", {"folder": "offers"})
    refused, decision = await _call(proxy, run, "delete_message", {"message_id": "m-557"})
    assert refused and decision["code"] == "approval_pending", decision
    assert "m-557" not in await _trash(proxy)
    [rec] = _records(proxy, run, "delete_message")
    assert "gate_waived" not in rec["extra"] and rec["extra"]["gate_waiver"]["waived"] is False, rec["extra"]


def _unkeyed(values: Any) -> int:
    """The pick signature before it was keyed: 8 bits of an unkeyed hash anyone can compute."""
    return int.from_bytes(_hash("|".join(sorted(set(values))))[:2], "big") & 0xFF
