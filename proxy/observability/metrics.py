"""Prometheus metrics of the proxy, declared once in `METRICS`, on a private registry.

Every `Metrics()` owns its own `CollectorRegistry` (tests build many). Hot-path helpers cache
labelled children in dicts so a call costs one dict lookup and one increment.

Metrics declared `fast=True` (the per-call ones) skip prometheus_client's Counter/Histogram:
those take a lock per value and scan buckets linearly. A fast series is a plain list ("cell")
updated without a lock — the proxy is single-threaded asyncio per process — and a histogram
finds its bucket with `bisect`. `collect()` (run by `render()` in a worker thread) copies the
cells and builds the same families, so the exposition is unchanged; a scrape may see one
observation half-applied (bucket counted, sum not yet), never an error.

Label values must be bounded: `tool` is a catalogue name or "<unknown>", `upstream` a
configured upstream, `code` a `Code` value, `check` a check id. Never pass request bytes.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, cast, get_args

import prometheus_client.metrics as _prom_metrics
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# 10 µs .. 30 s: the envelope's checks sit in the µs range, upstream calls in ms..s.
DURATION_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

Stage = Literal["envelope", "upstream", "audit", "total"]
UpstreamOutcome = Literal["ok", "error", "timeout"]
ReloadResult = Literal["success", "failure"]
MisconfigLayer = Literal["registry", "envelope"]
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
    "invalid_header",
    "too_many_streams",
    "header_timeout",
    "foreign_session",
    "hop_by_hop_header",
    "underscore_header",
    "body_timeout",
    "bad_request",  # bytes the listener's parser does not take as an HTTP request (400)
]
# Requests the admin listener refused before any route: a Host it does not answer (421), no or
# an unknown approver token on a guarded route (401), no such route (404), no such method on a
# route (405), a POST body that did not arrive within `listener.header_timeout` (408), bytes its
# parser does not take as an HTTP request (400: see `bad_request` in `RejectReason`).
AdminRejectReason = Literal["bad_host", "unauthenticated", "not_found", "method_not_allowed",
                            "body_timeout", "bad_request"]
# Header fields the proxy did not forward: the direction, and why (a request field whose name
# holds `_`, a field the message's own `Connection` header named); see proxy/fronts/headers.py.
HeaderDirection = Literal["request", "response"]
HeaderDropReason = Literal["underscore", "connection"]
# Why an approval was requested: the tool's own `approval: required` (policy), a gated effect
# (defaults' or the principal's gated_effects), a flagged data flow (`on_flag: approve`), a
# tainted run's unendorsed critical arguments (`on_tainted: approve`).
ApprovalReason = Literal["policy", "gated_effect", "dataflow_flag", "tainted_run"]
# The fixed label sets, from the types above (one source for mypy and the runtime check).
STAGES: tuple[Stage, ...] = get_args(Stage)
UPSTREAM_OUTCOMES: tuple[UpstreamOutcome, ...] = get_args(UpstreamOutcome)
RELOAD_RESULTS: tuple[ReloadResult, ...] = get_args(ReloadResult)
MISCONFIG_LAYERS: tuple[MisconfigLayer, ...] = get_args(MisconfigLayer)
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)
ADMIN_REJECT_REASONS: tuple[AdminRejectReason, ...] = get_args(AdminRejectReason)
APPROVAL_REASONS: tuple[ApprovalReason, ...] = get_args(ApprovalReason)
# Response fields are never dropped for an underscore (only requests go to frameworks that fold).
HEADER_DROPS: tuple[tuple[HeaderDirection, HeaderDropReason], ...] = (
    ("request", "underscore"), ("request", "connection"), ("response", "connection"))


@dataclass(frozen=True)
class MetricSpec:
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    fast: bool = False  # lock-free collector (Counter or Histogram only): the per-call metrics

    def __post_init__(self) -> None:
        if self.fast and self.kind not in (Counter, Histogram):
            raise ValueError(f"{self.name}: only counters and histograms can be fast")


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(Counter, "envelope_decisions_total", "Decisions by upstream, tool, verdict and reason code.", ("upstream", "tool", "verdict", "code"), fast=True),
    MetricSpec(Histogram, "envelope_call_duration_seconds", "Time spent per stage of a tools/call (envelope, upstream, audit, total).", ("stage",), fast=True),
    MetricSpec(Histogram, "envelope_upstream_duration_seconds", "Duration of upstream requests.", ("upstream",), fast=True),
    MetricSpec(Counter, "envelope_upstream_requests_total", "Upstream requests by outcome (ok, error, timeout).", ("upstream", "outcome"), fast=True),
    MetricSpec(Counter, "envelope_policy_reloads_total", "Policy reload attempts by result (success, failure).", ("result",)),
    MetricSpec(Gauge, "envelope_policy_revision_info", "The policy revision being served (value 1).", ("revision",)),
    MetricSpec(Gauge, "envelope_policy_last_reload_timestamp_seconds", "Unix time of the last successful policy load."),
    MetricSpec(Gauge, "envelope_misconfigured_tools", "Tools that can never run, by layer (registry: catalogue vs policy; envelope: a missing dependency).", ("layer",)),
    MetricSpec(Counter, "envelope_audit_write_failures_total", "Audit records that could not be written (the call was refused)."),
    MetricSpec(Counter, "envelope_audit_records_total", "Audit records written.", fast=True),
    MetricSpec(Counter, "envelope_check_errors_total", "Checks that raised (the call was refused: fail closed).", ("check",)),
    MetricSpec(Counter, "envelope_rejected_requests_total", "Requests rejected at the front before the envelope.", ("reason",)),
    MetricSpec(Counter, "envelope_admin_rejected_requests_total", "Admin listener requests refused: bad_host (421, a Host it does not answer), unauthenticated (401, no or an unknown approver token), not_found (404, no such route), method_not_allowed (405), body_timeout (408, a body not arrived within listener.header_timeout), bad_request (400, bytes that are not an HTTP request the listener takes).", ("reason",)),
    MetricSpec(Counter, "envelope_headers_dropped_total", "Header fields not forwarded, by direction (request: toward an upstream; response: toward the client) and reason (underscore: a request field name holding '_'; connection: named by the message's Connection header).", ("direction", "reason")),
    MetricSpec(Gauge, "envelope_catalogue_tools", "Tools in the catalogue per upstream.", ("upstream",)),
    MetricSpec(Gauge, "envelope_upstream_up", "Upstream health: 1 up, 0 down or not yet known.", ("upstream",)),
    MetricSpec(Counter, "envelope_idempotent_replays_total", "Calls answered from the stored first result of the same call (never forwarded twice)."),
    MetricSpec(Counter, "envelope_idempotency_releases_total", "Idempotency keys whose outcome was unknown released by an approver (POST /v1/idempotency/<decision id>/release): the next call with that key is performed."),
    MetricSpec(Counter, "envelope_upstream_retries_total", "Upstream requests retried after a transient failure (connect error, 429, 502, 503, 504).", ("upstream",)),
    MetricSpec(Counter, "envelope_shadow_records_total", "Writer calls of shadow runs recorded instead of performed."),
    MetricSpec(Gauge, "envelope_approvals_pending", "Approvals waiting for a person's decision (not yet expired)."),
    MetricSpec(Counter, "envelope_dataflow_flagged_total", "Sink calls the data-flow check flagged, by tool and mode (shadow: forwarded; enforce: refused or sent to approval).", ("tool", "mode")),
    MetricSpec(Counter, "envelope_dataflow_tainted_total", "Sink calls in a run that read untrusted content with critical arguments nothing trusted endorses (dataflow.on_tainted), by tool, mode and action (allow is never counted; shadow: forwarded).", ("tool", "mode", "action")),
    MetricSpec(Counter, "envelope_gates_waived_total", "Gated calls let through without a person because the run's intent asked for the action and named every critical argument (dataflow.waive_gate), by tool.", ("tool",)),
    MetricSpec(Counter, "envelope_approvals_requested_total", "Approvals requested (a new pending approval for a call), by reason (policy, gated_effect, dataflow_flag, tainted_run).", ("reason",)),
    MetricSpec(Counter, "envelope_approval_webhook_failures_total", "Failed approval webhook delivery attempts (each retry counts)."),
    MetricSpec(Counter, "envelope_guardrail_actions_total", "Output guardrail rules that fired on a result, by tool and action (redact, block, warn).", ("tool", "action")),
    MetricSpec(Gauge, "envelope_stdio_processes", "Child processes of each stdio upstream (running or starting), against its max_processes.", ("upstream",)),
)  # fmt: skip


def _v(x: Any) -> str:
    return str(x.value) if isinstance(x, Enum) else str(x)


# -- lock-free collectors for the hot path ---------------------------------------------------

_BOUNDS: tuple[float, ...] = tuple(float(b) for b in DURATION_BUCKETS)
# `bisect_left(_BOUNDS, v)` is the first bucket with v <= le (Prometheus' rule); len(_BOUNDS)
# is the +Inf bucket. A histogram cell: per-bucket (non-cumulative) counts, then sum, created.
_LE: tuple[str, ...] = (*(floatToGoString(b) for b in _BOUNDS), "+Inf")
_NB = len(_LE)
_SUM = _NB
_CREATED = _NB + 1

Cell = list[Any]  # counter: [value, created]; histogram: [*bucket counts, sum, created]


def _snapshot(cells: dict[tuple[str, ...], Cell]) -> list[tuple[tuple[str, ...], Cell]]:
    """Copy of `cells` safe against the event loop adding a series during the copy."""
    while True:
        try:
            return [(k, list(c)) for k, c in list(cells.items())]
        except RuntimeError:  # "dictionary changed size during iteration": copy again
            continue


class _FastMetric:
    """A fast `MetricSpec`'s series: label values -> cell, read by `collect()` without a lock."""

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.cells: dict[tuple[str, ...], Cell] = {}
        if not spec.labels:  # an unlabelled series exists (at 0) from the start
            self.child(())

    def child(self, labelvalues: tuple[str, ...]) -> Cell:
        """The cell of one series, created on first use (called on the event loop only)."""
        cell = self.cells.get(labelvalues)
        if cell is None:
            if len(labelvalues) != len(self.spec.labels):
                raise ValueError(f"{self.spec.name}: expected labels {self.spec.labels}")
            cell = self._new_cell(time.time())
            self.cells[labelvalues] = cell
        return cell

    def _new_cell(self, created: float) -> Cell:
        raise NotImplementedError

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class _FastCounter(_FastMetric):
    def _new_cell(self, created: float) -> Cell:
        return [0, created]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.spec.name, self.spec.doc, labels=self.spec.labels)

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        use_created = _prom_metrics._use_created
        for labelvalues, (value, created) in _snapshot(self.cells):
            fam.add_metric(labelvalues, float(value), created=created if use_created else None)
        yield fam


