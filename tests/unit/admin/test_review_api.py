"""The review page's admin endpoints on a real aiohttp app and a real audit directory:
`/v1/decision-stats` (window, filters, bounded scan) and `/v1/approvals/{id}/recent` (the
approval's own run and principal, bounded scan), both behind an approver token."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.admin import review
from proxy.admin.app import build_admin_app
from proxy.approvals.approvers import Approvers
from proxy.approvals.records import CallBinding
from proxy.approvals.service import ApprovalService
from proxy.audit.query import ts_key
from proxy.config import ApprovalsConfig, ApproverConfig
from proxy.observability.metrics import Metrics
from proxy.store.memory import MemoryStore

TOKEN = "reviewer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONFIG = ApprovalsConfig(approvers={
    "rev": ApproverConfig(token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())})


class Status:
    def __init__(self, audit_dir: Path | None) -> None:
        self.config = SimpleNamespace(audit_dir=audit_dir)
        self.approvers = Approvers(CONFIG)
        self.approvals = ApprovalService(MemoryStore(), CONFIG)

    def readiness(self) -> list[str]:
        return []

    def policy_status(self) -> dict[str, Any]:
        return {"revision": "r"}


def rec(minutes_ago: float, verdict: str = "allow", *, run: str = "run-1", principal: str = "ops",
        tool: str = "send", code: str = "ok") -> dict[str, Any]:
    return {"ts": ts_key(datetime.now(UTC) - timedelta(minutes=minutes_ago)), "verdict": verdict,
            "decision_id": f"d-{minutes_ago}-{run}-{principal}", "run": run, "principal": principal,
            "upstream": "mail", "tool": tool, "code": code, "reason": "r"}


def write_log(directory: Path, records: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ordered = sorted(records, key=lambda r: r["ts"])  # a log is written oldest first
    (directory / "audit.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ordered))


@pytest.fixture
def status(tmp_path: Path) -> Status:
    return Status(tmp_path / "audit")


@pytest.fixture
async def client(status: Status) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(build_admin_app(status, Metrics()))) as c:
        yield c


async def test_stats_need_a_token_and_a_window_within_bounds(client: TestClient[Any, Any]) -> None:
    assert (await client.get("/v1/decision-stats")).status == 401
    for window in ("0m", "30s", "25h", "2d", "2026-01-01", "soon", "1h ago"):
        resp = await client.get("/v1/decision-stats", params={"window": window}, headers=AUTH)
        assert resp.status == 400, window
    # No log written yet: an empty picture, not an error.
    resp = await client.get("/v1/decision-stats", headers=AUTH)
    assert resp.status == 200
    body = await resp.json()
    assert (body["count"], body["window"], body["bucket_seconds"]) == (0, "1h", 60)
    assert len(body["buckets"]) in (60, 61)  # 61 unless the hour began on a whole minute


async def test_stats_count_the_window_and_follow_filters(status: Status,
                                                         client: TestClient[Any, Any]) -> None:
    assert status.config.audit_dir is not None
    write_log(status.config.audit_dir, [
        rec(1), rec(2, "deny", code="arg_rule_violation"), rec(3, "deny", principal="bot"),
        rec(20, "error", code="upstream_error"), rec(90)])
    body = await (await client.get("/v1/decision-stats", headers=AUTH)).json()
    assert body["totals"] == {"allow": 1, "deny": 2, "error": 1}
    assert body["top_refused_codes"][0] == {"code": "arg_rule_violation", "count": 1}
    body = await (await client.get("/v1/decision-stats", headers=AUTH,
                                   params={"window": "15m", "principal": "ops"})).json()
    assert body["totals"] == {"allow": 1, "deny": 1, "error": 0}
    assert body["top_refused_tools"] == [{"tool": "mail.send", "count": 1}]
    body = await (await client.get("/v1/decision-stats", headers=AUTH,
                                   params={"window": "24h"})).json()
    assert (body["count"], body["bucket_seconds"]) == (5, 480)


async def test_stats_without_an_audit_log_is_503(tmp_path: Path) -> None:
    async with TestClient(TestServer(build_admin_app(Status(None), Metrics()))) as c:
        resp = await c.get("/v1/decision-stats", headers=AUTH)
        assert resp.status == 503 and "no audit log" in (await resp.json())["error"]


async def test_recent_shows_the_approvals_own_run_only(status: Status,
                                                        client: TestClient[Any, Any]) -> None:
    assert status.config.audit_dir is not None
    write_log(status.config.audit_dir, [
        rec(5), rec(4, "deny"), rec(3), rec(2, run="run-2"), rec(1, principal="other")])
    approval, _ = await status.approvals.request(
        CallBinding("ops", "run-1", "mail", "send", "sha256:x"), arguments={"to": "a"},
        effect="external", reason="gated", ttl=60)
    path = f"/v1/approvals/{approval.id}/recent"
    assert (await client.get(path)).status == 401
    assert (await client.get(path, headers=AUTH, params={"limit": "101"})).status == 400
    assert (await client.get(path, headers=AUTH, params={"limit": "x"})).status == 400
    assert (await client.get("/v1/approvals/apr-none/recent", headers=AUTH)).status == 404
    # The run and principal come from the approval: a query naming another run changes nothing.
    body = await (await client.get(path, headers=AUTH, params={"run": "run-2"})).json()
    assert (body["run"], body["principal"], body["count"], body["truncated"]) == ("run-1", "ops", 3, False)
    assert [d["decision_id"] for d in body["decisions"]] == ["d-3-run-1-ops", "d-4-run-1-ops",
                                                             "d-5-run-1-ops"]
    body = await (await client.get(path, headers=AUTH, params={"limit": "1"})).json()
    assert [d["decision_id"] for d in body["decisions"]] == ["d-3-run-1-ops"]


async def test_recent_reads_a_bounded_number_of_records(status: Status, client: TestClient[Any, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert status.config.audit_dir is not None
    write_log(status.config.audit_dir, [rec(10)] + [rec(i / 100, run="busy") for i in range(1, 30)])
    monkeypatch.setattr(review, "MAX_SCAN", 20)
    approval, _ = await status.approvals.request(
        CallBinding("ops", "run-1", "mail", "send", "sha256:x"), arguments={}, effect="external",
        reason="gated", ttl=60)
    body = await (await client.get(f"/v1/approvals/{approval.id}/recent", headers=AUTH)).json()
    # The run's one call lies past the bound: not found, and said so.
    assert (body["count"], body["scanned"], body["truncated"]) == (0, 20, True)


async def test_a_pending_approval_is_listed_and_counted_whatever_else_the_store_holds(
        status: Status, client: TestClient[Any, Any]) -> None:
    # Decided approvals stay listed for `retention` (24 h): a busy day keeps thousands. The
    # listing read the first 1000 records of the namespace and then kept the pending ones, so a
    # new pending approval past them was missing from the list, the page and the gauge (broke).
    service = status.approvals
    for i in range(1001):
        old, _ = await service.request(CallBinding("ops", "run-1", "mail", "send", f"sha256:{i}"),
                                       arguments={"n": i}, effect="external", reason="gated", ttl=600)
        await service.decide(old.id, approver="rev", approve=False, reason="no")
    new, _ = await service.request(CallBinding("ops", "run-2", "mail", "send", "sha256:new"),
                                   arguments={"to": "b"}, effect="external", reason="gated", ttl=600)
    body = await (await client.get("/v1/approvals", headers=AUTH, params={"state": "pending"})).json()
    assert [a["id"] for a in body["approvals"]] == [new.id]
    assert body["truncated"] is False
    assert await service.refresh_pending() == 1
    # Decided, it leaves the pending list and the count.
    await service.decide(new.id, approver="rev", approve=True, reason="ok")
    body = await (await client.get("/v1/approvals", headers=AUTH, params={"state": "pending"})).json()
    assert body["approvals"] == [] and await service.refresh_pending() == 0
    # Every state beyond the bound is said to be cut, never silently short.
    body = await (await client.get("/v1/approvals", headers=AUTH, params={"state": "denied"})).json()
    assert (len(body["approvals"]), body["truncated"]) == (1000, True)
