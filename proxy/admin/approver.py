"""Who is asking, on the admin routes that need an approver, and what an approver's action sends.

Every route that reads arguments or acts (the approvals API, the decisions and shadow APIs, the
intent API, the idempotency release) needs `Authorization: Bearer <approver token>`; tokens are
compared by digest in constant time (`proxy.approvals.approvers.Approvers.authenticate`).

- `authenticate(approvers, request)`: the approver's name, or None.
- `unauthorized(request)`: the 401 every route answers, saying whether the token was missing or
  is not an approver's (the caller knows what it sent: nothing is revealed).
- `approver(request, approvers, noted=...)`: the name, or that 401 after the failure is noted on
  the bounded audit of failed approver authentication (`proxy.admin.failed_auth`): the routes
  that act (approve, deny, intent, release) pass what to note; those that read pass nothing.
- `reasoned(request, limit, fields)`: an action's body (a JSON object of the given fields with
  a non-blank `reason`, within `limit` bytes), or the refusal: approve, deny and release are
  each an approver's decision, recorded with why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from proxy.admin.failed_auth import Action, FailedApproverAuth, token_of
from proxy.admin.protect import read_body, refusal

REALM = 'Bearer realm="envelope-approvals"'
# What a failed attempt of one action is noted as: the limiter, the action, and what the
# request names (an approval id, a run, a decision id; or a marker when it is not well formed).
Noted = tuple[FailedApproverAuth | None, Action, Callable[[web.Request], str]]


def bearer(request: web.Request) -> str | None:
    """The bearer token the request sends, or None."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def authenticate(approvers: Any, request: web.Request) -> str | None:
    """The name of the approver whose token the request sends, or None (no approvers: nobody)."""
    if approvers is None:
        return None
    name: str | None = approvers.authenticate(bearer(request))
    return name


def unauthorized(request: web.Request) -> web.Response:
    """401 for a request no approver's token authenticates. A missing token and a wrong one get
    different texts, so the caller knows which mistake to fix."""
    if bearer(request) is None:
        message = "an approver token is required (Authorization: Bearer <token>)"
    else:
        message = "the bearer token is not an approver's token (wrong, or not configured here)"
    return refusal(401, message, {"WWW-Authenticate": REALM})


def approver(request: web.Request, approvers: Any,
             noted: Noted | None = None) -> str | web.Response:
    """The approver's name, or the 401; a route that acts notes the failure (`noted`: the
    limiter, the action, and a function naming what the request would have acted on)."""
    name = authenticate(approvers, request)
    if name is not None:
        return name
    if noted is not None:
        failures, action, subject = noted
        if failures is not None:
            failures.failed(request, token_of(request), subject(request), action)
    return unauthorized(request)


async def reasoned(request: web.Request, limit: int,
                   fields: frozenset[str] = frozenset({"reason"})) -> dict[str, Any] | web.Response:
    """An approver action's body: a JSON object of `fields` (at most) whose `reason` is a
    non-blank string, stripped; or the refusal (400, or `read_body`'s 413 and 408)."""
    raw = await read_body(request, limit)
    if isinstance(raw, web.Response):
        return raw
    shape = 'body must be a JSON object: {"reason": "..."}'
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        return refusal(400, shape)
    if not isinstance(body, dict):
        return refusal(400, shape)
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        return refusal(400, "a reason is required")
    unknown = set(body) - fields
    if unknown:
        return refusal(400, f"unexpected field(s): {', '.join(sorted(unknown))}")
    return {**body, "reason": reason.strip()}
