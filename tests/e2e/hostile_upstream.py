"""A scripted, hostile MCP upstream: raw aiohttp Streamable HTTP that misbehaves on request.

The official SDK cannot be made to drop a connection mid-request, answer garbage or forge
`_meta`, so this server speaks the wire itself. It behaves correctly unless a call asks it not
to, through the `mode` argument every tool accepts; a test picks a tool for its effect
(annotations) and a mode for the misbehaviour.

Wire (endpoint `/mcp`):

- Session family (2025-11-25, 2025-06-18): `initialize` answers `Mcp-Session-Id`;
  `notifications/*` and client responses get 202; a missing session id gets 400, an unknown
  one 404. GET opens the session's standalone SSE stream (one at a time, 409 otherwise);
  events pushed while no GET is open wait for the next one. `Last-Event-ID` resumes the stream
  that event belongs to: the standalone stream replays its later events and stays open; a
  request's stream replays its later events (waiting for them if needed) and closes after the
  response. Every session event has an id (a per-session counter); unknown ids get 400.
  DELETE ends the session (its open streams end too).
- Stateless family (2026-07-28): a POST with `MCP-Protocol-Version: 2026-07-28` or
  `_meta["io.modelcontextprotocol/protocolVersion"]` needs no session; `Mcp-Method` / `Mcp-Name`
  headers that disagree with the body get 400 / -32020; results carry `resultType` (lists also
  `ttlMs`, `cacheScope`); -32601 answers 404 and -32602 400. GET and DELETE get 405; `ping` is
  gone (-32601), `server/discover` replaces the handshake. SSE events carry no ids.
- `tools/list`: `TOOLS` (annotations per name; `--tools` adds or replaces entries). Every tool
  takes `mode`, `text`, `delay`, `size`, `notes`, `key`, `sampling` and obeys `mode`:
  `json` (default), `sse`, `close_after_read`, `slow`, `rpc_error`, `huge_event`,
  `drop_resumable`, `forge_meta`, `http_500`, `garbage`, `task`, `raw` (see
  `Upstream.tools_call`).
- `resources/list|read`, `resources/templates/list`, `prompts/list|get` (texts settable through
  `/_texts`), `tasks/get|result|list|cancel`, `logging/setLevel`, `ping`.

Control (JSON, same port, never under `/mcp`): `GET /_log[?since=N]` every message POSTed to
`/mcp` in arrival order (see `MessageLog`); `GET /_sessions`; `POST /_reset` (body
`{"sessions": false}` keeps the sessions); `POST /_texts` `{"resources": {uri: text},
"prompts": {name: text}}`; `POST /_push` `{"message": {...}, "session": id?, "wait": s?}`.

Memory is bounded (log, sessions, stored events, tasks, texts: see the limits below); logs go
to stderr only with `--verbose`.

Run: `python tests/e2e/hostile_upstream.py --port P [--tools JSON] [--verbose]`; in tests,
`with hostile_server() as up:` gives `up.url` and `up.control` (a `HostileControl`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

JSON = dict[str, Any]

MODERN = "2026-07-28"
SESSION_VERSIONS = ("2025-11-25", "2025-06-18")
LATEST_SESSION = SESSION_VERSIONS[0]
META_VERSION = "io.modelcontextprotocol/protocolVersion"
SERVER_INFO = {"name": "hostile-upstream", "version": "1.0"}

# Bounds, so a test that asks for a lot (or forgets to reset) cannot exhaust the machine.
MAX_BODY = 16 * 1024 * 1024
MAX_LOG_ENTRIES = 10_000
MAX_LOG_BYTES = 64 * 1024 * 1024
MAX_SESSIONS = 64
MAX_SESSION_EVENT_BYTES = 16 * 1024 * 1024
MAX_STORED_EVENT = 4 * 1024 * 1024  # a bigger event is sent without an id: not resumable
MAX_TASKS = 256
MAX_TEXTS = 1024
MAX_SIZE = 16 * 1024 * 1024  # huge_event
MAX_DELAY = 300.0
MAX_NOTES = 1000

MODES = ("json", "sse", "close_after_read", "slow", "rpc_error", "huge_event", "drop_resumable",
         "forge_meta", "http_500", "garbage", "task", "raw")

INPUT_SCHEMA: JSON = {
    "type": "object",
    "properties": {
        "mode": {"type": "string", "description": "the behaviour: " + ", ".join(MODES)},
        "text": {"type": "string", "description": "the result text"},
        "delay": {"type": "number", "description": "seconds (slow, task, drop_resumable)"},
        "size": {"type": "integer", "description": "bytes of text (huge_event)"},
        "notes": {"type": "array", "items": {"type": "string"},
                  "description": "one notification each before the result (sse)"},
        "key": {"type": "string", "description": "free, for the caller's bookkeeping"},
        "sampling": {"type": "boolean", "description": "sse: ask the client to sample first"},
    },
}

# Tool name -> annotations (None: no annotations, which MCP reads as a destructive open-world
# writer). The effect is the only difference between tools: all of them obey `mode`.
TOOLS: dict[str, JSON | None] = {
    "read_page": {"readOnlyHint": True, "openWorldHint": True},
    "read_secret": {"readOnlyHint": True, "openWorldHint": False},
    "write_note": {"readOnlyHint": False, "destructiveHint": False},
    "put_note": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": True},
    "delete_all": {"readOnlyHint": False, "destructiveHint": True},
    "bare": None,
}

CAPABILITIES: JSON = {
    "tools": {"listChanged": False},
    "resources": {"listChanged": False, "subscribe": False},
    "prompts": {"listChanged": False},
    "logging": {},
    "tasks": {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}},
}

log = logging.getLogger("hostile_upstream")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def obj(value: Any) -> JSON:
    """`value` if it is a JSON object, else {} (hostile input never crashes a handler)."""
    return value if isinstance(value, dict) else {}


def tool_result(text: str) -> JSON:
    return {"content": [{"type": "text", "text": text}], "structuredContent": {"text": text},
            "isError": False}


def sse_event(data: str, event_id: str | None = None, retry: int | None = None) -> bytes:
    """One SSE event; `data` is one line (JSON escapes newlines)."""
    lines = ["event: message"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if retry is not None:
        lines.append(f"retry: {retry}")
    lines.append(f"data: {data}")
    return ("\n".join(lines) + "\n\n").encode()


class RpcError(Exception):
    """A JSON-RPC error answer for the current request."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


