"""Rate-limit check: token buckets per principal and per tool, a call budget per run, and a bound
on the calls of one run in flight at once; all shared by every replica through the store.

Limits, each absent unless the policy sets it (a principal with none, calling a tool with none,
is not looked at: `applies` is false and the store is never touched). Every key of run state is
the principal-scoped run key (`RunContext.key`), so one principal cannot spend another's run
budget or slots by naming its run id:

- **rate** (`principals.<id>.rate`, else `defaults.rate`): one token bucket per principal for
  all its calls. `rate: 100/min` refills 100 tokens a minute; `burst` (absent: the count) is
  the bucket's size, the most calls let through in a row.
- **tool rate** (`tools.<key>.rate`): one bucket per principal for that tool.
- **budget** (`principals.<id>.max_calls_per_run`, else `defaults.max_calls_per_run`): a
  bucket that never refills, one per run: the calls a run may send upstream in all. It lives
  `dataflow.ledger_ttl` after the run's last counted call (a run the proxy forgets, like its
  ledger); refused calls write nothing, so they do not extend it: a run that keeps looping
  past its budget gets a new one after that long (24 h by default). A call that took a token
  and was then not sent (refused by a later check, answered by the proxy itself: a replay; no
  connection to the upstream) gives it back when it ends (`Store.give`: atomic, capped, the
  expiry kept), so only calls sent upstream count. Rate tokens are not given back: a rate
  bounds a caller's pace, refused calls' too.
- **concurrency** (`max_concurrent_per_run`, principal else defaults): a call takes one of the
  run's numbered slots in the store (namespace `run`, keys `<run key>/slot/<n>`, n < bound) with
  an atomic `add`, released when the call's decision is final (a result hook, before its audit
  record); a slot of a replica that died mid-call expires after a lease (the upstream timeout
  plus the longest approval wait plus a margin).

A call's buckets are taken in one atomic store operation (`Store.take`: one Lua script on Redis,
one transaction on SQLite) on the store's clock: a token from each, or none. A call refused here
takes nothing: a call refused by a bucket releases its slot through the same hook, and a call
refused for want of a slot never reaches the buckets. Refusals are `rate_limited` (not queued:
the client retries); a bucket's refusal carries the wait (`retry_after`, in the reason too).
The check runs after shadow: a shadowed call is never performed and takes nothing.

Fail closed: a limited call with no store is refused `misconfigured`; a store that cannot answer
refuses `store_unavailable`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, Verdict, deny
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import DataflowPolicy, RateLimit
from proxy.store.base import Bucket, Store

RUN_NS = "run"
RATE_NS = "rate"
LEASE_MARGIN = 60.0
# A bucket's state outlives a refill from empty to full by this much (then absent == full).
BUCKET_TTL_MARGIN = 1.0


def slot_key(run_key: str, n: int) -> str:
    """The store key of a run's slot `n` (`run_key`: `RunContext.key`)."""
    return f"{run_key}/slot/{n}"


def principal_key(principal: str) -> str:
    return f"principal/{principal}"


def tool_key(tool: str, principal: str) -> str:
    # A tool key has no "/" (`<upstream>.<tool>`), so no principal id can forge another's key.
    return f"tool/{tool}/{principal}"


def budget_key(run_key: str) -> str:
    """The store key of a run's call budget (`run_key`: `RunContext.key`)."""
    return f"calls/{run_key}"


def retry_after(wait: float) -> float:
    """The wait to tell a client: rounded up to a tenth of a second, never 0 (a client that
    waits this long finds its token)."""
    return max(0.1, math.ceil(wait * 10 - 1e-6) / 10)


@dataclass(frozen=True, slots=True)
class _Rate:
    """One compiled rate: its bucket's shape and the rule that set it."""

    capacity: float
    per_second: float
    text: str  # as written ("100/min (burst 20)"), for the reason
    rule: str

    @classmethod
    def of(cls, rate: RateLimit, rule: str) -> _Rate:
        return cls(float(rate.capacity), rate.per_second, str(rate), rule)

    def bucket(self, key: str) -> Bucket:
        return Bucket(key, self.capacity, self.per_second,
                      self.capacity / self.per_second + BUCKET_TTL_MARGIN)


@dataclass(frozen=True, slots=True)
class _Limits:
    """What bounds one principal's calls (whatever the tool)."""

    rate: _Rate | None
    budget: tuple[int, str] | None
    concurrency: tuple[int, str] | None

    @property
    def any(self) -> bool:
        return self.rate is not None or self.budget is not None or self.concurrency is not None


