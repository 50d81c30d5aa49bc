"""Approval and grant records: a person's decision bound to one exact call, and the grants that
pre-approve a narrow family of later calls (see `proxy.approvals` for their life)."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import orjson

from proxy.approvals.reveal import hidden_characters, revealed, revealed_json
from proxy.errors import EnvelopeError
from proxy.policy.vocab import parse_duration

NS_APPROVAL = "approval"
NS_BY_CALL = "approval_by_call"
NS_GRANT = "grant"
# Arguments over `LIST_ARGUMENTS_BYTES`, stored apart from their approval (same id, same expiry
# or a little later): the record then keeps their size and the list's preview, so listing,
# polling and deciding read and rewrite a few KiB, never the arguments.
NS_ARGUMENTS = "approval_arguments"
# The grants' index: one store hash per principal, upstream, tool and run (`grant_key`), grant id
# -> the grant. A call reads the two hashes it can match (tool scope, its run's scope), never
# the first 1,000 grants of the store.
NS_GRANT_INDEX = "grant_index"

State = Literal["pending", "approved", "denied", "expired", "consumed"]
STATES: tuple[State, ...] = ("pending", "approved", "denied", "expired", "consumed")
GrantScope = Literal["tool", "run"]

_OPT = orjson.OPT_SORT_KEYS

# The most bytes of arguments (as compact JSON, UTF-8) an approval shows in a list (`GET
# /v1/approvals`, polled by the review page): past it the list carries a preview of this many
# bytes instead (`arguments_truncated`), and the approval read by id shows them whole. A list of
# 100 approvals of 1 MB was 200 MB per answer.
LIST_ARGUMENTS_BYTES = 8 * 1024

# An approval id as `new_approval_id` makes it: `apr-` and 16 lowercase hex digits.
_APPROVAL_ID = re.compile(r"apr-[0-9a-f]{16}")


def new_approval_id() -> str:
    """A fresh approval id (64 random bits)."""
    return f"apr-{secrets.token_hex(8)}"


def is_approval_id(text: str) -> bool:
    """Whether `text` has the shape `new_approval_id` gives (the admin API's failed-
    authentication records name nothing else a caller sent as an id)."""
    return _APPROVAL_ID.fullmatch(text) is not None


class ApprovalError(EnvelopeError):
    """An approver's request cannot be carried out (maps to a 4xx answer)."""

    status = 400


class ApprovalNotFound(ApprovalError):
    """No approval (or grant) has this id."""

    status = 404


class ApprovalConflict(ApprovalError):
    """The approval is no longer pending (decided, consumed or expired)."""

    status = 409


class SelfApproval(ApprovalError):
    """An approver tried to decide a call made by themselves."""

    status = 403


class OutOfScope(ApprovalError):
    """An approver tried to decide a call outside their `scope`."""

    status = 403


class InvalidGrant(ApprovalError):
    """The grant in an approve request is malformed or too long."""

    status = 400



class InvalidRequestState(ApprovalError):
    """A `requestState` the proxy did not mint, for another call or approval, or expired."""

    status = 400



def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=_OPT)


@dataclass(frozen=True, slots=True)
class CallBinding:
    """What an approval is bound to: exactly one call."""

    principal: str
    run: str
    upstream: str
    tool: str
    args_digest: str

    @property
    def key(self) -> str:
        """A fixed-length store key (ids and names may hold any character)."""
        raw = orjson.dumps([self.principal, self.run, self.upstream, self.tool, self.args_digest])
        return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True, slots=True)
