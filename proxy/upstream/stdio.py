"""Stdio upstreams: MCP servers the proxy launches as child processes (`command:`).

Each command upstream is made reachable exactly like an HTTP one: `StdioUpstreams` serves an
internal Streamable HTTP endpoint on loopback (`http://127.0.0.1:<port>/<upstream>`, guarded by
a random per-process secret header that only the proxy's own targets carry), and the
upstream's `UpstreamTarget.url` points at it. The per-upstream route, the aggregate, the
executor, the envelope and audit therefore stay untouched: a stdio upstream is one more URL.

Behind the endpoint, newline-delimited JSON-RPC on the child's stdin/stdout, one message a line:

- Session clients (2025-06-18 / 2025-11-25, `initialize` without `Mcp-Session-Id`) each get a
  child of their own: a stdio server is one MCP session. Children come from a bounded pool
  (`max_processes` per upstream); past the bound `initialize` gets HTTP 503 with a JSON-RPC
  error at once (a clear answer, never a hang). A child no request touched for `idle_timeout`
  is stopped and its session forgotten (the client then gets 404 and initializes again).
- Stateless clients (2026-07-28, no session id) share one child the proxy started (a modern
  server needs no handshake); their JSON-RPC ids and progress tokens are remapped to string ids
  with a proxy prefix, so replies, progress and server requests reach the right caller and
  never collide. Closing the caller's stream sends `notifications/cancelled` to the child.
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
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from proxy.policy.model import Upstream

log = logging.getLogger("envelope.stdio")

SECRET_HEADER = "X-Envelope-Stdio-Secret"
# Ids the proxy mints towards a shared child (and back towards a stateless caller): strings with
# this prefix, so they never collide with a caller's numbers or strings.
ID_PREFIX = "envelope-stdio-"
# The environment a child inherits from the proxy; everything else comes from `env`.
INHERITED_ENV = ("PATH", "HOME", "LANG")
# One stderr line in the proxy log at most this long (the rest is cut, said so).
STDERR_LINE_BYTES = 4096
# At most this many stderr lines a second per child reach the log (a chatty or looping child
# must not drown the proxy's own log); the rest are counted.
STDERR_LINES_PER_SECOND = 100
# After a crash: 0.25 s, 0.5 s, ... at most 30 s before the next start.
BACKOFF_FIRST = 0.25
BACKOFF_MAX = 30.0
# A session child that crashes this often in a row without answering is given up: its session
# ends (404) instead of restarting forever.
MAX_SESSION_RESTARTS = 5
# Close: how long a child has after its stdin closed, then after SIGTERM.
CLOSE_GRACE = 2.0
# The most unsolicited messages held for a session nobody listens to (GET stream closed).
BACKLOG = 256

HealthSink = Callable[[str, bool, str | None], None]


@dataclass(frozen=True, slots=True)
class StdioSpec:
    """How to run one command upstream."""

    name: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    max_processes: int = 16
    idle_timeout: float = 300.0


def command_upstream(command: Sequence[str], env: Mapping[str, str] | None = None,
                     cwd: str | None = None) -> Upstream:
    """A policy `Upstream` that launches `command` (what `envelope-proxy stdio -- cmd` serves)."""
    return Upstream(command=list(command), env=dict(env or {}), cwd=cwd)


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: PATH, HOME and LANG of the proxy plus `extra` (never the proxy's
    other variables: they may hold its credentials)."""
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    env.update(extra)
    return env


class ChildGone(Exception):
    """The child process is not running (exited, broken, or being restarted)."""


@dataclass(eq=False, slots=True)
class Waiter:
    """One caller's request in flight on a child: where its stream's messages go.

    `None` on the queue: the child is gone, the stream ends without a reply."""

    reply_id: Any  # the id the caller used (restored on the reply)
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    progress: Any = None  # the caller's progress token, when remapped
    done: bool = False


