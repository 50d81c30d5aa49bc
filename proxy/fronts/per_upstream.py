"""MCP Streamable HTTP front, one route per upstream: `/mcp/<upstream>`, every revision.

Wire only (see `proxy.fronts.forwarded` for the executor and `proxy.fronts.render` for what
goes back). By method:

- `tools/call`: the envelope decides (`calls.tool_call_from` -> `Envelope.begin`), the executor
  forwards and ends it, `render` answers (a refusal is a tool result the model reads).
- `resources/read`, `prompts/get`, `tasks/result`: content reads: forwarded by the same
  executor, their answer inspected (labels and guardrails of the resource, prompt, or the task's
  tool) and audited.
- `tools/list`: the answer teaches the tool registry and is filtered per principal.
- Sessions are bound to the principal that created them (learned from the relayed `initialize`
  answer): a request, of any method, carrying a session id another principal created is answered
  404 "Session not found". The binding is in the state store too (`sessions.SharedOwners`), so
  every worker and replica sharing it, and the process after a restart, knows it; a session no
  proxy sharing the store saw created is relayed, and the upstream decides.
- `tasks/get`, `tasks/cancel` (and `tasks/result`) are relayed only for the principal whose call
  created the task (in memory and in the store): the upstream knows one caller, the proxy, and
  would answer or cancel another principal's task; a task unknown so is refused (-32602). A
  `tasks/list` answer keeps only that principal's tasks.
- Everything else (initialize, ping, lists, completion, notifications, the client's answers to
  server requests) is relayed; every JSON-RPC message the upstream sends back, as
  JSON or SSE, on POST and on the standalone GET stream (resumed or not), is inspected by the
  envelope before it is delivered (`Envelope.relay`: forged meta removed, guardrails, ledger).
- A result that reaches the client on a resumed GET stream (`Last-Event-ID`) after it left the
  call's stream is inspected as that call's result and audited as its delivery.
- An HTTP upstream (`openapi:`) speaks no MCP: its route is answered by the proxy itself, by
  the aggregate's MCP server in single-upstream mode (`AggregateFront(single=True)`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.envelope.pipeline import Pending
from proxy.envelope.types import Principal, Reply, ToolCall
from proxy.errors import ReplyTooLarge, StoreError, UpstreamBusy, UpstreamError, UpstreamTimeout
from proxy.fronts import calls, jsonrpc, render
from proxy.fronts.aggregate import AggregateFront
from proxy.fronts.calls import Route
from proxy.fronts.context import FrontContext
from proxy.fronts.forwarded import Downstream, UpstreamRequest, UpstreamTarget
from proxy.fronts.guard import Guard, body_decoded, read_body
from proxy.fronts.headers import HOP_BY_HOP, layered, nominated, protected
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
from proxy.fronts.sessions import SharedOwners
from proxy.fronts.sessions import digest as session_digest
from proxy.fronts.sse import (
    KEEP_ALIVE,
    SSEEvent,
    SSEParser,
    format_event,
    format_fields,
    verbatim,
)
from proxy.observability import tracing
from proxy.policy.vocab import Effect
from proxy.upstream.forwarder import UpstreamResponse
from proxy.upstream.stdio import principal_value

log = logging.getLogger("envelope.mcp")

# Request headers the proxy consumes itself and does not pass upstream (besides the hop-by-hop
# ones and what `Connection` names: `proxy.fronts.headers`).
NOT_UPSTREAM = HOP_BY_HOP | {"accept-encoding", "authorization", "origin", "cookie", "x-envelope-run",
                             "x-envelope-shadow", "x-envelope-parent-run", "x-envelope-capability",
                             "x-envelope-agent", "x-envelope-intent", "x-envelope-stdio-principal"}
# Response headers the proxy's own server sets.
NOT_DOWNSTREAM = HOP_BY_HOP | {"server", "date"}
# Requests whose answer is content the agent reads: forwarded by the executor and audited.
READS = frozenset({"resources/read", "prompts/get", "tasks/result"})
# Requests whose answer is recorded in the run's ledger when relayed (task status messages).
# Lists, initialize and the like are inspected (meta, guardrails) but not recorded: their text
# is the server's self-description, read before any task, and recording it would taint every run.
RECORDED = frozenset({"tasks/get", "tasks/list", "tasks/cancel"})
# Requests naming a task, relayed only for the principal whose call created it (`tasks/result`,
# a content read, too: `_read`).
OWNED_TASK_REQUESTS = frozenset({"tasks/get", "tasks/cancel"})
# Requests an upstream may receive twice (nothing changes): resent once on a stale pooled
# connection. Every other request written to an upstream is never sent again.
REPEATABLE = frozenset({"ping", "tools/list", "resources/list", "resources/templates/list",
                        "prompts/list", "tasks/get", "tasks/list", "completion/complete"})
# How many calls left on a resumable stream, and how many task ids, are remembered.
REMEMBERED = 10_000
# Most entries of one `tasks/list` answer looked up (`_Scope._own_tasks`); the rest are dropped.
LISTED_TASKS = 1_000
REMEMBER_SECONDS = 3600.0
# How long the tool of a task is known (in memory, and in the store's TASKS_NS): its result is
# inspected as that tool's; a result asked for later is refused (its tool's guardrails and labels
# could not be applied).
TASK_SECONDS = 24 * 3600.0
TASKS_NS = "tasks"
# Calls whose client left a resumable stream, for the worker a resumed GET lands on.
DETACHED_NS = "detached"


class _Remembered:
    """A bounded, expiring map of calls by a wire key (LRU, entries live `REMEMBER_SECONDS`)."""

    def __init__(self, size: int = REMEMBERED, seconds: float = REMEMBER_SECONDS):
        self._size = size
        self._seconds = seconds
        self._items: OrderedDict[tuple[Any, ...], tuple[float, ToolCall]] = OrderedDict()

    def put(self, key: tuple[Any, ...], call: ToolCall) -> None:
        self._items[key] = (time.monotonic() + self._seconds, call)
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def get(self, key: tuple[Any, ...], pop: bool = False) -> ToolCall | None:
        found = self._items.pop(key, None) if pop else self._items.get(key)
        if found is None or found[0] < time.monotonic():
            return None
        return found[1]


def _id_key(value: Any) -> str:
    """A JSON-RPC id as a dict key that tells 1 from "1"."""
    return orjson.dumps(value).decode()


class McpFront:
    """aiohttp handlers for `/mcp/{upstream}`."""

    def __init__(self, context: FrontContext):
        self.ctx = context
        self.envelope = context.envelope
        self.metrics = context.metrics
        context.executor.on_detached = self._detached
        # In-band approval: what each session's client can do (from its initialize), and the
        # elicitation requests the proxy sent and awaits answers for.
        self.sessions = SessionCapabilities()
        # The same binding in the store, for every worker and replica (not a per-process memory
        # store: the bounded map above is all such a process needs, and it stays bounded).
        store = context.store
        self.owners = SharedOwners(store) if store is not None and store.kind != "memory" else None
        self.elicitations = Elicitations(self.owners.store if self.owners is not None else None)
        # Calls whose client left a resumable stream: their result may arrive on a resumed GET.
        self.detached = _Remembered()
        # Task-augmented calls by task id: `tasks/result` is inspected as that tool's result (and
        # in the store too, for the other workers and replicas: `_task_tool`).
        self.tasks = _Remembered(seconds=TASK_SECONDS)
        # HTTP upstreams' routes: an MCP server the proxy answers itself.
        self.http_tools = AggregateFront(context, tuple, single=True)

    def routes(self, guard: Guard) -> list[web.RouteDef]:
        """The route, every request through `guard` first."""
        return [web.route("*", "/mcp/{upstream}", guard.wrap(self.handle), expect_handler=guard.expect_handler())]

    # ---- entry -------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        target = self.ctx.targets(request.match_info["upstream"])
        if target is None:
            return render.rpc_error(404, None, jsonrpc.METHOD_NOT_FOUND,
                                    f"no upstream named {request.match_info['upstream']!r} is configured")
        if self.ctx.spec(target.name) is not None:
            return await self.http_tools.handle(request)
        principal = self.ctx.authenticate(request)
        if isinstance(principal, web.Response):
            return principal
        session = request.headers.get("Mcp-Session-Id")
        if session and (refused := await self._foreign(request, target, session, principal)) is not None:
            return refused
        if request.method == "POST":
            return await self._post(request, target, principal)
        if request.method == "GET":
            return await self._get(request, target, principal)
        if request.method == "DELETE":
            async def ended(resp: UpstreamResponse) -> None:
                # Forgotten once the upstream ended it (or knows it no more): a server may
                # refuse DELETE (405), and a session alive upstream that the proxy forgot would
                # take another principal holding its id as one it never saw.
                if session and (200 <= resp.status < 300 or resp.status == 404):
                    self.sessions.forget(target.name, session)
                    if self.owners is not None:
                        try:
                            await self.owners.release(target.name, session, principal.id)
                        except StoreError as exc:  # the binding stays: it refuses others only
                            log.warning("the ended session's binding on upstream %s stays in the "
                                        "store until it expires: %s", target.name, exc)

            return await self._relay(request, target, principal, None, None, on_response=ended)
        return web.Response(status=405, headers={"Allow": "GET, POST, DELETE"})

    async def _post(self, request: web.Request, target: UpstreamTarget, principal: Principal) -> web.StreamResponse:
        settings = self.ctx.settings
        try:
            body = await read_body(request, settings.max_body_bytes, settings.body_timeout)
            msg = await jsonrpc.parse_post(body, settings.max_json_depth, request.headers.get("Mcp-Method"))
        except BadMessage as exc:
            self.metrics.rejected(exc.reason)
            response = render.rpc_error(exc.status, exc.id, exc.code, exc.message)
            if exc.close:
                response.force_close()
            return response
        if tracing.TRACER is not None:
            tracing.request(msg.method, msg.id, msg.params, request.headers)
        method = msg.method if msg.is_request else None
        if method == "tools/call":
            return await self._tools_call(request, target, principal, msg, body)
        if method == "tools/list":
            return await self._relay(request, target, principal, msg, body, tools_list=True)
        if method in READS:
            return await self._read(request, target, principal, msg, body)
        if method in OWNED_TASK_REQUESTS:
            if isinstance(refused := await self._own_task(target, principal, msg), web.Response):
                return refused
        if msg.method is None and isinstance(msg.id, str) and msg.id.startswith(ID_PREFIX):
            # The client's answer to the proxy's own elicitation request: never relayed upstream.
            session = request.headers.get("Mcp-Session-Id")
            if not self.elicitations.resolve(target.name, session, principal.id, msg.body):
                handed = False
                if session:  # asked by another worker of this session, perhaps: handed over
                    try:
                        handed = await self.elicitations.hand_over(target.name, session, principal.id, msg.body)
                    except StoreError as exc:
                        log.error("an answer to proxy request %s could not be handed over: %s", msg.id, exc)
                        return render.rpc_error(503, None, jsonrpc.INTERNAL_ERROR,
                                                "the answer could not be passed on (state store unavailable)")
                if not handed:
                    log.info("an answer to unknown (or late) proxy request %s was dropped", msg.id)
            return web.Response(status=202)
        if method == "initialize":
            capabilities = msg.params.get("capabilities")

            async def remember(resp: UpstreamResponse) -> None:
                session = resp.headers.get("Mcp-Session-Id")
                if session and resp.status == 200:
                    self.sessions.remember(target.name, session, principal.id, capabilities)
                    if self.owners is not None:  # before the client learns the id
                        info = self.sessions.get(target.name, session)
                        await self.owners.claim(target.name, session, principal.id,
                                                info is not None and info.elicitation)

            return await self._relay(request, target, principal, msg, body, on_response=remember)
        return await self._relay(request, target, principal, msg, body)

    # ---- upstream plumbing -------------------------------------------------------------

    def _upstream_headers(self, request: web.Request, target: UpstreamTarget) -> CIMultiDict[str]:
        """The client's headers the upstream gets: not the hop-by-hop ones, not what the
        client's `Connection` names, not those the proxy consumes (`NOT_UPSTREAM`), and a name
        holding `_` only under `underscore_headers: allow` (and never a spelling of a field the
        proxy strips or sets); then the upstream's configured headers (the proxy's own
        credential) and trace context, which nothing the client sends removes."""
        headers: CIMultiDict[str] = CIMultiDict()
        decoded = body_decoded(request)
        named = nominated(request.headers)
        strip = NOT_UPSTREAM | named if named else NOT_UPSTREAM
        underscores = connection = 0
        for name, value in request.headers.items():
            lname = name.lower()
            if lname in strip:
                if lname in named:
                    connection += 1
                elif lname == "authorization" and target.forward_authorization:
                    headers.add(name, value)
                continue
            if lname == "content-encoding" and decoded:  # the body forwarded is the decoded one
                continue
            if "_" in lname and not self._underscore_allowed(lname, target):
                underscores += 1
                continue
            headers.add(name, value)
        if underscores:
            self.metrics.headers_dropped("request", "underscore", underscores)
        if connection:
            self.metrics.headers_dropped("request", "connection", connection)
        for name, value in target.headers.items():
            headers[name] = value
        # The client's traceparent continues in the proxy's trace: the upstream joins it there.
        return headers if tracing.TRACER is None else tracing.inject(headers)

    def _underscore_allowed(self, lname: str, target: UpstreamTarget) -> bool:
        """Whether a request header whose (lower-case) name holds `_` goes upstream."""
        if self.ctx.settings.underscore_headers != "allow":
            return False
        folded = lname.replace("_", "-")  # what an upstream that folds `_` reads it as
        return not (folded in NOT_UPSTREAM or protected(folded)
                    or any(folded == n.lower() for n in target.headers))

    def _session_headers(self, request: web.Request, target: UpstreamTarget) -> dict[str, str] | None:
        """What reaches the client's upstream session (None: stateless, no session)."""
        session = request.headers.get("Mcp-Session-Id")
        if not session:
            return None
        headers = {"Mcp-Session-Id": session}
        version = request.headers.get("MCP-Protocol-Version")
        if version:
            headers["MCP-Protocol-Version"] = version
        auth = request.headers.get("Authorization")
        if auth and target.forward_authorization:
            headers["Authorization"] = auth
        return layered(headers, target.headers)

    def _downstream_headers(self, resp: UpstreamResponse) -> CIMultiDict[str]:
        """The upstream's response headers the client gets (hop-by-hop ones, what the
        upstream's `Connection` names and the proxy server's own headers removed)."""
        named = nominated(resp.headers)
        skip = NOT_DOWNSTREAM | named if named else NOT_DOWNSTREAM
        headers: CIMultiDict[str] = CIMultiDict()
        for name, value in resp.headers.items():
            if name.lower() not in skip:
                headers.add(name, value)
        if named:
            self.metrics.headers_dropped("response", "connection",
                                        sum(1 for name in resp.headers if name.lower() in named))
        return headers

    def _route(self, request: web.Request, target: UpstreamTarget) -> Route:
        return Route(target.name, request.headers.get("Mcp-Session-Id") or None,
                     request.headers.get("MCP-Protocol-Version", ""))

    def _request(self, request: web.Request, target: UpstreamTarget, msg: Message,
                 body: bytes) -> UpstreamRequest:
        return UpstreamRequest(target, body, self._upstream_headers(request, target), msg.id,
                               session=self._session_headers(request, target))

    def _detached(self, pending: Pending, upstream: UpstreamRequest) -> Awaitable[None] | None:
        """A call's client left a resumable stream: its result may come on a resumed GET (on
        this worker, or on another: its tool and decision go in the store too, by what this
        returns)."""
        call = pending.call
        if not call.run.session:
            return None
        self.detached.put((call.upstream, call.run.session, call.principal.id, _id_key(upstream.reply_id)), call)
        return self._share_detached(call, _id_key(upstream.reply_id)) if self.owners is not None else None

    @staticmethod
    def _detached_key(upstream: str, session: str, principal: str, reply_id: str) -> str:
        return f"{upstream}/{session_digest(session + chr(0) + principal + chr(0) + reply_id)}"

    async def _share_detached(self, call: ToolCall, reply_id: str) -> None:
        assert self.owners is not None and call.run.session
        try:
            await self.owners.store.put(
                DETACHED_NS, self._detached_key(call.upstream, call.run.session, call.principal.id, reply_id),
                orjson.dumps({"tool": call.tool, "decision_id": call.decision_id}), ttl=REMEMBER_SECONDS)
        except StoreError as exc:  # another worker inspects the result as untrusted content
            log.warning("a detached call of %s.%s is known to this worker only: %s", call.upstream, call.tool, exc)

    async def detached_elsewhere(self, upstream: str, session: str, principal: str,
                                 reply_id: str) -> tuple[str, str] | None:
        """(tool, decision id) of a call another worker saw detached, or None. Raises StoreError."""
        if self.owners is None:
            return None
        found = await self.owners.store.get(DETACHED_NS, self._detached_key(upstream, session, principal, reply_id))
        shared = orjson.loads(found) if found is not None else None
        if not isinstance(shared, dict) or not isinstance(shared.get("tool"), str):
            return None
        return shared["tool"], str(shared.get("decision_id"))

    # ---- tools/call and content reads ------------------------------------------------------

    async def _tools_call(self, request: web.Request, target: UpstreamTarget, principal: Principal,
                          msg: Message, body: bytes) -> web.StreamResponse:
        stateless = calls.is_stateless(request.headers, msg)
        try:
            name, arguments = calls.tool_request(msg, request.headers)
        except BadMessage as exc:
            self.metrics.rejected(exc.reason)
            return render.rpc_error(exc.status, exc.id, exc.code, exc.message)
        call = calls.tool_call_from(request.headers, msg, self._route(request, target), name, arguments,
                                    principal, self.ctx.settings.request_headers())
        channel = self._in_band_channel(request, target, principal, msg, stateless)
        if isinstance(channel, DeferChannel) and (channel.answer is not None or channel.state is not None):
            # The proxy's own answer and state never reach the upstream.
            params, _, _ = strip_stateless(msg.params)
            msg = Message({**msg.body, "params": params})
            body = orjson.dumps(msg.body)
        call.in_band = channel
        pending = await self.envelope.begin(call)
        downstream = Downstream(request, channel.stream if isinstance(channel, SessionChannel) else None,
                                self._downstream_headers)
        outcome = await self.ctx.executor.run(pending, self._request(request, target, msg, body), downstream)
        await self._remember_task(outcome.message, call)
        ask = channel.input_required() if isinstance(channel, DeferChannel) and channel.minted else None
        return await render.respond(outcome, msg.id, stateless=stateless, stream=downstream.stream,
                                    headers=downstream.response_headers, tool=name, ask=ask,
                                    plain=render.writes_plain(request))

    @staticmethod
    def _task_key(upstream: str, principal: str, task_id: str) -> str:
        return f"{upstream}/{session_digest(principal + chr(0) + task_id)}"

    async def _remember_task(self, message: Mapping[str, Any] | None, call: ToolCall) -> None:
        result = message.get("result") if message is not None else None
        task = result.get("task") if isinstance(result, dict) else None
        task_id = task.get("taskId") if isinstance(task, dict) else None
        if isinstance(task_id, str):
            self.tasks.put((call.upstream, call.principal.id, task_id), call)
            if self.owners is not None:
                try:
                    await self.owners.store.put(TASKS_NS, self._task_key(call.upstream, call.principal.id, task_id),
                                                call.tool.encode("utf-8", "surrogatepass"), ttl=TASK_SECONDS)
                except StoreError as exc:  # another worker will refuse its result: fail closed
                    log.error("task %s of %s.%s is known to this worker only: %s", task_id[:80],
                              call.upstream, call.tool, exc)

    async def _task_tool(self, target: UpstreamTarget, principal: Principal, task_id: Any) -> str | None:
        """The tool whose task `task_id` is (None: not known to any worker sharing the store).
        Raises StoreError."""
        if not isinstance(task_id, str):
            return None
        task = self.tasks.get((target.name, principal.id, task_id))
        if task is not None:
            return task.tool
        if self.owners is None:
            return None
        found = await self.owners.store.get(TASKS_NS, self._task_key(target.name, principal.id, task_id))
        return None if found is None else found.decode("utf-8", "surrogatepass")

    async def _own_task(self, target: UpstreamTarget, principal: Principal, msg: Message) -> str | web.Response:
        """The tool of the task a `tasks/get`, `tasks/result` or `tasks/cancel` names, or its
        refusal: a task not created through this proxy by this principal (another principal's
        task id: the upstream knows one caller, the proxy, and would answer or cancel it) is
        unknown (-32602), one whose owner the store cannot tell 503. Never relayed."""
        task_id = msg.params.get("taskId")
        try:
            tool = await self._task_tool(target, principal, task_id)
        except StoreError as exc:
            log.error("%s on upstream %s refused: the task's tool cannot be read: %s", msg.method,
                      target.name, exc)
            return render.rpc_error(503, msg.id, jsonrpc.INTERNAL_ERROR,
                                    "the task's tool cannot be read (state store unavailable)")
        if tool is None:
            # Another principal's, or its tool's guardrails and labels could not be applied to
            # its result: not relayed (fail closed).
            log.warning("%s on upstream %s refused: task %r is not known", msg.method, target.name,
                        str(task_id)[:80])
            return render.rpc_error(200, msg.id, jsonrpc.INVALID_PARAMS,
                                    "unknown task: it was not created through this proxy by this "
                                    "principal (or is older than 24 h)" + (
                                        ", so its result cannot be inspected as its tool's"
                                        if msg.method == "tasks/result" else ""))
        return tool

    async def _read(self, request: web.Request, target: UpstreamTarget, principal: Principal,
                    msg: Message, body: bytes) -> web.StreamResponse:
        """A content read: the answer is inspected as the resource's, prompt's or task tool's
        content, recorded in the run's ledger and audited (one record per read)."""
        method = msg.method or ""
        tool = None
        if method == "tasks/result":
            owned = await self._own_task(target, principal, msg)
            if isinstance(owned, web.Response):
                return owned
            tool = owned
        call = calls.read_from(request.headers, method, msg.params, self._route(request, target),
                               principal, tool)
        call.effect = Effect.READ
        pending = self.envelope.begin_read(call, requested=True)
        downstream = Downstream(request, None, self._downstream_headers)
        outcome = await self.ctx.executor.run(pending, self._request(request, target, msg, body), downstream)
        return await render.respond(outcome, msg.id, stateless=calls.is_stateless(request.headers, msg),
                                    stream=downstream.stream, headers=downstream.response_headers,
                                    plain=render.writes_plain(request))

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

    # ---- everything else: relayed, every message inspected ----------------------------------

    async def _get(self, request: web.Request, target: UpstreamTarget, principal: Principal) -> web.StreamResponse:
        """A GET stream (standalone or resumed): relayed while it holds a slot of the streams'
        budget (503 past it), freed however the stream ends."""
        slot = self.ctx.take_streams(principal, (target.name,))
        if isinstance(slot, web.Response):
            return slot
        try:
            return await self._relay(request, target, principal, None, None)
        finally:
            slot.release()

    async def _foreign(self, request: web.Request, target: UpstreamTarget, session: str,
                       principal: Principal) -> web.StreamResponse | None:
        """The refusal of a request carrying a session another principal created (404, as for
        a session that does not exist, whatever the method: a session id is a bearer string,
        not identity), or None. A session this process does not know is looked up in the
        store (created through another worker or replica, or before a restart); one the store
        cannot be asked about is refused (503)."""
        owner = self.sessions.owner(target.name, session)
        if owner is None and self.owners is not None:
            try:
                bound = await self.owners.binding(target.name, session)
            except StoreError as exc:
                log.error("refused a %s on upstream %s: the session's owner cannot be read: %s",
                          request.method, target.name, exc)
                return render.rpc_error(503, None, jsonrpc.INTERNAL_ERROR,
                                        "the session's owner cannot be read (state store unavailable)")
            owner = None if bound is None else bound[0]
            if bound is not None and owner == principal.id:  # known here from now on
                self.sessions.remember(target.name, session, principal.id,
                                       {"elicitation": {}} if bound[1] else None)
        if owner is None or owner == principal.id:
            return None
        self.metrics.rejected("foreign_session")
        log.warning("refused a %s on upstream %s: the session was created by another principal",
                    request.method, target.name)
        return render.rpc_error(404, None, jsonrpc.INVALID_REQUEST, "Session not found")

    async def _relay(self, request: web.Request, target: UpstreamTarget, principal: Principal,
                     msg: Message | None, body: bytes | None, *, tools_list: bool = False,
                     on_response: Callable[[UpstreamResponse], Awaitable[None]] | None = None
                     ) -> web.StreamResponse:
        """Relay a request the envelope does not decide; inspect every JSON-RPC message of the
        answer (JSON or SSE) before it is delivered. A GET (standalone or resumed stream) has
        no read timeout and a connection of the streams' budget; any other request's answer
        must start and end within the upstream's timeout (else its stream ends with a JSON-RPC
        error, a JSON answer is a 504). An SSE event or a JSON body past its cap is
        not read on: the stream ends there (a JSON answer is a 502)."""
        ctx = self.ctx
        settings = ctx.settings
        started = time.perf_counter()
        stream = request.method == "GET"
        headers = self._upstream_headers(request, target)
        if target.principal_header is not None:
            headers[target.principal_header] = principal_value(principal.id)
        try:
            async with asyncio.timeout(target.timeout):
                resp = await ctx.forwarder.open(
                    request.method, target.url, headers, body,
                    connect_timeout=target.connect_timeout, read_timeout=None if stream else target.timeout,
                    resend=request.method in ("GET", "DELETE") or (msg is not None and msg.method in REPEATABLE),
                    long_lived=stream)
        except UpstreamBusy as exc:  # the proxy's budget, not the upstream's health
            return ctx.busy(str(exc))
        except (UpstreamError, TimeoutError) as exc:
            timeout = isinstance(exc, TimeoutError | UpstreamTimeout)
            ctx.observe(target.name, time.perf_counter() - started, "timeout" if timeout else "error", str(exc))
            what = "timed out" if timeout else f"unavailable: {exc}"
            return render.rpc_error(504 if timeout else 502, msg.id if msg else None,
                                    jsonrpc.INTERNAL_ERROR, f"upstream {target.name!r} {what}")
        ok = resp.status < 500  # as the executor and the aggregate count an answer
        ctx.observe(target.name, time.perf_counter() - started, "ok" if ok else "error",
                    None if ok else f"answered HTTP {resp.status}")
        if on_response is not None:
            try:
                await on_response(resp)
            except StoreError as exc:  # a session that could not be bound is not handed out
                resp.close()
                log.error("upstream %s: the answer to a %s was withheld: %s", target.name,
                          msg.method if msg is not None else request.method, exc)
                return render.rpc_error(503, msg.id if msg else None, jsonrpc.INTERNAL_ERROR,
                                        "the session could not be bound to its principal (state store "
                                        "unavailable)")
        scope = _Scope(self, request, target, principal, msg, tools_list)
        # A request's whole answer (not only its start) is bounded by the upstream's timeout, as
        # a call's is: an endless or trickled stream must not hold both connections for ever.
        deadline = None if stream else asyncio.get_running_loop().time() + target.timeout - (
            time.perf_counter() - started)
        async with resp:
            ctype = resp.headers.get("Content-Type", "")
            headers = self._downstream_headers(resp)
            out: web.StreamResponse | None = None
            try:
                async with asyncio.timeout_at(deadline):
                    if ctype.startswith("text/event-stream"):
                        out = web.StreamResponse(status=resp.status, headers=headers)
                        await out.prepare(request)
                        parser = SSEParser(settings.max_upstream_event_bytes)
                        async for chunk in resp.chunks():
                            for ev in parser.feed(chunk):
                                await out.write(await scope.event(ev))
                        await out.write_eof()
                        return out
                    data = await resp.read(settings.max_upstream_reply_bytes)
            except TimeoutError:
                why = f"upstream {target.name!r} did not answer within {target.timeout:g}s"
                log.info("relay from %s cut off: %s", target.name, why)
                error = jsonrpc.error_body(msg.id if msg else None, jsonrpc.INTERNAL_ERROR, why)
                if out is not None:
                    await render.end_stream(out, format_event(error))
                    return out
                return web.Response(status=504, body=error, content_type="application/json")
            except ReplyTooLarge as exc:
                log.warning("relay from %s refused: %s", target.name, exc)
                if out is not None:  # the stream ends here; its client may resume or reopen it
                    await render.end_stream(out, None)
                    return out
                return render.rpc_error(502, msg.id if msg else None, jsonrpc.INTERNAL_ERROR,
                                        f"upstream {target.name!r} {exc}")
            except (UpstreamError, ConnectionResetError) as exc:
                log.info("relay from %s ended early: %s", target.name, exc)
                if out is not None:
                    await render.end_stream(out, None)
                    return out
                return web.Response(status=502)
            if ctype.startswith("application/json"):
                data = await scope.json(data)
                headers.popall("Content-Length", None)
            return web.Response(status=resp.status, body=data, headers=headers)