class HttpRefusal(Exception):
    """An HTTP-level refusal (no session, unknown session, header mismatch...)."""

    def __init__(self, status: int, code: int, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


# ---- state ---------------------------------------------------------------------------------


class MessageLog:
    """Every message POSTed to `/mcp`, oldest first, bounded by count and bytes.

    Entry: seq, time, kind (request | notification | response | invalid), method, id, params,
    message (the whole body, parsed), session, era (session | stateless), headers (lowercase
    names), status (HTTP status sent; None when the connection was dropped), answered (a
    JSON-RPC response for this request reached the wire, possibly later on a resumed stream),
    outcome (json | sse | error | accepted | refused | aborted | client_gone | cancelled |
    stored | resumed | task | http_500 | garbage).
    """

    def __init__(self) -> None:
        self.entries: deque[tuple[int, JSON]] = deque()
        self.bytes = 0
        self.seq = itertools.count(1)

    def add(self, entry: JSON, size: int) -> JSON:
        entry["seq"] = next(self.seq)
        self.entries.append((size, entry))
        self.bytes += size
        while len(self.entries) > MAX_LOG_ENTRIES or (self.bytes > MAX_LOG_BYTES and len(self.entries) > 1):
            dropped, _ = self.entries.popleft()
            self.bytes -= dropped
        return entry

    def since(self, seq: int) -> list[JSON]:
        return [e for _, e in self.entries if e["seq"] > seq]

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


@dataclass
class Event:
    seq: int
    stream: str  # "get" (the standalone stream) or "req-<log seq>"
    data: str  # "" for a priming event
    final: bool  # the response that ends a request's stream
    entry: JSON | None  # the log entry it answers (final events)
    delivered: bool = False


@dataclass
class Session:
    id: str
    version: str
    events: deque[Event] = field(default_factory=deque)
    event_bytes: int = 0
    last_seq: int = 0  # the newest event id handed out (evicted events keep theirs)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    alive: bool = True
    get_streams: int = 0
    running: dict[str, asyncio.Event] = field(default_factory=dict)  # request id -> cancelled

    def store(self, stream: str, data: str, final: bool = False, entry: JSON | None = None) -> Event | None:
        """Append an event (None when too big to keep: it is then sent without an id)."""
        if len(data) > MAX_STORED_EVENT:
            return None
        self.last_seq += 1
        event = Event(self.last_seq, stream, data, final, entry)
        self.events.append(event)
        self.event_bytes += len(data)
        while self.event_bytes > MAX_SESSION_EVENT_BYTES and len(self.events) > 1:
            self.event_bytes -= len(self.events.popleft().data)
        self.wake()
        return event

    def wake(self) -> None:
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    def find(self, event_id: str) -> Event | None:
        return next((e for e in self.events if str(e.seq) == event_id), None)

    def end(self) -> None:
        self.alive = False
        for cancelled in self.running.values():
            cancelled.set()
        self.wake()


@dataclass
class Task:
    id: str
    text: str
    session: Session | None
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)
    status: str = "working"
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None

    def wire(self) -> JSON:
        return {"taskId": self.id, "status": self.status, "createdAt": self.created,
                "lastUpdatedAt": self.updated, "ttl": 60000, "pollInterval": 100,
                "statusMessage": self.text}

    def finish(self, status: str) -> None:
        self.status, self.updated = status, now_iso()
        self.done.set()


