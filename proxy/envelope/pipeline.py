"""The envelope: an ordered, named table of checks, and the runtime that audits every decision.

`Chain` is built once per policy revision and never changes; `Envelope.install` swaps chains
atomically (calls in flight keep the chain they started with). Fronts call `Envelope.begin`
to decide a call and `Envelope.finish` to audit and count it; they never see a check.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.audit.log import AuditLog
from proxy.audit.record import build_record
from proxy.envelope.checks import (
    approval,
    arg_rules,
    authz,
    capability,
    catalogue,
    dataflow,
    delegation,
    idempotency,
    ratelimit,
    runtaint,
    schema,
    shadow,
)
from proxy.envelope.misconfig import Dependencies, MisconfigSink, Misconfiguration
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    ALLOWED,
    AsyncCheck,
    Check,
    Code,
    Decision,
    Principal,
    Services,
    ToolCall,
    Verdict,
)
from proxy.errors import AuditError, ResultWithheld
from proxy.observability.metrics import Metrics
from proxy.policy.compiled import PolicyRevision

log = logging.getLogger("envelope")

# The order is the contract (DESIGN section 2): cheapest and most decisive first. Delegation is
# second (a too-deep run or an off-roster agent is refused before anything else looks at it); the
# rate limit runs after shadow (a shadowed call is never performed, so it takes no slot) and
# before approval (a call beyond the bound pages nobody). Shadow runs before approval and
# idempotency (DESIGN lists it after them): a dry run must not page approvers, and a shadowed
# call is never performed, so it needs no idempotency claim.
CHECKS: tuple[type[Any], ...] = (
    catalogue.CatalogueCheck,
    delegation.DelegationCheck,
    capability.CapabilityCheck,
    schema.SchemaCheck,
    runtaint.RunTaintCheck,
    authz.AuthzCheck,
    arg_rules.ArgRulesCheck,
    dataflow.DataflowCheck,
    shadow.ShadowCheck,
    ratelimit.RateLimitCheck,
    approval.ApprovalCheck,
    idempotency.IdempotencyCheck,
)

UNKNOWN_TOOL_LABEL = "<unknown>"


class Chain:
    """The checks of one policy revision, in order."""

    def __init__(self, revision: PolicyRevision, registry: ToolRegistry, metrics: Metrics | None = None,
                 services: Services | None = None):
        self.revision = revision
        self.registry = registry
        self._metrics = metrics
        self.services = services
        # What the envelope layer provides (store, approvals), fixed for the chain's lifetime.
        self.dependencies = Dependencies.of(services)
        self.checks: tuple[Check | AsyncCheck, ...] = tuple(
            cls(revision, registry, services) for cls in CHECKS
        )

    @property
    def checks(self) -> tuple[Check | AsyncCheck, ...]:
        return self._checks

    @checks.setter
    def checks(self, checks: tuple[Check | AsyncCheck, ...]) -> None:
        self._checks = checks
        # Whether each check waits, decided once: the per-call loop only reads a bool.
        self._plan = tuple((c, inspect.iscoroutinefunction(c.decide)) for c in checks)

    def _failed(self, check: Check | AsyncCheck, call: ToolCall, exc: Exception) -> Decision:
        log.error("check %s failed on %s (decision %s)", check.id, call.qualified_name, call.decision_id,
                  exc_info=exc)
        if self._metrics is not None:
            self._metrics.check_error(check.id)
        return Decision(
            Verdict.ERROR,
            Code.INTERNAL_ERROR,
            check.id,
            f"the {check.id} check failed ({type(exc).__name__}); the call was refused",
        )

    async def run(self, call: ToolCall) -> Decision:
        """Decide a call: the first check that returns a Decision ends it.

        An exception inside a check refuses the call with `internal_error` (fail closed).
        Waiting checks are awaited only for calls they apply to.
        """
        call.upstream_tool = self.registry.get(call.upstream, call.tool)
        for check, waits in self._plan:
            try:
                if waits:
                    if not check.applies(call):  # type: ignore[union-attr]
                        continue
                    decision = await check.decide(call)  # type: ignore[misc]
                else:
                    decision = check.decide(call)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                return self._failed(check, call, exc)
            if decision is not None:
                return decision
        return ALLOWED

    def visible(self, principal: Principal, upstream: str, tool: str) -> bool:
        """Whether `tools/list` shows this tool to this principal."""
        return catalogue.visible(self.revision, self.registry, principal.id, upstream, tool)

    def misconfigured(self) -> list[Misconfiguration]:
        """Every tool that can never run and why (the registry as learned so far)."""
        return catalogue.misconfigurations(self.revision, self.registry, self.dependencies)

    def tool_label(self, call: ToolCall) -> str:
        """A bounded metric label: the tool's name when the catalogue knows it."""
        if call.qualified_name in self.revision.tools or call.upstream_tool is not None:
            return call.tool
        return UNKNOWN_TOOL_LABEL


@dataclass(slots=True)
class Pending:
    """A decided call on its way to the upstream (or to its refusal)."""

    call: ToolCall
    chain: Chain
    decision: Decision
    started: float
    envelope_seconds: float
    latency: dict[str, float] = field(default_factory=dict)


