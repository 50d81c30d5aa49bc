"""Traces from the real `envelope-proxy` process, exported over OTLP/HTTP to a real receiver on
loopback (an aiohttp app decoding `POST /v1/traces` with the OTLP protobuf types the exporter
itself depends on), configured by the standard `OTEL_*` variables only. One allowed call (the
client's `traceparent` continued) and one refused call: the spans a collector receives, the
audit records' `trace_id`, the `traceparent` the upstream received, and `audit verify`.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from e2e_helpers import cli, write_doc
from hostile_upstream import hostile_server

from tests.harness import free_port, proxy_process, token

pytest.importorskip("opentelemetry.exporter.otlp.proto.http",
                    reason="the otel extra is not installed (pip install 'envelope-proxy[otel]')")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

STATELESS = "2026-07-28"
TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
SERVER, CLIENT = 2, 3  # OTLP's Span.SpanKind


class Receiver:
    """An OTLP/HTTP traces receiver on loopback, in its own thread and event loop: every span
    it was sent, as (trace id, span id, parent id, name, kind, attributes, resource)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    async def traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            for rs in export.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        attrs = {a.key: _value(a.value) for a in s.attributes}
                        self.spans.append({"trace": s.trace_id.hex(), "span": s.span_id.hex(),
                                           "parent": s.parent_span_id.hex() or None, "name": s.name,
                                           "kind": s.kind, "attrs": attrs, "resource": resource})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self.traces)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> Receiver:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def wait(self, count: int, timeout: float = 15.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if len(spans) >= count or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


def call(url: str, tool: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    hdrs = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
            "MCP-Protocol-Version": STATELESS, "Authorization": f"Bearer {token('agent')}",
            **(headers or {})}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": tool, "arguments": {"text": "hello"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                  "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
    response = httpx.post(url, json=body, headers=hdrs, timeout=20)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def test_a_collector_receives_the_calls_spans_and_the_audit_log_names_their_traces(
        tmp_path: Path, receiver: Receiver) -> None:
    policies = write_doc(tmp_path / "policy", {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"h.read_page": {"effect": "read"},
                  "h.write_note": {"effect": "write",
                                   "rules": [{"id": "no-notes", "forbid": "true", "reason": "read-only day"}]}},
    })
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_SERVICE_NAME": "envelope-e2e", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with hostile_server() as up, proxy_process(tmp_path, {"h": up.url}, policies=policies, env=env) as pp:
        allowed = call(pp.url("h"), "read_page", {"traceparent": f"00-{TRACE}-{PARENT}-01"})
        assert allowed["result"]["isError"] is False
        refused = call(pp.url("h"), "write_note")
        assert refused["result"]["isError"] is True
        # allowed: server, checks, client; refused: server, checks
        spans = receiver.wait(5)
        [upstream_call] = up.control.calls("read_page")
        assert up.control.calls("write_note") == []
        records = pp.audit_records()

    assert {s["resource"].get("service.name") for s in spans} == {"envelope-e2e"}
    servers = {s["attrs"]["gen_ai.tool.name"]: s for s in spans if s["kind"] == SERVER}
    assert set(servers) == {"read_page", "write_note"}

    # The allowed call: the client's trace continued, through the checks to the upstream.
    server = servers["read_page"]
    assert server["trace"] == TRACE and server["parent"] == PARENT
    assert server["name"] == "tools/call read_page"
    assert server["attrs"]["mcp.method.name"] == "tools/call"
    assert server["attrs"]["envelope.verdict"] == "allow"
    tree = [s for s in spans if s["trace"] == TRACE]
    [checks] = [s for s in tree if s["name"] == "envelope.checks"]
    [client] = [s for s in tree if s["kind"] == CLIENT]
    assert checks["parent"] == server["span"] and client["parent"] == server["span"]
    assert upstream_call["headers"]["traceparent"] == f"00-{TRACE}-{client['span']}-01"

    # The refused call: a new trace, no upstream exchange, the rule that refused it.
    server = servers["write_note"]
    assert server["parent"] is None and server["trace"] != TRACE
    assert server["attrs"]["envelope.verdict"] == "deny"
    assert server["attrs"]["envelope.rule"] == "no-notes"
    assert server["attrs"]["envelope.check"] == "arg_rules"
    assert [s["kind"] for s in spans if s["trace"] == server["trace"] and s["kind"] == CLIENT] == []

    # Each call's audit record names the trace the collector received, and the chain holds.
    by_tool = {r["tool"]: r for r in records if r.get("tool") in servers}
    assert by_tool["read_page"]["trace_id"] == TRACE
    assert by_tool["write_note"]["trace_id"] == server["trace"]
    assert servers["read_page"]["attrs"]["envelope.decision_id"] == by_tool["read_page"]["decision_id"]
    done = cli("audit", "verify", str(pp.audit_dir))
    assert done.returncode == 0, done.stdout + done.stderr
