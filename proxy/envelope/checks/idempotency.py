"""Idempotency check: a retry of a call already performed returns the stored first result.

Applies to gated effects (`proxy.envelope.effects.gated`), to tools with `idempotent: true`, to
every call carrying a client idempotency key and to every call with an approval still to spend.
The first call claims its key in the store (`add`: atomic, also across replicas sharing Redis),
then spends its approval when the approval check released it as approved (`call.spend_approval`:
after the claim, so a duplicate that finds the approval consumed finds the claim too and waits
for the first call instead of being told its approval is used up; see
`proxy.envelope.checks.approval`), and registers a result hook: an upstream
JSON-RPC `result` is stored for replay for `idempotency.ttl`. A call that may have been performed
without a result to keep (its request was written upstream, even partly, and then: an HTTP 5xx,
a reset or end of the connection, an answer that is no reply, a timeout, its client left, the
proxy stopped) leaves an `unknown` record for `idempotency.ttl` too: a retry is refused at once
(`idempotency_in_flight`, naming the decision whose outcome is unknown), never performed again;
unless the policy declares the tool `idempotent: true` (safe to perform twice). Beside it, an
index entry (`UNKNOWN_NS`, keyed by that decision id, for as long) names its store key and the
call: the store key is a digest, so the decision id a refusal names cannot find it otherwise. An
approver who knows the call was not performed releases the key through it (`find_unknown`,
`release`: the admin API's `POST /v1/idempotency/<decision id>/release`). Only a call
certainly not performed frees the key for a retry: never sent (refused by a check, no
connection), or refused by the upstream itself (an HTTP 4xx, or a JSON-RPC error in an answer
that is not a 5xx). A duplicate that finds the claim still in flight polls the store for up to
`idempotency.wait` and answers with the same result, or refuses `idempotency_in_flight`.

Keys: the client's key (`Idempotency-Key` header or `_meta["envelope/idempotency_key"]`), scoped
to the principal, upstream and tool so one client cannot read another's results; else a key
derived from principal, run, upstream, tool and the argument digest. A client key reused with
other arguments is refused (`idempotency_conflict`) rather than answered with another call's
result.

Fail closed: with no store, or a store that cannot answer, the call is refused; it is never
performed without a record that keeps it from being performed twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from proxy.envelope.effects import gated
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, ResultHook, Services, ToolCall, Verdict, deny
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.store.base import Store

NS = "idem"
# Decision id -> the store key (and the call) of its `unknown` record: see `find_unknown`.
UNKNOWN_NS = "idem_unknown"
DEFAULT_TTL = 24 * 3600.0
DEFAULT_WAIT = 30.0
# A claim outlives the longest the first call can take (upstream timeout, a duplicate's wait)
# by this margin. A claim left by a proxy that died mid-call then frees itself instead of
# refusing every retry for a whole `ttl`.
CLAIM_MARGIN = 60.0
POLL_FIRST = 0.02
POLL_MAX = 0.25


def certainly_not_performed(call: ToolCall, reply: Mapping[str, Any] | None) -> bool:
    """Whether a call that ended without a result to keep was certainly not performed: never
    sent (nothing written upstream), or refused by the upstream (an HTTP 4xx; a JSON-RPC error
    in an answer that is not a 5xx). Anything else sent may have been performed: a 5xx, a
    connection reset or closed after the request was written, an answer that is no reply, a
    timeout, a client that left or a proxy that stopped mid-call."""
    if not call.maybe_sent:
        return True
    status = call.upstream_status
    if status is None or status >= 500:
        return False
    return 400 <= status < 500 or (isinstance(reply, Mapping) and "error" in reply)


@dataclass(frozen=True, slots=True)
class IdempotencyKey:
    """A call's key: `store` is the store key, `shown` what audit records carry."""

    store: str
    shown: str


def call_key(call: ToolCall, digest: str) -> IdempotencyKey:
    """The call's idempotency key (see the module docstring for the scoping)."""
    pid = call.principal.id
    if call.idempotency_key is not None:
        material = f"client\0{pid}\0{call.upstream}\0{call.tool}\0{call.idempotency_key}"
        h = hashlib.sha256(material.encode()).hexdigest()
        return IdempotencyKey(h, call.idempotency_key)
    material = f"derived\0{pid}\0{call.run.id}\0{call.upstream}\0{call.tool}\0{digest}"
    h = hashlib.sha256(material.encode()).hexdigest()
    return IdempotencyKey(h, f"derived:{h[:16]}")


def _load(raw: bytes) -> dict[str, Any]:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise StoreError(f"unreadable idempotency record: {exc}") from exc
    if not isinstance(record, dict):
        raise StoreError("unreadable idempotency record: not an object")
    return record


