"""The budget of long-lived GET streams on the MCP listener, counted in this process.

A standalone GET stream holds a client connection and an upstream connection for as long as
the client likes, so one client could hold them all. Every GET stream takes a `StreamSlot`
before its upstream stream is opened: one per upstream stream, counted against its principal
(`limits.max_streams_per_principal`, over every upstream) and its upstream
(`limits.max_streams_per_upstream`, over every principal). Past either, `take` raises
`LimitExceeded` naming the limit and the front answers 503. A slot is freed by `release()`
(idempotent), which the front calls in a `finally`: a stream that ends, however it ends,
gives its slots back. Calls (POST) never take a slot.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.errors import LimitExceeded

__all__ = ["StreamBudget", "StreamSlot"]


class StreamSlot:
    """The slots one client stream holds: one per upstream stream behind it."""

    __slots__ = ("_budget", "principal", "upstreams")

    def __init__(self, budget: StreamBudget, principal: str, upstreams: tuple[str, ...]):
        self._budget: StreamBudget | None = budget
        self.principal = principal
        self.upstreams = upstreams

    def release(self) -> None:
        """Give the slots back (again: nothing)."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.principal, self.upstreams)


class StreamBudget:
    """Concurrent GET streams per principal and per upstream (see the module docstring)."""

    def __init__(self, per_principal: int, per_upstream: int):
        self.per_principal = per_principal
        self.per_upstream = per_upstream
        self._principals: dict[str, int] = {}
        self._upstreams: dict[str, int] = {}

    def take(self, principal: str, upstreams: Sequence[str]) -> StreamSlot:
        """Slots for one stream per upstream in `upstreams`, all or none; LimitExceeded (naming
        the limit) when the principal or an upstream has no room left."""
        wanted = tuple(upstreams)
        held = self._principals.get(principal, 0)
        if held + len(wanted) > self.per_principal:
            raise LimitExceeded(
                f"too many streams: principal {principal!r} holds {held} of "
                f"{self.per_principal} (limits.max_streams_per_principal)")
        for name in set(wanted):
            open_ = self._upstreams.get(name, 0)
            if open_ + wanted.count(name) > self.per_upstream:
                raise LimitExceeded(
                    f"too many streams: upstream {name!r} has {open_} of {self.per_upstream} "
                    "open (limits.max_streams_per_upstream)")
        if wanted:
            self._principals[principal] = held + len(wanted)
            for name in wanted:
                self._upstreams[name] = self._upstreams.get(name, 0) + 1
        return StreamSlot(self, principal, wanted)

    def held(self, principal: str | None = None, upstream: str | None = None) -> int:
        """Streams open for `principal` or to `upstream` (for tests and status)."""
        if principal is not None:
            return self._principals.get(principal, 0)
        return self._upstreams.get(upstream or "", 0)

    def _give_back(self, principal: str, upstreams: tuple[str, ...]) -> None:
        if not upstreams:
            return
        _decrement(self._principals, principal, len(upstreams))
        for name in upstreams:
            _decrement(self._upstreams, name, 1)


def _decrement(counts: dict[str, int], key: str, by: int) -> None:
    left = counts.get(key, 0) - by
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)  # no entry per principal that ever streamed: the map stays small
