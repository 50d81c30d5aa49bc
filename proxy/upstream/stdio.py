"""Stdio upstreams: MCP servers the proxy launches as child processes (`command:`).

Each command upstream is made reachable exactly like an HTTP one: `StdioUpstreams` serves an
internal Streamable HTTP endpoint on loopback (`http://127.0.0.1:<port>/<upstream>`, guarded by
a random per-process secret header that only the proxy's own targets carry), and the
upstream's `UpstreamTarget.url` points at it. The per-upstream route, the aggregate, the
executor, the envelope and audit therefore stay untouched: a stdio upstream is one more URL.

Behind the endpoint, newline-delimited JSON-RPC on the child's stdin/stdout, one message a line:

- Session clients (2025-06-18 / 2025-11-25, `initialize` without `Mcp-Session-Id`) each get a
  child of their own: a stdio server is one MCP session. Children come from a bounded pool
  (`max_processes` per upstream, of which one principal holds at most its share,
  `max_processes_per_principal`: one client cannot take every slot from the others); past
  either bound `initialize` gets HTTP 503 with a JSON-RPC error at once (a clear answer, never a
  hang). A child no request touched for `idle_timeout` is stopped and its session forgotten
  (the client then gets 404 and initializes again). A session child that fails at start-up
  (cannot be started, or exits before it answers `initialize`) starts a backoff: until it
  passes, `initialize` is refused 503 saying why, so a crash-looping server is not started
  again for every retry.
- Stateless clients (2026-07-28, no session id) share one child the proxy started and
  prepared: a server that answers `server/discover` gets their requests as they are; one that
  speaks only the handshake revisions is initialised by the proxy (2025-11-25), which then
  answers `server/discover` for it, adds `resultType` (and list results' `ttlMs: 0`,
  `cacheScope: private`) to its results and answers its server
  requests itself (`ping`) or refuses them (a stateless caller cannot be asked mid-call). Their
  JSON-RPC ids and progress tokens are remapped to string ids with a proxy prefix, so replies,
  progress and server requests reach the right caller and never collide. Closing the caller's
  stream sends `notifications/cancelled` to the child.
- A request is answered as an SSE stream: the child's server requests (sampling, elicitation,
  roots) and notifications (progress, logging) go to the stream of the call that caused them,
  then the reply ends it. Events carry no ids: a stream that ends without its reply is a failed
  call (`upstream_error`), never one the client could resume.
- A child that exits, or writes a line past `max_line_bytes` or one that is not JSON (then it is
  killed: it is broken), fails the calls in flight on it (their streams end without a reply, so
  the executor refuses them as `upstream_error` and audits them), reports the upstream down,
  and is restarted with backoff; a session child is restarted with the session's own
  `initialize` replayed, so the session goes on. Its stderr goes to the proxy log line by line,
  tagged with the upstream name, each line capped.
- Shutdown (`close`): stdin closed, a grace to exit, then SIGTERM, then SIGKILL, to the
  child's whole process group (`npx` and friends start grandchildren).

- With several workers (`workers: N`), each worker has its endpoint, children and pool; a
  session's child lives in the worker that started it. A request of a session another worker
  holds (its id, `<port>.<random>.<tag>`, names that worker's endpoint port and is tagged with
  a MAC under the secret the workers share: `Siblings`) is handed to that worker's endpoint
  and its answer streamed back (`_forward`); the fronts of the worker that took it already did
  the envelope's work. Only the siblings' ports, which the supervisor holds, are ever sent to.

One child process (start, line reader, stderr, stop) is `proxy/upstream/child.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import math
import re
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

import orjson
from aiohttp import web

from proxy.errors import UpstreamBusy, UpstreamError
from proxy.policy.model import Upstream
from proxy.upstream.child import Child, ChildGone, StdioSpec, Waiter, child_env, key_of, log_due
from proxy.upstream.forwarder import Forwarder

__all__ = ["PRINCIPAL_HEADER", "SECRET_HEADER", "Siblings", "StdioSpec", "StdioUpstreams", "child_env",
           "command_upstream", "principal_value"]

log = logging.getLogger("envelope.stdio")

SECRET_HEADER = "X-Envelope-Stdio-Secret"
# The caller's principal (percent-encoded), set by the proxy's fronts on requests to the
# endpoint: a session counts against its principal's share of the processes. A client's own is
# never forwarded (the fronts strip `X-Envelope-*` fields they set).
PRINCIPAL_HEADER = "X-Envelope-Stdio-Principal"
# Ids the proxy mints towards a shared child (and back towards a stateless caller): strings with
# this prefix, so they never collide with a caller's numbers or strings.
ID_PREFIX = "envelope-stdio-"
# What a request handed to the worker holding its session carries on, and what of its answer.
_FORWARDED_HEADERS = frozenset({SECRET_HEADER.lower(), PRINCIPAL_HEADER.lower(), "mcp-session-id",
                                "mcp-protocol-version", "content-type", "accept", "last-event-id",
                                "traceparent", "tracestate"})
_ANSWER_HEADERS = frozenset({"content-type", "cache-control", "mcp-session-id"})
# Seconds to connect to another worker's endpoint (loopback: anything longer is a worker gone).
_SIBLING_CONNECT = 2.0
# After a crash: 0.25 s, 0.5 s, ... at most 30 s before the next start.
BACKOFF_FIRST = 0.25
BACKOFF_MAX = 30.0
# A session child that crashes this often in a row without answering is given up: its session
# ends (404) instead of restarting forever.
MAX_SESSION_RESTARTS = 5

# The shared child: probed with `server/discover` at the modern revision; a server that does
# not answer it is initialised by the proxy at the newest handshake revision instead.
MODERN_VERSION = "2026-07-28"
HANDSHAKE_VERSION = "2025-11-25"
PROXY_INFO = {"name": "envelope-proxy", "version": "1"}
HANDSHAKE_SECONDS = 30.0
PROBE_SECONDS = 10.0

HealthSink = Callable[[str, bool, str | None], None]


def command_upstream(command: Sequence[str], env: Mapping[str, str] | None = None,
                     cwd: str | None = None) -> Upstream:
    """A policy `Upstream` that launches `command` (what `envelope-proxy stdio -- cmd` serves)."""
    return Upstream(command=list(command), env=dict(env or {}), cwd=cwd)


@dataclass(eq=False, slots=True)
class Session:
    """A session client's own child and what replays its handshake after a restart."""

    id: str
    spec: StdioSpec
    principal: str = ""
    child: Child | None = None
    initialize: dict[str, Any] | None = None
    initialized: dict[str, Any] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    last_used: float = field(default_factory=time.monotonic)
    restarts: int = 0
    closed: bool = False
    # The session's GET streams: each holds what it has not written yet, bounded like a call's.
    listeners: list[Waiter] = field(default_factory=list)


