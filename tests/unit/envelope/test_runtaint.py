"""The run-taint check: `run.tainted` / `run.secret` for CEL, read from the run's ledger."""

from __future__ import annotations

from envelope_helpers import RUN_KEY, build_revision, make_call

from proxy.envelope.checks.runtaint import RunTaintCheck
from proxy.envelope.dataflow import ledger
from proxy.envelope.types import Code, RunContext, Services
from proxy.errors import StoreError
from proxy.policy.compiled import reads_run_taint
from proxy.store.memory import MemoryStore


def _revision(rule: str) -> object:
    return build_revision({
        "upstreams": {"up": {"url": "http://127.0.0.1:9/mcp"}},
        "tools": {"up.post": {"effect": "write", "rules": [{"id": "r", "forbid": rule}]}},
    })


def test_which_cel_reads_the_run_taint() -> None:
    assert reads_run_taint("run.tainted")
    assert reads_run_taint("!run . secret && args.x == 1")
    assert reads_run_taint("run['tainted']") and reads_run_taint('run [ "secret" ]')
    assert not reads_run_taint("run.depth > 1 || args.tainted")
    assert not reads_run_taint('args.run_secret == "x"')


async def test_flags_come_from_the_ledger_and_only_widen() -> None:
    store = MemoryStore()
    check = RunTaintCheck(_revision("run.tainted"), None, Services(store=store))  # type: ignore[arg-type]
    call = make_call("post", {}, upstream="up")
    assert check.applies(call)
    assert await check.decide(call) is None and not call.run.tainted and not call.run.secret
    await ledger.record(store, RUN_KEY, ledger.LedgerDelta("up.fetch", untrusted=True), n=32,
                          cap=1024, ttl=60)
    assert await check.decide(call) is None and call.run.tainted and not call.run.secret
    replayed = make_call("post", {}, upstream="up")
    replayed.run = RunContext("run-2", replayed.principal.id, secret=True)  # a recorded call's flags are kept
    assert await check.decide(replayed) is None and replayed.run.secret


async def test_a_policy_that_does_not_read_the_taint_pays_nothing() -> None:
    store = MemoryStore()
    store.fail = StoreError("down")
    check = RunTaintCheck(_revision("run.depth > 3"), None, Services(store=store))  # type: ignore[arg-type]
    assert not check.applies(make_call("post", {}, upstream="up"))


async def test_fail_closed_without_a_store_or_when_it_fails() -> None:
    call = make_call("post", {}, upstream="up")
    no_store = RunTaintCheck(_revision("run.tainted"), None, Services())  # type: ignore[arg-type]
    refused = await no_store.decide(call)
    assert refused is not None and refused.code is Code.MISCONFIGURED
    store = MemoryStore()
    store.fail = StoreError("redis store redis://x: get failed: Connection refused")
    failing = RunTaintCheck(_revision("run.tainted"), None, Services(store=store))  # type: ignore[arg-type]
    refused = await failing.decide(call)
    assert refused is not None and refused.code is Code.STORE_UNAVAILABLE
    assert "Connection refused" in refused.reason and refused.rule == "tools.up.post rule r"
