"""The rate-limit check's token buckets and run budget with a MemoryStore on a fake clock: which
calls it looks at, per-principal and per-tool buckets, burst, budgets, all-or-nothing takes, the
wait on the wire and in the audit record, shadow calls taking nothing, fail closed. (The
concurrency bound's own tests are in test_delegation.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.audit.log import AuditLog
from proxy.envelope.checks.ratelimit import RATE_NS, RUN_NS, RateLimitCheck, principal_key, slot_key
from proxy.envelope.outcome import refusal_result
from proxy.envelope.pipeline import Envelope
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    Code,
    Decision,
    Reply,
    RunContext,
    Services,
    ToolCall,
    Verdict,
    deny,
    run_key,
)
from proxy.errors import StoreError
from proxy.observability.metrics import Metrics
from proxy.store.memory import MemoryStore
from tests.unit.fakes import Clock, clocked_store

TOOLS: dict[str, Any] = {
    "demo.echo": {"effect": "read"},
    "demo.search": {"effect": "read", "rate": "1/min"},
    "demo.write_note": {"effect": "write"},
}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> MemoryStore:
    return clocked_store(clock)


def _doc(defaults: dict[str, Any] | None = None, **principals: Any) -> dict[str, Any]:
    return {"upstreams": UPSTREAMS, "tools": TOOLS, "principals": principals, "defaults": defaults or {}}


def _check(store: MemoryStore | None, defaults: dict[str, Any] | None = None, **principals: Any) -> RateLimitCheck:
    return RateLimitCheck(build_revision(_doc(defaults, **principals)), ToolRegistry(), Services(store=store))


_ids = iter(range(1_000_000))


def _call(principal: str = "agent", tool: str = "echo", run: str = "run-1") -> ToolCall:
    call = make_call(tool, principal=principal)
    call.run = RunContext(run, principal)
    call.decision_id = f"d-{next(_ids)}"
    return call


async def _decide(check: RateLimitCheck, call: ToolCall) -> Decision | None:
    return await check.decide(call) if check.applies(call) else None


async def _passed(check: RateLimitCheck, n: int, **kw: Any) -> list[bool]:
    return [await _decide(check, _call(**kw)) is None for _ in range(n)]


def test_applies_only_to_limited_principals_and_tools(store: MemoryStore) -> None:
    check = _check(store, agent={"rate": "3/min"}, free={})
    assert check.applies(_call("agent"))
    assert not check.applies(_call("free"))
    assert not check.applies(_call("unlisted"))  # no defaults.rate
    assert check.applies(_call("free", tool="search"))  # the tool's own rate
    defaults = _check(store, {"rate": "10/s"}, free={})
    assert defaults.applies(_call("unlisted")) and defaults.applies(_call("free"))
    budget = _check(store, {"max_calls_per_run": 5})
    assert budget.applies(_call("anyone"))


async def test_principal_rate_three_per_minute(store: MemoryStore, clock: Clock) -> None:
    check = _check(store, agent={"rate": "3/min"})
    assert await _passed(check, 3) == [True, True, True]
    refused = await _decide(check, _call())
    assert refused is not None
    assert (refused.verdict, refused.code, refused.check, refused.rule) == (
        Verdict.DENY, Code.RATE_LIMITED, "rate_limit", "principals.agent.rate")
    assert refused.reason == ("principal 'agent' is over its rate of 3/min (principals.agent.rate); "
                              "retry in 20.0s")
    assert refused.retry_after == 20.0 and refused.audit == {"retry_after": 20.0}
    # Another principal, unlimited, is not touched; other runs share the principal's bucket.
    assert await _passed(check, 5, principal="other") == [True] * 5
    assert await _passed(check, 1, run="run-2") == [False]
    clock.now += 12.55
    refused = await _decide(check, _call())
    assert refused is not None and refused.retry_after == 7.5  # 7.45 s, rounded up
    clock.now += 7.45
    assert await _passed(check, 2) == [True, False]


async def test_burst_then_the_rate(store: MemoryStore, clock: Clock) -> None:
    check = _check(store, agent={"rate": {"limit": "60/min", "burst": 5}})
    assert await _passed(check, 6) == [True] * 5 + [False]
    refused = await _decide(check, _call())
    assert refused is not None and refused.retry_after == 1.0
    assert "60/min (burst 5)" in refused.reason
    clock.now += 2.5
    assert await _passed(check, 3) == [True, True, False]


async def test_defaults_rate_gives_each_principal_its_own_bucket(store: MemoryStore) -> None:
    check = _check(store, {"rate": "2/h"}, own={"rate": "1/h"})
    assert await _passed(check, 3, principal="bob") == [True, True, False]
    assert await _passed(check, 3, principal="carol") == [True, True, False]
    assert await _passed(check, 2, principal="own") == [True, False]
    refused = await _decide(check, _call("bob"))
    assert refused is not None and refused.rule == "defaults.rate" and refused.retry_after == 1800.0


async def test_tool_rate_is_per_principal(store: MemoryStore) -> None:
    check = _check(store)
    assert await _passed(check, 2, principal="alice", tool="search") == [True, False]
    refused = await _decide(check, _call("alice", tool="search"))
    assert refused is not None and refused.rule == "tools.demo.search.rate"
    assert refused.reason.startswith("principal 'alice' is over the rate of demo.search, 1/min per principal")
    assert await _passed(check, 1, principal="bob", tool="search") == [True]
    assert await _passed(check, 3, principal="alice", tool="echo") == [True] * 3  # no rate there


async def test_a_refused_call_takes_nothing(store: MemoryStore) -> None:
    check = _check(store, agent={"rate": "2/min"})
    assert await _passed(check, 1, tool="search") == [True]
    # Refused by the tool's bucket: the principal's bucket keeps its second token.
    refused = await _decide(check, _call(tool="search"))
    assert refused is not None and refused.rule == "tools.demo.search.rate"
    assert await _passed(check, 2, tool="echo") == [True, False]


async def test_run_budget(store: MemoryStore, clock: Clock) -> None:
    check = _check(store, {"max_calls_per_run": 5}, agent={"max_calls_per_run": 2})
    assert await _passed(check, 3, run="loop") == [True, True, False]
    refused = await _decide(check, _call(run="loop"))
    assert refused is not None
    assert (refused.code, refused.rule, refused.retry_after) == (
        Code.RATE_LIMITED, "principals.agent.max_calls_per_run", None)
    assert refused.reason == ("run 'loop' has made the 2 calls its budget allows "
                              "(principals.agent.max_calls_per_run); start a new run")
    assert "retry_after" not in refused.as_meta("d")
    clock.now += 3600  # a budget never refills while the run lives
    assert await _passed(check, 1, run="loop") == [False]
    assert await _passed(check, 2, run="next") == [True, True]
    assert await _passed(check, 6, principal="other", run="o") == [True] * 5 + [False]


async def _end(call: ToolCall, sent: bool) -> None:
    call.maybe_sent = sent
    for hook in call.on_result:  # the envelope runs them when the call ends
        await hook(call, Decision(Verdict.ERROR, Code.APPROVAL_PENDING, "approval", "later"), None)


async def test_a_call_not_sent_gives_its_budget_token_back(store: MemoryStore) -> None:
    check = _check(store, agent={"max_calls_per_run": 2, "rate": "3/min"})
    refused_later = _call(run="r")
    assert await _decide(check, refused_later) is None
    await _end(refused_later, sent=False)  # refused by a later check (or never sent)
    sent = _call(run="r")
    assert await _decide(check, sent) is None
    await _end(sent, sent=True)  # it reached the upstream (even if it then failed): it counts
    assert await _passed(check, 2, run="r") == [True, False]  # the budget's second call, then spent
    # The principal's rate is not given back: 3 tokens taken by 3 passed calls, the 4th refused.
    refused = await _decide(check, _call(run="other"))
    assert refused is not None and refused.rule == "principals.agent.rate"


async def test_another_principal_naming_the_run_has_a_budget_of_its_own(store: MemoryStore) -> None:
    """Runs are keyed by principal + run id: naming a victim's run id spends nothing of it."""
    check = _check(store, {"max_calls_per_run": 2})
    assert await _passed(check, 3, principal="mallory", run="victim-run") == [True, True, False]
    assert await _passed(check, 3, principal="agent", run="victim-run") == [True, True, False]


