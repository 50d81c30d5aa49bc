"""The lock-free hot-path collectors expose exactly what stock prometheus_client would."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics, enable_created_metrics
from prometheus_client.parser import text_string_to_metric_families

from proxy.envelope.types import Code, Verdict
from proxy.observability.metrics import (
    ADMIN_REJECT_REASONS,
    APPROVAL_REASONS,
    DURATION_BUCKETS,
    HEADER_DROPS,
    METRICS,
    MISCONFIG_LAYERS,
    REJECT_REASONS,
    RELOAD_RESULTS,
    STAGES,
    UPSTREAM_OUTCOMES,
    Metrics,
    MetricSpec,
)

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def _parse(body: bytes) -> dict[SampleKey, float]:
    out: dict[SampleKey, float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, key
            out[key] = s.value
    return out


def _families(body: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


class Stock:
    """The same hot-path calls on plain prometheus_client metrics (the reference)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.c: dict[str, Any] = {}
        for spec in METRICS:
            kwargs: dict[str, Any] = {"registry": self.registry}
            if spec.kind is Histogram:
                kwargs["buckets"] = DURATION_BUCKETS
            self.c[spec.name] = spec.kind(spec.name, spec.doc, spec.labels, **kwargs)
        for s in STAGES:
            self.c["envelope_call_duration_seconds"].labels(s)
        for r in RELOAD_RESULTS:
            self.c["envelope_policy_reloads_total"].labels(r)
        for r in REJECT_REASONS:
            self.c["envelope_rejected_requests_total"].labels(r)
        for r in ADMIN_REJECT_REASONS:
            self.c["envelope_admin_rejected_requests_total"].labels(r)
        for layer in MISCONFIG_LAYERS:
            self.c["envelope_misconfigured_tools"].labels(layer)
        for r in APPROVAL_REASONS:
            self.c["envelope_approvals_requested_total"].labels(r)
        for key in HEADER_DROPS:
            self.c["envelope_headers_dropped_total"].labels(*key)

    def decision(self, upstream: str, tool: str, verdict: Any, code: Any) -> None:
        self.c["envelope_decisions_total"].labels(upstream, tool, str(verdict), str(code)).inc()

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.c["envelope_call_duration_seconds"].labels(stage).observe(seconds)

    def observe_upstream(self, upstream: str, seconds: float, outcome: str) -> None:
        self.c["envelope_upstream_duration_seconds"].labels(upstream).observe(seconds)
        self.c["envelope_upstream_requests_total"].labels(upstream, outcome).inc()

    def audit_record(self) -> None:
        self.c["envelope_audit_records_total"].inc()


def _drive(targets: list[Any], n: int, seed: int = 7) -> None:
    rng = random.Random(seed)
    # Bucket bounds exactly, just around them, and beyond the last one (+Inf only).
    edges = [b for b in DURATION_BUCKETS] + [b * 1.0001 for b in DURATION_BUCKETS]
    edges += [0.0, 31.0, 1e6]
    for i in range(n):
        upstream = rng.choice(["github", "jira", 'x"y\\z\n'])  # label escaping too
        tool = rng.choice(["search_issues", "create_issue", "<unknown>"])
        verdict, code = rng.choice([(Verdict.ALLOW, Code.OK), ("deny", "unknown_tool")])
        outcome = rng.choice(UPSTREAM_OUTCOMES)
        secs = [rng.choice(edges) if i % 3 else rng.uniform(0, 40) for _ in range(5)]
        for t in targets:
            t.decision(upstream, tool, verdict, code)
            for stage, s in zip(STAGES, secs, strict=False):
                t.observe_stage(stage, s)
            t.observe_upstream(upstream, secs[4], outcome)
            t.audit_record()


def _without_created(samples: dict[SampleKey, float]) -> dict[SampleKey, float]:
    return {k: v for k, v in samples.items() if not k[0].endswith("_created")}


def test_exposition_matches_stock_prometheus_client() -> None:
    m, ref = Metrics(), Stock()
    _drive([m, ref], 500)
    ours, theirs = m.render()[0], generate_latest(ref.registry)
    assert _families(ours) == _families(theirs)
    a, b = _parse(ours), _parse(theirs)
    assert a.keys() == b.keys()  # same series, `_created` ones included
    a, b = _without_created(a), _without_created(b)
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-12), key
    # Same text line for line once the `_created` timestamps are set aside.
    strip = [ln for ln in ours.decode().splitlines() if "_created{" not in ln]
    strip_ref = [ln for ln in theirs.decode().splitlines() if "_created{" not in ln]
    assert [ln.rsplit(" ", 1)[0] for ln in strip] == [ln.rsplit(" ", 1)[0] for ln in strip_ref]


