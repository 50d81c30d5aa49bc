"""Failed approver authentication on the routes that act, on the audit record, bounded.

A 401 on `POST /v1/approvals/<id>/approve` or `/deny`, on `POST /v1/runs/<run>/intent` or on
`POST /v1/idempotency/<decision id>/release` is a
token being guessed, or a revoked one still in use: a security review wants it on record, not
only counted. Every one is counted (`envelope_admin_rejected_requests_total{reason=
"unauthenticated"}`); the audit log gets at most two records per `WINDOW` however fast they
come, over all those routes (one limiter per admin application: `failed_auth_of`): the first
failure after a quiet window at once, and every failure after it within the window as one
aggregated record when the window closes (their count, first and last time, and at most
`MAX_NAMED` distinct remote addresses, approval ids, runs and decision ids). A flood sustained for a day
writes at most 2,880 records (about 2 MB).

The records are of the kind a refused decision already is (`Envelope.note_failed_approver`:
method and tool `<approval>`, check `approval`, verdict deny, code `unauthorized`), so `audit
verify`, `audit query`, the decisions API and the review page read them unchanged. A 421 (wrong
Host) is not audited: nothing was attempted under any name (the MCP listener's 421 is not either).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from proxy.audit.record import utc_timestamp
from proxy.errors import AuditError

log = logging.getLogger(__name__)

WINDOW = 60.0  # seconds between one failure's own record and the next record
MAX_NAMED = 10  # distinct remote addresses, approval ids and runs an aggregated record names

Token = Literal["missing", "unknown"]
# What the refused request would have done: decide an approval, set a run's intent, or release
# an idempotency key whose outcome is unknown.
Action = Literal["approve", "deny", "intent", "release"]


@dataclass(slots=True)
class _Held:
    """The failures since the last record, not yet written."""

    first: str
    last: str = ""
    count: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    remotes: set[str] = field(default_factory=set)
    approvals: set[str] = field(default_factory=set)
    runs: set[str] = field(default_factory=set)
    decisions: set[str] = field(default_factory=set)

    def add(self, token: Token, remote: str, subject: str, action: Action, ts: str) -> None:
        self.count += 1
        self.last = ts
        self.tokens[token] = self.tokens.get(token, 0) + 1
        if len(self.remotes) < MAX_NAMED:
            self.remotes.add(remote)
        named = (self.runs if action == "intent" else self.decisions if action == "release"
                 else self.approvals)
        if len(named) < MAX_NAMED:
            named.add(subject)


class FailedApproverAuth:
    """Audits failed approver authentication on decisions, intents and releases, at most two
    records per window."""

    def __init__(self, envelope: Any, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._envelope = envelope
        self._window = window
        self._clock = clock
        self._written: float | None = None  # when the last record was written (clock)
        self._held: _Held | None = None
        self._timer: asyncio.TimerHandle | None = None

    def failed(self, request: web.Request, token: Token, subject: str, action: Action) -> None:
        """Note one 401 of `action` on `subject` (the approval id to approve or deny, the run
        whose intent was to be set, the decision whose key was to be released; a marker such as `<invalid approval id>` when the caller
        found it not well formed; cut at 100 characters). Never raises: the request is refused
        whatever the audit log does."""
        now, ts = self._clock(), utc_timestamp()
        remote, subject = (request.remote or "-")[:64], subject[:100]
        if self._held is None and (self._written is None or now - self._written >= self._window):
            if action == "intent":
                reason = f"intent for run {subject!r} not set"
                named: dict[str, Any] = {"run": subject, "action": action}
            elif action == "release":
                reason = f"idempotency key of decision {subject!r} not released"
                named = {"decision_id": subject, "action": action}
            else:
                reason = f"approval {subject!r} not {action}d"
                named = {"approval_id": subject, "decision": action}
            self._write(f"approver authentication failed ({token} token): {reason}",
                        {**named, "token": token, "remote": remote, "failures": 1})
            return
        if self._held is None:
            self._held = _Held(first=ts)
        self._held.add(token, remote, subject, action, ts)
        if self._timer is None:
            due = (self._written or now) + self._window - now
            self._timer = asyncio.get_running_loop().call_later(max(due, 0.0), self.flush)

    def flush(self) -> None:
        """Write the failures held since the last record as one (the window's end, and the
        admin listener's shutdown, before the audit log closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, None
        if held is None:
            return
        self._write(f"approver authentication failed {held.count} times from {held.first} to "
                    f"{held.last} (aggregated: at most two records per {self._window:g} s)",
                    {"failures": held.count, "first": held.first, "last": held.last,
                     "tokens": held.tokens, "remotes": sorted(held.remotes),
                     "approval_ids": sorted(held.approvals), "runs": sorted(held.runs),
                     "decision_ids": sorted(held.decisions)})

    async def close(self, app: web.Application) -> None:
        """`on_cleanup` of the admin application: what is held is written."""
        self.flush()

    def _write(self, reason: str, extra: dict[str, Any]) -> None:
        self._written = self._clock()
        try:
            self._envelope.note_failed_approver(reason=reason, extra=extra)
        except AuditError as exc:  # counted by the envelope; the 401 stands either way
            log.warning("failed approver authentication not audited: %s", exc)


def token_of(request: web.Request) -> Token:
    """Which failure a 401 is: no bearer token sent, or one no approver holds."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return "unknown" if scheme.lower() == "bearer" and token.strip() else "missing"


# The admin application's one limiter (`failed_auth_of`).
FAILED_AUTH = web.AppKey("envelope.admin.failed_auth", FailedApproverAuth)


def failed_auth_of(app: web.Application, envelope: Any) -> FailedApproverAuth | None:
    """The limiter every route of `app` notes its failed approver authentication with (made on
    first use, written out at the app's cleanup); None without an envelope (nothing to audit to)."""
    if envelope is None:
        return None
    failures = app.get(FAILED_AUTH)
    if failures is None:
        app[FAILED_AUTH] = failures = FailedApproverAuth(envelope)
        app.on_cleanup.append(failures.close)
    return failures
