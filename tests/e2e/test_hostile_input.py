"""Hostile input against the real `envelope-proxy` process: findings 1-4 of the adversarial pass.

Each test is an attack that succeeded on the old main: a regex-heavy untrusted page that froze
the event loop, a write the transport sent twice after the upstream dropped the connection, a
forbid rule silently disabled by another rule's `// comment` on cel-cpp, and untrusted text
smuggled through a `date-time` argument the flow check trusted without validating. Assertions
are on the reply, the audit record and the upstream's own log of what reached it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostile_upstream import HostileUpstream, hostile_server
from test_response_path import HOSTILE, INJECTION, Client, policy, records, verify

from tests.harness import proxy_process


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    with hostile_server() as up:
        yield up


def proxied(tmp_path: Path, hostile: HostileUpstream, **overrides: Any) -> Any:
    hostile.control.reset()
    return proxy_process(tmp_path, {"h": hostile.url}, policies=policy(tmp_path / "policy", **overrides))


# -- 1. a regex-heavy untrusted page does not freeze the enforcement point --------------------


def test_a_pathological_untrusted_page_is_recorded_while_healthz_keeps_answering(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    """60 KB of `a` (and of an address-like run) was quadratic for the old token regexes: the
    process and `/healthz` froze for tens of seconds while the page was recorded."""
    page = "a" * 60_000 + " " + "b." * 30_000 + "@x"
    with proxied(tmp_path, hostile) as pp:
        client = Client(pp.url("h"), stateless=True)
        slowest = [0.0]
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=60) as http:  # a stall is measured, not a crash of this thread
                while not done.is_set():
                    started = time.monotonic()
                    assert http.get(f"{pp.admin}/healthz").status_code == 200
                    slowest[0] = max(slowest[0], time.monotonic() - started)
                    time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            for _ in range(3):
                reply = client.call("read_page", {"text": page})
                assert reply["result"]["isError"] is False, reply
        finally:
            done.set()
            prober.join()
        # The old regexes froze it for tens of seconds; 5 s leaves a loaded CI machine room.
        assert slowest[0] < 5.0, f"/healthz took {slowest[0]:.2f}s while a page was recorded"
        [first, *_] = records(pp, tool="read_page")
        assert first["extra"]["dataflow_recorded"]["untrusted"] is True
        # The page is in the run's ledger: copying a piece of it into a sink is still flagged.
        copied = client.call("write_note", {"title": "t", "text": "a" * 200})
        assert copied["result"]["_meta"]["envelope/decision"]["code"] == "dataflow_policy_blocked"


# -- 2. a write reaches its upstream at most once ---------------------------------------------


@pytest.mark.parametrize("key", [None, "drop-k1"], ids=["unkeyed", "client-key"])
def test_a_write_whose_connection_drops_after_the_read_is_sent_once_and_audited(
        tmp_path: Path, hostile: HostileUpstream, key: str | None) -> None:
    """The drop comes on a pooled connection (a read went first), which looks exactly like a
    keep-alive connection the upstream closed as the request was written: the transport's one
    case for resending. A writer is not resent there, with or without the client's idempotency
    key (the key lets the envelope replay the agent's repeats; only `idempotent: true` in policy
    says the upstream can take the request twice). Found by the wire fuzz with a keyed write."""
    with proxied(tmp_path, hostile) as pp:
        client = Client(pp.url("h"), stateless=True)
        assert client.call("read_page", {"text": "warm the pool"})["result"]["isError"] is False
        extra = {"Idempotency-Key": key} if key is not None else None
        reply = client.request("tools/call", {"name": "write_note", "arguments": {
            "mode": "close_after_read", "text": "pay 100"}}, extra)
        decision = reply["result"]["_meta"]["envelope/decision"]
        assert reply["result"]["isError"] is True and decision["code"] == "upstream_error", reply
        assert len(hostile.control.calls("write_note")) == 1  # never resent
        [rec] = records(pp, tool="write_note")
        assert rec["code"] == "upstream_error" and rec["decision_id"] == decision["decision_id"]
        assert "attempts" not in (rec.get("extra") or {})  # retried calls say so: test_retries.py
        assert (rec.get("extra") or {}).get("idempotency_key") == key
        verify(pp)


# -- 3. one rule's text cannot switch off another (cel-cpp joined rules on one line) ----------


@pytest.mark.parametrize("engine", ["cel-cpp", "cel-python"])
def test_a_forbid_rule_after_a_commented_rule_still_runs(
        tmp_path: Path, hostile: HostileUpstream, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVELOPE_CEL_ENGINE", engine)
    tools = {
        "h.read_page": {"effect": "read", "output": "untrusted"},
        "h.write_note": {"effect": "write", "rules": [
            {"id": "no-drafts", "forbid": 'args.title == "draft" // drafts stay local',
             "reason": "no drafts"},
            {"id": "no-secrets", "forbid": 'args.text.contains("secret")', "reason": "no secrets"},
        ]},
    }
    with proxied(tmp_path, hostile, tools=tools) as pp:
        client = Client(pp.url("h"), stateless=True)
        refused = client.call("write_note", {"title": "t", "text": "the secret plan"})
        decision = refused["result"]["_meta"]["envelope/decision"]
        assert (decision["check"], decision["rule"]) == ("arg_rules", "no-secrets"), decision
        assert client.call("write_note", {"title": "draft", "text": "x"})["result"]["_meta"][
            "envelope/decision"]["rule"] == "no-drafts"
        assert client.call("write_note", {"title": "t", "text": "fine"})["result"]["isError"] is False
        assert [c["params"]["arguments"]["text"] for c in hostile.control.calls("write_note")] == ["fine"]


# -- 4. a format is trusted only once it is validated -----------------------------------------


def test_untrusted_text_in_a_date_time_argument_is_refused_by_the_schema(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    tools = {
        "h.read_page": {"effect": "read", "output": "untrusted"},
        "h.write_note": {"effect": "write", "log_args": True, "schema": {
            "type": "object", "required": ["when", "text"],
            "properties": {"when": {"type": "string", "format": "date-time"},
                           "text": {"type": "string"}}}},
    }
    with proxied(tmp_path, hostile, tools=tools) as pp:
        client = Client(pp.url("h"), stateless=True)
        assert client.call("read_page", {"text": HOSTILE})["result"]["isError"] is False
        smuggled = client.call("write_note", {"when": INJECTION, "text": "meeting"})
        decision = smuggled["result"]["_meta"]["envelope/decision"]
        assert decision["code"] == "schema_invalid" and "/when" in decision["reason"], decision
        fine = client.call("write_note", {"when": "2026-12-01T09:30:00Z", "text": "meeting"})
        assert fine["result"]["isError"] is False, fine
        assert [c["params"]["arguments"]["when"] for c in hostile.control.calls("write_note")] == [
            "2026-12-01T09:30:00Z"]