class IdempotencyCheck:
    """Claims a call's key, or answers a duplicate with the first call's stored result."""

    id: ClassVar[str] = "idempotency"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._revision = revision
        self._services = services
        self._idempotent = frozenset(
            key for key, tool in revision.tools.items() if tool.policy.idempotent
        )
        cfg = services.settings.idempotency if services is not None else None
        self._ttl: float = cfg.ttl if cfg is not None else DEFAULT_TTL
        self._wait: float = cfg.wait if cfg is not None else DEFAULT_WAIT
        self._timeouts = {name: up.timeout for name, up in revision.document.upstreams.items()}

    def applies(self, call: ToolCall) -> bool:
        return (
            call.spend_approval is not None  # never forwarded with an approval left unspent
            or call.idempotency_key is not None
            or call.qualified_name in self._idempotent
            or gated(self._revision, call)
        )

    async def decide(self, call: ToolCall) -> Decision | None:
        """None after claiming the key (the call goes on); a replay of the stored result for a
        duplicate. Refuses `misconfigured` without a store, `store_unavailable` when the store
        fails, `idempotency_in_flight` when the first call does not finish within the wait and
        `idempotency_conflict` for a client key reused with other arguments."""
        store: Store | None = self._services.store if self._services is not None else None
        if store is None:
            return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                            "idempotency needs a state store and none is configured; "
                            "the call was refused")
        digest = call.args_digest()
        key = call_key(call, digest)
        try:
            return await self._claim_or_replay(store, call, key, digest)
        except (StoreError, TimeoutError) as exc:
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"the state store cannot record this call ({exc or 'timed out'}); "
                            "refused rather than risk performing it twice")

    def _claim_ttl(self, call: ToolCall) -> float:
        return min(self._ttl, self._timeouts.get(call.upstream, 30.0) + self._wait + CLAIM_MARGIN)

    async def _claim_or_replay(self, store: Store, call: ToolCall, key: IdempotencyKey,
                               digest: str) -> Decision | None:
        claim = orjson.dumps({"state": "inflight", "decision_id": call.decision_id,
                              "args_digest": digest, "at": time.time()})
        deadline = time.monotonic() + self._wait
        poll = POLL_FIRST
        while True:
            if await store.add(NS, key.store, claim, ttl=self._claim_ttl(call)):
                if call.audit_extra.get("approval_state") == "consumed":
                    # Its one approval was already spent, and only a call holding its claim
                    # spends one: with this key free, that call has ended and no result of it
                    # is stored to replay (it failed, or the record expired; or it had another
                    # client key). Never perform it a second time on that approval; unbind
                    # it, so that calling again asks a person anew (else every retry would be
                    # refused for as long as the spent approval is kept).
                    await store.delete(NS, key.store)
                    if call.forget_approval is not None:
                        await call.forget_approval()
                    return Decision(
                        Verdict.DENY, Code.APPROVAL_EXPIRED, self.id,
                        "the approval for this call was already used and no result of it is "
                        "stored; calling again asks for a new approval",
                    )
                # Spent only now, under the claim: see the module docstring.
                spend, call.spend_approval = call.spend_approval, None
                if spend is not None:
                    refused = await self._spend(store, key, spend)
                    if refused is not None:
                        return refused
                call.on_result.append(self._recorder(store, key, digest))
                call.audit_extra["idempotency_key"] = key.shown
                return None
            raw = await store.get(NS, key.store)
            if raw is not None:
                record = _load(raw)
                if record.get("args_digest") != digest:
                    return deny(Code.IDEMPOTENCY_CONFLICT, self.id,
                                f"idempotency key {key.shown!r} was used for a call with other "
                                "arguments; use a new key for a new call")
                if record.get("state") == "done" and isinstance(record.get("result"), dict):
                    return self._replay(key, record)
                if record.get("state") == "unknown":
                    return self._unknown(key, record)
            # In flight elsewhere (or the claim just went away: the next `add` takes it).
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Decision(
                    Verdict.ERROR, Code.IDEMPOTENCY_IN_FLIGHT, self.id,
                    f"the same call (idempotency key {key.shown!r}) is still being performed; "
                    f"it did not finish within {self._wait:g}s, retry later",
                )
            await asyncio.sleep(min(poll, remaining))
            poll = min(poll * 2, POLL_MAX)

    @staticmethod
    async def _spend(store: Store, key: IdempotencyKey,
                     spend: Callable[[], Awaitable[Decision | None]]) -> Decision | None:
        """Spend the call's approval while holding its claim: None when spent; the approval
        check's refusal otherwise, the claim then released (nothing was performed)."""
        try:
            refused = await spend()
        except BaseException:
            # A store failure or a cancellation: the call is not performed; free the key for a
            # retry (the claim would expire anyway) when the store still answers.
            with contextlib.suppress(StoreError, TimeoutError):
                await store.delete(NS, key.store)
            raise
        if refused is not None:
            await store.delete(NS, key.store)
        return refused

    def _replay(self, key: IdempotencyKey, record: Mapping[str, Any]) -> Decision:
        first = str(record.get("decision_id", ""))
        metrics = self._services.metrics if self._services is not None else None
        if metrics is not None:
            metrics.idempotent_replay()
        return Decision(
            Verdict.ALLOW, Code.REPLAYED, self.id,
            f"a repeat of decision {first}: answered with its stored result, not performed again",
            result=record["result"],
            audit={"replayed": True, "idempotency_key": key.shown, "replayed_from": first},
        )

    def _unknown(self, key: IdempotencyKey, record: Mapping[str, Any]) -> Decision:
        first = str(record.get("decision_id", ""))
        return Decision(
            Verdict.ERROR, Code.IDEMPOTENCY_IN_FLIGHT, self.id,
            f"the same call (idempotency key {key.shown!r}) was sent upstream by decision {first}, "
            f"whose outcome is unknown ({record.get('code', 'unknown')}): it may have been "
            "performed, so it is not sent again; once you know it was not, call with a new "
            "idempotency key",
            audit={"idempotency_key": key.shown, "outcome_unknown_from": first},
        )

    def _recorder(self, store: Store, key: IdempotencyKey, digest: str) -> ResultHook:
        ttl = self._ttl
        idempotent = self._idempotent

        async def record(call: ToolCall, decision: Decision, reply: Mapping[str, Any] | None) -> None:
            result = reply.get("result") if isinstance(reply, Mapping) else None
            # A result withheld by the output guardrails (blocked, or not checkable) was performed
            # all the same: its refusal is what a retry replays (never a second performance).
            performed = decision.verdict is Verdict.ALLOW or decision.check == "guardrails"
            if performed and isinstance(result, dict):
                await store.put(NS, key.store, orjson.dumps({
                    "state": "done", "decision_id": call.decision_id, "args_digest": digest,
                    "result": result, "at": time.time(),
                }), ttl=ttl)
                return
            if decision.verdict is Verdict.ALLOW and reply is None:
                # The client left a resumable stream: the call goes on upstream. Keep the claim
                # (it expires) rather than let a retry perform it again.
                return
            if not certainly_not_performed(call, reply) and call.qualified_name not in idempotent:
                # It may have been performed: a retry is refused, never sent again.
                await store.put(NS, key.store, orjson.dumps({
                    "state": "unknown", "decision_id": call.decision_id, "args_digest": digest,
                    "code": decision.code.value, "at": time.time(),
                }), ttl=ttl)
                # Written after the record: when it cannot be, the key stays refused for its
                # ttl (as before any release existed), never freed.
                await store.put(UNKNOWN_NS, call.decision_id, orjson.dumps({
                    "key": key.store, "shown": key.shown, "principal": call.principal.id,
                    "run": call.run.id, "upstream": call.upstream, "tool": call.tool,
                    "args_digest": digest,
                }), ttl=ttl)
                return
            # Never sent, or refused by the upstream (or an idempotent tool): free the key.
            raw = await store.get(NS, key.store)
            if raw is not None and _load(raw).get("decision_id") == call.decision_id:
                await store.delete(NS, key.store)

        return record


