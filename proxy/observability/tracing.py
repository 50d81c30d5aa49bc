"""OpenTelemetry traces, an optional extra (`pip install 'envelope-proxy[otel]'`).

One seam: `TRACER`. It is None unless the extra is importable AND the standard environment
turns tracing on (`configure`), and every hook in the proxy is guarded by one attribute check,
`if tracing.TRACER is None`, so a proxy without traces pays that check and nothing else (no
function call, no context variable, no import of the SDK; see bench/RESULTS.md).

The rule that turns tracing on (read once per process, at start):

- `OTEL_SDK_DISABLED=true` turns it off whatever else is set;
- otherwise it is on when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`; `none`
  is off), or when an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
  `OTEL_EXPORTER_OTLP_ENDPOINT`). The spec's default exporter is `otlp`, but a sidecar that
  starts posting to localhost:4318 because nobody said otherwise is a surprise: it is opt-in.
- The exporter is OTLP over HTTP/protobuf (the endpoint, headers, timeout and compression
  come from the usual `OTEL_EXPORTER_OTLP_*` variables); sampling from `OTEL_TRACES_SAMPLER`
  (default parent-based always-on), batching from `OTEL_BSP_*`, the resource from
  `OTEL_RESOURCE_ATTRIBUTES` / `OTEL_SERVICE_NAME` (default `envelope-proxy`).

Spans (names and attributes follow the OpenTelemetry MCP semantic conventions where they
exist, `envelope.*` for the proxy's own):

- a SERVER span per POST to an MCP route (`Guard.wrap`), continuing the client's W3C
  `traceparent`; named `{mcp.method.name} {target}` once the front parsed the request;
- `envelope.checks`, its child, around the envelope's checks (`Envelope.begin`);
- a CLIENT span for the upstream exchange in the executor (`proxy.fronts.forwarded`), whose
  context reaches the upstream as `traceparent`/`tracestate` headers (and in `params._meta`
  where the front writes the body itself anyway: the aggregated `/mcp`);
- the audit record of the request's call carries the trace id (`trace_id`), and the server
  span the record's verdict, code, check, rule, policy revision and decision id.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from multidict import CIMultiDict

if TYPE_CHECKING:
    from aiohttp import web
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("envelope.tracing")

# The seam: None = tracing off (the extra missing, or not enabled). Read it as
# `tracing.TRACER`, never imported by name (it changes at `configure`/`install`).
TRACER: Tracer | None = None
_PROVIDER: TracerProvider | None = None
_OWNED = False  # the provider is ours to flush and shut down (configure), not a test's

# The request's SERVER span: the audit record and late attributes find it here, whatever span
# is current where they run (a completion may run under the client span or in its own task).
_SERVER: ContextVar[Span | None] = ContextVar("envelope_server_span", default=None)

SERVICE_NAME = "envelope-proxy"
EXPORTERS = frozenset({"otlp", "console"})

T = TypeVar("T")


def enabled(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters the environment asks for (empty: tracing is off). See the module docstring
    for the rule; an exporter name the proxy does not ship is logged and ignored."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    unknown = [n for n in names if n not in EXPORTERS and n != "none"]
    if unknown:
        log.warning("OTEL_TRACES_EXPORTER names exporters this proxy does not ship (%s): ignored; "
                    "it exports with %s", ", ".join(unknown), ", ".join(sorted(EXPORTERS)))
    return [n for n in names if n in EXPORTERS]


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on for this process when the environment asks for it and the extra is
    installed (the process's own provider and exporter). Idempotent; never raises: a tracing
    setup that fails is logged and the proxy runs without traces."""
    if TRACER is not None:
        return True
    exporters = enabled(environ)
    if not exporters:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        log.warning("OTEL_* asks for traces but the otel extra is not installed "
                    "(pip install 'envelope-proxy[otel]'): no traces")
        return False
    try:
        resource = Resource.create({})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        provider = TracerProvider(resource=resource)
        for name in exporters:
            exporter: SpanExporter
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                exporter = OTLPSpanExporter()
            else:
                exporter = ConsoleSpanExporter()
            provider.add_span_processor(BatchSpanProcessor(exporter))
    except Exception as exc:  # a broken exporter setting must not stop the proxy
        log.warning("tracing not started: %s", exc)
        return False
    install(provider, owned=True)
    log.info("tracing on: exporting with %s", ", ".join(exporters))
    return True


def install(provider: TracerProvider, *, owned: bool = False) -> None:
    """Trace with `provider` (tests: one with an in-memory exporter)."""
    global TRACER, _PROVIDER, _OWNED
    _PROVIDER, _OWNED = provider, owned
    TRACER = provider.get_tracer("envelope-proxy")


def uninstall() -> None:
    """Back to no tracing (the provider is left to its owner)."""
    global TRACER, _PROVIDER, _OWNED
    TRACER, _PROVIDER, _OWNED = None, None, False


def shutdown() -> None:
    """Export what is buffered and stop the exporter `configure` started (blocking: call it
    off the event loop, at the end of shutdown)."""
    provider, owned = _PROVIDER, _OWNED
    uninstall()
    if provider is not None and owned:
        try:
            provider.force_flush(5000)
            provider.shutdown()
        except Exception as exc:  # the exporter's failure is not the shutdown's
            log.warning("tracing: spans not exported at shutdown: %s", exc)


# -- the server span ---------------------------------------------------------------------------