@dataclass(slots=True)
class Failing:
    """An upstream whose session children fail at start-up: no new one before `until`."""

    count: int = 0
    until: float = 0.0
    last: str = ""


@dataclass(eq=False, slots=True)
class Shared:
    """The child stateless callers of one upstream share, and its id maps."""

    spec: StdioSpec
    child: Child | None = None
    starting: asyncio.Task[Child] | None = None
    failures: int = 0
    next_start: float = 0.0
    last_used: float = field(default_factory=time.monotonic)
    # Server requests relayed to callers: proxy id -> the child's own id.
    server_requests: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, Waiter] = field(default_factory=dict)
    # The child's initialize result when it speaks only the handshake revisions (the proxy
    # initialised it and speaks 2026-07-28 for it); None for a modern server.
    handshake: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Siblings:
    """What the stdio endpoints of the workers of one serve share: a secret, and every worker's
    endpoint port. The supervisor binds each endpoint's socket (`sock`: this worker's) and keeps
    it open while the serve runs, so no other process can take a port a session id names."""

    secret: str
    sock: socket.socket
    ports: frozenset[int]


class StdioUpstreams:
    """Every command upstream of the process, served on one internal loopback endpoint.

    Built before the policy is installed (its URL is known at once: the socket is bound here),
    `configure(specs)` after each policy load, `await start()` with the other listeners,
    `await close()` at shutdown (every child stopped)."""

    def __init__(self, max_line_bytes: int = 32 * 2**20, on_health: HealthSink | None = None,
                 on_processes: Callable[[str, int], None] | None = None,
                 siblings: Siblings | None = None, forwarder: Forwarder | None = None):
        """`siblings`: with several workers, what their endpoints share (each then hands the
        others the requests of sessions they hold, `_peer`, through `forwarder`, the process's
        upstream client); None: one process, a random secret and a port of its own."""
        self.max_line_bytes = max_line_bytes
        self.on_health = on_health
        self.on_processes = on_processes  # (upstream, children now): the pool gauge
        self.secret = siblings.secret if siblings is not None else secrets.token_urlsafe(32)
        self._forwarder = forwarder
        if siblings is not None:
            self._sock = siblings.sock
        else:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self._siblings = (frozenset(siblings.ports) - {self.port}
                          if siblings is not None and forwarder is not None else frozenset())
        self._specs: dict[str, StdioSpec] = {}
        self._sessions: dict[str, Session] = {}
        self._shared: dict[str, Shared] = {}
        self._slots: dict[str, int] = {}
        self._held: dict[tuple[str, str], int] = {}  # (upstream, principal) -> its sessions
        self._failing: dict[str, Failing] = {}
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._closing = False

    # ---- wiring -------------------------------------------------------------------------

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    @property
    def headers(self) -> dict[str, str]:
        """What every proxy request to the endpoint carries (the endpoint refuses others)."""
        return {SECRET_HEADER: self.secret}

    def configure(self, specs: Mapping[str, StdioSpec]) -> None:
        """Serve exactly `specs` from now on; the children of an upstream removed or changed
        are stopped (their sessions end; the next call starts the new command)."""
        for name, old in list(self._specs.items()):
            if specs.get(name) != old:
                self._drop_upstream(name)
        self._specs = dict(specs)

    def processes(self, name: str) -> int:
        """Children (running or starting) of upstream `name` now."""
        return self._slots.get(name, 0)

    def pids(self) -> list[int]:
        """Every running child's pid (tests, diagnostics)."""
        children = [s.child for s in self._sessions.values()] + [s.child for s in self._shared.values()]
        return [c.pid for c in children if c is not None and c.alive and c.pid is not None]

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_line_bytes)
        app.router.add_route("*", "/{upstream}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.SockSite(self._runner, self._sock)
        await site.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="stdio-reaper")

    async def close(self) -> None:
        """Stop every child (stdin closed, then SIGTERM, then SIGKILL) and the endpoint."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        children = [s.child for s in self._sessions.values()] + [s.child for s in self._shared.values()]
        for session in self._sessions.values():
            session.closed = True
        self._sessions.clear()
        self._shared.clear()
        for task in list(self._tasks):
            task.cancel()
        running = [c for c in children if c is not None]
        if running:
            log.info("stopping %d stdio children (stdin closed, then SIGTERM, then SIGKILL)",
                     len(running))
        await asyncio.gather(*(c.close() for c in running), return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._sock.close()

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _health(self, name: str, ok: bool, error: str | None = None) -> None:
        if self.on_health is not None:
            self.on_health(name, ok, error)

    # ---- the endpoint ---------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get(SECRET_HEADER, "")
        if not hmac.compare_digest(given.encode(), self.secret.encode()):
            return web.Response(status=403, text="forbidden")
        spec = self._specs.get(request.match_info["upstream"])
        if spec is None:
            return web.Response(status=404, text="no such stdio upstream")
        sid = request.headers.get("Mcp-Session-Id")
        if sid and sid not in self._sessions:
            port = self._peer(sid)
            if port is not None:
                return await self._forward(request, port)
        if request.method == "GET":
            return await self._listen(request, sid)
        if request.method == "DELETE":
            session = self._sessions.get(sid or "")
            if session is None:
                return web.Response(status=404 if sid else 405)
            await self._end_session(session)
            return web.Response(status=200)
        if request.method != "POST":
            return web.Response(status=405)
        try:
            message = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, None, -32700, "Parse error")
        if not isinstance(message, dict):
            return _error(400, None, -32600, "one JSON-RPC message per request")
        if sid:
            session = self._sessions.get(sid)
            if session is None:
                return _error(404, message.get("id"), -32001, "Session not found")
            return await self._session_post(request, session, message)
        if message.get("method") == "initialize" and "id" in message:
            return await self._open_session(request, spec, message)
        return await self._shared_post(request, spec, message)

    # ---- sessions another worker holds -------------------------------------------------------

    def _session_id(self) -> str:
        """A new session id: `<endpoint port>.<random>.<tag>`, the tag a MAC of the rest under
        the endpoint's secret. Workers sharing the secret know by it which endpoint (worker) holds
        a session; nobody else can make one that names a port."""
        body = f"{self.port}.{secrets.token_hex(16)}"
        return f"{body}.{self._tag(body)}"

    def _tag(self, body: str) -> str:
        return hmac.new(self.secret.encode(), body.encode(), hashlib.sha256).hexdigest()[:32]

    def _peer(self, sid: str) -> int | None:
        """The port of the other worker's endpoint holding session `sid`, or None: one worker,
        not an id an endpoint of this serve made (its tag), or not another worker's port (this
        endpoint's own: a session ended here is not looked for elsewhere). Only the siblings'
        ports, which their supervisor holds for the serve's life: no other process can take one
        and be sent the secret."""
        if not self._siblings or len(sid) > 100:
            return None
        body, _, tag = sid.rpartition(".")
        port, _, _ = body.partition(".")
        if not (port.isdigit() and len(port) <= 5 and hmac.compare_digest(tag, self._tag(body))):
            return None
        return int(port) if int(port) in self._siblings else None

    async def _forward(self, request: web.Request, port: int) -> web.StreamResponse:
        """A request of a session the endpoint on `port` (another worker of this serve) holds,
        handed to it through the process's forwarder (written at most once: it never resends
        unasked) and its answer streamed back as it comes. The fronts of this worker did the
        envelope's work on it (checks, audit, inspection of what comes back); here it only
        reaches the child that is the session. A worker that cannot be reached (gone, its
        children with it): 404, the session is over and the client initializes again; one that
        broke off after the request was written: 502 (it may have been performed)."""
        assert self._forwarder is not None  # given with `siblings`
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        body = await request.read() if request.can_read_body else None
        sid = request.headers.get("Mcp-Session-Id", "")
        try:
            answer = await self._forwarder.open(
                request.method, f"http://127.0.0.1:{port}{request.rel_url}", headers, body,
                connect_timeout=_SIBLING_CONNECT, read_timeout=None, long_lived=request.method == "GET")
        except UpstreamBusy as exc:
            return _error(503, None, -32000, f"stdio session stream refused: {exc}")
        except UpstreamError as exc:
            if exc.attempts:  # written: the worker holding the session may have performed it
                log.warning("stdio session %s…: its worker broke off: %s", sid[:12], exc)
                return _error(502, None, -32603, f"the worker holding the stdio session broke off: {exc}")
            log.info("stdio session %s… of a worker not reachable (%s): session not found", sid[:12], exc)
            return _error(404, None, -32001, "Session not found") if request.method == "POST" \
                else web.Response(status=404)
        async with answer:
            response = web.StreamResponse(status=answer.status, headers={
                k: v for k, v in answer.headers.items() if k.lower() in _ANSWER_HEADERS})
            await response.prepare(request)
            try:
                async for chunk in answer.chunks():
                    await response.write(chunk)
            except UpstreamError as exc:  # the worker went away mid-answer: the stream ends
                log.warning("stdio session %s…: its worker broke off the stream: %s", sid[:12], exc)
            return response  # (a call's stream without its reply is a failed call)

    # ---- session clients --------------------------------------------------------------------

    def _take_slot(self, spec: StdioSpec) -> bool:
        used = self._slots.get(spec.name, 0)
        if used >= spec.max_processes:
            return False
        self._slots[spec.name] = used + 1
        self._publish(spec.name)
        return True

    def _free_slot(self, name: str) -> None:
        self._slots[name] = max(0, self._slots.get(name, 0) - 1)
        self._publish(name)

    def _publish(self, name: str) -> None:
        if self.on_processes is not None:
            self.on_processes(name, self._slots[name])

    def _hold(self, name: str, principal: str, change: int) -> None:
        key = (name, principal)
        held = self._held.get(key, 0) + change
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    def _over_share(self, spec: StdioSpec, principal: str, rpc_id: Any) -> web.Response | None:
        """503 when `principal` holds its whole share of `spec`'s processes, else None."""
        share = spec.per_principal
        if self._held.get((spec.name, principal), 0) < share:
            return None
        who = f"principal {principal!r}" if principal else "this principal"
        log.warning("stdio upstream %s: %s holds %d processes, its whole share "
                    "(max_processes_per_principal: %d): refused to start another", spec.name,
                    who, share, share)
        response = _error(503, rpc_id, -32000,
                          f"{who} holds as many processes of stdio upstream {spec.name!r} as one "
                          f"principal may (max_processes_per_principal: {share}); end a session "
                          "or try again later")
        response.headers["Retry-After"] = "1"
        return response

    def _start_failed(self, spec: StdioSpec, reason: str) -> None:
        failing = self._failing.setdefault(spec.name, Failing())
        failing.count += 1
        failing.last = reason
        delay = _backoff(failing.count)
        failing.until = time.monotonic() + delay
        log.error("stdio upstream %s: a session's child failed at start-up (%s), %d times in a "
                  "row: no new session before %gs", spec.name, reason, failing.count, delay)

    def _backing_off(self, spec: StdioSpec, rpc_id: Any) -> web.Response | None:
        """503 while the upstream's start-up backoff runs, else None."""
        failing = self._failing.get(spec.name)
        if failing is None:
            return None
        left = failing.until - time.monotonic()
        if left <= 0:
            return None
        response = _error(503, rpc_id, -32000,
                          f"stdio upstream {spec.name!r} failed to start {failing.count} times in "
                          f"a row (last: {failing.last}); the next start is in {left:.1f}s")
        response.headers["Retry-After"] = str(math.ceil(left))
        return response

    def _full(self, spec: StdioSpec, rpc_id: Any) -> web.Response:
        log.warning("stdio upstream %s runs as many processes as it may (max_processes: %d): "
                    "refused to start another", spec.name, spec.max_processes)
        response = _error(503, rpc_id, -32000,
                          f"stdio upstream {spec.name!r} runs as many processes as it may "
                          f"(max_processes: {spec.max_processes}); try again later")
        response.headers["Retry-After"] = "1"
        return response

    async def _open_session(self, request: web.Request, spec: StdioSpec,
                            message: dict[str, Any]) -> web.StreamResponse:
        if self._closing:
            return _error(503, message.get("id"), -32000, "the proxy is shutting down")
        principal = unquote(request.headers.get(PRINCIPAL_HEADER, ""))
        refused = self._backing_off(spec, message.get("id"))
        if refused is not None:
            return refused
        if self._slots.get(spec.name, 0) >= spec.max_processes:
            return self._full(spec, message.get("id"))
        refused = self._over_share(spec, principal, message.get("id"))
        if refused is not None:
            return refused
        self._take_slot(spec)
        self._hold(spec.name, principal, 1)
        session = Session(id=self._session_id(), spec=spec, principal=principal,
                          initialize=message)
        try:
            child = await self._start_child(spec, session)
        except ChildGone as exc:
            self._free_slot(spec.name)
            self._hold(spec.name, principal, -1)
            self._health(spec.name, False, str(exc))
            self._start_failed(spec, str(exc))
            return _error(502, message.get("id"), -32603, f"stdio upstream {spec.name!r}: {exc}")
        session.child = child
        session.ready.set()
        self._sessions[session.id] = session
        waiter = Waiter(message.get("id"))
        try:
            return await self._relay(request, child, message, waiter,
                                     key_of(message.get("id")), {"Mcp-Session-Id": session.id},
                                     answer_first=True,
                                     on_reply=lambda _: self._health(spec.name, True))
        finally:
            session.last_used = time.monotonic()  # idle counts from the last answer
            if waiter.done:
                self._failing.pop(spec.name, None)  # it starts: the backoff is over
            else:
                if not child.alive:
                    self._start_failed(spec, f"the process {child.broken or 'exited'} before "
                                       "it answered initialize")
                # No session without the server's answer: nothing restarts a child for a
                # handshake that never happened, and the slot is free again.
                await self._end_session(session)

    async def _start_child(self, spec: StdioSpec, owner: Session | Shared) -> Child:
        child = Child(spec, self.max_line_bytes,
                      on_message=lambda c, m, size: self._unsolicited(owner, c, m, size),
                      on_exit=lambda c, why: self._exited(owner, c, why))
        await child.start()
        log.info("stdio upstream %s: started child %s", spec.name, child.pid)
        return child

    async def _session_post(self, request: web.Request, session: Session,
                            message: dict[str, Any]) -> web.StreamResponse:
        session.last_used = time.monotonic()
        if not session.ready.is_set():
            # The child is being restarted after a crash: the call waits for it (within the
            # upstream's timeout, which the executor holds).
            await session.ready.wait()
        if session.closed or session.child is None:
            return _error(404, message.get("id"), -32001, "Session not found")
        child = session.child
        if "method" not in message or "id" not in message:
            if message.get("method") == "notifications/initialized":
                session.initialized = message
            try:
                await child.send(message)
            except ChildGone:
                return _error(502, None, -32603, f"stdio upstream {session.spec.name!r}: the "
                              "process is not running")
            return web.Response(status=202)
        key = key_of(message.get("id"))
        if key in child.pending:
            # MCP: an id is never reused within a session. Sent on, the child's one reply would
            # reach one of the two callers and the other would wait until its timeout.
            return _error(400, message.get("id"), -32600,
                          f"request id {key} is already in flight in this session")
        waiter = Waiter(message.get("id"), progress=_progress_token(message))
        try:
            return await self._relay(request, child, message, waiter, key,
                                     {"Mcp-Session-Id": session.id})
        finally:
            session.last_used = time.monotonic()

    async def _listen(self, request: web.Request, sid: str | None) -> web.StreamResponse:
        """GET: the session's stream for server messages no call caused."""
        if not sid:
            return web.Response(status=405)
        session = self._sessions.get(sid)
        if session is None:
            return web.Response(status=404)
        listener = Waiter(None)
        session.listeners.append(listener)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            while True:
                message = await listener.get()
                if message is None:
                    break
                await response.write(b"data: " + orjson.dumps(message) + b"\n\n")
        finally:
            with contextlib.suppress(ValueError):
                session.listeners.remove(listener)
            if listener.dropped:
                log.warning("stdio upstream %s: dropped %d messages of session %s… for a stream "
                            "whose client read them slower than they came", session.spec.name,
                            listener.dropped, session.id[:8])
        return response

    async def _end_session(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        session.ready.set()
        self._sessions.pop(session.id, None)
        self._hold(session.spec.name, session.principal, -1)
        for listener in session.listeners:
            listener.put(None)  # however much it holds: its stream ends after that
        child, session.child = session.child, None
        if child is not None:
            self._free_slot(session.spec.name)
            await child.close()

    # ---- stateless clients ------------------------------------------------------------------

    async def _shared_child(self, spec: StdioSpec) -> Child:
        """The upstream's shared child, started (after the crash backoff) when there is none."""
        shared = self._shared.get(spec.name)
        if shared is None:
            shared = self._shared[spec.name] = Shared(spec)
        shared.last_used = time.monotonic()
        if shared.child is not None and shared.child.alive:
            return shared.child
        if shared.starting is None:
            if not self._take_slot(spec):
                raise _Full()
            shared.starting = asyncio.get_running_loop().create_task(self._start_shared(shared))
        return await asyncio.shield(shared.starting)

    async def _start_shared(self, shared: Shared) -> Child:
        try:
            delay = shared.next_start - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            child: Child | None = None
            try:
                child = await self._start_child(shared.spec, shared)
                shared.handshake = await self._prepare_shared(child)
            except (ChildGone, TimeoutError) as exc:
                if child is not None:
                    await child.close(0.2)
                self._free_slot(shared.spec.name)
                shared.failures += 1
                shared.next_start = time.monotonic() + _backoff(shared.failures)
                reason = str(exc) or "it did not answer in time"
                self._health(shared.spec.name, False, f"stdio child: {reason}")
                raise ChildGone(reason) from exc
            if self._closing or self._shared.get(shared.spec.name) is not shared:
                # Dropped (a reload removed or changed the upstream, or shutdown) while the
                # child came up: nothing would ever stop it, and it would keep its slot.
                await child.close(0.2)
                self._free_slot(shared.spec.name)
                raise ChildGone("the upstream was reconfigured while its process started")
            shared.child = child
            return child
        finally:
            shared.starting = None

    async def _prepare_shared(self, child: Child) -> dict[str, Any] | None:
        """Find out which revisions the shared child speaks: None when it answers
        `server/discover` (a modern server: callers' requests go to it as they are), else its
        `initialize` result after the proxy's own handshake. ChildGone when it takes neither."""
        meta = {"io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
                "io.modelcontextprotocol/clientInfo": PROXY_INFO,
                "io.modelcontextprotocol/clientCapabilities": {}}
        try:
            reply = await self._ask(child, "server/discover", {"_meta": meta}, PROBE_SECONDS)
        except TimeoutError:
            reply = None  # a server that ignores unknown methods: try the handshake
        result = reply.get("result") if reply else None
        if isinstance(result, dict) and MODERN_VERSION in (result.get("supportedVersions") or ()):
            return None
        reply = await self._ask(child, "initialize", {
            "protocolVersion": HANDSHAKE_VERSION, "capabilities": {}, "clientInfo": PROXY_INFO})
        result = reply.get("result") if reply else None
        if not isinstance(result, dict):
            raise ChildGone("it answered neither server/discover nor initialize")
        await child.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        log.info("stdio upstream %s: shared child %s speaks %s: initialised by the proxy for "
                 "stateless callers", child.spec.name, child.pid, result.get("protocolVersion"))
        return result

    async def _ask(self, child: Child, method: str, params: dict[str, Any],
                   seconds: float = HANDSHAKE_SECONDS) -> dict[str, Any] | None:
        """One request of the proxy's own to `child`: its reply, None when the child went away;
        TimeoutError past `seconds`."""
        proxy_id = f"{ID_PREFIX}{next(self._ids)}"
        waiter = Waiter(proxy_id)
        child.register(key_of(proxy_id), waiter)
        try:
            await child.send({"jsonrpc": "2.0", "id": proxy_id, "method": method, "params": params})
            async with asyncio.timeout(seconds):
                return await waiter.get()
        finally:
            child.forget(key_of(proxy_id))

    async def _shared_post(self, request: web.Request, spec: StdioSpec,
                           message: dict[str, Any]) -> web.StreamResponse:
        if self._closing:
            return _error(503, message.get("id"), -32000, "the proxy is shutting down")
        if "method" not in message:
            # A caller's answer to a server request relayed with a proxy id.
            shared = self._shared.get(spec.name)
            own = shared.server_requests.pop(key_of(message.get("id")), _MISSING) if shared else _MISSING
            if shared is None or own is _MISSING or shared.child is None:
                return web.Response(status=202)  # nobody waits for it any more
            with contextlib.suppress(ChildGone):
                await shared.child.send({**message, "id": own})
            return web.Response(status=202)
        if "id" not in message:
            # A stateless caller cancels by closing its stream; other notifications have no
            # session to belong to.
            return web.Response(status=202)
        try:
            child = await self._shared_child(spec)
        except _Full:
            return self._full(spec, message.get("id"))
        except ChildGone as exc:
            return _error(502, message.get("id"), -32603, f"stdio upstream {spec.name!r}: {exc}")
        shared = self._shared[spec.name]
        if shared.handshake is not None and message.get("method") == "server/discover":
            return _reply(message.get("id"), _discover(shared.handshake))
        proxy_id = f"{ID_PREFIX}{next(self._ids)}"
        waiter = Waiter(message.get("id"))
        params = message.get("params")
        outgoing = {**message, "id": proxy_id}
        if isinstance(params, dict) and isinstance(params.get("_meta"), dict) \
                and "progressToken" in params["_meta"]:
            waiter.progress = params["_meta"]["progressToken"]
            token = f"{ID_PREFIX}p{next(self._ids)}"
            outgoing["params"] = {**params, "_meta": {**params["_meta"], "progressToken": token}}
            shared.progress[token] = waiter
        try:
            return await self._relay(request, child, outgoing, waiter, key_of(proxy_id), {},
                                     cancel_id=proxy_id, complete=_completion(shared, message),
                                     on_reply=lambda _: self._shared_ok(shared))
        finally:
            for token in [t for t, w in shared.progress.items() if w is waiter]:
                del shared.progress[token]

    def _shared_ok(self, shared: Shared) -> None:
        shared.failures = 0
        self._health(shared.spec.name, True)

    # ---- one call's stream ------------------------------------------------------------------

    async def _relay(self, request: web.Request, child: Child, outgoing: dict[str, Any],
                     waiter: Waiter, key: str, headers: dict[str, str],
                     cancel_id: str | None = None, complete: Mapping[str, Any] | None = None,
                     answer_first: bool = False,
                     on_reply: Callable[[dict[str, Any]], None] | None = None) -> web.StreamResponse:
        """Send one request to `child` and answer with an SSE stream of what the child sends for
        it, ending with its reply (its id restored); the stream ends without a reply when the
        child goes away. A caller gone before the reply cancels it (`cancel_id`: stateless).
        `complete`: fields a 2026-07-28 caller needs on the result, added when the child (which
        speaks a handshake revision) left them out. `answer_first` (`initialize`): the stream
        starts with the child's first message, and a child gone before it is answered 502 with
        a JSON-RPC error (a request that had no effect yet, unlike a call cut off mid-stream)."""
        child.register(key, waiter)
        outgoing = _with_trace(outgoing, request.headers)
        try:
            await child.send(outgoing)
        except ChildGone as exc:
            child.forget(key)
            return _error(502, waiter.reply_id, -32603,
                          f"stdio upstream {child.spec.name!r}: {exc}")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
        try:
            first: dict[str, Any] | None = None
            if answer_first:
                first = await waiter.get()
                if first is None:
                    return _error(502, waiter.reply_id, -32603,
                                  f"stdio upstream {child.spec.name!r}: the process "
                                  f"{child.broken or 'exited'} before it answered")
            await response.prepare(request)
            while True:
                message, first = (first, None) if first is not None else (await waiter.get(), None)
                if message is None:
                    break  # the child went away: no reply, the call failed
                if "method" not in message and message.get("id") is not None \
                        and key_of(message.get("id")) == key:
                    message = {**message, "id": waiter.reply_id}
                    result = message.get("result")
                    if complete and isinstance(result, dict):
                        message["result"] = {**complete, **result}
                    waiter.done = True
                    await response.write(_event(message))
                    if on_reply is not None:
                        on_reply(message)
                    break
                await response.write(_event(message))
        finally:
            child.forget(key)
            if waiter.dropped:
                log.warning("stdio upstream %s: dropped %d messages of child %s for a call whose "
                            "client read them slower than they came", child.spec.name,
                            waiter.dropped, child.pid)
            if not waiter.done and cancel_id is not None and child.alive:
                self._spawn_task(_cancel(child, cancel_id))
        return response

    def _unsolicited(self, owner: Session | Shared, child: Child, message: dict[str, Any],
                     size: int) -> None:
        """A server request or notification: to the stream of the call it belongs to."""
        if isinstance(owner, Shared):
            self._route_shared(owner, child, message, size)
            return
        waiter = _by_progress(child, message) or _latest(child)
        if waiter is not None:
            self._offer(waiter, child, message, size)
            return
        for listener in owner.listeners:
            if listener.offer(message, size):
                return
        self._unroutable(child, message)

    def _offer(self, waiter: Waiter, child: Child, message: dict[str, Any], size: int) -> None:
        """`message` to the stream of `waiter`'s call, unless that holds too much unread: then
        dropped (a server request answered with an error, so the child does not wait)."""
        if not waiter.offer(message, size) and "id" in message and "method" in message:
            self._spawn_task(_send_quietly(child, {
                "jsonrpc": "2.0", "id": message["id"],
                "error": {"code": -32603, "message": "the client is not reading: request dropped"}}))

    def _route_shared(self, shared: Shared, child: Child, message: dict[str, Any], size: int) -> None:
        if shared.handshake is not None and "id" in message and "method" in message:
            # A handshake-revision server asks a 2026-07-28 caller, who cannot be asked
            # mid-call: answered here (ping), or refused so the child does not wait.
            answer: dict[str, Any] = (
                {"result": {}} if message["method"] == "ping" else
                {"error": {"code": -32601, "message": f"{message['method']} is not available: "
                           "the client is stateless (2026-07-28)"}})
            self._spawn_task(_send_quietly(child, {"jsonrpc": "2.0", "id": message["id"], **answer}))
            return
        params = message.get("params")
        token = params.get("progressToken") if isinstance(params, dict) else None
        waiter = shared.progress.get(token) if isinstance(token, str) else None
        if waiter is not None:
            message = {**message, "params": {**params, "progressToken": waiter.progress}}  # type: ignore[dict-item]
        elif len(child.pending) == 1:
            # Only one caller can have caused it.
            waiter = next(iter(child.pending.values()))
        if waiter is None:
            self._unroutable(child, message)
            return
        if "id" in message and "method" in message:
            proxy_id = f"{ID_PREFIX}s{next(self._ids)}"
            shared.server_requests[key_of(proxy_id)] = message["id"]
            message = {**message, "id": proxy_id}
        self._offer(waiter, child, message, size)

    def _unroutable(self, child: Child, message: dict[str, Any]) -> None:
        """Nobody can receive it: a server request is answered with an error so the child does
        not wait forever; a notification is dropped."""
        child.unroutable += 1
        if log_due(child.unroutable):
            log.info("stdio upstream %s: no caller to receive %s (%d messages of child %s so far)",
                     child.spec.name, message.get("method"), child.unroutable, child.pid)
        if "id" in message and "method" in message:
            self._spawn_task(_send_quietly(child, {
                "jsonrpc": "2.0", "id": message["id"],
                "error": {"code": -32603, "message": "no client is waiting for this request"}}))

    # ---- crashes, restarts, reaping ---------------------------------------------------------

    def _exited(self, owner: Session | Shared, child: Child, reason: str) -> None:
        name = child.spec.name
        if self._closing:
            return
        if isinstance(owner, Shared):
            if owner.child is not child:
                return
            owner.child = None
            self._free_slot(name)
            owner.failures += 1
            owner.next_start = time.monotonic() + _backoff(owner.failures)
            log.error("stdio upstream %s: shared child %s %s; the next call starts another",
                      name, child.pid, reason)
            self._health(name, False, f"stdio child {reason}")
            return
        if owner.closed or owner.child is not child:
            return
        log.error("stdio upstream %s: child %s of session %s… %s; restarting it", name,
                  child.pid, owner.id[:8], reason)
        self._health(name, False, f"stdio child {reason}")
        owner.ready.clear()
        self._spawn_task(self._restart(owner))

    async def _restart(self, session: Session) -> None:
        """Start the session's child again (with backoff) and replay its handshake."""
        name = session.spec.name
        while not session.closed and not self._closing:
            session.restarts += 1
            if session.restarts > MAX_SESSION_RESTARTS:
                log.error("stdio upstream %s: session %s… crashed %d times in a row: ended",
                          name, session.id[:8], MAX_SESSION_RESTARTS)
                await self._end_session(session)
                return
            await asyncio.sleep(_backoff(session.restarts))
            if session.closed or self._closing:
                return
            try:
                child = await self._start_child(session.spec, session)
                if session.initialize is not None:
                    await self._handshake(child, session)
            except (ChildGone, TimeoutError) as exc:
                self._health(name, False, f"stdio child restart failed: {exc}")
                continue
            if session.closed or self._closing:
                # Ended (DELETE, idle, shutdown) while the child came up: nothing would ever
                # stop it, and its slot was already given back.
                await child.close(0.2)
                return
            session.child = child
            session.restarts = 0
            session.ready.set()
            self._health(name, True)
            log.info("stdio upstream %s: session %s… restarted as child %s", name,
                     session.id[:8], child.pid)
            return

    async def _handshake(self, child: Child, session: Session) -> None:
        assert session.initialize is not None
        proxy_id = f"{ID_PREFIX}init-{next(self._ids)}"
        waiter = Waiter(proxy_id)
        child.register(key_of(proxy_id), waiter)
        try:
            # The send within the deadline too: a child that never reads stdin fills the pipe
            # (64 KiB) with a large initialize, and the write would wait for it for ever.
            async with asyncio.timeout(HANDSHAKE_SECONDS):
                await child.send({**session.initialize, "id": proxy_id})
                reply = await waiter.get()
        except BaseException:
            await child.close(0.2)
            raise
        if reply is None or "result" not in reply:
            await child.close(0.2)
            raise ChildGone("it did not accept the session's initialize again")
        if session.initialized is not None:
            await child.send(session.initialized)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for session in list(self._sessions.values()):
                child = session.child
                if child is not None and not child.pending \
                        and now - session.last_used > session.spec.idle_timeout:
                    log.info("stdio upstream %s: session %s… idle for %gs: stopping its child",
                             session.spec.name, session.id[:8], session.spec.idle_timeout)
                    await self._end_session(session)
            for name, shared in list(self._shared.items()):
                child = shared.child
                if child is not None and not child.pending \
                        and now - shared.last_used > shared.spec.idle_timeout:
                    log.info("stdio upstream %s: shared child idle for %gs: stopping it", name,
                             shared.spec.idle_timeout)
                    shared.child = None
                    self._free_slot(name)
                    await child.close()

    def _drop_upstream(self, name: str) -> None:
        self._failing.pop(name, None)  # a new command starts at once
        for session in [s for s in self._sessions.values() if s.spec.name == name]:
            self._spawn_task(self._end_session(session))
        shared = self._shared.pop(name, None)
        if shared is not None and shared.child is not None:
            child, shared.child = shared.child, None
            self._free_slot(name)
            self._spawn_task(child.close())


class _Full(Exception):
    """Every process slot of the upstream is taken."""


_MISSING = object()


# A W3C `traceparent` (version 00 and future versions alike: the first four fields).
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[ -~]*)?")
MAX_TRACESTATE = 512  # W3C: at most 32 members; longer ones are dropped, not cut