class RateLimitCheck:
    """Refuses `rate_limited` when a token bucket of the call is empty, its run has spent its
    call budget, or the run already has its bound of calls in flight."""

    id: ClassVar[str] = "rate_limit"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._services = services
        document = revision.document
        defaults = document.defaults
        self._default = _Limits(
            _Rate.of(defaults.rate, "defaults.rate") if defaults.rate is not None else None,
            (defaults.max_calls_per_run, "defaults.max_calls_per_run") if defaults.max_calls_per_run else None,
            (defaults.max_concurrent_per_run, "defaults.max_concurrent_per_run")
            if defaults.max_concurrent_per_run else None,
        )
        self._limits: dict[str, _Limits] = {}
        for pid, principal in revision.principals.items():
            own = principal.policy
            where = f"principals.{pid}"
            self._limits[pid] = _Limits(
                _Rate.of(own.rate, f"{where}.rate") if own.rate is not None else self._default.rate,
                (own.max_calls_per_run, f"{where}.max_calls_per_run")
                if own.max_calls_per_run else self._default.budget,
                (own.max_concurrent_per_run, f"{where}.max_concurrent_per_run")
                if own.max_concurrent_per_run else self._default.concurrency,
            )
        self._tool_rates = {
            key: _Rate.of(tool.policy.rate, f"tools.{key}.rate")
            for key, tool in revision.tools.items() if tool.policy.rate is not None
        }
        self._run_ttl = (document.dataflow or DataflowPolicy()).ledger_ttl
        waits = [t.policy.approval.wait for t in revision.tools.values() if t.policy.approval is not None]
        timeouts = {name: up.timeout for name, up in document.upstreams.items()}
        longest_wait = max(waits, default=30.0)
        self._lease = {name: t + longest_wait + LEASE_MARGIN for name, t in timeouts.items()}
        self._default_lease = 30.0 + longest_wait + LEASE_MARGIN

    def applies(self, call: ToolCall) -> bool:
        # On every call: two dict lookups, no store.
        return (self._limits.get(call.principal.id, self._default).any
                or call.qualified_name in self._tool_rates)

    async def decide(self, call: ToolCall) -> Decision | None:
        limits = self._limits.get(call.principal.id, self._default)
        tool_rate = self._tool_rates.get(call.qualified_name)
        store: Store | None = self._services.store if self._services is not None else None
        if store is None:
            rule = _first_rule(limits, tool_rate)
            return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                            f"a rate limit ({rule}) needs a state store, and none is configured", rule)
        try:
            if limits.concurrency is not None:
                refused = await self._slot(store, call, *limits.concurrency)
                if refused is not None:
                    return refused
            return await self._take(store, call, limits, tool_rate)
        except (StoreError, TimeoutError) as exc:
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"cannot count the calls of run {call.run.id!r}: the state store cannot "
                            f"answer ({exc or 'timed out'}); the call was refused",
                            _first_rule(limits, tool_rate))

    async def _slot(self, store: Store, call: ToolCall, bound: int, rule: str) -> Decision | None:
        """Take a free slot of the run (released when the call ends), or the refusal."""
        token = call.decision_id.encode()
        lease = self._lease.get(call.upstream, self._default_lease)
        for n in range(bound):
            key = slot_key(call.run.key, n)
            if await store.add(RUN_NS, key, token, ttl=lease):
                call.on_result.append(_releaser(store, key, token))
                call.audit_extra["run_slot"] = n
                return None
        return deny(
            Code.RATE_LIMITED, self.id,
            f"run {call.run.id!r} already has {bound} call{'s' if bound != 1 else ''} in flight "
            f"(the bound is {bound}); retry when one finishes",
            rule,
        )

    async def _take(self, store: Store, call: ToolCall, limits: _Limits,
                    tool_rate: _Rate | None) -> Decision | None:
        """Take a token from each of the call's buckets (one store operation), or the refusal."""
        pid = call.principal.id
        limited: list[tuple[Bucket, str, str]] = []  # each bucket, what its refusal says, its rule
        if limits.rate is not None:
            limited.append((limits.rate.bucket(principal_key(pid)),
                            f"principal {pid!r} is over its rate of {limits.rate.text}",
                            limits.rate.rule))
        if tool_rate is not None:
            limited.append((tool_rate.bucket(tool_key(call.qualified_name, pid)),
                            f"principal {pid!r} is over the rate of {call.qualified_name}, "
                            f"{tool_rate.text} per principal", tool_rate.rule))
        if limits.budget is not None:
            calls, rule = limits.budget
            limited.append((Bucket(budget_key(call.run.key), float(calls), 0.0, self._run_ttl),
                            f"run {call.run.id!r} has made the {calls} call{'s' if calls != 1 else ''} "
                            "its budget allows", rule))
        if not limited:
            return None
        taken = await store.take(RATE_NS, [bucket for bucket, _, _ in limited])
        if taken.granted:
            if limits.budget is not None:
                call.on_result.append(_refunder(store, limited[-1][0]))
            return None
        _, why, rule = limited[taken.bucket]
        if math.isinf(taken.wait):  # a spent budget: no wait helps
            return deny(Code.RATE_LIMITED, self.id, f"{why} ({rule}); start a new run", rule)
        wait = retry_after(taken.wait)
        return Decision(Verdict.DENY, Code.RATE_LIMITED, self.id, f"{why} ({rule}); retry in {wait:.1f}s",
                        rule, audit={"retry_after": wait}, retry_after=wait)


def _first_rule(limits: _Limits, tool_rate: _Rate | None) -> str:
    """The rule a whole-call refusal names (no store, store down): the first limit that applies."""
    if limits.concurrency is not None:
        return limits.concurrency[1]
    for rate in (limits.rate, tool_rate):
        if rate is not None:
            return rate.rule
    assert limits.budget is not None
    return limits.budget[1]


def _refunder(store: Store, budget: Bucket) -> Any:
    async def refund(call: ToolCall, decision: Decision, reply: Mapping[str, Any] | None) -> None:
        # Only a call that reached (or may have reached) its upstream counts against the run's
        # budget: one refused by a later check, answered by the proxy (a replay) or never sent
        # (no connection) gets its token back.
        if not call.maybe_sent:
            await store.give(RATE_NS, budget)
    return refund


def _releaser(store: Store, key: str, token: bytes) -> Any:
    async def release(call: ToolCall, decision: Decision, reply: Mapping[str, Any] | None) -> None:
        # Only our own slot: after a lease expired another call may hold the key.
        if await store.get(RUN_NS, key) == token:
            await store.delete(RUN_NS, key)
    return release
