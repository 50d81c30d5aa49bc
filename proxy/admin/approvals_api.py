"""Approvals API on the admin listener: approvers list, inspect, approve and deny gated calls.

    GET  /v1/approvals?state=pending|approved|denied|expired|consumed
    GET  /v1/approvals/{id}
    POST /v1/approvals/{id}/approve   {"reason": "...", "grant": {"scope": "tool"|"run",
                                        "args": {...}, "duration": "30m"}}   (grant optional)
    POST /v1/approvals/{id}/deny      {"reason": "..."}
    GET  /v1/grants

An approval's JSON carries its `arguments` and, for people to read, `arguments_text` (hidden
and text-reordering characters escaped) and `hidden_characters` (`proxy.approvals.reveal`), with
`arguments_bytes` (their size as compact JSON) and `arguments_truncated`. The list cuts arguments
over `LIST_ARGUMENTS_BYTES` (8 KiB): such an entry has `arguments_truncated: true`, `arguments`
and `hidden_characters` null and a preview of that many bytes as `arguments_text` (the page
polls the list; 100 approvals of 1 MB were 200 MB an answer). Read by id, or answered to an
approve or deny, an approval is always whole: approvers (the page, the CLI) decide on that one.

Every route needs `Authorization: Bearer <approver token>` (tokens from `approvals.approvers`
of the runtime config, compared by SHA-256 digest in constant time): approvals show the calls'
arguments. Answers: 401 no or unknown token (on approve and deny audited, at most two records a
minute with the intent API's: `proxy.admin.failed_auth`), 403 an approver deciding their own call
(their name and the call's principal compared ignoring case, width and invisible characters:
`proxy.approvals.approvers.same_person`) or a call outside their `scope` (`<upstream>.<tool>`
patterns of the config; such refusals are audited), 404 unknown id, 409 no longer pending, 400 bad body, 413 body too large, 408 body not
arrived within `listener.header_timeout`, 503 the store or the audit log cannot answer (fail
closed).

Every approve or deny is audited before it is stored (`Envelope.note_approval`: a record of
method `<approval>` naming the call, the approver, the decision and the reason): a decision
the audit log cannot take is not made (503). A decision that then fails (403, 404, 409, 503)
gets a second record saying so (`extra.request`: the first one's id). The approval keeps the
record's id (`decision_record`), and the call it releases names it (`extra.approval_record`).
"""

from __future__ import annotations

import asyncio
from typing import Any, get_args

import orjson
from aiohttp import web

from proxy.admin.approver import approver, reasoned
from proxy.admin.failed_auth import failed_auth_of
from proxy.admin.protect import expect, refusal
from proxy.approvals.approvers import Approvers, own_call, same_person
from proxy.approvals.records import (
    LIST_ARGUMENTS_BYTES,
    STATES,
    ApprovalConflict,
    ApprovalError,
    GrantRequest,
    OutOfScope,
    SelfApproval,
    State,
    is_approval_id,
)
from proxy.approvals.service import ApprovalService
from proxy.envelope.types import Code, Verdict
from proxy.errors import AuditError, StoreError

_NO_STORE = {"Cache-Control": "no-store"}
# What a failed-authentication record names instead of an id that is not an approval id (control
# characters, bidi overrides, ... never reach the audit log from an unauthenticated request).
INVALID_APPROVAL = "<invalid approval id>"
_MAX_BODY = 64 * 1024
_DECIDE_FIELDS, _DENY_FIELDS = frozenset({"reason", "grant"}), frozenset({"reason"})


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={**_NO_STORE, **(headers or {})})


_error = refusal


def _approval_named(request: web.Request) -> str:
    """What a failed-authentication record names: the approval id sent, or a marker."""
    sent = request.match_info["id"]
    return sent if is_approval_id(sent) else INVALID_APPROVAL


