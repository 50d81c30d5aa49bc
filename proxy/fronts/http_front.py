"""The plain HTTP front: `/http/<upstream>/<path>`, a reverse proxy for agents that call a REST
API directly, for upstreams described by an OpenAPI document (`openapi:` in the policy).

Wire only, like the MCP routes: a request is matched to an operation of the upstream's spec
(method + path template; none matches: the envelope refuses it `unknown_tool`), its arguments
are read from the path, the query, the headers the spec declares and the JSON body
(`openapi.arguments_from`), and the call goes the way every `tools/call` goes: `calls` builds
the `ToolCall`, `Envelope.begin` decides it, the one `Executor` sends the operation's request
(`Spec.request_for`, built from the checked arguments: what was checked is what is sent) and
ends it through `Envelope.complete`, and `render.http_response` answers: the upstream's status
and body as they came (re-rendered only where a guardrail rewrote the result, decoded when the
backend sent gzip/deflate) with only its `RELAYED_HEADERS`, or an
RFC 9457 problem-details refusal. Run, principal, intent and shadow headers act as on the MCP
routes; the idempotency key is the standard `Idempotency-Key` header.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.fronts import calls, render
from proxy.fronts.calls import Route
from proxy.fronts.context import FrontContext
from proxy.fronts.forwarded import Downstream, UpstreamRequest, UpstreamTarget
from proxy.fronts.guard import Guard, read_body
from proxy.fronts.headers import nominated
from proxy.fronts.jsonrpc import BadMessage, Message, _depth_exceeds, read_twice
from proxy.observability.metrics import Metrics
from proxy.upstream.forwarder import UpstreamResponse
from proxy.upstream.openapi import HttpCall, arguments_from

log = logging.getLogger("envelope.http")

PREFIX = "/http"
# The tool name of a request no operation matches (audited and refused as `unknown_tool`):
# bounded, the method and path are the client's bytes.
MAX_UNMATCHED = 200


# The backend's response headers an agent sees: only these, which describe the body and its
# caching, and inspected with it (the executor passes them in the result's `_meta`; `ETag` is
# dropped again when a guardrail re-renders the body), plus `Location` rewritten to point
# through the proxy (`_location`). Any other header (a `Set-Cookie` session of the backend's,
# a `Content-Encoding` that no longer fits the delivered body, an `X-Debug-*`) is dropped.
RELAYED_HEADERS = frozenset({
    "content-type", "content-language", "cache-control", "expires", "last-modified",
    "retry-after", "vary", "etag",
})


def _location(value: str, sent_to: str, base: str, mount: str) -> str | None:
    """A `Location` (a created resource, a redirect) as the agent reaches it: through the proxy
    (`mount` + the path under the upstream's `base` URL). None when it points anywhere else (another
    host, or outside the upstream's base path): the agent could only go there around the proxy."""
    target = urlsplit(urljoin(sent_to, value.strip()))
    origin = urlsplit(base)
    prefix = origin.path.rstrip("/")
    if (target.scheme, target.netloc) != (origin.scheme, origin.netloc):
        return None
    if target.path != prefix and not target.path.startswith(prefix + "/"):
        return None
    rest = target.path[len(prefix):] or "/"
    return mount + rest + (f"?{target.query}" if target.query else "")


def _downstream_headers(sent_to: str, base: str, mount: str,
                        metrics: Metrics) -> Callable[[UpstreamResponse], CIMultiDict[str]]:
    """What of the upstream's response headers an HTTP client may see (`RELAYED_HEADERS`, and
    `Location` through the proxy; never one the upstream's `Connection` names, counted), for a
    request sent to the URL `sent_to`."""
    def kept(resp: UpstreamResponse) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict()
        named = nominated(resp.headers)
        for name, value in resp.headers.items():
            lowered = name.lower()
            if lowered in named:
                if lowered in RELAYED_HEADERS or lowered == "location":
                    metrics.headers_dropped("response", "connection")
                continue
            if lowered in RELAYED_HEADERS:
                headers.add(name, value)
            elif lowered == "location":
                location = _location(value, sent_to, base, mount)
                if location is not None:
                    headers.add(name, location)
        return headers
    return kept


class HttpFront:
    """aiohttp handlers for `/http/{upstream}/{path}`."""

    def __init__(self, context: FrontContext):
        self.ctx = context
        self.envelope = context.envelope
        self.metrics = context.metrics

    def routes(self, guard: Guard) -> list[web.RouteDef]:
        """The route, every request through `guard` first (its refusals as problem details)."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            refused = guard.check(request)
            return _as_problem(refused) if refused is not None else await self.handle(request)

        return [web.route("*", PREFIX + "/{upstream}/{path:.*}", guarded,
                          expect_handler=guard.expect_handler(_as_problem))]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["upstream"]
        target = self.ctx.targets(name)
        spec = self.ctx.spec(name) if target is not None else None
        if target is None or spec is None:
            return render.problem(404, "not_found", f"no upstream named {name!r} with an OpenAPI "
                                  "document is configured")
        principal = self.ctx.authenticate(request)
        if isinstance(principal, web.Response):  # the MCP routes' 401, as problem details
            return _as_problem(principal, "unauthenticated")
        try:
            # (A request without a body, e.g. `Content-Length: 0`, has nothing to read.)
            settings = self.ctx.settings
            body = (await read_body(request, settings.max_body_bytes, settings.body_timeout)
                    if request.can_read_body else b"")
            payload = await self._json(request, body)
        except BadMessage as exc:
            self.metrics.rejected(exc.reason)
            refused = render.problem(exc.status, "invalid_request", exc.message)
            if exc.close:
                refused.force_close()
            return refused
        # The path as sent (still percent-encoded: `Spec.match` decodes each parameter, so an
        # encoded "/" stays inside its segment), relative to `/http/<upstream>`.
        path = "/" + request.rel_url.raw_path.split("/", 3)[3]
        try:
            matched = spec.match(request.method, path)
        except ValueError:  # a path parameter's bytes are not UTF-8 (`%ff`)
            self.metrics.rejected("invalid_request")
            return render.problem(400, "invalid_request", "Bad Request: a path parameter is not UTF-8")
        if matched is None:
            # No operation: the envelope refuses it (`unknown_tool`), audited like any call.
            tool, arguments, op = f"{request.method} {path}"[:MAX_UNMATCHED], {}, None
        else:
            op, path_params = matched
            query: dict[str, list[str]] = {}
            for key, value in request.query.items():
                query.setdefault(key, []).append(value)
            try:
                arguments = arguments_from(op, path_params, query, request.headers, payload)
            except ValueError as exc:
                self.metrics.rejected("invalid_request")
                return render.problem(400, "invalid_request", f"Bad Request: {exc}")
            tool = op.tool
        call = calls.tool_call_from(request.headers, _message(tool, arguments), Route(name, None, ""),
                                    tool, arguments, principal, self.ctx.settings.request_headers())
        # Which HTTP request the call came as (its record's `extra.http`): the route is no
        # JSON-RPC method, and an unmatched one is known by it alone.
        call.audit_extra["http"] = f"{request.method} {path}"[:MAX_UNMATCHED]
        pending = await self.envelope.begin(call)
        upstream: UpstreamRequest | None = None
        if op is not None and pending.forwardable:
            try:
                upstream = self._request(request, target, spec.request_for(op, call.arguments))
            except ValueError:
                # Checked arguments that build no request: never sent; the envelope ends the
                # call refused (allowed but not forwarded) and audits it.
                log.exception("decision %s: no request for %s", call.decision_id, op.tool)
        sent_to = target.url.rstrip("/") + path
        downstream = Downstream(None, None, _downstream_headers(sent_to, target.url, f"/http/{name}",
                                                                  self.ctx.metrics))
        outcome = await self.ctx.executor.run(pending, upstream, downstream)
        return render.http_response(outcome, downstream.response_headers)

    async def _json(self, request: web.Request, body: bytes) -> Any | None:
        """The request's JSON body (None when empty); BadMessage (400) when it is not JSON or
        nests deeper than the limit, 415 when it is in another media type."""
        if not body:
            return None
        ctype = request.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise BadMessage(0, f"Unsupported Media Type: a request body must be JSON, not {ctype[:60]!r}",
                             "invalid_request", status=415)
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadMessage(0, f"Bad Request: the body is not JSON ({exc})", "parse_error") from exc
        if _depth_exceeds(value, self.ctx.settings.max_json_depth):
            raise BadMessage(0, f"Bad Request: the body nests deeper than "
                             f"{self.ctx.settings.max_json_depth} levels", "too_deep")
        why = await read_twice(body)
        if why is not None:
            raise BadMessage(0, f"Bad Request: {why} (the proxy and the upstream could read "
                             "different values)", "invalid_request")
        return value

    def _request(self, request: web.Request, target: UpstreamTarget, http: HttpCall) -> UpstreamRequest:
        """The upstream request: the operation's own (path, query, declared headers, body; the
        executor adds the upstream's configured headers), with the agent's Authorization only
        when the upstream forwards it, and the upstream's bytes wanted back (`relay`)."""
        auth = request.headers.get("Authorization")
        headers = {"Authorization": auth} if auth and target.forward_authorization else {}
        return UpstreamRequest(target, b"", headers, uuid.uuid4().hex,
                               http=dataclasses.replace(http, relay=True))


def _message(tool: str, arguments: dict[str, Any]) -> Message:
    """The `tools/call` an HTTP request stands for: what `calls.tool_call_from` reads (no
    `_meta`: run, intent and idempotency key come from the headers)."""
    return Message({"jsonrpc": "2.0", "id": None, "method": "tools/call",
                    "params": {"name": tool, "arguments": arguments}})


# What the guard's and the shared context's refusals are called when they carry no decision.
_WIRE_CODES = {400: "invalid_request", 401: "unauthenticated", 403: "forbidden_origin",
               413: "too_large", 421: "misdirected_request"}
# Their headers a client still needs (the rest describe the JSON-RPC body they replace).
_KEPT = ("WWW-Authenticate", "Retry-After", "Connection")


def _as_problem(response: web.Response, code: str | None = None) -> web.Response:
    """A refusal the guard or the shared context built for the MCP routes (a JSON-RPC error
    body), as problem details: its status, kept headers and message, and the decision's members
    when it was audited (an invalid header); a refusal that closes the connection (no Host)
    still closes it."""
    try:
        error = orjson.loads(response.body)["error"]  # type: ignore[arg-type]
        message, data = str(error["message"]), error.get("data")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message, data = response.reason or "refused", None
    decision = data.get("envelope/decision") if isinstance(data, dict) else None
    members = dict(decision) if isinstance(decision, dict) else {}
    code = str(members.pop("code", None) or code or _WIRE_CODES.get(response.status, "refused"))
    headers = {h: response.headers[h] for h in _KEPT if h in response.headers}
    problem = render.problem(response.status, code, message, headers, **members)
    if response.keep_alive is False:  # force_close() sets no header for `_KEPT` to carry
        problem.force_close()
    return problem
