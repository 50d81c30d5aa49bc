"""Per-upstream health: `up`, `down` or `unknown`, from real traffic and an optional probe.

`UpstreamHealth` is fed every upstream request outcome by the MCP fronts (ok / error /
timeout, with the error message) and by `HealthProber`, a periodic lightweight HTTP request to
each upstream URL that counts *any* HTTP status as alive (the probe sends a session id no
server knows, so MCP servers answer 404 at once and create no session). State per upstream:
consecutive failures, last error and when, last success. An upstream is `down` after
`down_after` consecutive failures and `up` again after one success.

Health is reported, never enforced: calls to a down upstream are still forwarded (and refused
as `upstream_error` when they fail), so an upstream coming back is used at once. Nor does it
touch readiness: one down upstream leaves the others serving, and restarting the proxy would
not bring it back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.upstream.forwarder import Forwarder

log = logging.getLogger("envelope.upstreams")

State = Literal["up", "down", "unknown"]
Outcome = Literal["ok", "error", "timeout"]
# Sent by the probe: unknown to every server, so an MCP server answers 404 without creating a
# session (a GET without one makes SDK servers mint a session per probe).
PROBE_SESSION = "envelope-health-probe"


@dataclass(slots=True)
class UpstreamState:
    """What is known about one upstream; times are Unix seconds (None: never)."""

    state: State = "unknown"
    consecutive_failures: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    last_success_at: float | None = None
    last_checked_at: float | None = None
    last_source: str | None = None  # "traffic" or "probe"

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "last_success_at": self.last_success_at,
            "last_checked_at": self.last_checked_at,
            "last_source": self.last_source,
        }


class UpstreamHealth:
    """Health of every configured upstream; `on_change({name: up})` sees every state change.

    `up` is True, False, or None while unknown."""

    def __init__(self, down_after: int = 1, on_change: Callable[[Mapping[str, bool | None]], None] | None = None,
                 clock: Callable[[], float] = time.time):
        if down_after < 1:
            raise ValueError("down_after must be at least 1")
        self.down_after = down_after
        self._states: dict[str, UpstreamState] = {}
        self._on_change = on_change
        self._clock = clock

    def sync(self, names: Iterable[str]) -> None:
        """Track exactly `names` (after a policy load): new ones start `unknown`."""
        wanted = set(names)
        changed = False
        for name in list(self._states):
            if name not in wanted:
                del self._states[name]
                changed = True
        for name in wanted:
            if name not in self._states:
                self._states[name] = UpstreamState()
                changed = True
        if changed:
            self._publish()

    def record(self, upstream: str, outcome: Outcome, error: str | None = None,
               source: str = "traffic") -> None:
        """Feed one request outcome. Unknown upstream names are ignored (never a new series)."""
        st = self._states.get(upstream)
        if st is None:
            return
        now = self._clock()
        st.last_checked_at = now
        st.last_source = source
        before = st.state
        if outcome == "ok":
            st.consecutive_failures = 0
            st.last_success_at = now
            st.state = "up"
        else:
            st.consecutive_failures += 1
            st.last_error = error or ("timed out" if outcome == "timeout" else "request failed")
            st.last_error_at = now
            if st.consecutive_failures >= self.down_after:
                st.state = "down"
        if st.state != before:
            if st.state == "down":
                log.warning("upstream %s is down (%s): %s", upstream, source, st.last_error)
            else:
                log.info("upstream %s is %s (%s)", upstream, st.state, source)
            self._publish()

    def mark_down(self, upstream: str, error: str, source: str = "process") -> None:
        """What the proxy itself saw fail for sure (a stdio child exited): down at once,
        whatever `down_after` says (that threshold guards against one lost request)."""
        st = self._states.get(upstream)
        if st is None:
            return
        for _ in range(max(1, self.down_after - st.consecutive_failures)):
            self.record(upstream, "error", error, source=source)

    def state(self, upstream: str) -> State:
        st = self._states.get(upstream)
        return st.state if st is not None else "unknown"

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every upstream's state as JSON types, sorted by name."""
        return {name: self._states[name].as_dict() for name in sorted(self._states)}

    def summary(self) -> dict[str, dict[str, Any]]:
        """The short form shown by `/readyz`: state and last error."""
        return {name: {"state": st.state, "last_error": st.last_error}
                for name, st in sorted(self._states.items())}

    def _publish(self) -> None:
        if self._on_change is not None:
            self._on_change({n: (None if s.state == "unknown" else s.state == "up")
                             for n, s in self._states.items()})


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    name: str
    url: str


class HealthProber:
    """Probes every upstream each `interval` seconds; one tracked task, stopped by `stop()`."""

    def __init__(self, health: UpstreamHealth, forwarder: Forwarder,
                 targets: Callable[[], Iterable[ProbeTarget]], interval: float, timeout: float):
        self.health = health
        self.forwarder = forwarder
        self.targets = targets
        self.interval = interval
        self.timeout = timeout
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="envelope-health-probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        # The first probe waits one interval: startup stays quiet towards upstreams, and real
        # traffic in the meantime already reports health.
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.probe_all()
            except Exception:  # a bug in probing must not end the loop
                log.exception("upstream health probe failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(t) for t in self.targets()))

    async def probe(self, target: ProbeTarget) -> None:
        """One probe: any HTTP answer within `timeout` is up; refused, reset or silent is down."""
        try:
            async with asyncio.timeout(self.timeout):
                resp = await self.forwarder.open(
                    "GET", target.url,
                    {"Accept": "application/json", "Mcp-Session-Id": PROBE_SESSION},
                    None, connect_timeout=self.timeout, read_timeout=self.timeout,
                    # A probe changes nothing upstream; resending it after the stale keep-alive
                    # race keeps that race from marking a healthy upstream down.
                    resend=True,
                )
            resp.close()
        except (TimeoutError, UpstreamTimeout):
            self.health.record(target.name, "timeout",
                               f"probe: no answer within {self.timeout:g}s", source="probe")
        except UpstreamError as exc:
            self.health.record(target.name, "error", f"probe: {exc}", source="probe")
        else:
            self.health.record(target.name, "ok", source="probe")
