"""The idempotency check with a MemoryStore: claim, replay, wait for a duplicate, fail closed."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.audit.record import args_digest
from proxy.config import Config, IdempotencyConfig
from proxy.envelope.checks.idempotency import NS, IdempotencyCheck, call_key
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import ALLOWED, Code, Decision, Services, ToolCall, Verdict
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
    (Decision(Verdict.ERROR, Code.CLIENT_DISCONNECTED, "forward", "gone"), None),
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
