"""Approval check: a gated call waits for a person's decision bound to this exact call.

Gated: the tool's `approval.required` when its policy has an `approval` block; otherwise its
effect (`call.effect`, set by the catalogue) is in the principal's `gated_effects`, else in
`defaults.gated_effects` (external, destructive).

For a gated call the check looks up the approval bound to the call (principal, run, upstream,
tool, argument digest) and:

- none: an active grant covering the call lets it continue (audited with `grant_id`);
  otherwise a pending approval is created (webhook notified) and the call is held up to the
  tool's `approval.wait`, polling the store (woken at once when this process decides);
- pending after the wait: `approval_pending`, naming the approval id; the client retries the
  same call after approval;
- approved: the call continues, audited with `approval_id` and `approver`, carrying
  `call.spend_approval`: the idempotency check spends the approval (store cas approved ->
  consumed) once it holds the call's claim;
- denied: `approval_denied` with the approver's reason (until the approval's TTL ends; then the
  same call may ask again);
- expired: `approval_expired`; the binding is dropped, so calling again asks anew.

Exactly-once contract with the idempotency check (next in the chain): an approved approval is
spent only by the call that holds the idempotency claim, after it took the claim; only the
caller that wins the approved -> consumed cas goes on (any other gets `approval_expired`). So
whoever finds the approval consumed also finds the claim of the call that spent it, or that
call's stored result, or neither because it ended without a result. Such a call (a concurrent
duplicate, or a retry of a call already performed) is let through with
`audit_extra["approval_state"] = "consumed"`; the idempotency check holds it while the first is
in flight and replays the first's stored result, and never forwards it again.

In-band (the tool's `approval.in_band`, when the front set `call.in_band`: the client can be
asked): the person at the client is asked too, and their answer is recorded through the same
service as decided by `user:<principal>` (audited with `in_band: true`).

- "hold" channels (sessions: an `elicitation/create` on the call's stream) are asked while the
  call is held; whichever decision comes first (in-band or out-of-band) counts; no answer within
  `wait` is the usual `approval_pending`.
- "defer" channels (2026-07-28: `input_required`) are not held: a pending call hands the front a
  signed state (`RequestStateSigner`: approval id + call binding + nonce + expiry) and is refused
  as pending; the retry carries the answer and the state, which is verified (signature, binding,
  expiry) and spent once (store `add` on the nonce) before the answer is recorded. A forged,
  foreign, expired or replayed state is refused as `approval_denied`.

Fail closed: with no approval gate (approvals disabled or no store) a gated call is refused as
`misconfigured`; any StoreError refuses it as `store_unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, ClassVar

from proxy.approvals.records import Approval, ApprovalConflict, CallBinding, InvalidRequestState
from proxy.approvals.service import ApprovalService
from proxy.approvals.signer import RequestStateSigner
from proxy.config import ApprovalsConfig
from proxy.envelope.effects import needs_approval
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    ApprovalPrompt,
    Code,
    Decision,
    InBandAnswer,
    InBandChannel,
    Services,
    ToolCall,
    Verdict,
    deny,
)
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import Approval as ApprovalPolicy
from proxy.policy.vocab import Effect

if TYPE_CHECKING:
    from proxy.observability.metrics import ApprovalReason

DEFAULT_WAIT = 30.0

log = logging.getLogger("envelope.approval")


def _evidence(call: ToolCall) -> list[dict[str, Any]] | None:
    """The data-flow evidence that escalated the call (`on_flag: approve`), for the approver;
    None when the call is gated by its effect only."""
    if call.escalation is None:
        return None
    flow = call.audit_extra.get("dataflow")
    found = flow.get("evidence") if isinstance(flow, dict) else None
    return [dict(e) for e in found if isinstance(e, dict)] if isinstance(found, list) else None


class ApprovalCheck:
    """Hold gated calls until a person approves this exact call (or a grant covers it)."""

    id: ClassVar[str] = "approval"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        # `Services.hold_calls` False (policy tests, replay): a gated call whose approval has no
        # decision yet is `approval_pending` at once; everything else is the same check.
        self._hold_calls = services.hold_calls if services is not None else True
        self._metrics = services.metrics if services is not None else None
        self._revision = revision
        self._policies: dict[str, ApprovalPolicy | None] = {
            key: tool.policy.approval for key, tool in revision.tools.items()
        }
        self._principal_gated = frozenset(
            pid for pid, p in revision.principals.items() if p.policy.gated_effects is not None
        )
        self._config: ApprovalsConfig = services.settings.approvals if services is not None else ApprovalsConfig()
        # The process's approval service (shared with the admin API); a check built without
        # one (tests, offline tools) builds its own on the store.
        self._service: ApprovalService | None = None
        self._store_kind = "none"
        if services is not None and services.store is not None and self._config.enabled:
            self._service = services.approvals or ApprovalService(
                services.store, self._config, services.notifier, services.metrics)
            self._store_kind = services.store.kind
        # The process's signer, so states minted before a policy reload open after it; only a
        # check built without one (tests, offline tools) signs with its own.
        signer = services.signer if services is not None else None
        self._signer = signer if signer is not None else RequestStateSigner.from_config(self._config)

    # -- gating (sync, cheap) ---------------------------------------------------------------

    def applies(self, call: ToolCall) -> bool:
        """Whether the call is gated (one definition with idempotency: `effects.gated`) and
        its gate is not waived by the user's intent (`effects.needs_approval`)."""
        return needs_approval(self._revision, call)

    def _rule(self, call: ToolCall) -> str:
        if call.escalation is not None:
            return "dataflow.on_tainted" if call.escalation_reason == "tainted_run" else "dataflow.on_flag"
        if self._policies.get(call.qualified_name) is not None:
            return f"tools.{call.qualified_name}.approval"
        if call.principal.id in self._principal_gated:
            return f"principals.{call.principal.id}.gated_effects"
        return "defaults.gated_effects"

    # -- deciding ---------------------------------------------------------------------------

    async def decide(self, call: ToolCall) -> Decision | None:
        """None when an approval (or grant) releases the call; otherwise a refusal.

        Refuses `misconfigured` without an approval gate, `store_unavailable` when the store
        cannot answer, `approval_pending` / `approval_denied` / `approval_expired` per the
        approval's state.
        """
        if self._service is None:
            return deny(
                Code.MISCONFIGURED, self.id,
                f"tool '{call.qualified_name}' needs approval (effect "
                f"{(call.effect or Effect.DESTRUCTIVE).value}) but no approval gate is configured",
                self._rule(call),
            )
        try:
            return await self._decide(self._service, call)
        except StoreError as exc:
            return Decision(
                Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                f"the state store ({self._store_kind}) is unavailable ({exc}); gated calls are "
                "refused until it answers",
            )

    async def _decide(self, service: ApprovalService, call: ToolCall) -> Decision | None:
        binding = CallBinding(call.principal.id, call.run.id, call.upstream, call.tool,
                              call.args_digest())
        policy = self._policies.get(call.qualified_name)
        wait = (policy.wait if policy is not None else DEFAULT_WAIT) if self._hold_calls else 0.0
        ttl = (policy.ttl if policy is not None else None) or self._config.ttl
        channel = self._in_band(call, policy)
        if channel is not None and channel.mode == "defer" and (
                channel.answer is not None or channel.state is not None):
            refused = await self._answered(service, call, binding, channel)
            if refused is not None:
                return refused
        approval = await service.for_call(binding)
        if approval is not None:
            state = approval.effective_state(service.clock())
            if state == "pending":
                return await self._hold(service, call, approval, wait, channel)
            if state == "denied" and service.clock() >= approval.expires_at:
                await service.forget(approval)  # a denial binds until its TTL ends
                approval = None
            elif state == "expired":
                await service.forget(approval)
                return self._settled(call, approval, state)
            else:
                return await self._release(service, call, approval)
        grant = await service.find_grant(binding, call.arguments)
        if grant is not None:
            call.audit_extra.update(grant_id=grant.id, approver=grant.approver)
            return None
        effect = (call.effect or Effect.DESTRUCTIVE).value
        why = self._reason(call)
        call.audit_extra["approval_reason"] = why
        approval, created = await service.request(
            binding, arguments=call.arguments, effect=effect,
            reason=call.escalation or f"effect {effect} of {call.qualified_name} is gated ({self._rule(call)})",
            ttl=ttl, decision_id=call.decision_id, evidence=_evidence(call),
        )
        if created and self._metrics is not None:
            self._metrics.approval_requested(why)
        return await self._hold(service, call, approval, wait, channel)

    def _reason(self, call: ToolCall) -> ApprovalReason:
        """Why this call asks a person (`envelope_approvals_requested_total{reason}`)."""
        if call.escalation is not None:
            return "tainted_run" if call.escalation_reason == "tainted_run" else "dataflow_flag"
        if self._policies.get(call.qualified_name) is not None:
            return "policy"
        return "gated_effect"

    # -- in-band ----------------------------------------------------------------------------

    def _in_band(self, call: ToolCall, policy: ApprovalPolicy | None) -> InBandChannel | None:
        """The channel to the person at the client, when the policy lets them approve."""
        if policy is None or not policy.in_band:
            return None
        return call.in_band

    @staticmethod
    def _prompt(call: ToolCall, approval: Approval) -> ApprovalPrompt:
        return ApprovalPrompt(approval.id, call.upstream, call.tool, approval.args_digest,
                              call.arguments, approval.expires_at)

    async def _record(self, service: ApprovalService, call: ToolCall, approval_id: str,
                      answer: InBandAnswer) -> None:
        """Record the person's answer as decided by `user:<principal>` (a decision made
        elsewhere first wins: the conflict is ignored, the state is read again)."""
        try:
            await service.decide(approval_id, approver=f"user:{call.principal.id}",
                                 approve=answer.approve, reason=answer.reason)
        except ApprovalConflict:
            return
        call.audit_extra["in_band"] = True

    async def _ask(self, service: ApprovalService, call: ToolCall, approval: Approval,
                   channel: InBandChannel) -> None:
        answer = await channel.ask(self._prompt(call, approval))
        if answer is not None:
            await self._record(service, call, approval.id, answer)

    async def _answered(self, service: ApprovalService, call: ToolCall, binding: CallBinding,
                        channel: InBandChannel) -> Decision | None:
        """A 2026-07-28 retry carrying the answer to our input request: verify the state, spend
        it, record the answer. None continues with the approval's (new) state; a Decision
        refuses a forged, foreign, expired or replayed state."""
        def refused(why: str) -> Decision:
            log.warning("in-band approval state refused for %s (%s): %s", call.qualified_name,
                        call.decision_id, why)
            return Decision(
                Verdict.DENY, Code.APPROVAL_DENIED, self.id,
                "the in-band approval answer could not be verified (forged, replayed, expired or "
                "for another call); call again to be asked anew",
                "in_band", audit={"in_band": True, "in_band_refused": why},
            )

        if channel.state is None or channel.answer is None:
            return refused("an answer without its requestState" if channel.state is None
                           else "a requestState without an answer")
        try:
            sealed = self._signer.open(channel.state, binding)
        except InvalidRequestState as exc:
            return refused(str(exc))
        if not await service.spend(sealed.nonce, sealed.expires_at):
            return refused("replayed")
        approval = await service.head(sealed.approval_id)
        if approval is None or approval.binding != binding:
            return refused("unknown approval")
        if approval.effective_state(service.clock()) == "pending":
            await self._record(service, call, approval.id, channel.answer)
        return None

    # -- holding ----------------------------------------------------------------------------

    async def _hold(self, service: ApprovalService, call: ToolCall, approval: Approval,
                    wait: float, channel: InBandChannel | None = None) -> Decision | None:
        """Wait up to `wait` seconds (not past the approval's expiry) for a decision, asking the
        person at the client meanwhile when there is an in-band channel."""
        if channel is not None and channel.mode == "defer":
            # 2026-07-28: no holding; the client asks its user and retries with the answer.
            channel.defer(self._prompt(call, approval), self._signer.seal(approval.id, approval.binding))
            return Decision(
                Verdict.DENY, Code.APPROVAL_PENDING, self.id,
                f"approval {approval.id} is pending: the user at the client is asked; retry the "
                "same call with the answer, or after an out-of-band approval",
                self._rule(call),
                audit={"approval_id": approval.id, "approval_state": "pending",
                       "in_band": "input_required"},
            )
        # Named while held, so that a call cut off meanwhile (its client left) is recorded with
        # the approval it asked for.
        call.audit_extra["approval_id"] = approval.id
        asking: asyncio.Task[None] | None = None
        if channel is not None:
            asking = asyncio.get_running_loop().create_task(self._ask(service, call, approval, channel))
        try:
            current = await service.wait_for_decision(approval, wait, asking)
            if current is None:  # the store dropped it: as good as expired
                return self._settled(call, approval, "expired")
            state = current.effective_state(service.clock())
            if state == "pending":
                return self._settled(call, current, "pending", None if service.stopping else wait)
            if state == "expired":
                await service.forget(current)
                return self._settled(call, current, state)
            return await self._release(service, call, current)
        finally:
            if asking is not None:
                if asking.done() and not asking.cancelled() and asking.exception() is not None:
                    log.error("in-band approval request for %s failed", approval.id,
                              exc_info=asking.exception())
                asking.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asking

    async def _release(self, service: ApprovalService, call: ToolCall,
                       approval: Approval) -> Decision | None:
        """Approved: continue, to be spent once the call holds its idempotency claim. Consumed:
        continue to the idempotency check (see the module's contract). Denied or expired:
        refuse."""
        state = approval.effective_state(service.clock())
        if state == "approved":
            call.audit_extra.update(approval_id=approval.id, approver=approval.approver)
            if approval.decision_record is not None:
                call.audit_extra["approval_record"] = approval.decision_record
            call.spend_approval = functools.partial(self._spend, service, call, approval)
            return None
        if state == "consumed":
            call.audit_extra.update(approval_id=approval.id, approver=approval.approver,
                                    approval_state="consumed")
            call.forget_approval = functools.partial(service.forget, approval)
            if approval.decision_record is not None:
                call.audit_extra["approval_record"] = approval.decision_record
            return None
        return self._settled(call, approval, state)

    async def _spend(self, service: ApprovalService, call: ToolCall,
                     approval: Approval) -> Decision | None:
        """`call.spend_approval`: consume the approval (approved -> consumed, exactly once). None
        for the one caller that wins; otherwise the refusal (consumed by a call with another
        idempotency key, expired meanwhile). Raises StoreError."""
        for _ in range(3):
            if await service.consume(approval):
                await service.refresh_gauge()
                return None
            current = await service.head(approval.id)
            if current is None:  # the store dropped it: as good as expired
                return self._settled(call, approval, "expired")
            state = current.effective_state(service.clock())
            if state == "expired":
                await service.forget(current)  # as in `_decide`: calling again asks anew
            if state != "approved":
                return self._settled(call, current, state)
            approval = current  # still approved, re-stored meanwhile: try again
        return self._settled(call, approval, approval.effective_state(service.clock()))

    def _settled(self, call: ToolCall, approval: Approval, state: str,
                 wait: float | None = None) -> Decision:
        """The refusal for a call whose approval is not (or no longer) usable."""
        audit: dict[str, Any] = {"approval_id": approval.id, "approval_state": state}
        rule = self._rule(call)
        if state == "pending":
            hint = self._config.pending_hint
            return Decision(
                Verdict.DENY, Code.APPROVAL_PENDING, self.id,
                f"approval {approval.id} is pending: "
                + ("the proxy is shutting down; " if wait is None else f"not decided within {wait:g}s; ")
                + "retry the same call after approval"
                + (f"; {hint.replace('{id}', approval.id)}" if hint else ""),
                rule, audit=audit,
            )
        if state == "denied":
            audit["approver"] = approval.approver
            return Decision(
                Verdict.DENY, Code.APPROVAL_DENIED, self.id,
                f"approval {approval.id} was denied by {approval.approver}: "
                f"{approval.decision_reason or 'no reason given'}",
                rule, audit=audit,
            )
        if state == "consumed":
            return Decision(
                Verdict.DENY, Code.APPROVAL_EXPIRED, self.id,
                f"approval {approval.id} was already used by another call; ask for a new "
                "approval to perform it again",
                rule, audit=audit,
            )
        return Decision(
            Verdict.DENY, Code.APPROVAL_EXPIRED, self.id,
            f"approval {approval.id} expired before it was used; calling again asks for a new "
            "approval",
            rule, audit=audit,
        )
