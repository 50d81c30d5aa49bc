"""Authorization check: CEL `allow` expressions of the tool and of the principal.

A level with expressions authorizes when any of them is true; an expression that errors counts
as false. Both levels must authorize. A level without expressions sets no condition.
"""

from __future__ import annotations

from typing import ClassVar

from proxy.envelope.celvars import activation, referenced
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, deny
from proxy.errors import CelEvalError
from proxy.policy.compiled import PolicyRevision, Program


def _any_true(program: Program, act: object) -> bool:
    """One level's verdict: any expression true authorizes; errors count as false."""
    try:
        return program.evaluate(act)
    except CelEvalError:
        return False


class AuthzCheck:
    """Refuses `unauthorized` when the tool's or the principal's `allow` expressions all fail."""

    id: ClassVar[str] = "authz"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._engine = revision.cel
        self._names = referenced(revision)
        # Each level's expressions as one `a || b || ...` program: one engine call per level.
        engine = self._engine
        self._tools = {
            key: engine.compile_any([p.source for p in t.allow])
            for key, t in revision.tools.items() if t.allow
        }
        self._principals = {
            pid: engine.compile_any([p.source for p in pr.allow])
            for pid, pr in revision.principals.items() if pr.allow
        }

    def _refuse(self, call: ToolCall, rule: str) -> Decision:
        return deny(
            Code.UNAUTHORIZED,
            self.id,
            f"principal '{call.principal.id}' is not authorized to call '{call.qualified_name}'",
            rule,
        )

    def decide(self, call: ToolCall) -> Decision | None:
        """Continue when every level with expressions has one true; refuse otherwise (fail
        closed: variables that cannot be converted refuse)."""
        key = call.qualified_name
        tool_allow = self._tools.get(key)
        principal_allow = self._principals.get(call.principal.id)
        if tool_allow is None and principal_allow is None:
            return None
        try:
            act = activation(call, self._engine, self._names)
        except CelEvalError:
            rule = (
                "tools." + key + ".allow"
                if tool_allow
                else "principals." + call.principal.id + ".allow"
            )
            return self._refuse(call, rule)
        if tool_allow is not None and not _any_true(tool_allow, act):
            return self._refuse(call, f"tools.{key}.allow")
        if principal_allow is not None and not _any_true(principal_allow, act):
            return self._refuse(call, f"principals.{call.principal.id}.allow")
        return None
