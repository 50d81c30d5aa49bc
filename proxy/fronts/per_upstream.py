"""MCP Streamable HTTP front: relays every revision, inspects `tools/list` and `tools/call`.

One route per upstream, `/mcp/<upstream>`. Everything not inspected is relayed unchanged
(status, body, headers other than hop-by-hop), SSE event by event. `tools/list` results teach
the tool registry and are filtered per principal; `tools/call` goes through the envelope and a
refusal comes back as a tool result the model reads. This module knows wire formats, not
policy: it asks the `Envelope` for decisions and the runtime for upstream targets.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.config import RetryConfig
from proxy.envelope.checks.guardrails import guard_reply
from proxy.envelope.pipeline import Envelope, Pending
from proxy.envelope.types import (
    Code,
    Decision,
    Principal,
    RequestInfo,
    RunContext,
    ToolCall,
    Verdict,
)
from proxy.errors import AuditError, IdentityError, ResultWithheld, UpstreamError, UpstreamTimeout
from proxy.fronts import jsonrpc
from proxy.fronts.inband import (
    ID_PREFIX,
    DeferChannel,
    Elicitations,
    SessionCapabilities,
    SessionChannel,
    stateless_elicitation,
    strip_stateless,
)
from proxy.fronts.jsonrpc import BadMessage, Message
from proxy.fronts.sse import SSEEvent, SSEParser, format_event
from proxy.observability.metrics import UpstreamOutcome
from proxy.policy.vocab import Effect
from proxy.upstream.forwarder import Forwarder, UpstreamResponse

log = logging.getLogger("envelope.mcp")

STATELESS_REVISION = "2026-07-28"
DECISION_META = "envelope/decision"

# Never forwarded in either direction (RFC 9110 hop-by-hop, plus what the proxy recomputes).
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "content-length", "host",
    }
)
# Request headers the proxy consumes itself and does not pass upstream.
NOT_UPSTREAM = HOP_BY_HOP | {"accept-encoding", "authorization", "origin", "cookie", "x-envelope-run",
                             "x-envelope-shadow", "x-envelope-parent-run", "x-envelope-capability",
                             "x-envelope-agent"}
# Response headers the proxy's own server sets.
NOT_DOWNSTREAM = HOP_BY_HOP | {"server", "date"}
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# Upstream answers that say "try again" without the call having run (or, for 502/504 behind a
# gateway, without the proxy knowing): retried for read-only and client-keyed calls only.
RETRY_STATUSES = frozenset({429, 502, 503, 504})


def _connect_failed(exc: UpstreamError) -> bool:
    """The request never reached the upstream (refused, unreachable, no connection in time).

    Both forwarders word connect failures this way; anything later (a reset after sending) may
    have reached the upstream and is not retried.
    """
    return str(exc).startswith("cannot connect to upstream")


def _retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After: <seconds>` header; None when absent or an HTTP date."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """Where and how to reach one upstream (policy plus runtime overrides)."""

    name: str
    url: str
    timeout: float
    connect_timeout: float
    headers: Mapping[str, str]
    forward_authorization: bool


class Identity(Protocol):
    """Resolves the verified principal of a request (see `proxy.identity`)."""

    def resolve(self, headers: Mapping[str, str]) -> Principal: ...


@dataclass(frozen=True, slots=True)
class FrontSettings:
    max_body_bytes: int
    max_json_depth: int
    allowed_hosts: frozenset[str]  # lower-case host names without port; "*" allows any
    allowed_origins: frozenset[str]  # exact origins ("https://app.example"); loopback always ok
    request_headers: Callable[[], tuple[str, ...]]  # policy-selected headers visible to CEL


def _json(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _rpc_error(status: int, id: Any, code: int, message: str, data: Any = None) -> web.Response:
    return _json(status, jsonrpc.error_body(id, code, message, data))


def _is_stateless(request: web.Request, msg: Message | None) -> bool:
    version = request.headers.get("MCP-Protocol-Version", "")
    if not version and msg is not None:
        meta = msg.params.get("_meta")
        if isinstance(meta, dict):
            v = meta.get("io.modelcontextprotocol/protocolVersion")
            version = v if isinstance(v, str) else ""
    return version >= STATELESS_REVISION


def idempotency_key(headers: Mapping[str, str], params: Mapping[str, Any]) -> str | None:
    """The client's idempotency key: the `Idempotency-Key` header, else
    `params._meta["envelope/idempotency_key"]`; bounded to 200 characters."""
    key = headers.get("Idempotency-Key")
    if not key:
        meta = params.get("_meta")
        value = meta.get("envelope/idempotency_key") if isinstance(meta, dict) else None
        key = value if isinstance(value, str) else None
    return key[:200] if key else None


CLIENT_INFO_META = "io.modelcontextprotocol/clientInfo"


def run_id(headers: Mapping[str, str], session: str | None, principal_id: str,
           params: Mapping[str, Any]) -> str:
    """The run a call belongs to: the `X-Envelope-Run` header, else the MCP session, else
    (stateless revision) the principal plus the client it runs in, as named by
    `_meta["io.modelcontextprotocol/clientInfo"]` (name and version). The stateless protocol
    carries no per-instance id, so two instances of one client program under one principal
    share a run: their histories merge, which widens data-flow verdicts, never narrows them.
    Frameworks that run several agents per principal send `X-Envelope-Run`."""
    explicit = headers.get("X-Envelope-Run")
    if explicit:
        return explicit
    if session:
        return session
    meta = params.get("_meta")
    info = meta.get(CLIENT_INFO_META) if isinstance(meta, Mapping) else None
    if isinstance(info, Mapping) and isinstance(info.get("name"), str) and info["name"]:
        version = info.get("version")
        client = f"{info['name']}@{version}" if isinstance(version, str) and version else info["name"]
        return f"principal:{principal_id}/client:{client[:200]}"
    return f"principal:{principal_id}"


def refusal_result(decision: Decision, decision_id: str, stateless: bool) -> dict[str, Any]:
    """The tool result a model reads when the envelope refuses a call."""
    result: dict[str, Any] = {
        "content": [
            {"type": "text", "text": f"Blocked by policy ({decision.code.value}): {decision.reason}"}
        ],
        "isError": True,
        "_meta": {DECISION_META: decision.as_meta(decision_id)},
    }
    if stateless:
        result["resultType"] = "complete"
    return result


def guard_result(envelope: Envelope, pending: Pending, reply: dict[str, Any], msg_id: Any,
                 stateless: bool) -> tuple[dict[str, Any], Decision | None, bool]:
    """Run the output guardrails on the upstream's JSON-RPC reply before it is audited and sent.

    Returns (the reply to audit and send, the decision to audit instead of the call's own, or
    None, whether the reply differs from the upstream's bytes). Redactions rewrite `reply` in
    place; a `block` (or a guardrail failure: fail closed) replaces the result with a refusal.
    """
    guarded = guard_reply(pending, reply, envelope.metrics)
    if guarded.decision is None:
        return reply, None, guarded.changed
    refusal = refusal_result(guarded.decision, pending.call.decision_id, stateless)
    return {"jsonrpc": "2.0", "id": msg_id, "result": refusal}, guarded.decision, True


class McpFront:
    """aiohttp handlers for `/mcp/{upstream}`."""

    def __init__(
        self,
        envelope: Envelope,
        forwarder: Forwarder,
        identity: Identity,
        targets: Callable[[str], UpstreamTarget | None],
        settings: FrontSettings,
    ):
        self.envelope = envelope
        self.forwarder = forwarder
        self.identity = identity
        self.targets = targets
        self.settings = settings
        self.metrics = envelope.metrics
        # Told every upstream request outcome (proxy.upstream.health.UpstreamHealth.record); optional.
        self.on_upstream: Callable[[str, UpstreamOutcome, str | None], None] | None = None
        # Fire-and-forget upstream notifications (cancellations), tracked so shutdown can wait.
        self._background: set[asyncio.Task[None]] = set()
        self.shutting_down = False  # set by the runtime when it starts draining
        # In-band approval: what each session's client can do (from its initialize), and the
        # elicitation requests the proxy sent and awaits answers for.
        self.sessions = SessionCapabilities()
        self.elicitations = Elicitations()

    def routes(self) -> list[web.RouteDef]:
        return [web.route("*", "/mcp/{upstream}", self.handle)]

    async def close(self) -> None:
        """Let pending background notifications finish (bounded), then drop them."""
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        for task in self._background:
            task.cancel()

    def cancel_upstream(self, request: web.Request, target: UpstreamTarget, request_id: Any) -> None:
        """Tell a session-based upstream that the client gave up on `request_id`.

        In 2025-06-18 / 2025-11-25 a dropped connection is not a cancellation, so the proxy
        sends `notifications/cancelled` itself; in 2026-07-28 closing the stream (which the
        forwarder does) is the cancellation.
        """
        if not request.headers.get("Mcp-Session-Id"):
            return
        body = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                             "params": {"requestId": request_id, "reason": "client disconnected"}})
        headers = self._upstream_headers(request, target)
        headers["Content-Type"] = "application/json"
        headers.popall("Mcp-Method", None)
        headers.popall("Mcp-Name", None)

        async def send() -> None:
            try:
                resp = await self.forwarder.open("POST", target.url, headers, body,
                                                 connect_timeout=target.connect_timeout,
                                                 read_timeout=target.connect_timeout)
                resp.close()
            except (UpstreamError, TimeoutError) as exc:
                log.info("could not send notifications/cancelled to %s: %s", target.name, exc)

        self.spawn(send())

    # ---- entry -------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        problem = self._check_host_origin(request)
        if problem is not None:
            return problem
        target = self.targets(request.match_info["upstream"])
        if target is None:
            return _rpc_error(404, None, jsonrpc.METHOD_NOT_FOUND,
                              f"no upstream named {request.match_info['upstream']!r} is configured")
        principal = self.authenticate(request)
        if isinstance(principal, web.Response):
            return principal
        if request.method == "POST":
            return await self._post(request, target, principal)
        if request.method in ("GET", "DELETE"):
            session = request.headers.get("Mcp-Session-Id")
            if request.method == "DELETE" and session:
                self.sessions.forget(target.name, session)
            return await self._relay(request, target, None, stream_timeout=None)
        return web.Response(status=405, headers={"Allow": "GET, POST, DELETE"})

    def _observe_upstream(self, upstream: str, seconds: float, outcome: UpstreamOutcome,
                          error: str | None = None) -> None:
        """Count one upstream request and tell the health tracker (if any) its outcome."""
        self.metrics.observe_upstream(upstream, seconds, outcome)
        if self.on_upstream is not None:
            self.on_upstream(upstream, outcome, error)

    def authenticate(self, request: web.Request) -> Principal | web.Response:
        """The verified principal, or the 401 to send (identity headers are never trusted)."""
        try:
            return self.identity.resolve(request.headers)
        except IdentityError as exc:
            self.metrics.rejected("unauthenticated")
            return web.Response(
                status=401, body=jsonrpc.error_body(None, jsonrpc.INVALID_REQUEST, f"Unauthorized: {exc}"),
                content_type="application/json", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )

    def _check_host_origin(self, request: web.Request) -> web.Response | None:
        allowed = self.settings.allowed_hosts
        if "*" not in allowed:
            host = (request.host or "").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if host.startswith("[") and "]" in host:
                name = host[: host.index("]") + 1]
            if name not in allowed and name.strip("[]") not in allowed:
                self.metrics.rejected("bad_host")
                return _rpc_error(421, None, jsonrpc.INVALID_REQUEST, f"Misdirected request: host {host!r} is not allowed")
        origin = request.headers.get("Origin")
        if origin is not None and origin not in self.settings.allowed_origins:
            hostname = (urlsplit(origin).hostname or "").lower()
            if hostname not in LOOPBACK_HOSTS:
                self.metrics.rejected("bad_origin")
                return _rpc_error(403, None, jsonrpc.INVALID_REQUEST, f"Forbidden: origin {origin!r} is not allowed")
        return None

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BadMessage(jsonrpc.INVALID_REQUEST, f"Request body larger than {limit} bytes", "too_large", status=413)
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise BadMessage(jsonrpc.INVALID_REQUEST, f"Request body larger than {limit} bytes", "too_large", status=413)
        return bytes(buf)

    async def _post(self, request: web.Request, target: UpstreamTarget, principal: Principal) -> web.StreamResponse:
        try:
            body = await self._read_body(request)
            msg = jsonrpc.parse_post(body, self.settings.max_json_depth, request.headers.get("Mcp-Method"))
        except BadMessage as exc:
            self.metrics.rejected(exc.reason)
            headers = {"Connection": "close"} if exc.status == 413 else None
            return _json(exc.status, jsonrpc.error_body(exc.id, exc.code, exc.message), headers)
        if msg.is_request and msg.method == "tools/call":
            return await self._tools_call(request, target, principal, msg, body)
        if msg.is_request and msg.method == "tools/list":
            return await self._tools_list(request, target, principal, msg, body)
        if msg.method is None and isinstance(msg.id, str) and msg.id.startswith(ID_PREFIX):
            # The client's answer to the proxy's own elicitation request: never relayed upstream.
            if not self.elicitations.resolve(target.name, request.headers.get("Mcp-Session-Id"),
                                             principal.id, msg.body):
                log.info("an answer to unknown (or late) proxy request %s was dropped", msg.id)
            return web.Response(status=202)
        if msg.is_request and msg.method == "initialize":
            capabilities = msg.params.get("capabilities")

            def remember(resp: UpstreamResponse) -> None:
                session = resp.headers.get("Mcp-Session-Id")
                if session and resp.status == 200:
                    self.sessions.remember(target.name, session, principal.id, capabilities)

            return await self._relay(request, target, body, stream_timeout=None, on_response=remember)
        return await self._relay(request, target, body, stream_timeout=None)

    # ---- upstream plumbing -------------------------------------------------------------

    def _upstream_headers(self, request: web.Request, target: UpstreamTarget) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in request.headers.items():
            lname = name.lower()
            if lname in NOT_UPSTREAM and not (lname == "authorization" and target.forward_authorization):
                continue
            headers.add(name, value)
        for name, value in target.headers.items():
            headers[name] = value
        return headers

    @staticmethod
    def _downstream_headers(resp: UpstreamResponse, drop_type: bool = False) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in resp.headers.items():
            lname = name.lower()
            if lname in NOT_DOWNSTREAM or (drop_type and lname == "content-type"):
                continue
            headers.add(name, value)
        return headers

    async def _open(self, request: web.Request, target: UpstreamTarget, body: bytes | None,
                    read_timeout: float | None) -> UpstreamResponse:
        async with asyncio.timeout(target.timeout):
            return await self.forwarder.open(
                request.method, target.url, self._upstream_headers(request, target), body,
                connect_timeout=target.connect_timeout, read_timeout=read_timeout,
            )

    async def _relay(self, request: web.Request, target: UpstreamTarget, body: bytes | None,
                     stream_timeout: float | None,
                     on_response: Callable[[UpstreamResponse], None] | None = None) -> web.StreamResponse:
        """Relay a request we do not inspect: bytes in, bytes out, streamed. `on_response` sees
        the upstream's response (status, headers) before it is relayed."""
        started = time.perf_counter()
        try:
            resp = await self._open(request, target, body, stream_timeout)
        except (UpstreamError, TimeoutError) as exc:
            outcome: Literal["timeout", "error"] = (
                "timeout" if isinstance(exc, TimeoutError | UpstreamTimeout) else "error"
            )
            self._observe_upstream(target.name, time.perf_counter() - started, outcome, str(exc))
            msg = f"upstream {target.name!r} " + ("timed out" if outcome == "timeout" else f"unavailable: {exc}")
            return _rpc_error(502 if outcome == "error" else 504, None, jsonrpc.INTERNAL_ERROR, msg)
        self._observe_upstream(target.name, time.perf_counter() - started, "ok")
        if on_response is not None:
            on_response(resp)
        async with resp:
            out = web.StreamResponse(status=resp.status, headers=self._downstream_headers(resp))
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit():
                out.content_length = int(length)
            await out.prepare(request)
            try:
                async for chunk in resp.chunks():
                    await out.write(chunk)
            except (UpstreamError, ConnectionResetError) as exc:
                log.info("relay from %s ended early: %s", target.name, exc)
                return out
            await out.write_eof()
            return out

    # ---- tools/list --------------------------------------------------------------------

    def _filter_list(self, result: Any, target: UpstreamTarget, principal: Principal) -> Any:
        if not isinstance(result, dict) or not isinstance(result.get("tools"), list):
            return result
        self.envelope.registry.learn(target.name, result["tools"])
        self.envelope.refresh_catalogue_metrics()
        chain = self.envelope.chain
        if chain is None:
            visible: list[Any] = []
        else:
            visible = [
                t for t in result["tools"]
                if isinstance(t, dict) and isinstance(t.get("name"), str)
                and chain.visible(principal, target.name, t["name"])
            ]
        return {**result, "tools": visible}

    async def _tools_list(self, request: web.Request, target: UpstreamTarget, principal: Principal,
                          msg: Message, body: bytes) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            resp = await self._open(request, target, body, target.timeout)
            async with resp:
                ctype = resp.headers.get("Content-Type", "")
                if resp.status != 200 or not (ctype.startswith("application/json") or ctype.startswith("text/event-stream")):
                    data = await resp.read()
                    return web.Response(status=resp.status, body=data, headers=self._downstream_headers(resp))
                if ctype.startswith("application/json"):
                    data = await resp.read()
                    self._observe_upstream(target.name, time.perf_counter() - started, "ok")
                    reply = orjson.loads(data)
                    if isinstance(reply, dict) and "result" in reply:
                        reply["result"] = self._filter_list(reply["result"], target, principal)
                    return web.Response(status=200, body=orjson.dumps(reply),
                                        headers=self._downstream_headers(resp))
                out = web.StreamResponse(status=200, headers=self._downstream_headers(resp))
                await out.prepare(request)
                parser = SSEParser()
                async for chunk in resp.chunks():
                    for ev in parser.feed(chunk):
                        await out.write(self._rewrite_list_event(ev, msg, target, principal))
                for ev in parser.flush():
                    await out.write(self._rewrite_list_event(ev, msg, target, principal))
                self._observe_upstream(target.name, time.perf_counter() - started, "ok")
                await out.write_eof()
                return out
        except (UpstreamError, TimeoutError, orjson.JSONDecodeError) as exc:
            timeout = isinstance(exc, TimeoutError | UpstreamTimeout)
            self._observe_upstream(target.name, time.perf_counter() - started, "timeout" if timeout else "error", str(exc))
            what = "timed out" if timeout else f"failed: {exc}"
            return _rpc_error(200, msg.id, jsonrpc.INTERNAL_ERROR, f"upstream {target.name!r} {what}")

    def _rewrite_list_event(self, ev: SSEEvent, msg: Message, target: UpstreamTarget, principal: Principal) -> bytes:
        if not ev.has_data:
            return ev.raw
        try:
            reply = orjson.loads(ev.data)
        except orjson.JSONDecodeError:
            return ev.raw
        if not (isinstance(reply, dict) and reply.get("id") == msg.id and "result" in reply):
            return ev.raw
        reply["result"] = self._filter_list(reply["result"], target, principal)
        return format_event(orjson.dumps(reply), ev.event, ev.id)

    # ---- tools/call --------------------------------------------------------------------

    def _tool_call(self, request: web.Request, target: UpstreamTarget, principal: Principal,
                   msg: Message) -> ToolCall:
        params = msg.params
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise BadMessage(jsonrpc.INVALID_PARAMS, 'Invalid params: "name" must be a non-empty string',
                             "invalid_request", id=msg.id)
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise BadMessage(jsonrpc.INVALID_PARAMS, 'Invalid params: "arguments" must be an object',
                             "invalid_request", id=msg.id)
        header_name = request.headers.get("Mcp-Name")
        if header_name is not None and header_name != name:
            raise BadMessage(jsonrpc.HEADER_MISMATCH,
                             f"Mcp-Name header {header_name!r} does not match the tool name {name!r}",
                             "header_mismatch", id=msg.id)
        session = request.headers.get("Mcp-Session-Id")
        wanted = self.settings.request_headers()
        selected = {h: request.headers[h] for h in wanted if h in request.headers}
        return ToolCall(
            decision_id=uuid.uuid4().hex,
            upstream=target.name,
            tool=name,
            arguments=arguments,
            principal=principal,
            # The parent run and agent are claims the delegation check resolves against the
            # proxy's own lineage records; the depth is never taken from the client.
            run=RunContext(id=run_id(request.headers, session, principal.id, params), session=session,
                           parent=request.headers.get("X-Envelope-Parent-Run") or None,
                           agent=request.headers.get("X-Envelope-Agent") or None),
            request=RequestInfo(method="tools/call",
                                protocol_version=request.headers.get("MCP-Protocol-Version", ""),
                                headers=selected),
            idempotency_key=idempotency_key(request.headers, params),
            shadow_requested=request.headers.get("X-Envelope-Shadow", "").strip().lower() in ("1", "true", "yes"),
            capability_requested=request.headers.get("X-Envelope-Capability"),
        )

    async def _refuse(self, pending: Pending, decision: Decision, msg: Message, stateless: bool,
                      stream: web.StreamResponse | None = None, **finish: Any) -> web.StreamResponse:
        """Audit a refusal and build its reply (a tool result, or -32602 for unknown tools); as
        the last event of `stream` when the call's SSE stream is already open."""
        try:
            await self.envelope.finish(pending, decision, **finish)
        except AuditError:
            decision = Decision(Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                                "the audit log cannot be written; the call was refused")
        call = pending.call
        if stream is not None:
            payload = jsonrpc.result_body(msg.id, refusal_result(decision, call.decision_id, stateless))
            return await _end_stream(stream, payload)
        if decision.code is Code.UNKNOWN_TOOL:
            return _rpc_error(400 if stateless else 200, msg.id, jsonrpc.INVALID_PARAMS,
                              f"Unknown tool: {call.tool}",
                              {DECISION_META: decision.as_meta(call.decision_id)})
        return _json(200, jsonrpc.result_body(msg.id, refusal_result(decision, call.decision_id, stateless)))

    async def _tools_call(self, request: web.Request, target: UpstreamTarget, principal: Principal,
                          msg: Message, body: bytes) -> web.StreamResponse:
        stateless = _is_stateless(request, msg)
        try:
            call = self._tool_call(request, target, principal, msg)
        except BadMessage as exc:
            self.metrics.rejected(exc.reason)
            return _json(exc.status, jsonrpc.error_body(exc.id, exc.code, exc.message))
        channel = self._in_band_channel(request, target, principal, msg, stateless)
        if isinstance(channel, DeferChannel) and (channel.answer is not None or channel.state is not None):
            # The proxy's own answer and state never reach the upstream.
            params, _, _ = strip_stateless(msg.params)
            msg = Message({**msg.body, "params": params})
            body = orjson.dumps(msg.body)
        call.in_band = channel
        pending = await self.envelope.begin(call)
        stream = channel.stream if isinstance(channel, SessionChannel) else None
        if (isinstance(channel, DeferChannel) and channel.minted is not None
                and pending.decision.code is Code.APPROVAL_PENDING):
            return await self._input_required(pending, msg, channel)
        if pending.decision.refused:
            return await self._refuse(pending, pending.decision, msg, stateless, stream)
        if pending.decision.result is not None:
            if stream is not None:
                return await _end_stream(stream, await self._held_body(pending, msg, stateless))
            return await self._answer_held(pending, msg, stateless)
        return await _ForwardedCall(self, request, target, msg, body, pending, stateless, stream).run()

    def _in_band_channel(self, request: web.Request, target: UpstreamTarget, principal: Principal,
                         msg: Message, stateless: bool) -> SessionChannel | DeferChannel | None:
        """How the person at the client can be asked to approve this call, if at all (whether
        they may is the approval check's business)."""
        if stateless:
            _, carried, _ = strip_stateless(msg.params)
            if carried is not None:
                return carried
            return DeferChannel() if stateless_elicitation(msg.params) else None
        session = request.headers.get("Mcp-Session-Id")
        if not session or "text/event-stream" not in request.headers.get("Accept", ""):
            return None
        info = self.sessions.get(target.name, session)
        if info is None or not info.elicitation or info.principal != principal.id:
            return None
        return SessionChannel(request, self.elicitations, target.name, session, principal.id)

    async def _input_required(self, pending: Pending, msg: Message, channel: DeferChannel) -> web.Response:
        """2026-07-28: ask the client's user for the approval with an `input_required` result."""
        result = channel.input_required()
        result["_meta"] = {DECISION_META: pending.decision.as_meta(pending.call.decision_id)}
        try:
            await self.envelope.finish(pending)
        except AuditError:
            return await self._refuse(pending, Decision(  # type: ignore[return-value]
                Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                "the audit log cannot be written; the call was refused"), msg, True)
        return _json(200, jsonrpc.result_body(msg.id, result))

    async def _answer_held(self, pending: Pending, msg: Message, stateless: bool) -> web.Response:
        """Answer with a result the envelope holds (an idempotent replay, a shadow result)."""
        return _json(200, await self._held_body(pending, msg, stateless))

    async def _held_body(self, pending: Pending, msg: Message, stateless: bool) -> bytes:
        """Audit a held result (replay, shadow) and return its JSON-RPC reply (a refusal when
        the audit fails)."""
        decision = pending.decision
        result = dict(decision.result or {})
        meta = dict(result.get("_meta") or {})
        meta[DECISION_META] = decision.as_meta(pending.call.decision_id)
        if decision.code is Code.REPLAYED:
            meta["envelope/replayed"] = True
        elif decision.code is Code.SHADOWED:
            meta["envelope/shadow"] = True
        result["_meta"] = meta
        if stateless:
            result.setdefault("resultType", "complete")
        try:
            await self.envelope.finish(pending)
        except ResultWithheld as exc:
            result = refusal_result(exc.decision, pending.call.decision_id, stateless)
        except AuditError:
            refusal = Decision(Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                               "the audit log cannot be written; the call was refused")
            try:
                await self.envelope.finish(pending, refusal)
            except AuditError:
                pass
            result = refusal_result(refusal, pending.call.decision_id, stateless)
        return jsonrpc.result_body(msg.id, result)

    def spawn(self, coro: Any) -> None:
        """Run `coro` in the background, tracked so shutdown waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _end_stream(stream: web.StreamResponse, payload: bytes) -> web.StreamResponse:
    """Write the call's last message as an SSE event and end the stream."""
    try:
        await stream.write(format_event(payload))
        await stream.write_eof()
    except ConnectionResetError:
        pass
    return stream


class _ForwardedCall:
    """One allowed `tools/call` on its way upstream and back: audit before the reply."""

    def __init__(self, front: McpFront, request: web.Request, target: UpstreamTarget, msg: Message,
                 body: bytes, pending: Pending, stateless: bool,
                 stream: web.StreamResponse | None = None):
        self.front = front
        self.request = request
        self.target = target
        self.msg = msg
        self.body = body
        self.pending = pending
        self.stateless = stateless
        self.started = 0.0
        self.status: int | None = None
        # The client's SSE response, when open: the proxy opened it before forwarding (in-band
        # approval) or it relays the upstream's stream. Everything else is written on it.
        self.stream: web.StreamResponse | None = stream
        self.finished = False
        self.resumable = False  # the upstream's events carry ids: the client can resume
        self.attempts = 1

    def _upstream_seconds(self) -> float:
        return time.perf_counter() - self.started

    def _guard(self, reply: dict[str, Any]) -> tuple[dict[str, Any], Decision | None, bool]:
        """The output guardrails on the call's reply (see `guard_result`)."""
        return guard_result(self.front.envelope, self.pending, reply, self.msg.id, self.stateless)

    async def _finish_ok(self, result_body: Any, decision: Decision | None = None) -> Decision | None:
        """Audit the upstream's answer (or `decision`, a guardrail's refusal that replaces it).
        None when the answer may go out; else the refusal to send instead (the audit failed, or
        the result is withheld)."""
        is_error = None
        if isinstance(result_body, dict):
            res = result_body.get("result")
            if isinstance(res, dict):
                is_error = bool(res.get("isError", False))
            elif "error" in result_body:
                is_error = True
        self.finished = True
        try:
            await self.front.envelope.finish(self.pending, decision, upstream_status=self.status,
                                             upstream_seconds=self._upstream_seconds(),
                                             extra={"is_error": is_error}, reply=result_body)
        except AuditError:
            return Decision(Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                            "the audit log cannot be written; the result is withheld")
        except ResultWithheld as exc:
            return exc.decision
        return None

    def _failure(self, code: Code, reason: str) -> Decision:
        return Decision(Verdict.ERROR, code, "forward", reason)

    async def run(self) -> web.StreamResponse:
        front, target = self.front, self.target
        self.started = time.perf_counter()
        try:
            async with asyncio.timeout(target.timeout):
                return await self._exchange()
        except (TimeoutError, UpstreamTimeout):
            front._observe_upstream(target.name, self._upstream_seconds(), "timeout")
            return await self._fail(self._failure(
                Code.UPSTREAM_TIMEOUT, f"upstream {target.name!r} did not answer within {target.timeout:g}s"))
        except UpstreamError as exc:
            front._observe_upstream(target.name, self._upstream_seconds(), "error", str(exc))
            return await self._fail(self._failure(Code.UPSTREAM_ERROR, f"upstream {target.name!r} failed: {exc}"))
        except asyncio.CancelledError:
            self._client_gone()
            raise
        except ConnectionResetError:  # writing to a client that went away mid-stream
            self._client_gone()
            return self.stream or web.Response(status=499)

    def _client_gone(self) -> None:
        """The client disconnected before the result: audit it once, and cancel the upstream
        call unless the stream is resumable.

        A stream whose events carry ids (2025-11-25 with an event store) may be resumed with
        GET + Last-Event-ID, and the spec says a disconnect is not a cancellation then: the
        upstream keeps running and the result reaches the client on the resumed stream.
        Otherwise nobody can ever read the result, so the call is cancelled (`notifications/
        cancelled` for sessions; closing the upstream stream cancels a stateless call).
        """
        if self.finished:
            return
        self.finished = True
        if self.front.shutting_down:
            # Not the client: the proxy is stopping and its grace ran out on this call.
            log.warning("shutdown cut off decision %s (%s) before %s answered",
                        self.pending.call.decision_id, self.pending.call.qualified_name, self.target.name)
            self.front.cancel_upstream(self.request, self.target, self.msg.id)
            decision = self._failure(Code.SHUTDOWN,
                                     "the proxy shut down before the upstream answered; cancelled")
        elif self.resumable:
            decision = Decision(Verdict.ALLOW, Code.OK, "forward",
                                "the client disconnected; the stream is resumable, the call goes on")
        else:
            self.front.cancel_upstream(self.request, self.target, self.msg.id)
            decision = self._failure(Code.CLIENT_DISCONNECTED,
                                     "the client disconnected before the upstream answered; cancelled")
        # This runs while the handler is being cancelled: audit in a tracked task of its own.
        self.front.spawn(self._audit_quietly(decision))

    async def _audit_quietly(self, decision: Decision) -> None:
        try:
            await self.front.envelope.finish(self.pending, decision, upstream_status=self.status,
                                             upstream_seconds=self._upstream_seconds(),
                                             extra={"client_disconnected": True})
        except AuditError:
            log.error("could not audit the disconnect of decision %s", self.pending.call.decision_id)

    async def _fail(self, decision: Decision) -> web.StreamResponse:
        """Refuse after forwarding failed; in an SSE stream already open, as its last event."""
        if self.finished:  # audited already (e.g. upstream broke off after the result)
            return self.stream or web.Response(status=502)
        if self.stream is None:
            self.finished = True
            return await self.front._refuse(self.pending, decision, self.msg, self.stateless,
                                            upstream_status=self.status,
                                            upstream_seconds=self._upstream_seconds())
        self.finished = True
        try:
            await self.front.envelope.finish(self.pending, decision, upstream_status=self.status,
                                             upstream_seconds=self._upstream_seconds())
        except AuditError:
            decision = Decision(Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                                "the audit log cannot be written; the call was refused")
        payload = jsonrpc.result_body(self.msg.id, refusal_result(decision, self.pending.call.decision_id, self.stateless))
        try:
            await self.stream.write(format_event(payload))
            await self.stream.write_eof()
        except ConnectionResetError:
            pass
        return self.stream

    def _retry_config(self) -> RetryConfig | None:
        """The retry settings when this call may be retried: read-only, or carrying the client's
        idempotency key (the envelope claimed it, so a retry cannot perform it twice)."""
        call = self.pending.call
        if call.effect is not Effect.READ and call.idempotency_key is None:
            return None
        settings = getattr(self.front.envelope.services, "settings", None)
        retry = getattr(settings, "retry", None)
        return retry if isinstance(retry, RetryConfig) else RetryConfig()

    def _retry_delay(self, retry: RetryConfig, retry_after: float | None) -> float | None:
        """Seconds to wait before the next attempt; None when no attempt is left or the wait
        would not leave the attempt any of the upstream's timeout."""
        if self.attempts >= retry.attempts:
            return None
        delay = retry_after if retry_after is not None else retry.backoff * 2 ** (self.attempts - 1)
        delay = min(delay, retry.max_backoff)
        if delay >= self.target.timeout - self._upstream_seconds():
            return None
        return delay

    async def _open(self) -> UpstreamResponse:
        """Open the upstream request, retrying transient failures when the call allows it.

        Runs before any byte reaches the client, so a retry is invisible to it. Each failed
        attempt is counted as an upstream error and each retry in
        `envelope_upstream_retries_total`; the audit record carries the number of attempts.
        """
        front, target = self.front, self.target
        retry = self._retry_config()
        while True:
            attempt_started = time.perf_counter()
            delay: float | None = None
            try:
                resp = await front.forwarder.open(
                    "POST", target.url, front._upstream_headers(self.request, target), self.body,
                    connect_timeout=target.connect_timeout, read_timeout=target.timeout,
                )
            except UpstreamError as exc:
                if retry is not None and _connect_failed(exc):
                    delay = self._retry_delay(retry, None)
                if delay is None:
                    raise
                front._observe_upstream(target.name, time.perf_counter() - attempt_started,
                                        "error", str(exc))
            else:
                if retry is None or resp.status not in RETRY_STATUSES:
                    return resp
                delay = self._retry_delay(retry, _retry_after(resp.headers.get("Retry-After")))
                if delay is None:
                    return resp
                resp.close()
                front._observe_upstream(target.name, time.perf_counter() - attempt_started,
                                        "error", f"answered HTTP {resp.status}")
            front.metrics.upstream_retry(target.name)
            log.info("retrying %s on %s in %.3gs (attempt %d failed)", self.pending.call.qualified_name,
                     target.name, delay, self.attempts)
            await asyncio.sleep(delay)
            self.attempts += 1
            self.pending.call.audit_extra["attempts"] = self.attempts

    async def _exchange(self) -> web.StreamResponse:
        front, target = self.front, self.target
        resp = await self._open()
        async with resp:
            self.status = resp.status
            ctype = resp.headers.get("Content-Type", "")
            if ctype.startswith("text/event-stream") and resp.status == 200:
                return await self._relay_sse(resp)
            data = await resp.read()
            front._observe_upstream(target.name, self._upstream_seconds(),
                                    "ok" if resp.status < 500 else "error", f"answered HTTP {resp.status}")
            parsed: Any = None
            if ctype.startswith("application/json"):
                try:
                    parsed = orjson.loads(data)
                except orjson.JSONDecodeError:
                    parsed = None
            if (isinstance(parsed, dict) and parsed.get("id") == self.msg.id
                    and ("result" in parsed or "error" in parsed)):
                # The server's own answer (a result, or a JSON-RPC error with its HTTP status).
                parsed, guarded, changed = self._guard(parsed)
                if changed:  # redacted or blocked: a new body (and so a new Content-Length)
                    data = orjson.dumps(parsed)
                refusal = await self._finish_ok(parsed, guarded)
                if refusal is not None:
                    if self.stream is not None:
                        return await _end_stream(self.stream, self._refusal(refusal).body)  # type: ignore[arg-type]
                    return self._refusal(refusal)
                if self.stream is not None:
                    return await _end_stream(self.stream, data)
                return web.Response(status=resp.status, body=data, headers=front._downstream_headers(resp))
            reason = f"upstream {target.name!r} answered HTTP {resp.status}" + (
                "" if resp.status != 200 else " without a JSON-RPC reply")
            if resp.status == 404 and self.stream is None:
                # Unknown or expired session: pass it through so the client re-initializes, as
                # the protocol asks.
                self.finished = True
                try:
                    await front.envelope.finish(
                        self.pending, self._failure(Code.UPSTREAM_ERROR, reason),
                        upstream_status=resp.status, upstream_seconds=self._upstream_seconds())
                except AuditError:
                    return self._audit_refusal()
                return web.Response(status=resp.status, body=data, headers=front._downstream_headers(resp))
            # 5xx, garbage, anything that is not an answer: a refusal the model can read.
            return await self._fail(self._failure(Code.UPSTREAM_ERROR, reason))

    def _audit_refusal(self) -> web.Response:
        return self._refusal(Decision(Verdict.ERROR, Code.AUDIT_UNAVAILABLE, "audit",
                                      "the audit log cannot be written; the result is withheld"))

    def _refusal(self, decision: Decision) -> web.Response:
        return _json(200, jsonrpc.result_body(
            self.msg.id, refusal_result(decision, self.pending.call.decision_id, self.stateless)))

    async def _relay_sse(self, resp: UpstreamResponse) -> web.StreamResponse:
        """Relay the call's SSE stream event by event; audit just before the result event."""
        front = self.front
        out = self.stream
        if out is None:
            out = web.StreamResponse(status=200, headers=front._downstream_headers(resp))
            await out.prepare(self.request)
            self.stream = out
        parser = SSEParser()
        first = True
        async for chunk in resp.chunks():
            if first:
                front._observe_upstream(self.target.name, self._upstream_seconds(), "ok")
                first = False
            for ev in parser.feed(chunk):
                if not await self._relay_event(out, ev):
                    return out
        for ev in parser.flush():
            if not await self._relay_event(out, ev):
                return out
        if not self.finished:
            if self.resumable:
                # 2025-11-25 lets a server close a call's stream early (after a priming event
                # with an id); the client resumes with GET + Last-Event-ID and the result
                # arrives there. Inventing a failure here would give the call two answers.
                self.finished = True
                try:
                    await front.envelope.finish(
                        self.pending, upstream_status=self.status,
                        upstream_seconds=self._upstream_seconds(),
                        extra={"is_error": None, "stream": "closed before the result; resumable"},
                    )
                except AuditError:
                    return await self._fail(self._failure(Code.AUDIT_UNAVAILABLE, "audit log unavailable"))
                await out.write_eof()
                return out
            return await self._fail(self._failure(
                Code.UPSTREAM_ERROR, f"upstream {self.target.name!r} closed the stream without a result"))
        await out.write_eof()
        return out

    async def _relay_event(self, out: web.StreamResponse, ev: SSEEvent) -> bool:
        """Write one event; audit first when it is our response. False ends the relay."""
        if ev.id:
            self.resumable = True
        if not self.finished and ev.has_data and b'"id"' in ev.raw:
            try:
                reply = orjson.loads(ev.data)
            except orjson.JSONDecodeError:
                reply = None
            if (isinstance(reply, dict) and reply.get("id") == self.msg.id
                    and ("result" in reply or "error" in reply)):
                reply, guarded, changed = self._guard(reply)
                refusal = await self._finish_ok(reply, guarded)
                if refusal is not None:
                    await out.write(format_event(self._refusal(refusal).body))  # type: ignore[arg-type]
                    await out.write_eof()
                    return False
                if changed:  # redacted or blocked: the rewritten result event, same id
                    await out.write(format_event(orjson.dumps(reply), ev.event, ev.id))
                    return True
        await out.write(ev.raw)
        return True
