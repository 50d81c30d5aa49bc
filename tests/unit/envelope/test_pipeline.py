"""The chain and the envelope runtime: order, fail-closed on check errors, one audit record."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from proxy.audit.log import AuditLog
from proxy.envelope.pipeline import CHECKS, Envelope
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    Code,
    Decision,
    Principal,
    RequestInfo,
    RunContext,
    ToolCall,
    Verdict,
)
from proxy.observability.metrics import Metrics
from proxy.policy.loader import load_policy

POLICIES = Path(__file__).resolve().parents[2] / "fixtures" / "policies"


def _call(tool: str, args: dict, principal: str = "ops", groups: tuple[str, ...] = ()) -> ToolCall:
    return ToolCall(
        decision_id=f"d-{tool}",
        upstream="notes",
        tool=tool,
        arguments=args,
        principal=Principal(principal, groups, {"tenant": "acme"}),
        run=RunContext(id="run-1", principal=principal, session="s-1"),
        request=RequestInfo(method="tools/call"),
    )


@pytest.fixture
def envelope(tmp_path: Path) -> Envelope:
    env = Envelope(AuditLog(tmp_path / "audit"), Metrics(), ToolRegistry())
    env.install(load_policy(POLICIES))
    return env


def _records(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "audit" / "audit.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def test_chain_order_is_the_documented_table(envelope: Envelope) -> None:
    ids = [c.id for c in envelope.chain.checks]  # type: ignore[union-attr]
    # run_taint reads the ledger flags CEL may use, so it sits just before authz and arg_rules.
    assert ids == [
        "catalogue", "delegation", "capability", "schema", "run_taint", "authz", "arg_rules",
        "dataflow", "shadow", "rate_limit", "approval", "idempotency",
    ]
    assert len(CHECKS) == len(ids)


async def test_first_refusing_check_decides_and_is_audited_once(envelope: Envelope, tmp_path: Path) -> None:
    pending = await envelope.begin(_call("write_note", {"title": "t", "body": "b", "folder": "trash"}))
    d = pending.decision
    assert (d.verdict, d.code, d.check, d.rule) == (
        Verdict.DENY, Code.CAPABILITY_BLOCKED, "arg_rules", "notes.write_note#fallback"
    )
    outcome = await envelope.complete(pending)
    assert outcome.kind == "refuse" and outcome.decision is d
    assert await envelope.complete(pending) is outcome  # a call ends exactly once
    [rec] = _records(tmp_path)
    assert rec["decision_id"] == "d-write_note" and rec["code"] == "capability_blocked"
    assert rec["verdict"] == "deny" and rec["rule"] == "notes.write_note#fallback"
    assert "args" not in rec and rec["args_digest"].startswith("sha256:")
    metrics = envelope.metrics.render()[0].decode()
    assert (
        'envelope_decisions_total{code="capability_blocked",tool="write_note",upstream="notes",verdict="deny"} 1.0'
        in metrics
    )


class _Exploding:
    id: ClassVar[str] = "authz"

    def decide(self, call: ToolCall) -> Decision | None:
        raise RuntimeError("boom")


async def test_a_check_that_raises_refuses_with_internal_error(envelope: Envelope, tmp_path: Path) -> None:
    chain = envelope.chain
    assert chain is not None
    chain.checks = (*chain.checks[:3], _Exploding(), *chain.checks[4:])  # type: ignore[assignment]
    pending = await envelope.begin(_call("echo", {"text": "hi"}))
    assert pending.decision.refused
    assert pending.decision.verdict is Verdict.ERROR
    assert pending.decision.code is Code.INTERNAL_ERROR and pending.decision.check == "authz"
    await envelope.complete(pending)
    [rec] = _records(tmp_path)
    assert rec["code"] == "internal_error" and rec["verdict"] == "error"
    assert 'envelope_check_errors_total{check="authz"} 1.0' in envelope.metrics.render()[0].decode()


class _Releasing:
    """An approval check that releases every call with an approval still to spend."""

    id: ClassVar[str] = "approval"

    def decide(self, call: ToolCall) -> Decision | None:
        async def spend() -> Decision | None:
            return None

        call.spend_approval = spend
        return None


async def test_an_approval_left_unspent_refuses_the_call(envelope: Envelope) -> None:
    # Without the idempotency check nothing spends the approval: never forwarded so.
    chain = envelope.chain
    assert chain is not None
    chain.checks = (*chain.checks[:-2], _Releasing())  # type: ignore[assignment]
    pending = await envelope.begin(_call("echo", {"text": "hi"}))
    assert not pending.forwardable
    d = pending.decision
    assert (d.verdict, d.code, d.check) == (Verdict.ERROR, Code.INTERNAL_ERROR, "approval")


async def test_unwritable_audit_log_refuses_before_forwarding(tmp_path: Path) -> None:
    (tmp_path / "audit").mkdir()
    (tmp_path / "audit" / "audit.jsonl").symlink_to("/dev/full")
    env = Envelope(AuditLog(tmp_path / "audit"), Metrics(), ToolRegistry())
    env.install(load_policy(POLICIES))
    pending = await env.begin(_call("echo", {"text": "hi"}))
    assert pending.decision.code is Code.AUDIT_UNAVAILABLE and pending.decision.refused


async def test_allowed_call_then_reload_keeps_in_flight_chain(envelope: Envelope) -> None:
    pending = await envelope.begin(_call("echo", {"text": "hi"}))
    assert not pending.decision.refused
    old = pending.chain
    envelope.install(load_policy(POLICIES))
    assert envelope.chain is not old and pending.chain is old


def test_a_chain_built_ahead_is_installed_only_with_its_own_revision(envelope: Envelope) -> None:
    serving = envelope.chain
    revision = load_policy(POLICIES)
    chain = envelope.build(revision)
    assert envelope.chain is serving  # built, not installed
    with pytest.raises(ValueError):
        envelope.install(load_policy(POLICIES), chain)
    assert envelope.chain is serving
    assert envelope.install(revision, chain) is chain and envelope.chain is chain


async def test_a_call_whose_record_cannot_be_serialised_is_refused_never_forwarded(
        envelope: Envelope, tmp_path: Path) -> None:
    """A value the audit log cannot hold (a string decoded from an undecodable byte) refuses
    the call before anything is forwarded; its refusal is still recorded, the value escaped."""
    call = _call("echo", {"text": "hi"})
    call.run = RunContext("run-\udcff", "ops", session="sess-\udcff")
    pending = await envelope.begin(call)
    assert pending.decision.refused and not pending.forwardable
    assert pending.decision.check == "audit" and pending.decision.code is Code.INTERNAL_ERROR
    outcome = await envelope.complete(pending)
    assert outcome.kind == "refuse"
    [rec] = _records(tmp_path)
    assert rec["sanitized"] is True and rec["session"] == "sess-\\udcff" and rec["code"] == "internal_error"


async def test_a_completion_with_nothing_to_wait_for_ends_at_once(envelope: Envelope, tmp_path: Path) -> None:
    """Most completions write no store and run no hook: they end synchronously, in the
    caller, with no task (nothing can interrupt them)."""
    pending = await envelope.begin(_call("write_note", {"title": "t", "body": "b", "folder": "trash"}))
    outcome = await envelope.complete(pending)
    assert outcome.kind == "refuse" and pending.completion is None and not envelope.completing
    assert len(_records(tmp_path)) == 1


async def test_a_completion_that_waits_survives_the_callers_cancellation(tmp_path: Path) -> None:
    """The store is slow when the result is recorded and the caller is cancelled meanwhile (the
    client left, a timeout): the completion goes on in its own task and the record is written."""
    from proxy.envelope.types import Reply, Services
    from proxy.store.memory import MemoryStore

    class SlowStore(MemoryStore):
        async def hash_put(self, *args: Any, **kw: Any) -> Any:
            await asyncio.sleep(0.3)
            return await super().hash_put(*args, **kw)

        async def hash_append(self, *args: Any, **kw: Any) -> Any:  # a ledger entry's write
            await asyncio.sleep(0.3)
            return await super().hash_append(*args, **kw)

    metrics = Metrics()
    env = Envelope(AuditLog(tmp_path / "audit"), metrics, ToolRegistry(),
                   Services(store=SlowStore(), metrics=metrics))
    env.install(load_policy(POLICIES))
    pending = await env.begin(_call("echo", {"text": "hi"}))
    reply = {"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "a page " * 20}]}}
    caller = asyncio.create_task(env.complete(pending, Reply(reply)))
    await asyncio.sleep(0.05)
    assert pending.completion is not None and not pending.completion.done()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await env.drain(5)
    [rec] = _records(tmp_path)
    assert rec["code"] == "ok" and rec["extra"]["dataflow_recorded"]["untrusted"] is True
    assert pending.outcome is not None and pending.outcome.kind == "deliver"
