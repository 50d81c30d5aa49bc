"""Admin API: health, readiness (fail closed), metrics exposition, policy status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.admin.app import build_admin_app
from proxy.observability.metrics import Metrics


class FakeStatus:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.policy: dict[str, Any] = {"revision": "rev-a", "misconfigured": []}
        self.fail = False

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
    resp = await client.get("/v1/policy")
    assert resp.status == 200 and await resp.json() == status.policy
    status.fail = True
    resp = await client.get("/v1/policy")
    assert resp.status == 500 and "no policy" in (await resp.json())["error"]


async def test_unknown_route_and_method(client: TestClient[Any, Any]) -> None:
    assert (await client.get("/nope")).status == 404
    assert (await client.post("/healthz")).status == 405