class Approval:
    """One approval request and its decision (a store record)."""

    id: str
    state: State
    principal: str
    run: str
    upstream: str
    tool: str
    args_digest: str
    arguments: dict[str, Any]  # shown to approvers: they decide on what the call does
    effect: str
    reason: str  # why the call is gated
    created_at: float
    expires_at: float
    decision_id: str | None = None  # the call that asked for it
    approver: str | None = None
    decision_reason: str | None = None
    decided_at: float | None = None
    consumed_at: float | None = None
    grant_id: str | None = None  # a grant the approver gave with the approval
    # Data-flow evidence when the data-flow check sent the call here (`on_flag: approve`): each
    # {kind, argument, source, snippet}, shown to the approver beside the arguments. None: gated
    # by effect only (and records written before the field existed).
    evidence: list[dict[str, Any]] | None = None
    # The audit record of the person's decision (`<approval>`, written before it was stored),
    # which the released call's record names as `extra.approval_record`. None: undecided, decided
    # in-band (the call's own record carries it), or a record written before the field existed.
    decision_record: str | None = None
    # Arguments over LIST_ARGUMENTS_BYTES (compact JSON) are stored apart (`NS_ARGUMENTS`): the
    # record holds `arguments` null, their size and the list's preview (their first
    # LIST_ARGUMENTS_BYTES as indented JSON). Read whole (`ApprovalService.get`), an approval has
    # its arguments; read as a head (listing, polling), `{}` and the preview. None, None: the
    # arguments are in the record (small ones, and records written before session 14).
    arguments_bytes: int | None = None
    arguments_preview: str | None = None

    @property
    def apart(self) -> bool:
        """Whether the arguments are stored apart from the record."""
        return self.arguments_preview is not None

    @property
    def binding(self) -> CallBinding:
        return CallBinding(self.principal, self.run, self.upstream, self.tool, self.args_digest)

    def effective_state(self, now: float) -> State:
        """The state as of `now`: pending or approved past `expires_at` is expired."""
        if self.state in ("pending", "approved") and now >= self.expires_at:
            return "expired"
        return self.state

    def encode(self) -> bytes:
        """The stored record (without the arguments when they are stored apart: the same bytes
        for a head and for the approval read whole, which compare-and-set relies on). Size and
        preview unset are left out: a record of the previous version encodes as it was stored
        (consuming an approval it approved compares these bytes)."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("arguments_bytes", "arguments_preview"):
            if record[name] is None:
                del record[name]
        if self.apart:
            record["arguments"] = None
        return _canonical(record)

    @classmethod
    def decode(cls, raw: bytes) -> Approval:
        """A stored record; arguments stored apart read as `{}` (a head)."""
        data = orjson.loads(raw)
        if data.get("arguments") is None:
            data["arguments"] = {}
        return cls(**data)

    def with_arguments(self, arguments: dict[str, Any]) -> Approval:
        """This approval with its arguments (read apart) in place."""
        return replace(self, arguments=arguments)

    @staticmethod
    def cut(arguments: dict[str, Any], cut_at: int = LIST_ARGUMENTS_BYTES) -> tuple[int, str | None]:
        """(size of `arguments` as compact JSON, the preview of their first `cut_at` bytes as
        indented JSON, or None when they are not larger than `cut_at`)."""
        size = len(orjson.dumps(arguments))
        if size <= cut_at:
            return size, None
        head = orjson.dumps(arguments, option=orjson.OPT_INDENT_2)[:cut_at]
        # A character cut in two is dropped whole ("ignore" can only meet it at the end).
        return size, head.decode("utf-8", errors="ignore")

    def view(self, now: float, cut_at: int | None = None) -> dict[str, Any]:
        """The JSON shape of the admin API (state as of `now`), with the arguments as the
        approver must read them (`arguments_text`: hidden characters escaped) and where such
        characters are (`hidden_characters`; see `proxy.approvals.reveal`), their size
        (`arguments_bytes`: compact JSON, UTF-8) and whether they are cut (`arguments_truncated`).

        With `cut_at` (a list: `LIST_ARGUMENTS_BYTES`), arguments larger than that are cut: the
        view then carries `arguments` and `hidden_characters` null and, as `arguments_text`, a
        preview: their first `cut_at` bytes as indented JSON, hidden characters escaped (no longer
        JSON; an escape makes a hidden character up to six characters long). An approver decides
        on the view read by id, never on a preview.

        A head (arguments stored apart, not read) always gives the preview: it has no more."""
        # Arguments stored apart are never empty (they are over LIST_ARGUMENTS_BYTES).
        head_only = self.apart and not self.arguments
        size = self.arguments_bytes if self.arguments_bytes is not None else len(orjson.dumps(self.arguments))
        # Shallow: the answer is serialised at once (`asdict` would copy the arguments first).
        view = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "arguments_preview"}
        view.update(state=self.effective_state(now), arguments_bytes=size)
        if head_only or (cut_at is not None and size > cut_at):
            if self.apart and (head_only or cut_at == LIST_ARGUMENTS_BYTES):
                text = self.arguments_preview
            else:
                text = self.cut(self.arguments, cut_at or LIST_ARGUMENTS_BYTES)[1]
            return {**view, "arguments": None, "arguments_text": revealed(text or ""),
                    "hidden_characters": None, "arguments_truncated": True}
        return {**view, "arguments_text": revealed_json(self.arguments),
                "hidden_characters": hidden_characters(self.arguments),
                "arguments_truncated": False}


def grant_key(principal: str, upstream: str, tool: str, run: str | None) -> str:
    """The grants' index key of the grants a call of `principal` to `upstream`.`tool` may match:
    run None for tool-scoped grants, else those of that run. A fixed-length digest (names may
    hold any character)."""
    return hashlib.sha256(orjson.dumps([principal, upstream, tool, run])).hexdigest()


@dataclass(frozen=True, slots=True)
class Grant:
    """A standing approval: later calls of one principal to one tool (optionally in one run)
    whose arguments hold the given exact values go ahead without waiting."""

    id: str
    scope: GrantScope
    principal: str
    upstream: str
    tool: str
    run: str | None
    args: dict[str, Any]
    approver: str
    reason: str
    approval_id: str
    created_at: float
    expires_at: float

    def matches(self, binding: CallBinding, arguments: Mapping[str, Any], now: float) -> bool:
        if now >= self.expires_at:
            return False
        if (binding.principal, binding.upstream, binding.tool) != (self.principal, self.upstream, self.tool):
            return False
        if self.scope == "run" and binding.run != self.run:
            return False
        # Exact JSON equality: canonical bytes, so 1 != true and key order does not matter.
        return all(k in arguments and _canonical(arguments[k]) == _canonical(v) for k, v in self.args.items())

    @property
    def key(self) -> str:
        """Its hash in the grants' index (`NS_GRANT_INDEX`)."""
        return grant_key(self.principal, self.upstream, self.tool, self.run if self.scope == "run" else None)

    def encode(self) -> bytes:
        return _canonical(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Grant:
        return cls(**orjson.loads(raw))

    def view(self, now: float) -> dict[str, Any]:
        return {**asdict(self), "active": now < self.expires_at}


@dataclass(frozen=True, slots=True)
class GrantRequest:
    """The `grant` of an approve request, validated."""

    scope: GrantScope
    args: dict[str, Any]
    duration: float

    @classmethod
    def parse(cls, data: Any, max_duration: float) -> GrantRequest:
        """Validate `{"scope": "tool"|"run", "args": {...}, "duration": "30m"}`; InvalidGrant otherwise."""
        if not isinstance(data, dict):
            raise InvalidGrant("grant must be an object {scope, args, duration}")
        unknown = set(data) - {"scope", "args", "duration"}
        if unknown:
            raise InvalidGrant(f"unknown grant field(s): {', '.join(sorted(unknown))}")
        scope = data.get("scope")
        if scope not in ("tool", "run"):
            raise InvalidGrant('grant scope must be "tool" or "run"')
        args = data.get("args", {})
        if not isinstance(args, dict):
            raise InvalidGrant("grant args must be an object of exact argument values")
        try:
            duration = parse_duration(data.get("duration", "1h"))
        except ValueError as exc:
            raise InvalidGrant(f"grant duration: {exc}") from None
        if not 0 < duration <= max_duration:
            raise InvalidGrant(f"grant duration must be more than 0 and at most {max_duration:g}s")
        return cls(scope, args, duration)


