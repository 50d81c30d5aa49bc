"""The idempotency check with a MemoryStore: claim, replay, wait for a duplicate, fail closed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.approvals.notifier import ApprovalNotifier
from proxy.approvals.service import ApprovalService
from proxy.audit.log import AuditLog
from proxy.audit.record import args_digest
from proxy.config import ApprovalsConfig, Config, IdempotencyConfig
from proxy.envelope.checks.idempotency import (
    NS,
    UNKNOWN_NS,
    IdempotencyCheck,
    call_key,
    find_unknown,
    release,
)
from proxy.envelope.pipeline import Envelope, Pending
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import ALLOWED, Code, Decision, Reply, Services, ToolCall, Verdict
from proxy.errors import StoreError
from proxy.observability.metrics import Metrics
from proxy.policy.vocab import Effect
from proxy.store.memory import MemoryStore

DOC: dict[str, Any] = {
    "upstreams": UPSTREAMS,
    "tools": {
        "demo.echo": {"effect": "read"},
        "demo.write_note": {"effect": "write"},
        "demo.tally": {"effect": "write", "idempotent": True},
        "demo.delete_note": {"effect": "destructive"},
        "demo.archive": {"effect": "destructive", "approval": {"required": False}},
    },
}
RESULT = {"content": [{"type": "text", "text": "saved"}], "structuredContent": {"count": 7},
          "isError": False}
FORWARD_FAILED = Decision(Verdict.ERROR, Code.UPSTREAM_ERROR, "forward", "HTTP 503")


def _check(store: MemoryStore | None, wait: float = 1.0) -> tuple[IdempotencyCheck, Metrics]:
    metrics = Metrics()
    services = Services(store=store, metrics=metrics,
                        settings=Config(idempotency=IdempotencyConfig(ttl=60, wait=wait)))
    return IdempotencyCheck(build_revision(DOC), ToolRegistry(), services), metrics


def _call(tool: str = "tally", args: dict[str, Any] | None = None, *, key: str | None = None,
          principal: str = "agent", decision_id: str = "d-1", effect: Effect | None = None) -> ToolCall:
    call = make_call(tool, args if args is not None else {"n": 1}, principal=principal)
    call.decision_id = decision_id
    call.idempotency_key = key
    call.effect = effect or {"echo": Effect.READ, "delete_note": Effect.DESTRUCTIVE,
                             "archive": Effect.DESTRUCTIVE}.get(tool, Effect.WRITE)
    return call


async def _finish(call: ToolCall, decision: Decision = ALLOWED, reply: Any = None) -> None:
    for hook in call.on_result:
        await hook(call, decision, reply)


def _reply(result: dict[str, Any] = RESULT) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "result": result}


def _replays(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("envelope_idempotent_replays_total") or 0.0


def test_applies_to_gated_idempotent_and_keyed_calls() -> None:
    check, _ = _check(MemoryStore())
    assert check.applies(_call("tally"))  # idempotent: true
    assert check.applies(_call("delete_note"))  # destructive is gated by default
    assert check.applies(_call("write_note", key="k-1"))  # a client key
    assert not check.applies(_call("write_note"))
    assert not check.applies(_call("echo"))
    assert not check.applies(_call("archive"))  # approval.required: false ungates it


async def test_first_call_claims_then_a_repeat_replays_the_stored_result() -> None:
    store = MemoryStore()
    check, metrics = _check(store)
    first = _call(decision_id="d-first")
    assert await check.decide(first) is None
    assert first.audit_extra["idempotency_key"].startswith("derived:")
    assert len(first.on_result) == 1
    await _finish(first, ALLOWED, _reply())

    again = _call(decision_id="d-again")
    decision = await check.decide(again)
    assert decision is not None
    assert (decision.verdict, decision.code, decision.check) == (Verdict.ALLOW, Code.REPLAYED, "idempotency")
    assert decision.result == RESULT
    assert decision.audit == {"replayed": True, "idempotency_key": first.audit_extra["idempotency_key"],
                              "replayed_from": "d-first"}
    assert again.on_result == []
    assert _replays(metrics) == 1


async def test_other_arguments_or_another_run_is_another_call() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    first = _call()
    assert await check.decide(first) is None
    await _finish(first, ALLOWED, _reply())
    assert await check.decide(_call(args={"n": 2})) is None
    other_run = _call()
    other_run.run = dataclasses.replace(other_run.run, id="run-2")
    assert await check.decide(other_run) is None


async def test_client_key_reused_with_other_arguments_is_refused() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    first = _call("write_note", {"title": "a"}, key="k-1")
    assert await check.decide(first) is None
    assert first.audit_extra["idempotency_key"] == "k-1"
    await _finish(first, ALLOWED, _reply())
    decision = await check.decide(_call("write_note", {"title": "b"}, key="k-1", decision_id="d-2"))
    assert decision is not None and decision.code is Code.IDEMPOTENCY_CONFLICT
    assert decision.verdict is Verdict.DENY


async def test_client_keys_are_scoped_to_the_principal() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    mine = _call("write_note", key="k-1", principal="alice")
    assert await check.decide(mine) is None
    await _finish(mine, ALLOWED, _reply())
    # Mallory guessing Alice's key gets her own, fresh claim, never Alice's result.
    assert await check.decide(_call("write_note", key="k-1", principal="mallory")) is None
    digest = "sha256:x"
    assert call_key(_call(key="k", principal="a"), digest) != call_key(_call(key="k", principal="b"), digest)


@pytest.mark.parametrize("decision,reply", [
    (FORWARD_FAILED, None),
    (ALLOWED, {"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "boom"}}),
])
async def test_a_failed_first_call_frees_the_key_for_a_retry(decision: Decision, reply: Any) -> None:
    store = MemoryStore()
    check, _ = _check(store)
    first = _call()
    assert await check.decide(first) is None
    await _finish(first, decision, reply)
    assert await store.items(NS) == []
    assert await check.decide(_call(decision_id="d-retry")) is None  # performs it


async def test_a_resumable_disconnect_keeps_the_claim() -> None:
    store = MemoryStore()
    check, _ = _check(store, wait=0.05)
    first = _call()
    assert await check.decide(first) is None
    await _finish(first, ALLOWED, None)  # allowed, no reply: the upstream goes on
    decision = await check.decide(_call(decision_id="d-2"))
    assert decision is not None and decision.code is Code.IDEMPOTENCY_IN_FLIGHT


JSONRPC_ERROR = {"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "boom"}}


@pytest.mark.parametrize("code,status,reply", [
    (Code.UPSTREAM_TIMEOUT, None, None),
    (Code.CLIENT_DISCONNECTED, None, None),
    (Code.SHUTDOWN, None, None),
    (Code.UPSTREAM_ERROR, None, None),  # the connection reset or closed after the request
    (Code.UPSTREAM_ERROR, 500, None),  # HTTP 500, no JSON-RPC reply
    (Code.OK, 502, JSONRPC_ERROR),  # a JSON-RPC error, but in a 5xx answer
    (Code.UPSTREAM_ERROR, 200, None),  # an answer that is no reply
])
async def test_a_sent_call_with_an_unknown_outcome_is_never_sent_again(
        code: Code, status: int | None, reply: Any) -> None:
    # The upstream may have performed it: a retry is refused at once (no wait), naming the call.
    store = MemoryStore()
    check, _ = _check(store, wait=30)
    first = _call("write_note", key="k-1", decision_id="d-first")
    assert await check.decide(first) is None
    first.maybe_sent, first.upstream_status = True, status
    verdict = Verdict.ALLOW if code is Code.OK else Verdict.ERROR
    await _finish(first, Decision(verdict, code, "forward", "no answer"), reply)
    decision = await asyncio.wait_for(check.decide(_call("write_note", key="k-1", decision_id="d-2")), 5)
    assert decision is not None and decision.code is Code.IDEMPOTENCY_IN_FLIGHT
    assert "d-first" in decision.reason and "outcome is unknown" in decision.reason
    assert decision.audit == {"idempotency_key": "k-1", "outcome_unknown_from": "d-first"}
    [(_, raw)] = await store.items(NS)
    assert orjson.loads(raw)["state"] == "unknown"


@pytest.mark.parametrize("sent,status,reply", [
    (False, None, None),  # never written upstream (no connection, cut off before forwarding)
    (True, 409, None),  # the upstream refused it
    (True, 200, JSONRPC_ERROR),  # the server answered that it failed
])
async def test_a_call_certainly_not_performed_frees_the_key(sent: bool, status: int | None,
                                                            reply: Any) -> None:
    store = MemoryStore()
    check, _ = _check(store)
    first = _call("write_note", key="k-1")
    assert await check.decide(first) is None
    first.maybe_sent, first.upstream_status = sent, status
    await _finish(first, FORWARD_FAILED if reply is None else ALLOWED, reply)
    assert await store.items(NS) == []
    assert await check.decide(_call("write_note", key="k-1", decision_id="d-retry")) is None


async def test_an_idempotent_tool_with_an_unknown_outcome_frees_the_key() -> None:
    # The policy says it is safe to perform twice.
    store = MemoryStore()
    check, _ = _check(store)
    first = _call("tally")
    assert await check.decide(first) is None
    first.maybe_sent = True
    await _finish(first, Decision(Verdict.ERROR, Code.UPSTREAM_TIMEOUT, "forward", "late"), None)
    assert await check.decide(_call("tally", decision_id="d-retry")) is None


async def test_a_concurrent_duplicate_waits_for_the_first_result() -> None:
    store = MemoryStore()
    check, _ = _check(store, wait=5)
    first = _call(decision_id="d-first")
    assert await check.decide(first) is None
    waiting = asyncio.create_task(check.decide(_call(decision_id="d-dup")))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await _finish(first, ALLOWED, _reply())
    decision = await asyncio.wait_for(waiting, 2)
    assert decision is not None and decision.code is Code.REPLAYED and decision.result == RESULT


async def test_a_duplicate_takes_over_when_the_first_fails() -> None:
    store = MemoryStore()
    check, _ = _check(store, wait=5)
    first = _call(decision_id="d-first")
    assert await check.decide(first) is None
    dup = _call(decision_id="d-dup")
    waiting = asyncio.create_task(check.decide(dup))
    await asyncio.sleep(0.05)
    await _finish(first, FORWARD_FAILED, None)
    assert await asyncio.wait_for(waiting, 2) is None  # it claimed the key and performs the call
    assert orjson.loads((await store.items(NS))[0][1])["decision_id"] == "d-dup"


async def test_a_duplicate_refuses_when_the_wait_runs_out() -> None:
    check, _ = _check(MemoryStore(), wait=0.1)
    assert await check.decide(_call(decision_id="d-first")) is None
    decision = await check.decide(_call(decision_id="d-dup"))
    assert decision is not None
    assert (decision.verdict, decision.code) == (Verdict.ERROR, Code.IDEMPOTENCY_IN_FLIGHT)
    assert "still being performed" in decision.reason


async def test_store_failure_refuses_store_unavailable() -> None:
    store = MemoryStore()
    store.fail = StoreError("database is locked")
    check, _ = _check(store)
    call = _call()
    decision = await check.decide(call)
    assert decision is not None
    assert (decision.verdict, decision.code, decision.check) == (
        Verdict.ERROR, Code.STORE_UNAVAILABLE, "idempotency")
    assert "database is locked" in decision.reason
    assert call.on_result == []


async def test_unreadable_record_refuses_store_unavailable() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    call = _call()
    await store.put(NS, call_key(call, args_digest(call.arguments)).store, b"not json")
    decision = await check.decide(call)
    assert decision is not None and decision.code is Code.STORE_UNAVAILABLE


async def test_no_store_refuses_misconfigured() -> None:
    check, _ = _check(None)
    decision = await check.decide(_call())
    assert decision is not None
    assert (decision.verdict, decision.code) == (Verdict.ERROR, Code.MISCONFIGURED)


async def test_recording_failure_surfaces_from_the_hook() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    call = _call()
    assert await check.decide(call) is None
    store.fail = StoreError("gone")
    with pytest.raises(StoreError):  # Envelope.finish logs it and marks the audit record
        await _finish(call, ALLOWED, _reply())


async def test_a_consumed_approval_without_a_stored_result_is_never_performed_again() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    call = _call("delete_note", {"title": "t"})
    call.audit_extra["approval_state"] = "consumed"  # the approval gate let it through, used
    decision = await check.decide(call)
    assert decision is not None and decision.refused
    assert decision.code is Code.APPROVAL_EXPIRED and "already used" in decision.reason
    assert call.on_result == []
    assert await store.items("idem") == []  # the claim was released again


# -- the approval is spent under the claim (exactly once with the approval check) ---------------


def _spender(store: MemoryStore, call: ToolCall, refusal: Decision | None = None,
              error: Exception | None = None) -> list[list[tuple[str, bytes]]]:
    """Give `call` an approval to spend that records the claims held when it is spent."""
    seen: list[list[tuple[str, bytes]]] = []

    async def spend() -> Decision | None:
        seen.append(await store.items(NS))
        if error is not None:
            raise error
        return refusal

    call.spend_approval = spend
    return seen


async def test_the_approval_is_spent_only_once_the_claim_is_held() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    call = _call("delete_note", {"title": "t"}, decision_id="d-first")
    seen = _spender(store, call)
    assert await check.decide(call) is None
    [[(_, claim)]] = seen  # spent once, with this call's claim already in the store
    assert orjson.loads(claim)["decision_id"] == "d-first"
    assert call.spend_approval is None and len(call.on_result) == 1


async def test_an_approval_that_cannot_be_spent_refuses_and_frees_the_claim() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    used = Decision(Verdict.DENY, Code.APPROVAL_EXPIRED, "approval", "already used by another call")
    call = _call("delete_note", {"title": "t"})
    _spender(store, call, refusal=used)
    assert await check.decide(call) is used
    assert call.on_result == [] and await store.items(NS) == []


async def test_a_store_failure_while_spending_refuses_store_unavailable() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    call = _call("delete_note", {"title": "t"})
    _spender(store, call, error=StoreError("cas failed"))
    decision = await check.decide(call)
    assert decision is not None and decision.code is Code.STORE_UNAVAILABLE
    assert "cas failed" in decision.reason
    assert call.on_result == [] and await store.items(NS) == []  # a retry is not kept waiting


def test_applies_to_any_call_with_an_approval_to_spend() -> None:
    check, _ = _check(MemoryStore())
    call = _call("write_note")  # neither gated, idempotent nor keyed
    assert not check.applies(call)
    _spender(MemoryStore(), call)
    assert check.applies(call)  # never forwarded with its approval left unspent


# -- concurrent duplicates of one approved call, through the envelope ----------------------------


class RealisticStore(MemoryStore):
    """A MemoryStore that yields like SQLite or Redis: every operation takes a moment, so
    concurrent calls interleave between store operations; the scan behind the pending-approvals
    gauge takes longest (it reads every approval)."""

    async def get(self, ns: str, key: str) -> bytes | None:
        await asyncio.sleep(0.001)
        return await super().get(ns, key)

    async def put(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> None:
        await asyncio.sleep(0.001)
        await super().put(ns, key, value, ttl)

    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        await asyncio.sleep(0.001)
        return await super().add(ns, key, value, ttl)

    async def cas(self, ns: str, key: str, expected: bytes, value: bytes,
                  ttl: float | None = None) -> bool:
        await asyncio.sleep(0.001)
        return await super().cas(ns, key, expected, value, ttl)

    async def items(self, ns: str, limit: int = 1000) -> list[tuple[str, bytes]]:
        await asyncio.sleep(0.02)
        return await super().items(ns, limit)


class Gated:
    """An envelope whose `demo.delete_note` needs approval, on a RealisticStore."""

    def __init__(self, audit: Path, *, approval_wait: str = "0s", idempotency_wait: float = 5.0):
        self.store = RealisticStore()
        self.notifier = ApprovalNotifier()
        approvals = ApprovalsConfig(poll_interval=0.01)
        self.services = Services(
            store=self.store, metrics=Metrics(), notifier=self.notifier,
            settings=Config(approvals=approvals,
                            idempotency=IdempotencyConfig(ttl=60, wait=idempotency_wait)))
        self.envelope = Envelope(AuditLog(audit), Metrics(), ToolRegistry(), self.services)
        self.envelope.install(build_revision({"upstreams": UPSTREAMS, "tools": {"demo.delete_note": {
            "effect": "destructive", "approval": {"required": True, "wait": approval_wait}}}}))
        self.approvals = ApprovalService(self.store, approvals, self.notifier)
        self.audit = audit

    def call(self, decision_id: str) -> ToolCall:
        return _call("delete_note", {"title": "t"}, decision_id=decision_id)

    async def approve(self) -> str:
        for _ in range(400):  # until the approval exists
            pending = await self.approvals.approvals("pending")
            if pending:
                await self.approvals.decide(pending[0].id, approver="alice", approve=True,
                                            reason="ok")
                return pending[0].id
            await asyncio.sleep(0.005)
        raise AssertionError("no pending approval appeared")

    def records(self) -> dict[str, dict[str, Any]]:
        lines = (self.audit / "audit.jsonl").read_text().splitlines()
        return {r["decision_id"]: r for r in map(json.loads, lines)}


async def _performed_then_replayed(w: Gated, calls: list[asyncio.Task[Pending]]) -> None:
    """Exactly one of `calls` goes upstream; its result answers the other, not performed again."""
    done, waiting = await asyncio.wait(calls, timeout=3, return_when=asyncio.FIRST_COMPLETED)
    [first] = [t.result() for t in done]
    assert first.forwardable, first.decision  # never `approval_expired` while it is in flight
    await asyncio.sleep(0.2)
    assert len(waiting) == 1 and not next(iter(waiting)).done()  # held behind the first
    outcome = await w.envelope.complete(first, Reply(_reply()))
    assert outcome.kind == "deliver"
    second = await asyncio.wait_for(next(iter(waiting)), 3)
    assert not second.forwardable
    assert (second.decision.code, second.decision.result) == (Code.REPLAYED, RESULT)
    await w.envelope.complete(second)
    records = w.records()
    assert records[first.call.decision_id]["code"] == "ok"
    replay = records[second.call.decision_id]
    assert (replay["code"], replay["extra"]["replayed_from"]) == ("replayed", first.call.decision_id)
    assert (await w.approvals.approvals())[0].state == "consumed"


async def test_duplicates_after_one_approval_perform_once_and_replay(tmp_path: Path) -> None:
    w = Gated(tmp_path / "audit")
    assert (await w.envelope.begin(w.call("d-ask"))).decision.code is Code.APPROVAL_PENDING
    await w.approve()
    calls = [asyncio.create_task(w.envelope.begin(w.call(f"d-{i}"))) for i in range(2)]
    await _performed_then_replayed(w, calls)


async def test_duplicates_held_for_one_approval_perform_once_and_replay(tmp_path: Path) -> None:
    w = Gated(tmp_path / "audit", approval_wait="5s")
    calls = [asyncio.create_task(w.envelope.begin(w.call(f"d-{i}"))) for i in range(2)]
    await w.approve()
    await _performed_then_replayed(w, calls)


async def test_a_duplicate_outlasted_by_the_first_is_refused_in_flight(tmp_path: Path) -> None:
    w = Gated(tmp_path / "audit", idempotency_wait=0.3)
    assert (await w.envelope.begin(w.call("d-ask"))).decision.code is Code.APPROVAL_PENDING
    await w.approve()
    first, second = await asyncio.gather(*(w.envelope.begin(w.call(f"d-{i}")) for i in range(2)))
    performed = [p for p in (first, second) if p.forwardable]
    refused = [p for p in (first, second) if not p.forwardable]
    assert len(performed) == 1 and len(refused) == 1
    decision = refused[0].decision
    assert (decision.verdict, decision.code) == (Verdict.ERROR, Code.IDEMPOTENCY_IN_FLIGHT)
    # The first one's answer later is still its own, delivered once.
    assert (await w.envelope.complete(performed[0], Reply(_reply()))).kind == "deliver"


# ---- releasing a key whose outcome is unknown --------------------------------------------------

async def _unknown_first(store: MemoryStore) -> tuple[IdempotencyCheck, ToolCall]:
    check, _ = _check(store, wait=30)
    first = _call("write_note", key="k-1", decision_id="d-first")
    assert await check.decide(first) is None
    first.maybe_sent, first.upstream_status = True, 500
    await _finish(first, FORWARD_FAILED, None)
    return check, first


async def test_an_unknown_outcome_is_indexed_by_its_decision_id_and_released() -> None:
    store = MemoryStore()
    check, first = await _unknown_first(store)
    found = await find_unknown(store, "d-first")
    assert found is not None and found.held
    assert (found.key, found.shown, found.principal, found.upstream, found.tool) == (
        call_key(first, first.args_digest()).store, "k-1", "agent", "demo", "write_note")
    assert await find_unknown(store, "d-other") is None
    assert await release(store, found) is True
    assert await store.items(NS) == [] and await store.items(UNKNOWN_NS) == []
    assert await find_unknown(store, "d-first") is None  # a second release finds nothing
    assert await check.decide(_call("write_note", key="k-1", decision_id="d-retry")) is None


async def test_a_release_never_deletes_a_key_that_changed_since_it_was_read() -> None:
    # Read, then another release and a retry's claim take the key: the stale release is refused.
    store = MemoryStore()
    check, _ = await _unknown_first(store)
    stale = await find_unknown(store, "d-first")
    fresh = await find_unknown(store, "d-first")
    assert stale is not None and fresh is not None
    assert await release(store, fresh) is True
    assert await check.decide(_call("write_note", key="k-1", decision_id="d-retry")) is None
    assert await release(store, stale) is False
    [(_, raw)] = await store.items(NS)
    assert orjson.loads(raw)["decision_id"] == "d-retry"  # the retry's claim is kept


async def test_a_key_holding_another_call_is_not_held_for_release() -> None:
    store = MemoryStore()
    _, first = await _unknown_first(store)
    key = call_key(first, first.args_digest()).store
    await store.put(NS, key, orjson.dumps({"state": "done", "decision_id": "d-other",
                                           "args_digest": "x", "result": {}}))
    found = await find_unknown(store, "d-first")
    assert found is not None and not found.held
    assert await release(store, found) is False
    assert orjson.loads(await store.get(NS, key) or b"")["state"] == "done"
