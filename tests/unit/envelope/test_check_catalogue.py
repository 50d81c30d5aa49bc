"""Catalogue check, misconfiguration report, tools/list visibility, capability check."""

from __future__ import annotations

from typing import Any

import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.envelope.checks.capability import CapabilityCheck
from proxy.envelope.checks.catalogue import (
    CatalogueCheck,
    misconfiguration,
    misconfigured_tools,
    visible,
)
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, ToolInfo
from proxy.policy.vocab import Effect


def doc(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"upstreams": UPSTREAMS, "defaults": {"unknown_tools": "deny"}}
    base.update(kw)
    return base


def test_unknown_tool_denied(registry: ToolRegistry) -> None:
    rev = build_revision(doc(tools={"demo.echo": {"effect": "read"}}))
    d = CatalogueCheck(rev, registry).decide(make_call("delete_all"))
    assert d is not None and d.code is Code.UNKNOWN_TOOL
    assert d.check == "catalogue"
    assert d.reason == "tool 'demo.delete_all' is not in the policy catalogue"
    assert d.rule == "defaults.unknown_tools"


def test_known_tool_sets_policy_effect(registry: ToolRegistry) -> None:
    rev = build_revision(doc(tools={"demo.echo": {"effect": "read"}}))
    call = make_call("echo")
    assert CatalogueCheck(rev, registry).decide(call) is None
    assert call.effect is Effect.READ


def test_unknown_allowed_gets_safe_default_and_is_gated(registry: ToolRegistry) -> None:
    rev = build_revision(doc(defaults={"unknown_tools": "allow"}))
    call = make_call("mystery")
    d = CatalogueCheck(rev, registry).decide(call)
    assert call.effect is Effect.DESTRUCTIVE
    assert d is not None and d.code is Code.MISCONFIGURED
    assert "needs approval (effect destructive) but no approval gate is configured" in d.reason


def test_unknown_allowed_runs_when_not_gated(registry: ToolRegistry) -> None:
    rev = build_revision(doc(defaults={"unknown_tools": "allow", "gated_effects": []}))
    call = make_call("mystery")
    assert CatalogueCheck(rev, registry).decide(call) is None
    assert call.effect is Effect.DESTRUCTIVE


ANN_READ = {"readOnlyHint": True}
ANN_WRITE_CLOSED = {"readOnlyHint": False, "destructiveHint": False, "openWorldHint": False}
ANN_EXTERNAL = {"destructiveHint": False}


@pytest.mark.parametrize(
    ("trusted", "annotations", "expected"),
    [
        (True, ANN_READ, Effect.READ),
        (True, ANN_WRITE_CLOSED, Effect.WRITE),
        (True, ANN_EXTERNAL, Effect.EXTERNAL),
        (True, {}, Effect.DESTRUCTIVE),
        (False, ANN_READ, Effect.DESTRUCTIVE),
        (False, ANN_WRITE_CLOSED, Effect.DESTRUCTIVE),
    ],
)
def test_annotations_only_count_when_trusted(
    registry: ToolRegistry, trusted: bool, annotations: dict[str, Any], expected: Effect
) -> None:
    upstreams = {"demo": {"url": "http://127.0.0.1:9/mcp", "trust_annotations": trusted}}
    rev = build_revision(
        doc(upstreams=upstreams, defaults={"gated_effects": []}, tools={"demo.t": {}})
    )
    call = make_call("t", info=ToolInfo("t", None, annotations))
    assert CatalogueCheck(rev, registry).decide(call) is None
    assert call.effect is expected


def test_policy_effect_beats_trusted_annotations(registry: ToolRegistry) -> None:
    upstreams = {"demo": {"url": "http://127.0.0.1:9/mcp", "trust_annotations": True}}
    rev = build_revision(doc(upstreams=upstreams, tools={"demo.t": {"effect": "write"}}))
    call = make_call("t", info=ToolInfo("t", None, ANN_READ))
    assert CatalogueCheck(rev, registry).decide(call) is None
    assert call.effect is Effect.WRITE


@pytest.mark.parametrize(
    ("tool_policy", "fragment"),
    [
        ({"effect": "external"}, "needs approval (effect external) but no approval gate"),
        ({"effect": "destructive"}, "needs approval (effect destructive)"),
        ({}, "needs approval (effect destructive)"),  # undeclared effect: safe default
        ({"effect": "read", "approval": {"required": True}}, "needs approval (effect read)"),
        (
            {"effect": "write", "fallback": "deny"},
            "has fallback deny and no allow rule, so no call can ever run",
        ),
        (
            {"effect": "write", "rules": [{"forbid": "args.x == 1"}], "fallback": "deny"},
            "has fallback deny and no allow rule",
        ),
    ],
)
def test_misconfigured(registry: ToolRegistry, tool_policy: dict[str, Any], fragment: str) -> None:
    rev = build_revision(doc(tools={"demo.t": tool_policy}))
    d = CatalogueCheck(rev, registry).decide(make_call("t"))
    assert d is not None and d.code is Code.MISCONFIGURED
    assert d.reason.startswith("tool 'demo.t' ")
    assert fragment in d.reason
    assert d.rule == "tools.demo.t"


def test_misconfigured_undeclared_upstream(registry: ToolRegistry) -> None:
    rev = build_revision(doc(tools={"other.t": {"effect": "read"}}))
    d = CatalogueCheck(rev, registry).decide(make_call("t", upstream="other"))
    assert d is not None and d.code is Code.MISCONFIGURED
    assert d.reason == (
        "tool 'other.t' names upstream 'other', which is not declared under upstreams"
    )


