"""The audit record of one decision: a versioned event, masked before it is written.

Arguments are recorded by digest only unless the tool's policy asks for them (`log_args`);
then the values the policy names in `mask` are replaced by "***" in the recorded copy (the
digest is always of the real arguments, so a call can still be matched to its record).
Built on the hot path of every call: plain dict, no validation layer.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

RECORD_VERSION = 1
MASKED = "***"
_OPT = orjson.OPT_SORT_KEYS

# Formatting the date part costs more than the rest of the record: cache it per second.
_ts_cache: tuple[int, str] = (-1, "")


def utc_timestamp(ns: int | None = None) -> str:
    """RFC 3339 UTC with microseconds and "Z", e.g. "2026-01-02T03:04:05.123456Z"."""
    global _ts_cache
    sec, rem = divmod(time.time_ns() if ns is None else ns, 1_000_000_000)
    cached_sec, prefix = _ts_cache
    if sec != cached_sec:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _ts_cache = (sec, prefix)
    return "%s.%06dZ" % (prefix, rem // 1000)  # noqa: UP031 - faster than an f-string here


def canonical_args(arguments: Mapping[str, Any]) -> bytes:
    """The canonical JSON (sorted keys, no spaces) of the arguments: what `args_digest` hashes
    and what a record's `args` holds. Raises TypeError (orjson.JSONEncodeError) for non-JSON
    values."""
    return orjson.dumps(arguments, option=_OPT)


def digest_of(canonical: bytes) -> str:
    """"sha256:<hex>" of canonical argument bytes."""
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def args_digest(arguments: Mapping[str, Any]) -> str:
    """Return "sha256:<hex>" of the canonical JSON (sorted keys, no spaces) of the arguments.

    Independent of key order. Raises TypeError (orjson.JSONEncodeError) for non-JSON values.
    """
    return digest_of(canonical_args(arguments))


def _pointer(pointer: str) -> list[str]:
    """The unescaped segments of a JSON pointer ("/a~1b/~0c" -> ["a/b", "~c"])."""
    return [seg.replace("~1", "/").replace("~0", "~") for seg in pointer.split("/")[1:]]


def _mask_names(value: Any, names: frozenset[str]) -> Any:
    """A copy of `value` with every object member named in `names` masked, at any depth."""
    if isinstance(value, Mapping):
        return {k: MASKED if k in names else _mask_names(v, names) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_names(v, names) for v in value]
    return value


def _mask_pointer(value: Any, segments: Sequence[str]) -> Any:
    """A copy of `value` with the member at `segments` masked (copies only along the path);
    `value` itself when the path does not exist. `*` matches every element or member."""
    if not segments:
        return MASKED
    head, rest = segments[0], segments[1:]
    if isinstance(value, Mapping):
        keys: Iterable[Any] = value.keys() if head == "*" else ([head] if head in value else [])
        out = None
        for k in keys:
            new = _mask_pointer(value[k], rest)
            if new is not value[k]:
                if out is None:
                    out = dict(value)
                out[k] = new
        return value if out is None else out
    if isinstance(value, list | tuple):
        if head == "*":
            idx: Iterable[int] = range(len(value))
        elif head.isdigit() and (head == "0" or not head.startswith("0")) and int(head) < len(value):
            idx = [int(head)]
        else:
            idx = []
        lst = None
        for i in idx:
            new = _mask_pointer(value[i], rest)
            if new is not value[i]:
                if lst is None:
                    lst = list(value)
                lst[i] = new
        return value if lst is None else lst
    return value


def mask_arguments(arguments: Mapping[str, Any], mask: Iterable[str]) -> Mapping[str, Any]:
    """The arguments with every masked value replaced by "***"; never modifies `arguments`.

    A `mask` entry starting with "/" is a JSON pointer (RFC 6901; `*` as a segment matches every
    array element or object member); any other entry is a member name masked at any depth
    (nested objects and arrays included). Paths that do not exist are ignored. Returns
    `arguments` itself when nothing is masked.
    """
    names = frozenset(m for m in mask if not m.startswith("/"))
    result: Any = _mask_names(arguments, names) if names else arguments
    for m in mask:
        if m.startswith("/"):
            result = _mask_pointer(result, _pointer(m))
    return result


def _value(v: Any) -> Any:
    # Enums (Verdict, Code) are recorded by value, so a record equals its parsed JSON.
    # `_value_`, not `.value`: the property costs ~1 µs on the hot path.
    return v if type(v) is str else v._value_


def build_record(
    *,
    decision_id: str,
    revision: str,
    principal: str,
    session: str | None,
    run: str,
    upstream: str,
    tool: str,
    verdict: str,
    code: str,
    check: str,
    rule: str | None,
    reason: str,
    arguments: Mapping[str, Any],
    log_args: bool,
    latency: Mapping[str, float],
    upstream_status: int | None,
    extra: Mapping[str, Any] | None = None,
    mask: Sequence[str] = (),
    method: str | None = None,
    canonical: bytes | None = None,
) -> dict[str, Any]:
    """The audit record (schema version 1) of one decision, ready for `AuditLog.write`.

    `latency` is seconds per stage (as measured, e.g. with `perf_counter`); the record holds
    milliseconds rounded to 3 decimals under `latency_ms`. `verdict` and `code` may be the
    enums of `proxy.envelope.types`. `extra`, when given, is kept under its own `extra` key so
    it can never shadow a versioned field. `args` is present only when `log_args`, with the
    values named by `mask` replaced by "***" (see `mask_arguments`); `args_digest` is always
    the digest of the real, unmasked arguments. `canonical`, the arguments' `canonical_args`
    when the caller has them, is hashed and (unmasked) recorded as is, never serialised again.
    `method` is the MCP method the record is about (absent: `tools/call`).
    """
    if canonical is None:
        canonical = canonical_args(arguments)
    rec: dict[str, Any] = {
        "v": RECORD_VERSION,
        "ts": utc_timestamp(),
        "decision_id": decision_id,
        "revision": revision,
        "principal": principal,
        "session": session,
        "run": run,
        "upstream": upstream,
        "tool": tool,
        "verdict": _value(verdict),
        "code": _value(code),
        "check": check,
        "rule": rule,
        "reason": reason,
        "args_digest": digest_of(canonical),
        # round(x * 1e6) / 1000 == round(x * 1000, 3), at a tenth of the cost.
        "latency_ms": {stage: round(s * 1e6) / 1000 for stage, s in latency.items()},
        "upstream_status": upstream_status,
    }
    if method is not None and method != "tools/call":
        rec["method"] = method
    if log_args:
        # Canonical bytes are sorted already, so the line stays canonical (the chain's hash).
        rec["args"] = mask_arguments(arguments, mask) if mask else orjson.Fragment(canonical)
    if extra:
        rec["extra"] = dict(extra)
    return rec
