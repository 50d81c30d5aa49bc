"""The shadow check with a MemoryStore: sticky runs, policy modes, records, fail closed."""

from __future__ import annotations

from typing import Any

import orjson
from envelope_helpers import RUN_KEY, UPSTREAMS, build_revision, make_call

from proxy.envelope.checks.shadow import (
    DEFAULT_RESULT,
    NS,
    RUN_NS,
    ShadowCheck,
    list_records,
    run_flag_key,
)
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, RunContext, Services, ToolCall, Verdict
from proxy.errors import StoreError
from proxy.observability.metrics import Metrics
from proxy.policy.vocab import Effect
from proxy.store.memory import MemoryStore

DOC: dict[str, Any] = {
    "upstreams": UPSTREAMS,
    "tools": {
        "demo.echo": {"effect": "read"},
        "demo.write_note": {"effect": "write"},
        "demo.delete_note": {"effect": "destructive"},
        "demo.draft": {"effect": "write", "mode": "shadow", "shadow_result": "Draft noted (shadow)."},
    },
    "principals": {"trainee": {"mode": "shadow"}},
}
EFFECTS = {"echo": Effect.READ, "delete_note": Effect.DESTRUCTIVE}


def _check(store: MemoryStore | None) -> tuple[ShadowCheck, Metrics]:
    metrics = Metrics()
    return ShadowCheck(build_revision(DOC), ToolRegistry(), Services(store=store, metrics=metrics)), metrics


def _call(tool: str = "write_note", args: dict[str, Any] | None = None, *, shadow: bool = False,
          run: str = "run-1", principal: str = "agent", decision_id: str = "d-1") -> ToolCall:
    call = make_call(tool, args if args is not None else {"title": "t", "body": "b"}, principal=principal)
    call.run = RunContext(run, principal)
    call.decision_id = decision_id
    call.shadow_requested = shadow
    call.effect = EFFECTS.get(tool, Effect.WRITE)
    return call


def _records(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("envelope_shadow_records_total") or 0.0


def test_applies_to_writers_and_to_calls_asking_for_shadow() -> None:
    check, _ = _check(MemoryStore())
    assert check.applies(_call("write_note"))
    assert check.applies(_call("echo", shadow=True))
    assert not check.applies(_call("echo"))


async def test_header_shadows_a_writer_and_records_the_would_be_call() -> None:
    store = MemoryStore()
    check, metrics = _check(store)
    call = _call(shadow=True, decision_id="d-shadow")
    decision = await check.decide(call)
    assert decision is not None
    assert (decision.verdict, decision.code, decision.check) == (Verdict.ALLOW, Code.SHADOWED, "shadow")
    assert decision.rule == "request:X-Envelope-Shadow"
    assert decision.result == {"content": [{"type": "text", "text": DEFAULT_RESULT}], "isError": True}
    assert call.run.shadow is True
    [(key, raw)] = await store.items(NS)
    assert decision.audit == {"shadow": True, "shadow_record": key}
    record = orjson.loads(raw)
    assert record["arguments"] == {"title": "t", "body": "b"}
    assert {k: record[k] for k in ("decision_id", "run", "principal", "upstream", "tool", "effect")} == {
        "decision_id": "d-shadow", "run": "run-1", "principal": "agent", "upstream": "demo",
        "tool": "write_note", "effect": "write"}
    assert record["would_need_approval"] is False
    assert record["time"].endswith("Z")
    assert await store.get(RUN_NS, run_flag_key(RUN_KEY)) is not None
    assert _records(metrics) == 1


async def test_the_run_stays_shadow_without_the_header() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    # Switched on by a read call: the read itself is forwarded.
    read = _call("echo", {"text": "x"}, shadow=True)
    assert await check.decide(read) is None
    assert read.audit_extra == {"shadow": True}
    later = await check.decide(_call("delete_note", {"title": "t"}, decision_id="d-2"))
    assert later is not None and later.code is Code.SHADOWED and later.rule == "run"
    [(_, raw)] = await store.items(NS)
    assert orjson.loads(raw)["would_need_approval"] is True  # destructive is gated
    # Another run is not affected.
    assert await check.decide(_call(run="run-2")) is None


async def test_policy_mode_shadow_for_a_principal_and_a_tool() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    by_principal = await check.decide(_call(principal="trainee"))
    assert by_principal is not None and by_principal.code is Code.SHADOWED
    assert by_principal.rule == "principals.trainee.mode"
    assert await check.decide(_call("echo", {"text": "x"}, principal="trainee")) is None
    by_tool = await check.decide(_call("draft"))
    assert by_tool is not None and by_tool.rule == "tools.demo.draft.mode"
    assert by_tool.result is not None
    assert by_tool.result["content"][0]["text"] == "Draft noted (shadow)."
    # Policy shadow does not make the run sticky.
    assert await store.get(RUN_NS, run_flag_key(RUN_KEY)) is None
    assert await check.decide(_call()) is None


async def test_no_recorder_refuses_a_shadow_call() -> None:
    check, _ = _check(None)
    decision = await check.decide(_call(shadow=True))
    assert decision is not None
    assert (decision.verdict, decision.code) == (Verdict.ERROR, Code.MISCONFIGURED)
    assert decision.reason.startswith("shadow run but no recorder")
    assert await check.decide(_call()) is None  # not a shadow run: nothing to record


async def test_store_failure_refuses_store_unavailable() -> None:
    store = MemoryStore()
    store.fail = StoreError("redis down")
    check, _ = _check(store)
    for call in (_call(shadow=True), _call(), _call(principal="trainee")):
        decision = await check.decide(call)
        assert decision is not None
        assert (decision.verdict, decision.code, decision.check) == (
            Verdict.ERROR, Code.STORE_UNAVAILABLE, "shadow")


async def test_list_records_filters_by_run_oldest_first() -> None:
    store = MemoryStore()
    check, _ = _check(store)
    for i in range(3):
        await check.decide(_call(shadow=True, run="run-a", decision_id=f"a{i}"))
    await check.decide(_call(shadow=True, run="run-b", decision_id="b0"))
    assert [r["decision_id"] for r in await list_records(store)] == ["a0", "a1", "a2", "b0"]
    assert [r["decision_id"] for r in await list_records(store, run="run-a", limit=2)] == ["a1", "a2"]
    assert await list_records(store, run="nope") == []
