"""Traces through both MCP routes in-process (the `stack` of test_fronts: the runtime's own
wiring against a scripted upstream), exported to the SDK's in-memory exporter: the span tree,
its attributes, the client's `traceparent` continued, the context sent upstream (header, and
`params._meta` where the aggregate writes the body), and the audit record's `trace_id`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed "
                    "(pip install 'envelope-proxy[otel]')")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.observability import tracing
from tests.integration import test_fronts
from tests.integration.test_fronts import ROUTES, Stack, result

stack = test_fronts.stack  # the fixture: both routes in-process against a scripted upstream

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


class Seen:
    """What reached the upstream with each tools/call: its headers and body."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.bodies: list[dict[str, Any]] = []

    async def answer(self, request: web.Request, msg: dict[str, Any]) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        self.bodies.append(msg)
        return web.json_response(result(msg, "fine"))


def by_kind(exported: tuple[ReadableSpan, ...], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in exported if s.kind is kind]


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


def parent_id(span: ReadableSpan) -> str | None:
    return f"{span.parent.span_id:016x}" if span.parent is not None else None


@pytest.mark.parametrize(("route", "prefix"), ROUTES)
async def test_an_allowed_call_is_one_tree_continuing_the_clients_trace(
        stack: Stack, spans: InMemorySpanExporter, route: str, prefix: str) -> None:
    seen = Seen()
    stack.upstream.script = seen.answer
    status, reply = await stack.call(route, f"{prefix}read", {"q": "x"},
                                     headers={"traceparent": TRACEPARENT})
    assert status == 200 and reply["result"]["content"][0]["text"] == "fine"

    exported = spans.get_finished_spans()
    [server] = by_kind(exported, SpanKind.SERVER)
    [client] = by_kind(exported, SpanKind.CLIENT)
    [checks] = [s for s in exported if s.name == "envelope.checks"]
    assert len(exported) == 3
    # One trace, the client's: the server span's parent is the client's span.
    assert {f"{s.context.trace_id:032x}" for s in exported if s.context} == {TRACE}
    assert parent_id(server) == PARENT
    assert parent_id(checks) == span_id(server) and parent_id(client) == span_id(server)

    [record] = stack.records(tool="read")
    assert record["trace_id"] == TRACE
    attrs = server.attributes or {}
    assert server.name == f"tools/call {prefix}read"
    assert attrs["mcp.method.name"] == "tools/call"
    assert attrs["gen_ai.tool.name"] == "read"
    assert attrs["envelope.upstream"] == "u"
    assert attrs["envelope.verdict"] == "allow" and attrs["envelope.code"] == record["code"]
    assert attrs["envelope.decision_id"] == record["decision_id"]
    assert attrs["envelope.policy_revision"] == record["revision"]
    assert attrs["http.response.status_code"] == 200
    assert (checks.attributes or {})["envelope.verdict"] == "allow"
    assert (client.attributes or {})["http.response.status_code"] == 200
    assert (client.attributes or {})["envelope.upstream"] == "u"

    # The upstream continues the trace under the proxy's client span.
    [headers] = seen.headers
    assert headers["traceparent"] == f"00-{TRACE}-{span_id(client)}-01"
    meta = seen.bodies[0]["params"].get("_meta", {})
    if route == "/mcp":  # the aggregate writes the body itself: the context rides in _meta too
        assert meta["traceparent"] == headers["traceparent"]
    else:  # the client's bytes go upstream untouched
        assert "traceparent" not in meta


@pytest.mark.parametrize(("route", "prefix"), ROUTES)
async def test_a_refused_call_has_no_client_span_and_says_why(
        stack: Stack, spans: InMemorySpanExporter, route: str, prefix: str) -> None:
    _, reply = await stack.call(route, f"{prefix}denied")
    assert reply["result"]["isError"] is True

    exported = spans.get_finished_spans()
    assert by_kind(exported, SpanKind.CLIENT) == []
    [server] = by_kind(exported, SpanKind.SERVER)
    [checks] = [s for s in exported if s.name == "envelope.checks"]
    assert server.parent is None  # no traceparent from the client: a new trace
    [record] = stack.records(tool="denied")
    assert server.context is not None and record["trace_id"] == f"{server.context.trace_id:032x}"
    for span in (server, checks):
        attrs = span.attributes or {}
        assert attrs["envelope.verdict"] == "deny"
        assert attrs["envelope.code"] == "capability_blocked"
        assert attrs["envelope.check"] == "arg_rules"
        assert attrs["envelope.rule"] == "never"
        assert attrs["envelope.decision_id"] == record["decision_id"]


async def test_without_tracing_the_client_context_passes_and_records_have_no_trace_id(stack: Stack) -> None:
    seen = Seen()
    stack.upstream.script = seen.answer
    await stack.call("/mcp/u", "read", headers={"traceparent": TRACEPARENT})
    [record] = stack.records(tool="read")
    assert "trace_id" not in record
    assert seen.headers[0]["traceparent"] == TRACEPARENT  # relayed as it came, as before
