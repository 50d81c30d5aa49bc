"""Which calls count as gated: one definition for approval, idempotency and shadow records.

A tool whose policy has an `approval` block is gated exactly when `approval.required` is true;
otherwise when its effective effect is in the principal's `gated_effects` (when its policy sets
them), else in `defaults.gated_effects`. A call whose effect is not known yet counts as the safe
default (destructive).
"""

from __future__ import annotations

from proxy.envelope.types import ToolCall
from proxy.policy.compiled import PolicyRevision
from proxy.policy.vocab import Effect


def gated_effect(revision: PolicyRevision, key: str, effect: Effect | None,
                 principal_id: str | None = None) -> bool:
    """Whether tool `key` with effective `effect`, called by `principal_id`, needs approval."""
    compiled = revision.tools.get(key)
    approval = compiled.policy.approval if compiled is not None else None
    if approval is not None:
        return bool(approval.required)
    gated_effects = revision.document.defaults.gated_effects
    principal = revision.principals.get(principal_id) if principal_id is not None else None
    own = getattr(principal.policy, "gated_effects", None) if principal is not None else None
    if own is not None:
        gated_effects = own
    return (effect or Effect.DESTRUCTIVE) in gated_effects


def needs_approval(revision: PolicyRevision, call: ToolCall) -> bool:
    """Whether `call` waits for a person: gated (`gated`) and its gate not waived by the
    user's intent (`dataflow.waive_gate`, `ToolCall.gate_waived`)."""
    return not call.gate_waived and gated(revision, call)


def gated(revision: PolicyRevision, call: ToolCall) -> bool:
    """Whether `call` has a gated effect, or a check escalated it (needs approval and
    idempotency)."""
    if call.escalation is not None:
        return True
    return gated_effect(revision, call.qualified_name, call.effect, call.principal.id)
