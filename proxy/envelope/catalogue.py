"""Catalogue check: the tool is known to policy and its policy can ever let it run.

Refuses `unknown_tool` (no `tools:` entry while `defaults.unknown_tools` is deny) and
`misconfigured` (a tool no call could ever pass: gated with no approval gate, fallback deny with
no allow rule, or an undeclared upstream). Sets `call.effect` for every later check.

`misconfiguration`, `misconfigured_tools` and `visible` are the same decisions for the front's
`tools/list` filter and the admin misconfiguration report, so what is hidden and what is refused
never disagree.
"""

from __future__ import annotations

from typing import ClassVar

from proxy.envelope.call import Code, Decision, Effect, Services, ToolCall, deny
from proxy.envelope.tools import ToolRegistry, effective_effect
from proxy.policy.compiled import PolicyRevision


def _upstream_of(key: str) -> str:
    return key.split(".", 1)[0]


def _trusts(revision: PolicyRevision, upstream: str) -> bool:
    declared = revision.document.upstreams.get(upstream)
    return bool(declared is not None and declared.trust_annotations)


def misconfiguration(revision: PolicyRevision, key: str, effect: Effect) -> str | None:
    """Why no call of tool `key` (with its effective `effect`) can ever run; None when one can.

    Gating: a tool whose policy has an `approval` block is gated exactly when
    `approval.required` is true; otherwise when its effect is in `defaults.gated_effects`. The
    approval gate does not exist yet, so a gated tool is misconfigured.
    """
    compiled = revision.tools.get(key)
    approval = compiled.policy.approval if compiled is not None else None
    gated = (
        approval.required
        if approval is not None
        else effect in revision.document.defaults.gated_effects
    )
    if gated:
        return (
            f"tool '{key}' needs approval (effect {effect.value}) "
            "but no approval gate is configured"
        )
    if compiled is not None and compiled.fallback == "deny":
        if not any(rule.kind == "allow" for rule in compiled.rules):
            return f"tool '{key}' has fallback deny and no allow rule, so no call can ever run"
    upstream = _upstream_of(key)
    if upstream not in revision.document.upstreams:
        return f"tool '{key}' names upstream '{upstream}', which is not declared under upstreams"
    return None


def _effect_of(
    revision: PolicyRevision, registry: ToolRegistry, upstream: str, tool: str
) -> Effect:
    compiled = revision.tools.get(f"{upstream}.{tool}")
    policy_effect = compiled.policy.effect if compiled is not None else None
    return effective_effect(
        policy_effect, registry.get(upstream, tool), _trusts(revision, upstream)
    )


def misconfigured_tools(revision: PolicyRevision, registry: ToolRegistry) -> dict[str, str]:
    """Every misconfigured tool key to its reason: all policy tools, plus every learned tool
    when `defaults.unknown_tools` is allow (those run on the defaults and can be misconfigured
    too)."""
    report: dict[str, str] = {}
    for key, compiled in revision.tools.items():
        effect = _effect_of(revision, registry, compiled.upstream, compiled.name)
        reason = misconfiguration(revision, key, effect)
        if reason is not None:
            report[key] = reason
    if revision.document.defaults.unknown_tools == "allow":
        for upstream in registry.upstreams():
            for info in registry.tools(upstream):
                key = f"{upstream}.{info.name}"
                if key in revision.tools:
                    continue
                reason = misconfiguration(
                    revision, key, _effect_of(revision, registry, upstream, info.name)
                )
                if reason is not None:
                    report[key] = reason
    return dict(sorted(report.items()))


def _read_only(revision: PolicyRevision, principal_id: str) -> bool:
    principal = revision.principals.get(principal_id)
    capability = principal.policy.capability if principal is not None else None
    return (capability or revision.document.defaults.capability) == "read-only"


def visible(
    revision: PolicyRevision, registry: ToolRegistry, principal_id: str, upstream: str, tool: str
) -> bool:
    """Whether `tools/list` shows this tool to this principal.

    Hidden when the catalogue would refuse it (unknown or misconfigured) or when the principal is
    read-only and the tool's effect is not read. CEL conditions (authz, rules) do not hide a tool:
    they depend on arguments.
    """
    key = f"{upstream}.{tool}"
    if key not in revision.tools and revision.document.defaults.unknown_tools == "deny":
        return False
    effect = _effect_of(revision, registry, upstream, tool)
    if misconfiguration(revision, key, effect) is not None:
        return False
    return not (effect is not Effect.READ and _read_only(revision, principal_id))


class CatalogueCheck:
    """First check: resolve the tool's policy and effective effect, refuse what can never run."""

    id: ClassVar[str] = "catalogue"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._revision = revision
        self._tools = revision.tools
        self._deny_unknown = revision.document.defaults.unknown_tools == "deny"
        self._trusted = frozenset(
            name for name, up in revision.document.upstreams.items() if up.trust_annotations
        )
        # (key, effect) -> reason or None. Misconfiguration depends only on the revision, the key
        # and the effect; keys are bounded by the policy catalogue (unknown keys are not cached).
        self._misconfigured: dict[tuple[str, Effect], str | None] = {}

    def decide(self, call: ToolCall) -> Decision | None:
        """Refuse unknown or misconfigured tools; otherwise set `call.effect` and continue."""
        key = call.qualified_name
        compiled = self._tools.get(key)
        if compiled is None and self._deny_unknown:
            return deny(
                Code.UNKNOWN_TOOL,
                self.id,
                f"tool '{key}' is not in the policy catalogue",
                "defaults.unknown_tools",
            )
        effect = effective_effect(
            compiled.policy.effect if compiled is not None else None,
            call.upstream_tool,
            call.upstream in self._trusted,
        )
        call.effect = effect
        if compiled is not None:
            cache_key = (key, effect)
            try:
                reason = self._misconfigured[cache_key]
            except KeyError:
                reason = self._misconfigured[cache_key] = misconfiguration(
                    self._revision, key, effect
                )
        else:
            reason = misconfiguration(self._revision, key, effect)
        if reason is not None:
            return deny(Code.MISCONFIGURED, self.id, reason, f"tools.{key}")
        return None
