"""The aggregated endpoint `/mcp`: several upstreams presented as one MCP server.

Tools are renamed `<upstream>.<tool>`. Unlike `/mcp/<upstream>`, which relays bytes, this front
is an MCP server itself: it answers the client in JSON (`application/json`) and talks to each
upstream as an MCP client through the same forwarder, with one upstream session per client
session and upstream (2025-06-18 / 2025-11-25 clients, `Mcp-Session-Id` of its own), or one
shared upstream session per upstream for stateless 2026-07-28 clients (`server/discover`).

Nothing of the per-upstream route is copied here: `tools/list` results go through
`FrontContext.filter_tools` (learn into the registry, `Chain.visible` per principal), and a
`tools/call` is built by `calls.tool_call_from` (`upstream=<upstream>`, `tool=<original name>`),
decided by `Envelope.begin`, forwarded and ended by the same executor (retries, cancellation
with `notifications/cancelled`, resumption of a stream the upstream closes early) and answered
by `render`, so refusals, audit records and metrics are those of the per-upstream route.

Client sessions are bound to the principal that initialized them (another principal's session
id is answered 404 "Session not found") and bounded per principal (`max_sessions_per_principal`:
past it the principal's own least recently used session is dropped, never another's) and in all
(`max_sessions`: then the biggest holder's least recently used goes); a dropped or deleted
session's upstream sessions are closed (DELETE; for a dropped one in a tracked background task).
On a shared store (not `memory`) which upstream session a client session uses with each upstream
is kept there too, sealed (`SharedUpstreamSessions`): the worker or replica that takes a client
session up uses that upstream session rather than opening its own, so an upstream that keeps
state per session sees one session per client session on any number of workers. Two workers
opening one at once keep the first stored (the other closes its own); an upstream's 404 has the
worker open a new one in its place, unless another worker already did.

Served: `initialize`, `server/discover`, `ping`, `tools/list` (all upstreams merged, no
pagination), `tools/call`, notifications, GET (legacy sessions: the upstreams'
`notifications/tools/list_changed` fanned out, one upstream stream per upstream per client
session, within the streams' budget; a second GET on a session replaces the first) and DELETE. Everything else (resources/*,
prompts/*, completion, logging) is answered with JSON-RPC -32601: those have no unambiguous
merge across servers; use `/mcp/<upstream>` for them. Upstream progress notifications and
server-to-client requests (sampling, elicitation) are not relayed (the client gets JSON only),
so nothing of them reaches the client (a server request is answered upstream with -32601 by the
executor, so the tool does not wait for it); the answer is inspected like on every route.

HTTP upstreams (`openapi:` in the policy, `proxy.upstream.openapi`) are served here too: their
`tools/list` is the spec's operations (`Operation.tool_definition`, filtered per principal like
any list, not learned: the registry has them from the revision), a `tools/call` is the HTTP
request `Spec.request_for` builds from the decided call, sent by the same executor
(`UpstreamRequest.http`); no MCP session is opened with them and no GET stream is followed.
With `single=True` the same server answers `/mcp/<upstream>` for one HTTP upstream (the
per-upstream front hands those routes over): the route's upstream only, tool names unprefixed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from proxy.envelope.pipeline import Pending
from proxy.envelope.types import Principal
from proxy.errors import StoreError, UpstreamError, UpstreamTimeout
from proxy.fronts import calls, jsonrpc, render
from proxy.fronts.calls import STATELESS_REVISION, Route
from proxy.fronts.context import FrontContext
from proxy.fronts.forwarded import Downstream, UpstreamRequest, UpstreamTarget
from proxy.fronts.guard import Guard, read_body
from proxy.fronts.headers import layered
from proxy.fronts.jsonrpc import BadMessage, Message
from proxy.fronts.sessions import OwnedLRU, SharedOwners, SharedUpstreamSessions, StoredSession
from proxy.fronts.sse import SSEParser, format_event
from proxy.fronts.streams import StreamSlot
from proxy.observability import tracing
from proxy.upstream import openapi
from proxy.upstream.stdio import principal_value

log = logging.getLogger("envelope.aggregate")

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
LEGACY_REVISIONS = ("2025-11-25", "2025-06-18")
UPSTREAM_REVISION = "2025-11-25"  # what the aggregate speaks to upstreams (sessions)
SERVER_INFO = {"name": "envelope-proxy-aggregate", "version": "1"}
MAX_PAGES = 50  # tools/list pages fetched per upstream
LISTEN_RETRY = 2.0  # seconds before an upstream GET stream that ended is reopened
_LIST_CHANGED = format_event(orjson.dumps({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}))


@dataclass(slots=True)
class _UpstreamSession:
    """The aggregate's MCP client session with one upstream."""

    session_id: str | None = None
    protocol: str = ""
    ready: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The client's Authorization the session was opened with (only for `forward_authorization`
    # upstreams, which may bind the session to it): what ends it if its client session is pushed
    # out, with no request of that client at hand.
    auth: str | None = None
    # Whose it is (the client session's principal; None: shared by stateless clients).
    principal: str | None = None
    # The client session it serves (None: shared by stateless clients), and what the store
    # held for it when it was taken from there or stored (`SharedUpstreamSessions`).
    client: str | None = None
    stored: bytes | None = None