class _FastHistogram(_FastMetric):
    def _new_cell(self, created: float) -> Cell:
        return [*([0] * _NB), 0.0, created]

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.spec.name, self.spec.doc, labels=self.spec.labels)

    def collect(self) -> Iterator[Metric]:
        fam = self._family()
        use_created = _prom_metrics._use_created
        labelnames = self.spec.labels
        for labelvalues, cell in _snapshot(self.cells):
            buckets: list[tuple[str, float]] = []
            acc = 0
            for le, n in zip(_LE, cell[:_NB], strict=True):
                acc += n
                buckets.append((le, float(acc)))
            fam.add_metric(labelvalues, buckets, float(cell[_SUM]))
            if use_created:
                labels = dict(zip(labelnames, labelvalues, strict=True))
                fam.samples.append(Sample(fam.name + "_created", labels, cell[_CREATED], None))
        yield fam


class Metrics:
    """The proxy's metrics on a private registry, with cached hot-path helpers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.collectors: dict[str, Any] = {}
        for spec in METRICS:  # registration order is exposition order
            if spec.fast:
                fast = (_FastHistogram if spec.kind is Histogram else _FastCounter)(spec)
                self.registry.register(fast)
                self.collectors[spec.name] = fast
                continue
            kwargs: dict[str, Any] = {"registry": self.registry}
            if spec.kind is Histogram:
                kwargs["buckets"] = DURATION_BUCKETS
            self.collectors[spec.name] = spec.kind(spec.name, spec.doc, spec.labels, **kwargs)
        c = self.collectors
        self._decisions = cast(_FastCounter, c["envelope_decisions_total"])
        self._upstream_hist = cast(_FastHistogram, c["envelope_upstream_duration_seconds"])
        self._upstream_req = cast(_FastCounter, c["envelope_upstream_requests_total"])
        self._revision = cast(Gauge, c["envelope_policy_revision_info"])
        self._last_reload = cast(Gauge, c["envelope_policy_last_reload_timestamp_seconds"])
        misconfigured = cast(Gauge, c["envelope_misconfigured_tools"])
        self._misconfigured = {layer: misconfigured.labels(layer) for layer in MISCONFIG_LAYERS}
        self._audit_failures = cast(Counter, c["envelope_audit_write_failures_total"])
        self._audit_records = cast(_FastCounter, c["envelope_audit_records_total"]).child(())
        self._check_errors = cast(Counter, c["envelope_check_errors_total"])
        self._catalogue = cast(Gauge, c["envelope_catalogue_tools"])
        # Fixed label sets are created up front: their series exist (at 0) from the start.
        stage_hist = cast(_FastHistogram, c["envelope_call_duration_seconds"])
        self._stages = {s: stage_hist.child((s,)) for s in STAGES}
        reloads = cast(Counter, c["envelope_policy_reloads_total"])
        self._reloads = {r: reloads.labels(r) for r in RELOAD_RESULTS}
        rejected = cast(Counter, c["envelope_rejected_requests_total"])
        self._rejected = {r: rejected.labels(r) for r in REJECT_REASONS}
        admin_rejected = cast(Counter, c["envelope_admin_rejected_requests_total"])
        self._admin_rejected = {r: admin_rejected.labels(r) for r in ADMIN_REJECT_REASONS}
        dropped = cast(Counter, c["envelope_headers_dropped_total"])
        self._headers_dropped = {key: dropped.labels(*key) for key in HEADER_DROPS}
        requested = cast(Counter, c["envelope_approvals_requested_total"])
        self._approvals_requested = {r: requested.labels(r) for r in APPROVAL_REASONS}
        self._decision_children: dict[tuple[Any, ...], Cell] = {}
        self._upstream_children: dict[tuple[str, str], tuple[Cell, Cell]] = {}
        self._check_children: dict[str, Any] = {}
        self._current_revision: str | None = None
        self._catalogue_upstreams: set[str] = set()
        self._up_upstreams: set[str] = set()

    # -- hot path -------------------------------------------------------------------------

    def decision(self, upstream: str, tool: str, verdict: Any, code: Any) -> None:
        """Count one decision. `tool` must be a catalogue name or "<unknown>" (bounded)."""
        key = (upstream, tool, verdict, code)
        cell = self._decision_children.get(key)
        if cell is None:
            cell = self._decisions.child((str(upstream), str(tool), _v(verdict), _v(code)))
            self._decision_children[key] = cell
        cell[0] += 1

    def observe_stage(self, stage: Stage, seconds: float) -> None:
        """Record one stage's duration; raises ValueError for a stage not in `STAGES`."""
        try:
            cell = self._stages[stage]
        except KeyError:
            raise ValueError(f"unknown stage {stage!r}") from None
        cell[bisect_left(_BOUNDS, seconds)] += 1
        cell[_SUM] += seconds

    def observe_upstream(self, upstream: str, seconds: float, outcome: UpstreamOutcome) -> None:
        """Record one upstream request: its duration and outcome (ok, error, timeout)."""
        key = (upstream, outcome)
        pair = self._upstream_children.get(key)
        if pair is None:
            if outcome not in UPSTREAM_OUTCOMES:
                raise ValueError(f"unknown upstream outcome {outcome!r}")
            pair = (
                self._upstream_hist.child((str(upstream),)),
                self._upstream_req.child((str(upstream), outcome)),
            )
            self._upstream_children[key] = pair
        hist = pair[0]
        hist[bisect_left(_BOUNDS, seconds)] += 1
        hist[_SUM] += seconds
        pair[1][0] += 1

    def audit_record(self) -> None:
        self._audit_records[0] += 1

    def audit_write_failure(self) -> None:
        self._audit_failures.inc()

    def check_error(self, check: str) -> None:
        """Count a check that raised; `check` is the check's stable id."""
        child = self._check_children.get(check)
        if child is None:
            child = self._check_children[check] = self._check_errors.labels(check)
        child.inc()

    def idempotent_replay(self) -> None:
        """Count one call answered from a stored result."""
        cast(Counter, self.collectors["envelope_idempotent_replays_total"]).inc()

    def idempotency_release(self) -> None:
        """Count one idempotency key released by an approver."""
        cast(Counter, self.collectors["envelope_idempotency_releases_total"]).inc()

    def upstream_retry(self, upstream: str) -> None:
        """Count one retried upstream request; `upstream` is a configured upstream name."""
        cast(Counter, self.collectors["envelope_upstream_retries_total"]).labels(upstream).inc()

    def shadow_record(self) -> None:
        """Count one writer call recorded (not performed) in a shadow run."""
        cast(Counter, self.collectors["envelope_shadow_records_total"]).inc()

    def guardrail_action(self, tool: str, action: str) -> None:
        """Count one guardrail rule that fired on a result; `tool` as for `decision`."""
        cast(Counter, self.collectors["envelope_guardrail_actions_total"]).labels(tool, action).inc()

    def dataflow_flagged(self, tool: str, mode: str) -> None:
        """Count one flagged sink; `tool` is a catalogue name or "<unknown>", `mode` the
        data-flow mode (shadow, enforce)."""
        cast(Counter, self.collectors["envelope_dataflow_flagged_total"]).labels(tool, mode).inc()

    def dataflow_tainted(self, tool: str, mode: str, action: str) -> None:
        """Count one tainted-run sink with unendorsed critical arguments; `tool` is a catalogue
        name or "<unknown>", `action` approve or block (what enforce does)."""
        cast(Counter, self.collectors["envelope_dataflow_tainted_total"]).labels(tool, mode, action).inc()

    def gate_waived(self, tool: str) -> None:
        """Count one gated call whose gate the run's intent waived; `tool` as for
        `dataflow_flagged`."""
        cast(Counter, self.collectors["envelope_gates_waived_total"]).labels(tool).inc()

    def approval_requested(self, reason: ApprovalReason) -> None:
        """Count one new approval request; raises ValueError outside `APPROVAL_REASONS`."""
        try:
            child = self._approvals_requested[reason]
        except KeyError:
            raise ValueError(f"unknown approval reason {reason!r}") from None
        child.inc()

    def rejected(self, reason: RejectReason) -> None:
        """Count a request rejected at the front; raises ValueError outside `REJECT_REASONS`."""
        try:
            child = self._rejected[reason]
        except KeyError:
            raise ValueError(f"unknown rejection reason {reason!r}") from None
        child.inc()

    def admin_rejected(self, reason: AdminRejectReason) -> None:
        """Count a request the admin listener refused (421, 401, 404, 405, 408, 400)."""
        self._admin_rejected[reason].inc()

    def headers_dropped(self, direction: HeaderDirection, reason: HeaderDropReason, count: int = 1) -> None:
        """Count header fields not forwarded; raises ValueError outside the fixed label sets."""
        try:
            child = self._headers_dropped[(direction, reason)]
        except KeyError:
            raise ValueError(f"unknown header drop {(direction, reason)!r}") from None
        child.inc(count)

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
            self.loaded(when)

    def loaded(self, when: float | None = None) -> None:
        """Set the last-load timestamp: a successful reload, and the start-up load (a fresh
        process whose gauge said 0 looked like a policy loaded in 1970)."""
        self._last_reload.set(time.time() if when is None else when)

    def set_misconfigured(self, counts: Mapping[str, int]) -> None:
        """Set misconfigured tools per layer; a layer absent from `counts` is 0. Raises
        ValueError for a layer not in `MISCONFIG_LAYERS`."""
        unknown = set(counts) - set(MISCONFIG_LAYERS)
        if unknown:
            raise ValueError(f"unknown misconfiguration layer(s) {sorted(unknown)}")
        for layer, child in self._misconfigured.items():
            child.set(counts.get(layer, 0))

    def set_catalogue(self, counts: Mapping[str, int]) -> None:
        """Set tools per upstream; upstreams no longer present lose their series."""
        for upstream in self._catalogue_upstreams - set(counts):
            self._catalogue.remove(upstream)
        for upstream, n in counts.items():
            self._catalogue.labels(upstream).set(n)
        self._catalogue_upstreams = set(counts)

    # -- approvals ---------------------------------------------------------------------------

    def set_approvals_pending(self, count: int) -> None:
        cast(Gauge, self.collectors["envelope_approvals_pending"]).set(count)

    def approval_webhook_failure(self) -> None:
        cast(Counter, self.collectors["envelope_approval_webhook_failures_total"]).inc()

    def set_upstreams_up(self, states: Mapping[str, bool | None]) -> None:
        """Set `envelope_upstream_up` (None, unknown, counts as 0); gone upstreams lose their series."""
        gauge = cast(Gauge, self.collectors["envelope_upstream_up"])
        for upstream in self._up_upstreams - set(states):
            gauge.remove(upstream)
        for upstream, up in states.items():
            gauge.labels(upstream).set(1 if up else 0)
        self._up_upstreams = set(states)

    def set_stdio_processes(self, upstream: str, count: int) -> None:
        cast(Gauge, self.collectors["envelope_stdio_processes"]).labels(upstream).set(count)

    # -- exposition -----------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
