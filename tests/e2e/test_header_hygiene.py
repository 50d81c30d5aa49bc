"""Header hygiene through the real process, on both MCP listeners (`aiohttp` and `fast`): what an
upstream receives and what a client gets back (proxy/fronts/headers.py).

- RFC 9110 §7.6.1: a field a `Connection` header names is hop-by-hop: the upstream never sees
  one its client named, the client never sees one its upstream named (JSON and SSE answers).
- A client cannot remove the proxy's own upstream headers by naming them in `Connection`: a
  protected name is refused 400 (audited, counted); the proxy's configured upstream header
  arrives whatever the client sends.
- Request fields whose name holds `_` are dropped by default (counted), refused 400 under
  `listener.underscore_headers: reject`, and never read by the proxy as the dashed name.

The upstream is an aiohttp server in a thread that records every request's headers and answers
with headers of its own, one of them named in its `Connection`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from e2e_helpers import write_doc
from fake_upstream import serving

from tests.harness import ProxyProcess, free_port, metric_value, proxy_process, token

STATELESS = "2026-07-28"
KINDS = ("aiohttp", "fast")
# The proxy's own credential toward the upstream (policy `upstreams.h.headers`).
UPSTREAM_KEY = "proxy-credential"


@dataclass
class RecordingUpstream:
    """Records each POST's headers (lower-case names, every value); answers with `X-Up-Kept`
    and `X-Up-Hop`, the latter named in its `Connection`, as JSON or (`mode: sse`) SSE."""

    port: int = 0
    seen: list[dict[str, list[str]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def calls(self) -> list[dict[str, list[str]]]:
        return [h for h in self.seen if h.get("x-test-method") == ["tools/call"]]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        headers: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        headers["x-test-method"] = [str(body.get("method"))]
        self.seen.append(headers)
        own = {"Connection": "keep-alive, X-Up-Hop", "X-Up-Hop": "upstream-secret",
               "X-Up-Kept": "1"}
        if body.get("method") != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": body.get("id"),
                                      "result": {"resultType": "complete"}}, headers=own)
        result = {"jsonrpc": "2.0", "id": body["id"], "result": {
            "content": [{"type": "text", "text": "ok"}], "isError": False, "resultType": "complete"}}
        if body["params"].get("arguments", {}).get("mode") != "sse":
            return web.json_response(result, headers=own)
        resp = web.StreamResponse(headers={**own, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"event: message\ndata: {json.dumps(result)}\n\n".encode())
        await resp.write_eof()
        return resp


@contextlib.contextmanager
def recording_upstream() -> Iterator[RecordingUpstream]:
    up = RecordingUpstream(port=free_port())
    with serving(up.handle, up.port, "the recording upstream"):
        yield up


@pytest.fixture(scope="module")
def upstream() -> Iterator[RecordingUpstream]:
    with recording_upstream() as up:
        yield up


@contextlib.contextmanager
def served(tmp: Path, upstream: RecordingUpstream, kind: str,
           underscores: str | None = None) -> Iterator[ProxyProcess]:
    upstream.seen.clear()
    policy = write_doc(tmp / "policy", {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "30s",
                            "headers": {"X-Upstream-Key": UPSTREAM_KEY}}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"h.read_page": {"effect": "read"}},
    })
    listener = {"kind": kind, **({"underscore_headers": underscores} if underscores else {})}
    with proxy_process(tmp, {"h": upstream.url}, policies=policy, config={"listener": listener},
                       env={"ENVELOPE_LISTENER": kind}) as pp:
        yield pp


def call(pp: ProxyProcess, headers: list[tuple[str, str]], rid: int = 1,
         **arguments: Any) -> httpx.Response:
    """A stateless `tools/call` of `read_page` with `headers` added to the client's own."""
    body = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "read_page", "arguments": arguments,
        "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                  "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
    sent = [("Accept", "application/json, text/event-stream"), ("Content-Type", "application/json"),
            ("MCP-Protocol-Version", STATELESS), ("Mcp-Method", "tools/call"), ("Mcp-Name", "read_page"),
            ("Authorization", f"Bearer {token('alice')}"), *headers]
    return httpx.post(pp.url("h"), content=json.dumps(body).encode(), headers=sent, timeout=30)


