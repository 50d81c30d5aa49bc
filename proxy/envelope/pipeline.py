"""The envelope: an ordered, named table of checks, and the runtime that audits every decision.

`Chain` is built once per policy revision and never changes; `Envelope.install` swaps chains
atomically (calls in flight keep the chain they started with). Fronts call `Envelope.begin`
to decide a call (or `begin_read` to open a content read) and the forwarded-call executor
ends it with `Envelope.complete` (`proxy.envelope.outcome`): the one place where the answer
is inspected, the result checks run, the audit record is written and the call is counted.
Fronts never see a check, never build a decision and never write audit.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

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
from proxy.envelope.inspect import Inspector, Notes, Subject
from proxy.envelope.misconfig import Dependencies, MisconfigSink, Misconfiguration
from proxy.envelope.outcome import AUDIT_DOWN, Completion
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    ALLOWED,
    AsyncCheck,
    Check,
    Code,
    Decision,
    Outcome,
    Principal,
    Services,
    ToolCall,
    ToolInfo,
    Verdict,
)
from proxy.observability import tracing
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
        # How what the upstreams send is inspected under this revision.
        self.inspector = (Inspector(revision) if services is None else
                          Inspector(revision, services.settings.limits.guardrail_scan_timeout))
        # The misconfiguration report and the registry generation it was read at.
        self._report: tuple[int, list[Misconfiguration]] | None = None

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
                call.audit_extra["cancelled_in"] = check.id  # what held it: its record says so
                raise
            except Exception as exc:
                return self._failed(check, call, exc)
            if decision is not None:
                return decision
        if call.spend_approval is not None:
            # Released by the approval check but never spent (the idempotency check spends it
            # under the call's claim): performed now, the approval would stay reusable.
            return Decision(Verdict.ERROR, Code.INTERNAL_ERROR, "approval",
                            "the call's approval was not spent before forwarding; the call was "
                            "refused")
        return ALLOWED

    def visible(self, principal: Principal, upstream: str, tool: str) -> bool:
        """Whether `tools/list` shows this tool to this principal."""
        return catalogue.visible(self.revision, self.registry, principal.id, upstream, tool)

    def misconfigured(self) -> list[Misconfiguration]:
        """Every tool that can never run and why (the registry as learned so far). Kept until
        the registry changes: a hot reload makes it where it builds the chain, off the event
        loop (1,000 tools: 4-17 ms), and the install on the loop finds it made."""
        generation = self.registry.generation  # read first: a change from here on is seen
        if self._report is None or self._report[0] != generation:
            self._report = (generation, catalogue.misconfigurations(
                self.revision, self.registry, self.dependencies))
        return self._report[1]

    def prepare_report(self) -> None:
        """Make the misconfiguration report now, off the event loop (`Envelope.build`). When
        the loop learns a `tools/list` while this thread reads the registry ("changed size
        during iteration"), the report is left unmade: `misconfigured` makes it on the loop."""
        try:
            self.misconfigured()
        except RuntimeError:
            pass  # `_report` was not assigned: the next `misconfigured` call makes it

    def idempotent(self, call: ToolCall) -> bool:
        """Whether the policy declares the tool `idempotent: true` (safe to perform twice)."""
        tool = self.revision.tools.get(call.qualified_name)
        return tool is not None and tool.policy.idempotent

    def tool_label(self, call: ToolCall) -> str:
        """A bounded metric label: the tool's name when the catalogue knows it."""
        if call.qualified_name in self.revision.tools or call.upstream_tool is not None:
            return call.tool
        return UNKNOWN_TOOL_LABEL


    def decide_read(self, call: ToolCall) -> Decision | None:
        """The capability check's refusal of a client's `resources/read` or `prompts/get` (the
        Rule of Two on the labels of what it reads), or None. Never raises: a failure refuses."""
        if call.request.method not in ("resources/read", "prompts/get"):
            return None
        check = next((c for c in self.checks if isinstance(c, capability.CapabilityCheck)), None)
        if check is None:
            return None
        try:
            return check.decide_read(call, self.subject(call).labels.base)
        except Exception as exc:
            return self._failed(check, call, exc)

    def subject(self, call: ToolCall) -> Subject:
        """Whose content the upstream's answer to `call` is (labels, guardrails, ledger source):
        the tool's for `tools/call` (and for `tasks/result` of a task the front knows), the
        resource's or prompt's for a read, else anything an upstream sends."""
        method = call.request.method
        inspector = self.inspector
        if method == "tools/call" or (method == "tasks/result" and call.tool != method):
            return inspector.tool(call, self.tool_label(call))
        if method == "resources/read":
            uri = call.arguments.get("uri")
            return inspector.resource(call.upstream, uri if isinstance(uri, str) else "")
        if method == "prompts/get":
            name = call.arguments.get("name")
            return inspector.prompt(call.upstream, name if isinstance(name, str) else "")
        return inspector.relayed(call.upstream, method)


@dataclass(slots=True)
class Pending:
    """A decided call (or a content read) on its way to the upstream, or to its refusal.

    `record` is its audit record, built and serialised before anything is forwarded (the end
    only adds the result fields); `notes` what the inspection of its stream did so far;
    `outcome` is set once the call has ended (`Envelope.complete`): it ends exactly once.
    """

    call: ToolCall
    chain: Chain | None
    decision: Decision
    started: float
    envelope_seconds: float
    record: dict[str, Any] | None = None
    noted: Notes | None = None
    outcome: Outcome | None = None
    completion: asyncio.Task[Outcome] | None = None
    _subject: Subject | None = None

    @property
    def notes(self) -> Notes:
        """What the inspection did so far (made on first use: most calls note nothing)."""
        if self.noted is None:
            self.noted = Notes()
        return self.noted

    @property
    def subject(self) -> Subject | None:
        if self._subject is None and self.chain is not None:
            self._subject = self.chain.subject(self.call)
        return self._subject

    @property
    def forwardable(self) -> bool:
        """Whether the call goes upstream: allowed, and nothing held in its place."""
        return not self.decision.refused and self.decision.result is None and self.outcome is None


# What a content read (`resources/read`, `prompts/get`, `tasks/result`) is decided as: no
# policy check applies to it; its answer is inspected like a tool result and audited.
READ_ALLOWED = Decision(Verdict.ALLOW, Code.OK, "inspect", "content relayed after inspection")


class Envelope(Completion):
    """Runs the current chain, ends every call exactly once (`complete`, in `outcome.py`) and
    writes one audit record per decision."""

    def __init__(self, audit: AuditLog, metrics: Metrics, registry: ToolRegistry,
                 services: Services | None = None):
        self.audit = audit
        self.metrics = metrics
        self.registry = registry
        self.services = services if services is not None else Services(metrics=metrics)
        self._chain: Chain | None = None
        # The upstreams whose catalogue came from an OpenAPI spec at the last install.
        self._specs: frozenset[str] = frozenset()
        # Decision recorder for replay (`serve --record`; `proxy.tools.replay.Recorder`), or None.
        self.recorder: Any = None
        # Misconfigurations: logged once per revision, counted by layer, listed by the admin API.
        self.misconfig = MisconfigSink(metrics)
        # Completions running in tasks of their own (shielded, or after the client left):
        # tracked so that shutdown waits for their audit records.
        self.completing: set[asyncio.Task[Any]] = set()
        # Calls handed to the upstream and not yet ended (decision id -> call): what an exit
        # at once (a second signal) still writes a record for (`abandon`).
        self.forwarding: dict[str, Pending] = {}
        # Probe once now: a log that cannot take a record must refuse the very first call too.
        audit.check_writable(force=True)

    @property
    def chain(self) -> Chain | None:
        return self._chain

    def build(self, revision: PolicyRevision) -> Chain:
        """A new chain for `revision`, not installed. Safe in a worker thread: building reads
        the revision (the checks keep the registry and services, they do not read them yet) and
        the registry only for the misconfiguration report, made again at install if the
        registry changed meanwhile; so a hot reload builds it where it loads, off the event
        loop (1,000 tools: 0.15 s a chain before its scans were kept by text, ~0.05 s since),
        and `install` swaps it in."""
        chain = Chain(revision, self.registry, self.metrics, self.services)
        chain.prepare_report()  # the report `install` publishes, made here when it can be
        return chain

    def install(self, revision: PolicyRevision, chain: Chain | None = None) -> Chain:
        """Swap in `chain` (built by `build` from `revision`), or a new chain for `revision`."""
        if chain is None:
            chain = self.build(revision)
        elif chain.revision is not revision:
            raise ValueError("the chain installed was built from another revision")
        self._learn_specs(revision)
        self._chain = chain
        self.misconfig.loaded()
        self.refresh_catalogue_metrics()
        return chain

    def _learn_specs(self, revision: PolicyRevision) -> None:
        # An HTTP upstream's catalogue is its spec, not a tools/list: each revision replaces it
        # whole (an operation removed from the spec is gone), with the operator's effect.
        previous = self._specs
        self._specs = frozenset(revision.specs)
        for upstream in previous - self._specs:
            self.registry.forget(upstream)
        for upstream, spec in revision.specs.items():
            self.registry.replace(upstream, [
                ToolInfo(op.tool, op.input_schema, op.tool_definition()["annotations"], op.effect)
                for op in spec.operations.values()
            ])

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

    def _unavailable(self) -> Decision | None:
        """The refusal every call gets while nothing can be decided or audited, or None."""
        if self._chain is None:
            return Decision(Verdict.ERROR, Code.MISCONFIGURED, "catalogue", "no policy is loaded")
        if not (self.audit.healthy or self.audit.check_writable()):
            return AUDIT_DOWN
        return None

    async def begin(self, call: ToolCall) -> Pending:
        """Decide a call and build its audit record. Never raises (but cancellation): failures
        become refusals. A call whose record cannot be built is refused, never forwarded."""
        started = time.perf_counter()
        chain = self._chain
        decision = self._unavailable()
        if decision is None:
            assert chain is not None
            try:
                decision = await (chain.run(call) if tracing.TRACER is None else tracing.checks(chain, call))
            except asyncio.CancelledError:
                self._cut_off(call, chain, started)
                raise
        pending = Pending(call, chain, decision, started, time.perf_counter() - started)
        self._prepare(pending)
        return pending

    def _cut_off(self, call: ToolCall, chain: Chain, started: float) -> None:
        """Record a call cancelled while a check held it (its client left, or the proxy stopped,
        e.g. during an approval's wait): nothing was forwarded, and the call is on record all
        the same (an approval it asked for names it). Written by a tracked task; the claims it
        holds (idempotency) are released by its result hooks."""
        stopping = self.services.notifier is not None and self.services.notifier.stopping
        where = call.audit_extra.get("cancelled_in", "envelope")
        decision = Decision(
            Verdict.ERROR, Code.SHUTDOWN if stopping else Code.CLIENT_DISCONNECTED, str(where),
            ("the proxy shut down" if stopping else "the client disconnected")
            + f" while the {where} check held the call; it was not forwarded")
        if not stopping:
            call.audit_extra["client_disconnected"] = True
        pending = Pending(call, chain, decision, started, time.perf_counter() - started)
        self._prepare(pending)
        self.complete_soon(pending, None)

    def begin_read(self, call: ToolCall, requested: bool = False) -> Pending:
        """Open a content read (`resources/read`, `prompts/get`, `tasks/result`): allowed unless
        nothing can be decided or audited, or (a read the client `requested`) the principal's
        Rule-of-Two profile refuses its content's labels; its answer is inspected and audited by
        `complete`. A failure of that check refuses the read (`internal_error`)."""
        started = time.perf_counter()
        decision = self._unavailable()
        if decision is None and requested and self._chain is not None:
            decision = self._chain.decide_read(call)
        decision = decision or READ_ALLOWED
        pending = Pending(call, self._chain, decision, started, time.perf_counter() - started)
        self._prepare(pending)
        return pending

    def _prepare(self, pending: Pending) -> None:
        """Build the call's audit record and serialise it once, before anything is forwarded:
        a record that cannot be written whole refuses the call (the refusal is recorded with
        the offending values escaped)."""
        call, chain = pending.call, pending.chain
        log_args, mask = _logging(chain, call)
        record: dict[str, Any] | None = None
        try:
            record = build_record(
                decision_id=call.decision_id,
                revision=chain.revision.revision if chain is not None else "none",
                principal=call.principal.id, session=call.run.session, run=call.run.id,
                upstream=call.upstream, tool=call.tool, verdict=pending.decision.verdict,
                code=pending.decision.code, check=pending.decision.check,
                rule=pending.decision.rule, reason=pending.decision.reason,
                arguments=call.arguments, log_args=log_args, latency={}, upstream_status=None,
                mask=mask, method=call.request.method, canonical=call.args_json(),
            )
            orjson.dumps(record)
            if call.audit_extra:
                orjson.dumps(call.audit_extra)
        except (orjson.JSONEncodeError, TypeError) as exc:
            log.error("the audit record of decision %s cannot be serialised (%s): refused",
                      call.decision_id, exc)
            pending.decision = Decision(
                Verdict.ERROR, Code.INTERNAL_ERROR, "audit",
                "the call's audit record cannot be written (a value the log cannot hold); the "
                "call was refused")  # its record is written with such values escaped
        pending.record = record


def _logging(chain: Chain | None, call: ToolCall) -> tuple[bool, list[str]]:
    """Whether the call's record holds its arguments, and what is masked in them."""
    if chain is None:
        return False, []
    defaults = chain.revision.document.defaults
    tool_policy = chain.revision.tools.get(call.qualified_name)
    log_args = bool((tool_policy is not None and tool_policy.policy.log_args) or defaults.log_args)
    mask: list[str] = []
    if log_args:
        mask = list(defaults.mask)
        if tool_policy is not None and tool_policy.policy.mask:
            mask += tool_policy.policy.mask
    return log_args, mask
