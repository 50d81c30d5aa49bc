"""Egress: an `Outcome` turned into wire bytes, the same way on every route.

One `render` for every way a call ends: the upstream's answer (its own bytes when the
inspection changed nothing), a refusal (a tool result the model reads, with the decision in
`_meta`; a JSON-RPC error for unknown tools and lost sessions), a result the envelope holds
(replay, shadow), an in-band approval request (`input_required`), in JSON or as the last event
of the call's SSE stream. The plain HTTP front's answers are here too (`http_response`): the
upstream's own response, or problem details (RFC 9457) for a refusal. Fronts never build a
refusal themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, cast

import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.envelope.outcome import DECISION_META, refusal_result
from proxy.envelope.types import Code, Outcome
from proxy.fronts import jsonrpc
from proxy.fronts.plain import PlainAnswer
from proxy.fronts.sse import format_event
from proxy.upstream.openapi import RELAYED_HEADERS_META

Form = Literal["json", "sse"]


def _complete(result: dict[str, Any], stateless: bool) -> dict[str, Any]:
    if stateless:
        result.setdefault("resultType", "complete")
    return result


def render(outcome: Outcome, client_id: Any, *, stateless: bool, tool: str = "",
           ask: dict[str, Any] | None = None, same_id: bool = True) -> tuple[int, bytes]:
    """(HTTP status, the JSON-RPC message answering `client_id`) for an outcome; an empty
    body for `none`. `tool` is the tool name as the client sent it (for `Unknown tool`);
    `ask` the in-band approval request to send instead of a pending refusal (2026-07-28
    `input_required`); `same_id` False when the upstream answered another id than the
    client's (the aggregate mints its own): its bytes are then never relayed as they are."""
    decision = outcome.decision
    if outcome.kind == "deliver":
        if outcome.raw is not None and outcome.sse is None and same_id:
            return outcome.status, outcome.raw
        message = dict(outcome.message or {})
        message["id"] = client_id
        if stateless and isinstance(message.get("result"), dict):
            # The aggregate speaks 2025-11-25 to its upstreams; its stateless clients need this.
            message["result"] = _complete(dict(message["result"]), stateless)
        return outcome.status, orjson.dumps(message)
    if outcome.kind == "held":
        return 200, jsonrpc.result_body(client_id, _complete(dict(outcome.message or {}), stateless))
    if outcome.kind == "none":
        return 200, b""
    meta = {DECISION_META: decision.as_meta(outcome.decision_id)}
    if ask is not None and decision.code is Code.APPROVAL_PENDING:
        return 200, jsonrpc.result_body(client_id, {**ask, "_meta": meta})
    if outcome.status == 404:  # the upstream lost the session: the client initializes again
        return 404, jsonrpc.error_body(client_id, jsonrpc.INVALID_REQUEST, "Session not found", meta)
    if decision.code is Code.UNKNOWN_TOOL:  # as a server answers an unknown tool
        return (400 if stateless else 200), jsonrpc.error_body(
            client_id, jsonrpc.INVALID_PARAMS, f"Unknown tool: {tool}", meta)
    return 200, jsonrpc.result_body(client_id, _complete(refusal_result(decision, outcome.decision_id),
                                                         stateless))


def sse_event(outcome: Outcome, body: bytes) -> bytes:
    """The answer as an SSE event: the upstream's own event when unchanged, else `body` in an
    event of the same type and id."""
    if outcome.kind == "deliver" and outcome.raw is not None and outcome.sse is not None:
        return outcome.raw
    event, event_id = outcome.sse if outcome.sse is not None else ("message", None)
    return format_event(body, event, event_id)


_JSON_HEADERS: Mapping[str, str] = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))


def writes_plain(request: web.Request) -> bool:
    """Whether the server that carried `request` writes a `PlainAnswer` itself
    (`proxy.fronts.plain`: the fast listener's hot route says so on its request,
    `LeanRequest.plain_answers`; aiohttp's requests do not)."""
    return getattr(request, "plain_answers", False) is True