class Envelope:
    """Runs the current chain and writes one audit record per decision."""

    def __init__(self, audit: AuditLog, metrics: Metrics, registry: ToolRegistry,
                 services: Services | None = None):
        self.audit = audit
        self.metrics = metrics
        self.registry = registry
        self.services = services
        self._chain: Chain | None = None
        # Decision recorder for replay (`serve --record`; `proxy.tools.replay.Recorder`), or None.
        self.recorder: Any = None
        # Misconfigurations: logged once per revision, counted by layer, listed by the admin API.
        self.misconfig = MisconfigSink(metrics)
        # Probe once now: a log that cannot take a record must refuse the very first call too.
        audit.check_writable(force=True)

    @property
    def chain(self) -> Chain | None:
        return self._chain

    def install(self, revision: PolicyRevision) -> Chain:
        """Build a whole new chain for `revision` and swap it in."""
        chain = Chain(revision, self.registry, self.metrics, self.services)
        self._chain = chain
        self.misconfig.loaded()
        self.refresh_catalogue_metrics()
        return chain

    def refresh_catalogue_metrics(self) -> None:
        """Recompute the misconfiguration report and the catalogue gauges: at every install and
        whenever the registry learns a tools/list (new problems are logged, known ones are not)."""
        chain = self._chain
        if chain is None:
            return
        self.misconfig.publish(chain.misconfigured())
        self.metrics.set_catalogue(
            {upstream: len(self.registry.tools(upstream)) for upstream in self.registry.upstreams()}
        )

    async def begin(self, call: ToolCall) -> Pending:
        """Decide a call. Never raises (but cancellation): failures become refusals."""
        started = time.perf_counter()
        chain = self._chain
        if chain is None:
            decision = Decision(Verdict.ERROR, Code.MISCONFIGURED, "catalogue", "no policy is loaded")
        elif not (self.audit.healthy or self.audit.check_writable()):
            decision = Decision(
                Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                "the audit log cannot be written; calls are refused until it can",
            )
        else:
            decision = await chain.run(call)
        elapsed = time.perf_counter() - started
        return Pending(call, chain, decision, started, elapsed)  # type: ignore[arg-type]

    async def finish(
        self,
        pending: Pending,
        decision: Decision | None = None,
        *,
        upstream_status: int | None = None,
        upstream_seconds: float | None = None,
        extra: dict[str, Any] | None = None,
        reply: Mapping[str, Any] | None = None,
    ) -> None:
        """Run the call's result hooks, then audit and count its final decision.

        `reply` is the upstream's JSON-RPC reply when the call was forwarded and answered.
        Raises AuditError when the record cannot be written. Call it before the reply is sent:
        a record that cannot be written turns the reply into an `audit_unavailable` refusal.
        Raises ResultWithheld (after auditing its refusal) when a hook says the result must not
        reach the agent; the front answers with that refusal instead.
        """
        call = pending.call
        decision = decision or pending.decision
        withheld: Decision | None = None
        for hook in call.on_result:
            try:
                await hook(call, decision, reply)
            except asyncio.CancelledError:
                raise
            except ResultWithheld as exc:  # the refusal is audited in place of the decision
                withheld = withheld or exc.decision
            except Exception as exc:  # a hook never hides the outcome; the record says so
                log.error("result hook failed for decision %s", call.decision_id, exc_info=exc)
                extra = {**(extra or {}), "hook_error": f"{type(exc).__name__}: {exc}"}
        if call.audit_extra:
            extra = {**(extra or {}), **call.audit_extra}
        if withheld is not None:
            extra = {**(extra or {}), "withheld": {"verdict": decision.verdict.value,
                                                   "code": decision.code.value}}
            decision = withheld
        if decision.audit:
            extra = {**(extra or {}), **decision.audit}
        now = time.perf_counter()
        latency = {"envelope": pending.envelope_seconds, "total": now - pending.started}
        if upstream_seconds is not None:
            latency["upstream"] = upstream_seconds
        chain = pending.chain
        revision = chain.revision.revision if chain is not None else "none"
        tool_policy = chain.revision.tools.get(call.qualified_name) if chain is not None else None
        log_args = bool(
            (tool_policy is not None and tool_policy.policy.log_args)
            or (chain is not None and chain.revision.document.defaults.log_args)
        )
        mask: list[str] = []
        if log_args and chain is not None:
            mask = chain.revision.document.defaults.mask
            if tool_policy is not None and tool_policy.policy.mask:
                mask = [*mask, *tool_policy.policy.mask]
        record = build_record(
            decision_id=call.decision_id,
            revision=revision,
            principal=call.principal.id,
            session=call.run.session,
            run=call.run.id,
            upstream=call.upstream,
            tool=call.tool,
            verdict=decision.verdict.value,
            code=decision.code.value,
            check=decision.check,
            rule=decision.rule,
            reason=decision.reason,
            arguments=call.arguments,
            log_args=log_args,
            latency=latency,
            upstream_status=upstream_status,
            extra=extra,
            mask=mask,
        )
        t_audit = time.perf_counter()
        try:
            self.audit.write(record)
        except AuditError:
            self.metrics.audit_write_failure()
            log.error("audit write failed for decision %s: %s", call.decision_id, self.audit.last_error)
            raise
        done = time.perf_counter()
        m = self.metrics
        m.audit_record()
        label = chain.tool_label(call) if chain is not None else UNKNOWN_TOOL_LABEL
        m.decision(call.upstream, label, decision.verdict.value, decision.code.value)
        m.observe_stage("envelope", pending.envelope_seconds)
        m.observe_stage("audit", done - t_audit)
        m.observe_stage("total", done - pending.started)
        if upstream_seconds is not None:
            m.observe_stage("upstream", upstream_seconds)
        if self.recorder is not None:  # never raises: a recording failure is logged and counted
            self.recorder.record(pending, decision, reply)
        if withheld is not None:
            raise ResultWithheld(withheld)
