"""Delegation check: sub-agent runs stay within `max_depth` and on their holder's roster.

A child run names its parent with `X-Envelope-Parent-Run` (and its agent name with
`X-Envelope-Agent`). The proxy computes the depth from its own lineage records, never from the
client: the store namespace `run`, key `<run key>/lineage` (`RunContext.key`: the run of the
calling principal), a JSON object

    {"parent": <run id or null>, "depth": <int>, "principal": <id>, "holder": <parent's principal
     or null>, "agent": <name or null>, "implied": <bool>, "since": <utc time>}

written once, on the first call the proxy sees of a run (`add`: the first writer wins on every
replica, and a record never changes afterwards, so replicas may cache it). A root run (no parent)
is depth 0; a child is its parent's depth + 1. A later call of a run that names another parent
keeps the recorded lineage (audited as `lineage_conflict`).

Runs belong to principals: the named parent is looked up as a run of the calling principal,
then as a run of each principal whose policy lists the caller under `delegates` (it lets the
caller's runs be its runs' children). Another principal's run is never a parent otherwise: a
principal naming a run id it does not own gets a run of its own (an implied root), and so never
reaches another principal's ledger. A parent found nowhere is recorded as a root at depth 0 of the
calling principal (`implied: true`), so a delegated child must come after its parent's first
call to be attached to it.

Refusals:
- `depth_exceeded` when the run's depth is beyond the calling principal's `max_depth`
  (absent: `defaults.max_depth`, 2: session, child, grandchild);
- `not_on_roster` when a child run's agent is not on the roster of its parent's principal (the
  holder): a child with no agent name is not guessed onto it.

Fail closed: a call naming a parent with no state store is refused `misconfigured`; a store that
cannot answer refuses child calls and writer calls `store_unavailable` (read calls of runs that
name no parent keep working, at depth 0, so an outage does not stop reads).

Taint crosses the boundary upwards: for a child run this check sets `call.run.taint_targets`
to `taint_ancestors` (the store keys of the ancestor runs whose ledgers the child's untrusted or
secret output widens, cut at a parent whose principal sets `propagate_taint: false`, and at a
parent of another principal that no longer lists the child's principal under `delegates`); the
inspection widens each after updating the child's own ledger.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import orjson

from proxy.audit.record import utc_timestamp
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    Code,
    Decision,
    RunContext,
    Services,
    ToolCall,
    Verdict,
    deny,
    run_key,
)
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import MAX_DEPTH
from proxy.policy.vocab import Effect
from proxy.store.base import Store

log = logging.getLogger("envelope.delegation")

RUN_NS = "run"
# Lineage records outlive the runs they describe by far; a run idle longer than this is
# recorded anew (as a root, or from the parent it names) on its next call.
LINEAGE_TTL = 7 * 24 * 3600.0
# Records cached per process (immutable once written, so a cached record is never stale).
CACHE_SIZE = 10_000
# Deepest ancestor chain `taint_ancestors` walks (a cycle or a corrupt record cannot loop): the
# deepest `max_depth` a policy may set, so a run allowed to call reaches all its ancestors.
MAX_WALK = MAX_DEPTH


def lineage_key(key: str) -> str:
    """The store key of a run's lineage record (`key`: the run's `RunContext.key`)."""
    return f"{key}/lineage"


@dataclass(frozen=True, slots=True)
class Lineage:
    """One run's recorded place in its tree."""

    parent: str | None  # the parent's run id, as the child named it
    depth: int
    principal: str
    holder: str | None = None  # the parent run's principal (whose run it is, whose roster applies)
    agent: str | None = None
    implied: bool = False  # recorded because a child named it, before any call of its own

    @property
    def parent_key(self) -> str | None:
        """The store key of the parent run (a run of `holder`)."""
        if self.parent is None:
            return None
        return run_key(self.holder or self.principal, self.parent)

    def dumps(self) -> bytes:
        return orjson.dumps({**dataclasses.asdict(self), "since": utc_timestamp()})

    @classmethod
    def loads(cls, raw: bytes) -> Lineage:
        d = orjson.loads(raw)
        return cls(parent=d.get("parent"), depth=int(d.get("depth", 0)), principal=str(d.get("principal", "")),
                   holder=d.get("holder"), agent=d.get("agent"), implied=bool(d.get("implied", False)))