@dataclass(frozen=True)
class Args:
    """A tool call's arguments, checked (a bad one is a -32602 error, not a crash)."""

    mode: str
    text: str
    delay: float
    size: int
    notes: tuple[str, ...]
    sampling: bool

    @classmethod
    def parse(cls, name: str, raw: Any) -> Args:
        if not isinstance(raw, dict):
            raise RpcError(-32602, "arguments must be an object")
        mode = raw.get("mode", "json")
        if mode not in MODES:
            raise RpcError(-32602, f"unknown mode {mode!r}")
        text = raw.get("text", f"{name} ok")
        delay = raw.get("delay", 0)
        size = raw.get("size", 1024 * 1024)
        notes = raw.get("notes", [])
        if not isinstance(text, str):
            raise RpcError(-32602, "text must be a string")
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= MAX_DELAY:
            raise RpcError(-32602, f"delay must be a number in [0, {MAX_DELAY}]")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE:
            raise RpcError(-32602, f"size must be an integer in [0, {MAX_SIZE}]")
        if (not isinstance(notes, list) or len(notes) > MAX_NOTES
                or not all(isinstance(n, str) for n in notes)):
            raise RpcError(-32602, f"notes must be at most {MAX_NOTES} strings")
        return cls(mode, text, float(delay), size, tuple(notes), raw.get("sampling") is True)


@dataclass
class Call:
    """One JSON-RPC request being answered."""

    request: web.Request
    entry: JSON
    id: Any
    method: str
    params: JSON
    modern: bool
    session: Session | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Mcp-Session-Id": self.session.id} if self.session else {}

    def result(self, result: JSON, listing: bool = False) -> JSON:
        if self.modern:
            result = {**result, "resultType": result.get("resultType", "complete")}
            if listing:
                result = {"ttlMs": 0, "cacheScope": "private", **result}
        return {"jsonrpc": "2.0", "id": self.id, "result": result}


# ---- the server ----------------------------------------------------------------------------