class Child:
    """One stdio server process: a reader of its stdout and stderr, a writer to its stdin.

    `on_message(child, msg)` receives every message that is not a reply to a pending request;
    `on_exit(child, reason)` runs once when it ends, after every waiter got `None`."""

    def __init__(self, spec: StdioSpec, max_line_bytes: int,
                 on_message: Callable[[Child, dict[str, Any]], None],
                 on_exit: Callable[[Child, str], None]):
        self.spec = spec
        self.max_line_bytes = max_line_bytes
        self.on_message = on_message
        self.on_exit = on_exit
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[str, Waiter] = {}
        self.alive = False
        self.broken: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._write_lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self) -> None:
        """Start the process; ChildGone with the reason when it cannot be started."""
        spec = self.spec
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *spec.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=child_env(dict(spec.env)), cwd=spec.cwd,
                # Its own process group: shutdown reaches the grandchildren too, and a ^C at the
                # proxy's terminal does not kill children before the proxy closes them in order.
                start_new_session=True,
                limit=self.max_line_bytes + 1,
            )
        except OSError as exc:
            raise ChildGone(f"cannot start {spec.command[0]!r}: {exc.strerror or exc}") from exc
        self.alive = True
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read(), name=f"stdio-{spec.name}-out"),
                       loop.create_task(self._stderr(), name=f"stdio-{spec.name}-err")]

    async def send(self, message: Mapping[str, Any]) -> None:
        """Write one message as one line; ChildGone when the child cannot take it."""
        proc = self.proc
        if not self.alive or proc is None or proc.stdin is None:
            raise ChildGone(self.broken or "the process is not running")
        line = orjson.dumps(message) + b"\n"
        async with self._write_lock:
            try:
                proc.stdin.write(line)
                await proc.stdin.drain()
            except (ConnectionError, RuntimeError) as exc:
                raise ChildGone(f"its stdin is closed: {exc}") from exc

    def register(self, key: str, waiter: Waiter) -> None:
        self.pending[key] = waiter

    def forget(self, key: str) -> None:
        self.pending.pop(key, None)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        reason = "exited"
        try:
            while True:
                try:
                    line = await stdout.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    reason = f"wrote a line past {self.max_line_bytes} bytes"
                    self.broken = reason
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    message = orjson.loads(line)
                except orjson.JSONDecodeError:
                    reason = "wrote a line that is not JSON"
                    self.broken = reason
                    break
                if not isinstance(message, dict):
                    reason = "wrote a line that is not one JSON-RPC message"
                    self.broken = reason
                    break
                self._dispatch(message)
        finally:
            self.alive = False
            if self.broken is not None:
                log.error("stdio upstream %s: child %s %s: stopping it", self.spec.name,
                          self.pid, self.broken)
                self._signal(signal.SIGKILL)
            code = await self._wait(CLOSE_GRACE)
            if self.broken is None:
                reason = f"exited with code {code}" if code is not None else "closed its stdout"
            for waiter in list(self.pending.values()):
                waiter.queue.put_nowait(None)
            self.pending.clear()
            self.on_exit(self, reason)

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "method" not in message and "id" in message:
            waiter = self.pending.pop(_key(message.get("id")), None)
            if waiter is not None:
                waiter.queue.put_nowait(message)
                return
            log.info("stdio upstream %s: dropped a reply to no pending request", self.spec.name)
            return
        self.on_message(self, message)

    async def _stderr(self) -> None:
        """Log the child's stderr line by line: each line capped at STDERR_LINE_BYTES (the rest
        of a longer line is skipped up to its newline), at most STDERR_LINES_PER_SECOND lines a
        second (the lines past it are counted, and the count logged)."""
        assert self.proc is not None and self.proc.stderr is not None
        stderr = self.proc.stderr
        buffer = b""
        skipping = 0  # bytes of an over-long line skipped so far
        window, logged, dropped = time.monotonic(), 0, 0
        while True:
            chunk = await stderr.read(65536)
            if not chunk:
                break
            buffer += chunk
            lines: list[tuple[bytes, int]] = []
            while True:
                end = buffer.find(b"\n")
                if end < 0:
                    break
                line, buffer = buffer[:end], buffer[end + 1:]
                if skipping:
                    skipping = 0  # the end of a line already logged in part
                    continue
                lines.append((line[:STDERR_LINE_BYTES], max(0, len(line) - STDERR_LINE_BYTES)))
            if not skipping and len(buffer) > STDERR_LINE_BYTES:
                lines.append((buffer[:STDERR_LINE_BYTES], len(buffer) - STDERR_LINE_BYTES))
                skipping, buffer = len(buffer), b""
            elif skipping:
                skipping += len(buffer)
                buffer = b""
            for line, cut in lines:
                now = time.monotonic()
                if now - window >= 1.0:
                    if dropped:
                        log.warning("stdio upstream %s [%s]: %d stderr lines not logged (more "
                                    "than %d a second)", self.spec.name, self.pid, dropped,
                                    STDERR_LINES_PER_SECOND)
                    window, logged, dropped = now, 0, 0
                if logged >= STDERR_LINES_PER_SECOND:
                    dropped += 1
                    continue
                logged += 1
                self._log_stderr(line, cut)
        if buffer and not skipping:
            self._log_stderr(buffer[:STDERR_LINE_BYTES], max(0, len(buffer) - STDERR_LINE_BYTES))
        if dropped:
            log.warning("stdio upstream %s [%s]: %d stderr lines not logged (more than %d a "
                        "second)", self.spec.name, self.pid, dropped, STDERR_LINES_PER_SECOND)

    def _log_stderr(self, line: bytes, cut: int) -> None:
        text = line.decode("utf-8", "replace").rstrip()
        if cut:
            text += " [... the rest of the line not logged]"
        if text:
            log.info("stdio upstream %s [%s] stderr: %s", self.spec.name, self.pid, text)

    def _signal(self, sig: int) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    async def _wait(self, seconds: float) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        try:
            async with asyncio.timeout(seconds):
                return await proc.wait()
        except TimeoutError:
            return None

    async def close(self, grace: float = CLOSE_GRACE) -> None:
        """Close stdin, wait `grace`, then SIGTERM, wait, then SIGKILL (the process group)."""
        proc = self.proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        if proc.returncode is None and await self._wait(grace) is None:
            self._signal(signal.SIGTERM)
            if await self._wait(grace) is None:
                self._signal(signal.SIGKILL)
                await self._wait(grace)
        # The group may outlive its leader (a grandchild that ignored stdin closing).
        self._signal(signal.SIGKILL)
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, grace)