def test_not_misconfigured(registry: ToolRegistry) -> None:
    rev = build_revision(
        doc(
            tools={
                "demo.r": {"effect": "read"},
                "demo.w": {"effect": "write", "rules": [{"allow": "true"}]},
                # An explicit approval block decides gating for the tool.
                "demo.x": {"effect": "external", "approval": {"required": False}},
            }
        )
    )
    check = CatalogueCheck(rev, registry)
    for tool in ("r", "w", "x"):
        assert check.decide(make_call(tool)) is None, tool
    assert misconfiguration(rev, "demo.w", Effect.WRITE) is None
    assert misconfiguration(rev, "demo.w", Effect.EXTERNAL) is not None


def test_misconfigured_tools_report(registry: ToolRegistry) -> None:
    rev = build_revision(
        doc(
            defaults={"unknown_tools": "allow"},
            tools={"demo.r": {"effect": "read"}, "demo.d": {"effect": "destructive"}},
        )
    )
    registry.learn("demo", [{"name": "r"}, {"name": "learned"}])
    registry.learn("ghost", [{"name": "g", "annotations": {"readOnlyHint": True}}])
    report = misconfigured_tools(rev, registry)
    assert set(report) == {"demo.d", "demo.learned", "ghost.g"}
    assert "needs approval" in report["demo.learned"]
    # ghost is not declared: the registry-layer problem comes first.
    assert "which is not declared under upstreams" in report["ghost.g"]


def test_misconfigured_tools_report_ignores_learned_when_unknown_denied(
    registry: ToolRegistry,
) -> None:
    rev = build_revision(doc(tools={"demo.r": {"effect": "read"}}))
    registry.learn("demo", [{"name": "r"}, {"name": "learned"}])
    # Reported (see test_misconfig.py) but refused as unknown_tool, not as misconfigured.
    assert misconfigured_tools(rev, registry) == {}


def test_visible(registry: ToolRegistry) -> None:
    rev = build_revision(
        doc(
            tools={
                "demo.r": {"effect": "read"},
                "demo.w": {"effect": "write"},
                "demo.d": {"effect": "destructive"},
            },
            principals={"reader": {"capability": "read-only"}},
        )
    )
    assert visible(rev, registry, "agent", "demo", "r")
    assert visible(rev, registry, "agent", "demo", "w")
    assert visible(rev, registry, "agent", "demo", "d")  # misconfigured: listed, refused when called
    assert not visible(rev, registry, "agent", "demo", "unknown")  # unknown, deny
    assert visible(rev, registry, "reader", "demo", "r")
    assert not visible(rev, registry, "reader", "demo", "w")  # read-only principal


def test_visible_unknown_allowed_uses_trusted_annotations(registry: ToolRegistry) -> None:
    upstreams = {"demo": {"url": "http://127.0.0.1:9/mcp", "trust_annotations": True}}
    rev = build_revision(doc(upstreams=upstreams, defaults={"unknown_tools": "allow"}))
    registry.learn("demo", [{"name": "ro", "annotations": {"readOnlyHint": True}}, {"name": "rw"}])
    assert visible(rev, registry, "agent", "demo", "ro")
    assert visible(rev, registry, "agent", "demo", "rw")  # gated (misconfigured) but listed
    rev = build_revision(doc(upstreams=upstreams, defaults={"unknown_tools": "allow"},
                             principals={"reader": {"capability": "read-only"}}))
    assert visible(rev, registry, "reader", "demo", "ro")
    assert not visible(rev, registry, "reader", "demo", "rw")  # destructive default


# -- capability --------------------------------------------------------------------------


def _capability_rev(default: str = "read-write") -> Any:
    return build_revision(
        doc(
            defaults={"capability": default, "gated_effects": []},
            tools={"demo.r": {"effect": "read"}, "demo.w": {"effect": "write"}},
            principals={
                "reader": {"capability": "read-only"},
                "writer": {"capability": "read-write"},
                "plain": {},
            },
        )
    )


def _run(rev: Any, registry: ToolRegistry, principal: str, tool: str) -> Any:
    call = make_call(tool, principal=principal)
    assert CatalogueCheck(rev, registry).decide(call) is None
    return CapabilityCheck(rev, registry).decide(call)


def test_read_only_principal_blocked_from_writers(registry: ToolRegistry) -> None:
    rev = _capability_rev()
    d = _run(rev, registry, "reader", "w")
    assert d is not None and d.code is Code.CAPABILITY_BLOCKED and d.check == "capability"
    assert d.reason == "principal 'reader' is read-only and tool 'demo.w' has effect write"
    assert d.rule == "principals.reader.capability"
    assert _run(rev, registry, "reader", "r") is None
    assert _run(rev, registry, "writer", "w") is None
    assert _run(rev, registry, "plain", "w") is None
    assert _run(rev, registry, "stranger", "w") is None


def test_default_read_only(registry: ToolRegistry) -> None:
    rev = _capability_rev("read-only")
    for principal in ("plain", "stranger"):
        d = _run(rev, registry, principal, "w")
        assert d is not None and d.code is Code.CAPABILITY_BLOCKED
        assert d.rule == "defaults.capability"
        assert _run(rev, registry, principal, "r") is None
    assert _run(rev, registry, "writer", "w") is None