async def server(request: web.Request, handler: Callable[[web.Request], Awaitable[T]]) -> T:
    """Run `handler` under the request's SERVER span, continuing the client's `traceparent`."""
    from opentelemetry import propagate, trace

    assert TRACER is not None
    parent = propagate.extract(request.headers)
    with TRACER.start_as_current_span(f"{request.method} {request.path}", context=parent,
                                      kind=trace.SpanKind.SERVER) as span:
        span.set_attribute("http.request.method", request.method)
        span.set_attribute("url.path", request.path)
        token = _SERVER.set(span)
        try:
            response = await handler(request)
            status = getattr(response, "status", None)
            if isinstance(status, int):
                span.set_attribute("http.response.status_code", status)
            return response
        finally:
            _SERVER.reset(token)


def request(method: str | None, request_id: Any, params: Mapping[str, Any],
            headers: Mapping[str, str]) -> None:
    """Name the server span after the MCP request the front parsed."""
    span = _SERVER.get()
    if span is None or not span.is_recording():
        return
    if method is None:  # a response or notification without a method: nothing to name
        return
    span.set_attribute("mcp.method.name", method)
    if request_id is not None:
        span.set_attribute("jsonrpc.request.id", str(request_id))
    session = headers.get("Mcp-Session-Id")
    if session:
        span.set_attribute("mcp.session.id", session)
    version = headers.get("MCP-Protocol-Version")
    if version:
        span.set_attribute("mcp.protocol.version", version)
    target = params.get("name") if method in ("tools/call", "prompts/get") else None
    if method == "resources/read":
        uri = params.get("uri")
        if isinstance(uri, str):
            span.set_attribute("mcp.resource.uri", uri)
    if isinstance(target, str):
        if method == "tools/call":
            span.set_attribute("gen_ai.tool.name", target)
            span.set_attribute("gen_ai.operation.name", "execute_tool")
        else:
            span.set_attribute("gen_ai.prompt.name", target)
        span.update_name(f"{method} {target}")
    else:
        span.update_name(method)


def recorded(record: MutableMapping[str, Any]) -> None:
    """Put the trace id into the call's audit record (absent when the request has no trace) and
    the record's decision onto the server span."""
    span = _SERVER.get()
    if span is None:
        return
    context = span.get_span_context()
    if not context.is_valid:
        return
    record["trace_id"] = f"{context.trace_id:032x}"
    if not span.is_recording():
        return
    _decision(span, record.get("verdict"), record.get("code"), record.get("check"), record.get("rule"))
    span.set_attribute("envelope.policy_revision", str(record.get("revision")))
    span.set_attribute("envelope.decision_id", str(record.get("decision_id")))
    span.set_attribute("envelope.upstream", str(record.get("upstream")))
    span.set_attribute("gen_ai.tool.name", str(record.get("tool")))
    if record.get("verdict") == "error":
        from opentelemetry.trace import StatusCode

        span.set_status(StatusCode.ERROR, str(record.get("code")))


def _decision(span: Span, verdict: Any, code: Any, check: Any, rule: Any) -> None:
    span.set_attribute("envelope.verdict", str(verdict))
    span.set_attribute("envelope.code", str(code))
    span.set_attribute("envelope.check", str(check))
    if rule is not None:
        span.set_attribute("envelope.rule", str(rule))


# -- the envelope's checks ----------------------------------------------------------------------


async def checks(chain: Any, call: Any) -> Any:
    """`chain.run(call)` under the `envelope.checks` span, annotated with its decision."""
    assert TRACER is not None
    with TRACER.start_as_current_span("envelope.checks") as span:
        decision = await chain.run(call)
        if span.is_recording():
            span.set_attribute("envelope.decision_id", call.decision_id)
            span.set_attribute("envelope.policy_revision", chain.revision.revision)
            span.set_attribute("gen_ai.tool.name", call.tool)
            span.set_attribute("envelope.upstream", call.upstream)
            _decision(span, decision.verdict.value, decision.code.value, decision.check, decision.rule)
        return decision


# -- the upstream exchange ----------------------------------------------------------------------


class Exchange(Protocol):
    """What the client span reads of one forwarded request (`proxy.fronts.forwarded`)."""

    status: int | None
    attempts: int


async def client(upstream: str, url: str, method: str | None, exchange: Exchange,
                 run: Callable[[], Awaitable[T]], rewrite: Callable[[Mapping[str, str]], None] | None) -> T:
    """`run()` (the upstream exchange) under a CLIENT span; `rewrite`, when the front writes
    the request body itself, is given the span's trace context for `params._meta`."""
    from urllib.parse import urlsplit

    from opentelemetry import trace

    assert TRACER is not None
    with TRACER.start_as_current_span(f"{method or 'POST'} {upstream}", kind=trace.SpanKind.CLIENT) as span:
        if span.is_recording():
            parts = urlsplit(url)
            span.set_attribute("envelope.upstream", upstream)
            span.set_attribute("http.request.method", "POST")
            if parts.hostname:
                span.set_attribute("server.address", parts.hostname)
            if parts.port:
                span.set_attribute("server.port", parts.port)
            if method:
                span.set_attribute("mcp.method.name", method)
        if rewrite is not None:
            rewrite(carrier())
        try:
            return await run()
        finally:
            if span.is_recording():
                if exchange.status is not None:
                    span.set_attribute("http.response.status_code", exchange.status)
                span.set_attribute("envelope.attempts", exchange.attempts)


def carrier() -> dict[str, str]:
    """The current span's trace context as W3C `traceparent` (and `tracestate`) entries."""
    from opentelemetry import propagate

    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def inject(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """`headers` with the current span's trace context replacing any the client sent."""
    out: CIMultiDict[str] = CIMultiDict(headers)
    for name, value in carrier().items():
        out[name] = value
    return out