def dropped(pp: ProxyProcess, direction: str, reason: str) -> float:
    return metric_value(pp.metrics(), "envelope_headers_dropped_total", direction=direction,
                        reason=reason)


@pytest.mark.parametrize("kind", KINDS)
def test_connection_named_and_underscore_headers_never_reach_the_upstream(
        tmp_path: Path, upstream: RecordingUpstream, kind: str) -> None:
    with served(tmp_path, upstream, kind) as pp:
        resp = call(pp, [("Connection", "keep-alive, X-Hop-Secret"), ("X-Hop-Secret", "client-hop"),
                         ("X-Kept", "yes"), ("X_Forwarded_For", "203.0.113.9"),
                         ("X_Envelope_Run", "smuggled-run"), ("X_Upstream_Key", "client-key"),
                         ("Mcp-Param-Region", "eu")])
        assert resp.status_code == 200, resp.text
        assert resp.json()["result"]["content"][0]["text"] == "ok"
        [seen] = upstream.calls()
        assert seen["x-kept"] == ["yes"] and seen["mcp-param-region"] == ["eu"]
        assert "x-hop-secret" not in seen and "connection" not in seen
        assert [n for n in seen if "_" in n] == []
        # The proxy's own header arrives once, as the proxy set it.
        assert seen["x-upstream-key"] == [UPSTREAM_KEY]
        # The proxy read no run from the underscore spelling of X-Envelope-Run.
        [record] = [r for r in pp.audit_records() if r.get("tool") == "read_page"]
        assert record["run"] != "smuggled-run"
        assert dropped(pp, "request", "underscore") == 3
        assert dropped(pp, "request", "connection") == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_cannot_strip_the_proxys_own_headers_through_connection(
        tmp_path: Path, upstream: RecordingUpstream, kind: str) -> None:
    with served(tmp_path, upstream, kind) as pp:
        # Naming the proxy's configured header changes nothing: it is added after the
        # client's headers are filtered.
        resp = call(pp, [("Connection", "X-Upstream-Key"), ("X-Upstream-Key", "client-key")])
        assert resp.status_code == 200, resp.text
        [seen] = upstream.calls()
        assert seen["x-upstream-key"] == [UPSTREAM_KEY]
        # Naming a header the proxy reads itself is refused, before any upstream sees it.
        for named in ("Authorization", "Mcp-Session-Id", "X-Envelope-Run", "x-forwarded-for, keep-alive"):
            resp = call(pp, [("Connection", named)], rid=2)
            assert resp.status_code == 400, (named, resp.text)
            error = resp.json()["error"]
            assert error["code"] == -32600 and "Connection header names" in error["message"], error
            assert error["data"]["envelope/decision"]["check"] == "guard"
        assert len(upstream.calls()) == 1
        refused = [r for r in pp.audit_records() if r.get("check") == "guard"]
        assert [r["extra"]["header"] for r in refused] == ["Connection"] * 4
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total",
                            reason="hop_by_hop_header") == 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["json", "sse"])
def test_an_upstream_header_named_in_its_connection_is_not_relayed(
        tmp_path: Path, upstream: RecordingUpstream, kind: str, mode: str) -> None:
    with served(tmp_path, upstream, kind) as pp:
        resp = call(pp, [], mode=mode)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith(
            "text/event-stream" if mode == "sse" else "application/json")
        assert resp.headers.get("x-up-kept") == "1"
        assert "x-up-hop" not in resp.headers
        assert "X-Up-Hop" not in resp.headers.get("connection", "")
        assert dropped(pp, "response", "connection") == 1


