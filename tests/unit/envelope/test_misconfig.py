"""Misconfiguration report: every kind with its layer, refusals that match it, one sink."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from envelope_helpers import build_revision, make_call

from proxy.audit.log import AuditLog
from proxy.config import ApprovalsConfig, Config
from proxy.envelope.checks import catalogue
from proxy.envelope.checks.catalogue import (
    TOOL_RULES,
    CatalogueCheck,
    misconfiguration,
    misconfigurations,
    visible,
)
from proxy.envelope.misconfig import (
    Dependencies,
    MisconfigSink,
    Misconfiguration,
    count_by_layer,
)
from proxy.envelope.pipeline import Envelope
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Services
from proxy.observability.metrics import Metrics
from proxy.policy.vocab import Effect
from proxy.store.memory import MemoryStore

NO_STORE = Dependencies(store=None)
FULL = Dependencies(store="sqlite", approvals_enabled=True, approval_check=True)

DOC: dict[str, Any] = {
    "upstreams": {"demo": {"url": "http://127.0.0.1:9/mcp"}},
    "defaults": {"unknown_tools": "deny"},
    "tools": {
        "demo.read": {"effect": "read"},
        "demo.gated": {"effect": "destructive"},
        "demo.nothing": {"effect": "write", "fallback": "deny"},
        "demo.shadowed": {"effect": "write", "mode": "shadow"},
        "demo.gone": {"effect": "read"},
        "ghost.t": {"effect": "read"},
    },
    "principals": {"rehearsal": {"mode": "shadow"}, "plain": {}},
}
OFFERED = [{"name": n} for n in ("read", "gated", "nothing", "shadowed", "extra")]


@pytest.fixture
def revision() -> Any:
    return build_revision(DOC)


@pytest.fixture
def learned(registry: ToolRegistry) -> ToolRegistry:
    registry.learn("demo", OFFERED)
    return registry


def kinds(report: list[Misconfiguration]) -> set[tuple[str, str, str]]:
    return {(p.tool if p.principal is None else f"{p.tool}@{p.principal}", p.layer, p.kind)
            for p in report}


def test_every_kind_with_its_layer(revision: Any, learned: ToolRegistry) -> None:
    report = misconfigurations(revision, learned, NO_STORE)
    assert kinds(report) == {
        ("ghost.t", "registry", "undeclared_upstream"),
        ("demo.gone", "registry", "not_offered"),
        ("demo.nothing", "registry", "fallback_deny"),
        ("demo.extra", "registry", "unknown_tool"),
        ("demo.gated", "envelope", "no_approval_gate"),
        ("demo.gated", "envelope", "no_idempotency_store"),
        ("demo.shadowed", "envelope", "no_shadow_recorder"),
        ("*@rehearsal", "envelope", "no_shadow_recorder"),
    }
    assert count_by_layer(report) == {"registry": 4, "envelope": 3}
    by = {(p.tool, p.kind): p for p in report}
    assert by[("demo.gated", "no_approval_gate")].reason == (
        "tool 'demo.gated' needs approval (effect destructive) but no approval gate is configured "
        "(no state store is configured)")
    assert "needs an idempotency store" in by[("demo.gated", "no_idempotency_store")].reason
    assert "defaults.unknown_tools is deny" in by[("demo.extra", "unknown_tool")].reason
    assert by[("*", "no_shadow_recorder")].as_json() == {
        "tool": "*", "layer": "envelope", "kind": "no_shadow_recorder", "principal": "rehearsal",
        "reason": by[("*", "no_shadow_recorder")].reason,
    }
    # Sorted by tool, each tool's problems in rule order (the refusal gives the first).
    assert [p.tool for p in report] == sorted(p.tool for p in report)


def test_not_offered_only_once_the_upstream_is_learned(revision: Any, registry: ToolRegistry) -> None:
    report = misconfigurations(revision, registry, FULL)
    assert {p.kind for p in report} == {"undeclared_upstream", "fallback_deny"}
    registry.learn("demo", [])  # an upstream that offers nothing: every policy tool is missing
    assert {p.tool for p in misconfigurations(revision, registry, FULL) if p.kind == "not_offered"} == {
        "demo.read", "demo.gated", "demo.nothing", "demo.shadowed", "demo.gone"}


def test_envelope_layer_depends_on_the_runtime(revision: Any, learned: ToolRegistry) -> None:
    def envelope(deps: Dependencies) -> set[tuple[str, str, str]]:
        return {k for k in kinds(misconfigurations(revision, learned, deps)) if k[1] == "envelope"}

    assert envelope(FULL) == set()
    assert envelope(Dependencies("sqlite", approvals_enabled=False, approval_check=True)) == {
        ("demo.gated", "envelope", "no_approval_gate")}
    assert envelope(Dependencies("sqlite", approvals_enabled=True, approval_check=False)) == {
        ("demo.gated", "envelope", "no_approval_gate")}
    # The registry layer does not depend on the runtime.
    registry_layer = {k for k in kinds(misconfigurations(revision, learned, FULL))}
    assert registry_layer == {k for k in kinds(misconfigurations(revision, learned, NO_STORE))
                              if k[1] == "registry"}


def test_dependencies_of_services() -> None:
    assert Dependencies.of(None).store is None
    assert Dependencies.of(Services()).store is None
    deps = Dependencies.of(Services(store=MemoryStore()))
    assert (deps.store, deps.approvals_enabled) == ("memory", True)

    off = Config(approvals=ApprovalsConfig(enabled=False))
    assert Dependencies.of(Services(store=MemoryStore(), settings=off)).approvals_enabled is False
    assert Dependencies.default_runtime().describe() == "sqlite store, approvals enabled"


def test_rules_are_one_ordered_table() -> None:
    assert [r.id for r in TOOL_RULES] == [
        "undeclared_upstream", "not_offered", "fallback_deny",
        "no_approval_gate", "no_idempotency_store", "no_shadow_recorder", "no_rate_store",
    ]
    assert [r.layer for r in TOOL_RULES] == ["registry"] * 3 + ["envelope"] * 4


def test_rate_limits_without_a_store_are_reported_where_they_are_set() -> None:
    revision = build_revision({
        "upstreams": {"demo": {"url": "http://127.0.0.1:9/mcp"}},
        "defaults": {"max_calls_per_run": 500},
        "principals": {"bot": {"rate": "10/min"}, "plain": {}},
        "tools": {"demo.search": {"effect": "read", "rate": "5/min"}, "demo.echo": {"effect": "read"}},
    })
    found = {(p.tool, p.principal, p.kind, p.rule) for p in misconfigurations(revision, ToolRegistry(), NO_STORE)}
    assert found == {
        ("demo.search", None, "no_rate_store", "tools.demo.search"),
        ("*", "bot", "no_rate_store", "principals.bot"),
        ("*", "plain", "no_rate_store", "principals.plain"),  # through defaults
        ("*", "*", "no_rate_store", "defaults"),
    }
    reasons = {p.principal: p.reason for p in misconfigurations(revision, ToolRegistry(), NO_STORE)}
    assert "rate in principals.bot" in reasons["bot"] and "max_calls_per_run in defaults" in reasons["plain"]
    assert misconfigurations(revision, ToolRegistry(), FULL) == []
    assert misconfiguration(revision, "demo.search", Effect.READ) is not None  # the call is refused


@pytest.mark.parametrize("services", [None, Services(), Services(store=MemoryStore())])
def test_check_refuses_with_the_reported_reason(
    revision: Any, learned: ToolRegistry, services: Services | None
) -> None:
    check = CatalogueCheck(revision, learned, services)
    report = misconfigurations(revision, learned, Dependencies.of(services))
    first: dict[str, Misconfiguration] = {}
    for p in report:
        if p.principal is None and p.kind != "unknown_tool":
            first.setdefault(p.tool, p)
    assert "demo.nothing" in first and "demo.gone" in first and "ghost.t" in first
    for key, problem in first.items():
        upstream, tool = key.split(".", 1)
        d = check.decide(make_call(tool, upstream=upstream, info=learned.get(upstream, tool)))
        assert d is not None and d.code is Code.MISCONFIGURED, key
        assert (d.check, d.reason, d.rule) == ("catalogue", problem.reason, f"tools.{key}")
    # A misconfigured tool stays listed; the upstream tool with no policy stays hidden and is
    # refused as unknown_tool (JSON-RPC -32602 at the front).
    for key in first:
        upstream, tool = key.split(".", 1)
        assert visible(revision, learned, "agent", upstream, tool), key
    assert not visible(revision, learned, "agent", "demo", "extra")
    d = check.decide(make_call("extra", info=learned.get("demo", "extra")))
    assert d is not None and d.code is Code.UNKNOWN_TOOL
    assert check.decide(make_call("read", info=learned.get("demo", "read"))) is None
    deps = Dependencies.of(services)
    assert misconfiguration(revision, "demo.nothing", Effect.WRITE, deps, offered=True) == (
        first["demo.nothing"].reason)
    assert misconfiguration(revision, "demo.read", Effect.READ, deps, offered=False) == (
        "tool 'demo.read' is in the policy but upstream 'demo' does not offer it in tools/list")


def test_gated_without_store_vs_with_store(revision: Any, learned: ToolRegistry) -> None:
    call = make_call("gated", info=learned.get("demo", "gated"))
    d = CatalogueCheck(revision, learned, Services()).decide(call)
    assert d is not None and d.reason.endswith("(no state store is configured)")
    d = CatalogueCheck(revision, learned, Services(store=MemoryStore())).decide(call)
    deps = Dependencies.of(Services(store=MemoryStore()))
    if deps.approval_check:  # the approval gate is built: nothing missing for this tool
        assert d is None
    else:
        assert d is not None and d.reason.endswith("(this proxy has no approval check)")


def test_shadow_principal_without_recorder(revision: Any, learned: ToolRegistry) -> None:
    check = CatalogueCheck(revision, learned, Services())
    d = check.decide(make_call("shadowed", principal="plain", info=learned.get("demo", "shadowed")))
    assert d is not None and "tool 'demo.shadowed' is in shadow mode" in d.reason
    doc = {**DOC, "tools": {"demo.read": {"effect": "read"},
                            "demo.w": {"effect": "write", "rules": [{"allow": "true"}]}}}
    rev = build_revision(doc)
    learned = ToolRegistry()  # nothing learned yet: no tool is "not offered"
    check = CatalogueCheck(rev, learned, Services())
    d = check.decide(make_call("w", principal="rehearsal"))
    assert d is not None and d.code is Code.MISCONFIGURED
    assert d.rule == "principals.rehearsal"
    assert d.reason.startswith("principal 'rehearsal' is in shadow mode")
    assert check.decide(make_call("read", principal="rehearsal")) is None  # reads are performed
    assert check.decide(make_call("w", principal="plain")) is None
    assert CatalogueCheck(rev, learned, Services(store=MemoryStore())).decide(
        make_call("w", principal="rehearsal")) is None


def test_sink_logs_each_problem_once_per_load(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    sink = MisconfigSink(metrics)
    a = Misconfiguration("demo.a", "envelope", "no_approval_gate", "needs approval")
    b = Misconfiguration("demo.b", "registry", "not_offered", "not offered")
    caplog.set_level(logging.WARNING, logger="envelope")
    sink.loaded()
    sink.publish([a])
    sink.publish([a])  # a tools/list that changes nothing: no new line
    sink.publish([a, b])  # a tools/list that reveals b: one line for b
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == ("misconfigured tool demo.a [envelope, no_approval_gate]: needs approval; "
                        "calls to it are refused")
    assert "demo.b [registry, not_offered]" in lines[1]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert sink.as_json() == [a.as_json(), b.as_json()]
    body = metrics.render()[0].decode()
    assert 'envelope_misconfigured_tools{layer="registry"} 1.0' in body
    assert 'envelope_misconfigured_tools{layer="envelope"} 1.0' in body
    sink.loaded()  # a new load says it again
    sink.publish([a])
    assert len(caplog.records) == 3
    assert 'envelope_misconfigured_tools{layer="registry"} 0.0' in metrics.render()[0].decode()


def test_envelope_publishes_at_install_and_on_tools_list(tmp_path: Path, revision: Any,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="envelope")
    registry = ToolRegistry()
    envelope = Envelope(AuditLog(tmp_path), Metrics(), registry, Services())
    envelope.install(revision)
    before = {p.kind for p in envelope.misconfig.current}
    assert "not_offered" not in before and "unknown_tool" not in before
    logged = len(caplog.records)
    assert logged == len(envelope.misconfig.current)
    registry.learn("demo", OFFERED)
    envelope.refresh_catalogue_metrics()
    kinds_now = {p.kind for p in envelope.misconfig.current}
    assert {"not_offered", "unknown_tool"} <= kinds_now
    assert len(caplog.records) == logged + 2  # demo.gone and demo.extra, once each
    envelope.refresh_catalogue_metrics()
    assert len(caplog.records) == logged + 2
    assert envelope.chain is not None
    assert envelope.misconfig.current == tuple(envelope.chain.misconfigured())


def test_a_reload_makes_the_report_where_it_builds_the_chain(
        tmp_path: Path, revision: Any, learned: ToolRegistry,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A hot reload builds the chain in a worker thread; the install on the event loop publishes
    # the report made there (1,000 tools: 4-17 ms on the loop otherwise).
    envelope = Envelope(AuditLog(tmp_path), Metrics(), learned, Services())
    threads: list[str] = []
    made = catalogue.misconfigurations

    def counted(*args: Any) -> list[Misconfiguration]:
        threads.append(threading.current_thread().name)
        return made(*args)

    monkeypatch.setattr(catalogue, "misconfigurations", counted)
    built: list[Any] = []
    worker = threading.Thread(target=lambda: built.append(envelope.build(revision)), name="reload")
    worker.start()
    worker.join()
    envelope.install(revision, built[0])
    assert threads == ["reload"]
    assert {"not_offered", "unknown_tool"} <= {p.kind for p in envelope.misconfig.current}


def test_a_tools_list_learned_between_build_and_install_is_in_the_report(
        tmp_path: Path, revision: Any) -> None:
    registry = ToolRegistry()
    envelope = Envelope(AuditLog(tmp_path), Metrics(), registry, Services())
    chain = envelope.build(revision)
    registry.learn("demo", OFFERED)  # the loop learns a tools/list while the reload builds
    envelope.install(revision, chain)
    assert {"not_offered", "unknown_tool"} <= {p.kind for p in envelope.misconfig.current}
    assert envelope.misconfig.current == tuple(catalogue.misconfigurations(
        revision, registry, chain.dependencies))


def test_a_registry_changed_under_the_reload_thread_does_not_fail_the_reload(
        tmp_path: Path, revision: Any, learned: ToolRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    # Reading the registry while the loop learns a tools/list can raise "dictionary changed size
    # during iteration" in the reload thread: the chain is still built, the report made at install.
    envelope = Envelope(AuditLog(tmp_path), Metrics(), learned, Services())
    made = catalogue.misconfigurations
    calls: list[int] = []

    def racing(*args: Any) -> list[Misconfiguration]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return made(*args)

    monkeypatch.setattr(catalogue, "misconfigurations", racing)
    chain = envelope.build(revision)
    envelope.install(revision, chain)
    assert len(calls) == 2
    assert {"not_offered", "unknown_tool"} <= {p.kind for p in envelope.misconfig.current}
