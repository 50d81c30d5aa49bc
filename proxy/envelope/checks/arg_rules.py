"""Argument rules check: forbid rules, then allow rules, then the tool's fallback.

Every forbid rule is evaluated first: one that matches, or errors, refuses (fail closed). Then
the allow rules in file order: the first true one allows; one that errors does not match. Then
`fallback`: deny refuses, allow continues.
"""

from __future__ import annotations

from typing import ClassVar

from proxy.envelope.celvars import activation, referenced
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, deny
from proxy.errors import CelEvalError
from proxy.policy.cel import Engine
from proxy.policy.compiled import CompiledRule, PolicyRevision, Program

MAX_ERROR = 200


class _Plan:
    __slots__ = ("allows", "any_allow", "any_forbid", "fallback_reason", "fallback_rule", "forbids")

    def __init__(
        self,
        engine: Engine,
        forbids: tuple[CompiledRule, ...],
        allows: tuple[CompiledRule, ...],
        fallback_reason: str | None,
        fallback_rule: str,
    ):
        self.forbids = forbids
        self.allows = allows
        self.fallback_reason = fallback_reason  # None: fallback allow
        self.fallback_rule = fallback_rule
        # Each group as one `a || b || ...` program (one engine call instead of one per rule).
        # CEL's `||` gives exactly the rule semantics: false only when no rule matched and none
        # errored. Only a matching or erroring forbid group is re-evaluated rule by rule, to
        # name the deciding rule.
        self.any_forbid = engine.compile_any([r.program.source for r in forbids]) if forbids else None
        self.any_allow = engine.compile_any([r.program.source for r in allows]) if allows else None


def _clip(text: str) -> str:
    text = text.split("\n", 1)[0]
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."


class ArgRulesCheck:
    """Refuses `capability_blocked` with the deciding rule's id and reason."""

    id: ClassVar[str] = "arg_rules"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._engine = revision.cel
        self._names = referenced(revision)
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
                self._plans[key] = _Plan(
                    self._engine, forbids, allows, fallback_reason, f"{key}#fallback"
                )

    def _blocked(self, rule: str, reason: str) -> Decision:
        return deny(Code.CAPABILITY_BLOCKED, self.id, reason, rule)

    def decide(self, call: ToolCall) -> Decision | None:
        """Apply the tool's rules; refuse on a matching or erroring forbid, or a deny fallback."""
        plan = self._plans.get(call.qualified_name)
        if plan is None:
            return None
        if plan.forbids or plan.allows:
            try:
                act = activation(call, self._engine, self._names)
            except CelEvalError as exc:
                if plan.forbids:
                    rule = plan.forbids[0]
                    return self._blocked(rule.id, f"{rule.reason} (rule error: {_clip(str(exc))})")
                act = None
            if act is not None:
                if plan.any_forbid is not None and not self._clear(plan.any_forbid, act):
                    return self._first_forbid(plan, act)
                if plan.any_allow is not None:
                    try:
                        if plan.any_allow.evaluate(act):
                            return None
                    except CelEvalError:
                        pass  # an allow rule that errors does not match
        if plan.fallback_reason is not None:
            return self._blocked(plan.fallback_rule, plan.fallback_reason)
        return None

    @staticmethod
    def _clear(program: Program, act: object) -> bool:
        try:
            return not program.evaluate(act)
        except CelEvalError:
            return False

    def _first_forbid(self, plan: _Plan, act: object) -> Decision:
        """The first forbid rule (file order) that matches or errors; the group said one does."""
        for rule in plan.forbids:
            try:
                matched = rule.program.evaluate(act)
            except CelEvalError as exc:
                return self._blocked(rule.id, f"{rule.reason} (rule error: {_clip(str(exc))})")
            if matched:
                return self._blocked(rule.id, rule.reason)
        # The group and the single rules disagree (cannot happen with CEL's `||`): fail closed.
        rule = plan.forbids[0]
        return self._blocked(rule.id, f"{rule.reason} (forbid rules could not be evaluated singly)")
