"""Rate-limit check: a bound on the calls of one run in flight at once, shared by all replicas.

The bound is the principal's `max_concurrent_per_run`, else `defaults.max_concurrent_per_run`
(absent: no bound, and the check never touches the store). A call takes one of the run's
numbered slots in the store (namespace `run`, keys `<run key>/slot/<n>`, n < bound; the run key
is principal-scoped, `RunContext.key`) with an
atomic `add`; a call that finds every slot taken is refused `rate_limited` (it is not queued:
the client retries). The slot is released when the call's decision is final (a result hook
that runs before its audit record is written), whatever the outcome; a slot of a replica that
died mid-call expires after a lease (the upstream timeout plus the longest approval wait plus a
margin). Because the slots live in the shared store, two replicas on one Redis share the bound.

Fail closed: a bounded principal with no store is refused `misconfigured`; a store that cannot
answer refuses `store_unavailable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, Verdict, deny
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.store.base import Store

RUN_NS = "run"
LEASE_MARGIN = 60.0


def slot_key(run_key: str, n: int) -> str:
    """The store key of a run's slot `n` (`run_key`: `RunContext.key`)."""
    return f"{run_key}/slot/{n}"


class RateLimitCheck:
    """Refuses `rate_limited` when the run already has its bound of calls in flight."""

    id: ClassVar[str] = "rate_limit"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._services = services
        default = getattr(revision.document.defaults, "max_concurrent_per_run", None)
        self._default = (int(default), "defaults.max_concurrent_per_run") if default else None
        self._bounds: dict[str, tuple[int, str] | None] = {}
        for pid, principal in revision.principals.items():
            own = getattr(principal.policy, "max_concurrent_per_run", None)
            self._bounds[pid] = (int(own), f"principals.{pid}.max_concurrent_per_run") if own else self._default
        waits = [t.policy.approval.wait for t in revision.tools.values() if t.policy.approval is not None]
        timeouts = {name: up.timeout for name, up in revision.document.upstreams.items()}
        longest_wait = max(waits, default=30.0)
        self._lease = {name: t + longest_wait + LEASE_MARGIN for name, t in timeouts.items()}
        self._default_lease = 30.0 + longest_wait + LEASE_MARGIN

    def _bound(self, call: ToolCall) -> tuple[int, str] | None:
        pid = call.principal.id
        return self._bounds[pid] if pid in self._bounds else self._default

    def applies(self, call: ToolCall) -> bool:
        return self._bound(call) is not None

    async def decide(self, call: ToolCall) -> Decision | None:
        bound, rule = self._bound(call)  # type: ignore[misc]
        store: Store | None = self._services.store if self._services is not None else None
        if store is None:
            return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                            f"a per-run concurrency bound ({rule}) needs a state store, and none is "
                            "configured", rule)
        token = call.decision_id.encode()
        lease = self._lease.get(call.upstream, self._default_lease)
        try:
            for n in range(bound):
                key = slot_key(call.run.key, n)
                if await store.add(RUN_NS, key, token, ttl=lease):
                    call.on_result.append(_releaser(store, key, token))
                    call.audit_extra["run_slot"] = n
                    return None
        except (StoreError, TimeoutError) as exc:
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"cannot count the calls in flight of run {call.run.id!r}: the state store "
                            f"cannot answer ({exc or 'timed out'}); the call was refused", rule)
        return deny(
            Code.RATE_LIMITED, self.id,
            f"run {call.run.id!r} already has {bound} call{'s' if bound != 1 else ''} in flight "
            f"(the bound is {bound}); retry when one finishes",
            rule,
        )


def _releaser(store: Store, key: str, token: bytes) -> Any:
    async def release(call: ToolCall, decision: Decision, reply: Mapping[str, Any] | None) -> None:
        # Only our own slot: after a lease expired another call may hold the key.
        if await store.get(RUN_NS, key) == token:
            await store.delete(RUN_NS, key)
    return release