@pytest.mark.parametrize("kind", KINDS)
def test_reject_mode_refuses_an_underscore_header_and_allow_mode_forwards_it(
        tmp_path: Path, upstream: RecordingUpstream, kind: str) -> None:
    with served(tmp_path / "reject", upstream, kind, underscores="reject") as pp:
        resp = call(pp, [("X_Custom", "1")])
        assert resp.status_code == 400, resp.text
        assert "X_Custom has an underscore" in resp.json()["error"]["message"]
        assert upstream.calls() == []
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total",
                            reason="underscore_header") == 1
        [record] = [r for r in pp.audit_records() if r.get("check") == "guard"]
        assert record["extra"]["header"] == "X_Custom"
    with served(tmp_path / "allow", upstream, kind, underscores="allow") as pp:
        resp = call(pp, [("X_Custom", "1"), ("X_Envelope_Run", "smuggled-run"),
                         ("X_Upstream_Key", "client-key")])
        assert resp.status_code == 200, resp.text
        [seen] = upstream.calls()
        # Forwarded, except spellings of what the proxy strips or sets.
        assert seen["x_custom"] == ["1"]
        assert "x_envelope_run" not in seen and "x_upstream_key" not in seen
        assert dropped(pp, "request", "underscore") == 2
        [record] = [r for r in pp.audit_records() if r.get("tool") == "read_page"]
        assert record["run"] != "smuggled-run"


@pytest.mark.parametrize("kind", KINDS)
def test_a_relayed_request_and_answer_lose_their_connection_named_headers(
        tmp_path: Path, upstream: RecordingUpstream, kind: str) -> None:
    """Requests the envelope does not decide (here `tools/list`) are relayed by another path."""
    with served(tmp_path, upstream, kind) as pp:
        body = {"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": {"_meta": {
            "io.modelcontextprotocol/protocolVersion": STATELESS,
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
        resp = httpx.post(pp.url("h"), content=json.dumps(body).encode(), timeout=30, headers=[
            ("Accept", "application/json, text/event-stream"), ("Content-Type", "application/json"),
            ("MCP-Protocol-Version", STATELESS), ("Mcp-Method", "tools/list"),
            ("Authorization", f"Bearer {token('alice')}"),
            ("Connection", "X-Hop-Secret"), ("X-Hop-Secret", "client-hop"), ("X_Custom", "1")])
        assert resp.status_code == 200, resp.text
        [seen] = [h for h in upstream.seen if h["x-test-method"] == ["tools/list"]
                  and "mcp-method" in h]
        assert "x-hop-secret" not in seen and "x_custom" not in seen
        assert seen["x-upstream-key"] == [UPSTREAM_KEY]
        assert resp.headers.get("x-up-kept") == "1" and "x-up-hop" not in resp.headers


@pytest.mark.parametrize("route", ["h", ""])
def test_the_configured_authorization_replaces_the_agents_forwarded_one_whatever_its_case(
        tmp_path: Path, upstream: RecordingUpstream, route: str) -> None:
    """`forward_authorization` beside a configured `authorization` (lower case): the upstream
    gets the proxy's credential once, never the agent's beside it (a server reading the first
    field would take the agent's), on the per-upstream route and the aggregate `/mcp`
    (`headers.layered`, one merge for every path)."""
    upstream.seen.clear()
    policy = write_doc(tmp_path / "policy", {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "30s",
                            "forward_authorization": True,
                            "headers": {"authorization": f"Bearer {UPSTREAM_KEY}"}}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"h.read_page": {"effect": "read"}},
    })
    config = {} if route else {"aggregate": {"enabled": True, "upstreams": ["h"]}, "health_interval": 0}
    with proxy_process(tmp_path, {"h": upstream.url}, policies=policy, config=config) as pp:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "read_page" if route else "h.read_page", "arguments": {},
            "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                      "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
        resp = httpx.post(pp.url(route) if route else f"{pp.base}/mcp",
                          content=json.dumps(body).encode(), timeout=30, headers=[
            ("Accept", "application/json, text/event-stream"), ("Content-Type", "application/json"),
            ("MCP-Protocol-Version", STATELESS), ("Mcp-Method", "tools/call"),
            ("Mcp-Name", body["params"]["name"]), ("Authorization", f"Bearer {token('alice')}")])
        assert resp.status_code == 200, resp.text
        assert resp.json()["result"]["content"][0]["text"] == "ok", resp.text
        assert upstream.seen, "nothing reached the upstream"
        for seen in upstream.seen:  # the aggregate's initialize too
            assert seen["authorization"] == [f"Bearer {UPSTREAM_KEY}"], seen