def _with_trace(message: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """`message` carrying the request's W3C trace context (the `traceparent`/`tracestate`
    headers the proxy's client span sent, when tracing is on) in `params._meta`, where MCP
    carries it over stdio (there are no headers on the child's stdin). A value that is no
    trace context is not passed on; without one the message goes as it is."""
    parent = headers.get("traceparent", "")
    params = message.get("params", {})
    if not _TRACEPARENT.fullmatch(parent) or not isinstance(params, dict):
        return message
    meta = params.get("_meta")
    meta = {k: v for k, v in meta.items() if k not in ("traceparent", "tracestate")} \
        if isinstance(meta, dict) else {}
    meta["traceparent"] = parent
    state = headers.get("tracestate", "")
    if state and len(state) <= MAX_TRACESTATE and state.isprintable():
        meta["tracestate"] = state
    return {**message, "params": {**params, "_meta": meta}}


def principal_value(principal: str) -> str:
    """`principal` as the value of PRINCIPAL_HEADER (any id fits a header field)."""
    return quote(principal, safe="")


def _backoff(failures: int) -> float:
    return float(min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** max(0, failures - 1)))


def _by_progress(child: Child, message: dict[str, Any]) -> Waiter | None:
    params = message.get("params")
    token = params.get("progressToken") if isinstance(params, dict) else None
    if token is None:
        return None
    for waiter in child.pending.values():
        if waiter.progress == token:
            return waiter
    return None


