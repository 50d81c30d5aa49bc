"""How a call ends: `Envelope.complete`, the one place where a forwarded call (or a content
read, or a refusal) becomes an audited `Outcome`.

`complete(pending, ending)` takes what the forwarded-call executor saw (`Reply`: the upstream's
answer; `Failure`: none came; a `Decision` the inspection of the call's stream returned; nothing:
the call was refused or answered from the envelope's own state) and, in this order:

1. inspects the answer (`proxy.envelope.inspect`): forged `envelope/*` meta removed, output
   guardrails (a block, or a guardrail failure, withholds the answer), the data-flow ledger
   records what the client will receive (enforce withholds an answer it cannot record);
2. runs the call's result hooks (idempotency stores the result, the rate limit frees the slot);
3. writes the audit record built before forwarding, adding the result fields;
4. counts the decision.

Neither the client going away nor the caller's timeout can interrupt it between the upstream's
answer and the audit record: it starts eagerly, and most completions end without waiting for
anything (no store write is due, no hook), so they run to the record synchronously; one that
must wait (for the store, a worker thread) goes on in a task of its own, shielded from the
caller's cancellation (tracked in `Envelope.completing`; shutdown waits for them). A call ends exactly once. If the audit record
cannot be written, the answer is withheld (`audit_unavailable`), the failure is logged at ERROR
with the decision id and counted in `envelope_audit_write_failures_total`, `/readyz` turns false
and every later call is refused until the log is writable again.

`inspect_event` inspects one message of a call's stream (a notification or a server-to-client
request relayed before the answer); `relay` inspects a message outside any call (a standalone or
resumed GET stream, the reply of a request the envelope does not decide) and writes an audit
record when the inspection acted (a guardrail fired, the ledger could not record it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.audit.log import AuditLog
from proxy.audit.record import build_record, utc_timestamp
from proxy.envelope.checks.guardrails import failed
from proxy.envelope.dataflow.ledger import LedgerDelta
from proxy.envelope.dataflow.secret import pick_secret
from proxy.envelope.inspect import Scan, Subject
from proxy.envelope.types import (
    Code,
    Decision,
    Failure,
    Outcome,
    OutcomeKind,
    Reply,
    Services,
    ToolCall,
    Verdict,
)
from proxy.errors import AuditError, StoreError
from proxy.observability import tracing
from proxy.observability.metrics import Metrics

if TYPE_CHECKING:
    from proxy.envelope.pipeline import Chain, Pending

log = logging.getLogger("envelope")

DECISION_META = "envelope/decision"
UNKNOWN_TOOL_LABEL = "<unknown>"

AUDIT_DOWN = Decision(Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                      "the audit log cannot be written; calls are refused until it can")
AUDIT_FAILED = Decision(Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                        "the audit log cannot be written; the result is withheld")
NOT_FORWARDED = Decision(Verdict.ERROR, Code.INTERNAL_ERROR, "forward",
                         "the call was allowed but never forwarded; refused")

Ending = Reply | Failure | Decision | None


def refusal_result(decision: Decision, decision_id: str) -> dict[str, Any]:
    """The tool result a model reads when the envelope refuses a call (the same text on every
    route), with the machine-readable decision in `_meta`."""
    return {
        "content": [{"type": "text", "text": f"Blocked by policy ({decision.code.value}): {decision.reason}"}],
        "isError": True,
        "_meta": {DECISION_META: decision.as_meta(decision_id)},
    }


def held_result(decision: Decision, decision_id: str) -> dict[str, Any]:
    """A result the envelope holds instead of forwarding (a replay, a shadow result), marked."""
    result = dict(decision.result or {})
    meta = dict(result.get("_meta") or {})
    meta[DECISION_META] = decision.as_meta(decision_id)
    if decision.code is Code.REPLAYED:
        meta["envelope/replayed"] = True
    elif decision.code is Code.SHADOWED:
        meta["envelope/shadow"] = True
    result["_meta"] = meta
    return result


def withheld_by(scan: Scan) -> Decision | None:
    """The refusal that withholds a scanned message (None: it is delivered): it is not one
    JSON-RPC message, the guardrails could not check it, or one of them blocks it."""
    if scan.malformed is not None:
        return Decision(Verdict.ERROR, Code.UPSTREAM_ERROR, "inspect",
                        f"the upstream sent {scan.malformed}, which clients read in different "
                        "ways; it was withheld")
    if scan.error is not None:
        return failed(scan.error)
    return scan.guarded.refusal()


_FAILURES: dict[str, tuple[Verdict, Code]] = {
    "error": (Verdict.ERROR, Code.UPSTREAM_ERROR),
    "timeout": (Verdict.ERROR, Code.UPSTREAM_TIMEOUT),
    "disconnected": (Verdict.ERROR, Code.CLIENT_DISCONNECTED),
    "shutdown": (Verdict.ERROR, Code.SHUTDOWN),
    "detached": (Verdict.ALLOW, Code.OK),
    "session_lost": (Verdict.ERROR, Code.UPSTREAM_ERROR),
}


async def _resume(coro: Coroutine[Any, Any, Outcome], waiting: Any) -> Outcome:
    """Drive a coroutine that was started eagerly and suspended on `waiting` (what it awaits: a
    future, or None for a bare yield) to its end, in the task running this (what Python 3.12's
    eager tasks do). The awaited future's result or exception reaches the coroutine when it is
    sent on, exactly as a task would deliver it."""
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                # What a task does with a future its coroutine yields: clear the flag the
                # future's `__await__` set, then wait for it (its result or error reaches the
                # coroutine, a cancelled future's CancelledError too: a store deadline cancels
                # the operation it awaits, and the coroutine turns that into its timeout).
                waiting._asyncio_future_blocking = False
                with contextlib.suppress(Exception):
                    await waiting
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this task is cancelled: so is the coroutine
                try:
                    coro.throw(asyncio.CancelledError())
                except StopIteration as done:  # it ended all the same
                    ended: Outcome = done.value
                    return ended
                raise
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            outcome: Outcome = done.value
            return outcome


def failure_decision(failure: Failure) -> Decision:
    verdict, code = _FAILURES[failure.kind]
    return Decision(verdict, code, "forward", failure.reason)


@dataclass(slots=True)
class Relayed:
    """What the inspection of one relayed message decided: deliver `message` (rewritten when
    `changed`), or, when `refusal` is set, withhold it (a call's stream then ends refused)."""

    message: dict[str, Any]
    changed: bool
    refusal: Decision | None = None


class Completion:
    """The ending half of `proxy.envelope.pipeline.Envelope` (which sets these attributes)."""

    audit: AuditLog
    metrics: Metrics
    services: Services
    recorder: Any
    completing: set[asyncio.Task[Any]]
    forwarding: dict[str, Pending]

    @property
    def chain(self) -> Chain | None:  # implemented by Envelope
        raise NotImplementedError

    # -- ending a call ----------------------------------------------------------------------

    async def complete(self, pending: Pending, ending: Ending = None, *,
                       upstream_seconds: float | None = None) -> Outcome:
        """End `pending` with `ending` (see the module docstring) and return what to deliver.
        Never raises but for the caller's own cancellation, which does not stop it: the
        record is written all the same. Calling it again returns the first outcome."""
        if pending.outcome is not None:
            return pending.outcome
        task = pending.completion
        if task is None:
            coro = self._complete(pending, ending, upstream_seconds)
            try:
                # Eagerly: most completions never wait (no store write is due, no hook), and
                # then end here, synchronously: nothing can interrupt them, no task is made.
                waiting = coro.send(None)
            except StopIteration as done:
                outcome: Outcome = done.value
                return outcome
            task = pending.completion = self._track(_resume(coro, waiting))
        return await asyncio.shield(task)

    def complete_soon(self, pending: Pending, ending: Ending, *,
                      upstream_seconds: float | None = None) -> None:
        """`complete` from code that is being cancelled (the client left): tracked, not awaited."""
        if pending.outcome is None and pending.completion is None:
            pending.completion = self._track(self._complete(pending, ending, upstream_seconds))

    def _track(self, coro: Coroutine[Any, Any, Outcome]) -> asyncio.Task[Outcome]:
        task = asyncio.get_running_loop().create_task(coro)
        self.completing.add(task)
        task.add_done_callback(self.completing.discard)
        return task

    def abandon(self, reason: str) -> int:
        """The process exits at once (a second signal): write, now, the record of every call
        handed to an upstream that has not ended (`shutdown`, `extra.abandoned`), so none that
        may have been performed goes unaudited. Synchronous (the audit write is); never raises.
        The number of records written."""
        written = 0
        decision = Decision(Verdict.ERROR, Code.SHUTDOWN, "forward", reason)
        for pending in list(self.forwarding.values()):
            if pending.outcome is not None:
                continue
            try:
                if self._write(pending, decision, {"abandoned": True}, None, None) is decision:
                    written += 1
            except Exception as exc:  # exiting anyway: say so, write the others
                log.error("record of abandoned decision %s not written: %s", pending.call.decision_id, exc)
        self.forwarding.clear()
        return written

    async def drain(self, grace: float) -> None:
        """Wait up to `grace` seconds for completions still running: their audit records
        (shutdown)."""
        if self.completing:
            await asyncio.wait(set(self.completing), timeout=grace)

    async def _complete(self, pending: Pending, ending: Ending,
                        upstream_seconds: float | None) -> Outcome:
        call = pending.call
        decision = pending.decision
        extra: dict[str, Any] = {}
        kind: OutcomeKind = "refuse"
        message: Mapping[str, Any] | None = None
        raw: bytes | None = None
        status = 200
        upstream_status: int | None = None
        try:
            if isinstance(ending, Reply):
                upstream_status = status = ending.status
                kind, decision, message, raw = await self._answer(pending, ending, extra)
            elif isinstance(ending, Failure):
                upstream_status = ending.status
                if ending.kind == "session_lost":
                    status = 404
                decision = failure_decision(ending)
                if ending.extra:
                    extra.update(ending.extra)
                kind = "none" if ending.kind in ("disconnected", "detached", "shutdown") else "refuse"
                if ending.kind != "detached":  # a detached call's output may still arrive
                    await self._clear_pending(pending)
            elif isinstance(ending, Decision):  # the inspection of the call's stream withheld it
                extra["withheld"] = {"verdict": decision.verdict.value, "code": decision.code.value}
                decision = ending
                await self._clear_pending(pending)
            elif decision.refused:
                await self._clear_pending(pending)
            elif decision.result is not None:
                kind, message = "held", held_result(decision, call.decision_id)
                if decision.code is Code.REPLAYED:  # the client reads that result once more
                    refusal = await self._record(pending, pending.subject, {"result": decision.result},
                                                 done=True)
                    if refusal is not None:
                        kind, message, decision = "refuse", None, refusal
                else:
                    await self._clear_pending(pending)
            else:
                decision = NOT_FORWARDED
                await self._clear_pending(pending)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must still end in a record and a refusal
            log.error("completing decision %s failed", call.decision_id, exc_info=exc)
            extra["complete_error"] = f"{type(exc).__name__}: {exc}"
            kind, message, raw = "refuse", None, None
            decision = Decision(Verdict.ERROR, Code.INTERNAL_ERROR, "envelope",
                                "ending the call failed; its result is withheld")
        if kind == "deliver" and isinstance(message, Mapping):
            result = message.get("result")
            extra["is_error"] = bool(result.get("isError", False)) if isinstance(result, Mapping) else True
        call.upstream_status = upstream_status
        for hook in call.on_result:
            try:
                await hook(call, decision, message if kind == "deliver" else None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a hook never hides the outcome; the record says so
                log.error("result hook failed for decision %s", call.decision_id, exc_info=exc)
                extra["hook_error"] = f"{type(exc).__name__}: {exc}"
        written = self._write(pending, decision, extra, upstream_status, upstream_seconds,
                              message if kind == "deliver" else None, answered=isinstance(ending, Reply))
        if written is not decision:  # the audit log failed: nothing is delivered
            decision, kind, message, raw = written, "refuse", None, None
        sse = ending.sse if isinstance(ending, Reply) else None
        outcome = Outcome(kind, decision, call.decision_id, message, raw, status, sse)
        pending.outcome = outcome
        self.forwarding.pop(call.decision_id, None)
        return outcome

    async def _answer(self, pending: Pending, reply: Reply, extra: dict[str, Any]
                      ) -> tuple[OutcomeKind, Decision, Mapping[str, Any] | None, bytes | None]:
        """Inspect the upstream's answer: what to deliver, or the refusal that withholds it."""
        subject = pending.subject
        if subject is None:  # no policy: nothing can inspect it
            return "refuse", NOT_FORWARDED, None, None
        scan = await self._scan(pending, subject, reply.message, reply.raw)
        refusal = withheld_by(scan)
        if refusal is not None:
            await self._clear_pending(pending)
            return "refuse", refusal, None, None
        refusal = await self._record(pending, subject, reply.message, done=True)
        if refusal is not None:
            extra["withheld"] = {"verdict": pending.decision.verdict.value,
                                 "code": pending.decision.code.value}
            return "refuse", refusal, None, None
        return "deliver", pending.decision, reply.message, (None if scan.changed else reply.raw)

    async def _scan(self, pending: Pending, subject: Subject, message: dict[str, Any],
                    raw: bytes | None = None) -> Scan:
        chain = pending.chain
        assert chain is not None
        scan = await chain.inspector.scan(subject, message, raw)
        if scan.guarded.fired:
            pending.notes.add_guarded(scan.guarded)
        if scan.stripped:
            pending.notes.meta_stripped += 1
        if scan.guarded.fired:
            blocked = scan.guarded.blocking is not None
            for fired in scan.guarded.fired:
                if not blocked or fired.rule.action != "redact":  # a withheld answer redacts nothing
                    self.metrics.guardrail_action(subject.metric_tool, fired.rule.action)
        if scan.error is not None:
            self.metrics.check_error("guardrails")
        return scan

    async def _record(self, pending: Pending, subject: Subject | None, message: Mapping[str, Any],
                      *, done: bool) -> Decision | None:
        """Record what the client will receive in the run's ledger (and clear the call's
        pending marker when `done`); the refusal that withholds it when it cannot be recorded
        in enforce mode, else None."""
        chain, call = pending.chain, pending.call
        if chain is None or subject is None or not chain.inspector.recording:
            return None
        inspector = chain.inspector
        store = self.services.store
        if store is None:
            if subject.labels.tracked:
                call.audit_extra.setdefault("dataflow_error", "no state store: flows are not tracked")
            return None
        result = message.get("result")
        # Only an answer without an error confirms the record a read asked for.
        answered = subject.tool_result and isinstance(result, Mapping) and result.get("isError") is not True
        secret = None
        if inspector.escalates:
            try:
                secret = await pick_secret(store)
            except (StoreError, TimeoutError) as exc:
                # Its listings then record no picks (endorse less: escalate more); writing the
                # delta below meets the same store and refuses what it must.
                log.warning("data-flow pick secret unavailable for run %s: %s", call.run.id, exc)
                call.audit_extra["dataflow_error"] = f"pick secret unavailable: {exc or 'timed out'}"
        delta = await inspector.delta(subject, message, handles=call.read_handles if answered else (),
                                      pointed=call.read_pointed and answered, pick_secret=secret)
        marker = call.ledger_pending if done else None
        if delta.empty and marker is None:
            return None
        try:
            await inspector.record(store, self.services.recent, call.run, delta, marker)
        except (StoreError, TimeoutError) as exc:
            # A pending marker stays: past its deadline the run counts as coarse (fail closed).
            log.error("data-flow ledger of run %s not updated: %s", call.run.id, exc)
            call.audit_extra["dataflow_error"] = f"ledger not updated: {exc or 'timed out'}"
            # Trusted content that endorses only is delivered all the same: what it would have
            # endorsed is not, so the run escalates more, never less.
            if inspector.dataflow.mode == "enforce" and delta.taints:
                what = "untrusted" if delta.untrusted else "secret"
                return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, "dataflow",
                                f"the run's data-flow ledger cannot record this {what} content "
                                f"({exc or 'timed out'}); it is withheld")
            return None
        if marker is not None:
            call.ledger_pending = None
        pending.notes.add_recorded(delta)
        return None

    async def stream_opens(self, pending: Pending) -> Decision | None:
        """The call's answer is an SSE stream, which its client may resume elsewhere (GET +
        Last-Event-ID, possibly on another replica): the pending marker the data-flow check asked
        for (`ToolCall.ledger_due`) goes in the run's ledger before anything of it is relayed.
        The refusal that withholds the stream when the store cannot take it in enforce mode
        (shadow notes it and goes on), else None."""
        call, chain, store = pending.call, pending.chain, self.services.store
        deadline, call.ledger_due = call.ledger_due, None
        if deadline is None or chain is None or store is None:
            return None
        try:
            await chain.inspector.mark(store, self.services.recent, call.run, call.decision_id, deadline)
        except (StoreError, TimeoutError) as exc:
            log.error("data-flow ledger of run %s cannot take the pending marker of decision %s: %s",
                      call.run.id, call.decision_id, exc)
            call.audit_extra["dataflow_error"] = f"pending marker not written: {exc or 'timed out'}"
            if chain.inspector.dataflow.mode == "enforce":
                return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, "dataflow",
                                f"the run's data-flow ledger cannot say that this call's stream is on its "
                                f"way ({exc or 'timed out'}); it is withheld")
            return None
        call.ledger_pending = call.decision_id
        return None

    async def _clear_pending(self, pending: Pending) -> None:
        """Nothing will be delivered: clear the call's pending ledger marker (if it left one)."""
        call = pending.call
        store = self.services.store
        chain = pending.chain
        if call.ledger_pending is None or store is None or chain is None:
            return
        try:
            await chain.inspector.record(store, self.services.recent, call.run,
                                         LedgerDelta(call.qualified_name), call.ledger_pending)
            call.ledger_pending = None
        except (StoreError, TimeoutError) as exc:  # it expires into a coarse run: fail closed
            log.warning("pending ledger marker of decision %s not cleared: %s", call.decision_id, exc)

    # -- the audit record -------------------------------------------------------------------

    def _write(self, pending: Pending, decision: Decision, extra: dict[str, Any],
               upstream_status: int | None, upstream_seconds: float | None,
               delivered: Mapping[str, Any] | None = None, *, answered: bool = False) -> Decision:
        """Write the call's record with its result fields, count it; the decision, or the
        `audit_unavailable` refusal when the log cannot take it (saying the result is withheld
        only when the upstream `answered`: a call refused before forwarding was never
        performed, and its reason must not suggest otherwise)."""
        call = pending.call
        now = time.perf_counter()
        latency = {"envelope": pending.envelope_seconds, "total": now - pending.started}
        if upstream_seconds is not None:
            latency["upstream"] = upstream_seconds
        record = pending.record
        if record is None:
            record = build_record(
                decision_id=call.decision_id, revision="none", principal=call.principal.id,
                session=call.run.session, run=call.run.id, upstream=call.upstream, tool=call.tool,
                verdict=decision.verdict, code=decision.code, check=decision.check,
                rule=decision.rule, reason=decision.reason, arguments={}, log_args=False,
                latency={}, upstream_status=None, method=call.request.method, canonical=b"{}")
        merged = {**extra, **call.audit_extra}
        if pending.noted is not None:
            merged.update(pending.noted.audit())
        if decision.audit:
            merged.update(decision.audit)
        record.update(ts=utc_timestamp(), verdict=decision.verdict.value, code=decision.code.value,
                      check=decision.check, rule=decision.rule, reason=decision.reason,
                      latency_ms={k: round(s * 1e6) / 1000 for k, s in latency.items()},
                      upstream_status=upstream_status)
        if merged:
            record["extra"] = merged
        if tracing.TRACER is not None:
            tracing.recorded(record)
        t_audit = time.perf_counter()
        m = self.metrics
        try:
            self.audit.write(record)
        except AuditError:
            m.audit_write_failure()
            log.error("audit write failed for decision %s (%s %s, %s): %s; the answer is withheld "
                      "and calls are refused until the log is writable", call.decision_id,
                      call.request.method, call.qualified_name, decision.code.value,
                      self.audit.last_error)
            return AUDIT_FAILED if answered else AUDIT_DOWN
        done = time.perf_counter()
        m.audit_record()
        m.decision(call.upstream, self._label(pending), decision.verdict.value, decision.code.value)
        m.observe_stage("envelope", pending.envelope_seconds)
        m.observe_stage("audit", done - t_audit)
        m.observe_stage("total", done - pending.started)
        if upstream_seconds is not None:
            m.observe_stage("upstream", upstream_seconds)
        if self.recorder is not None and call.request.method == "tools/call":
            self.recorder.record(pending, decision, delivered)  # never raises: logged, counted
        return decision

    @staticmethod
    def _label(pending: Pending) -> str:
        subject = pending.subject
        if subject is not None:
            return subject.metric_tool
        return UNKNOWN_TOOL_LABEL

    # -- messages that are not a call's answer ---------------------------------------------------

    async def inspect_event(self, pending: Pending, message: dict[str, Any]) -> Relayed:
        """Inspect one message of a call's stream before it is relayed (a notification, a
        server-to-client request): what it did goes into the call's record. A refusal ends the
        call (the executor withholds the message and ends the call with it)."""
        subject = pending.subject
        if subject is None:
            return Relayed(message, False, NOT_FORWARDED)
        scan = await self._scan(pending, subject, message)
        refusal = withheld_by(scan)
        if refusal is None:
            refusal = await self._record(pending, subject, message, done=False)
        return Relayed(message, scan.changed, refusal)

    async def relay(self, call: ToolCall, message: dict[str, Any], *, record: bool = True) -> Relayed:
        """Inspect a message outside any call's answer (a standalone GET stream, the reply to a
        request the envelope does not decide). `call` says whose run it reaches
        (`proxy.fronts.calls.read_from`); `record` False keeps it out of the run's ledger (a
        server's self-description: initialize, lists). An audit record is written when the
        inspection acted: a guardrail fired, the content was withheld, or the ledger could not
        record it."""
        pending = self.begin_read(call)
        subject = pending.subject
        if pending.decision.refused or subject is None:  # no policy, or the audit log is down
            return Relayed(message, False, pending.decision if pending.decision.refused else NOT_FORWARDED)
        scan = await self._scan(pending, subject, message)
        refusal = withheld_by(scan)
        if refusal is None and record:
            refusal = await self._record(pending, subject, message, done=False)
        if refusal is not None or scan.guarded.fired or "dataflow_error" in call.audit_extra:
            self._write(pending, refusal or pending.decision, {}, None, None)
        return Relayed(message, scan.changed, refusal)

    def begin_read(self, call: ToolCall) -> Pending:  # implemented by Envelope
        raise NotImplementedError

    # -- requests refused at the front ------------------------------------------------------------

    def reject(self, *, upstream: str | None, method: str, path: str, reason: str,
               extra: Mapping[str, Any]) -> str:
        """Audit a request refused before any check (a header value that is not a valid field
        value): one record, `invalid_request` from check `guard`. Returns its decision id.
        Never raises: a failing audit log is counted and logged (the request is refused
        anyway)."""
        chain = self.chain
        decision_id = uuid.uuid4().hex
        record = build_record(
            decision_id=decision_id, revision=chain.revision.revision if chain is not None else "none",
            principal="<unverified>", session=None, run="-", upstream=upstream or "-",
            tool="<request>", verdict=Verdict.DENY, code=Code.INVALID_REQUEST, check="guard",
            rule=None, reason=reason, arguments={}, log_args=False, latency={}, upstream_status=None,
            extra={"http_method": method, "path": path[:200], **extra}, method="<request>",
            canonical=b"{}")
        try:
            self.audit.write(record)
        except AuditError:
            self.metrics.audit_write_failure()
            log.error("audit write failed for rejected request %s: %s", decision_id, self.audit.last_error)
            return decision_id
        self.metrics.audit_record()
        self.metrics.decision(upstream or "-", UNKNOWN_TOOL_LABEL, Verdict.DENY.value,
                              Code.INVALID_REQUEST.value)
        return decision_id

    def note_approval(self, *, principal: str, run: str, upstream: str, tool: str, args_digest: str,
                      approver: str, verdict: Verdict, code: Code, reason: str,
                      extra: Mapping[str, Any]) -> str:
        """Audit a person's decision on an approval (the admin API's approve or deny): one record
        of method and tool `<approval>` (as `<intent>`: never counted as a call of the tool),
        check `approval`, the approved call's principal, run, upstream and argument digest, its
        tool in `extra.tool`, written before the decision is stored. Returns its decision id;
        raises AuditError when the audit log cannot take it (the caller then decides nothing: a
        decision releases a gated call, so it is never made unaudited). The record names the
        call by its digest (the canonical arguments are not at hand here; the approval keeps
        them)."""
        return self._note_admin("<approval>", "approval", principal, run, upstream, verdict, code, reason,
                                {"approver": approver, "tool": tool, **extra}, args_digest)

    def note_intent(self, *, principal: str, run: str, approver: str, verdict: Verdict, code: Code,
                    reason: str, extra: Mapping[str, Any]) -> str:
        """Audit an intent set for a run through the admin API (`proxy.envelope.dataflow.intent`):
        one record of method and tool `<intent>`, check `intent`, before the intent is stored.
        Returns its decision id; raises AuditError when the audit log cannot take it (the
        caller then stores nothing: an intent narrows verdicts, so it is never set unaudited)."""
        return self._note_admin("<intent>", "intent", principal, run, "-", verdict, code, reason,
                                {"approver": approver, **extra})

    def note_release(self, *, principal: str, run: str, upstream: str, tool: str, args_digest: str,
                     approver: str, verdict: Verdict, code: Code, reason: str,
                     extra: Mapping[str, Any]) -> str:
        """Audit an approver releasing an idempotency key whose outcome is unknown (the admin
        API's `POST /v1/idempotency/<decision id>/release`): one record of method and tool
        `<idempotency>`, check `idempotency`, the call's principal, run, upstream and argument
        digest, its tool in `extra.tool`, written before the key is released. Returns its
        decision id; raises AuditError when the audit log cannot take it (the caller then
        releases nothing: a release lets the call be performed again)."""
        return self._note_admin("<idempotency>", "idempotency", principal, run, upstream, verdict,
                                code, reason, {"approver": approver, "tool": tool, **extra},
                                args_digest)

    def note_failed_approver(self, *, reason: str, extra: Mapping[str, Any]) -> str:
        """Audit approver authentication failing on approve, deny, a run's intent or a release
        (`proxy.admin.failed_auth`, which bounds how often): one record of method and tool
        `<approval>`, check `approval`, verdict deny, code `unauthorized`, principal
        `<unverified>` (no token named anyone).
        Returns its decision id; raises AuditError when the audit log cannot take it."""
        return self._note_admin("<approval>", "approval", "<unverified>", "-", "-", Verdict.DENY,
                                Code.UNAUTHORIZED, reason, dict(extra))

    def _note_admin(self, method: str, check: str, principal: str, run: str, upstream: str,
                    verdict: Verdict, code: Code, reason: str, extra: dict[str, Any],
                    args_digest: str | None = None) -> str:
        """One audit record of an admin API action (`method` is also its tool), written now;
        its decision id. AuditError propagates (counted) so the caller acts on nothing."""
        chain = self.chain
        decision_id = uuid.uuid4().hex
        record = build_record(
            decision_id=decision_id, revision=chain.revision.revision if chain is not None else "none",
            principal=principal, session=None, run=run, upstream=upstream, tool=method,
            verdict=verdict, code=code, check=check, rule=None, reason=reason, arguments={},
            log_args=False, latency={}, upstream_status=None, extra=extra, method=method,
            canonical=b"{}")
        if args_digest is not None:
            record["args_digest"] = args_digest
        try:
            self.audit.write(record)
        except AuditError:
            self.metrics.audit_write_failure()
            raise
        self.metrics.audit_record()
        return decision_id