async def respond(outcome: Outcome, client_id: Any, *, stateless: bool,
                  stream: web.StreamResponse | None = None, headers: Mapping[str, str] | None = None,
                  tool: str = "", ask: dict[str, Any] | None = None, same_id: bool = True,
                  plain: bool = False) -> web.StreamResponse:
    """Send an outcome: as the last event of the call's open SSE `stream`, else as a JSON
    response (`headers` are the upstream's response headers to keep, for a delivered answer).
    `plain` (only for a request whose server `writes_plain`): a JSON response is returned as a
    `PlainAnswer` instead, typed as the response it stands for; that server writes it."""
    status, body = render(outcome, client_id, stateless=stateless, tool=tool, ask=ask, same_id=same_id)
    if stream is not None:
        if body:
            await end_stream(stream, sse_event(outcome, body))
        else:
            await end_stream(stream, None)
        return stream
    if not body:
        return web.Response(status=499)  # nobody to answer: the client is gone
    if outcome.kind == "deliver" and headers is not None and outcome.sse is None:
        if plain:
            return cast(web.StreamResponse, PlainAnswer(status, headers, body))
        return web.Response(status=status, body=body, headers=headers)  # the upstream's own
    if plain:
        return cast(web.StreamResponse, PlainAnswer(status, _JSON_HEADERS, body))
    return web.Response(status=status, body=body, content_type="application/json")


async def end_stream(stream: web.StreamResponse, event: bytes | None) -> None:
    """Write the stream's last event (if any) and end it; a client that left is not an error."""
    try:
        if event is not None:
            await stream.write(event)
        await stream.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass


def rpc_error(status: int, id: Any, code: int, message: str, data: Any = None) -> web.Response:
    """A JSON-RPC error response (malformed requests, unknown routes)."""
    return web.Response(status=status, body=jsonrpc.error_body(id, code, message, data),
                        content_type="application/json")


def rpc_result(id: Any, result: dict[str, Any], stateless: bool,
               headers: Mapping[str, str] | None = None) -> web.Response:
    """A JSON-RPC result the front answers itself (the aggregate's initialize, lists, ping)."""
    return web.Response(status=200, body=jsonrpc.result_body(id, _complete(result, stateless)),
                        content_type="application/json", headers=headers)


# ---- the plain HTTP front (`/http/<upstream>/...`): the same outcomes as HTTP answers ----------

PROBLEM_JSON = "application/problem+json"
# RFC 9457 `type` of a refusal: this prefix and its reason code (stable, like the code).
PROBLEM_TYPE = "urn:envelope-proxy:problem:"
# The HTTP status of a refusal by its code; every other refusal is 403 (policy said no),
# `unknown_tool` too (no operation of the spec matches the method and path: the catalogue
# refuses it like an unknown MCP tool). The statuses below are not policy's "no": wait for a
# person, slow down, a malformed request, or a failure on the way.
_PROBLEM_STATUS: dict[Code, int] = {
    Code.APPROVAL_PENDING: 428,  # retry the same request once a person approved it
    Code.RATE_LIMITED: 429,
    Code.INVALID_REQUEST: 400,
    Code.UPSTREAM_ERROR: 502,
    Code.UPSTREAM_TIMEOUT: 504,
    Code.INTERNAL_ERROR: 500,
    Code.AUDIT_UNAVAILABLE: 503,
    Code.STORE_UNAVAILABLE: 503,
    Code.SHUTDOWN: 503,
}
# Seconds a client whose call waits for approval is asked to wait before it retries.
APPROVAL_RETRY_AFTER = 5
# Upstream response headers that describe bytes the proxy re-renders (never passed as they are).
_BODY_HEADERS = frozenset({"content-length", "content-encoding", "content-type", "etag",
                           "content-md5", "digest", "content-digest", "repr-digest"})


def problem(status: int, code: str, detail: str, headers: Mapping[str, str] | None = None,
            **extensions: Any) -> web.Response:
    """An RFC 9457 problem-details answer: `type` from the reason code, `title` the code in
    words, `detail` the text, `code` and any other members (None values dropped)."""
    body: dict[str, Any] = {"type": f"{PROBLEM_TYPE}{code}", "title": code.replace("_", " ").capitalize(),
                            "status": status, "detail": detail, "code": code}
    body.update({k: v for k, v in extensions.items() if v is not None})
    return web.Response(status=status, body=orjson.dumps(body), content_type=PROBLEM_JSON,
                        headers=headers)


