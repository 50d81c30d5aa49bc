"""Shadow check: in a shadow run, writer calls are recorded, not performed.

A run is shadow when the client sends `X-Envelope-Shadow: 1` (sticky: the run's flag is kept in
the store, namespace `run`, key `<run key>/shadow` (`RunContext.key`: the run of this principal;
another principal naming the same run id has a flag of its own); later calls of the run without
the header stay shadow, and nothing switches it off), or when the policy sets `mode: shadow` for the
principal or the tool. In a shadow run a call whose effect is not `read` is written to the
store namespace `shadow` (full arguments, upstream, tool, principal, run, decision id, time,
whether it would have needed approval) and the client receives a synthetic result (the tool's
`shadow_result`, or a default text). Read calls are forwarded as usual.

Runs before the approval check on purpose: a dry run must not page approvers.

Fail closed: a shadow run with no store refuses `misconfigured` ("shadow run but no recorder"),
a store that cannot answer refuses `store_unavailable`; a shadow call is never performed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, ClassVar

import orjson

from proxy.audit.record import utc_timestamp
from proxy.envelope.effects import needs_approval
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, Verdict
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.vocab import Effect
from proxy.store.base import Store

NS = "shadow"
RUN_NS = "run"
# A run's shadow flag lives this long after its last shadow call (sliding): a long shadow run
# never silently turns live.
RUN_FLAG_TTL = 24 * 3600.0
# How long recorded writes are kept for review.
RECORD_TTL = 7 * 24 * 3600.0
DEFAULT_RESULT = "Shadow run: this call was recorded, not performed."
# Most records a listing reads before filtering by run.
SCAN_LIMIT = 100_000


def run_flag_key(run_key: str) -> str:
    """The store key of a run's sticky shadow flag (`run_key`: `RunContext.key`)."""
    return f"{run_key}/shadow"


class ShadowCheck:
    """Turns writer calls of shadow runs into recorded, synthetic results."""

    id: ClassVar[str] = "shadow"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._revision = revision
        self._services = services
        self._principals = frozenset(
            pid for pid, p in revision.principals.items() if p.policy.mode == "shadow"
        )
        self._tools = frozenset(
            key for key, t in revision.tools.items() if t.policy.mode == "shadow"
        )
        self._texts: dict[str, str] = {
            key: t.policy.shadow_result for key, t in revision.tools.items() if t.policy.shadow_result
        }

    def applies(self, call: ToolCall) -> bool:
        # Reads without the header never need the store: they are forwarded in any run.
        return call.shadow_requested or call.effect is not Effect.READ

    def _policy_rule(self, call: ToolCall) -> str | None:
        if call.principal.id in self._principals:
            return f"principals.{call.principal.id}.mode"
        if call.qualified_name in self._tools:
            return f"tools.{call.qualified_name}.mode"
        return None

    async def decide(self, call: ToolCall) -> Decision | None:
        """None when the run is not shadow, or for its read calls; a synthetic result (SHADOWED)
        after recording a writer call. Refuses `misconfigured` without a store and
        `store_unavailable` when the store fails."""
        rule = self._policy_rule(call)
        if call.shadow_requested:
            rule = rule or "request:X-Envelope-Shadow"
        store: Store | None = self._services.store if self._services is not None else None
        if store is None:
            if rule is None:
                return None  # no store, so no sticky flag either: not a shadow run
            return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                            "shadow run but no recorder: no state store is configured", rule)
        try:
            return await self._decide(store, call, rule)
        except (StoreError, TimeoutError) as exc:
            if rule is None:
                # A run, once shadow, stays shadow; with the store down we cannot tell whether
                # this one was switched on earlier, so a write could escape a dry run: refuse.
                reason = (f"cannot tell whether run {call.run.id!r} is a shadow run: the state "
                          f"store cannot answer ({exc or 'timed out'}); the write was refused, "
                          "not performed")
            else:
                reason = (f"shadow run but the recorder cannot answer ({exc or 'timed out'}); "
                          "the call was refused, not performed")
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id, reason, rule)

    async def _decide(self, store: Store, call: ToolCall, rule: str | None) -> Decision | None:
        flag_key = run_flag_key(call.run.key)
        flag = orjson.dumps({"shadow": True, "since": utc_timestamp(), "decision_id": call.decision_id})
        if call.shadow_requested:
            await store.put(RUN_NS, flag_key, flag, ttl=RUN_FLAG_TTL)
        elif rule is None:
            if await store.get(RUN_NS, flag_key) is None:
                return None
            rule = "run"
            await store.put(RUN_NS, flag_key, flag, ttl=RUN_FLAG_TTL)  # slide the expiry
        call.run = dataclasses.replace(call.run, shadow=True)
        call.audit_extra["shadow"] = True
        if call.effect is Effect.READ:
            return None
        record_key = f"{time.time_ns():020d}-{call.decision_id}"
        record = {
            "decision_id": call.decision_id,
            "time": utc_timestamp(),
            "run": call.run.id,
            "session": call.run.session,
            "principal": call.principal.id,
            "upstream": call.upstream,
            "tool": call.tool,
            "effect": (call.effect or Effect.DESTRUCTIVE).value,
            "arguments": call.arguments,
            "would_need_approval": needs_approval(self._revision, call),
            "idempotency_key": call.idempotency_key,
            "revision": self._revision.revision,
            "rule": rule,
        }
        await store.put(NS, record_key, orjson.dumps(record), ttl=RECORD_TTL)
        metrics = self._services.metrics if self._services is not None else None
        if metrics is not None:
            metrics.shadow_record()
        text = self._texts.get(call.qualified_name, DEFAULT_RESULT)
        # isError: MCP clients validate a successful result against the tool's outputSchema and
        # reject one without matching structuredContent, which a synthetic result cannot have;
        # an error result is handed to the model as text. The decision itself is an allow.
        return Decision(
            Verdict.ALLOW, Code.SHADOWED, self.id,
            "shadow run: the call was recorded, not performed", rule,
            result={"content": [{"type": "text", "text": text}], "isError": True},
            audit={"shadow": True, "shadow_record": record_key},
        )


async def list_records(store: Store, run: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """The recorded writes (of one run when `run` is given), oldest first, at most the `limit`
    most recent. Raises StoreError when the store cannot answer."""
    items = await store.items(NS, limit=SCAN_LIMIT)
    records: list[tuple[str, dict[str, Any]]] = []
    for key, raw in items:
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(record, dict) or (run is not None and record.get("run") != run):
            continue
        records.append((key, {"id": key, **record}))
    records.sort(key=lambda kv: kv[0])
    return [r for _, r in records[-limit:]] if limit > 0 else []
