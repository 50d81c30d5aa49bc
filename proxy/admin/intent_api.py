"""Admin API for a run's intent: what the user asked, set by a person instead of the framework.

    POST /v1/runs/{run}/intent   {"principal": "<principal id>", "text": "<the user's words>"}

Needs `Authorization: Bearer <approver token>` (401 otherwise, audited at most two records a
minute with approve's and deny's: `proxy.admin.failed_auth`; the record names the run only
when it is a run id, else `<invalid run id>`) of an approver without a `scope`
(403 otherwise): an intent endorses values for the data-flow check, for every tool of the run, so
setting one is an act of an approver who may decide every call; never for their own runs (403,
names compared as the self-approval rule does: `proxy.approvals.approvers.same_person`). The text is appended to the run's
intent (`proxy.envelope.dataflow.intent`; the run of that principal, as `X-Envelope-Intent`
would), after an audit record of method `<intent>` (check `intent`, the approver, the text's
length and digest, never the text) is written: an intent is never set unaudited. Answers 200
`{"run", "principal", "appended", "decision_id"}`; 400 a run that is not a run id (the rule of
`X-Envelope-Run`: `proxy.envelope.types.run_id_problem`), a principal that is no principal id
(`proxy.identity.name_problem`), bad body, control characters or over
`dataflow.max_intent_chars`; 413 body too large; 408 body not arrived within
`listener.header_timeout`; 503 no store, no policy, the store or the audit log cannot answer
(fail closed).
"""

from __future__ import annotations

import hashlib
from typing import Any
from urllib.parse import unquote

import orjson
from aiohttp import web

from proxy.admin.approver import approver
from proxy.admin.failed_auth import failed_auth_of
from proxy.admin.protect import expect, read_body
from proxy.approvals.approvers import own_call, same_person
from proxy.envelope.dataflow import intent as intents
from proxy.envelope.types import RUN_ID_RULE, Code, Verdict, run_id_problem, run_key
from proxy.errors import AuditError, StoreError
from proxy.identity import names_problem
from proxy.policy.model import DataflowPolicy

_MAX_BODY = 256 * 1024
# What a failed-authentication record names instead of a run that is not a run id (control
# characters, bidi overrides, ... never reach the audit log from an unauthenticated request).
INVALID_RUN = "<invalid run id>"


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store", **(headers or {})})


def _run(request: web.Request) -> str | web.Response:
    """The run named in the path, percent-decoded as UTF-8, or the 400 refusal naming the rule
    it breaks (`run_id_problem`, the rule `X-Envelope-Run` is held to)."""
    # From the path as sent: aiohttp's decoded `match_info` keeps bytes that are not UTF-8 as
    # their `%XX` text, which would name another run than the one sent.
    raw = request.rel_url.raw_path.split("/")[3]
    try:
        run = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        return _json({"error": f"run id: {RUN_ID_RULE}: {raw[:200]} is not UTF-8 once "
                               "percent-decoded"}, 400)
    why = run_id_problem(run)
    return run if why is None else _json({"error": f"run id: {why}"}, 400)


def _run_named(request: web.Request) -> str:
    """What a failed-authentication record names: the run sent, or a marker (checked for the
    record only: the 401 comes before the run's own 400)."""
    run = _run(request)
    return run if isinstance(run, str) else INVALID_RUN


def add_intent_routes(app: web.Application, status: Any) -> None:
    """Mount `POST /v1/runs/{run}/intent`; the store is `status.store`, the audit and the policy
    `status.envelope`, the approvers `status.approvers`."""

    # Failed authentication is audited, bounded with approve's and deny's (`failed_auth_of`).
    failures = failed_auth_of(app, getattr(status, "envelope", None))

    async def set_intent(request: web.Request) -> web.Response:
        who = approver(request, getattr(status, "approvers", None),
                       (failures, "intent", _run_named))
        if isinstance(who, web.Response):
            return who
        if status.approvers.scoped(who):
            return _json({"error": f"{who} has a scope ({status.approvers.scope_text(who)}): an "
                                   "intent endorses values for every tool of a run, so only an approver "
                                   "without a scope may set one"}, 403)
        run = _run(request)
        if isinstance(run, web.Response):
            return run
        raw = await read_body(request, _MAX_BODY)
        if isinstance(raw, web.Response):
            return raw
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if (not isinstance(body, dict) or set(body) != {"principal", "text"}
                or not isinstance(body["principal"], str) or not body["principal"]
                or not isinstance(body["text"], str) or not body["text"].strip()):
            return _json({"error": 'body must be {"principal": "<id>", "text": "<the user\'s words>"}'}, 400)
        principal, text = body["principal"], body["text"].strip()
        problem = names_problem("principal", [principal])
        if problem is not None:  # no verified identity carries it: no run of it to endorse
            return _json({"error": problem}, 400)
        if same_person(principal, who):
            # An intent endorses values its run's calls would otherwise be flagged or held for:
            # an approver's own, set by themselves, would be a self-approval in advance.
            return _json({"error": own_call(who, principal, "set the intent of", "a run of")}, 403)
        store = getattr(status, "store", None)
        envelope: Any = getattr(status, "envelope", None)
        chain = envelope.chain if envelope is not None else None
        if store is None or envelope is None or chain is None:
            return _json({"error": "no state store or no policy: a run's intent cannot be kept"}, 503)
        policy = chain.revision.document.dataflow or DataflowPolicy(mode="shadow")
        try:
            intents.checked(text, policy.max_intent_chars)
        except intents.IntentError as exc:
            return _json({"error": str(exc)}, 400)
        extra = {"intent": {"by": f"admin:{who}", "chars": len(text),
                            "sha256": hashlib.sha256(text.encode()).hexdigest()}}
        try:
            decision_id = envelope.note_intent(
                principal=principal, run=run, approver=who, verdict=Verdict.ALLOW, code=Code.OK,
                reason=f"intent set for run {run!r} by approver {who!r}", extra=extra)
        except AuditError as exc:
            return _json({"error": f"the audit log cannot take the record ({exc}); nothing was set"}, 503)
        try:
            appended = await intents.append(store, run_key(principal, run), text,
                                            max_chars=policy.max_intent_chars, ttl=policy.ledger_ttl)
        except (intents.IntentError, StoreError, TimeoutError) as exc:
            failed = isinstance(exc, intents.IntentError)
            try:  # best effort: the record above said it was asked for; say it was not set
                envelope.note_intent(
                    principal=principal, run=run, approver=who,
                    verdict=Verdict.DENY if failed else Verdict.ERROR,
                    code=Code.INVALID_REQUEST if failed else Code.STORE_UNAVAILABLE,
                    reason=f"intent for run {run!r} not set: {exc or 'timed out'}",
                    extra={**extra, "request": decision_id})
            except AuditError:
                pass
            if failed:
                return _json({"error": str(exc)}, 400)
            return _json({"error": f"the state store cannot answer: {exc or 'timed out'}"}, 503)
        return _json({"run": run, "principal": principal, "appended": appended, "decision_id": decision_id})

    app.router.add_post("/v1/runs/{run}/intent", set_intent, expect_handler=expect)