class _Cache:
    """A bounded LRU of lineage records per store object."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self._size = size
        self._items: OrderedDict[tuple[int, str], Lineage] = OrderedDict()

    def get(self, store: Store, key: str) -> Lineage | None:
        item = (id(store), key)
        found = self._items.get(item)
        if found is not None:
            self._items.move_to_end(item)
        return found

    def put(self, store: Store, key: str, lineage: Lineage) -> None:
        self._items[(id(store), key)] = lineage
        self._items.move_to_end((id(store), key))
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


CACHE = _Cache()


async def lookup(store: Store, key: str) -> Lineage | None:
    """The recorded lineage of the run stored at `key` (`RunContext.key`), or None (raises
    StoreError)."""
    cached = CACHE.get(store, key)
    if cached is not None:
        return cached
    raw = await store.get(RUN_NS, lineage_key(key))
    if raw is None:
        return None
    lineage = Lineage.loads(raw)
    CACHE.put(store, key, lineage)
    return lineage


async def record(store: Store, key: str, lineage: Lineage) -> Lineage:
    """Record a run's lineage unless one exists; the recorded one (first writer wins)."""
    if not await store.add(RUN_NS, lineage_key(key), lineage.dumps(), ttl=LINEAGE_TTL):
        existing = await lookup(store, key)
        if existing is not None:
            return existing
        # Expired between the two calls: record ours (nothing else can be more right).
        await store.put(RUN_NS, lineage_key(key), lineage.dumps(), ttl=LINEAGE_TTL)
    CACHE.put(store, key, lineage)
    return lineage


async def resolve(store: Store, run: RunContext, delegators: Sequence[str] = ()) -> Lineage:
    """The lineage of `run`: recorded, or computed from the named parent's record and recorded
    now. The parent is a run of `run.principal`, else of the first of `delegators` (principals
    that list it under `delegates`) that has one by that id, else an implied root of
    `run.principal`. Client-sent depths do not exist: depth is always the proxy's own count."""
    own = await lookup(store, run.key)
    if own is not None:
        return own
    parent = run.parent
    own = Lineage(None, 0, run.principal, agent=run.agent)
    if parent:
        for holder in (run.principal, *delegators):
            key = run_key(holder, parent)
            if key == run.key:
                continue  # a run is not its own parent
            above = await lookup(store, key)
            if above is not None:
                own = Lineage(parent, above.depth + 1, run.principal, holder=holder, agent=run.agent)
                break
        else:
            if parent != run.id:
                # Never seen: a root at depth 0, recorded so its other children agree.
                key = run_key(run.principal, parent)
                above = await record(store, key, Lineage(None, 0, run.principal, implied=True))
                own = Lineage(parent, above.depth + 1, run.principal, holder=run.principal,
                              agent=run.agent)
    return await record(store, run.key, own)


def _delegates(revision: PolicyRevision, principal: str) -> frozenset[str]:
    compiled = revision.principals.get(principal)
    return frozenset(getattr(compiled.policy, "delegates", ()) or ()) if compiled is not None else frozenset()


async def taint_ancestors(store: Store, revision: PolicyRevision, key: str) -> list[str]:
    """The store keys of the ancestor runs (nearest first) whose ledgers a taint seen in the run
    at `key` widens: up the recorded lineage, stopping at (and excluding) a parent whose principal
    sets `propagate_taint: false`, or a parent of another principal that does not (any longer)
    list the child's principal under `delegates`. [] for a root run or an unknown one. Raises
    StoreError."""
    out: list[str] = []
    seen = {key}
    current = await lookup(store, key)
    while current is not None and current.parent_key is not None and len(out) < MAX_WALK:
        parent_key = current.parent_key
        holder = current.holder or current.principal
        if parent_key in seen:
            break
        if holder != current.principal and current.principal not in _delegates(revision, holder):
            break
        seen.add(parent_key)
        compiled = revision.principals.get(holder)
        policy = compiled.policy if compiled is not None else None
        if policy is not None and getattr(policy, "propagate_taint", True) is False:
            break
        out.append(parent_key)
        current = await lookup(store, parent_key)
    return out


