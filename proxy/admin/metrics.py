"""Prometheus metrics of the proxy, declared once in `METRICS`, on a private registry.

Every `Metrics()` owns its own `CollectorRegistry` (tests build many). Hot-path helpers cache
labelled children in dicts so a call costs one dict lookup and one increment.

Label values must be bounded: `tool` is a catalogue name or "<unknown>", `upstream` a
configured upstream, `code` a `Code` value, `check` a check id. Never pass request bytes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, cast, get_args

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# 10 µs .. 30 s: the envelope's checks sit in the µs range, upstream calls in ms..s.
DURATION_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

Stage = Literal["envelope", "upstream", "audit", "total"]
UpstreamOutcome = Literal["ok", "error", "timeout"]
ReloadResult = Literal["success", "failure"]
RejectReason = Literal[
    "parse_error",
    "invalid_request",
    "batch",
    "too_large",
    "too_deep",
    "bad_host",
    "bad_origin",
    "unauthenticated",
    "header_mismatch",
]
# The fixed label sets, from the types above (one source for mypy and the runtime check).
STAGES: tuple[Stage, ...] = get_args(Stage)
UPSTREAM_OUTCOMES: tuple[UpstreamOutcome, ...] = get_args(UpstreamOutcome)
RELOAD_RESULTS: tuple[ReloadResult, ...] = get_args(ReloadResult)
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)


@dataclass(frozen=True)
class MetricSpec:
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(Counter, "envelope_decisions_total", "Decisions by upstream, tool, verdict and reason code.", ("upstream", "tool", "verdict", "code")),
    MetricSpec(Histogram, "envelope_call_duration_seconds", "Time spent per stage of a tools/call (envelope, upstream, audit, total).", ("stage",)),
    MetricSpec(Histogram, "envelope_upstream_duration_seconds", "Duration of upstream requests.", ("upstream",)),
    MetricSpec(Counter, "envelope_upstream_requests_total", "Upstream requests by outcome (ok, error, timeout).", ("upstream", "outcome")),
    MetricSpec(Counter, "envelope_policy_reloads_total", "Policy reload attempts by result (success, failure).", ("result",)),
    MetricSpec(Gauge, "envelope_policy_revision_info", "The policy revision being served (value 1).", ("revision",)),
    MetricSpec(Gauge, "envelope_policy_last_reload_timestamp_seconds", "Unix time of the last successful policy load."),
    MetricSpec(Gauge, "envelope_misconfigured_tools", "Tools whose policy can never let them run."),
    MetricSpec(Counter, "envelope_audit_write_failures_total", "Audit records that could not be written (the call was refused)."),
    MetricSpec(Counter, "envelope_audit_records_total", "Audit records written."),
    MetricSpec(Counter, "envelope_check_errors_total", "Checks that raised (the call was refused: fail closed).", ("check",)),
    MetricSpec(Counter, "envelope_rejected_requests_total", "Requests rejected at the front before the envelope.", ("reason",)),
    MetricSpec(Gauge, "envelope_catalogue_tools", "Tools in the catalogue per upstream.", ("upstream",)),
)  # fmt: skip


def _v(x: Any) -> str:
    return str(x.value) if isinstance(x, Enum) else str(x)


class Metrics:
    """The proxy's metrics on a private registry, with cached hot-path helpers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.collectors: dict[str, Any] = {}
        for spec in METRICS:
            kwargs: dict[str, Any] = {"registry": self.registry}
            if spec.kind is Histogram:
                kwargs["buckets"] = DURATION_BUCKETS
            self.collectors[spec.name] = spec.kind(spec.name, spec.doc, spec.labels, **kwargs)
        c = self.collectors
        self._decisions = cast(Counter, c["envelope_decisions_total"])
        self._upstream_hist = cast(Histogram, c["envelope_upstream_duration_seconds"])
        self._upstream_req = cast(Counter, c["envelope_upstream_requests_total"])
        self._revision = cast(Gauge, c["envelope_policy_revision_info"])
        self._last_reload = cast(Gauge, c["envelope_policy_last_reload_timestamp_seconds"])
        self._misconfigured = cast(Gauge, c["envelope_misconfigured_tools"])
        self._audit_failures = cast(Counter, c["envelope_audit_write_failures_total"])
        self._audit_records = cast(Counter, c["envelope_audit_records_total"])
        self._check_errors = cast(Counter, c["envelope_check_errors_total"])
        self._catalogue = cast(Gauge, c["envelope_catalogue_tools"])
        # Fixed label sets are created up front: their series exist (at 0) from the start.
        stage_hist = cast(Histogram, c["envelope_call_duration_seconds"])
        self._stages = {s: stage_hist.labels(s) for s in STAGES}
        reloads = cast(Counter, c["envelope_policy_reloads_total"])
        self._reloads = {r: reloads.labels(r) for r in RELOAD_RESULTS}
        rejected = cast(Counter, c["envelope_rejected_requests_total"])
        self._rejected = {r: rejected.labels(r) for r in REJECT_REASONS}
        self._decision_children: dict[tuple[Any, ...], Any] = {}
        self._upstream_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._check_children: dict[str, Any] = {}
        self._current_revision: str | None = None
        self._catalogue_upstreams: set[str] = set()

    # -- hot path -------------------------------------------------------------------------

    def decision(self, upstream: str, tool: str, verdict: Any, code: Any) -> None:
        """Count one decision. `tool` must be a catalogue name or "<unknown>" (bounded)."""
        key = (upstream, tool, verdict, code)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decisions.labels(upstream, tool, _v(verdict), _v(code))
            self._decision_children[key] = child
        child.inc()

    def observe_stage(self, stage: Stage, seconds: float) -> None:
        """Record one stage's duration; raises ValueError for a stage not in `STAGES`."""
        try:
            child = self._stages[stage]
        except KeyError:
            raise ValueError(f"unknown stage {stage!r}") from None
        child.observe(seconds)

    def observe_upstream(self, upstream: str, seconds: float, outcome: UpstreamOutcome) -> None:
        """Record one upstream request: its duration and outcome (ok, error, timeout)."""
        key = (upstream, outcome)
        pair = self._upstream_children.get(key)
        if pair is None:
            if outcome not in UPSTREAM_OUTCOMES:
                raise ValueError(f"unknown upstream outcome {outcome!r}")
            pair = (
                self._upstream_hist.labels(upstream),
                self._upstream_req.labels(upstream, outcome),
            )
            self._upstream_children[key] = pair
        pair[0].observe(seconds)
        pair[1].inc()

    def audit_record(self) -> None:
        self._audit_records.inc()

    def audit_write_failure(self) -> None:
        self._audit_failures.inc()

    def check_error(self, check: str) -> None:
        """Count a check that raised; `check` is the check's stable id."""
        child = self._check_children.get(check)
        if child is None:
            child = self._check_children[check] = self._check_errors.labels(check)
        child.inc()

    def rejected(self, reason: RejectReason) -> None:
        """Count a request rejected at the front; raises ValueError outside `REJECT_REASONS`."""
        try:
            child = self._rejected[reason]
        except KeyError:
            raise ValueError(f"unknown rejection reason {reason!r}") from None
        child.inc()

    # -- policy and catalogue ---------------------------------------------------------------

    def set_revision(self, revision: str) -> None:
        """Expose `revision` as the served one; the previous revision's series is removed."""
        previous = self._current_revision
        if previous == revision:
            return
        if previous is not None:
            self._revision.remove(previous)
        self._revision.labels(revision).set(1)
        self._current_revision = revision

    def reload(self, result: ReloadResult, when: float | None = None) -> None:
        """Count a reload attempt; a success also sets the last-reload timestamp."""
        try:
            child = self._reloads[result]
        except KeyError:
            raise ValueError(f"unknown reload result {result!r}") from None
        child.inc()
        if result == "success":
            self._last_reload.set(time.time() if when is None else when)

    def set_misconfigured(self, count: int) -> None:
        self._misconfigured.set(count)

    def set_catalogue(self, counts: Mapping[str, int]) -> None:
        """Set tools per upstream; upstreams no longer present lose their series."""
        for upstream in self._catalogue_upstreams - set(counts):
            self._catalogue.remove(upstream)
        for upstream, n in counts.items():
            self._catalogue.labels(upstream).set(n)
        self._catalogue_upstreams = set(counts)

    # -- exposition -----------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
