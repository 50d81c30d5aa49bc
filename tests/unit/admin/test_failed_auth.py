"""Failed approver authentication on decisions, intents and releases: audited, at most two records per window."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.admin.failed_auth import MAX_NAMED, FailedApproverAuth, failed_auth_of
from proxy.errors import AuditError


class Notes:
    """What `Envelope.note_failed_approver` was asked to write."""

    def __init__(self) -> None:
        self.written: list[dict[str, Any]] = []
        self.broken = False
        self.second = asyncio.Event()  # set once two records are written

    def note_failed_approver(self, *, reason: str, extra: dict[str, Any]) -> str:
        if self.broken:
            raise AuditError("disk full")
        self.written.append({"reason": reason, **extra})
        if len(self.written) == 2:
            self.second.set()
        return "id"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _request(remote: str) -> Any:
    request = make_mocked_request("POST", "/v1/approvals/a1/approve")
    request._transport_peername = (remote, 5555)  # what `request.remote` reads
    return request


async def test_a_flood_writes_one_record_then_one_aggregate_per_window() -> None:
    notes, clock = Notes(), Clock()
    auth = FailedApproverAuth(notes, window=60.0, clock=clock)
    # One request per remote, each sent again and again (a mocked request costs ~4 ms to build;
    # `failed` reads only its remote).
    remotes = [_request(f"10.0.0.{n}") for n in range(20)]
    for i in range(1000):
        auth.failed(remotes[i % 20], "unknown" if i % 2 else "missing", f"a{i % 15}", "approve")
    [first] = notes.written
    assert first == {"reason": "approver authentication failed (missing token): approval 'a0' not "
                               "approved", "approval_id": "a0", "decision": "approve",
                     "token": "missing", "remote": "10.0.0.0", "failures": 1}
    auth.flush()  # what the window's timer does when it closes
    [_, held] = notes.written
    assert held["failures"] == 999 and held["tokens"] == {"unknown": 500, "missing": 499}
    assert len(held["remotes"]) == len(held["approval_ids"]) == MAX_NAMED  # bounded, not 20 or 15
    assert held["reason"].startswith("approver authentication failed 999 times from ")
    # The next failure within the window is held again; after a quiet window one is written at once.
    auth.failed(_request("10.0.0.1"), "unknown", "a1", "deny")
    assert len(notes.written) == 2
    auth.flush()
    clock.now += 61
    auth.failed(_request("10.0.0.1"), "unknown", "a1", "deny")
    assert [n["failures"] for n in notes.written] == [1, 999, 1, 1]


async def test_the_held_failures_are_written_when_the_window_closes() -> None:
    notes = Notes()
    auth = FailedApproverAuth(notes, window=0.05)
    for _ in range(3):
        auth.failed(_request("10.0.0.1"), "unknown", "a1", "deny")
    await notes.second.wait()  # written by the window's timer, not by the test
    assert [n["failures"] for n in notes.written] == [1, 2]


async def test_an_audit_log_that_cannot_write_leaves_the_refusal_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    notes = Notes()
    notes.broken = True
    auth = FailedApproverAuth(notes)
    auth.failed(_request("10.0.0.1"), "missing", "a1", "approve")  # never raises
    assert "failed approver authentication not audited: disk full" in caplog.text


async def test_intents_and_decisions_share_one_window_per_application() -> None:
    notes, clock = Notes(), Clock()
    app = web.Application()
    auth = failed_auth_of(app, notes)
    assert auth is not None and failed_auth_of(app, notes) is auth  # one limiter per app
    assert failed_auth_of(web.Application(), None) is None  # nothing to audit to
    auth._clock = clock
    auth.failed(_request("10.0.0.1"), "missing", "run-1", "intent")
    auth.failed(_request("10.0.0.2"), "unknown", "run-2", "intent")
    auth.failed(_request("10.0.0.2"), "unknown", "a1", "approve")
    [first] = notes.written
    assert first == {"reason": "approver authentication failed (missing token): intent for run "
                               "'run-1' not set", "run": "run-1", "action": "intent",
                     "token": "missing", "remote": "10.0.0.1", "failures": 1}
    auth.flush()
    held = notes.written[1]
    assert (held["failures"], held["runs"], held["approval_ids"]) == (2, ["run-2"], ["a1"])
    assert held["decision_ids"] == []


async def test_releases_share_the_window_and_name_their_decision_ids() -> None:
    notes, clock = Notes(), Clock()
    auth = FailedApproverAuth(notes, clock=clock)
    auth.failed(_request("10.0.0.1"), "unknown", "d" * 32, "release")
    auth.failed(_request("10.0.0.1"), "missing", "e" * 32, "release")
    auth.failed(_request("10.0.0.1"), "missing", "run-1", "intent")
    [first] = notes.written
    assert first == {"reason": "approver authentication failed (unknown token): idempotency key "
                               f"of decision {'d' * 32!r} not released", "decision_id": "d" * 32,
                     "action": "release", "token": "unknown", "remote": "10.0.0.1", "failures": 1}
    auth.flush()
    held = notes.written[1]
    assert (held["failures"], held["decision_ids"], held["runs"]) == (2, ["e" * 32], ["run-1"])