class DelegationCheck:
    """Second check: computes the run's lineage, refuses too-deep runs and off-roster agents."""

    id: ClassVar[str] = "delegation"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._revision = revision
        self._services = services
        defaults = revision.document.defaults
        self._default_depth = int(getattr(defaults, "max_depth", 2))
        self._depth: dict[str, tuple[int, str]] = {}
        self._rosters: dict[str, frozenset[str]] = {}
        # Per principal, the principals whose runs may be its runs' parents (they list it under
        # `delegates`), in a stable order.
        delegators: dict[str, list[str]] = {}
        for pid, principal in sorted(revision.principals.items()):
            for child in getattr(principal.policy, "delegates", ()) or ():
                if child != pid:
                    delegators.setdefault(child, []).append(pid)
        self._delegators = {child: tuple(pids) for child, pids in delegators.items()}
        for pid, principal in revision.principals.items():
            own = getattr(principal.policy, "max_depth", None)
            if own is not None:
                self._depth[pid] = (int(own), f"principals.{pid}.max_depth")
            roster = getattr(principal.policy, "roster", None)
            if roster is not None:
                self._rosters[pid] = frozenset(roster)

    def _store(self) -> Store | None:
        return self._services.store if self._services is not None else None

    def applies(self, call: ToolCall) -> bool:
        # Without a store there is no lineage to read: only calls that name a parent need one.
        return self._store() is not None or bool(call.run.parent)

    async def decide(self, call: ToolCall) -> Decision | None:
        store = self._store()
        claimed = call.run.parent
        if store is None:
            return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                            f"run {call.run.id!r} names parent run {claimed!r} but no state store is "
                            "configured to record run lineage", "X-Envelope-Parent-Run")
        try:
            lineage = await resolve(store, call.run, self._delegators.get(call.principal.id, ()))
            targets = (tuple(await taint_ancestors(store, self._revision, call.run.key))
                       if lineage.parent is not None else ())
        except (StoreError, TimeoutError) as exc:
            if not claimed and call.effect is Effect.READ:
                return None  # a read of a run that names no parent: nothing to bound or record
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"cannot read the lineage of run {call.run.id!r}: the state store cannot "
                            f"answer ({exc or 'timed out'}); the call was refused")
        call.run = dataclasses.replace(call.run, parent=lineage.parent, depth=lineage.depth,
                                       agent=lineage.agent, lineage_known=True, taint_targets=targets)
        if lineage.parent is not None:
            call.audit_extra["run_parent"] = lineage.parent
            call.audit_extra["run_depth"] = lineage.depth
            if lineage.holder is not None and lineage.holder != call.principal.id:
                call.audit_extra["run_parent_principal"] = lineage.holder
        if claimed and claimed != lineage.parent:
            call.audit_extra["lineage_conflict"] = claimed
        bound, rule = self._depth.get(call.principal.id, (self._default_depth, "defaults.max_depth"))
        if lineage.depth > bound:
            return deny(
                Code.DEPTH_EXCEEDED, self.id,
                f"run {call.run.id!r} is at depth {lineage.depth} (parent {lineage.parent!r}) and the "
                f"bound is {bound} (root run 0, child 1, grandchild 2)",
                rule,
            )
        if lineage.parent is not None:
            holder = lineage.holder or call.principal.id
            roster = self._rosters.get(holder)
            if roster is not None and lineage.agent not in roster:
                named = (f"agent {lineage.agent!r}" if lineage.agent
                         else "no agent (X-Envelope-Agent)")
                listed = ", ".join(sorted(roster)) or "nobody"
                return deny(
                    Code.NOT_ON_ROSTER, self.id,
                    f"child run {call.run.id!r} of run {lineage.parent!r} names {named}, which is not on "
                    f"principal '{holder}''s roster ({listed})",
                    f"principals.{holder}.roster",
                )
        return None
