"""In-band approval on the MCP wire: asking the person at the client to approve a gated call.

The approval check (`proxy.envelope.checks.approval`) decides *whether* the person at the client may
approve (the tool's `approval.in_band`) and records their answer; this module only speaks the
wire:

- Sessions (2025-06-18 / 2025-11-25): the front remembers each session's principal and client
  capabilities from the `initialize` it relays (`SessionCapabilities`, bounded in memory, keyed
  by upstream and the `Mcp-Session-Id` the upstream returned). For a client that declared
  `elicitation`, `SessionChannel.ask` turns the held `tools/call` into an SSE stream and sends an
  `elicitation/create` request with a proxy-minted id (`envelope-<uuid>`); the client's answering
  POST (a JSON-RPC response with that id) is intercepted by the front (`Elicitations.resolve`),
  answered 202 and never relayed upstream. With a shared store the session's binding carries
  whether its client takes such questions (`proxy.fronts.sessions.SharedOwners`), and an answer
  that reaches another worker than the one that asked is handed over through the store
  (`Elicitations.pending` / `hand_over` / `answer`: only to a question pending for that session
  and principal, once, and only what the asker reads of it); without one, a session another
  process created falls back to out-of-band approval.
- Stateless (2026-07-28): a client that lists `elicitation` in its per-request
  `_meta["io.modelcontextprotocol/clientCapabilities"]` gets an `input_required` result
  (`DeferChannel`); the retry's `inputResponses["envelope/approval"]` and the proxy's
  `requestState` are taken out of the request (`strip_stateless`) before anything goes upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web

from proxy.approvals.reveal import hidden_characters, revealed
from proxy.approvals.signer import STATE_PREFIX
from proxy.envelope.types import ApprovalPrompt, InBandAnswer
from proxy.errors import StoreError
from proxy.fronts.sessions import OwnedLRU, digest
from proxy.fronts.sse import format_event
from proxy.store.base import Store

log = logging.getLogger("envelope.mcp.inband")

ID_PREFIX = "envelope-"
INPUT_KEY = "envelope/approval"
CAPABILITIES_META = "io.modelcontextprotocol/clientCapabilities"
PREVIEW_CHARS = 300
# Arguments (as JSON) past this many characters are not searched for hidden characters in the
# in-band question (`elicitation_params`: on the event loop, up to ~100 ms at this size).
REVEAL_CHARS = 65536
REASON_CHARS = 500


# -- what the client can do -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionInfo:
    principal: str
    capabilities: dict[str, Any]

    @property
    def elicitation(self) -> bool:
        return isinstance(self.capabilities.get("elicitation"), dict)


class SessionCapabilities:
    """Per (upstream, session id): the principal that created the session and its client's
    capabilities, from the relayed `initialize`.

    In memory and bounded (`proxy.fronts.sessions.OwnedLRU`: in all, and per principal, so no
    principal can push another's sessions out): a session this replica never saw created
    (another worker or replica, a restart, pushed out) gets out-of-band approval (its client's
    capabilities are not known here); its principal is learned from the store
    (`proxy.fronts.sessions.SharedOwners`, by `McpFront`).
    """

    def __init__(self, max_sessions: int = 10000, max_per_principal: int = 1000):
        self._sessions: OwnedLRU[tuple[str, str], SessionInfo] = OwnedLRU(
            max_sessions, min(max_per_principal, max_sessions))

    def remember(self, upstream: str, session: str, principal: str, capabilities: Any) -> None:
        info = SessionInfo(principal, capabilities if isinstance(capabilities, dict) else {})
        self._sessions.put((upstream, session), principal, info)

    def get(self, upstream: str, session: str) -> SessionInfo | None:
        found = self._sessions.get((upstream, session))
        return found[1] if found is not None else None

    def foreign(self, upstream: str, session: str, principal: str) -> bool:
        """Whether another principal created this session (False when it is unknown here)."""
        owner = self._sessions.owner((upstream, session))
        return owner is not None and owner != principal

    def owner(self, upstream: str, session: str) -> str | None:
        """Who created this session (None: unknown here); counts as a use."""
        return self._sessions.owner((upstream, session))

    def forget(self, upstream: str, session: str) -> None:
        self._sessions.pop((upstream, session))

    def __len__(self) -> int:
        return len(self._sessions)


def stateless_elicitation(params: dict[str, Any]) -> bool:
    """Whether a 2026-07-28 request says its client handles elicitation input requests."""
    meta = params.get("_meta")
    caps = meta.get(CAPABILITIES_META) if isinstance(meta, dict) else None
    return isinstance(caps, dict) and isinstance(caps.get("elicitation"), dict)


# -- the question ------------------------------------------------------------------------------


def elicitation_params(prompt: ApprovalPrompt) -> dict[str, Any]:
    """The form-mode `elicitation/create` params asking to approve one call."""
    # Hidden characters (bidi overrides, zero-width) and look-alike letters escaped: the person
    # reads what will run. Finding them is Python work per character (~1.5 µs at worst), on the
    # event loop: past REVEAL_CHARS only the preview is read, and the person is told so.
    text = json.dumps(dict(prompt.arguments), ensure_ascii=False, separators=(",", ":"))
    if len(text) > REVEAL_CHARS:
        preview = (revealed(text[:PREVIEW_CHARS]) + f"… (cut: {len(text):,} characters in all) WARNING: "
                   "too long to be checked here for hidden or look-alike characters: read the "
                   "arguments in the approvals API or on the review page before approving")
    else:
        preview = revealed(text)
        hidden = hidden_characters(dict(prompt.arguments))
        if len(preview) > PREVIEW_CHARS:
            preview = preview[:PREVIEW_CHARS] + f"… (cut: {len(preview):,} characters in all)"
        if hidden:
            preview += " WARNING: hidden or look-alike characters, shown escaped, at " + ", ".join(
                h["path"][:80] for h in hidden[:5]) + (" and more" if len(hidden) > 5 else "")
    message = (
        f"Approve the tool call {prompt.tool} on upstream {prompt.upstream}? "
        f"Arguments (digest {prompt.args_digest}): {preview} "
        f"[approval {prompt.approval_id}]"
    )
    return {
        "mode": "form",
        "message": message,
        "requestedSchema": {
            "type": "object",
            "properties": {
                "approve": {"type": "boolean", "title": "Approve",
                            "description": f"Let {prompt.tool} run with these arguments",
                            "default": False},
                "reason": {"type": "string", "title": "Reason",
                           "description": "Why (recorded with the decision)",
                           "maxLength": REASON_CHARS},
            },
            "required": ["approve"],
        },
        "_meta": {"envelope/approval_id": prompt.approval_id},
    }


def parse_answer(result: Any) -> InBandAnswer | None:
    """An `ElicitResult` -> the person's answer; None when it is not one (no decision)."""
    if not isinstance(result, dict):
        return None
    action = result.get("action")
    if action == "accept":
        content = result.get("content")
        content = content if isinstance(content, dict) else {}
        reason = content.get("reason")
        reason = reason[:REASON_CHARS] if isinstance(reason, str) and reason.strip() else ""
        if content.get("approve") is True:
            return InBandAnswer(True, reason or "approved by the user at the client", "accept")
        return InBandAnswer(False, reason or "not approved by the user at the client", "accept")
    if action == "decline":
        return InBandAnswer(False, "declined by the user at the client", "decline")
    if action == "cancel":
        return InBandAnswer(False, "dismissed by the user at the client", "cancel")
    return None


# -- sessions: elicitation/create on the call's stream ------------------------------------------


@dataclass(slots=True)
class _Waiting:
    upstream: str
    session: str
    principal: str
    future: asyncio.Future[Any]


# Answers handed over between workers: the store's namespace, how long one is kept, and how often
# a worker that asked looks for one there.
HANDOVER_NS = "elicitation-answers"
HANDOVER_TTL = 600.0
HANDOVER_POLL = 0.25
# What the store holds for a question no answer was handed over to yet, before its principal
# (an answer is JSON: it never starts so).
PENDING = b"?"


def _handover_key(upstream: str, session: str, request_id: str) -> str:
    return f"{upstream}/{digest(session)}/{request_id}"


def _read_of(body: dict[str, Any]) -> dict[str, Any]:
    """Of a client's answer, what the asker reads (`SessionChannel.ask`, `parse_answer`), bounded:
    an error, or the action, whether it approves and the reason (cut to REASON_CHARS)."""
    if "error" in body:
        return {"id": body.get("id"), "error": str(body["error"])[:REASON_CHARS]}
    result = body.get("result")
    if not isinstance(result, dict):
        return {"id": body.get("id"), "result": None}
    action = result.get("action")
    content = result.get("content")
    content = content if isinstance(content, dict) else {}
    reason = content.get("reason")
    return {"id": body.get("id"), "result": {
        "action": action if action in ("accept", "decline", "cancel") else None,
        "content": {"approve": content.get("approve") is True,
                    "reason": reason[:REASON_CHARS] if isinstance(reason, str) else ""}}}


class Elicitations:
    """Elicitation requests the proxy sent and awaits answers for, by their JSON-RPC id.

    With a shared `store` (several workers or replicas), the client's answer may reach a worker
    that did not ask (a new connection lands on any of them): the one that asks marks its
    question pending in the store (`pending`), a worker that did not ask hands an answer over in
    its place (`hand_over`), and the one that asked looks for it there while it waits
    (`answer`)."""

    def __init__(self, store: Store | None = None) -> None:
        self._waiting: dict[str, _Waiting] = {}
        self.store = store

    def open(self, upstream: str, session: str, principal: str) -> tuple[str, asyncio.Future[Any]]:
        request_id = f"{ID_PREFIX}{uuid.uuid4()}"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = _Waiting(upstream, session, principal, future)
        return request_id, future

    def close(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def resolve(self, upstream: str, session: str | None, principal: str, body: dict[str, Any]) -> bool:
        """Deliver a client's answer. False when nobody waits for it from this session and
        principal (unknown, late, or someone else's)."""
        waiting = self._waiting.get(body.get("id"))  # type: ignore[arg-type]
        if waiting is None or (waiting.upstream, waiting.session, waiting.principal) != (
                upstream, session, principal):
            return False
        if not waiting.future.done():
            waiting.future.set_result(body)
        return True

    async def pending(self, request_id: str) -> None:
        """Mark the question `request_id` (from `open`) pending in the store, so that another
        worker may hand its answer over. Without a store, nothing; a store that cannot answer is
        logged (an answer reaching another worker then cannot be passed on: the call waits on)."""
        waiting = self._waiting[request_id]
        if self.store is None:
            return
        try:
            await self.store.put(HANDOVER_NS, _handover_key(waiting.upstream, waiting.session, request_id),
                                 PENDING + waiting.principal.encode("utf-8", "surrogatepass"), ttl=HANDOVER_TTL)
        except StoreError as exc:
            log.warning("in-band question %s: only an answer reaching this worker is taken: %s", request_id, exc)

    async def hand_over(self, upstream: str, session: str, principal: str, body: dict[str, Any]) -> bool:
        """Leave an answer this process did not ask for in the store, in place of its question
        pending there for this session and principal (`pending`), for the worker that asked: only
        what it reads (`_read_of`). False without a store, for an id the proxy never makes, for a
        question not pending so (never asked, someone else's, or answered already). Raises
        StoreError."""
        request_id = body.get("id")
        if self.store is None or not isinstance(request_id, str) or len(request_id) > len(ID_PREFIX) + 36:
            return False
        return await self.store.cas(HANDOVER_NS, _handover_key(upstream, session, request_id),
                                    PENDING + principal.encode("utf-8", "surrogatepass"),
                                    orjson.dumps({"principal": principal, "body": _read_of(body)}),
                                    ttl=HANDOVER_TTL)

    async def answer(self, request_id: str, future: asyncio.Future[Any]) -> Any:
        """The client's answer to `request_id`: delivered here (`resolve`) or, with a store, handed
        over by another worker. A store that cannot answer is asked again at the next look."""
        waiting = self._waiting[request_id]
        if self.store is None:
            return await future
        key = _handover_key(waiting.upstream, waiting.session, request_id)
        while True:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(future), HANDOVER_POLL)
            try:
                found = await self.store.get(HANDOVER_NS, key)
            except StoreError as exc:
                log.warning("in-band answer %s: the store cannot be read (asked again): %s", request_id, exc)
                continue
            if found is None or found.startswith(PENDING):
                continue
            handed = orjson.loads(found)
            if (isinstance(handed, dict) and handed.get("principal") == waiting.principal
                    and isinstance(body := handed.get("body"), dict)):
                with contextlib.suppress(StoreError):
                    await self.store.delete(HANDOVER_NS, key)
                return body


@dataclass(slots=True)
class SessionChannel:
    """Ask over a session's `tools/call` stream (mode "hold"). Opens the SSE response on first
    use; the front then writes the call's result (or refusal) on `stream`."""

    request: web.Request
    elicitations: Elicitations
    upstream: str
    session: str
    principal: str
    mode: Literal["hold", "defer"] = "hold"
    answer: InBandAnswer | None = None
    state: str | None = None
    stream: web.StreamResponse | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def open_stream(self) -> web.StreamResponse:
        async with self._lock:
            if self.stream is None:
                out = web.StreamResponse(status=200, headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache, no-transform",
                    "X-Accel-Buffering": "no", "Mcp-Session-Id": self.session,
                })
                await out.prepare(self.request)
                self.stream = out
            return self.stream

    async def ask(self, prompt: ApprovalPrompt) -> InBandAnswer | None:
        out = await self.open_stream()
        request_id, future = self.elicitations.open(self.upstream, self.session, self.principal)
        try:
            await self.elicitations.pending(request_id)  # before the client can answer
            await out.write(format_event(orjson.dumps({
                "jsonrpc": "2.0", "id": request_id, "method": "elicitation/create",
                "params": elicitation_params(prompt),
            })))
            try:
                reply = await self.elicitations.answer(request_id, future)
            except asyncio.CancelledError:  # not answered in time, or decided out-of-band
                await self._cancelled(out, request_id)
                raise
        finally:
            self.elicitations.close(request_id)
        if "error" in reply:
            log.info("client answered in-band approval %s with an error: %s", prompt.approval_id,
                     reply.get("error"))
            return None
        return parse_answer(reply.get("result"))

    @staticmethod
    async def _cancelled(out: web.StreamResponse, request_id: str) -> None:
        """Tell the client the question is moot (not answered in time, or decided elsewhere)."""
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await out.write(format_event(orjson.dumps({
                "jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": request_id, "reason": "the approval no longer waits for this answer"},
            })))

    def defer(self, prompt: ApprovalPrompt, state: str) -> None:  # pragma: no cover - hold mode
        raise RuntimeError("a session channel asks while the call is held")


