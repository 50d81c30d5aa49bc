"""deploy/prometheus and deploy/grafana: promtool, CR/plain-file parity, metric names and labels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from deploy_helpers import DEPLOY, REPO, TARGET_LABELS, grouping_labels, load_yaml, metric_refs
from prometheus_client import Histogram

from proxy.envelope.types import Code, Verdict
from proxy.observability.metrics import (
    METRICS,
    MISCONFIG_LAYERS,
    REJECT_REASONS,
    RELOAD_RESULTS,
    STAGES,
    UPSTREAM_OUTCOMES,
)

PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "envelope-dashboard.json"
SPECS = {m.name: m for m in METRICS}
HISTOGRAMS = {m.name for m in METRICS if m.kind is Histogram}
# Fixed label value sets, so a typo in a selector ({verdict="alow"}) fails too.
LABEL_VALUES: dict[str, set[str]] = {
    "verdict": {v.value for v in Verdict},
    "code": {c.value for c in Code},
    "stage": set(STAGES),
    "outcome": set(UPSTREAM_OUTCOMES),
    "result": set(RELOAD_RESULTS),
    "layer": set(MISCONFIG_LAYERS),
    "reason": set(REJECT_REASONS),
}


def _rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(PROM / "alerts.rules.yml")["groups"] for r in g["rules"]]


def _dashboard_exprs() -> Iterator[str]:
    dash = json.loads(DASHBOARD.read_text())

    def walk(panels: list[dict[str, Any]]) -> Iterator[str]:
        for p in panels:
            for t in p.get("targets", []):
                yield t["expr"]
            yield from walk(p.get("panels", []))

    yield from walk(dash["panels"])
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            yield q["query"]


def _check_expr(expr: str, where: str) -> set[str]:
    refs = metric_refs(expr, HISTOGRAMS)
    assert refs or "envelope_" not in expr, where
    names = set()
    for name, matchers in refs:
        assert name in SPECS, f"{where}: {name} is not exported (proxy.observability.metrics.METRICS)"
        names.add(name)
        known = set(SPECS[name].labels) | TARGET_LABELS | ({"le"} if name in HISTOGRAMS else set())
        for label, op, value in matchers:
            assert label in known, f"{where}: {name} has no label {label!r}"
            if label in SPECS[name].labels and label in LABEL_VALUES and op in ("=", "!="):
                assert value in LABEL_VALUES[label], f"{where}: {label}={value!r} never exported"
    metric_labels = {lbl for n in names for lbl in SPECS[n].labels}
    extra = grouping_labels(expr) - metric_labels - TARGET_LABELS - {"le"}
    assert not extra, f"{where}: grouping by labels no metric here has: {sorted(extra)}"
    return names


def test_promtool_check_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("ENVELOPE_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required (ENVELOPE_REQUIRE_PROMTOOL=1) but not on PATH")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "rules", str(PROM / "alerts.rules.yml")],
                          capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheusrule_groups_equal_plain_file() -> None:
    cr = load_yaml(PROM / "rules.yaml")
    assert cr["apiVersion"] == "monitoring.coreos.com/v1" and cr["kind"] == "PrometheusRule"
    assert cr["spec"]["groups"] == load_yaml(PROM / "alerts.rules.yml")["groups"]


def test_alerts_are_complete() -> None:
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert {"summary", "description", "runbook"} <= set(r["annotations"]), r["alert"]
    used: set[str] = set()
    for r in rules:
        used |= _check_expr(r["expr"], r["alert"])
        for text in r["annotations"].values():
            _check_expr(text, f"{r['alert']} annotations")
    assert {
        "envelope_decisions_total", "envelope_approvals_pending", "envelope_policy_reloads_total",
        "envelope_audit_write_failures_total", "envelope_upstream_requests_total",
        "envelope_upstream_up", "envelope_misconfigured_tools",
    } <= used


def test_runbooks_documented() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for r in _rules():
        assert r["alert"] in readme, f"{r['alert']} has no runbook section in deploy/README.md"


def test_dashboard_metrics_exist() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    used: set[str] = set()
    for i, expr in enumerate(_dashboard_exprs()):
        used |= _check_expr(expr, f"dashboard expr #{i}")
    required = {
        "envelope_decisions_total", "envelope_call_duration_seconds",
        "envelope_upstream_duration_seconds", "envelope_upstream_requests_total",
        "envelope_upstream_up", "envelope_approvals_pending", "envelope_policy_revision_info",
        "envelope_policy_reloads_total", "envelope_audit_records_total",
        "envelope_audit_write_failures_total", "envelope_misconfigured_tools",
        "envelope_rejected_requests_total",
    }
    assert required <= used, f"dashboard lacks {sorted(required - used)}"


def test_metric_check_catches_mistakes() -> None:
    with pytest.raises(AssertionError):
        _check_expr("rate(envelope_decision_total[5m])", "typo")
    with pytest.raises(AssertionError):
        _check_expr('envelope_upstream_up{upstrem="x"}', "bad label")
    with pytest.raises(AssertionError):
        _check_expr('envelope_policy_reloads_total{result="failed"}', "bad value")
    with pytest.raises(AssertionError):
        _check_expr("sum by (tool) (envelope_upstream_up)", "bad grouping")
    assert _check_expr("envelope_call_duration_seconds_bucket", "ok") == {"envelope_call_duration_seconds"}
