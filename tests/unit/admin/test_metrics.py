"""Metrics: declared once, private registry per instance, exact names and labels."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.envelope.types import Code, Verdict
from proxy.observability.metrics import METRICS, REJECT_REASONS, STAGES, Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = m.render()
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def _exercise(m: Metrics) -> None:
    m.decision("github", "search_issues", Verdict.ALLOW, Code.OK)
    m.decision("github", "search_issues", Verdict.ALLOW, Code.OK)
    m.decision("github", "<unknown>", "deny", "unknown_tool")
    for stage in STAGES:
        m.observe_stage(stage, 0.00002)
    m.observe_upstream("github", 0.012, "ok")
    m.observe_upstream("github", 30.0, "timeout")
    m.reload("success", when=1234.5)
    m.reload("failure")
    m.set_revision("rev-a")
    m.set_misconfigured({"registry": 2, "envelope": 1})
    m.audit_record()
    m.audit_write_failure()
    m.check_error("authz")
    m.rejected("too_large")
    m.set_catalogue({"github": 12, "jira": 3})


def test_instances_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.decision("u", "t", "allow", "ok")
    dec = _key("envelope_decisions_total", code="ok", tool="t", upstream="u", verdict="allow")
    assert dec in _samples(a)
    assert not any(k[0] == "envelope_decisions_total" for k in _samples(b))


def test_exposition_has_every_declared_metric_with_its_labels() -> None:
    m = Metrics()
    _exercise(m)
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    for spec in METRICS:
        assert f"# HELP {spec.name} " in text, spec.name
    s = _samples(m)
    dec = "envelope_decisions_total"
    assert s[_key(dec, code="ok", tool="search_issues", upstream="github", verdict="allow")] == 2
    assert (
        s[_key(dec, code="unknown_tool", tool="<unknown>", upstream="github", verdict="deny")] == 1
    )
    for stage in STAGES:
        assert s[("envelope_call_duration_seconds_count", (("stage", stage),))] == 1
        bucket = "envelope_call_duration_seconds_bucket"
        assert s[_key(bucket, le="1e-05", stage=stage)] == 0
        assert s[_key(bucket, le="2.5e-05", stage=stage)] == 1
        assert s[_key(bucket, le="30.0", stage=stage)] == 1
    assert s[("envelope_upstream_duration_seconds_count", (("upstream", "github"),))] == 2
    assert s[("envelope_upstream_requests_total", (("outcome", "ok"), ("upstream", "github")))] == 1
    assert s[_key("envelope_upstream_requests_total", outcome="timeout", upstream="github")] == 1
    assert s[("envelope_policy_reloads_total", (("result", "success"),))] == 1
    assert s[("envelope_policy_reloads_total", (("result", "failure"),))] == 1
    assert s[("envelope_policy_last_reload_timestamp_seconds", ())] == 1234.5
    assert s[("envelope_policy_revision_info", (("revision", "rev-a"),))] == 1
    assert s[("envelope_misconfigured_tools", (("layer", "registry"),))] == 2
    assert s[("envelope_misconfigured_tools", (("layer", "envelope"),))] == 1
    assert s[("envelope_audit_records_total", ())] == 1
    assert s[("envelope_audit_write_failures_total", ())] == 1
    assert s[("envelope_check_errors_total", (("check", "authz"),))] == 1
    assert s[("envelope_rejected_requests_total", (("reason", "too_large"),))] == 1
    for reason in REJECT_REASONS:  # fixed label sets exist from the start
        assert ("envelope_rejected_requests_total", (("reason", reason),)) in s
    assert s[("envelope_catalogue_tools", (("upstream", "jira"),))] == 3


def test_revision_info_switches_series() -> None:
    m = Metrics()
    m.set_revision("rev-a")
    m.set_revision("rev-a")
    m.set_revision("rev-b")
    revs = {k[1] for k in _samples(m) if k[0] == "envelope_policy_revision_info"}
    assert revs == {(("revision", "rev-b"),)}


def test_catalogue_drops_removed_upstreams() -> None:
    m = Metrics()
    m.set_catalogue({"github": 1, "jira": 2})
    m.set_catalogue({"github": 4})
    cat = {k[1]: v for k, v in _samples(m).items() if k[0] == "envelope_catalogue_tools"}
    assert cat == {(("upstream", "github"),): 4}


def test_unbounded_label_values_are_refused() -> None:
    m = Metrics()
    with pytest.raises(ValueError):
        m.observe_stage("parse", 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        m.rejected("whatever")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        m.observe_upstream("github", 0.1, "meh")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        m.reload("maybe")  # type: ignore[arg-type]


def test_misconfigured_per_layer() -> None:
    m = Metrics()
    gauge = "envelope_misconfigured_tools"
    s = _samples(m)  # both layers exist (at 0) from the start
    assert s[(gauge, (("layer", "registry"),))] == 0 and s[(gauge, (("layer", "envelope"),))] == 0
    m.set_misconfigured({"envelope": 3})
    m.set_misconfigured({"registry": 1})  # an absent layer goes back to 0
    s = _samples(m)
    assert s[(gauge, (("layer", "registry"),))] == 1 and s[(gauge, (("layer", "envelope"),))] == 0
    with pytest.raises(ValueError):
        m.set_misconfigured({"policy": 1})