class Upstream:
    """The server's state and handlers (one per process). Serve `app()` with aiohttp's
    `handler_cancellation=True` (as `main` does), so that a client going away cancels its
    request (recorded as `client_gone`)."""

    def __init__(self, tools: dict[str, JSON | None]):
        self.tools = tools
        self.log = MessageLog()
        self.sessions: dict[str, Session] = {}
        self.tasks: dict[str, Task] = {}
        self.resource_texts: dict[str, str] = {}
        self.prompt_texts: dict[str, str] = {}
        self.server_requests = itertools.count(1)
        self.background: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/mcp", self.post_mcp)
        app.router.add_get("/mcp", self.get_mcp)
        app.router.add_delete("/mcp", self.delete_mcp)
        app.router.add_get("/_log", self.control_log)
        app.router.add_get("/_sessions", self.control_sessions)
        app.router.add_post("/_reset", self.control_reset)
        app.router.add_post("/_texts", self.control_texts)
        app.router.add_post("/_push", self.control_push)
        app.on_shutdown.append(self.shutdown)
        return app

    async def shutdown(self, _app: web.Application) -> None:
        # Open GET streams would otherwise hold the shutdown for its whole timeout.
        for session in self.sessions.values():
            session.end()
        for task in list(self.background):
            task.cancel()

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    # ---- POST /mcp ----

    async def post_mcp(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k.lower(): ", ".join(request.headers.getall(k)) for k in request.headers}
        entry: JSON = {"time": time.time(), "kind": "invalid", "method": None, "id": None,
                       "params": None, "message": None, "session": headers.get("mcp-session-id"),
                       "era": "session", "headers": headers, "status": None, "answered": False,
                       "outcome": None}
        try:
            message = json.loads(raw)
        except ValueError:
            self.log.add(entry, len(raw))
            return self.refuse(entry, HttpRefusal(400, -32700, "Parse error"), None)
        entry["message"] = message
        if not isinstance(message, dict):
            self.log.add(entry, len(raw))
            return self.refuse(entry, HttpRefusal(400, -32602, "one JSON-RPC message per POST"), None)
        method, params = message.get("method"), message.get("params")
        entry.update(method=method, id=message.get("id"), params=params)
        entry["kind"] = ("response" if not isinstance(method, str) else
                         "request" if "id" in message else "notification")
        params = obj(params)
        meta = obj(params.get("_meta"))
        modern = headers.get("mcp-protocol-version") == MODERN or meta.get(META_VERSION) == MODERN
        entry["era"] = "stateless" if modern else "session"
        self.log.add(entry, len(raw) + sum(len(k) + len(v) for k, v in headers.items()))
        log.debug("POST %s %s id=%s", entry["era"], method, entry["id"])
        try:
            if modern:
                self.check_modern(headers, message)
            session = None if modern else self.check_session(headers, method)
        except HttpRefusal as refusal:
            return self.refuse(entry, refusal, message.get("id"))
        if entry["kind"] != "request":
            if entry["kind"] == "notification" and method == "notifications/cancelled" and session:
                cancelled = session.running.get(json.dumps(params.get("requestId")))
                if cancelled is not None:
                    cancelled.set()
            entry.update(status=202, outcome="accepted")
            return web.Response(status=202, headers={"Mcp-Session-Id": session.id} if session else None)
        call = Call(request, entry, message["id"], str(method), params, modern, session)
        key = json.dumps(call.id)
        cancelled = asyncio.Event()
        if session is not None:
            session.running[key] = cancelled
        try:
            return await self.dispatch(call, cancelled)
        except RpcError as err:
            return await self.send_json(call, {"jsonrpc": "2.0", "id": call.id, "error": {
                "code": err.code, "message": err.message,
                **({"data": err.data} if err.data is not None else {})}}, outcome="error")
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client goes away (handler_cancellation).
            if not entry["answered"] and entry["outcome"] not in ("aborted", "cancelled", "stored"):
                entry["outcome"] = "client_gone"
            raise
        finally:
            if session is not None and session.running.get(key) is cancelled:
                del session.running[key]

    def check_modern(self, headers: dict[str, str], message: JSON) -> None:
        """A stateless request's routing headers agree with its body (else 400 / -32020)."""
        method = headers.get("mcp-method")
        if method is not None and method != message.get("method"):
            raise HttpRefusal(400, -32020, "Mcp-Method header does not match the body's method")
        name = headers.get("mcp-name")
        params = obj(message.get("params"))
        body_name = params.get("uri") if message.get("method") == "resources/read" else params.get("name")
        if name is not None and name != body_name:
            raise HttpRefusal(400, -32020, "Mcp-Name header does not match the body")

    def check_session(self, headers: dict[str, str], method: Any) -> Session | None:
        """The request's session (None for initialize), else 400 / 404."""
        if method == "initialize":
            return None
        version = headers.get("mcp-protocol-version")
        if version is not None and version not in SESSION_VERSIONS:
            raise HttpRefusal(400, -32600, f"Unsupported protocol version: {version}")
        sid = headers.get("mcp-session-id")
        if not sid:
            raise HttpRefusal(400, -32600, "Bad Request: Missing session ID")
        session = self.sessions.get(sid)
        if session is None or not session.alive:
            raise HttpRefusal(404, -32001, "Session not found")
        return session

    def refuse(self, entry: JSON, refusal: HttpRefusal, rpc_id: Any) -> web.Response:
        entry.update(status=refusal.status, outcome="refused")
        body = {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": refusal.code, "message": refusal.message}}
        return web.json_response(body, status=refusal.status)

    async def send_json(self, call: Call, body: JSON, outcome: str = "json") -> web.StreamResponse:
        """Answer with one JSON body, written here so the log knows it reached the wire."""
        status = 200
        if call.modern and "error" in body:
            status = {-32601: 404, -32602: 400, -32020: 400}.get(body["error"]["code"], 200)
        call.entry["outcome"] = outcome
        resp = web.Response(status=status, body=json.dumps(body).encode(),
                            content_type="application/json", headers=call.headers)
        await resp.prepare(call.request)
        await resp.write_eof()
        call.entry.update(status=status, answered=True)
        return resp

    async def dispatch(self, call: Call, cancelled: asyncio.Event) -> web.StreamResponse:
        p = call.params
        match call.method:
            case "initialize":
                return await self.initialize(call)
            case "server/discover":
                # A DiscoverResult is a 2026-07-28 shape whichever header asked for it.
                return await self.send_json(call, {"jsonrpc": "2.0", "id": call.id, "result": {
                    "supportedVersions": [*reversed(SESSION_VERSIONS), MODERN],
                    "capabilities": CAPABILITIES, "instructions": "A hostile test upstream.",
                    "resultType": "complete", "ttlMs": 0, "cacheScope": "private",
                    "_meta": {"io.modelcontextprotocol/serverInfo": SERVER_INFO}}})
            case "ping" if not call.modern:
                return await self.send_json(call, call.result({}))
            case "logging/setLevel":
                return await self.send_json(call, call.result({}))
            case "tools/list":
                return await self.send_json(call, call.result({"tools": self.tool_list()}, listing=True))
            case "tools/call":
                return await self.tools_call(call, cancelled)
            case "resources/list":
                uris = dict.fromkeys(["hostile://page", "hostile://secret", *self.resource_texts])
                return await self.send_json(call, call.result({"resources": [
                    {"uri": uri, "name": uri.rpartition("/")[2] or uri, "mimeType": "text/plain"}
                    for uri in uris]}, listing=True))
            case "resources/templates/list":
                return await self.send_json(call, call.result({"resourceTemplates": []}, listing=True))
            case "resources/read":
                uri = p.get("uri")
                if not isinstance(uri, str):
                    raise RpcError(-32602, "uri must be a string")
                text = self.resource_texts.get(uri, f"resource {uri}")
                return await self.send_json(call, call.result(
                    {"contents": [{"uri": uri, "mimeType": "text/plain", "text": text}]}))
            case "prompts/list":
                names = dict.fromkeys(["summarize", *self.prompt_texts])
                return await self.send_json(call, call.result({"prompts": [
                    {"name": n, "description": f"prompt {n}", "arguments": []} for n in names]},
                    listing=True))
            case "prompts/get":
                name = p.get("name")
                if not isinstance(name, str):
                    raise RpcError(-32602, "name must be a string")
                text = self.prompt_texts.get(name, f"prompt {name}")
                return await self.send_json(call, call.result({"description": f"prompt {name}", "messages": [
                    {"role": "user", "content": {"type": "text", "text": text}}]}))
            case "tasks/get" | "tasks/result" | "tasks/cancel":
                return await self.task_request(call)
            case "tasks/list":
                return await self.send_json(call, call.result(
                    {"tasks": [t.wire() for t in self.tasks.values()]}, listing=True))
        raise RpcError(-32601, "Method not found", call.method)

    async def initialize(self, call: Call) -> web.StreamResponse:
        asked = call.params.get("protocolVersion")
        version = asked if asked in SESSION_VERSIONS else LATEST_SESSION
        while len(self.sessions) >= MAX_SESSIONS:
            self.sessions.pop(next(iter(self.sessions))).end()
        session = Session(uuid.uuid4().hex, version)
        self.sessions[session.id] = session
        call.session = session
        call.entry["session"] = session.id
        return await self.send_json(call, call.result({
            "protocolVersion": version, "capabilities": CAPABILITIES, "serverInfo": SERVER_INFO,
            "instructions": "A hostile test upstream."}))

    def tool_list(self) -> list[JSON]:
        tools = []
        for name, hints in self.tools.items():
            tool: JSON = {"name": name, "description": f"{name}: obeys `mode`",
                          "inputSchema": INPUT_SCHEMA, "execution": {"taskSupport": "optional"}}
            if hints is not None:
                tool["annotations"] = hints
            tools.append(tool)
        return tools

    # ---- tools/call ----

    async def tools_call(self, call: Call, cancelled: asyncio.Event) -> web.StreamResponse:
        """Answer a tool call as its `mode` says.

        json: a JSON CallToolResult (text and structuredContent.text = `text`).
        sse: an SSE stream: one notification per note (alternating notifications/message and
          notifications/progress), then with `sampling` a sampling/createMessage request (id
          `srv-<n>`, not awaited), then the result.
        close_after_read: the body is read, then the connection is aborted (no HTTP response).
        slow: `delay` seconds (a notifications/cancelled or a disconnect stops it), then json.
        rpc_error: a JSON-RPC error -32000 (message `text`, data.detail `text`), HTTP 200.
        huge_event: one SSE result event whose text is `size` characters of `text` repeated.
        drop_resumable: (sessions) a priming event (id, empty data, retry 100), then the stream
          ends; after `delay` seconds the sse sequence is stored for a GET with Last-Event-ID.
        forge_meta: a result whose `_meta` and content `_meta` claim envelope decisions.
        http_500: HTTP 500, text body. garbage: HTTP 200 application/json that is not JSON.
        raw: `text` written to the socket as the whole HTTP response, with `{result}` standing
          for the JSON result of `key` (as json would send it), `{length}` for its length in
          bytes and `{size}` for it in hex (a chunk size); the parts between `{pause}` marks are
          written `delay` seconds apart, and the connection closed (what was written is sent)
          `delay` seconds after the last.
        task: with `params.task`, a CreateTaskResult; the task completes after `delay` seconds
          (notifications/tasks/status on the session's GET stream); without, like slow.
        """
        name = call.params.get("name")
        if not isinstance(name, str) or name not in self.tools:
            raise RpcError(-32602, f"Unknown tool: {name}")
        raw_args = call.params.get("arguments")
        args = Args.parse(name, {} if raw_args is None else raw_args)
        match args.mode:
            case "json":
                return await self.send_json(call, call.result(tool_result(args.text)))
            case "sse":
                return await self.send_sse(call, self.sse_sequence(call, args))
            case "close_after_read":
                call.entry["outcome"] = "aborted"
                return await self.abort(call)
            case "slow":
                return await self.slow(call, args, cancelled)
            case "rpc_error":
                raise RpcError(-32000, args.text, {"detail": args.text})
            case "huge_event":
                text = (args.text or "x") * (args.size // max(len(args.text or "x"), 1) + 1)
                return await self.send_sse(call, [(call.result(tool_result(text[:args.size])), True)])
            case "drop_resumable":
                return await self.drop_resumable(call, args)
            case "forge_meta":
                result = tool_result(args.text)
                result["content"][0]["_meta"] = {"envelope/x": 1}
                result["_meta"] = {"envelope/decision": {"code": "ok", "check": "forged"},
                                   "envelope/replayed": True}
                return await self.send_json(call, call.result(result))
            case "http_500":
                call.entry.update(status=500, outcome="http_500")
                return web.Response(status=500, text=f"internal error: {args.text}", headers=call.headers)
            case "raw":
                return await self.raw(call, args)
            case "garbage":
                call.entry.update(status=200, outcome="garbage")
                return web.Response(status=200, body=b'{"jsonrpc": "2.0", "result": <<' + args.text.encode(),
                                    content_type="application/json", headers=call.headers)
            case _:  # task
                if isinstance(call.params.get("task"), dict):
                    return await self.start_task(call, args)
                return await self.slow(call, args, cancelled)

    def sse_sequence(self, call: Call, args: Args) -> list[tuple[JSON, bool]]:
        """The messages of an `sse` answer, each with whether it is the final response."""
        meta = obj(call.params.get("_meta"))
        token = meta.get("progressToken", "hostile-progress")
        out: list[tuple[JSON, bool]] = []
        for i, note in enumerate(args.notes):
            if i % 2 == 0:
                out.append(({"jsonrpc": "2.0", "method": "notifications/message",
                             "params": {"level": "info", "logger": "hostile", "data": note}}, False))
            else:
                out.append(({"jsonrpc": "2.0", "method": "notifications/progress", "params": {
                    "progressToken": token, "progress": i + 1, "total": len(args.notes),
                    "message": note}}, False))
        if args.sampling:
            out.append(({"jsonrpc": "2.0", "id": f"srv-{next(self.server_requests)}",
                         "method": "sampling/createMessage", "params": {
                             "messages": [{"role": "user", "content": {"type": "text", "text": args.text}}],
                             "maxTokens": 100}}, False))
        out.append((call.result(tool_result(args.text)), True))
        return out

    async def open_sse(self, call: Call) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache, no-transform",
            "X-Accel-Buffering": "no", **call.headers})
        await resp.prepare(call.request)
        call.entry["status"] = 200
        return resp

    async def send_sse(self, call: Call, messages: list[tuple[JSON, bool]]) -> web.StreamResponse:
        """Send messages as one SSE stream; in a session each event is stored under an id."""
        call.entry["outcome"] = "sse"
        resp = await self.open_sse(call)
        for message, final in messages:
            data = json.dumps(message)
            event = (call.session.store(f"req-{call.entry['seq']}", data, final, call.entry if final else None)
                     if call.session else None)
            if event is not None:
                event.delivered = True
            await resp.write(sse_event(data, str(event.seq) if event else None))
            if final:
                call.entry["answered"] = True
        await resp.write_eof()
        return resp

    async def abort(self, call: Call) -> web.StreamResponse:
        """Drop the connection: no status line, no body."""
        transport = call.request.transport
        if transport is not None:
            transport.abort()
        # With handler_cancellation (as `main` runs it) the lost connection cancels this
        # handler here; without it, aiohttp's error path finds the transport closed.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        raise ConnectionResetError("connection aborted on request")

    async def raw(self, call: Call, args: Args) -> web.StreamResponse:
        """Write `args.text` as the response, framing and all, then close the connection."""
        key = obj(call.params.get("arguments")).get("key")
        result = json.dumps(call.result(tool_result(key if isinstance(key, str) else "raw ok"))).encode()
        data = args.text.encode("latin-1").replace(b"{length}", b"%d" % len(result)).replace(
            b"{size}", b"%x" % len(result))
        call.entry["outcome"] = "raw"
        transport = call.request.transport
        if transport is not None:
            for part in data.replace(b"{result}", result).split(b"{pause}"):
                transport.write(part)
                await asyncio.sleep(args.delay)
            transport.close()
        await asyncio.sleep(0)
        raise ConnectionResetError("connection closed after a raw response")

    async def slow(self, call: Call, args: Args, cancelled: asyncio.Event) -> web.StreamResponse:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cancelled.wait(), args.delay)
        if cancelled.is_set():
            # A cancelled request gets no response; over HTTP that means no body at all.
            call.entry["outcome"] = "cancelled"
            return await self.abort(call)
        return await self.send_json(call, call.result(tool_result(args.text)))

    async def drop_resumable(self, call: Call, args: Args) -> web.StreamResponse:
        session = call.session
        if session is None:
            raise RpcError(-32602, "drop_resumable needs a session (2025-06-18 or 2025-11-25)")
        stream = f"req-{call.entry['seq']}"
        priming = session.store(stream, "")
        assert priming is not None
        priming.delivered = True
        resp = await self.open_sse(call)
        await resp.write(sse_event("", str(priming.seq), retry=100))
        await resp.write_eof()
        call.entry["outcome"] = "stored"
        messages = self.sse_sequence(call, args)

        async def store_later() -> None:
            await asyncio.sleep(args.delay)
            for message, final in messages:
                session.store(stream, json.dumps(message), final, call.entry if final else None)

        self.spawn(store_later())
        return resp

    # ---- tasks ----

    async def start_task(self, call: Call, args: Args) -> web.StreamResponse:
        while len(self.tasks) >= MAX_TASKS:
            self.drop_task(self.tasks.pop(next(iter(self.tasks))))
        task = Task(f"task-{uuid.uuid4().hex[:12]}", args.text, call.session)
        self.tasks[task.id] = task

        async def complete() -> None:
            await asyncio.sleep(args.delay)
            if task.status != "working":
                return
            task.finish("completed")
            if task.session is not None and task.session.alive:
                task.session.store("get", json.dumps({"jsonrpc": "2.0", "method": "notifications/tasks/status",
                                                      "params": task.wire()}))

        task.runner = self.spawn(complete())
        call.entry["outcome"] = "task"
        body = call.result({"task": task.wire()})
        return await self.send_json(call, body, outcome="task")

    @staticmethod
    def drop_task(task: Task) -> None:
        """Forget a task; a tasks/result waiting for it gets its cancellation."""
        if task.runner is not None:
            task.runner.cancel()
        if task.status == "working":
            task.finish("cancelled")

    async def task_request(self, call: Call) -> web.StreamResponse:
        task = self.tasks.get(str(call.params.get("taskId")))
        if task is None:
            raise RpcError(-32602, f"Unknown task: {call.params.get('taskId')}")
        if call.method == "tasks/get":
            return await self.send_json(call, call.result(task.wire()))
        if call.method == "tasks/cancel":
            if task.status != "working":
                raise RpcError(-32602, f"Task {task.id} is already {task.status}")
            task.finish("cancelled")
            return await self.send_json(call, call.result(task.wire()))
        # tasks/result blocks until the task ends, as the 2025-11-25 spec says.
        await task.done.wait()
        if task.status != "completed":
            raise RpcError(-32602, f"Task {task.id} was {task.status}")
        result = tool_result(task.text)
        result["_meta"] = {"io.modelcontextprotocol/related-task": {"taskId": task.id}}
        return await self.send_json(call, call.result(result))

    # ---- GET / DELETE /mcp ----

    def session_for(self, request: web.Request) -> Session:
        if request.headers.get("MCP-Protocol-Version") == MODERN and "Mcp-Session-Id" not in request.headers:
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        sid = request.headers.get("Mcp-Session-Id")
        if not sid:
            raise web.HTTPBadRequest(text="Bad Request: Missing session ID")
        session = self.sessions.get(sid)
        if session is None or not session.alive:
            raise web.HTTPNotFound(text="Session not found")
        return session

    async def get_mcp(self, request: web.Request) -> web.StreamResponse:
        """A session's standalone stream, or the resumption of any of its streams."""
        session = self.session_for(request)
        last = request.headers.get("Last-Event-ID")
        if last is not None:
            resumed = session.find(last)
            if resumed is None:
                raise web.HTTPBadRequest(text=f"unknown Last-Event-ID {last!r}")
            stream, cursor = resumed.stream, resumed.seq
        else:
            if session.get_streams:
                raise web.HTTPConflict(text="Conflict: Only one SSE stream is allowed per session")
            stream = "get"
            # Events pushed while no GET was open wait for this one.
            waiting = [e.seq for e in session.events if e.stream == "get" and not e.delivered]
            cursor = waiting[0] - 1 if waiting else session.last_seq
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache, no-transform",
            "X-Accel-Buffering": "no", "Mcp-Session-Id": session.id})
        await resp.prepare(request)
        if stream == "get":
            session.get_streams += 1
            session.wake()
        log.debug("GET %s stream=%s after=%s", session.id, stream, cursor)
        try:
            # Resuming after a request stream's response: nothing more will come on it.
            finished = stream != "get" and any(
                e.final for e in session.events if e.stream == stream and e.seq <= cursor)
            while session.alive and not finished:
                changed = session.changed
                for event in [e for e in session.events if e.seq > cursor and e.stream == stream]:
                    cursor = event.seq
                    if not event.data:
                        continue
                    await resp.write(sse_event(event.data, str(event.seq)))
                    event.delivered = True
                    if event.final and event.entry is not None:
                        event.entry.update(answered=True, outcome="resumed")
                    finished = finished or (event.final and stream != "get")
                if not finished:
                    await changed.wait()
        finally:
            if stream == "get":
                session.get_streams -= 1
        await resp.write_eof()
        return resp

    async def delete_mcp(self, request: web.Request) -> web.Response:
        session = self.session_for(request)
        session.end()
        self.sessions.pop(session.id, None)
        return web.Response(status=200)

    # ---- control ----

    async def control_log(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError as exc:
            raise web.HTTPBadRequest(text="since must be an integer") from exc
        return web.json_response(self.log.since(since))

    async def control_sessions(self, _request: web.Request) -> web.Response:
        return web.json_response([{"id": s.id, "version": s.version, "alive": s.alive,
                                   "get_streams": s.get_streams, "events": len(s.events)}
                                  for s in self.sessions.values()])

    async def control_reset(self, request: web.Request) -> web.Response:
        body = await self.control_body(request, allow_empty=True)
        self.log.clear()
        for task in self.tasks.values():
            self.drop_task(task)
        self.tasks.clear()
        self.resource_texts.clear()
        self.prompt_texts.clear()
        if body.get("sessions", True):
            for session in self.sessions.values():
                session.end()
            self.sessions.clear()
            for background in list(self.background):
                background.cancel()
        return web.json_response({"ok": True})

    async def control_texts(self, request: web.Request) -> web.Response:
        body = await self.control_body(request)
        for key, target in (("resources", self.resource_texts), ("prompts", self.prompt_texts)):
            texts = body.get(key, {})
            if not isinstance(texts, dict) or not all(isinstance(v, str) for v in texts.values()):
                raise web.HTTPBadRequest(text=f"{key} must map names to strings")
            if len(target.keys() | texts.keys()) > MAX_TEXTS:
                raise web.HTTPBadRequest(text=f"at most {MAX_TEXTS} {key}")
            target.update(texts)
        return web.json_response({"resources": len(self.resource_texts), "prompts": len(self.prompt_texts)})

    async def control_push(self, request: web.Request) -> web.Response:
        """Put a message on a session's GET stream (the named one, else the newest live one),
        waiting up to `wait` seconds for that stream to be open."""
        body = await self.control_body(request)
        message = body.get("message")
        if not isinstance(message, dict):
            raise web.HTTPBadRequest(text="message must be a JSON object")
        sid = body.get("session")
        live = [s for s in self.sessions.values() if s.alive]
        session = self.sessions.get(sid) if isinstance(sid, str) else (live[-1] if live else None)
        if session is None or not session.alive:
            raise web.HTTPNotFound(text="no such live session")
        wait = body.get("wait", 0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_DELAY:
            raise web.HTTPBadRequest(text=f"wait must be a number in [0, {MAX_DELAY}]")
        deadline = time.monotonic() + wait
        while not session.get_streams and session.alive and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(session.changed.wait(), max(deadline - time.monotonic(), 0))
        event = session.store("get", json.dumps(message))
        if event is None:
            raise web.HTTPRequestEntityTooLarge(MAX_STORED_EVENT, len(json.dumps(message)))
        return web.json_response({"session": session.id, "event_id": str(event.seq),
                                  "listeners": session.get_streams})

    @staticmethod
    async def control_body(request: web.Request, allow_empty: bool = False) -> JSON:
        raw = await request.read()
        if not raw.strip() and allow_empty:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise web.HTTPBadRequest(text="body must be JSON") from exc
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="body must be a JSON object")
        return body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tools", default="{}",
                        help='JSON {name: annotations or null}, added to (or replacing) TOOLS')
    parser.add_argument("--verbose", action="store_true", help="log to stderr")
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(stream=sys.stderr, level=logging.DEBUG,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    else:
        # Also keeps aiohttp's "Error handling request" lines (after an abort) off stderr.
        logging.getLogger().addHandler(logging.NullHandler())
    extra = json.loads(args.tools)
    if not isinstance(extra, dict) or not all(v is None or isinstance(v, dict) for v in extra.values()):
        parser.error("--tools must be a JSON object of name -> annotations object or null")
    upstream = Upstream({**TOOLS, **extra})
    web.run_app(upstream.app(), host=args.host, port=args.port, print=None,
                access_log=log if args.verbose else None, handler_cancellation=True,
                shutdown_timeout=1.0)


# ---- for the tests -------------------------------------------------------------------------


class HostileControl:
    """A client for the control endpoints (blocking: in a coroutine whose loop must keep
    running meanwhile, e.g. `push(wait=...)` for a stream this loop opens, wrap the call in
    `asyncio.to_thread`)."""

    def __init__(self, base: str):
        import httpx

        self.http = httpx.Client(base_url=base, timeout=30)

    def log(self, since: int = 0) -> list[JSON]:
        """Every message POSTed to /mcp after log entry `since` (see `MessageLog`)."""
        response = self.http.get("/_log", params={"since": since})
        response.raise_for_status()
        entries: list[JSON] = response.json()
        return entries

    def calls(self, tool: str | None = None) -> list[JSON]:
        """The `tools/call` requests that reached the upstream (of `tool` only, if given)."""
        return [e for e in self.log() if e["method"] == "tools/call"
                and (tool is None or (e["params"] or {}).get("name") == tool)]

    def wait(self, predicate: Callable[[list[JSON]], bool], timeout: float = 5.0) -> list[JSON]:
        """Poll the log until `predicate(log)` holds; the log, or AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            entries = self.log()
            if predicate(entries):
                return entries
            if time.monotonic() > deadline:
                raise AssertionError(f"log condition not met after {timeout}s: {entries!r}")
            time.sleep(0.05)

    def sessions(self) -> list[JSON]:
        response = self.http.get("/_sessions")
        response.raise_for_status()
        sessions: list[JSON] = response.json()
        return sessions

    def reset(self, sessions: bool = True) -> None:
        """Clear the log, tasks, texts and (unless `sessions` is False) the sessions."""
        self.http.post("/_reset", json={"sessions": sessions}).raise_for_status()

    def texts(self, resources: dict[str, str] | None = None, prompts: dict[str, str] | None = None) -> None:
        self.http.post("/_texts", json={"resources": resources or {}, "prompts": prompts or {}}).raise_for_status()

    def push(self, message: JSON, session: str | None = None, wait: float = 0.0) -> JSON:
        """Put `message` on a session's GET stream; returns session, event_id, listeners."""
        body: JSON = {"message": message, "wait": wait}
        if session is not None:
            body["session"] = session
        response = self.http.post("/_push", json=body, timeout=wait + 30)
        response.raise_for_status()
        answer: JSON = response.json()
        return answer

    def close(self) -> None:
        self.http.close()


@dataclass
class HostileUpstream:
    url: str
    port: int
    control: HostileControl
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def hostile_server(tools: dict[str, JSON | None] | None = None,
                   verbose: bool = False) -> Iterator[HostileUpstream]:
    """Run this file as a server process on a free loopback port; yields its `/mcp` URL and a
    control client. `tools` adds to (or replaces entries of) `TOOLS`; `verbose` lets its log
    through to this process's stderr."""
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tests.harness import free_port, stop, wait_port

    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--port", str(port),
           "--tools", json.dumps(tools or {}), *(["--verbose"] if verbose else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=None if verbose else subprocess.DEVNULL, cwd=root)
    control: HostileControl | None = None
    try:
        wait_port(port, proc)
        control = HostileControl(f"http://127.0.0.1:{port}")
        yield HostileUpstream(f"http://127.0.0.1:{port}/mcp", port, control, proc)
    finally:
        if control is not None:
            control.close()
        stop(proc)


if __name__ == "__main__":
    main()
