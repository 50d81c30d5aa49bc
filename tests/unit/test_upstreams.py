"""Upstream health: state transitions, the probe (fake forwarder, no network), the gauge."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

import pytest

from proxy.approvals.approvers import Approvers
from proxy.config import ApprovalsConfig, ApproverConfig
from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.observability.metrics import Metrics
from proxy.upstream.health import PROBE_SESSION, HealthProber, ProbeTarget, UpstreamHealth
from tests.unit.fakes import Clock


def metric_value(text: str, name: str, upstream: str) -> float:
    prefix = f'{name}{{upstream="{upstream}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise AssertionError(f"no {prefix!r} in exposition")


def test_starts_unknown_and_follows_outcomes() -> None:
    clock = Clock()
    h = UpstreamHealth(clock=clock)
    h.sync(["a", "b"])
    assert h.state("a") == "unknown"
    h.record("a", "ok")
    assert h.snapshot()["a"]["state"] == "up"
    assert h.snapshot()["a"]["last_success_at"] == 1000.0
    clock.now = 1005.0
    h.record("a", "error", "cannot connect to upstream: refused")
    snap = h.snapshot()["a"]
    assert (snap["state"], snap["consecutive_failures"], snap["last_error"], snap["last_error_at"]) == (
        "down", 1, "cannot connect to upstream: refused", 1005.0)
    h.record("a", "timeout")
    assert h.snapshot()["a"]["consecutive_failures"] == 2
    assert h.snapshot()["a"]["last_error"] == "timed out"
    h.record("a", "ok")
    snap = h.snapshot()["a"]
    assert (snap["state"], snap["consecutive_failures"]) == ("up", 0)
    assert snap["last_error"] == "cannot connect to upstream: refused" or snap["last_error"] == "timed out"
    assert h.summary() == {"a": {"state": "up", "last_error": "timed out"},
                           "b": {"state": "unknown", "last_error": None}}


def test_down_after_threshold() -> None:
    h = UpstreamHealth(down_after=3)
    h.sync(["a"])
    h.record("a", "ok")
    h.record("a", "error", "x")
    h.record("a", "error", "x")
    assert h.state("a") == "up"
    h.record("a", "error", "x")
    assert h.state("a") == "down"


def test_unknown_names_are_ignored_and_sync_forgets() -> None:
    h = UpstreamHealth()
    h.sync(["a"])
    h.record("nope", "error", "x")
    assert list(h.snapshot()) == ["a"]
    h.sync(["b"])
    assert list(h.snapshot()) == ["b"]
    with pytest.raises(ValueError):
        UpstreamHealth(down_after=0)


def test_gauge_follows_state() -> None:
    m = Metrics()
    h = UpstreamHealth(on_change=m.set_upstreams_up)
    h.sync(["a", "b"])
    text = m.render()[0].decode()
    assert "envelope_upstream_up" in text
    assert metric_value(text, "envelope_upstream_up", upstream="a") == 0
    h.record("a", "ok")
    h.record("b", "error", "refused")
    text = m.render()[0].decode()
    assert metric_value(text, "envelope_upstream_up", upstream="a") == 1
    assert metric_value(text, "envelope_upstream_up", upstream="b") == 0
    h.sync(["a"])
    assert 'upstream="b"' not in m.render()[0].decode()


class FakeResponse:
    status = 404
    closed = False

    def close(self) -> None:
        self.closed = True


class FakeForwarder:
    def __init__(self, outcomes: dict[str, Any]):
        self.outcomes = outcomes
        self.seen: list[tuple[str, str, Mapping[str, str]]] = []
        self.resends: list[bool] = []

    async def open(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None, *,
                   connect_timeout: float, read_timeout: float | None, resend: bool = False) -> Any:
        self.seen.append((method, url, headers))
        self.resends.append(resend)
        out = self.outcomes[url]
        if isinstance(out, BaseException):
            raise out
        if out == "hang":
            await asyncio.sleep(10)
        return out


async def test_probe_records_each_upstream() -> None:
    ok = FakeResponse()
    fwd = FakeForwarder({"http://a/mcp": ok, "http://b/mcp": UpstreamError("cannot connect: refused"),
                         "http://c/mcp": UpstreamTimeout("slow"), "http://d/mcp": "hang"})
    h = UpstreamHealth()
    h.sync("abcd")
    prober = HealthProber(h, fwd, lambda: [ProbeTarget(n, f"http://{n}/mcp") for n in "abcd"],  # type: ignore[arg-type]
                          interval=0, timeout=0.05)
    await prober.probe_all()
    snap = h.snapshot()
    assert snap["a"]["state"] == "up" and ok.closed  # any HTTP status is alive
    assert fwd.resends == [True] * 4  # a probe may be resent after the stale keep-alive race
    assert snap["b"]["state"] == "down" and snap["b"]["last_error"] == "probe: cannot connect: refused"
    assert snap["c"]["state"] == "down" and "no answer" in snap["c"]["last_error"]
    assert snap["d"]["state"] == "down" and snap["d"]["last_source"] == "probe"
    method, _, headers = fwd.seen[0]
    assert method == "GET" and headers["Mcp-Session-Id"] == PROBE_SESSION


async def test_prober_loop_runs_and_stops() -> None:
    fwd = FakeForwarder({"http://a/mcp": FakeResponse()})
    h = UpstreamHealth()
    h.sync(["a"])
    prober = HealthProber(h, fwd, lambda: [ProbeTarget("a", "http://a/mcp")],  # type: ignore[arg-type]
                          interval=0.01, timeout=1)
    prober.start()
    await asyncio.sleep(0.05)
    await prober.stop()
    assert len(fwd.seen) >= 2
    assert h.state("a") == "up"
    disabled = HealthProber(h, fwd, lambda: [], interval=0, timeout=1)  # type: ignore[arg-type]
    disabled.start()
    await disabled.stop()


class StatusWithUpstreams:
    def __init__(self, health: UpstreamHealth) -> None:
        self.health = health
        self.approvers = Approvers(ApprovalsConfig(approvers={
            "op": ApproverConfig(token_sha256=hashlib.sha256(b"op-token").hexdigest())}))

    def readiness(self) -> list[str]:
        return []

    def policy_status(self) -> dict[str, Any]:
        return {}

    def upstream_summary(self) -> dict[str, Any]:
        return self.health.summary()

    def upstream_status(self) -> dict[str, Any]:
        return self.health.snapshot()


async def test_admin_shows_upstreams_without_affecting_readiness() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from proxy.admin.app import build_admin_app

    h = UpstreamHealth()
    h.sync(["a", "b"])
    h.record("a", "ok")
    h.record("b", "error", "cannot connect to upstream: refused")
    async with TestClient(TestServer(build_admin_app(StatusWithUpstreams(h), Metrics()))) as c:
        resp = await c.get("/readyz")
        assert resp.status == 200
        assert await resp.json() == {"ready": True, "upstreams": {
            "a": {"state": "up", "last_error": None},
            "b": {"state": "down", "last_error": "cannot connect to upstream: refused"}}}
        assert (await c.get("/v1/upstreams")).status == 401  # upstream details need a token
        resp = await c.get("/v1/upstreams", headers={"Authorization": "Bearer op-token"})
        body = await resp.json()
        assert body["upstreams"]["b"]["consecutive_failures"] == 1


async def test_an_http_upstream_is_probed_with_head_and_nothing_of_mcp() -> None:
    ok = FakeResponse()
    fwd = FakeForwarder({"http://api/v1": ok, "http://mcp/mcp": ok})
    h = UpstreamHealth()
    h.sync(["api", "mcp"])
    prober = HealthProber(h, fwd, lambda: [ProbeTarget("api", "http://api/v1", http=True),  # type: ignore[arg-type]
                                           ProbeTarget("mcp", "http://mcp/mcp")],
                          interval=0, timeout=0.05)
    await prober.probe_all()
    assert h.snapshot()["api"]["state"] == "up"
    seen = {url: (method, dict(headers)) for method, url, headers in fwd.seen}
    assert seen["http://api/v1"] == ("HEAD", {"Accept": "*/*"})
    assert seen["http://mcp/mcp"][0] == "GET" and seen["http://mcp/mcp"][1]["Mcp-Session-Id"] == PROBE_SESSION
