"""The forwarded-call executor: one call (or content read) on its way upstream and back, the
same way on every route (`/mcp/<upstream>` and the aggregated `/mcp`).

`Executor.run(pending, request, downstream)` ends every call it is given exactly once, through
`Envelope.complete`:

- a call the envelope refused or answers itself (replay, shadow) is completed at once;
- an allowed one is sent upstream (`UpstreamRequest`: body, headers, the id its answer carries)
  with bounded retries for calls that may be repeated (read-only, or carrying the client's
  idempotency key: never a writer that may have been performed), within the upstream's
  timeout, which covers the upstream exchange only: the completion (inspection, result checks,
  audit) runs after it, shielded, so no timeout and no disconnect can cut it short;
- the answer comes as JSON or as an SSE stream; every other message of the stream (progress,
  logging, server-to-client requests) is inspected by the envelope before it is relayed to the
  `Downstream` (the client's SSE stream; the aggregate's JSON clients get none), and a refusal
  there ends the call (the upstream call is cancelled);
- a stream the upstream closes early after events with ids is resumable: the aggregate resumes
  it itself (GET + `Last-Event-ID`); the per-upstream route leaves the resumption to its client
  (the call is `detached`, and the result, when fetched, is inspected by the GET relay);
- the client going away cancels the upstream call (`notifications/cancelled` for session
  upstreams; closing the stream cancels a stateless one), unless its stream is resumable;
- an answer past the caps (`max_event_bytes` for one SSE event, `max_reply_bytes` for a JSON
  body) is not read on: the call fails ("reply exceeds N bytes") and is cancelled;
- an HTTP (OpenAPI) upstream's call (`UpstreamRequest.http`) is sent as that HTTP request to
  the upstream's url joined with its path, with the same timeout, cap and failure handling
  and the same retries except that a client idempotency key does not make a writer repeatable
  (the backend never sees the key); its response (never parsed as SSE; a gzip or deflate body
  decoded first, any other content coding refused) becomes a tool result
  (`openapi.result_from`) answering `reply_id`, so the envelope inspects it like any MCP answer.

It never builds a decision: failures are `Failure`s, the envelope decides what they mean.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from proxy.config import Limits, RetryConfig
from proxy.envelope.pipeline import Envelope, Pending
from proxy.envelope.types import Decision, Effect, Failure, Outcome, Reply
from proxy.errors import ReplyTooLarge, UpstreamError, UpstreamTimeout
from proxy.fronts import jsonrpc
from proxy.fronts.headers import layered
from proxy.fronts.sse import SSEEvent, SSEParser, format_event, format_fields, verbatim
from proxy.observability import tracing
from proxy.observability.metrics import UpstreamOutcome
from proxy.upstream.forwarder import REPLY_SETTING, Forwarder, UpstreamResponse
from proxy.upstream.openapi import RELAYED_HEADERS_META, HttpCall, decoded, result_from

log = logging.getLogger("envelope.forward")

# Upstream answers that say "try again" without the call having run (or, for 502/504 behind a
# gateway, without the proxy knowing): retried for calls that may be repeated only.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Most times the aggregate resumes one stream its upstream closed early.
MAX_RESUMES = 8

Observe = Callable[[str, float, UpstreamOutcome, str | None], None]


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """Where and how to reach one upstream (policy plus runtime overrides)."""

    name: str
    url: str
    timeout: float
    connect_timeout: float
    headers: Mapping[str, str]
    forward_authorization: bool
    # The header naming the caller's principal on a request that opens an upstream session
    # (a stdio upstream's internal endpoint: each principal's share of its processes). None:
    # the upstream is not told.
    principal_header: str | None = None


@dataclass(slots=True)
class UpstreamRequest:
    """What goes upstream for one forwarded request.

    `reply_id` is the JSON-RPC id the upstream's answer carries; `session` the headers that
    reach the upstream session (`Mcp-Session-Id`, protocol version, credentials) for
    `notifications/cancelled` and stream resumption, None for a stateless request (closing the
    stream cancels it); `resume` says the proxy resumes a stream the upstream closed early
    itself. `setup`, when the proxy holds the upstream session itself (the aggregate), opens it
    before the first attempt (`setup(False)`) and again when the upstream answers 404 because
    it lost it (`setup(True)`), returning the headers that reach it (then both the request's
    headers and `session`); it raises UpstreamError when it cannot.

    `http` makes it an HTTP upstream's call: `http.method` to the target's url joined with
    `http.path`, carrying `http.body` (`body` is unused) and `headers` (what the front passes
    on: the agent's Authorization for a `forward_authorization` upstream), then `http.headers`,
    then the upstream's configured `headers` (last: the proxy's credential is never overridden).
    """

    target: UpstreamTarget
    body: bytes
    headers: Mapping[str, str]
    reply_id: Any
    session: Mapping[str, str] | None = None
    resume: bool = False
    setup: Callable[[bool], Awaitable[Mapping[str, str]]] | None = None
    # The body again with these entries in `params._meta` (the trace context), when the front
    # writes the body itself anyway; None: the client's bytes go upstream as they came.
    with_meta: Callable[[Mapping[str, str]], bytes] | None = None
    http: HttpCall | None = None


@dataclass(slots=True)
class Downstream:
    """Where a call's stream goes before its answer: the client's SSE response, opened on the
    first event with the upstream's headers (`request` None: nothing is relayed, the client
    gets the answer only). `stream` may already be open (an in-band approval asked on it)."""

    request: web.Request | None = None
    stream: web.StreamResponse | None = None
    headers: Callable[[UpstreamResponse], Mapping[str, str]] | None = None
    # The upstream's response headers kept for the client (`headers` applied), once it answered.
    response_headers: Mapping[str, str] | None = None

    @property
    def relays(self) -> bool:
        return self.request is not None

    async def open(self, resp: UpstreamResponse) -> None:
        if self.stream is None and self.request is not None:
            # The headers already kept for this answer (the executor's), else kept now.
            headers = self.response_headers
            if headers is None and self.headers is not None:
                headers = self.headers(resp)
            out = web.StreamResponse(status=200, headers=headers)
            await out.prepare(self.request)
            self.stream = out

    async def write(self, event: bytes) -> None:
        if self.stream is not None:
            await self.stream.write(event)


# An HTTP answer up to this many bytes (not content-coded) becomes a tool result on the event
# loop: parsing and walking it costs less than the hop to a thread and back (~0.1 ms). A larger
# or coded one is decoded and parsed in a worker thread: tens of milliseconds for a 16 MiB
# answer (orjson, then `_deeper_than` visits every node) must not stall every other call.
INLINE_HTTP_BYTES = 64 * 1024


async def _http_result(status: int, ctype: str, data: bytes, coding: str,
                       limit: int) -> tuple[bytes, dict[str, Any]]:
    """(the decoded body, `openapi.result_from` of it); ValueError as `decoded` raises it."""
    def work() -> tuple[bytes, dict[str, Any]]:
        body = decoded(data, coding, limit, REPLY_SETTING)
        return body, result_from(status, ctype, body)

    if len(data) <= INLINE_HTTP_BYTES and coding.strip().lower() in ("", "identity"):
        return work()
    return await asyncio.to_thread(work)


@dataclass(slots=True)
class Executor:
    """What every forwarded call of a front needs: the envelope, the upstream client, where
    upstream outcomes are reported, the retry settings, and the front's lifecycle hooks."""

    envelope: Envelope
    forwarder: Forwarder
    observe: Observe
    retry: RetryConfig
    # Fire-and-forget upstream notifications (cancellations), tracked by the front.
    spawn: Callable[[Awaitable[None]], None]
    # True once the proxy is draining: a call cut off then was cut off by the shutdown.
    shutting_down: Callable[[], bool] = lambda: False
    # Told of a call whose client left a resumable stream (its result may be fetched later).
    # What it returns (sharing the call with other workers) is awaited before the stream ends
    # where the upstream closed it, run in the background where the client left.
    on_detached: Callable[[Pending, UpstreamRequest], Awaitable[None] | None] | None = None
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # Caps on what an upstream sends (`limits.max_upstream_event_bytes` / `_reply_bytes`).
    max_event_bytes: int = Limits().max_upstream_event_bytes
    max_reply_bytes: int = Limits().max_upstream_reply_bytes

    async def run(self, pending: Pending, request: UpstreamRequest | None,
                  downstream: Downstream) -> Outcome:
        """End `pending`: forward it if it is to be forwarded, then complete it."""
        if request is None or not pending.forwardable:
            return await self.envelope.complete(pending)
        # Until it ends (`complete`): an exit at once still writes its record (`abandon`).
        self.envelope.forwarding[pending.call.decision_id] = pending
        return await _Forwarded(self, pending, request, downstream).run()

    async def deliver(self, pending: Pending, reply: Reply) -> Outcome:
        """End `pending` with an answer that arrived outside its own stream (a result fetched
        on a resumed GET): inspected, recorded and audited like any answer."""
        return await self.envelope.complete(pending, reply if pending.forwardable else None)

    def cancel(self, request: UpstreamRequest, reason: str) -> None:
        """Tell a session upstream that the request is abandoned (2025-06-18 / 2025-11-25: a
        dropped connection is not a cancellation; 2026-07-28: closing the stream is, and the
        executor does that)."""
        if request.session is None:
            return
        self._tell(request, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                             "params": {"requestId": request.reply_id, "reason": reason}})

    def refuse_server_request(self, request: UpstreamRequest, message: Mapping[str, Any],
                              why: str) -> None:
        """Answer a server request (sampling, elicitation, roots) on `request`'s stream that
        nobody downstream can answer with a JSON-RPC error, so the upstream's tool fails or goes
        on without instead of waiting until the call times out."""
        if request.session is None:
            return
        self._tell(request, {"jsonrpc": "2.0", "id": message.get("id"), "error": {
            "code": jsonrpc.METHOD_NOT_FOUND, "message": why}})

    def _tell(self, request: UpstreamRequest, message: Mapping[str, Any]) -> None:
        """POST `message` (a notification or an answer) in `request`'s upstream session, in a
        tracked background task; a failure is logged."""
        assert request.session is not None
        target = request.target
        body = orjson.dumps(message)
        headers = {**request.session, "Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream"}

        async def send() -> None:
            try:
                resp = await self.forwarder.open("POST", target.url, headers, body,
                                                 connect_timeout=target.connect_timeout,
                                                 read_timeout=target.connect_timeout)
                resp.close()
            except (UpstreamError, TimeoutError) as exc:
                log.info("could not send %s to %s: %s", message.get("method") or "an answer",
                         target.name, exc)

        self.spawn(send())


