"""Argument rules check: forbid rules, then allow rules, then the tool's fallback.

Every forbid rule is evaluated first: one that matches, or errors, refuses (fail closed). Then
the allow rules in file order: the first true one allows; one that errors does not match. Then
`fallback`: deny refuses, allow continues.
"""

from __future__ import annotations

from typing import ClassVar

from proxy.envelope.call import Code, Decision, ToolCall, deny
from proxy.envelope.celvars import activation
from proxy.envelope.tools import ToolRegistry
from proxy.errors import CelEvalError
from proxy.policy.cel import get_engine
from proxy.policy.compiled import CompiledRule, PolicyRevision

MAX_ERROR = 200


class _Plan:
    __slots__ = ("allows", "fallback_reason", "fallback_rule", "forbids")

    def __init__(
        self,
        forbids: tuple[CompiledRule, ...],
        allows: tuple[CompiledRule, ...],
        fallback_reason: str | None,
        fallback_rule: str,
    ):
        self.forbids = forbids
        self.allows = allows
        self.fallback_reason = fallback_reason  # None: fallback allow
        self.fallback_rule = fallback_rule


def _clip(text: str) -> str:
    text = text.split("\n", 1)[0]
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."


class ArgRulesCheck:
    """Refuses `capability_blocked` with the deciding rule's id and reason."""

    id: ClassVar[str] = "arg_rules"

    def __init__(self, revision: PolicyRevision, registry: ToolRegistry):
        self._engine = get_engine(revision.engine)
        # Only tools that can refuse here: those with rules or a deny fallback.
        self._plans: dict[str, _Plan] = {}
        for key, tool in revision.tools.items():
            forbids = tuple(r for r in tool.rules if r.kind == "forbid")
            allows = tuple(r for r in tool.rules if r.kind == "allow")
            fallback_reason = None
            if tool.fallback == "deny":
                fallback_reason = (
                    getattr(tool.policy, "fallback_reason", None) or "no rule allows this call"
                )
            if forbids or allows or fallback_reason is not None:
                self._plans[key] = _Plan(forbids, allows, fallback_reason, f"{key}#fallback")

    def _blocked(self, rule: str, reason: str) -> Decision:
        return deny(Code.CAPABILITY_BLOCKED, self.id, reason, rule)

    def decide(self, call: ToolCall) -> Decision | None:
        """Apply the tool's rules; refuse on a matching or erroring forbid, or a deny fallback."""
        plan = self._plans.get(call.qualified_name)
        if plan is None:
            return None
        if plan.forbids or plan.allows:
            try:
                act = activation(call, self._engine)
            except CelEvalError as exc:
                if plan.forbids:
                    rule = plan.forbids[0]
                    return self._blocked(rule.id, f"{rule.reason} (rule error: {_clip(str(exc))})")
                act = None
            if act is not None:
                for rule in plan.forbids:
                    try:
                        matched = rule.program.evaluate(act)
                    except CelEvalError as exc:
                        return self._blocked(
                            rule.id, f"{rule.reason} (rule error: {_clip(str(exc))})"
                        )
                    if matched:
                        return self._blocked(rule.id, rule.reason)
                for rule in plan.allows:
                    try:
                        if rule.program.evaluate(act):
                            return None
                    except CelEvalError:
                        continue
        if plan.fallback_reason is not None:
            return self._blocked(plan.fallback_rule, plan.fallback_reason)
        return None
