"""The stdio front's bridge: an MCP client's stdin and stdout relayed to `/mcp/<upstream>`.

An MCP client that launches its servers as commands starts `envelope-proxy stdio`; the command
runs the proxy's own MCP listener on loopback for this process alone, and this module carries
the client's newline-delimited JSON-RPC to it as one legacy (session) client would over HTTP:

- `initialize` is POSTed first and alone; the `Mcp-Session-Id` and protocol version it returns
  go on every later request, so the per-upstream route sees one ordinary session and decides
  everything (tools/list filtering, the envelope, audit, in-band approval).
- Requests are POSTed concurrently (a held call never blocks a `ping` or the client's answer to
  an elicitation); notifications and the client's responses to server requests are POSTed in
  the order they arrive. Every message of a reply (a JSON body, or each SSE event: progress,
  server requests, the response) is written to stdout as one line.
- After `notifications/initialized` a GET stream carries unsolicited server messages (given up
  quietly when the route answers 405).
- A stateless client (2026-07-28: `server/discover`, no `initialize`) never gets a session: its
  requests, which carry their revision in `_meta`, are POSTed as they are and the route treats
  them as stateless (in-band approval is then an `input_required` result the client retries).
- End of stdin ends the session (DELETE) and returns, once the requests in flight are answered
  (at most `drain_seconds`; SIGTERM / SIGINT cut it short: calls cut off are refused and
  audited by the route like any client disconnect).

Nothing but protocol reaches stdout: every line written is a JSON object (or array) parsed and
re-serialised here, so a stray byte from anywhere else cannot corrupt the client's stream (the
command also points file descriptor 1 at stderr, see `proxy.cli.stdio`). A request the route
could not answer (connection lost, a non-JSON error page, a stream cut before its response)
gets a JSON-RPC error with its id, so the client never waits forever.

The listener accepts only requests carrying `BRIDGE_HEADER` with this process's random secret
(`credential_middleware`): on a shared machine, another local user cannot use the loopback
port to call tools as this process's principal.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import UpstreamError
from proxy.fronts import jsonrpc
from proxy.fronts.sse import SSEParser

log = logging.getLogger("envelope.stdio")

__all__ = ["BRIDGE_HEADER", "StdioBridge", "credential_middleware"]

BRIDGE_HEADER = "X-Envelope-Bridge"
SESSION_HEADER = "Mcp-Session-Id"
ACCEPT = "application/json, text/event-stream"
# Seconds the DELETE that ends the session may take at the end.
CLOSE_TIMEOUT = 5.0
# Reconnection of the standalone GET stream: attempts in a row, and the longest pause.
LISTEN_ATTEMPTS = 5
LISTEN_MAX_BACKOFF = 5.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def credential_middleware(secret: str) -> Any:
    """An aiohttp middleware refusing (403) every request without `BRIDGE_HEADER: secret`;
    the header is removed before the route sees the request, so it never reaches an upstream."""
    expected = secret.encode()

    @web.middleware
    async def require_bridge(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get(BRIDGE_HEADER, "").encode()
        if not hmac.compare_digest(given, expected):
            return web.Response(status=403, body=jsonrpc.error_body(
                None, jsonrpc.INVALID_REQUEST, "Forbidden: this listener serves its stdio bridge only"),
                content_type="application/json")
        headers = CIMultiDict(request.headers)
        del headers[BRIDGE_HEADER]
        return await handler(request.clone(headers=headers))

    return require_bridge


class _Lines:
    """stdin as an async queue of lines, read by a daemon thread (pipes, files and terminals
    alike; a blocked read never holds up the process's exit). A line longer than `max_bytes`
    is skipped to its end and reported as `TOO_LONG`; None is end of input."""

    TOO_LONG = b""

    def __init__(self, stream: BinaryIO, max_bytes: int):
        self._stream = stream
        self._max = max_bytes
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="envelope-stdin", daemon=True).start()

    def _put(self, item: bytes | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already closed: nobody is listening
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _read(self) -> None:
        try:
            while True:
                line = self._stream.readline(self._max + 1)
                if not line:
                    break
                if len(line) > self._max and not line.endswith(b"\n"):
                    while line and not line.endswith(b"\n"):  # drop the rest of the line
                        line = self._stream.readline(65536)
                    self._put(self.TOO_LONG)
                    continue
                if line.strip():
                    self._put(line)
        except (OSError, ValueError) as exc:
            log.warning("stdin closed: %s", exc)
        finally:
            self._put(None)

    async def get(self) -> bytes | None:
        return await self._queue.get()


def _error(msg_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}


def _id_key(value: Any) -> str:
    """A JSON-RPC id as a set member that tells 1 from "1"."""
    return orjson.dumps(value).decode()


def _answers(message: Any, msg_id: Any) -> bool:
    return (isinstance(message, dict) and message.get("id") == msg_id
            and ("result" in message or "error" in message))


class StdioBridge:
    """One stdio client relayed to `url` (the proxy's `/mcp/<upstream>` on loopback)."""

    def __init__(self, url: str, secret: str, stdin: BinaryIO, stdout: BinaryIO,
                 max_message_bytes: int, max_event_bytes: int, drain_seconds: float = 10.0):
        self._url = url
        self._secret = secret
        self._stdin = stdin
        self._stdout = stdout
        self._max_message = max_message_bytes
        self._max_event = max_event_bytes
        self._drain_seconds = drain_seconds
        self._session: str | None = None
        self._version: str | None = None
        self._write_lock = asyncio.Lock()
        self._stdout_lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._stopped = asyncio.Event()
        # The client's `initialize` (body, id) and `notifications/initialized`, sent again when
        # the session has to be renewed.
        self._init: tuple[bytes, Any] | None = None
        self._initialized: bytes | None = None
        self._renew_lock = asyncio.Lock()
        # Requests in flight, and those of them the client cancelled (`_id_key`).
        self._in_flight: set[str] = set()
        self._cancelled: set[str] = set()

    def stop(self) -> None:
        """End the session as if stdin had closed (SIGTERM / SIGINT)."""
        self._stopped.set()

    async def run(self) -> None:
        """Relay until stdin ends (or `stop`), then end the session. Never raises for what the
        client or the route send: each failure is answered on stdout or logged."""
        # No total or read timeout: a call held for approval, or a GET stream, may stay open
        # for minutes; the route bounds every upstream exchange itself.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        self._http = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=True)
        lines = _Lines(self._stdin, self._max_message)
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            while True:
                line_task = asyncio.ensure_future(lines.get())
                done, _ = await asyncio.wait({line_task, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if line_task not in done:
                    line_task.cancel()
                    break
                line = line_task.result()
                if line is None:
                    await self._drain(stopped)
                    break
                await self._dispatch(line)
        finally:
            stopped.cancel()
            await self._close()

    async def _drain(self, stopped: asyncio.Future[Any]) -> None:
        """End of stdin: the requests still in flight get `drain_seconds` to be answered (a
        client that piped its requests and closed stdin reads the answers); a signal cuts it
        short."""
        if not self._tasks or stopped.done():
            return
        log.info("stdin closed: waiting up to %gs for %d request(s) in flight", self._drain_seconds,
                 len(self._tasks))
        everything = asyncio.ensure_future(asyncio.wait(set(self._tasks)))
        await asyncio.wait({everything, stopped}, timeout=self._drain_seconds,
                           return_when=asyncio.FIRST_COMPLETED)
        everything.cancel()

    # ---- client -> route -------------------------------------------------------------------

    async def _dispatch(self, line: bytes) -> None:
        if line == _Lines.TOO_LONG:
            await self._write(_error(None, jsonrpc.INVALID_REQUEST,
                                     f"message exceeds {self._max_message} bytes (limits.max_body_bytes)"))
            return
        try:
            message = orjson.loads(line)
        except orjson.JSONDecodeError:
            await self._write(_error(None, jsonrpc.PARSE_ERROR, "Parse error: not a JSON message"))
            return
        is_request = isinstance(message, dict) and isinstance(message.get("method"), str) and "id" in message
        if is_request and message["method"] == "initialize":
            # Alone and first: every later request needs the session it creates.
            await self._post(line, message["id"], initialize=True)
        elif is_request:
            self._in_flight.add(_id_key(message["id"]))
            task = asyncio.ensure_future(self._post(line, message["id"]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            # Notifications and answers to server requests, in order: `initialized` before the
            # next request, a cancellation after the request it cancels.
            if isinstance(message, dict) and message.get("method") == "notifications/cancelled":
                params = message.get("params")
                if isinstance(params, dict) and _id_key(params.get("requestId")) in self._in_flight:
                    # The client gave up on it: no stand-in error if its stream ends without one.
                    self._cancelled.add(_id_key(params.get("requestId")))
            await self._post(line, None)
            if isinstance(message, dict) and message.get("method") == "notifications/initialized":
                self._initialized = line
                self._start_listening()

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {BRIDGE_HEADER: self._secret, "Accept": accept}
        if self._session is not None:
            headers[SESSION_HEADER] = self._session
        if self._version is not None:
            headers["MCP-Protocol-Version"] = self._version
        return headers

    async def _post(self, body: bytes, msg_id: Any, initialize: bool = False) -> None:
        """POST one message; write what the reply carries. `msg_id` (a request's): the client
        gets an error with it when the reply carries no answer. A 404 on the session (the
        upstream restarted, or reaped it idle) renews the session once, as a client would, and
        the message is sent again."""
        assert self._http is not None
        answered = msg_id is None
        if initialize:
            self._init = (body, msg_id)
        try:
            for attempt in (1, 2):
                session = self._session
                headers = self._headers(ACCEPT) | {"Content-Type": "application/json"}
                async with self._http.post(self._url, data=body, headers=headers) as resp:
                    if resp.status == 202:
                        return
                    if resp.status == 404 and session is not None and attempt == 1 and not initialize \
                            and await self._renew(session):
                        continue  # this (unread) 404 is dropped; the message goes again
                    async for message in self._replies(resp):
                        if isinstance(message, dict) and message.get("id") is None and msg_id is not None \
                                and "error" in message:
                            message = {**message, "id": msg_id}  # a transport-level refusal of it
                        if initialize and resp.status == 200 and _answers(message, msg_id):
                            self._begin_session(resp.headers.get(SESSION_HEADER), message)
                        answered = answered or _answers(message, msg_id)
                        await self._write(message)
                    return
        except asyncio.CancelledError:
            answered = True  # the session is ending: nobody waits for the answer
            raise
        except (aiohttp.ClientError, OSError, ValueError, UpstreamError) as exc:
            log.warning("relaying a message to the proxy failed: %s", exc)
        finally:
            if msg_id is not None:
                key = _id_key(msg_id)
                self._in_flight.discard(key)
                if key in self._cancelled:
                    self._cancelled.discard(key)
                    answered = True
            if not answered:
                await self._write(_error(msg_id, jsonrpc.INTERNAL_ERROR,
                                         "envelope-proxy: the request ended without a response"))

    async def _renew(self, stale: str) -> bool:
        """A new session in place of `stale` (the client's own `initialize` and `initialized`
        sent again, their answers kept from the client); False when that fails."""
        async with self._renew_lock:
            if self._session != stale:  # another request renewed it meanwhile
                return self._session is not None
            if self._init is None:
                return False
            assert self._http is not None
            log.warning("the session expired (HTTP 404): initializing a new one")
            body, init_id = self._init
            self._session = None
            headers = self._headers(ACCEPT) | {"Content-Type": "application/json"}
            async with self._http.post(self._url, data=body, headers=headers) as resp:
                answer = [m async for m in self._replies(resp) if _answers(m, init_id)]
                if resp.status != 200 or not answer or "result" not in answer[0]:
                    log.error("a new session was refused (HTTP %s)", resp.status)
                    return False
                self._begin_session(resp.headers.get(SESSION_HEADER), answer[0])
            if self._initialized is not None:
                headers = self._headers(ACCEPT) | {"Content-Type": "application/json"}
                async with self._http.post(self._url, data=self._initialized, headers=headers) as resp:
                    await resp.read()
            if self._listener is not None and self._listener.done():
                self._listener = None
                self._start_listening()
            return True

    async def _replies(self, resp: aiohttp.ClientResponse) -> Any:
        """The messages of a reply: its SSE events' as they arrive, or its JSON body's."""
        if "text/event-stream" in resp.headers.get("Content-Type", ""):
            async for message in self._events(resp):
                yield message
            return
        body = bytearray()
        async for chunk in resp.content.iter_any():
            body += chunk
            if len(body) > self._max_event:
                log.warning("the proxy's reply exceeds %d bytes: dropped", self._max_event)
                return
        message = self._decode(bytes(body))
        if message is None:
            log.warning("the proxy answered HTTP %s without a JSON-RPC message", resp.status)
            return
        yield message

    def _begin_session(self, session: str | None, message: Any) -> None:
        result = message.get("result") if isinstance(message, dict) else None
        version = result.get("protocolVersion") if isinstance(result, dict) else None
        self._session = session
        self._version = version if isinstance(version, str) else None
        log.info("session started (protocol %s)", self._version or "unknown")

    def _decode(self, raw: bytes) -> Any:
        """A JSON-RPC message (object or array of objects) from `raw`, else None."""
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if isinstance(message, dict) and message.get("jsonrpc") == "2.0":
            return message
        if isinstance(message, list) and message and all(
                isinstance(m, dict) and m.get("jsonrpc") == "2.0" for m in message):
            return message
        return None

    async def _events(self, resp: aiohttp.ClientResponse, on_id: Callable[[str], None] | None = None) -> Any:
        """Each SSE event's message, as it arrives (events without data are priming events)."""
        parser = SSEParser(self._max_event, setting="limits.max_upstream_event_bytes")
        async for chunk in resp.content.iter_any():
            for event in parser.feed(chunk):
                if event.id is not None and on_id is not None:
                    on_id(event.id)
                if not event.has_data or not event.data.strip():
                    continue
                message = self._decode(event.data.encode())
                if message is None:
                    log.warning("dropped an SSE event that is not a JSON-RPC message")
                    continue
                yield message

    # ---- unsolicited messages ------------------------------------------------------------------

    def _start_listening(self) -> None:
        if self._listener is None and self._session is not None:
            self._listener = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        """The session's GET stream, reconnected (with `Last-Event-ID`) until the route refuses."""
        assert self._http is not None
        last_id: list[str] = []
        failures = 0
        while failures < LISTEN_ATTEMPTS:
            headers = self._headers("text/event-stream")
            if last_id:
                headers["Last-Event-ID"] = last_id[-1]
            try:
                async with self._http.get(self._url, headers=headers) as resp:
                    if resp.status != 200 or "text/event-stream" not in resp.headers.get("Content-Type", ""):
                        log.info("no stream for unsolicited messages (HTTP %s)", resp.status)
                        return
                    failures = 0
                    async for message in self._events(resp, on_id=lambda i: last_id.append(i)):
                        del last_id[:-1]
                        await self._write(message)
            except (aiohttp.ClientError, OSError, ValueError, UpstreamError) as exc:
                log.info("the stream for unsolicited messages ended: %s", exc)
            failures += 1
            await asyncio.sleep(min(0.25 * 2**failures, LISTEN_MAX_BACKOFF))

    # ---- route -> client -----------------------------------------------------------------------

    async def _write(self, message: Any) -> None:
        """One message as one line on stdout (a broken pipe ends the session)."""
        line = orjson.dumps(message) + b"\n"
        async with self._write_lock:
            try:
                await asyncio.to_thread(self._write_blocking, line)
            except (OSError, ValueError) as exc:
                log.warning("stdout closed: %s", exc)
                self._stopped.set()

    def _write_blocking(self, line: bytes) -> None:
        # A writer cancelled while its thread writes releases the asyncio lock early: this lock
        # keeps the next line from interleaving with the one still being written.
        with self._stdout_lock:
            self._stdout.write(line)
            self._stdout.flush()

    # ---- end -----------------------------------------------------------------------------------

    async def _close(self) -> None:
        """Cancel what is in flight (the route audits calls cut off), end the session, close."""
        log.info("stdin closed (or signalled): ending the session")
        pending = list(self._tasks)
        if self._listener is not None:
            pending.append(self._listener)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        http = self._http
        if http is None:
            return
        if self._session is not None:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT), http.delete(
                        self._url, headers=self._headers(ACCEPT)) as resp:
                    log.info("session ended (HTTP %s)", resp.status)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.info("ending the session failed: %s", exc)
        await http.close()