def test_counts_buckets_and_sums_after_hot_path_calls() -> None:
    m = Metrics()
    values = [0.00001, 0.00002, 0.0001, 0.003, 0.5, 30.0, 45.0]
    n = 40
    for _ in range(n):
        m.decision("github", "search_issues", Verdict.ALLOW, Code.OK)
        m.decision("github", "search_issues", "allow", "ok")  # same series as the enums
        for v in values:
            m.observe_stage("envelope", v)
        m.observe_upstream("github", 0.012, "ok")
        m.observe_upstream("jira", 100.0, "timeout")
        m.audit_record()
    s = _parse(m.render()[0])
    dec = ("envelope_decisions_total", tuple(sorted(
        {"code": "ok", "tool": "search_issues", "upstream": "github", "verdict": "allow"}.items()
    )))  # fmt: skip
    assert s[dec] == 2 * n
    assert [k for k in s if k[0] == "envelope_decisions_total"] == [dec]
    assert s[("envelope_audit_records_total", ())] == n

    def bucket(le: str, stage: str = "envelope") -> float:
        return s[("envelope_call_duration_seconds_bucket", (("le", le), ("stage", stage)))]

    expected = {  # cumulative: v <= le
        "1e-05": 1, "2.5e-05": 2, "5e-05": 2, "0.0001": 3, "0.00025": 3, "0.0005": 3,
        "0.001": 3, "0.0025": 3, "0.005": 4, "0.01": 4, "0.025": 4, "0.05": 4, "0.1": 4,
        "0.25": 4, "0.5": 5, "1.0": 5, "2.5": 5, "5.0": 5, "10.0": 5, "30.0": 6, "+Inf": 7,
    }  # fmt: skip
    assert {le: bucket(le) for le in expected} == {le: c * n for le, c in expected.items()}
    stage_count = ("envelope_call_duration_seconds_count", (("stage", "envelope"),))
    stage_sum = ("envelope_call_duration_seconds_sum", (("stage", "envelope"),))
    assert s[stage_count] == len(values) * n
    assert s[stage_sum] == pytest.approx(sum(values) * n)
    for stage in STAGES[1:]:  # declared up front, still empty
        assert bucket("+Inf", stage) == 0
        assert s[("envelope_call_duration_seconds_sum", (("stage", stage),))] == 0

    up = "envelope_upstream_duration_seconds"
    assert s[(f"{up}_count", (("upstream", "github"),))] == n
    assert s[(f"{up}_bucket", (("le", "0.01"), ("upstream", "github")))] == 0
    assert s[(f"{up}_bucket", (("le", "0.025"), ("upstream", "github")))] == n
    assert s[(f"{up}_bucket", (("le", "30.0"), ("upstream", "jira")))] == 0
    assert s[(f"{up}_bucket", (("le", "+Inf"), ("upstream", "jira")))] == n
    assert s[(f"{up}_sum", (("upstream", "jira"),))] == pytest.approx(100.0 * n)
    req = {k[1]: v for k, v in s.items() if k[0] == "envelope_upstream_requests_total"}
    assert req == {
        (("outcome", "ok"), ("upstream", "github")): n,
        (("outcome", "timeout"), ("upstream", "jira")): n,
    }


def test_created_series_are_consistent() -> None:
    m = Metrics()
    _drive([m], 3)
    s = _parse(m.render()[0])
    totals = {k for k in s if k[0].endswith(("_total", "_count"))}
    for name, labels in totals:
        base = name.removesuffix("_total").removesuffix("_count")
        assert (f"{base}_created", labels) in s, (name, labels)
    disable_created_metrics()
    try:
        assert not [k for k in _parse(m.render()[0]) if k[0].endswith("_created")]
    finally:
        enable_created_metrics()


def test_render_while_writing_from_another_thread() -> None:
    m = Metrics()
    stop = threading.Event()
    errors: list[BaseException] = []
    renders = 40

    def writer() -> None:
        try:
            i = 0
            while not stop.is_set():
                # New series keep appearing (650 in all) while the scraper copies the dicts.
                m.decision(f"u{i % 50}", f"t{i % 13}", "allow", "ok")
                for stage in STAGES:
                    m.observe_stage(stage, (i % 100) * 0.001)
                m.observe_upstream(f"u{i % 50}", 0.01, "ok")
                m.audit_record()
                i += 1
                if i % 64 == 0:
                    time.sleep(0)  # let the scraper in more often than every switch interval
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        deadline = time.monotonic() + 1.0
        for done in range(renders):
            if done >= 5 and time.monotonic() > deadline:
                break
            body, _ = m.render()
            s = _parse(body)  # always valid exposition
            assert s[("envelope_audit_records_total", ())] >= 0
    finally:
        stop.set()
        t.join()
    assert not errors
    s = _parse(m.render()[0])  # quiescent: exact again
    n = s[("envelope_audit_records_total", ())]
    assert sum(v for k, v in s.items() if k[0] == "envelope_decisions_total") == n
    for stage in STAGES:
        count = s[("envelope_call_duration_seconds_count", (("stage", stage),))]
        inf = s[("envelope_call_duration_seconds_bucket", (("le", "+Inf"), ("stage", stage)))]
        assert count == inf == n


def test_fast_is_only_for_counters_and_histograms() -> None:
    assert {spec.kind for spec in METRICS if spec.fast} <= {Counter, Histogram}
    with pytest.raises(ValueError):
        MetricSpec(Gauge, "x", "doc", fast=True)
