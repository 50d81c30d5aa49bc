"""Per-upstream health as an operator sees it: /readyz, /v1/upstreams, envelope_upstream_up.

Two upstreams, `a` on a closed port and `b` a real SDK server: `b` is unaffected, `a` shows as
down with its error (from the probe, or from real traffic when probing is off) while the proxy
stays ready, and `a` is up again once a server listens on its port."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import write_policy

from tests.harness import (
    ROOT,
    ProxyProcess,
    free_port,
    metric_value,
    proxy_process,
    rpc,
    stop,
    token,
    wait_port,
)

OPS = token("ops", tenant="acme")
ECHO_ONLY = {"notes.echo": {"effect": "read"}}


def echo(pp: ProxyProcess, upstream: str) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"text": "hi"},
                       "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                                 "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"},
                                 "io.modelcontextprotocol/clientCapabilities": {}}}}
    return rpc(pp.url(upstream), body, bearer=OPS, headers={"Mcp-Method": "tools/call", "Mcp-Name": "echo"})


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def readyz(pp: ProxyProcess) -> httpx.Response:
    return httpx.get(f"{pp.admin}/readyz", timeout=5)


def states(pp: ProxyProcess) -> dict[str, Any]:
    return dict(readyz(pp).json().get("upstreams", {}))


def test_probe_marks_down_and_back_up(tmp_path: Path, sse_upstream: Any) -> None:
    down_port = free_port()
    policies = write_policy(tmp_path / "policies", {"a": {}, "b": {}}, tools=ECHO_ONLY)
    urls = {"a": f"http://127.0.0.1:{down_port}/mcp", "b": sse_upstream.url}
    with proxy_process(tmp_path, urls, policies=policies, config={"health_interval": 0.3}) as pp:
        # The up upstream is unaffected.
        resp = echo(pp, "b")
        assert resp.status_code == 200 and resp.json()["result"]["isError"] is False, resp.text

        up = wait_for(lambda: (s := states(pp)) and s["a"]["state"] == "down" and s["b"]["state"] == "up" and s,
                      "a down, b up")
        assert "connect" in up["a"]["last_error"], up
        assert up["b"]["last_error"] is None
        r = readyz(pp)
        assert r.status_code == 200 and r.json()["ready"] is True  # a down upstream is not unreadiness
        text = pp.metrics()
        assert metric_value(text, "envelope_upstream_up", upstream="a") == 0
        assert metric_value(text, "envelope_upstream_up", upstream="b") == 1
        detail = pp.admin_get("/v1/upstreams").json()["upstreams"]
        assert detail["a"]["consecutive_failures"] >= 1 and detail["a"]["url"] == urls["a"]
        assert detail["a"]["last_success_at"] is None and detail["b"]["last_success_at"] is not None

        # The down upstream comes back: a real SDK server on its port.
        server = subprocess.Popen(
            [sys.executable, "-m", "proxy.examples.demo_server", "--port", str(down_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        try:
            wait_port(down_port, server)
            wait_for(lambda: states(pp)["a"]["state"] == "up", "a up again")
            assert metric_value(pp.metrics(), "envelope_upstream_up", upstream="a") == 1
            resp = echo(pp, "a")
            assert resp.status_code == 200 and resp.json()["result"]["isError"] is False, resp.text
        finally:
            stop(server)
        assert "upstream a is down" in pp.log()


def test_traffic_alone_reports_health(tmp_path: Path, sse_upstream: Any) -> None:
    """With probing off, real requests are what tell the tracker."""
    policies = write_policy(tmp_path / "policies", {"a": {}, "b": {}}, tools=ECHO_ONLY)
    urls = {"a": f"http://127.0.0.1:{free_port()}/mcp", "b": sse_upstream.url}
    with proxy_process(tmp_path, urls, policies=policies, config={"health_interval": 0}) as pp:
        assert states(pp) == {"a": {"state": "unknown", "last_error": None},
                              "b": {"state": "unknown", "last_error": None}}
        text = pp.metrics()
        assert metric_value(text, "envelope_upstream_up", upstream="a") == 0
        refused = echo(pp, "a").json()["result"]
        assert refused["_meta"]["envelope/decision"]["code"] == "upstream_error"
        assert echo(pp, "b").json()["result"]["isError"] is False
        s = states(pp)
        assert s["a"]["state"] == "down" and "connect" in s["a"]["last_error"], s
        assert s["b"] == {"state": "up", "last_error": None}
        text = pp.metrics()
        assert metric_value(text, "envelope_upstream_up", upstream="a") == 0
        assert metric_value(text, "envelope_upstream_up", upstream="b") == 1