# -- stateless: input_required --------------------------------------------------------------


@dataclass(slots=True)
class DeferChannel:
    """Ask by answering with `input_required` (mode "defer"); the retry carries the answer."""

    answer: InBandAnswer | None = None
    state: str | None = None
    mode: Literal["hold", "defer"] = "defer"
    prompt: ApprovalPrompt | None = None
    minted: str | None = None

    async def ask(self, prompt: ApprovalPrompt) -> InBandAnswer | None:  # pragma: no cover
        raise RuntimeError("a stateless channel defers; it cannot ask while holding")

    def defer(self, prompt: ApprovalPrompt, state: str) -> None:
        self.prompt = prompt
        self.minted = state

    def input_required(self) -> dict[str, Any]:
        """The `input_required` result asking for the approval (after `defer`)."""
        assert self.prompt is not None and self.minted is not None
        return {
            "resultType": "input_required",
            "inputRequests": {INPUT_KEY: {"method": "elicitation/create",
                                          "params": elicitation_params(self.prompt)}},
            "requestState": self.minted,
        }


def strip_stateless(params: dict[str, Any]) -> tuple[dict[str, Any], DeferChannel | None, bool]:
    """Take the proxy's own answer and state out of a 2026-07-28 `tools/call`'s params.

    Returns (params to forward, the channel carrying what was taken out or None when the
    request carries nothing of ours, whether params changed). A `requestState` is ours when it
    starts with the proxy's prefix; another one (the upstream's own) is left in place.
    """
    responses = params.get("inputResponses")
    ours_answer = isinstance(responses, dict) and INPUT_KEY in responses
    state = params.get("requestState")
    ours_state = isinstance(state, str) and state.startswith(STATE_PREFIX)
    if not ours_answer and not ours_state:
        return params, None, False
    channel = DeferChannel()
    out = dict(params)
    if ours_answer:
        assert isinstance(responses, dict)
        raw = responses[INPUT_KEY]
        channel.answer = parse_answer(raw) or InBandAnswer(False, "an unreadable answer", "cancel")
        rest = {k: v for k, v in responses.items() if k != INPUT_KEY}
        if rest:
            out["inputResponses"] = rest
        else:
            out.pop("inputResponses")
    if ours_state:
        channel.state = state
        out.pop("requestState")
    return out, channel, True
