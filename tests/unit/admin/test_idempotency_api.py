"""`POST /v1/idempotency/<decision id>/release`: who may release, what is audited, and that a
key is deleted only while it holds that decision's `unknown` record."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.admin.app import build_admin_app
from proxy.approvals.approvers import Approvers
from proxy.config import ApprovalsConfig, ApproverConfig
from proxy.envelope.checks.idempotency import NS, UNKNOWN_NS
from proxy.errors import AuditError
from proxy.observability.metrics import Metrics
from proxy.store.memory import MemoryStore

FIRST = "0123456789abcdef0123456789abcdef"
KEY = "f" * 64
# `Agent` is the caller `agent` to the self-release rule (names compared as read).
TOKENS = {"op": "op-token", "narrow": "narrow-token", "agent": "agent-token", "Agent": "Agent-token"}


class FakeEnvelope:
    """The audit side of the envelope: every note kept; `down` makes the audit log refuse."""

    def __init__(self) -> None:
        self.notes: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.down = False

    def note_release(self, **note: Any) -> str:
        if self.down:
            raise AuditError("disk full")
        self.notes.append(note)
        return f"rec-{len(self.notes)}"

    def note_failed_approver(self, *, reason: str, extra: Any) -> str:
        self.failed.append({"reason": reason, **extra})
        return "rec-failed"


class Status:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.envelope = FakeEnvelope()
        self.approvers = Approvers(ApprovalsConfig(approvers={
            name: ApproverConfig(token_sha256=hashlib.sha256(token.encode()).hexdigest(),
                                 **({"scope": ["other.*"]} if name == "narrow" else {}))
            for name, token in TOKENS.items()}))

    def readiness(self) -> list[str]:
        return []

    def policy_status(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def status() -> Status:
    return Status()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(status: Status, metrics: Metrics) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(build_admin_app(status, metrics))) as c:
        yield c


async def _unknown(status: Status, record: dict[str, Any] | None = None) -> bytes:
    raw = orjson.dumps(record or {"state": "unknown", "decision_id": FIRST, "args_digest": "x",
                                  "code": "upstream_error"})
    await status.store.put(NS, KEY, raw, ttl=60)
    await status.store.put(UNKNOWN_NS, FIRST, orjson.dumps({
        "key": KEY, "shown": "k-1", "principal": "agent", "run": "run-1", "upstream": "demo",
        "tool": "write_note", "args_digest": "x"}), ttl=60)
    return raw


async def _post(client: TestClient[Any, Any], who: str | None, body: Any = None,
                decision: str = FIRST) -> Any:
    headers = {"Authorization": f"Bearer {TOKENS[who]}"} if who else {}
    return await client.post(f"/v1/idempotency/{decision}/release", headers=headers,
                             json={"reason": "checked"} if body is None else body)


def _releases(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("envelope_idempotency_releases_total") or 0.0


async def test_release_audits_then_deletes_the_key_and_its_index(
        client: TestClient[Any, Any], status: Status, metrics: Metrics) -> None:
    await _unknown(status)
    resp = await _post(client, "op")
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["record"] == "rec-1"
    [note] = status.envelope.notes
    assert (note["approver"], note["principal"], note["tool"], note["verdict"].value) == (
        "op", "agent", "write_note", "allow")
    assert note["extra"]["released_from"] == FIRST and "checked" in note["reason"]
    assert await status.store.get(NS, KEY) is None
    assert await status.store.get(UNKNOWN_NS, FIRST) is None
    assert _releases(metrics) == 1
    assert (await _post(client, "op")).status == 404


async def test_a_key_holding_another_call_is_409_audited_and_kept(
        client: TestClient[Any, Any], status: Status, metrics: Metrics) -> None:
    done = await _unknown(status, {"state": "done", "decision_id": "d-retry", "args_digest": "x",
                                   "result": {}})
    resp = await _post(client, "op")
    assert resp.status == 409, await resp.text()
    assert await status.store.get(NS, KEY) == done
    [note] = status.envelope.notes
    assert note["extra"]["refused"] is True and note["verdict"].value == "deny"
    assert _releases(metrics) == 0


async def test_audit_log_down_releases_nothing(client: TestClient[Any, Any], status: Status) -> None:
    raw = await _unknown(status)
    status.envelope.down = True
    assert (await _post(client, "op")).status == 503
    assert await status.store.get(NS, KEY) == raw


@pytest.mark.parametrize("who,code", [("agent", 403), ("Agent", 403), ("narrow", 403), (None, 401)])
async def test_only_an_approver_who_may_decide_the_call_releases_it(
        client: TestClient[Any, Any], status: Status, who: str | None, code: int) -> None:
    raw = await _unknown(status)
    assert (await _post(client, who)).status == code
    assert await status.store.get(NS, KEY) == raw
    if who is None:
        [failed] = status.envelope.failed
        assert (failed["decision_id"], failed["action"]) == (FIRST, "release")
    else:
        assert status.envelope.notes[0]["extra"]["refused"] is True


async def test_unauthenticated_release_of_an_invalid_id_names_no_bytes_of_it(
        client: TestClient[Any, Any], status: Status) -> None:
    assert (await _post(client, None, decision="%E2%80%AEx")).status == 401
    assert status.envelope.failed[0]["decision_id"] == "<invalid decision id>"


@pytest.mark.parametrize("body", [[1], {"reason": 3}, {"reason": "x", "more": 1}])
async def test_a_bad_body_is_400(client: TestClient[Any, Any], status: Status, body: Any) -> None:
    await _unknown(status)
    assert (await _post(client, "op", body)).status == 400


@pytest.mark.parametrize("body", [{}, {"reason": ""}, {"reason": " \t\n"}, {"reason": None}])
async def test_a_release_needs_a_reason_as_approve_and_deny_do(
        client: TestClient[Any, Any], status: Status, metrics: Metrics, body: Any) -> None:
    # A release lets a writer be performed again: an approver's decision, recorded with why.
    # Without a reason nothing is released and nothing is audited as released.
    held = await _unknown(status)
    resp = await _post(client, "op", body)
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"] == "a reason is required"
    assert status.envelope.notes == []
    assert await status.store.get(NS, KEY) == held
    assert await status.store.get(UNKNOWN_NS, FIRST) is not None
    assert _releases(metrics) == 0