class _Scope:
    """One relayed answer: the run its messages reach, and how each is inspected."""

    def __init__(self, front: McpFront, request: web.Request, target: UpstreamTarget,
                 principal: Principal, msg: Message | None, tools_list: bool):
        self.front = front
        self.request = request
        self.target = target
        self.principal = principal
        self.msg = msg
        self.tools_list = tools_list
        self.route = front._route(request, target)

    def _call(self, method: str) -> ToolCall:
        return calls.read_from(self.request.headers, method, {}, self.route, self.principal)

    async def message(self, message: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """The message as the client may receive it (None: withheld), and whether it changed."""
        front, msg = self.front, self.msg
        answer = "method" not in message and ("result" in message or "error" in message)
        filtered = False
        if answer and msg is not None and message.get("id") == msg.id:
            if self.tools_list and "result" in message:
                # Learned and filtered, then inspected like any list (descriptions are text the
                # model reads), not recorded: a server's self-description.
                message["result"] = front.ctx.filter_tools(message["result"], self.target.name,
                                                           self.principal)
                filtered = True
            elif msg.method == "tasks/list" and "result" in message:
                try:
                    message["result"], filtered = await self._own_tasks(message["result"])
                except StoreError as exc:  # whose the tasks are cannot be read: none is listed
                    log.error("a tasks/list of upstream %s was withheld: %s", self.target.name, exc)
                    return {"jsonrpc": "2.0", "id": message.get("id"), "error": {
                        "code": jsonrpc.INTERNAL_ERROR,
                        "message": "the tasks' owners cannot be read (state store unavailable)"}}, True
            method, record = msg.method or "stream", msg.method in RECORDED
        elif answer and msg is None:
            return await self._resumed(message), True
        else:
            method, record = str(message.get("method") or "stream"), True
        relayed = await front.envelope.relay(self._call(method), message, record=record)
        if relayed.refusal is None:
            return relayed.message, relayed.changed or filtered
        if answer:  # the client still gets an answer to its request: the refusal
            return {"jsonrpc": "2.0", "id": message.get("id"), "error": {
                "code": jsonrpc.INTERNAL_ERROR,
                "message": f"Blocked by policy ({relayed.refusal.code.value}): {relayed.refusal.reason}"}}, True
        return None, True

    async def _own_tasks(self, result: Any) -> tuple[dict[str, Any], bool]:
        """A `tasks/list` result keeping only the tasks this principal's calls created through
        this proxy (the upstream knows one caller, the proxy, and lists every principal's), and
        whether it changed. A result without a list of tasks keeps none; past `LISTED_TASKS`
        entries none is kept (each unknown one costs a store read). Raises StoreError."""
        if not isinstance(result, dict):
            return {"tasks": []}, True
        listed = result.get("tasks")
        if not isinstance(listed, list):
            return {**result, "tasks": []}, True
        if len(listed) > LISTED_TASKS:
            log.warning("tasks/list on upstream %s: %d tasks listed, only the first %d are looked up",
                        self.target.name, len(listed), LISTED_TASKS)
        kept = [task for task in listed[:LISTED_TASKS] if isinstance(task, dict) and await self.front._task_tool(
            self.target, self.principal, task.get("taskId")) is not None]
        return {**result, "tasks": kept}, kept != listed

    async def _resumed(self, message: dict[str, Any]) -> dict[str, Any]:
        """An answer on a GET stream: the result of a call whose client left its stream (2025-11-25
        resumption). Inspected as that call's result (or, unknown here, as untrusted content),
        recorded, and audited as its delivery."""
        front = self.front
        session = self.route.session
        original = front.detached.get((self.target.name, session, self.principal.id,
                                       _id_key(message.get("id"))), pop=True) if session else None
        if original is not None:
            call = dataclasses.replace(original, decision_id=uuid.uuid4().hex, on_result=[],
                                       audit_extra={"result_of": original.decision_id}, in_band=None,
                                       ledger_pending=original.ledger_pending)
        else:
            call = self._call("stream")
            try:
                elsewhere = (await front.detached_elsewhere(self.target.name, session, self.principal.id,
                                                            _id_key(message.get("id"))) if session else None)
            except StoreError as exc:  # whose result this is cannot be read: not delivered
                log.error("a resumed result on upstream %s was withheld: %s", self.target.name, exc)
                return {"jsonrpc": "2.0", "id": message.get("id"), "error": {
                    "code": jsonrpc.INTERNAL_ERROR, "message": "Blocked by policy (store_unavailable): the "
                    "call this result answers cannot be read from the state store"}}
            if elsewhere is not None:  # a call another worker relayed: inspected as its tool's
                tool, decision_id = elsewhere
                call = dataclasses.replace(self._call("tools/call"), tool=tool,
                                           audit_extra={"result_of": decision_id})
        outcome = await front.ctx.executor.deliver(front.envelope.begin_read(call), Reply(message))
        _, body = render.render(outcome, message.get("id"), stateless=False, tool=call.tool)
        return orjson.loads(body)

    async def event(self, ev: SSEEvent) -> bytes:
        """One SSE event as the client may receive it (a bare keep-alive when withheld)."""
        if not ev.data.strip():  # a priming event (an id, empty data), a comment: no text passes
            return format_fields(ev)
        try:
            message = orjson.loads(ev.data)
        except orjson.JSONDecodeError:
            message = None
        if not isinstance(message, dict):
            log.info("dropped an event of %s that is not a JSON-RPC message", self.target.name)
            return KEEP_ALIVE
        as_sent = verbatim(ev) and await jsonrpc.relayable(ev.data, message)
        out, changed = await self.message(message)
        if out is None:
            return KEEP_ALIVE
        if not changed and as_sent:
            return ev.raw
        return format_event(orjson.dumps(out), ev.event, ev.id)

    async def json(self, data: bytes) -> bytes:
        """A JSON answer as the client may receive it (unchanged bytes when nothing changed)."""
        if not data.strip():
            return data  # an HTTP-level answer without a body
        try:
            message = orjson.loads(data)
        except orjson.JSONDecodeError:
            message = None
        if not isinstance(message, dict):
            # Nothing unread passes: a batch array (which some clients read), or JSON another
            # parser reads and orjson does not (NaN, 1e400, a lone surrogate: the MCP SDK reads
            # the first two) would reach the client uninspected (and a tools/list unfiltered).
            log.warning("withheld a JSON answer of %s that is not one JSON object the proxy reads",
                        self.target.name)
            return jsonrpc.error_body(self.msg.id if self.msg else None, jsonrpc.INTERNAL_ERROR,
                                      f"upstream {self.target.name!r} sent a JSON answer the proxy "
                                      "cannot read; it was withheld")
        as_sent = await jsonrpc.relayable(data, message)
        out, changed = await self.message(message)
        if out is None:
            return b""
        return orjson.dumps(out) if changed or not as_sent else data