def refusal_problem(outcome: Outcome) -> web.Response:
    """A refusal as problem details: the status for its code (`_PROBLEM_STATUS`, else 403),
    `detail` the text an MCP client reads, the decision's members, `approval_id` when a person
    is asked (with `Retry-After`), `retry_after` when the rate limit says when."""
    decision = outcome.decision
    meta = decision.as_meta(outcome.decision_id)
    text = refusal_result(decision, outcome.decision_id)["content"][0]["text"]
    status = _PROBLEM_STATUS.get(decision.code, 403)
    headers: dict[str, str] = {}
    approval_id = (decision.audit or {}).get("approval_id")
    if decision.code is Code.APPROVAL_PENDING:
        headers["Retry-After"] = str(APPROVAL_RETRY_AFTER)
    elif decision.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(decision.retry_after)))
    return problem(status, decision.code.value, text, headers, check=meta["check"], rule=meta["rule"],
                   reason=meta["reason"], decision_id=meta["decision_id"],
                   approval_id=approval_id if isinstance(approval_id, str) else None,
                   retry_after=meta.get("retry_after"))


def result_body(result: Mapping[str, Any], content_type: str, status: int = 200) -> tuple[bytes, str]:
    """(body, content type) an HTTP client gets for an MCP tool result the envelope rewrote
    (redacted) or holds (a replay, a shadow result): the JSON of `structuredContent` for a JSON
    answer (unwrapped from `{"result": ...}` when the answer was not an object), else the text
    (an error answer's without the `HTTP <status>: ` the MCP result prefixes it with)."""
    structured = result.get("structuredContent")
    text = "".join(c.get("text", "") for c in result.get("content") or ()
                   if isinstance(c, Mapping) and c.get("type") == "text" and isinstance(c.get("text"), str))
    text = text.removeprefix(f"HTTP {status}: ") if status >= 400 else text
    if isinstance(structured, Mapping) and (not content_type or "json" in content_type):
        value: Any = structured
        if set(structured) == {"result"} and not _text_is(text, structured):
            value = structured["result"]
        return orjson.dumps(value), content_type or "application/json"
    return text.encode(), content_type or "text/plain; charset=utf-8"


def _text_is(text: str, value: Any) -> bool:
    """Whether a result's text content is `value` as JSON (an object answer carries both)."""
    try:
        return bool(orjson.loads(text) == value)
    except orjson.JSONDecodeError:
        return False


def http_response(outcome: Outcome, headers: Mapping[str, str] | None) -> web.Response:
    """An outcome of the plain HTTP front as its answer. Delivered: the upstream's status,
    its response headers the client may see (as inspected, from the result's
    `RELAYED_HEADERS_META`; else `headers`) and its body unchanged, or re-rendered
    from the inspected result when a guardrail rewrote it (Content-Length recomputed). Held
    (replay, shadow): 200 with the held result's body, `X-Envelope-Decision` saying which.
    Refused: problem details (`refusal_problem`)."""
    if outcome.kind == "none":
        return web.Response(status=499)  # nobody to answer: the client is gone
    if outcome.kind == "refuse":
        return refusal_problem(outcome)
    result = (outcome.message or {}).get("result") if outcome.kind == "deliver" else outcome.message
    # The response headers as the envelope inspected them (redacted where a guardrail did), when
    # the executor passed them with the result; else those given.
    meta = result.get("_meta") if isinstance(result, Mapping) else None
    inspected = meta.get(RELAYED_HEADERS_META) if isinstance(meta, Mapping) else None
    pairs = ([(str(p[0]), str(p[1])) for p in inspected if isinstance(p, list) and len(p) == 2]
             if isinstance(inspected, list) else list((headers or {}).items()))
    kept = CIMultiDict((k, v) for k, v in pairs if k.lower() != "content-length")
    kept["X-Envelope-Decision-Id"] = outcome.decision_id
    if outcome.kind == "deliver" and outcome.raw is not None:
        return web.Response(status=outcome.status, body=outcome.raw, headers=kept)
    content_type = kept.get("Content-Type", "") if outcome.kind == "deliver" else ""
    for name in _BODY_HEADERS:
        kept.popall(name, None)
    status = outcome.status if outcome.kind == "deliver" else 200
    body, content_type = result_body(result if isinstance(result, Mapping) else {}, content_type, status)
    if outcome.kind == "held":
        kept["X-Envelope-Decision"] = outcome.decision.code.value  # replayed / shadowed
    response = web.Response(status=status, body=body, headers=kept)
    response.content_type = content_type.split(";")[0].strip()
    if "charset=" in content_type:
        response.charset = content_type.split("charset=", 1)[1].split(";")[0].strip()
    return response
