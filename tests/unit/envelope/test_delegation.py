"""The delegation check (lineage, depth, roster) and the rate-limit check with a MemoryStore."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.envelope.checks import delegation
from proxy.envelope.checks.delegation import DelegationCheck, lineage_key, taint_ancestors
from proxy.envelope.checks.ratelimit import RateLimitCheck, slot_key
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, RunContext, Services, ToolCall, Verdict, run_key
from proxy.errors import StoreError
from proxy.policy.vocab import Effect
from proxy.store.memory import MemoryStore

TOOLS = {"demo.echo": {"effect": "read"}, "demo.write_note": {"effect": "write"}}


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    delegation.CACHE.clear()


def _doc(**principals: Any) -> dict[str, Any]:
    return {"upstreams": UPSTREAMS, "tools": TOOLS, "principals": principals}


def _call(run: str, parent: str | None = None, agent: str | None = None, principal: str = "agent",
          tool: str = "echo") -> ToolCall:
    call = make_call(tool, principal=principal)
    call.run = RunContext(run, principal, parent=parent, agent=agent)
    call.effect = Effect.READ if tool == "echo" else Effect.WRITE
    return call


def _check(store: Any, **principals: Any) -> DelegationCheck:
    return DelegationCheck(build_revision(_doc(**principals)), ToolRegistry(), Services(store=store))


async def test_session_child_grandchild_pass_great_grandchild_refused() -> None:
    store = MemoryStore()
    check = _check(store)
    root = _call("s")
    assert await check.decide(root) is None and root.run.depth == 0
    child = _call("c", parent="s")
    assert await check.decide(child) is None and (child.run.depth, child.run.parent) == (1, "s")
    assert child.audit_extra == {"run_parent": "s", "run_depth": 1}
    grand = _call("g", parent="c")
    assert await check.decide(grand) is None and grand.run.depth == 2
    great = _call("gg", parent="g")
    d = await check.decide(great)
    assert d is not None and (d.verdict, d.code, d.check, d.rule) == (
        Verdict.DENY, Code.DEPTH_EXCEEDED, "delegation", "defaults.max_depth")
    assert "depth 3" in d.reason and "bound is 2" in d.reason
    rec = orjson.loads(await store.get("run", lineage_key(run_key("agent", "gg"))))  # type: ignore[arg-type]
    assert (rec["parent"], rec["depth"], rec["principal"]) == ("g", 3, "agent")


async def test_depth_comes_from_the_records_not_the_client() -> None:
    store = MemoryStore()
    check = _check(store)
    for run, parent in (("s", None), ("c", "s"), ("g", "c"), ("gg", "g")):
        await check.decide(_call(run, parent))
    # A later call of the too-deep run that names no parent (or a root) is still too deep.
    for parent in (None, "s", "unknown-root"):
        d = await check.decide(_call("gg", parent))
        assert d is not None and d.code is Code.DEPTH_EXCEEDED
    conflict = _call("gg", parent="s")
    await check.decide(conflict)
    assert conflict.audit_extra["lineage_conflict"] == "s"
    # Another process (cache cleared) reads the same answer from the store.
    delegation.CACHE.clear()
    d = await _check(store).decide(_call("gg"))
    assert d is not None and d.code is Code.DEPTH_EXCEEDED


async def test_unknown_parent_is_recorded_as_a_root() -> None:
    store = MemoryStore()
    check = _check(store)
    child = _call("c", parent="never-seen")
    assert await check.decide(child) is None and child.run.depth == 1
    rec = orjson.loads(await store.get("run", lineage_key(run_key("agent", "never-seen"))))  # type: ignore[arg-type]
    assert (rec["parent"], rec["depth"], rec["implied"]) == (None, 0, True)


async def test_principal_max_depth() -> None:
    check = _check(MemoryStore(), agent={"max_depth": 0})
    assert await check.decide(_call("s")) is None
    d = await check.decide(_call("c", parent="s"))
    assert d is not None and d.code is Code.DEPTH_EXCEEDED and d.rule == "principals.agent.max_depth"
    assert "depth 1" in d.reason and "bound is 0" in d.reason


async def test_roster() -> None:
    check = _check(MemoryStore(), agent={"roster": ["researcher", "summarizer"]})
    assert await check.decide(_call("s")) is None
    assert await check.decide(_call("c1", parent="s", agent="researcher")) is None
    d = await check.decide(_call("c2", parent="s", agent="shell-bot"))
    assert d is not None and (d.code, d.rule) == (Code.NOT_ON_ROSTER, "principals.agent.roster")
    assert "'shell-bot'" in d.reason and "researcher, summarizer" in d.reason
    d = await check.decide(_call("c3", parent="s"))  # no agent name: never guessed
    assert d is not None and d.code is Code.NOT_ON_ROSTER and "no agent" in d.reason
    # A root run is no child: the roster does not apply to it.
    assert await check.decide(_call("other-root", agent="shell-bot")) is None


async def test_roster_is_the_parent_holders() -> None:
    check = _check(MemoryStore(), boss={"roster": ["helper"], "delegates": ["agent"]}, agent={})
    assert await check.decide(_call("s", principal="boss")) is None
    assert await check.decide(_call("c", parent="s", agent="helper", principal="agent")) is None
    d = await check.decide(_call("c2", parent="s", agent="rogue", principal="agent"))
    assert d is not None and d.code is Code.NOT_ON_ROSTER and "principal 'boss'" in d.reason


class _Broken(MemoryStore):
    async def get(self, ns: str, key: str) -> bytes | None:
        raise StoreError("down")

    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        raise StoreError("down")


async def test_fail_closed() -> None:
    d = await _check(None).decide(_call("c", parent="s"))
    assert d is not None and (d.verdict, d.code) == (Verdict.ERROR, Code.MISCONFIGURED)
    assert not _check(None).applies(_call("root"))
    broken = _check(_Broken())
    d = await broken.decide(_call("c", parent="s"))
    assert d is not None and d.code is Code.STORE_UNAVAILABLE
    d = await broken.decide(_call("r", tool="write_note"))
    assert d is not None and d.code is Code.STORE_UNAVAILABLE
    assert await broken.decide(_call("r")) is None  # reads of root runs keep working


async def test_taint_ancestors_stop_at_propagate_taint_false() -> None:
    store = MemoryStore()
    boss, mid = {"delegates": ["mid"]}, {"delegates": ["agent"]}
    rev_doc = _doc(boss=boss, mid={**mid, "propagate_taint": False}, agent={})
    check = DelegationCheck(build_revision(rev_doc), ToolRegistry(), Services(store=store))
    await check.decide(_call("s", principal="boss"))
    await check.decide(_call("c", parent="s", principal="mid"))
    await check.decide(_call("g", parent="c", principal="agent"))
    s, c, g = run_key("boss", "s"), run_key("mid", "c"), run_key("agent", "g")
    revision = build_revision(rev_doc)
    # c's principal (mid) trusts its children: g's taint does not widen c (nor above it).
    assert await taint_ancestors(store, revision, g) == []
    assert await taint_ancestors(store, revision, c) == [s]
    assert await taint_ancestors(store, revision, s) == []
    # boss trusts its children: g widens c, and stops below s.
    rev_boss = build_revision(_doc(boss={**boss, "propagate_taint": False}, mid=mid, agent={}))
    assert await taint_ancestors(store, rev_boss, g) == [c]
    rev_all = build_revision(_doc(boss=boss, mid=mid, agent={}))
    assert await taint_ancestors(store, rev_all, g) == [c, s]
    # A principal that no longer lists the child's principal under `delegates` is not widened.
    rev_revoked = build_revision(_doc(boss={}, mid=mid, agent={}))
    assert await taint_ancestors(store, rev_revoked, g) == [c]


async def test_child_runs_carry_their_taint_targets() -> None:
    check = _check(MemoryStore(), agent={})
    await check.decide(_call("s"))
    child, grand = _call("c", parent="s"), _call("g", parent="c")
    await check.decide(child)
    await check.decide(grand)
    assert child.run.taint_targets == (run_key("agent", "s"),)
    # The grandparent is widened too.
    assert grand.run.taint_targets == (run_key("agent", "c"), run_key("agent", "s"))
    root = _call("s")
    await check.decide(root)
    assert root.run.taint_targets == ()


# ---- rate limit -----------------------------------------------------------------------------

def _limit(store: Any, bound: int | None = 2, default: int | None = None) -> RateLimitCheck:
    doc = _doc(agent={"max_concurrent_per_run": bound} if bound else {})
    if default:
        doc["defaults"] = {"max_concurrent_per_run": default}
    return RateLimitCheck(build_revision(doc), ToolRegistry(), Services(store=store))


async def _finish(call: ToolCall) -> None:
    for hook in call.on_result:
        await hook(call, Decision(Verdict.ALLOW, Code.OK, "forward", "ok"), None)


async def test_concurrency_bound_per_run() -> None:
    store = MemoryStore()
    check = _limit(store, 2)
    assert check.applies(_call("r"))
    first, second, third = (dataclasses.replace(_call("r"), decision_id=f"d{i}") for i in range(3))
    assert await check.decide(first) is None
    assert await check.decide(second) is None
    d = await check.decide(third)
    assert d is not None and (d.code, d.rule) == (Code.RATE_LIMITED, "principals.agent.max_concurrent_per_run")
    assert "2 calls in flight" in d.reason
    # Another run is not affected.
    assert await check.decide(dataclasses.replace(_call("other"), decision_id="o1")) is None
    await _finish(first)
    assert await store.get("run", slot_key(run_key("agent", "r"), 0)) is None
    assert await check.decide(third) is None


async def test_no_bound_no_store_touch_and_fail_closed() -> None:
    assert not _limit(MemoryStore(), None).applies(_call("r"))
    assert _limit(MemoryStore(), None, default=3).applies(_call("r"))
    d = await _limit(None, 1).decide(_call("r"))
    assert d is not None and d.code is Code.MISCONFIGURED
    d = await _limit(_Broken(), 1).decide(_call("r"))
    assert d is not None and d.code is Code.STORE_UNAVAILABLE


# ---- runs belong to their principal ------------------------------------------------------------

async def test_another_principals_run_id_is_a_run_of_ones_own() -> None:
    store = MemoryStore()
    check = _check(store, alice={}, mallory={})
    # alice's run r is a child of her run s (depth 1).
    assert await check.decide(_call("s", principal="alice")) is None
    alice_child = _call("r", parent="s", principal="alice")
    assert await check.decide(alice_child) is None and alice_child.run.depth == 1
    # mallory names the same run id: her own root run, alice's record untouched.
    mallory = _call("r", principal="mallory")
    assert await check.decide(mallory) is None
    assert (mallory.run.depth, mallory.run.parent, mallory.run.taint_targets) == (0, None, ())
    # mallory names alice's run s as her parent: an implied root of her own, never alice's run,
    # so her reads can never widen alice's ledger.
    child = _call("m-child", parent="s", principal="mallory")
    assert await check.decide(child) is None
    assert child.run.taint_targets == (run_key("mallory", "s"),)
    assert "run_parent_principal" not in child.audit_extra
    rec = orjson.loads(await store.get("run", lineage_key(run_key("alice", "r"))))  # type: ignore[arg-type]
    assert (rec["parent"], rec["depth"], rec["principal"]) == ("s", 1, "alice")


async def test_delegates_let_another_principals_runs_be_children() -> None:
    store = MemoryStore()
    check = _check(store, orch={"delegates": ["worker"]}, worker={}, other={})
    assert await check.decide(_call("root", principal="orch")) is None
    child = _call("w1", parent="root", principal="worker")
    assert await check.decide(child) is None
    assert (child.run.depth, child.run.taint_targets) == (1, (run_key("orch", "root"),))
    assert child.audit_extra["run_parent_principal"] == "orch"
    # A principal orch does not list gets a root of its own by that id.
    stranger = _call("o1", parent="root", principal="other")
    assert await check.decide(stranger) is None
    assert stranger.run.taint_targets == (run_key("other", "root"),)
    # The delegate's own run by that id comes first.
    assert await check.decide(_call("mine", principal="worker")) is None
    own = _call("w2", parent="mine", principal="worker")
    assert await check.decide(own) is None
    assert own.run.taint_targets == (run_key("worker", "mine"),)


async def test_a_run_at_the_deepest_allowed_depth_widens_its_root() -> None:
    # The deepest max_depth a policy may set is as deep as taint climbs: the run allowed to call
    # at that depth still reaches its root run's ledger.
    from proxy.policy.model import MAX_DEPTH
    store = MemoryStore()
    check = _check(store, agent={"max_depth": MAX_DEPTH})
    assert await check.decide(_call("r0")) is None
    for n in range(1, MAX_DEPTH + 1):
        assert await check.decide(_call(f"r{n}", parent=f"r{n - 1}", agent="a")) is None
    refused = await check.decide(_call(f"r{MAX_DEPTH + 1}", parent=f"r{MAX_DEPTH}", agent="a"))
    assert refused is not None and refused.code is Code.DEPTH_EXCEEDED
    revision = build_revision(_doc(agent={"max_depth": MAX_DEPTH}))
    ancestors = await taint_ancestors(store, revision, run_key("agent", f"r{MAX_DEPTH}"))
    assert len(ancestors) == MAX_DEPTH and ancestors[-1] == run_key("agent", "r0")
