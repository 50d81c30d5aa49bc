"""Admin API to release an idempotency key whose outcome is unknown.

    POST /v1/idempotency/{decision_id}/release   {"reason": "..."}   (reason required)

A keyed or gated writer sent upstream without a result to keep (an HTTP 5xx, a reset, a
timeout, its client left, ...) leaves an `unknown` record on its key: every retry is refused
`idempotency_in_flight`, naming that decision (`proxy.envelope.checks.idempotency`). An approver
who checked the upstream and knows the call was not performed releases the key, by the decision
id the refusal names: the next call with that key is performed.

Needs `Authorization: Bearer <approver token>` (401 otherwise, audited at most two records a
minute with approve's, deny's and intent's: `proxy.admin.failed_auth`; the record names the
decision only when it is a decision id, else `<invalid decision id>`) of an approver who may
decide the call (its `<upstream>.<tool>` within their `scope`) and did not make it (their name
and the call's principal compared ignoring case, width and invisible characters:
`proxy.approvals.approvers.same_person`; 403 otherwise, audited as refused). The release is
audited before the key is touched (`Envelope.note_release`: a record of method `<idempotency>`
naming the call, the approver, the decision id and the reason; none taken, nothing released:
503), then made by compare-and-delete: only while the key still holds that decision's `unknown` record. Answers 200 `{"decision_id",
"released": true, "idempotency_key", "principal", "run", "upstream", "tool", "record"}`
(`record`: the audit record's id), counted in `envelope_idempotency_releases_total`; 404 no
outcome unknown for that decision (never one, released already, expired); 409 the key holds
something else now (a new call's claim or result: audited as refused); 400 bad body, or no
reason (a release lets a writer be performed again: like an approve or a deny it is an
approver's decision, recorded with why; without one nothing is released or audited); 413 body
too large; 408 body not arrived within `listener.header_timeout`; 503 no store, the store or
the audit log cannot answer (fail closed).
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from aiohttp import web

from proxy.admin.approver import approver, reasoned
from proxy.admin.failed_auth import failed_auth_of
from proxy.admin.protect import expect, refusal
from proxy.approvals.approvers import own_call, same_person
from proxy.envelope.checks import idempotency
from proxy.envelope.types import Code, Verdict
from proxy.errors import AuditError, StoreError
from proxy.observability.metrics import Metrics

_MAX_BODY = 64 * 1024
# Decision ids are `uuid4().hex`. What a failed-authentication record names instead of anything
# else (control characters, bidi overrides, ... never reach the audit log unauthenticated).
DECISION_ID = re.compile(r"[0-9a-f]{32}")
INVALID_DECISION = "<invalid decision id>"


_error = refusal


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _decision_named(request: web.Request) -> str:
    """What a failed-authentication record names: the decision id sent, or a marker."""
    sent = request.match_info["decision_id"]
    return sent if DECISION_ID.fullmatch(sent) else INVALID_DECISION


def add_idempotency_routes(app: web.Application, status: Any, metrics: Metrics) -> None:
    """Mount `POST /v1/idempotency/{decision_id}/release`; the store is `status.store`, the
    audit `status.envelope`, the approvers `status.approvers`."""

    failures = failed_auth_of(app, getattr(status, "envelope", None))

    async def release(request: web.Request) -> web.Response:
        decision_id = request.match_info["decision_id"]
        approvers = getattr(status, "approvers", None)
        who = approver(request, approvers, (failures, "release", _decision_named))
        if isinstance(who, web.Response):
            return who
        body = await reasoned(request, _MAX_BODY)
        if isinstance(body, web.Response):
            return body
        reason: str = body["reason"]
        store = getattr(status, "store", None)
        envelope: Any = getattr(status, "envelope", None)
        if store is None or envelope is None:
            return _error(503, "no state store or no audit log: a release cannot be made")
        if not DECISION_ID.fullmatch(decision_id):
            return _error(404, f"no outcome unknown for decision {decision_id[:64]!r}: "
                               "not a decision id")
        try:
            found = await idempotency.find_unknown(store, decision_id)
            if found is not None and found.record is None:
                await idempotency.forget_unknown(store, decision_id)  # expired: nothing held
        except StoreError as exc:
            return _error(503, f"the state store cannot answer: {exc}")
        if found is None or found.record is None:
            return _error(404, f"no outcome unknown for decision {decision_id} (never recorded, "
                               "already released, or expired)")

        def note(verdict: Verdict, code: Code, why: str, **extra: Any) -> str:
            assert found is not None
            record: str = envelope.note_release(
                principal=found.principal, run=found.run, upstream=found.upstream,
                tool=found.tool, args_digest=found.args_digest, approver=who, verdict=verdict,
                code=code, reason=why, extra={"released_from": decision_id,
                                              "idempotency_key": found.shown, **extra})
            return record

        problem: tuple[int, str] | None = None
        try:
            held = found.held
        except StoreError as exc:
            return _error(503, f"the state store holds an unreadable record: {exc}")
        if same_person(found.principal, who):
            problem = 403, own_call(who, found.principal, "release")
        elif approvers is not None and not approvers.may_decide(who, found.upstream, found.tool):
            problem = 403, (f"{who} may not release calls of {found.upstream}.{found.tool} "
                            f"(scope: {approvers.scope_text(who)})")
        elif not held:
            problem = 409, (f"the idempotency key of decision {decision_id} holds another call "
                            "now: nothing to release")
        if problem is not None:
            try:
                note(Verdict.DENY, Code.INVALID_REQUEST,
                     f"key of decision {decision_id} not released: {problem[1]}", refused=True)
            except AuditError as exc:
                return _error(503, f"the audit log cannot take the request ({exc})")
            return _error(*problem)
        try:
            record_id = note(Verdict.ALLOW, Code.OK,
                             f"idempotency key of decision {decision_id} (outcome unknown) "
                             f"released by {who}: {reason}")
        except AuditError as exc:
            return _error(503, f"the audit log cannot take the release ({exc}); nothing was "
                               "released")
        failed: StoreError | None = None
        try:
            released = await idempotency.release(store, found)
        except StoreError as exc:
            released, failed = False, exc
        if not released:
            why = (f"the state store cannot answer: {failed}" if failed is not None else
                   f"the idempotency key of decision {decision_id} changed: nothing released")
            try:  # best effort: the record above said it was asked for; say it was not made
                note(Verdict.ERROR if failed is not None else Verdict.DENY,
                     Code.STORE_UNAVAILABLE if failed is not None else Code.INVALID_REQUEST,
                     f"key of decision {decision_id} not released: {why}", refused=True,
                     request=record_id)
            except AuditError:
                pass
            return _error(503 if failed is not None else 409, why)
        metrics.idempotency_release()
        return _json({"decision_id": decision_id, "released": True,
                      "idempotency_key": found.shown, "principal": found.principal,
                      "run": found.run, "upstream": found.upstream, "tool": found.tool,
                      "record": record_id})

    app.router.add_post("/v1/idempotency/{decision_id}/release", release, expect_handler=expect)

