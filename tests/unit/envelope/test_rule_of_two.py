"""Capability narrowing by header and Rule-of-Two profiles (capability check, tools/list, check CLI)."""

from __future__ import annotations

from typing import Any

import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.envelope.checks.capability import CapabilityCheck
from proxy.envelope.checks.catalogue import visible
from proxy.envelope.labels import Label
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, RequestInfo, ToolCall, ToolInfo, Verdict
from proxy.policy.model import PolicyDocument
from proxy.policy.vocab import Effect

TOOLS = {
    "demo.echo": {"effect": "read", "output": "trusted"},
    "demo.fetch": {"effect": "read"},  # output: untrusted by default
    "demo.vault": {"effect": "read", "output": "trusted"},
    "demo.write_note": {"effect": "write", "output": "trusted"},
}


def _rev(principals: dict[str, Any], **defaults: Any) -> Any:
    doc = {"upstreams": UPSTREAMS, "tools": TOOLS, "principals": principals}
    if defaults:
        doc["defaults"] = defaults
    return build_revision(doc)


def _call(tool: str, principal: str = "agent", capability: str | None = None) -> ToolCall:
    call = make_call(tool, principal=principal)
    call.effect = Effect.WRITE if tool == "write_note" else Effect.READ
    call.capability_requested = capability
    return call


def test_header_narrows_read_write_to_read_only() -> None:
    check = CapabilityCheck(_rev({"agent": {}}), ToolRegistry())
    assert check.decide(_call("write_note")) is None
    d = check.decide(_call("write_note", capability="read-only"))
    assert d is not None and (d.verdict, d.code, d.rule) == (
        Verdict.DENY, Code.CAPABILITY_BLOCKED, "request:X-Envelope-Capability")
    assert "narrowed to read-only" in d.reason
    assert check.decide(_call("echo", capability="read-only")) is None
    assert check.decide(_call("write_note", capability=" Read-Only ")) is not None


@pytest.mark.parametrize("asked", ["read-write", "admin", "", None])
def test_header_never_widens(asked: str | None) -> None:
    check = CapabilityCheck(_rev({"agent": {"capability": "read-only"}}), ToolRegistry())
    d = check.decide(_call("write_note", capability=asked))
    assert d is not None and d.rule == "principals.agent.capability"
    # Unlisted principals under a read-only default too.
    check = CapabilityCheck(_rev({}, capability="read-only"), ToolRegistry())
    d = check.decide(_call("write_note", principal="nobody", capability=asked))
    assert d is not None and d.rule == "defaults.capability"


def test_denying_external_side_effects_forces_read_only_and_hides_writers() -> None:
    rev = _rev({"agent": {"capability": "read-write",
                          "rule_of_two": {"external_side_effects": False}}})
    check = CapabilityCheck(rev, ToolRegistry())
    d = check.decide(_call("write_note"))
    assert d is not None and d.code is Code.CAPABILITY_BLOCKED
    assert d.rule == "principals.agent.rule_of_two.external_side_effects"
    assert "Rule-of-Two" in d.reason
    assert check.decide(_call("echo")) is None
    assert not visible(rev, ToolRegistry(), "agent", "demo", "write_note")
    assert visible(rev, ToolRegistry(), "agent", "demo", "echo")


def test_denying_sensitive_data_refuses_secret_output() -> None:
    tools = {**TOOLS, "demo.vault": {"effect": "read", "output": "trusted", "sensitivity": "secret"}}
    try:
        doc = {"upstreams": UPSTREAMS, "tools": tools,
               "principals": {"agent": {"rule_of_two": {"sensitive_data": False}}}}
        PolicyDocument.model_validate(doc)
    except Exception:
        pytest.skip("ToolPolicy.sensitivity is not in the policy model yet (data-flow issue)")
    check = CapabilityCheck(build_revision(doc), ToolRegistry())
    d = check.decide(_call("vault"))
    assert d is not None and d.code is Code.CAPABILITY_BLOCKED
    assert d.rule == "principals.agent.rule_of_two.sensitive_data" and "secret" in d.reason
    assert check.decide(_call("echo")) is None


def test_denying_untrusted_input_refuses_untrusted_output() -> None:
    check = CapabilityCheck(_rev({"agent": {"rule_of_two": {"untrusted_input": False}}}), ToolRegistry())
    call = _call("fetch")
    d = check.decide(call)
    assert d is not None and d.rule == "principals.agent.rule_of_two.untrusted_input"
    assert check.decide(_call("echo")) is None  # output: trusted
    # Annotations of an untrusted upstream never make output trusted.
    call = _call("fetch")
    call.upstream_tool = ToolInfo("fetch", annotations={"openWorldHint": False})
    assert check.decide(call) is not None


def test_profile_model_defaults() -> None:
    doc = PolicyDocument.model_validate({"principals": {"a": {"rule_of_two": {}}}})
    profile = doc.principals["a"].rule_of_two
    assert profile is not None and profile.holds_all
    assert doc.defaults.max_depth == 2
    assert doc.principals["a"].propagate_taint is True


@pytest.mark.parametrize(("profile", "label", "leg", "returns"), [
    ({"untrusted_input": False}, Label(untrusted=True, secret=False), "untrusted_input", "untrusted"),
    ({"sensitive_data": False}, Label(untrusted=False, secret=True), "sensitive_data", "secret"),
    # Both legs taken away, both brought: sensitive data is named first, for a call and a read.
    ({"untrusted_input": False, "sensitive_data": False}, Label(untrusted=True, secret=True),
     "sensitive_data", "secret"),
])
def test_a_call_and_a_content_read_are_refused_alike_by_a_rule_of_two_profile(
        profile: dict[str, bool], label: Label, leg: str, returns: str) -> None:
    """One refusal for both (the rule the profile's field, the reason naming the principal,
    what it may not do and what brings it); only what is being done differs."""
    tools = {**TOOLS, "demo.vault": {"effect": "read", "output": "untrusted" if label.untrusted else "trusted",
                                     "sensitivity": "secret" if label.secret else "public"}}
    rev = build_revision({"upstreams": UPSTREAMS, "tools": tools, "principals": {"agent": {"rule_of_two": profile}}})
    check = CapabilityCheck(rev, ToolRegistry())
    may_not = {"untrusted_input": "take untrusted input", "sensitive_data": "handle sensitive data"}[leg]
    by_call = check.decide(_call("vault"))
    read = _call("vault")
    read.request = RequestInfo("resources/read")
    by_read = check.decide_read(read, label)
    for decision, doing in ((by_call, f"tool 'demo.vault' returns {returns} output"),
                            (by_read, f"this resources/read returns {returns} content")):
        assert decision is not None and decision.code is Code.CAPABILITY_BLOCKED and decision.check == "capability"
        assert decision.rule == f"principals.agent.rule_of_two.{leg}"
        assert decision.reason == f"principal 'agent' may not {may_not} (Rule of Two) and {doing}"
    assert check.decide_read(read, Label(untrusted=False, secret=False)) is None
