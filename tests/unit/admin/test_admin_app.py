"""Admin API: health, readiness (fail closed), metrics exposition, policy status and the audit
chain head (approver token), the Host check of the whole listener."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.admin.app import build_admin_app
from proxy.admin.protect import admin_hosts
from proxy.approvals.approvers import Approvers
from proxy.audit.log import AuditLog
from proxy.config import ApprovalsConfig, ApproverConfig
from proxy.observability.metrics import Metrics

TOKEN = "operator-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FakeStatus:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.policy: dict[str, Any] = {"revision": "rev-a", "misconfigured": []}
        self.fail = False
        self.audit: AuditLog | None = None  # none: no /v1/audit/head
        self.approvers = Approvers(ApprovalsConfig(approvers={
            "op": ApproverConfig(token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())}))

    def readiness(self) -> list[str]:
        if self.fail:
            raise RuntimeError("store unreachable")
        return list(self.reasons)

    def policy_status(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("no policy")
        return self.policy


@pytest.fixture
def status() -> FakeStatus:
    return FakeStatus()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(status: FakeStatus, metrics: Metrics) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(build_admin_app(status, metrics))) as c:
        yield c


async def test_healthz(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/healthz")
    assert resp.status == 200
    assert resp.content_type == "application/json"
    assert await resp.json() == {"status": "ok"}


async def test_readyz(client: TestClient[Any, Any], status: FakeStatus) -> None:
    resp = await client.get("/readyz")
    assert resp.status == 200 and await resp.json() == {"ready": True}
    status.reasons = ["audit log not writable: No space left on device"]
    resp = await client.get("/readyz")
    assert resp.status == 503
    assert await resp.json() == {"ready": False, "reasons": status.reasons}
    assert resp.headers["Cache-Control"] == "no-store"


async def test_readyz_fails_closed(client: TestClient[Any, Any], status: FakeStatus) -> None:
    status.fail = True
    resp = await client.get("/readyz")
    assert resp.status == 503
    body = await resp.json()
    assert body["ready"] is False and "store unreachable" in body["reasons"][0]


async def test_metrics(client: TestClient[Any, Any], metrics: Metrics) -> None:
    metrics.decision("github", "search_issues", "allow", "ok")
    metrics.set_revision("rev-a")
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    text = await resp.text()
    assert (
        'envelope_decisions_total{code="ok",tool="search_issues",upstream="github",verdict="allow"} 1.0'
        in text
    )
    assert 'envelope_policy_revision_info{revision="rev-a"} 1.0' in text


async def test_policy_status(client: TestClient[Any, Any], status: FakeStatus) -> None:
    resp = await client.get("/v1/policy", headers=AUTH)
    assert resp.status == 200 and await resp.json() == status.policy
    status.fail = True
    resp = await client.get("/v1/policy", headers=AUTH)
    assert resp.status == 500 and "no policy" in (await resp.json())["error"]


def _admin_rejected(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("envelope_admin_rejected_requests_total",
                                             {"reason": reason})
    return value or 0.0


async def test_unknown_route_and_method_are_json_refusals_and_counted(
        client: TestClient[Any, Any], metrics: Metrics) -> None:
    # aiohttp's own answers were plain text ("404: Not Found"), unlike every other admin refusal.
    resp = await client.get("/nope%0a", headers=AUTH)
    assert resp.status == 404
    assert (resp.content_type, resp.headers["Cache-Control"]) == ("application/json", "no-store")
    assert await resp.json() == {"error": "not found: GET /nope%0A"}
    resp = await client.post("/healthz")
    assert resp.status == 405
    assert resp.headers["Allow"] == "GET, HEAD"
    assert resp.content_type == "application/json"
    assert await resp.json() == {"error": "method not allowed: POST /healthz (allowed: GET, HEAD)"}
    # A handler's own 404 (the review page's assets) is answered the same way.
    resp = await client.get("/review/static/nope.js")
    assert resp.status == 404 and (await resp.json())["error"] == "not found: GET /review/static/nope.js"
    assert (_admin_rejected(metrics, "not_found"), _admin_rejected(metrics, "method_not_allowed")) == (2, 1)


async def test_policy_status_needs_an_approver_token(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/v1/policy")
    assert resp.status == 401 and "approver token" in (await resp.json())["error"]
    resp = await client.get("/v1/policy", headers={"Authorization": "Bearer wrong"})
    assert resp.status == 401
    # A wrong token is told apart from a missing one.
    assert "not an approver's token" in (await resp.json())["error"]
    # Health, readiness and metrics stay open (probes and scrapers carry no token).
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await client.get(path)).status == 200, path


@pytest.mark.parametrize("host", ["evil.example", "evil.example:9090", "127.0.0.1.nip.io"])
async def test_a_foreign_host_is_misdirected(client: TestClient[Any, Any], host: str) -> None:
    # A DNS-rebinding page reaches the listener under its own name: refused before any route,
    # open ones included.
    for path in ("/healthz", "/v1/policy", "/review"):
        resp = await client.get(path, headers={"Host": host, **AUTH})
        assert resp.status == 421, (host, path)
        assert "not allowed" in (await resp.json())["error"]


async def test_loopback_listen_and_configured_hosts_are_served(status: FakeStatus,
                                                               metrics: Metrics) -> None:
    allowed = admin_hosts("10.0.0.5", ["Admin.Internal"])
    async with TestClient(TestServer(build_admin_app(status, metrics, allowed))) as c:
        # IP literals cannot be rebound: a kubelet probe or a scraper addressing the pod by IP.
        for host in ("localhost:9090", "127.0.0.1", "[::1]:9090", "10.0.0.5:9090",
                     "admin.internal", "ADMIN.INTERNAL:9090", "10.244.1.7:9090", "[fd00::7]:9090"):
            assert (await c.get("/healthz", headers={"Host": host})).status == 200, host
        assert (await c.get("/healthz", headers={"Host": "other.internal"})).status == 421


async def test_audit_head_is_the_writers_own_and_refused_when_unknown(
        status: FakeStatus, metrics: Metrics, tmp_path: Path) -> None:
    audit = status.audit = AuditLog(tmp_path)
    written = audit.write({"tool": "echo"})
    async with TestClient(TestServer(build_admin_app(status, metrics))) as c:
        assert (await c.get("/v1/audit/head")).status == 401
        resp = await c.get("/v1/audit/head", headers=AUTH)
        assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
        head = await resp.json()
        assert (head["chain"], head["records"], head["hash"], head["file"]) == (
            "audit", 1, written, "audit.jsonl")
        # The file cut under the writer: the head served is still the one it wrote.
        (tmp_path / "audit.jsonl").write_bytes(b"")
        assert (await (await c.get("/v1/audit/head", headers=AUTH)).json())["hash"] == written
        # Not writable: 503, never the last head as if it were current.
        audit._fail(OSError("disk full"))
        resp = await c.get("/v1/audit/head", headers=AUTH)
        assert resp.status == 503
        assert "disk full" in (await resp.json())["error"] and written not in await resp.text()
    audit.close()


async def test_a_body_trickled_past_the_deadline_is_refused_408_closed_and_counted(
        status: FakeStatus, metrics: Metrics) -> None:
    # One byte at a time held the handler for as long as the client liked: the header timeout
    # ends at the head. The deadline is `listener.header_timeout` (here 0.5 s); the client keeps
    # trickling until it is answered, so the test waits on the answer, never on a clock.
    body = b'{"principal": "p", "text": "' + b"x" * 40 + b'"}'
    async with TestServer(build_admin_app(status, metrics, body_timeout=0.5)) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(f"POST /v1/runs/r/intent HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
                     f"Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        for i in range(len(body)):
            if answer.done():
                break
            writer.write(body[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.1)
        head = (await answer).decode()
        length = int(head.lower().split("content-length: ")[1].split("\r\n")[0])
        payload = await reader.readexactly(length)
        writer.close()
    assert head.startswith("HTTP/1.1 408 Request Timeout\r\n"), head
    assert "\r\nConnection: close\r\n" in head, head
    error = json.loads(payload)["error"]
    assert error.startswith("the body did not arrive within 0.5 s (listener.header_timeout); "), error
    assert i < len(body) - 1  # answered while the body was still coming
    assert _admin_rejected(metrics, "body_timeout") == 1