def add_routes(app: web.Application, service: ApprovalService, approvers: Approvers,
               envelope: Any = None) -> None:
    """Mount the approvals routes on the admin application. `envelope` (`proxy.envelope.
    pipeline.Envelope`) audits every decision; without one, approve and deny answer 503."""

    # Failed authentication on a decision is audited (bounded: `proxy.admin.failed_auth`).
    failures = failed_auth_of(app, envelope)

    def unavailable(exc: StoreError) -> web.Response:
        return _error(503, f"the state store ({service.store.kind}) is unavailable: {exc}")

    async def list_approvals(request: web.Request) -> web.Response:
        who = approver(request, approvers)
        if isinstance(who, web.Response):
            return who
        state = request.query.get("state")
        if state is not None and state not in STATES:
            return _error(400, f"state must be one of {', '.join(get_args(State))}")
        try:
            found, truncated = await service.listing(state)
        except StoreError as exc:
            return unavailable(exc)
        now = service.clock()
        # Views escape hidden characters, Python work per character of the arguments (up to
        # LIST_ARGUMENTS_BYTES each in a list): made in a worker thread, not on the event loop.
        views = await asyncio.to_thread(lambda: [a.view(now, LIST_ARGUMENTS_BYTES) for a in found])
        return _json({"approvals": views, "truncated": truncated})

    async def show(request: web.Request) -> web.Response:
        who = approver(request, approvers)
        if isinstance(who, web.Response):
            return who
        approval_id = request.match_info["id"]
        try:
            approval = await service.get(approval_id)
        except StoreError as exc:
            return unavailable(exc)
        if approval is None:
            return _error(404, f"no approval {approval_id}")
        return _json(await asyncio.to_thread(approval.view, service.clock()))

    async def decide(request: web.Request, approve: bool) -> web.Response:
        who = approver(request, approvers,
                       (failures, "approve" if approve else "deny", _approval_named))
        if isinstance(who, web.Response):
            return who
        body = await reasoned(request, _MAX_BODY, _DECIDE_FIELDS if approve else _DENY_FIELDS)
        if isinstance(body, web.Response):
            return body
        reason: str = body["reason"]
        approval_id = request.match_info["id"]
        try:
            grant = (GrantRequest.parse(body["grant"], service.config.max_grant_duration)
                     if body.get("grant") is not None else None)
            asked = await service.get(approval_id)
        except ApprovalError as exc:
            return _error(exc.status, str(exc))
        except StoreError as exc:
            return unavailable(exc)
        if asked is None:
            return _error(404, f"no approval {approval_id}")
        if envelope is None:
            return _error(503, "no audit log: a decision cannot be recorded, so none is made")
        verb = "approved" if approve else "denied"

        def note(verdict: Verdict, code: Code, why: str, **extra: Any) -> str:
            assert asked is not None
            decided: str = envelope.note_approval(
                principal=asked.principal, run=asked.run, upstream=asked.upstream, tool=asked.tool,
                args_digest=asked.args_digest, approver=who, verdict=verdict, code=code,
                reason=why, extra={"approval_id": asked.id, "decision": verb, **extra})
            return decided

        # What `service.decide` would refuse is refused (and audited as refused) before a record
        # says the decision was made; `decide` checks again against the stored record.
        problem: ApprovalError | None = None
        if same_person(asked.principal, who):
            problem = SelfApproval(own_call(who, asked.principal))
        elif not approvers.may_decide(who, asked.upstream, asked.tool):
            problem = OutOfScope(f"{who} may not decide calls of {asked.upstream}.{asked.tool} "
                                 f"(scope: {approvers.scope_text(who)})")
        elif (state := asked.effective_state(service.clock())) != "pending":
            problem = ApprovalConflict(f"approval {approval_id} is {state}, not pending")
        if problem is not None:
            try:
                note(Verdict.DENY, Code.INVALID_REQUEST, f"approval {approval_id} not {verb}: {problem}",
                     refused=True)
            except AuditError as exc:
                return _error(503, f"the audit log cannot take the request ({exc})")
            return _error(problem.status, str(problem))
        try:
            record_id = note(Verdict.ALLOW if approve else Verdict.DENY,
                             Code.OK if approve else Code.APPROVAL_DENIED,
                             f"approval {approval_id} {verb} by {who}: {reason}",
                             **({"grant": {"scope": grant.scope, "duration": grant.duration}}
                                if grant is not None else {}))
        except AuditError as exc:
            return _error(503, f"the audit log cannot take the decision ({exc}); nothing was decided")
        try:
            approval, granted = await service.decide(
                approval_id, approver=who, approve=approve, reason=reason,
                grant=grant, record=record_id,
            )
        except (ApprovalError, StoreError) as exc:
            try:  # best effort: the record above said it was asked for; say it was not made
                note(Verdict.DENY if isinstance(exc, ApprovalError) else Verdict.ERROR,
                     Code.INVALID_REQUEST if isinstance(exc, ApprovalError) else Code.STORE_UNAVAILABLE,
                     f"approval {approval_id} not {verb}: {exc}", refused=True, request=record_id)
            except AuditError:
                pass
            if isinstance(exc, ApprovalError):
                return _error(exc.status, str(exc))
            return unavailable(exc)
        now = service.clock()
        if approval.apart:  # answered whole: the arguments `asked` read apart
            approval = approval.with_arguments(asked.arguments)
        data = await asyncio.to_thread(approval.view, now)
        if granted is not None:
            data["grant"] = granted.view(now)
        return _json(data)

    async def approve(request: web.Request) -> web.Response:
        return await decide(request, True)

    async def deny(request: web.Request) -> web.Response:
        return await decide(request, False)

    async def grants(request: web.Request) -> web.Response:
        who = approver(request, approvers)
        if isinstance(who, web.Response):
            return who
        try:
            found, truncated = await service.grant_listing()
        except StoreError as exc:
            return unavailable(exc)
        now = service.clock()
        return _json({"grants": [g.view(now) for g in found if now < g.expires_at],
                      "truncated": truncated})

    app.router.add_get("/v1/approvals", list_approvals, expect_handler=expect)
    app.router.add_get("/v1/approvals/{id}", show, expect_handler=expect)
    app.router.add_post("/v1/approvals/{id}/approve", approve, expect_handler=expect)
    app.router.add_post("/v1/approvals/{id}/deny", deny, expect_handler=expect)
    app.router.add_get("/v1/grants", grants, expect_handler=expect)
