"""JSON-RPC 2.0 message parsing and error bodies for the MCP front, with input limits."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.observability.metrics import RejectReason

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020  # 2026-07-28: an Mcp-* header disagrees with the body


class BadMessage(Exception):
    """The request body is not an acceptable JSON-RPC message; carries the wire error."""

    def __init__(self, code: int, message: str, reason: RejectReason, id: Any = None, status: int = 400,
                 close: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason  # bounded metric label
        self.id = id
        self.status = status
        self.close = close  # the answer closes the connection (the body was not read to its end)


@dataclass(slots=True)
class Message:
    body: dict[str, Any]

    @property
    def method(self) -> str | None:
        m = self.body.get("method")
        return m if isinstance(m, str) else None

    @property
    def id(self) -> Any:
        return self.body.get("id")

    @property
    def is_request(self) -> bool:
        return self.method is not None and "id" in self.body

    @property
    def params(self) -> dict[str, Any]:
        p = self.body.get("params")
        return p if isinstance(p, dict) else {}


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True when containers nest deeper than `limit` (iterative: no recursion limit)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


# orjson reads integers in this range exactly, and any other as a (rounded) float.
_EXACT_INTS = range(-(2**63), 2**64)
# The most significant digits any double needs to be written so that it reads back the same:
# serializers never write more, and a literal with more names a value the proxy reads rounded.
_MAX_DIGITS = 17
# A number past either bound has a run of 18 digits and dots: bodies without one skip the
# per-number hooks.
_NUMBER_BYTES = bytes(0x30 if chr(b) in "0123456789." else 0x20 for b in range(256))
_LONG_RUN = b"0" * 18


def long_number(body: bytes) -> bool:
    """Whether `body` holds a run of 18 digits and dots (what `[0-9.]{18}` finds). Searched in
    the body with digits and dots made "0" and every other byte " ": two C passes, 7x faster than
    the regex on a small call and 14x on a 60 KB text (`re` steps the class at each byte)."""
    return _LONG_RUN in body.translate(_NUMBER_BYTES)


def _significant_digits(literal: str) -> int:
    mantissa = literal.lstrip("-+").lower().partition("e")[0].replace(".", "")
    return len(mantissa.strip("0"))


class _Ambiguous(Exception):
    """Raised by the second reading's hooks: why the body reads two ways."""


def _pairs(items: list[tuple[str, Any]]) -> None:
    # Nothing is built from the second reading: it only looks for a member named twice.
    if len(items) > 1 and len({name for name, _ in items}) != len(items):
        raise _Ambiguous("a JSON object names a member twice")


def _integer(literal: str) -> None:
    if int(literal) not in _EXACT_INTS:
        raise _Ambiguous(f"the integer {literal[:40]} is beyond 64 bits")


def _number(literal: str) -> None:
    if _significant_digits(literal) > _MAX_DIGITS:
        raise _Ambiguous(f"the number {literal[:40]} has more than {_MAX_DIGITS} significant digits")


# Built once (json.loads with hooks builds a decoder per call, a third of the cost of a small
# message); the hooks keep no state, so one decoder serves every thread.
_READER = json.JSONDecoder(object_pairs_hook=_pairs)
_NUMBER_READER = json.JSONDecoder(object_pairs_hook=_pairs, parse_int=_integer, parse_float=_number)
# Past this many bytes the second reading runs in a worker thread (`read_twice`): it costs
# about 10x orjson's (~80 µs per KiB of small objects), which must not stall the event loop.
INLINE_REREAD_BYTES = 4096


def ambiguity(body: bytes) -> str | None:
    """Why `body` (JSON orjson already took) could read differently to the proxy than to an
    upstream, or None. The proxy checks the values it read and forwards the body as sent, so
    two readings would let the method the envelope saw, or the arguments a person approved
    (their digest), differ from what runs:

    - an object naming a member twice, escapes decoded (`"\\u006dethod"` is `"method"`): the
      proxy reads the last, an upstream may read the first;
    - a number the proxy reads rounded: an integer outside 64 bits, or a literal with more than
      17 significant digits (two such numbers can share one digest while a big-number upstream
      tells them apart).

    JSON that the second parser cannot take counts as ambiguous (fail closed)."""
    reader = _NUMBER_READER if long_number(body) else _READER
    try:
        reader.decode(body.decode("utf-8"))
    except _Ambiguous as exc:
        return str(exc)
    except (ValueError, RecursionError):
        return "the JSON cannot be read twice the same way"
    return None


def _canonical(value: Any, body: bytes) -> bool:
    """Whether `body` is byte for byte what orjson writes for `value` (what most clients send:
    compact JSON, members in order). Such a body reads one way only, so the second reading
    (`ambiguity`, ~5x orjson's parse) is skipped: orjson writes each member of an object once,
    every integer within 64 bits, every float in at most 17 significant digits, and nests at
    most 254 levels (far inside the second parser's recursion limit)."""
    try:
        return orjson.dumps(value) == body
    except orjson.JSONEncodeError:
        return False


async def read_twice(body: bytes) -> str | None:
    """`ambiguity(body)`, in a worker thread past INLINE_REREAD_BYTES."""
    if len(body) <= INLINE_REREAD_BYTES:
        return ambiguity(body)
    return await asyncio.to_thread(ambiguity, body)