@dataclass(slots=True)
class _Fanout:
    """A client session's upstream GET streams (one per upstream), and the GET reading them.

    They belong to the session, not to one GET: a second GET on the session takes them over
    (`out` and `request` switch to it; the first GET ends), so a session never holds more than
    one upstream stream per upstream, and its slots of the streams' budget are held once."""

    slot: StreamSlot
    out: asyncio.Queue[bytes | None]
    request: web.Request  # the current GET's (its credentials reach the upstreams on a reopen)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


@dataclass(slots=True)
class _ClientSession:
    """A legacy client's session on `/mcp`: bound to its principal, one upstream session each."""

    id: str
    principal: str
    protocol: str
    upstreams: dict[str, _UpstreamSession] = field(default_factory=dict)
    fanout: _Fanout | None = None

    def end_stream(self) -> None:
        """End the session's GET stream, if one is open (its upstream streams end with it)."""
        if self.fanout is not None:
            _end(self.fanout.out)


class _Reply(Exception):
    """A finished wire reply raised out of request handling."""

    def __init__(self, response: web.Response):
        self.response = response


class AggregateFront:
    """aiohttp handlers for `/mcp`, on the same `FrontContext` as `/mcp/<upstream>`."""

    def __init__(self, context: FrontContext, upstreams: Callable[[], Sequence[str]], max_sessions: int = 1000,
                 max_sessions_per_principal: int = 100, single: bool = False, seal_key: bytes | None = None):
        self.ctx = context
        self.upstreams = upstreams  # the aggregated upstream names, in order (config or policy)
        # `/mcp/<upstream>` of one HTTP upstream: the route names the upstream, tools unprefixed.
        self.single = single
        # Client sessions by id, bound to their principal; a principal past its own bound loses
        # its own least recently used session, never another's (see proxy.fronts.sessions).
        self._sessions: OwnedLRU[str, _ClientSession] = OwnedLRU(max_sessions, max_sessions_per_principal)
        # Who created each session, in the store too, so that another worker or replica (or the
        # process after a restart) serves it (`_client_session`): not a per-process memory store.
        store = context.store
        self._owners = SharedOwners(store) if store is not None and store.kind != "memory" else None
        # Which upstream session each client session uses, for the workers sharing the store;
        # `seal_key` is the workers' shared key (None: not shared, as with a memory store).
        self._upstream_sessions = SharedUpstreamSessions(store, seal_key) \
            if self._owners is not None and store is not None and seal_key is not None and not single else None
        self._route = "aggregate-http" if single else "aggregate"
        self._shared: dict[str, _UpstreamSession] = {}  # stateless clients
        self._ids = 0
        # Request ids minted here; the prefix is this process's, as the workers (and replicas)
        # sharing one upstream session each mint theirs: an upstream answers by id, so two
        # requests in flight with one id in one session would have one of them wait for ever.
        self._id_prefix = f"envelope-agg-{uuid.uuid4().hex[:12]}-"
        self._warned: set[str] = set()

    def routes(self, guard: Guard) -> list[web.RouteDef]:
        """The route, every request through `guard` first."""
        return [web.route("*", "/mcp", guard.wrap(self.handle), expect_handler=guard.expect_handler())]

    async def shutdown(self, app: web.Application | None = None) -> None:
        """End every open GET stream (called before the listener drains)."""
        for sess in self._sessions.values():
            sess.end_stream()

    def sessions_of(self, principal: str) -> int:
        """How many client sessions `principal` holds."""
        return self._sessions.owned(principal)

    # ---- entry -------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        principal = self.ctx.authenticate(request)
        if isinstance(principal, web.Response):
            return principal
        try:
            if request.method == "POST":
                return await self._post(request, principal)
            if request.method == "GET":
                return await self._get(request, principal)
            if request.method == "DELETE":
                return await self._delete(request, principal)
        except _Reply as reply:
            return reply.response
        return web.Response(status=405, headers={"Allow": "GET, POST, DELETE"})

    async def _client_session(self, request: web.Request, principal: Principal, id: Any = None) -> _ClientSession:
        """The legacy client's session; 400 without the header, 404 unknown (re-initialize) or
        another principal's. A session this process does not know but the store says is the
        principal's (created through another worker or replica, or before a restart) is taken
        up here: its upstream sessions are opened on first use, as after an upstream's 404."""
        sid = request.headers.get("Mcp-Session-Id")
        if not sid:
            raise _Reply(_error(400, id, jsonrpc.INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required"))
        found = self._sessions.get(sid, touch=False)
        if found is None and self._owners is not None:
            try:
                owner = await self._owners.owner(self._route, sid)
            except StoreError as exc:
                log.error("aggregate: the owner of a session cannot be read: %s", exc)
                raise _Reply(_error(503, id, jsonrpc.INTERNAL_ERROR,
                                    "the session's owner cannot be read (state store unavailable)")) from exc
            if owner is not None:
                found = (owner, self._adopt(sid, owner, request))
        if found is None or found[0] != principal.id:  # a session id is never identity
            if found is not None:
                self.ctx.metrics.rejected("foreign_session")
            raise _Reply(_error(404, id, jsonrpc.INVALID_REQUEST, "Session not found"))
        self._sessions.get(sid)  # its owner's most recently used
        return found[1]

    def _adopt(self, sid: str, owner: str, request: web.Request) -> _ClientSession:
        """A session created elsewhere, known here from now on (its revision: the one the client
        says it speaks, which it sends on every request after `initialize`)."""
        version = request.headers.get("MCP-Protocol-Version", "")
        sess = _ClientSession(id=sid, principal=owner,
                              protocol=version if version in LEGACY_REVISIONS else LEGACY_REVISIONS[0])
        self._keep(sess)
        return sess

    def _keep(self, sess: _ClientSession) -> None:
        for _, _, old in self._sessions.put(sess.id, sess.principal, sess):
            # Pushed out (its client gets 404 and initializes again): its streams end and its
            # upstream sessions are closed, in the background (tracked for shutdown).
            log.info("aggregate: session of %s dropped (least recently used)", old.principal)
            old.end_stream()
            self.ctx.spawn(self._drop(old))

    async def _drop(self, sess: _ClientSession) -> None:
        """A session pushed out: its upstream sessions closed, its binding in the store gone (so
        that no worker takes it up again: its client gets 404 and initializes again). Never
        raises."""
        await self._close_upstreams(sess, None)
        if self._owners is not None:
            try:
                await self._owners.release(self._route, sess.id, sess.principal)
            except StoreError as exc:
                log.warning("aggregate: a dropped session's binding stays in the store: %s", exc)

    async def _post(self, request: web.Request, principal: Principal) -> web.StreamResponse:
        ctx = self.ctx
        try:
            body = await read_body(request, ctx.settings.max_body_bytes, ctx.settings.body_timeout)
            msg = await jsonrpc.parse_post(body, ctx.settings.max_json_depth, request.headers.get("Mcp-Method"))
        except BadMessage as exc:
            ctx.metrics.rejected(exc.reason)
            refused = _error(exc.status, exc.id, exc.code, exc.message)
            if exc.close:
                refused.force_close()
            return refused
        if not msg.is_request:
            return web.Response(status=202)  # notifications and responses: nothing to do
        if tracing.TRACER is not None:
            tracing.request(msg.method, msg.id, msg.params, request.headers)
        stateless = calls.is_stateless(request.headers, msg)
        if msg.method == "initialize":
            return await self._initialize(msg, principal, request)
        if msg.method == "server/discover":
            return _result(msg.id, {
                "supportedVersions": [STATELESS_REVISION],
                "capabilities": {"tools": {"listChanged": False}},
                "instructions": self._instructions(request),
                "resultType": "complete", "ttlMs": 0, "cacheScope": "private",
                "_meta": {"io.modelcontextprotocol/serverInfo": SERVER_INFO},
            })
        sess = None if stateless else await self._client_session(request, principal, msg.id)
        if msg.method == "ping":
            return _result(msg.id, {"resultType": "complete"} if stateless else {})
        if msg.method == "tools/list":
            return await self._tools_list(request, sess, principal, msg, stateless)
        if msg.method == "tools/call":
            return await self._tools_call(request, sess, principal, msg, stateless)
        if self.single:
            return _error(404 if stateless else 200, msg.id, jsonrpc.METHOD_NOT_FOUND,
                          f"Method not found: {msg.method} (an HTTP upstream serves tools only)")
        return _error(404 if stateless else 200, msg.id, jsonrpc.METHOD_NOT_FOUND,
                      f"Method not found: {msg.method} is not served by the aggregated endpoint /mcp "
                      "(it serves tools only; use /mcp/<upstream> for resources and prompts)")

    def _instructions(self, request: web.Request) -> str:
        if self.single:
            return (f"Operations of the HTTP API {request.match_info['upstream']!r} behind "
                    "envelope-proxy, one tool each.")
        return "Tools of several MCP servers behind envelope-proxy, named <upstream>.<tool>."

    async def _initialize(self, msg: Message, principal: Principal, request: web.Request) -> web.Response:
        requested = msg.params.get("protocolVersion")
        version = requested if requested in LEGACY_REVISIONS else LEGACY_REVISIONS[0]
        sess = _ClientSession(id=uuid.uuid4().hex, principal=principal.id, protocol=version)
        if self._owners is not None:  # bound in the store before the client learns the id
            try:
                await self._owners.claim(self._route, sess.id, principal.id)
            except StoreError as exc:
                log.error("aggregate: a session could not be bound to its principal: %s", exc)
                return _error(503, msg.id, jsonrpc.INTERNAL_ERROR,
                              "the session could not be bound to its principal (state store unavailable)")
        self._keep(sess)
        result = {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": SERVER_INFO,
            "instructions": self._instructions(request),
        }
        return _result(msg.id, result, {"Mcp-Session-Id": sess.id})

    async def _delete(self, request: web.Request, principal: Principal) -> web.Response:
        sess = await self._client_session(request, principal)
        self._sessions.pop(sess.id)
        if self._owners is not None:
            try:
                await self._owners.release(self._route, sess.id, principal.id)
            except StoreError as exc:  # the binding stays until it expires: it refuses others only
                log.warning("aggregate: an ended session's binding stays in the store: %s", exc)
        sess.end_stream()
        await self._close_upstreams(sess, request.headers.get("Authorization"))
        return web.Response(status=200)

    async def _close_upstreams(self, sess: _ClientSession, auth: str | None) -> None:
        """End `sess`'s upstream sessions (DELETE), with the client's `auth` when there is a
        request of it, else the one each was opened with; those another worker opened for it
        too (from the store), whose entries go. Never raises."""
        ending = list(sess.upstreams.items())
        shared = self._upstream_sessions
        if shared is not None:
            names = list(self.upstreams())
            try:
                for name in names:
                    found = await shared.get(self._route, sess.id, name)
                    known = sess.upstreams.get(name)
                    if found is not None and found.session_id is not None and (
                            known is None or known.session_id != found.session_id):
                        ending.append((name, _UpstreamSession(found.session_id, found.protocol,
                                                              principal=sess.principal)))
                await shared.forget(self._route, sess.id, names)
            except StoreError as exc:  # they expire with the binding
                log.warning("aggregate: an ended session's upstream sessions stay in the store: %s", exc)
        for name, us in ending:
            await self._close_upstream(name, us, auth)

    async def _close_upstream(self, name: str, us: _UpstreamSession, auth: str | None) -> None:
        """DELETE one upstream session. Never raises."""
        target = self.ctx.targets(name)
        if target is not None and us.session_id:
            try:
                async with asyncio.timeout(target.connect_timeout):
                    resp = await self.ctx.forwarder.open(
                        "DELETE", target.url, self._headers(target, us, auth or us.auth), None,
                        connect_timeout=target.connect_timeout, read_timeout=target.connect_timeout)
                resp.close()
            except (UpstreamError, TimeoutError):
                pass  # the upstream expires it on its own

    # ---- talking to upstreams ------------------------------------------------------------

    def _targets(self, request: web.Request) -> list[UpstreamTarget]:
        if self.single:
            target = self.ctx.targets(request.match_info["upstream"])
            return [target] if target is not None else []
        out = []
        for name in self.upstreams():
            target = self.ctx.targets(name)
            if target is None:
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("aggregate: upstream %r is not in the policy; skipped", name)
                continue
            out.append(target)
        return out

    def _split(self, name: str, request: web.Request) -> tuple[UpstreamTarget, str] | None:
        """`<upstream>.<tool>` -> (target, tool); the longest matching upstream name wins.
        (Single-upstream mode: the route's upstream and `name` as it is.)"""
        if self.single:
            targets = self._targets(request)
            return (targets[0], name) if targets else None
        best: UpstreamTarget | None = None
        for target in self._targets(request):
            if name.startswith(target.name + ".") and len(name) > len(target.name) + 1:
                if best is None or len(target.name) > len(best.name):
                    best = target
        return None if best is None else (best, name[len(best.name) + 1:])

    def _headers(self, target: UpstreamTarget, us: _UpstreamSession, request: web.Request | str | None,
                 accept: str = "application/json, text/event-stream") -> dict[str, str]:
        """What an upstream request in `us` carries; `request` is the client's request (or its
        Authorization value), passed upstream only for `forward_authorization` upstreams."""
        headers = {"Accept": accept, "Content-Type": "application/json"}
        if us.session_id:
            headers["Mcp-Session-Id"] = us.session_id
        if us.protocol:
            headers["MCP-Protocol-Version"] = us.protocol
        # Not `isinstance(request, web.Request)`: the fast listener's hot route passes a LeanRequest.
        auth = request if request is None or isinstance(request, str) else request.headers.get("Authorization")
        if auth and target.forward_authorization:
            headers["Authorization"] = auth
        if target.principal_header is not None and us.principal is not None:
            headers[target.principal_header] = principal_value(us.principal)
        return layered(headers, target.headers)

    def _next_id(self) -> str:
        self._ids += 1
        return f"{self._id_prefix}{self._ids}"  # never collides with a client's id: we mint them all

    async def _exchange(self, target: UpstreamTarget, us: _UpstreamSession, request: web.Request,
                        payload: dict[str, Any]) -> tuple[int, str | None, dict[str, Any] | None]:
        """POST one message; (status, session id header, the JSON-RPC reply to it or None)."""
        rid = payload.get("id")
        resp = await self.ctx.forwarder.open(
            "POST", target.url, self._headers(target, us, request), orjson.dumps(payload),
            connect_timeout=target.connect_timeout, read_timeout=target.timeout)
        async with resp:
            sid = resp.headers.get("Mcp-Session-Id")
            ctype = resp.headers.get("Content-Type", "")
            if rid is not None and resp.status == 200 and ctype.startswith("text/event-stream"):
                parser = SSEParser(self.ctx.settings.max_upstream_event_bytes)
                async for chunk in resp.chunks():
                    for ev in parser.feed(chunk):
                        reply = _reply_to(ev.data if ev.has_data else "", rid)
                        if reply is not None:
                            return resp.status, sid, reply
                raise UpstreamError("closed the stream without a reply")
            data = await resp.read(self.ctx.settings.max_upstream_reply_bytes)
            if rid is not None and ctype.startswith("application/json"):
                return resp.status, sid, _reply_to(data, rid)
            return resp.status, sid, None

    async def _ensure(self, us: _UpstreamSession, target: UpstreamTarget, request: web.Request) -> None:
        """`us` ready for requests: the upstream session its client session uses (from the store,
        when another worker opened it), else a new one (initialized here, then stored)."""
        async with us.lock:
            if us.ready:
                return
            us.session_id, us.protocol = None, ""
            us.auth = request.headers.get("Authorization") if target.forward_authorization else None
            found = await self._stored(us, target.name)
            if found is not None and found.session_id is not None and found.raw != us.stored:
                # Opened by another worker (or opened again after the upstream forgot the one
                # this worker used: then `stored` is that one's).
                us.session_id, us.protocol, us.stored, us.ready = found.session_id, found.protocol, found.raw, True
                return
            await self._initialize_upstream(us, target, request)
            if found is None or found.session_id is not None:
                await self._store(us, target, found)
            us.ready = True

    async def _stored(self, us: _UpstreamSession, name: str) -> StoredSession | None:
        """What the store holds for `us`'s client session and upstream (None also when nothing
        is shared: stateless clients, a memory store). A store that cannot answer refuses the
        request (UpstreamError), as a worker cannot know which session the client's is."""
        shared = self._upstream_sessions
        if shared is None or us.client is None:
            return None
        try:
            return await shared.get(self._route, us.client, name)
        except StoreError as exc:
            log.error("aggregate: the upstream session of a client session cannot be read: %s", exc)
            raise UpstreamError("the state store cannot say which upstream session the client "
                                f"session uses ({exc})") from exc

    async def _store(self, us: _UpstreamSession, target: UpstreamTarget, found: StoredSession | None) -> None:
        """Store `us`'s new upstream session for its client session, in place of `found` (what
        the store held before it was opened). When another worker stored one meanwhile, that one
        is used and this one closed (in the background); a store that cannot answer refuses the
        request (UpstreamError) and closes this one, which no other worker would know."""
        shared = self._upstream_sessions
        if shared is None or us.client is None or us.session_id is None:
            return
        sealed = shared.seal(self._route, us.client, target.name, us.session_id, us.protocol)
        ours = _UpstreamSession(us.session_id, us.protocol, auth=us.auth, principal=us.principal)
        try:
            if await shared.claim(self._route, us.client, target.name, sealed,
                                  None if found is None else found.raw):
                us.stored = sealed
                return
            other = await shared.get(self._route, us.client, target.name)
        except StoreError as exc:
            log.error("aggregate: the upstream session of a client session cannot be stored: %s", exc)
            self.ctx.spawn(self._close_upstream(target.name, ours, None))
            raise UpstreamError(f"the state store cannot keep the client session's upstream session ({exc})") from exc
        if other is None or other.session_id is None or other.session_id == us.session_id:
            return  # the client session ended meanwhile, or another key's: this one serves here
        self.ctx.spawn(self._close_upstream(target.name, ours, None))
        us.session_id, us.protocol, us.stored = other.session_id, other.protocol, other.raw

    async def _initialize_upstream(self, us: _UpstreamSession, target: UpstreamTarget, request: web.Request) -> None:
        init = {"jsonrpc": "2.0", "id": self._next_id(), "method": "initialize",
                "params": {"protocolVersion": UPSTREAM_REVISION, "capabilities": {},
                           "clientInfo": SERVER_INFO}}
        status, sid, reply = await self._exchange(target, us, request, init)
        result = reply.get("result") if reply else None
        if not isinstance(result, dict):
            raise UpstreamError(f"initialize answered HTTP {status}" + (
                f": {reply['error'].get('message')}" if reply and isinstance(reply.get("error"), dict) else ""))
        us.session_id = sid
        version = result.get("protocolVersion")
        us.protocol = version if isinstance(version, str) else UPSTREAM_REVISION
        await self._exchange(target, us, request, {"jsonrpc": "2.0", "method": "notifications/initialized"})

    def _upstream_session(self, sess: _ClientSession | None, name: str) -> _UpstreamSession:
        table = self._shared if sess is None else sess.upstreams
        us = table.get(name)
        if us is None:
            us = table[name] = _UpstreamSession(principal=None if sess is None else sess.principal,
                                                client=None if sess is None else sess.id)
        return us

    async def _request(self, sess: _ClientSession | None, target: UpstreamTarget, request: web.Request,
                       method: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One request to an upstream in its session (initialized on first use, again after 404)."""
        us = self._upstream_session(sess, target.name)
        for attempt in range(2):
            await self._ensure(us, target, request)
            payload = {"jsonrpc": "2.0", "id": self._next_id(), "method": method, "params": params}
            status, _, reply = await self._exchange(target, us, request, payload)
            if status == 404 and attempt == 0:
                us.ready = False  # the upstream forgot the session (restart, expiry): start over
                continue
            if reply is None:
                raise UpstreamError(f"answered HTTP {status} without a JSON-RPC reply")
            return status, reply
        raise UpstreamError("answered 404 to a fresh session")

    async def _forward(self, sess: _ClientSession | None, target: UpstreamTarget, request: web.Request,
                       method: str, params: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
        """`_request` within the upstream's timeout, counted and reported to health like any relay."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(target.timeout):
                status, reply = await self._request(sess, target, request, method, params)
        except (TimeoutError, UpstreamTimeout) as exc:
            reason = f"did not answer within {target.timeout:g}s"
            self.ctx.observe(target.name, time.perf_counter() - started, "timeout", reason)
            raise UpstreamTimeout(reason) from exc
        except UpstreamError as exc:
            self.ctx.observe(target.name, time.perf_counter() - started, "error", str(exc))
            raise
        seconds = time.perf_counter() - started
        ok = status < 500
        self.ctx.observe(target.name, seconds, "ok" if ok else "error",
                                     None if ok else f"answered HTTP {status}")
        return status, reply, seconds

    # ---- tools/list --------------------------------------------------------------------

    async def _list_one(self, sess: _ClientSession | None, target: UpstreamTarget, request: web.Request,
                        principal: Principal) -> list[dict[str, Any]]:
        spec = self.ctx.spec(target.name)
        if spec is not None:
            listed = {"tools": [op.tool_definition() for op in spec.operations.values()]}
            return self._named(target, self.ctx.filter_tools(listed, target.name, principal, learn=False)["tools"])
        tools: list[dict[str, Any]] = []
        cursor: Any = None
        for _ in range(MAX_PAGES):
            _, reply, _ = await self._forward(sess, target, request, "tools/list",
                                              {"cursor": cursor} if cursor else {})
            result = reply.get("result")
            if not isinstance(result, dict):
                err = reply.get("error")
                raise UpstreamError(f"tools/list failed: {err.get('message') if isinstance(err, dict) else reply}")
            # The per-upstream route's own path: learn into the registry, filter per principal,
            # then the output guardrails (descriptions are text the model reads; not recorded).
            visible = self.ctx.filter_tools(result, target.name, principal).get("tools", [])
            route = Route(target.name, sess.id if sess is not None else None,
                          request.headers.get("MCP-Protocol-Version", ""))
            relayed = await self.ctx.envelope.relay(
                calls.read_from(request.headers, "tools/list", {}, route, principal),
                {"jsonrpc": "2.0", "result": {"tools": visible}}, record=False)
            if relayed.refusal is not None:
                raise UpstreamError(f"tools/list withheld: {relayed.refusal.reason}")
            tools.extend(self._named(target, relayed.message["result"]["tools"]))
            cursor = result.get("nextCursor")
            if not cursor:
                break
        return tools

    def _named(self, target: UpstreamTarget, visible: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tools as this endpoint names them (`<upstream>.<tool>`; unprefixed when single)."""
        if self.single:
            return visible
        tools = []
        for tool in visible:
            name = f"{target.name}.{tool['name']}"
            if not TOOL_NAME.fullmatch(name):
                if name not in self._warned:
                    self._warned.add(name)
                    log.warning("aggregate: tool %r is not a valid MCP tool name (1-128 of "
                                "[A-Za-z0-9_.-]); not listed", name[:200])
                continue
            tools.append({**tool, "name": name})
        return tools

    async def _tools_list(self, request: web.Request, sess: _ClientSession | None, principal: Principal,
                          msg: Message, stateless: bool) -> web.Response:
        targets = self._targets(request)
        lists = await asyncio.gather(*(self._list_one(sess, t, request, principal) for t in targets),
                                     return_exceptions=True)
        merged: list[dict[str, Any]] = []
        for target, tools in zip(targets, lists, strict=True):
            if isinstance(tools, BaseException):
                if isinstance(tools, asyncio.CancelledError):
                    raise tools
                # A down upstream's tools are missing; the others are still listed.
                log.info("aggregate: tools/list of %s failed: %s", target.name, tools)
                continue
            merged.extend(tools)
        result: dict[str, Any] = {"tools": merged}
        if stateless:
            result.update(resultType="complete", ttlMs=0, cacheScope="private")
        return _result(msg.id, result)

    # ---- tools/call --------------------------------------------------------------------

    async def _tools_call(self, request: web.Request, sess: _ClientSession | None, principal: Principal,
                          msg: Message, stateless: bool) -> web.StreamResponse:
        ctx = self.ctx
        try:
            name, arguments = calls.tool_request(msg, request.headers)
        except BadMessage as exc:
            ctx.metrics.rejected(exc.reason)
            return _error(400, exc.id, exc.code, exc.message)
        split = self._split(name, request)
        if split is None:
            return _error(400 if stateless else 200, msg.id, jsonrpc.INVALID_PARAMS, f"Unknown tool: {name}")
        target, tool = split
        route = Route(target.name, sess.id if sess is not None else None,
                      request.headers.get("MCP-Protocol-Version", "") or (sess.protocol if sess else ""))
        call = calls.tool_call_from(request.headers, msg, route, tool, arguments, principal,
                                    ctx.settings.request_headers())
        pending = await ctx.envelope.begin(call)
        reply_id = self._next_id()
        specs = pending.chain.revision.specs if pending.chain is not None else {}
        if target.name in specs:
            outcome = await ctx.executor.run(
                pending, self._http_request(pending, specs[target.name], target, request, reply_id),
                Downstream())
            if outcome.kind == "deliver":  # the HTTP status is the record's, not the MCP answer's
                outcome = dataclasses.replace(outcome, status=200)
            return await render.respond(outcome, msg.id, stateless=stateless, tool=name, same_id=False,
                                    plain=render.writes_plain(request))
        params: dict[str, Any] = {"name": tool, "arguments": arguments}
        us = self._upstream_session(sess, target.name)

        async def setup(fresh: bool) -> dict[str, str]:
            if fresh:
                us.ready = False
            await self._ensure(us, target, request)
            return self._headers(target, us, request)

        def body(meta: Mapping[str, str] | None = None) -> bytes:
            return orjson.dumps({"jsonrpc": "2.0", "id": reply_id, "method": "tools/call",
                                 "params": params if not meta else {**params, "_meta": meta}})

        upstream = UpstreamRequest(target, body(), {}, reply_id, resume=True, setup=setup,
                                   with_meta=body)
        outcome = await ctx.executor.run(pending, upstream, Downstream())
        return await render.respond(outcome, msg.id, stateless=stateless, tool=name, same_id=False,
                                    plain=render.writes_plain(request))

    @staticmethod
    def _http_request(pending: Pending, spec: openapi.Spec, target: UpstreamTarget, request: web.Request,
                      reply_id: str) -> UpstreamRequest | None:
        """The HTTP request of a decided call to an HTTP upstream; None when there is nothing to
        send (refused: the catalogue refuses a tool the spec lacks; or arguments the request
        cannot be built from, which the executor then ends as not forwarded)."""
        call = pending.call
        op = spec.operations.get(call.tool)
        if op is None or not pending.forwardable:
            return None
        try:
            http = spec.request_for(op, call.arguments)
        except ValueError as exc:
            log.warning("decision %s: cannot build the HTTP request of %s: %s",
                        call.decision_id, call.qualified_name, exc)
            return None
        auth = request.headers.get("Authorization")
        headers = {"Authorization": auth} if auth and target.forward_authorization else {}
        return UpstreamRequest(target, b"", headers, reply_id, http=http)

    # ---- GET: list_changed fan-out ----------------------------------------------------

    async def _get(self, request: web.Request, principal: Principal) -> web.StreamResponse:
        """The session's GET stream: one upstream stream per upstream per client session, each
        holding a slot of the streams' budget (503 past it). A second GET on the session
        replaces the first rather than being refused (409): a client whose connection died
        unnoticed (a NAT or a load balancer dropped it) reconnects at once, and nothing more is
        held either way; only the session's own principal can reach it."""
        if calls.is_stateless(request.headers, None):
            return web.Response(status=405, headers={"Allow": "POST"})
        if self.single:  # an HTTP upstream sends nothing of its own accord
            return web.Response(status=405, headers={"Allow": "POST, DELETE"})
        sess = await self._client_session(request, principal)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=64)
        fanout = sess.fanout
        if fanout is None:
            # HTTP upstreams have no stream to follow (nor an MCP session to open).
            targets = [t for t in self._targets(request) if self.ctx.spec(t.name) is None]
            slot = self.ctx.take_streams(principal, [t.name for t in targets])
            if isinstance(slot, web.Response):
                return slot
            fanout = sess.fanout = _Fanout(slot, queue, request)
            fanout.tasks = [asyncio.create_task(self._listen(sess, t, fanout), name=f"aggregate-listen-{t.name}")
                            for t in targets]
        else:
            _end(fanout.out)  # the earlier GET ends; its upstream streams carry on for this one
            fanout.out, fanout.request = queue, request
        out = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await out.prepare(request)
            while True:
                item = await queue.get()
                if item is None:
                    break
                await out.write(item)
            await out.write_eof()
        except ConnectionResetError:
            pass
        finally:
            if fanout.out is queue:  # not taken over: the upstream streams end with this GET
                if sess.fanout is fanout:
                    sess.fanout = None
                for task in fanout.tasks:
                    task.cancel()
                try:
                    await asyncio.gather(*fanout.tasks, return_exceptions=True)
                finally:
                    fanout.slot.release()  # once their upstream connections are closed
        return out

    async def _listen(self, sess: _ClientSession, target: UpstreamTarget, fanout: _Fanout) -> None:
        """Follow one upstream's GET stream; pass its `tools/list_changed` on, reopen when it ends."""
        us = self._upstream_session(sess, target.name)
        max_event = self.ctx.settings.max_upstream_event_bytes
        while True:
            try:
                async with asyncio.timeout(target.timeout):
                    await self._ensure(us, target, fanout.request)
                    resp = await self.ctx.forwarder.open(
                        "GET", target.url,
                        self._headers(target, us, fanout.request, accept="text/event-stream"), None,
                        connect_timeout=target.connect_timeout, read_timeout=None, long_lived=True)
                async with resp:
                    if resp.status == 404:
                        us.ready = False
                    elif resp.status == 409:
                        pass  # an earlier stream of this session is still closing upstream: again
                    elif resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                        return  # the upstream offers no stream (405): nothing to follow
                    else:
                        parser = SSEParser(max_event)
                        async for chunk in resp.chunks():
                            for ev in parser.feed(chunk):
                                queue = fanout.out
                                if ev.has_data and "tools/list_changed" in ev.data and not queue.full():
                                    note = _json_or_none(ev.data)
                                    if isinstance(note, dict) and note.get("method") == "notifications/tools/list_changed":
                                        queue.put_nowait(_LIST_CHANGED)
            except (UpstreamError, TimeoutError) as exc:
                log.debug("aggregate: GET stream of %s: %s", target.name, exc)
            await asyncio.sleep(LISTEN_RETRY)


def _end(queue: asyncio.Queue[bytes | None]) -> None:
    """Tell the GET reading `queue` to end (dropping its oldest pending event when full)."""
    while True:
        try:
            queue.put_nowait(None)
            return
        except asyncio.QueueFull:
            queue.get_nowait()


def _json_or_none(data: str | bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _reply_to(data: str | bytes, rid: Any) -> dict[str, Any] | None:
    if not data:
        return None
    reply = _json_or_none(data)
    if isinstance(reply, dict) and reply.get("id") == rid and ("result" in reply or "error" in reply):
        return reply
    return None


def _result(id: Any, result: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=200, body=jsonrpc.result_body(id, result), content_type="application/json",
                        headers=headers)


def _error(status: int, id: Any, code: int, message: str, data: Any = None) -> web.Response:
    return web.Response(status=status, body=jsonrpc.error_body(id, code, message, data),
                        content_type="application/json")