def _key(rpc_id: Any) -> str:
    """A pending-map key for a JSON-RPC id (1 and "1" are different ids)."""
    return orjson.dumps(rpc_id).decode()


@dataclass(eq=False, slots=True)
class Session:
    """A session client's own child and what replays its handshake after a restart."""

    id: str
    spec: StdioSpec
    child: Child | None = None
    initialize: dict[str, Any] | None = None
    initialized: dict[str, Any] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    last_used: float = field(default_factory=time.monotonic)
    restarts: int = 0
    closed: bool = False
    listeners: list[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=list)


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


class StdioUpstreams:
    """Every command upstream of the process, served on one internal loopback endpoint.

    Built before the policy is installed (its URL is known at once: the socket is bound here),
    `configure(specs)` after each policy load, `await start()` with the other listeners,
    `await close()` at shutdown (every child stopped)."""

    def __init__(self, max_line_bytes: int = 32 * 2**20, on_health: HealthSink | None = None):
        self.max_line_bytes = max_line_bytes
        self.on_health = on_health
        self.secret = secrets.token_urlsafe(32)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self._specs: dict[str, StdioSpec] = {}
        self._sessions: dict[str, Session] = {}
        self._shared: dict[str, Shared] = {}
        self._slots: dict[str, int] = {}
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

    # ---- session clients --------------------------------------------------------------------

    def _take_slot(self, spec: StdioSpec) -> bool:
        used = self._slots.get(spec.name, 0)
        if used >= spec.max_processes:
            return False
        self._slots[spec.name] = used + 1
        return True

    def _free_slot(self, name: str) -> None:
        self._slots[name] = max(0, self._slots.get(name, 0) - 1)

    def _full(self, spec: StdioSpec, rpc_id: Any) -> web.Response:
        log.warning("stdio upstream %s runs as many processes as it may (max_processes: %d): "
                    "refused a new session", spec.name, spec.max_processes)
        response = _error(503, rpc_id, -32000,
                          f"stdio upstream {spec.name!r} runs as many processes as it may "
                          f"(max_processes: {spec.max_processes}); try again later")
        response.headers["Retry-After"] = "1"
        return response

    async def _open_session(self, request: web.Request, spec: StdioSpec,
                            message: dict[str, Any]) -> web.StreamResponse:
        if self._closing:
            return _error(503, message.get("id"), -32000, "the proxy is shutting down")
        if not self._take_slot(spec):
            return self._full(spec, message.get("id"))
        session = Session(id=secrets.token_hex(16), spec=spec, initialize=message)
        try:
            child = await self._start_child(spec, session)
        except ChildGone as exc:
            self._free_slot(spec.name)
            self._health(spec.name, False, str(exc))
            return _error(502, message.get("id"), -32603, f"stdio upstream {spec.name!r}: {exc}")
        session.child = child
        session.ready.set()
        self._sessions[session.id] = session
        try:
            return await self._relay(request, child, message, Waiter(message.get("id")),
                                     _key(message.get("id")), {"Mcp-Session-Id": session.id},
                                     on_reply=lambda _: self._health(spec.name, True))
        finally:
            session.last_used = time.monotonic()  # idle counts from the last answer

    async def _start_child(self, spec: StdioSpec, owner: Session | Shared) -> Child:
        child = Child(spec, self.max_line_bytes,
                      on_message=lambda c, m: self._unsolicited(owner, c, m),
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
        waiter = Waiter(message.get("id"), progress=_progress_token(message))
        try:
            return await self._relay(request, child, message, waiter, _key(message.get("id")),
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
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(BACKLOG)
        session.listeners.append(queue)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            while True:
                message = await queue.get()
                if message is None:
                    break
                await response.write(b"data: " + orjson.dumps(message) + b"\n\n")
        finally:
            with contextlib.suppress(ValueError):
                session.listeners.remove(queue)
        return response

    async def _end_session(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        session.ready.set()
        self._sessions.pop(session.id, None)
        for queue in session.listeners:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
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
            try:
                shared.child = await self._start_child(shared.spec, shared)
            except ChildGone as exc:
                self._free_slot(shared.spec.name)
                shared.failures += 1
                shared.next_start = time.monotonic() + _backoff(shared.failures)
                self._health(shared.spec.name, False, str(exc))
                raise
            return shared.child
        finally:
            shared.starting = None

    async def _shared_post(self, request: web.Request, spec: StdioSpec,
                           message: dict[str, Any]) -> web.StreamResponse:
        if self._closing:
            return _error(503, message.get("id"), -32000, "the proxy is shutting down")
        if "method" not in message:
            # A caller's answer to a server request relayed with a proxy id.
            shared = self._shared.get(spec.name)
            own = shared.server_requests.pop(_key(message.get("id")), _MISSING) if shared else _MISSING
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
            return await self._relay(request, child, outgoing, waiter, _key(proxy_id), {},
                                     cancel_id=proxy_id,
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
                     cancel_id: str | None = None,
                     on_reply: Callable[[dict[str, Any]], None] | None = None) -> web.StreamResponse:
        """Send one request to `child` and answer with an SSE stream of what the child sends for
        it, ending with its reply (its id restored); the stream ends without a reply when the
        child goes away. A caller gone before the reply cancels it (`cancel_id`: stateless)."""
        child.register(key, waiter)
        try:
            await child.send(outgoing)
        except ChildGone as exc:
            child.forget(key)
            return _error(502, waiter.reply_id, -32603,
                          f"stdio upstream {child.spec.name!r}: {exc}")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
        try:
            await response.prepare(request)
            while True:
                message = await waiter.queue.get()
                if message is None:
                    break  # the child went away: no reply, the call failed
                if "method" not in message and message.get("id") is not None \
                        and _key(message.get("id")) == key:
                    message = {**message, "id": waiter.reply_id}
                    waiter.done = True
                    await response.write(_event(message))
                    if on_reply is not None:
                        on_reply(message)
                    break
                await response.write(_event(message))
        finally:
            child.forget(key)
            if not waiter.done and cancel_id is not None and child.alive:
                self._spawn_task(_cancel(child, cancel_id))
        return response

    def _unsolicited(self, owner: Session | Shared, child: Child, message: dict[str, Any]) -> None:
        """A server request or notification: to the stream of the call it belongs to."""
        if isinstance(owner, Shared):
            self._route_shared(owner, child, message)
            return
        waiter = _by_progress(child, message) or _latest(child)
        if waiter is not None:
            waiter.queue.put_nowait(message)
            return
        for queue in owner.listeners:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(message)
                return
        self._unroutable(child, message)

    def _route_shared(self, shared: Shared, child: Child, message: dict[str, Any]) -> None:
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
            shared.server_requests[_key(proxy_id)] = message["id"]
            message = {**message, "id": proxy_id}
        waiter.queue.put_nowait(message)

    def _unroutable(self, child: Child, message: dict[str, Any]) -> None:
        """Nobody can receive it: a server request is answered with an error so the child does
        not wait forever; a notification is dropped."""
        log.info("stdio upstream %s: no caller to receive %s", child.spec.name,
                 message.get("method"))
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
        child.register(_key(proxy_id), waiter)
        try:
            await child.send({**session.initialize, "id": proxy_id})
            async with asyncio.timeout(30):
                reply = await waiter.queue.get()
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


def _error(status: int, rpc_id: Any, code: int, message: str) -> web.Response:
    body = {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
