"""Egress: an `Outcome` turned into wire bytes, the same way on every route.

One `render` for every way a call ends: the upstream's answer (its own bytes when the
inspection changed nothing), a refusal (a tool result the model reads, with the decision in
`_meta`; a JSON-RPC error for unknown tools and lost sessions), a result the envelope holds
(replay, shadow), an in-band approval request (`input_required`), in JSON or as the last event
of the call's SSE stream. Fronts never build a refusal themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import orjson
from aiohttp import web

from proxy.envelope.outcome import DECISION_META, refusal_result
from proxy.envelope.types import Code, Outcome
from proxy.fronts import jsonrpc
from proxy.fronts.sse import format_event

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


async def respond(outcome: Outcome, client_id: Any, *, stateless: bool,
                  stream: web.StreamResponse | None = None, headers: Mapping[str, str] | None = None,
                  tool: str = "", ask: dict[str, Any] | None = None, same_id: bool = True) -> web.StreamResponse:
    """Send an outcome: as the last event of the call's open SSE `stream`, else as a JSON
    response (`headers` are the upstream's response headers to keep, for a delivered answer)."""
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
        return web.Response(status=status, body=body, headers=headers)  # the upstream's own
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
