"""The approval service: every transition of approvals and grants, through the store."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from proxy.approvals.approvers import own_call, same_person
from proxy.approvals.notifier import ApprovalNotifier
from proxy.approvals.records import (
    NS_APPROVAL,
    NS_ARGUMENTS,
    NS_BY_CALL,
    NS_GRANT,
    NS_GRANT_INDEX,
    Approval,
    ApprovalConflict,
    ApprovalNotFound,
    CallBinding,
    Grant,
    GrantRequest,
    SelfApproval,
    State,
    grant_key,
    new_approval_id,
)
from proxy.config import ApprovalsConfig
from proxy.errors import StoreError
from proxy.store.base import Store

log = logging.getLogger("envelope.approvals")

_CAS_ATTEMPTS = 8
NS_STATE_NONCE = "approval_state_nonce"  # spent in-band states (replay protection)
# The pending approvals' index: one store hash, approval id -> its expiry. Listing and counting
# pending approvals read it (ids and times only), never every approval record of the retention
# window with its arguments; an entry of an approval no longer pending (decided by a process
# that stopped before unlisting it) or gone is dropped where it is found.
NS_PENDING = "approval_pending"
_PENDING_KEY = "index"
# The most approvals a listing reads (records of one state) or lists as pending; past it the
# answer says `truncated`.
LIST_LIMIT = 1000
MAX_PENDING = 10_000
# Arguments stored apart outlive their record by this much (a record never names arguments
# already gone: its own expiry is recomputed, from the same times, at every transition).
_ARGUMENTS_MARGIN = 60.0
# The most grants one index hash (a principal's grants for one tool, or for one tool in one run)
# is read with; past it a grant may go unfound (fail closed: the call asks for an approval).
MAX_GRANTS_PER_KEY = 10_000
# Grants written before the index (session 14) are indexed once per process, the first time a
# call looks for one: at most this many.
LEGACY_GRANTS = 100_000


@dataclass
class ApprovalService:
    """Create, find, decide and consume approvals and grants on the store.

    Stateless besides the store and the notifier: the runtime builds one per process, which the
    approval check (through `Services.approvals`) and the admin API share; replicas agree
    through the store.
    """

    store: Store
    config: ApprovalsConfig = field(default_factory=ApprovalsConfig)
    notifier: ApprovalNotifier | None = None
    metrics: Any = None
    clock: Callable[[], float] = time.time
    _legacy_grants: asyncio.Lock | None = field(default=None, init=False, repr=False)
    _legacy_indexed: bool = field(default=False, init=False, repr=False)

    # -- reading ----------------------------------------------------------------------------

    async def get(self, approval_id: str) -> Approval | None:
        """The approval whole (with its arguments, also when stored apart); None when the store
        no longer has it, or no longer has its arguments (it cannot be shown or decided)."""
        approval = await self.head(approval_id)
        if approval is None or not approval.apart:
            return approval
        raw = await self.store.get(NS_ARGUMENTS, approval_id)
        if raw is None:
            log.warning("approval %s: its arguments are gone from the store; treated as gone", approval_id)
            return None
        return approval.with_arguments(orjson.loads(raw))

    async def head(self, approval_id: str) -> Approval | None:
        """The approval's record only: arguments stored apart are not read (`{}`; the view shows
        their preview). Enough for its state, its binding and every transition."""
        raw = await self.store.get(NS_APPROVAL, approval_id)
        return None if raw is None else Approval.decode(raw)

    async def for_call(self, binding: CallBinding) -> Approval | None:
        """The approval bound to this call (its head: `head`), if one was requested and is
        still kept."""
        approval_id = await self.store.get(NS_BY_CALL, binding.key)
        if approval_id is None:
            return None
        approval = await self.head(approval_id.decode())
        if approval is None or approval.binding != binding:  # gone, or a (never seen) collision
            return None
        return approval

    async def approvals(self, state: State | None = None) -> list[Approval]:
        """Approvals (heads, in their state as of now), oldest first (see `listing`)."""
        return (await self.listing(state))[0]

    async def listing(self, state: State | None = None) -> tuple[list[Approval], bool]:
        """Approvals (heads: arguments stored apart are not read, see `head`; in their state as
        of now), oldest first, and whether there were more than were read: pending ones from the
        index (every one up to `MAX_PENDING`), others from the first `LIST_LIMIT` records of the
        store, in no set order."""
        now = self.clock()
        if state == "pending":
            return await self._pending(now)
        raw = await self.store.items(NS_APPROVAL, LIST_LIMIT + 1)
        found = [Approval.decode(value) for _, value in raw[:LIST_LIMIT]]
        if state is not None:
            found = [a for a in found if a.effective_state(now) == state]
        return sorted(found, key=lambda a: (a.created_at, a.id)), len(raw) > LIST_LIMIT

    async def _pending_index(self, now: float) -> tuple[list[str], bool]:
        """The ids the index holds as pending and not yet expired, and whether it held more than
        `MAX_PENDING`; entries past their expiry are dropped."""
        index = await self.store.hash_all(NS_PENDING, _PENDING_KEY, limit=MAX_PENDING + 1)
        ids: list[str] = []
        stale: list[bytes] = []
        for field_, expires in list(index.items())[:MAX_PENDING]:
            try:
                live = float(expires) > now
            except ValueError:
                live = False
            if live:
                ids.append(field_.decode())
            else:
                stale.append(field_)
        if stale:
            await self.store.hash_delete(NS_PENDING, _PENDING_KEY, stale)
        return ids, len(index) > MAX_PENDING

    async def _pending(self, now: float) -> tuple[list[Approval], bool]:
        ids, truncated = await self._pending_index(now)
        found: list[Approval] = []
        stale: list[bytes] = []
        for approval_id in ids:
            approval = await self.head(approval_id)
            if approval is not None and approval.effective_state(now) == "pending":
                found.append(approval)
            else:
                stale.append(approval_id.encode())
        if stale:
            await self.store.hash_delete(NS_PENDING, _PENDING_KEY, stale)
        return sorted(found, key=lambda a: (a.created_at, a.id)), truncated

    async def _unlist(self, approval_id: str) -> None:
        """Drop an approval that is no longer pending from the index. Best effort: its state
        changed already (a failure here must not report a decision as not made); an entry left
        behind is dropped by the next listing, which finds the record no longer pending."""
        try:
            await self.store.hash_delete(NS_PENDING, _PENDING_KEY, [approval_id.encode()])
        except StoreError as exc:
            log.warning("approval %s: not removed from the pending index (%s); the next listing "
                        "drops it", approval_id, exc)

    async def grants(self, limit: int = LIST_LIMIT) -> list[Grant]:
        """Grants (oldest first), the first `limit` records of the store (see `grant_listing`)."""
        return (await self.grant_listing(limit))[0]

    async def grant_listing(self, limit: int = LIST_LIMIT) -> tuple[list[Grant], bool]:
        """Grants, oldest first, from the first `limit` grant records of the store (in no set
        order), and whether there were more (the admin list; calls find theirs by the index)."""
        raw = await self.store.items(NS_GRANT, limit + 1)
        found = [Grant.decode(value) for _, value in raw[:limit]]
        return sorted(found, key=lambda g: (g.created_at, g.id)), len(raw) > limit

    async def find_grant(self, binding: CallBinding, arguments: Mapping[str, Any]) -> Grant | None:
        """The oldest active grant that covers this call, if any: read from the two index hashes
        the call can match (its principal's tool-scoped grants for the tool, and those of its
        run), whatever the number of grants in the store. Raises StoreError."""
        await self._index_legacy_grants()
        now = self.clock()
        found: list[Grant] = []
        for run in (None, binding.run):
            key = grant_key(binding.principal, binding.upstream, binding.tool, run)
            entries = await self.store.hash_all(NS_GRANT_INDEX, key, limit=MAX_GRANTS_PER_KEY)
            stale: list[bytes] = []
            for field_, raw in entries.items():
                grant = Grant.decode(raw)
                if now >= grant.expires_at:
                    stale.append(field_)
                elif grant.matches(binding, arguments, now):
                    found.append(grant)
            if stale:
                await self._drop_grants(key, stale)
        return min(found, key=lambda g: (g.created_at, g.id), default=None)

    async def _drop_grants(self, key: str, ids: list[bytes]) -> None:
        """Best effort: an expired grant left in the index matches nothing and is dropped again."""
        try:
            await self.store.hash_delete(NS_GRANT_INDEX, key, ids)
        except StoreError as exc:
            log.debug("expired grants not dropped from the index (%s)", exc)

    async def add_grant(self, grant: Grant) -> None:
        """Store a grant (`decide` gives them): its record (the admin list), then its index
        entry (what calls match on). A process stopping in between leaves a listed grant that
        releases nothing (fail closed), never one that releases calls unlisted."""
        ttl = grant.expires_at - self.clock()
        await self.store.put(NS_GRANT, grant.id, grant.encode(), ttl=ttl)
        # One expiry for the whole hash: as long as the longest grant this deployment gives, so
        # a short grant never cuts a longer one's life short.
        await self.store.hash_put(NS_GRANT_INDEX, grant.key, {grant.id.encode(): grant.encode()},
                                  ttl=max(ttl, self.config.max_grant_duration))

    async def _index_legacy_grants(self) -> None:
        """Index the grants written before the index existed (a store of an earlier version):
        once per process, before its first look-up. Raises StoreError (tried again next time)."""
        if self._legacy_indexed:
            return
        if self._legacy_grants is None:
            self._legacy_grants = asyncio.Lock()
        async with self._legacy_grants:
            if self._legacy_indexed:
                return
            now = self.clock()
            for _, raw in await self.store.items(NS_GRANT, LEGACY_GRANTS):
                grant = Grant.decode(raw)
                if now < grant.expires_at:
                    await self.store.hash_put(
                        NS_GRANT_INDEX, grant.key, {grant.id.encode(): raw},
                        ttl=max(grant.expires_at - now, self.config.max_grant_duration), replace=False)
            self._legacy_indexed = True

    async def refresh_pending(self) -> int:
        """Count pending approvals into `envelope_approvals_pending`; returns the count. Reads
        the index only (an entry decided by a process that stopped before unlisting it counts
        until a listing drops it)."""
        count = len((await self._pending_index(self.clock()))[0])
        if self.metrics is not None:
            self.metrics.set_approvals_pending(count)
        return count

    # -- writing ----------------------------------------------------------------------------

    def _store_ttl(self, approval: Approval) -> float:
        return max(1.0, approval.expires_at + self.config.retention - self.clock())

    async def request(
        self, binding: CallBinding, *, arguments: dict[str, Any], effect: str, reason: str,
        ttl: float, decision_id: str | None = None,
        evidence: list[dict[str, Any]] | None = None,
    ) -> tuple[Approval, bool]:
        """The approval for this call: the existing one, or a new pending one (then notified).

        Returns (approval, created). Concurrent identical calls share one approval: the binding
        is claimed with `add`, and the loser reads the winner's.
        """
        now = self.clock()
        size, preview = Approval.cut(arguments)
        approval = Approval(
            id=new_approval_id(), state="pending", principal=binding.principal,
            run=binding.run, upstream=binding.upstream, tool=binding.tool,
            args_digest=binding.args_digest, arguments=dict(arguments), effect=effect,
            reason=reason, created_at=now, expires_at=now + ttl, decision_id=decision_id,
            evidence=evidence, arguments_bytes=size, arguments_preview=preview,
        )
        ttl_store = self._store_ttl(approval)
        if approval.apart:  # before the record: a record never names arguments not yet stored
            await self.store.put(NS_ARGUMENTS, approval.id, orjson.dumps(approval.arguments),
                                 ttl=ttl_store + _ARGUMENTS_MARGIN)
        # Indexed first: a process stopping in between leaves an entry naming no record (dropped
        # when read), never a pending approval that no listing shows.
        await self.store.hash_put(NS_PENDING, _PENDING_KEY,
                                  {approval.id.encode(): repr(approval.expires_at).encode()})
        await self.store.put(NS_APPROVAL, approval.id, approval.encode(), ttl=ttl_store)
        if not await self.store.add(NS_BY_CALL, binding.key, approval.id.encode(), ttl=ttl_store):
            await self.store.delete(NS_APPROVAL, approval.id)
            await self._unlist(approval.id)
            existing = await self.for_call(binding)
            if existing is not None:
                if approval.apart:
                    await self.store.delete(NS_ARGUMENTS, approval.id)
                return existing, False
            await self.store.hash_put(NS_PENDING, _PENDING_KEY,
                                      {approval.id.encode(): repr(approval.expires_at).encode()})
            # The winner's binding vanished in between (forgotten): ours takes its place.
            await self.store.put(NS_APPROVAL, approval.id, approval.encode(), ttl=ttl_store)
            await self.store.put(NS_BY_CALL, binding.key, approval.id.encode(), ttl=ttl_store)
        log.info("approval %s requested: %s calls %s.%s (%s)", approval.id, binding.principal,
                 binding.upstream, binding.tool, reason)
        if self.notifier is not None:
            self.notifier.created(approval)
        await self.refresh_gauge()
        return approval, True

    async def forget(self, approval: Approval) -> None:
        """Unbind a spent approval (expired, or denied past its TTL) so the same call can ask
        again. The record itself stays listed until the store expires it."""
        key = approval.binding.key
        await self.store.cas(NS_BY_CALL, key, approval.id.encode(), b"", ttl=1.0)
        if approval.state in ("pending", "approved"):
            await self._transition(approval.id, lambda a: replace(a, state="expired")
                                   if a.state in ("pending", "approved") else a)
        await self._unlist(approval.id)

    async def _transition(self, approval_id: str, change: Callable[[Approval], Approval]) -> Approval:
        """Apply `change` to the stored record with compare-and-set; returns the record as
        stored afterwards. `change` may raise ApprovalError, or return its argument unchanged."""
        for _ in range(_CAS_ATTEMPTS):
            raw = await self.store.get(NS_APPROVAL, approval_id)
            if raw is None:
                raise ApprovalNotFound(f"no approval {approval_id}")
            current = Approval.decode(raw)
            updated = change(current)
            if updated == current:
                return current
            if await self.store.cas(NS_APPROVAL, approval_id, raw, updated.encode(),
                                    ttl=self._store_ttl(updated)):
                return updated
        raise ApprovalConflict(f"approval {approval_id} is changing under heavy contention; try again")

    async def decide(
        self, approval_id: str, *, approver: str, approve: bool, reason: str,
        grant: GrantRequest | None = None, record: str | None = None,
    ) -> tuple[Approval, Grant | None]:
        """Approve or deny a pending approval (with an optional grant when approving); `record`
        is the decision's audit record id, kept on the approval (`decision_record`).

        Raises ApprovalNotFound, SelfApproval (the approver made the call), ApprovalConflict
        (no longer pending: decided, consumed or expired), StoreError.
        """
        now = self.clock()
        grant_obj: Grant | None = None

        def change(current: Approval) -> Approval:
            nonlocal grant_obj
            if same_person(current.principal, approver):
                raise SelfApproval(own_call(approver, current.principal))
            state = current.effective_state(now)
            if state != "pending":
                raise ApprovalConflict(f"approval {approval_id} is {state}, not pending")
            if approve and grant is not None:
                grant_obj = Grant(
                    id=f"grt-{secrets.token_hex(8)}", scope=grant.scope, principal=current.principal,
                    upstream=current.upstream, tool=current.tool,
                    run=current.run if grant.scope == "run" else None, args=dict(grant.args),
                    approver=approver, reason=reason, approval_id=current.id,
                    created_at=now, expires_at=now + grant.duration,
                )
            return replace(
                current, state="approved" if approve else "denied", approver=approver,
                decision_reason=reason, decided_at=now,
                grant_id=grant_obj.id if grant_obj is not None else None,
                decision_record=record,
            )

        decided = await self._transition(approval_id, change)
        await self._unlist(approval_id)
        if grant_obj is not None:
            await self.add_grant(grant_obj)
        log.info("approval %s %s by %s: %s%s", approval_id, decided.state, approver, reason,
                 f" (grant {grant_obj.id}, scope {grant_obj.scope})" if grant_obj else "")
        if self.notifier is not None:
            self.notifier.decided(approval_id)
        await self.refresh_gauge()
        return decided, grant_obj

    async def consume(self, approval: Approval) -> bool:
        """Spend an approved approval: approved -> consumed, atomically. True for exactly one
        caller; False when another caller consumed it first (or it changed meanwhile)."""
        if approval.effective_state(self.clock()) != "approved":
            return False
        consumed = replace(approval, state="consumed", consumed_at=self.clock())
        ok = await self.store.cas(NS_APPROVAL, approval.id, approval.encode(), consumed.encode(),
                                  ttl=self._store_ttl(consumed))
        return ok

    async def spend(self, nonce: str, expires_at: float) -> bool:
        """Spend an in-band approval state's nonce: True the first time, False for a replay
        (kept until the state would have expired anyway). Raises StoreError."""
        ttl = max(1.0, expires_at - self.clock())
        return await self.store.add(NS_STATE_NONCE, nonce, b"1", ttl=ttl)

    @property
    def stopping(self) -> bool:
        """Shutdown began (`ApprovalNotifier.stop_holding`): held calls stop waiting."""
        return self.notifier is not None and self.notifier.stopping

    async def wait_for_decision(self, approval: Approval, wait: float,
                                asking: asyncio.Task[None] | None = None) -> Approval | None:
        """The approval (its head: `head`) once it is no longer pending, or still pending after `wait` seconds
        (never past its expiry); None when the store dropped it. Woken at once by a decision
        of this process (the notifier) or when `asking` (an in-band question) ends; otherwise
        the store is polled every `poll_interval`. Still pending at once when shutdown began
        (`stopping`). Raises StoreError."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait, max(0.0, approval.expires_at - self.clock()))
        while True:
            current = await self.head(approval.id)
            if current is None or current.effective_state(self.clock()) != "pending":
                return current
            remaining = deadline - loop.time()
            if remaining <= 0 or self.stopping:
                return current
            step = min(self.config.poll_interval, remaining)
            if asking is not None and not asking.done():
                await asyncio.wait({asking}, timeout=step)
            elif self.notifier is not None:
                await self.notifier.wait(approval.id, step)
            else:
                await asyncio.sleep(step)

    async def refresh_gauge(self) -> None:
        """`refresh_pending`, never raising (a gauge never fails a decision)."""
        if self.metrics is None:
            return
        try:
            await self.refresh_pending()
        except Exception as exc:  # a gauge never fails a decision
            log.debug("could not refresh the pending approvals gauge: %s", exc)