async def relayable(data: bytes | str, value: Any) -> bool:
    """Whether an upstream's JSON `data`, which orjson read as `value` (before anything changed
    it), may reach the client as it came: not when it reads two ways (`ambiguity`): an object
    naming a member twice (orjson keeps the last and the envelope inspects that; a client
    reading the first would get a value nobody inspected), or a number the proxy read rounded
    (an integer past 64 bits, a literal of more than 17 significant digits: a client reading it
    exact would get digits nobody inspected). Such a message is re-rendered from `value`, so the
    client reads what was inspected. Bytes that orjson writes for `value` (`_canonical`: what
    the MCP SDKs send) cost one `orjson.dumps`; any other is read a second time, in a worker
    thread past INLINE_REREAD_BYTES."""
    body = data.encode() if isinstance(data, str) else data
    if _canonical(value, body):
        return True
    return await read_twice(body) is None


def parse_message(body: bytes, max_depth: int) -> Message:
    """Parse one JSON-RPC message; BadMessage with the JSON-RPC error to send otherwise. A body
    past INLINE_REREAD_BYTES is not read the second time here (`ambiguity`): `parse_post`, the
    fronts' entry, does it off the loop; a smaller one that orjson would write byte for byte
    (`_canonical`) needs no second reading."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        text = str(exc)
        if "depth limit" in text or "recursion" in text:
            raise BadMessage(
                INVALID_REQUEST, f"JSON nested deeper than {max_depth} levels", "too_deep"
            ) from None
        if "UTF-8" in text:
            raise BadMessage(PARSE_ERROR, f"Parse error: invalid UTF-8 ({text})", "parse_error") from None
        raise BadMessage(PARSE_ERROR, f"Parse error: {text}", "parse_error") from None
    if isinstance(value, list):
        raise BadMessage(
            INVALID_REQUEST, "Batch requests are not supported: send one JSON-RPC message per POST", "batch"
        )
    if not isinstance(value, dict):
        raise BadMessage(INVALID_REQUEST, "Invalid Request: body must be a JSON-RPC object", "invalid_request")
    # Containers cannot nest deeper than there are brackets (a C-speed count): most messages
    # skip the walk.
    if body.count(b"{") + body.count(b"[") > max_depth and _depth_exceeds(value, max_depth):
        raise BadMessage(
            INVALID_REQUEST, f"JSON nested deeper than {max_depth} levels", "too_deep", id=_safe_id(value)
        )
    if len(body) <= INLINE_REREAD_BYTES and not _canonical(value, body):
        _refuse_ambiguous(ambiguity(body), value)
    if value.get("jsonrpc") != "2.0":
        raise BadMessage(INVALID_REQUEST, 'Invalid Request: "jsonrpc" must be "2.0"', "invalid_request", id=_safe_id(value))
    method = value.get("method")
    if method is not None and not isinstance(method, str):
        raise BadMessage(INVALID_REQUEST, 'Invalid Request: "method" must be a string', "invalid_request", id=_safe_id(value))
    if "id" in value and not _valid_id(value["id"]):
        raise BadMessage(INVALID_REQUEST, 'Invalid Request: "id" must be a string or an integer', "invalid_request")
    if method is None and "result" not in value and "error" not in value:
        raise BadMessage(INVALID_REQUEST, 'Invalid Request: no "method", "result" or "error"', "invalid_request", id=_safe_id(value))
    params = value.get("params")
    if params is not None and not isinstance(params, dict | list):
        raise BadMessage(INVALID_PARAMS, 'Invalid params: "params" must be an object', "invalid_request", id=_safe_id(value))
    return Message(value)


def _refuse_ambiguous(why: str | None, value: dict[str, Any]) -> None:
    if why is not None:
        raise BadMessage(
            INVALID_REQUEST, f"Invalid Request: {why} (the proxy and the upstream could read "
            "different values)", "invalid_request", id=_safe_id(value))


async def parse_post(body: bytes, max_depth: int, mcp_method: str | None) -> Message:
    """The message of an MCP POST: `parse_message`, plus what every front refuses on top. A
    `tools/call` without an id would slip past the envelope as a "notification"; an
    `Mcp-Method` header (2026-07-28) must name the body's method. A body past
    INLINE_REREAD_BYTES is read the second time (`ambiguity`) in a worker thread."""
    msg = parse_message(body, max_depth)
    if len(body) > INLINE_REREAD_BYTES:
        _refuse_ambiguous(await read_twice(body), msg.body)
    if msg.method == "tools/call" and not msg.is_request:
        raise BadMessage(INVALID_REQUEST, 'Invalid Request: "tools/call" must be a request with an "id"',
                         "invalid_request")
    if mcp_method is not None and msg.method is not None and mcp_method != msg.method:
        raise BadMessage(HEADER_MISMATCH,
                         f"Mcp-Method header {mcp_method!r} does not match the body's method {msg.method!r}",
                         "header_mismatch", id=msg.id)
    return msg


def _valid_id(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))


def _safe_id(value: dict[str, Any]) -> Any:
    v = value.get("id")
    return v if _valid_id(v) else None


def error_body(id: Any, code: int, message: str, data: Any = None) -> bytes:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return orjson.dumps({"jsonrpc": "2.0", "id": id, "error": err})


def result_body(id: Any, result: dict[str, Any]) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": id, "result": result})