async def test_run_budget_lives_the_ledger_ttl_after_the_last_call(clock: Clock, store: MemoryStore) -> None:
    doc = _doc(agent={"max_calls_per_run": 1})
    doc["dataflow"] = {"ledger_ttl": "1h"}
    check = RateLimitCheck(build_revision(doc), ToolRegistry(), Services(store=store))
    assert await _passed(check, 2, run="r") == [True, False]
    clock.now += 3599
    assert await _passed(check, 1, run="r") == [False]
    clock.now += 2  # an hour without a counted call: the run is forgotten
    assert await _passed(check, 1, run="r") == [True]


async def test_a_bucket_refusal_releases_the_concurrency_slot(store: MemoryStore) -> None:
    check = _check(store, agent={"rate": "1/min", "max_concurrent_per_run": 1})
    first = _call()
    assert await _decide(check, first) is None
    for hook in first.on_result:
        await hook(first, Decision(Verdict.ALLOW, Code.OK, "forward", "ok"), None)
    second = _call()
    refused = await _decide(check, second)
    assert refused is not None and refused.rule == "principals.agent.rate"
    assert await store.get(RUN_NS, slot_key(run_key("agent", "run-1"), 0)) == second.decision_id.encode()
    for hook in second.on_result:  # the envelope runs them for refusals too
        await hook(second, refused, None)
    assert await store.get(RUN_NS, slot_key(run_key("agent", "run-1"), 0)) is None


