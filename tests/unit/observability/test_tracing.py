"""The tracing seam (proxy/observability/tracing.py): the rule that turns it on, the no-op
path, and its pieces with the SDK's in-memory exporter (no network)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.observability import tracing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


@pytest.mark.parametrize(("environ", "exporters"), [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "x"}, []),  # naming the service asks for nothing
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none"}, []),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, []),  # not shipped: ignored (and logged)
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "TRUE"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
])
def test_tracing_is_opt_in_through_the_standard_variables(environ: dict[str, str], exporters: list[str]) -> None:
    assert tracing.enabled(environ) == exporters


def test_off_by_default_the_seam_stays_none() -> None:
    assert tracing.configure({}) is False
    assert tracing.TRACER is None


def test_without_the_extra_tracing_asked_for_is_logged_and_off(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    with caplog.at_level(logging.WARNING, "envelope.tracing"):
        assert tracing.configure({"OTEL_TRACES_EXPORTER": "otlp"}) is False
    assert tracing.TRACER is None
    assert "otel extra is not installed" in caplog.text


def test_a_record_outside_a_traced_request_has_no_trace_id() -> None:
    record: dict[str, Any] = {"verdict": "allow"}
    tracing.recorded(record)
    assert record == {"verdict": "allow"}


# -- with the SDK ---------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[Any]:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed "
                        "(pip install 'envelope-proxy[otel]')")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


def test_configure_starts_an_otlp_exporter_and_shutdown_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra is not installed "
                        "(pip install 'envelope-proxy[otel]')")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-proxy")
    try:
        assert tracing.configure({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}) is True
        assert tracing.TRACER is not None
        provider = tracing._PROVIDER
        assert provider is not None and provider.resource.attributes["service.name"] == "edge-proxy"
    finally:
        tracing.shutdown()
    assert tracing.TRACER is None


async def test_the_server_span_continues_the_clients_traceparent_and_stamps_the_record(spans: Any) -> None:
    record: dict[str, Any] = {"verdict": "deny", "code": "unauthorized", "check": "authz",
                              "rule": None, "revision": "r1", "decision_id": "d1",
                              "upstream": "u", "tool": "t"}

    async def handler(request: web.Request) -> web.Response:
        tracing.request("tools/call", 7, {"name": "t"}, request.headers)
        tracing.recorded(record)
        # What goes upstream now carries the proxy's span, in the client's trace.
        sent = tracing.inject({"TraceParent": TRACEPARENT, "Accept": "x"})
        assert sent["traceparent"].startswith(f"00-{TRACE}-") and sent["traceparent"] != TRACEPARENT
        assert len(sent.getall("traceparent")) == 1 and sent["Accept"] == "x"
        return web.Response(status=200)

    request = make_mocked_request("POST", "/mcp/u", headers={"traceparent": TRACEPARENT,
                                                              "Mcp-Session-Id": "s1"})
    await tracing.server(request, handler)
    [span] = spans.get_finished_spans()
    assert span.name == "tools/call t"
    assert f"{span.parent.span_id:016x}" == PARENT
    assert record["trace_id"] == TRACE
    attrs = dict(span.attributes)
    assert attrs == {
        "http.request.method": "POST", "url.path": "/mcp/u", "mcp.method.name": "tools/call",
        "jsonrpc.request.id": "7", "mcp.session.id": "s1", "gen_ai.tool.name": "t",
        "gen_ai.operation.name": "execute_tool", "envelope.verdict": "deny",
        "envelope.code": "unauthorized", "envelope.check": "authz",
        "envelope.policy_revision": "r1", "envelope.decision_id": "d1", "envelope.upstream": "u",
        "http.response.status_code": 200}


async def test_the_checks_span_carries_the_decision(spans: Any) -> None:
    decision = SimpleNamespace(verdict=SimpleNamespace(value="deny"), code=SimpleNamespace(value="unauthorized"),
                               check="authz", rule="r-7")

    class Chain:
        revision = SimpleNamespace(revision="rev9")

        async def run(self, call: Any) -> Any:
            return decision

    call = SimpleNamespace(decision_id="d2", tool="t", upstream="u")
    assert await tracing.checks(Chain(), call) is decision
    [span] = spans.get_finished_spans()
    assert span.name == "envelope.checks"
    assert span.attributes["envelope.rule"] == "r-7"
    assert span.attributes["envelope.policy_revision"] == "rev9"
    assert span.attributes["envelope.code"] == "unauthorized"


async def test_the_client_span_hands_its_context_to_the_body_and_records_the_status(spans: Any) -> None:
    exchange = SimpleNamespace(status=None, attempts=1)
    metas: list[dict[str, str]] = []

    async def run() -> str:
        exchange.status, exchange.attempts = 503, 2
        return "answer"

    out = await tracing.client("u", "http://up.example:8080/mcp", "tools/call", exchange, run,
                               lambda meta: metas.append(dict(meta)))
    assert out == "answer"
    [span] = spans.get_finished_spans()
    assert f"{span.context.span_id:016x}" in metas[0]["traceparent"]
    assert dict(span.attributes) == {
        "envelope.upstream": "u", "http.request.method": "POST", "server.address": "up.example",
        "server.port": 8080, "mcp.method.name": "tools/call", "http.response.status_code": 503,
        "envelope.attempts": 2}