def _progress_token(message: Mapping[str, Any]) -> Any:
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.get("progressToken") if isinstance(meta, dict) else None


def _latest(child: Child) -> Waiter | None:
    """The call most recently sent: the one a server message of a session most likely serves
    (the stdio wire says nothing more; a session client's calls are usually one at a time)."""
    return next(reversed(child.pending.values()), None)


async def _cancel(child: Child, proxy_id: str) -> None:
    await _send_quietly(child, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                                "params": {"requestId": proxy_id,
                                           "reason": "the client went away"}})


async def _send_quietly(child: Child, message: Mapping[str, Any]) -> None:
    with contextlib.suppress(ChildGone):
        await child.send(message)


def _event(message: Mapping[str, Any]) -> bytes:
    return b"event: message\ndata: " + orjson.dumps(message) + b"\n\n"


def _completion(shared: Shared, message: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a 2026-07-28 result carries that a handshake-revision server's lacks (None for a
    modern server): `resultType`, and on list results their cache hints (`ttlMs` 0: no
    caching the proxy cannot vouch for)."""
    if shared.handshake is None:
        return None
    fields: dict[str, Any] = {"resultType": "complete"}
    if str(message.get("method", "")).endswith("/list"):
        fields.update(ttlMs=0, cacheScope="private")
    return fields


def _discover(handshake: Mapping[str, Any]) -> dict[str, Any]:
    """The `server/discover` result of a handshake-revision server the proxy initialised."""
    result: dict[str, Any] = {
        "supportedVersions": [MODERN_VERSION], "capabilities": handshake.get("capabilities") or {},
        "resultType": "complete", "ttlMs": 0, "cacheScope": "private"}
    if isinstance(handshake.get("serverInfo"), dict):
        result["_meta"] = {"io.modelcontextprotocol/serverInfo": handshake["serverInfo"]}
    if isinstance(handshake.get("instructions"), str):
        result["instructions"] = handshake["instructions"]
    return result


def _reply(rpc_id: Any, result: Mapping[str, Any]) -> web.Response:
    body = {"jsonrpc": "2.0", "id": rpc_id, "result": result}
    return web.Response(status=200, body=orjson.dumps(body), content_type="application/json")


def _error(status: int, rpc_id: Any, code: int, message: str) -> web.Response:
    body = {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
