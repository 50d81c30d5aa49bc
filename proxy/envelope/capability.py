"""Capability check: a read-only principal cannot call tools whose effect is not read.

The principal's capability is its policy's `capability`, else `defaults.capability`. The same
rule hides writer tools from `tools/list` (see `proxy.envelope.catalogue.visible`).
"""

from __future__ import annotations

from typing import ClassVar

from proxy.envelope.call import Code, Decision, Effect, Services, ToolCall, deny
from proxy.envelope.tools import ToolRegistry
from proxy.policy.compiled import PolicyRevision


class CapabilityCheck:
    """Refuses `capability_blocked` when a read-only principal calls a non-read tool."""

    id: ClassVar[str] = "capability"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        default_read_only = revision.document.defaults.capability == "read-only"
        # principal id -> the rule that makes it read-only; absent: read-write.
        self._read_only: dict[str, str] = {}
        for pid, principal in revision.principals.items():
            capability = principal.policy.capability
            if capability == "read-only":
                self._read_only[pid] = f"principals.{pid}.capability"
            elif capability is None and default_read_only:
                self._read_only[pid] = "defaults.capability"
        self._listed = frozenset(revision.principals)
        self._default_rule = "defaults.capability" if default_read_only else None

    def decide(self, call: ToolCall) -> Decision | None:
        """Refuse a non-read effect for a read-only principal. A missing effect counts as the safe
        default (destructive)."""
        pid = call.principal.id
        rule = self._read_only.get(pid) if pid in self._listed else self._default_rule
        if rule is None:
            return None
        effect = call.effect or Effect.DESTRUCTIVE
        if effect is Effect.READ:
            return None
        return deny(
            Code.CAPABILITY_BLOCKED,
            self.id,
            f"principal '{pid}' is read-only and tool '{call.qualified_name}' has effect {effect.value}",
            rule,
        )
