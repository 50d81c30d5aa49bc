"""Delegation check: sub-agent runs stay within `max_depth` and on their holder's roster.

A child run names its parent with `X-Envelope-Parent-Run` (and its agent name with
`X-Envelope-Agent`). The proxy computes the depth from its own lineage records, never from the
client: the store namespace `run`, key `<run id>/lineage`, a JSON object

    {"parent": <run id or null>, "depth": <int>, "principal": <id>, "holder": <parent's principal
     or null>, "agent": <name or null>, "implied": <bool>, "since": <utc time>}

written once, on the first call the proxy sees of a run (`add`: the first writer wins on every
replica, and a record never changes afterwards, so replicas may cache it). A root run (no parent)
is depth 0; a child is its parent's depth + 1. A child naming a parent the proxy has never seen
records that parent as a root at depth 0 (`implied: true`). A later call of a run that names
another parent keeps the recorded lineage (audited as `lineage_conflict`).

Refusals:
- `depth_exceeded` when the run's depth is beyond the calling principal's `max_depth`
  (absent: `defaults.max_depth`, 2: session, child, grandchild);
- `not_on_roster` when a child run's agent is not on the roster of its parent's principal (the
  holder): a child with no agent name is not guessed onto it.

Fail closed: a call naming a parent with no state store is refused `misconfigured`; a store that
cannot answer refuses child calls and writer calls `store_unavailable` (read calls of runs that
name no parent keep working, at depth 0, so an outage does not stop reads).

Taint crosses the boundary upwards: for a child run this check sets `call.run.taint_targets`
to `taint_ancestors` (the ancestor runs whose ledgers the child's untrusted or secret output
widens, cut at a parent whose principal sets `propagate_taint: false`); the data-flow check's
result hook widens each with `proxy.envelope.checks.dataflow.widen_parent` after updating the child's
own ledger.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import orjson

from proxy.audit.record import utc_timestamp
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, Verdict, deny
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.vocab import Effect
from proxy.store.base import Store

log = logging.getLogger("envelope.delegation")

RUN_NS = "run"
# Lineage records outlive the runs they describe by far; a run idle longer than this is
# recorded anew (as a root, or from the parent it names) on its next call.
LINEAGE_TTL = 7 * 24 * 3600.0
# Records cached per process (immutable once written, so a cached record is never stale).
CACHE_SIZE = 10_000
# Deepest ancestor chain `taint_ancestors` walks (a cycle or a corrupt record cannot loop).
MAX_WALK = 64


def lineage_key(run_id: str) -> str:
    return f"{run_id}/lineage"


@dataclass(frozen=True, slots=True)
class Lineage:
    """One run's recorded place in its tree."""

    parent: str | None
    depth: int
    principal: str
    holder: str | None = None  # the parent run's principal (whose roster applies)
    agent: str | None = None
    implied: bool = False  # recorded because a child named it, before any call of its own

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

    def get(self, store: Store, run_id: str) -> Lineage | None:
        key = (id(store), run_id)
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, store: Store, run_id: str, lineage: Lineage) -> None:
        self._items[(id(store), run_id)] = lineage
        self._items.move_to_end((id(store), run_id))
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


CACHE = _Cache()


async def lookup(store: Store, run_id: str) -> Lineage | None:
    """The recorded lineage of a run, or None (raises StoreError)."""
    cached = CACHE.get(store, run_id)
    if cached is not None:
        return cached
    raw = await store.get(RUN_NS, lineage_key(run_id))
    if raw is None:
        return None
    lineage = Lineage.loads(raw)
    CACHE.put(store, run_id, lineage)
    return lineage


async def record(store: Store, run_id: str, lineage: Lineage) -> Lineage:
    """Record a run's lineage unless one exists; the recorded one (first writer wins)."""
    if not await store.add(RUN_NS, lineage_key(run_id), lineage.dumps(), ttl=LINEAGE_TTL):
        existing = await lookup(store, run_id)
        if existing is not None:
            return existing
        # Expired between the two calls: record ours (nothing else can be more right).
        await store.put(RUN_NS, lineage_key(run_id), lineage.dumps(), ttl=LINEAGE_TTL)
    CACHE.put(store, run_id, lineage)
    return lineage


async def resolve(store: Store, run_id: str, principal: str, parent: str | None,
                  agent: str | None) -> Lineage:
    """The lineage of `run_id`: recorded, or computed from the named parent's record and
    recorded now. Client-sent depths do not exist: depth is always the proxy's own count."""
    own = await lookup(store, run_id)
    if own is not None:
        return own
    if parent and parent != run_id:
        above = await lookup(store, parent)
        if above is None:  # never seen: a root at depth 0, recorded so its other children agree
            above = await record(store, parent, Lineage(None, 0, principal, implied=True))
        own = Lineage(parent, above.depth + 1, principal, holder=above.principal, agent=agent)
    else:
        own = Lineage(None, 0, principal, agent=agent)
    return await record(store, run_id, own)


async def taint_ancestors(store: Store, revision: PolicyRevision, run_id: str) -> list[str]:
    """The ancestor runs (nearest first) whose ledgers a taint seen in `run_id` widens: up the
    recorded lineage, stopping at (and excluding) a parent whose principal sets
    `propagate_taint: false`. [] for a root run or an unknown one. Raises StoreError."""
    out: list[str] = []
    seen = {run_id}
    current = await lookup(store, run_id)
    while current is not None and current.parent and len(out) < MAX_WALK:
        parent_id = current.parent
        if parent_id in seen:
            break
        seen.add(parent_id)
        parent = await lookup(store, parent_id)
        holder = parent.principal if parent is not None else current.holder
        compiled = revision.principals.get(holder) if holder is not None else None
        policy = compiled.policy if compiled is not None else None
        if policy is not None and getattr(policy, "propagate_taint", True) is False:
            break
        out.append(parent_id)
        current = parent
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
            lineage = await resolve(store, call.run.id, call.principal.id, claimed, call.run.agent)
            targets = (tuple(await taint_ancestors(store, self._revision, call.run.id))
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