async def test_fail_closed(store: MemoryStore) -> None:
    d = await _check(None, agent={"rate": "3/min"}).decide(_call())
    assert d is not None and (d.verdict, d.code, d.rule) == (Verdict.ERROR, Code.MISCONFIGURED, "principals.agent.rate")
    store.fail = StoreError("redis store redis://127.0.0.1:1: take failed: down")
    d = await _check(store, agent={"rate": "3/min"}).decide(_call())
    assert d is not None and (d.verdict, d.code) == (Verdict.ERROR, Code.STORE_UNAVAILABLE)
    assert "redis://127.0.0.1:1" in d.reason
    store.fail = None
    await store.put(RATE_NS, principal_key("agent"), b"garbled")
    d = await _check(store, agent={"rate": "3/min"}).decide(_call())
    assert d is not None and d.code is Code.STORE_UNAVAILABLE


def test_other_codes_keep_their_wire_shape() -> None:
    assert set(deny(Code.UNAUTHORIZED, "authz", "no").as_meta("d")) == {
        "code", "check", "rule", "reason", "decision_id"}


# ---- through the envelope: shadow first, the wire result, the audit record, the metric ----------


async def test_through_the_envelope(tmp_path: Path, store: MemoryStore) -> None:
    metrics = Metrics()
    envelope = Envelope(AuditLog(tmp_path / "audit"), metrics, ToolRegistry(),
                        Services(store=store, metrics=metrics))
    envelope.install(build_revision(_doc(agent={"rate": "1/min"}, trainee={"rate": "1/min", "mode": "shadow"})))

    async def call(principal: str, tool: str) -> Decision:
        pending = await envelope.begin(_call(principal, tool))
        if pending.forwardable:  # the upstream's answer: the call was performed
            reply = Reply({"jsonrpc": "2.0", "id": 1, "result": {"content": []}})
            return (await envelope.complete(pending, reply)).decision
        return (await envelope.complete(pending)).decision

    # A shadowed writer is recorded, not performed: it takes no token, however many there are.
    for _ in range(3):
        assert (await call("trainee", "write_note")).code is Code.SHADOWED
    assert (await call("trainee", "echo")).code is Code.OK
    assert (await call("trainee", "echo")).code is Code.RATE_LIMITED

    assert (await call("agent", "echo")).code is Code.OK
    refused = await call("agent", "echo")
    assert refused.code is Code.RATE_LIMITED
    wire = refusal_result(refused, "d-x")
    assert wire["_meta"]["envelope/decision"]["retry_after"] == 60.0
    assert wire["content"][0]["text"].endswith("retry in 60.0s")
    records = [json.loads(x) for x in (tmp_path / "audit" / "audit.jsonl").read_text().splitlines()]
    last = records[-1]
    assert (last["code"], last["check"], last["rule"]) == ("rate_limited", "rate_limit", "principals.agent.rate")
    assert last["extra"]["retry_after"] == 60.0
    assert metrics.registry.get_sample_value(
        "envelope_decisions_total",
        {"upstream": "demo", "tool": "echo", "verdict": "deny", "code": "rate_limited"}) == 2.0
