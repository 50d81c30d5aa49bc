"""Capability check: a read-only principal or call cannot call tools whose effect is not read,
and a principal's Rule-of-Two profile takes dangerous properties away.

The principal's capability is its policy's `capability`, else `defaults.capability`. A call may
narrow it (never widen it) with `X-Envelope-Capability: read-only`; any other value of the header
changes nothing. The Rule-of-Two profile (`principals.<id>.rule_of_two`) then applies:

- `external_side_effects: false` forces the read-only floor (whatever `capability` says);
- `sensitive_data: false` refuses tools whose output sensitivity is `secret`
  (`tools.<key>.sensitivity`, absent: public);
- `untrusted_input: false` refuses tools whose output is untrusted (`tools.<key>.output`;
  absent: untrusted unless the upstream's trusted annotations say `openWorldHint: false`).

The last two apply to content reads too (`resources/read`, `prompts/get`: `decide_read`, with
the labels of the policy's `resources:` / `prompts:` entry): a profile's leg is not reached by
reading a resource instead of calling a tool.

The read-only rule also hides writer tools from `tools/list` (see
`proxy.envelope.checks.catalogue.visible`, which asks `principal_read_only_rule`).
"""

from __future__ import annotations

from typing import ClassVar

from proxy.envelope.labels import Label
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, ToolInfo, deny
from proxy.policy.compiled import CompiledTool, PolicyRevision
from proxy.policy.model import RuleOfTwo
from proxy.policy.vocab import Effect

READ_ONLY_HEADER = "X-Envelope-Capability"


def narrows(requested: str | None) -> bool:
    """Whether `X-Envelope-Capability` (every value, comma-separated when given more than once)
    asks for read-only: one `read-only` among them narrows, whatever the others say."""
    return "read-only" in {v.strip().lower() for v in (requested or "").split(",")}


def principal_read_only_rule(revision: PolicyRevision, principal_id: str) -> str | None:
    """The policy rule that makes the principal read-only, or None (read-write).

    `principals.<id>.rule_of_two` with `external_side_effects: false` forces read-only whatever
    `capability` says; then the principal's `capability`; then `defaults.capability`.
    """
    principal = revision.principals.get(principal_id)
    policy = principal.policy if principal is not None else None
    profile = getattr(policy, "rule_of_two", None)
    if profile is not None and not profile.external_side_effects:
        return f"principals.{principal_id}.rule_of_two.external_side_effects"
    capability = policy.capability if policy is not None else None
    if capability == "read-only":
        return f"principals.{principal_id}.capability"
    if capability is None and revision.document.defaults.capability == "read-only":
        return "defaults.capability"
    return None


def tool_sensitivity(compiled: CompiledTool | None) -> str:
    """`secret` or `public` (the data-flow model's `sensitivity` label; absent: public)."""
    if compiled is None:
        return "public"
    return str(getattr(compiled.policy, "sensitivity", None) or "public")


def tool_output_untrusted(compiled: CompiledTool | None, info: ToolInfo | None, trusted_upstream: bool) -> bool:
    """Whether the tool's output is untrusted: the policy's `output` label, else the upstream's
    annotations when the upstream is trusted (`openWorldHint: false` -> trusted), else
    untrusted (the safe default)."""
    label = compiled.policy.output if compiled is not None else None
    if label is not None:
        return label == "untrusted"
    if trusted_upstream and info is not None:
        return info.annotations.get("openWorldHint", True) is not False
    return True


class CapabilityCheck:
    """Refuses `capability_blocked` when a read-only principal or call calls a non-read tool, or
    when the principal's Rule-of-Two profile takes away what the tool would bring."""

    id: ClassVar[str] = "capability"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._revision = revision
        # principal id -> the rule that makes it read-only; absent: read-write.
        self._read_only: dict[str, str] = {}
        # principal id -> its Rule-of-Two profile, when it takes something away.
        self._profiles: dict[str, RuleOfTwo] = {}
        for pid, principal in revision.principals.items():
            rule = principal_read_only_rule(revision, pid)
            if rule is not None:
                self._read_only[pid] = rule
            profile = getattr(principal.policy, "rule_of_two", None)
            if profile is not None and not (profile.sensitive_data and profile.untrusted_input):
                self._profiles[pid] = profile
        self._listed = frozenset(revision.principals)
        self._default_rule = (
            "defaults.capability" if revision.document.defaults.capability == "read-only" else None
        )
        self._trusted = frozenset(
            name for name, up in revision.document.upstreams.items() if up.trust_annotations
        )

    def decide(self, call: ToolCall) -> Decision | None:
        """Refuse a non-read effect for a read-only principal or call (a missing effect counts as
        the safe default, destructive), then apply the Rule-of-Two profile."""
        pid = call.principal.id
        rule = self._read_only.get(pid) if pid in self._listed else self._default_rule
        narrowed = False
        if rule is None and narrows(call.capability_requested):
            rule, narrowed = f"request:{READ_ONLY_HEADER}", True
        effect = call.effect or Effect.DESTRUCTIVE
        if rule is not None and effect is not Effect.READ:
            who = (f"this call is narrowed to read-only by {READ_ONLY_HEADER}" if narrowed
                   else f"principal '{pid}' is read-only")
            if rule.endswith(".rule_of_two.external_side_effects"):
                who = f"principal '{pid}' is read-only (its Rule-of-Two profile denies external side effects)"
            return deny(
                Code.CAPABILITY_BLOCKED,
                self.id,
                f"{who} and tool '{call.qualified_name}' has effect {effect.value}",
                rule,
            )
        profile = self._profiles.get(pid)
        if profile is None:
            return None
        compiled = self._revision.tools.get(call.qualified_name)
        label = Label(untrusted=tool_output_untrusted(compiled, call.upstream_tool, call.upstream in self._trusted),
                      secret=tool_sensitivity(compiled) == "secret")
        return self._rule_of_two(pid, profile, label, f"tool '{call.qualified_name}'", "output")

    def decide_read(self, call: ToolCall, label: Label) -> Decision | None:
        """Refuse a content read (`resources/read`, `prompts/get`) whose content carries `label`
        when the principal's Rule-of-Two profile takes that property away; else None."""
        profile = self._profiles.get(call.principal.id)
        if profile is None:
            return None
        return self._rule_of_two(call.principal.id, profile, label, f"this {call.request.method}", "content")

    def _rule_of_two(self, pid: str, profile: RuleOfTwo, label: Label, subject: str, noun: str) -> Decision | None:
        """The refusal of `subject` (a tool call, a content read), which returns `noun` labelled
        `label`, when principal `pid`'s Rule-of-Two `profile` takes away a property that label
        brings (sensitive data first); else None. The rule is the profile's field."""
        if not profile.sensitive_data and label.secret:
            leg, may_not, kind = "sensitive_data", "handle sensitive data", "secret"
        elif not profile.untrusted_input and label.untrusted:
            leg, may_not, kind = "untrusted_input", "take untrusted input", "untrusted"
        else:
            return None
        return deny(Code.CAPABILITY_BLOCKED, self.id,
                    f"principal '{pid}' may not {may_not} (Rule of Two) and {subject} returns {kind} {noun}",
                    f"principals.{pid}.rule_of_two.{leg}")