# ---- releasing a key whose outcome is unknown (the admin API) ---------------------------------

@dataclass(frozen=True, slots=True)
class UnknownOutcome:
    """A decision whose outcome is unknown, found by its id: the call it made, and `record`,
    what its store key holds now (None: nothing; the key expired or was released)."""

    decision_id: str
    key: str
    shown: str
    principal: str
    run: str
    upstream: str
    tool: str
    args_digest: str
    record: bytes | None

    @property
    def held(self) -> bool:
        """Whether the key still holds this decision's `unknown` record (so it may be released);
        False when it holds anything else (a new call's claim or result)."""
        if self.record is None:
            return False
        record = _load(self.record)
        return record.get("state") == "unknown" and record.get("decision_id") == self.decision_id


async def find_unknown(store: Store, decision_id: str) -> UnknownOutcome | None:
    """The call of `decision_id` whose outcome was recorded as unknown, or None when no such
    decision is indexed (never one, expired, or already released). Raises StoreError when the
    store cannot answer or holds an unreadable entry."""
    raw = await store.get(UNKNOWN_NS, decision_id)
    if raw is None:
        return None
    entry = _load(raw)
    fields = ("key", "shown", "principal", "run", "upstream", "tool", "args_digest")
    if not all(isinstance(entry.get(f), str) for f in fields):
        raise StoreError("unreadable idempotency index entry: fields missing")
    got = {f: str(entry[f]) for f in fields}
    return UnknownOutcome(decision_id=decision_id, record=await store.get(NS, got["key"]), **got)


async def release(store: Store, found: UnknownOutcome) -> bool:
    """Free the key of `found` for a retry: deleted only when `found` read its `unknown` record
    (`held`) and the key still holds exactly that record (compare-and-delete), then its index
    entry. False when the key held or now holds anything else (nothing deleted). Raises
    StoreError when the store cannot answer."""
    if found.record is None or not found.held:
        return False
    if not await store.delete_if(NS, found.key, found.record):
        return False
    await store.delete(UNKNOWN_NS, found.decision_id)
    return True


async def forget_unknown(store: Store, decision_id: str) -> None:
    """Drop an index entry whose key no longer holds anything (expired): nothing to release."""
    await store.delete(UNKNOWN_NS, decision_id)