class _Forwarded:
    """One forwarded request, from the first attempt to its completion."""

    def __init__(self, executor: Executor, pending: Pending, request: UpstreamRequest,
                 downstream: Downstream):
        self.x = executor
        self.pending = pending
        self.request = request
        self.downstream = downstream
        self.target = request.target
        self.started = 0.0
        self.status: int | None = None
        self.attempts = 1  # tries of `_open` (the backoff grows with them)
        self.writes = 0  # times the request was written upstream
        self.last_event_id: str | None = None  # the upstream's events carry ids: resumable

    def _seconds(self) -> float:
        return time.perf_counter() - self.started

    async def run(self) -> Outcome:
        x, target = self.x, self.target
        self.started = time.perf_counter()
        try:
            async with asyncio.timeout(target.timeout):
                ending = await (self._exchange() if tracing.TRACER is None else tracing.client(
                    target.name, target.url, self.pending.call.request.method, self,
                    self._exchange, self._with_meta))
        except (TimeoutError, UpstreamTimeout):
            x.observe(target.name, self._seconds(), "timeout", None)
            ending = self._failure("timeout", f"upstream {target.name!r} did not answer within "
                                   f"{target.timeout:g}s")
        except ReplyTooLarge as exc:
            # Nothing past the cap was read (or kept): the call is refused and cancelled (closing
            # the response aborted its connection; a session upstream is told too).
            x.observe(target.name, self._seconds(), "error", str(exc))
            ending = self._failure("error", f"upstream {target.name!r} {exc}")
            x.cancel(self.request, "the reply exceeded the proxy's size limit")
        except UpstreamError as exc:
            x.observe(target.name, self._seconds(), "error", str(exc))
            ending = self._failure("error", f"upstream {target.name!r} failed: {exc}")
        except asyncio.CancelledError:
            x.envelope.complete_soon(self.pending, self._gone(), upstream_seconds=self._seconds())
            raise
        except ConnectionResetError:  # writing to a client that went away mid-stream
            ending = self._gone()
        if isinstance(ending, Failure) and ending.kind == "timeout":
            x.cancel(self.request, "the proxy's upstream timeout expired")
        return await x.envelope.complete(self.pending, ending, upstream_seconds=self._seconds())

    def _with_meta(self, meta: Mapping[str, str]) -> None:
        if self.request.with_meta is not None:
            self.request.body = self.request.with_meta(meta)

    def _sent(self, writes: int | None) -> None:
        """Count one try and how often it wrote the request upstream (a refused connection:
        never; a resend on a stale pooled connection: twice). The record says `attempts` (tries,
        or writes when a try wrote twice) whenever there was more than one."""
        self.writes += 1 if writes is None else writes
        attempts = max(self.attempts, self.writes)
        if attempts > 1:
            self.pending.call.audit_extra["attempts"] = attempts

    def _failure(self, kind: Any, reason: str) -> Failure:
        return Failure(kind, reason, self.status)

    def _gone(self) -> Failure:
        """The client left before the answer: why, as the record will say."""
        x = self.x
        extra = {"client_disconnected": True}
        if x.shutting_down():
            log.warning("shutdown cut off decision %s (%s) before %s answered",
                        self.pending.call.decision_id, self.pending.call.qualified_name, self.target.name)
            x.cancel(self.request, "the proxy is shutting down")
            return Failure("shutdown", "the proxy shut down before the upstream answered; cancelled",
                           self.status, extra)
        if self.last_event_id is not None and self.downstream.relays:
            # A stream whose events carry ids may be resumed with GET + Last-Event-ID: the spec
            # says a disconnect is not a cancellation then; the upstream call goes on.
            if x.on_detached is not None and (sharing := x.on_detached(self.pending, self.request)) is not None:
                task = asyncio.ensure_future(sharing)
                x.background.add(task)
                task.add_done_callback(x.background.discard)
            return Failure("detached", "the client disconnected; the stream is resumable, the "
                           "call goes on", self.status, extra)
        x.cancel(self.request, "client disconnected")
        return Failure("disconnected", "the client disconnected before the upstream answered; "
                       "cancelled", self.status, extra)

    # -- the upstream exchange ---------------------------------------------------------------

    def _retry(self) -> RetryConfig | None:
        """The retry settings when this request may be written upstream more than once: a
        read-only call, or a tool the policy declares `idempotent: true` (promise 3: a writer
        reaches its upstream at most once unless policy says it is idempotent). A client's
        idempotency key does not make a writer repeatable: it lets the envelope answer the
        agent's own repeats from the first result, but says nothing of whether the upstream can
        take the same request twice."""
        pending = self.pending
        if pending.call.effect is Effect.READ:
            return self.x.retry
        if pending.chain is not None and pending.chain.idempotent(pending.call):
            return self.x.retry
        return None

    def _delay(self, retry: RetryConfig, retry_after: float | None) -> float | None:
        """Seconds to wait before the next attempt; None when no attempt is left or the wait
        would not leave the attempt any of the upstream's timeout."""
        if self.attempts >= retry.attempts:
            return None
        delay = retry_after if retry_after is not None else retry.backoff * 2 ** (self.attempts - 1)
        delay = min(delay, retry.max_backoff)
        if delay >= self.target.timeout - self._seconds():
            return None
        return delay

    async def _open(self) -> UpstreamResponse:
        """Send the request; repeat transient failures when the call allows it, before any byte
        reached the client. Each failed attempt is counted as an upstream error and each retry
        in `envelope_upstream_retries_total`; the record carries the number of attempts."""
        x, target, request = self.x, self.target, self.request
        retry = self._retry()
        reopened = False
        if request.setup is not None:
            request.headers = request.session = await request.setup(False)
        method, url = "POST", target.url
        body: bytes | None = request.body
        http = request.http
        if http is not None:
            method, url, body = http.method, target.url.rstrip("/") + http.path, http.body
        while True:
            attempt_started = time.perf_counter()
            delay: float | None = None
            # An HTTP backend is asked for no content coding (inspection reads the body as
            # sent); one that encodes anyway is decoded in `_http_answer`.
            headers = (request.headers if http is None else layered(
                {"Accept-Encoding": "identity"}, request.headers, http.headers, target.headers))
            # From here the upstream may get the request (a cancellation mid-write leaves it so).
            self.pending.call.maybe_sent = True
            try:
                resp = await x.forwarder.open(
                    method, url, headers if tracing.TRACER is None else tracing.inject(headers), body,
                    connect_timeout=target.connect_timeout, read_timeout=target.timeout,
                    resend=retry is not None)  # a written request is sent again only if repeatable
            except UpstreamError as exc:
                self._sent(exc.attempts)
                if self.writes == 0:  # no connection, no byte written, in any attempt so far
                    self.pending.call.maybe_sent = False
                if retry is not None and _connect_failed(exc):
                    delay = self._delay(retry, None)
                if delay is None:
                    raise
                x.observe(target.name, time.perf_counter() - attempt_started, "error", str(exc))
            else:
                self._sent(resp.attempts)
                if resp.status == 404 and request.setup is not None and not reopened:
                    # The upstream forgot the session (restart, expiry): it did not run the call.
                    resp.close()
                    request.headers = request.session = await request.setup(True)
                    reopened = True
                    continue
                if retry is None or resp.status not in RETRY_STATUSES:
                    return resp
                delay = self._delay(retry, _retry_after(resp.headers.get("Retry-After")))
                if delay is None:
                    return resp
                resp.close()
                x.observe(target.name, time.perf_counter() - attempt_started, "error",
                          f"answered HTTP {resp.status}")
            x.envelope.metrics.upstream_retry(target.name)
            log.info("retrying %s on %s in %.3gs (attempt %d failed)",
                     self.pending.call.qualified_name, target.name, delay, self.attempts)
            await asyncio.sleep(delay)
            self.attempts += 1

    async def _exchange(self) -> Reply | Failure | Decision:
        x, target = self.x, self.target
        resp = await self._open()
        async with resp:
            self.status = resp.status
            if self.downstream.headers is not None:
                self.downstream.response_headers = self.downstream.headers(resp)
            ctype = resp.headers.get("Content-Type", "")
            if self.request.http is not None:
                return await self._http_answer(resp, ctype)
            if ctype.startswith("text/event-stream") and resp.status == 200:
                x.observe(target.name, self._seconds(), "ok", None)
                refusal = await x.envelope.stream_opens(self.pending)
                if refusal is not None:
                    x.cancel(self.request, "the proxy withheld the call's stream")
                    return refusal
                await self.downstream.open(resp)
                return await self._stream(resp)
            data = await resp.read(x.max_reply_bytes)
            x.observe(target.name, self._seconds(), "ok" if resp.status < 500 else "error",
                      f"answered HTTP {resp.status}")
            if ctype.startswith("application/json"):
                reply = _reply_to(data, self.request.reply_id)
                if reply is not None:
                    # The server's own answer: a result, or a JSON-RPC error with its status.
                    relayable = await jsonrpc.relayable(data, reply)
                    return Reply(reply, data if relayable else None, resp.status)
            if resp.status == 404 and self.downstream.stream is None:
                # Unknown or expired session: the client must initialize again.
                return self._failure("session_lost", f"upstream {target.name!r} does not know "
                                     "the session (HTTP 404)")
            reason = f"upstream {target.name!r} answered HTTP {resp.status}" + (
                "" if resp.status != 200 else " without a JSON-RPC reply")
            return self._failure("error", reason)

    async def _http_answer(self, resp: UpstreamResponse, ctype: str) -> Reply | Failure:
        """An HTTP upstream's response as the tool result answering the call (an HTTP error
        status is an `isError` result, a 5xx also counted as an upstream error)."""
        x, http = self.x, self.request.http
        assert http is not None
        data = await resp.read(x.max_reply_bytes)
        # Every field: two `Content-Encoding` fields are two codings (RFC 9110 5.3), which
        # `decoded` refuses; the first alone undid one and passed the other unread.
        coding = ", ".join(resp.headers.getall("Content-Encoding", ()))
        try:
            # What is inspected and what the agent gets are the same decoded bytes (the plain
            # HTTP front relays no Content-Encoding).
            data, result = await _http_result(resp.status, ctype, data, coding, x.max_reply_bytes)
        except ValueError as exc:
            x.observe(self.target.name, self._seconds(), "error", str(exc))
            return self._failure("error", f"upstream {self.target.name!r} sent {exc}")
        x.observe(self.target.name, self._seconds(), "ok" if resp.status < 500 else "error",
                  f"answered HTTP {resp.status}")
        relayed = self.downstream.response_headers
        if http.relay and relayed:
            # The headers the plain HTTP front relays go with the result, so the envelope
            # inspects them as it inspects the body (a guardrail redacts or withholds a secret
            # in one alike) and `render.http_response` relays them as inspected.
            result["_meta"] = {RELAYED_HEADERS_META: [[k, v] for k, v in relayed.items()]}
        message = {"jsonrpc": "2.0", "id": self.request.reply_id, "result": result}
        return Reply(message, data if http.relay else None, resp.status)

    async def _stream(self, resp: UpstreamResponse) -> Reply | Failure | Decision:
        """Read the call's SSE stream: relay (inspected) events until the answer arrives; resume
        a stream closed early when this front resumes streams itself."""
        resumes = 0
        while True:
            parser = SSEParser(self.x.max_event_bytes)
            async for chunk in resp.chunks():
                for ev in parser.feed(chunk):
                    found = await self._event(ev)
                    if found is not None:
                        return found
            if self.last_event_id is None:
                return self._failure("error", f"upstream {self.target.name!r} closed the stream "
                                     "without a result")
            if not self.request.resume:
                # 2025-11-25 lets a server close a call's stream early (after an event with an
                # id); the client resumes with GET + Last-Event-ID and the answer arrives there.
                if self.x.on_detached is not None and (
                        sharing := self.x.on_detached(self.pending, self.request)) is not None:
                    await sharing  # before the client can resume it on another worker
                return self._failure("detached", "the upstream closed the stream before the "
                                     "result; the client resumes it (GET + Last-Event-ID)")
            resumes += 1
            if resumes > MAX_RESUMES:
                return self._failure("error", f"upstream {self.target.name!r} closed the stream "
                                     f"{MAX_RESUMES} times without a result")
            resp.close()
            resp = await self._resume()
            if resp.status != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                resp.close()
                return self._failure("error", f"upstream {self.target.name!r} answered HTTP "
                                     f"{resp.status} to resuming the stream")

    async def _resume(self) -> UpstreamResponse:
        target = self.target
        headers = {**(self.request.session or {}), "Accept": "text/event-stream",
                   "Last-Event-ID": self.last_event_id or ""}
        return await self.x.forwarder.open("GET", target.url, headers, None,
                                           connect_timeout=target.connect_timeout,
                                           read_timeout=target.timeout)

    async def _event(self, ev: SSEEvent) -> Reply | Decision | None:
        """Handle one event of the call's stream: the answer (returned), or an event relayed
        after inspection (a refusal there is returned: it ends the call)."""
        if ev.id:
            self.last_event_id = ev.id
        if not ev.data.strip():  # a priming event (an id, empty data), a comment: no text passes
            if self.downstream.relays:
                await self.downstream.write(format_fields(ev))
            return None
        message = _json(ev.data)
        if not isinstance(message, dict):
            log.info("dropped an event of %s that is not a JSON-RPC message", self.target.name)
            return None
        answer = message.get("id") == self.request.reply_id and ("result" in message or "error" in message)
        if not answer and not self.downstream.relays:
            if isinstance(message.get("method"), str) and "id" in message:
                # Only the aggregated endpoint relays nothing of a call's stream.
                self.x.refuse_server_request(self.request, message, (
                    f"{message['method']} is not relayed by the aggregated endpoint /mcp (use "
                    f"/mcp/{self.target.name} to be asked)"))
            return None  # nobody receives it: nothing to inspect
        # Judged before the inspection, which may change `message`.
        as_sent = verbatim(ev) and await jsonrpc.relayable(ev.data, message)
        if answer:
            return Reply(message, ev.raw if as_sent else None, self.status or 200, (ev.event, ev.id))
        relayed = await self.x.envelope.inspect_event(self.pending, message)
        if relayed.refusal is not None:
            self.x.cancel(self.request, "the proxy withheld the call's stream")
            return relayed.refusal
        if relayed.changed or not as_sent:
            await self.downstream.write(format_event(orjson.dumps(relayed.message), ev.event, ev.id))
        else:
            await self.downstream.write(ev.raw)
        return None


def _json(data: str | bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _reply_to(data: bytes, reply_id: Any) -> dict[str, Any] | None:
    reply = _json(data)
    if isinstance(reply, dict) and reply.get("id") == reply_id and ("result" in reply or "error" in reply):
        return reply
    return None


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
