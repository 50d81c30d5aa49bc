"""build_record: versioned, masked, stable digest; written and verified end to end."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson

from proxy.audit.log import AuditLog
from proxy.audit.record import args_digest, build_record, utc_timestamp
from proxy.audit.verify import verify
from proxy.envelope.types import Code, Verdict


def _record(**over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        decision_id="d-1",
        revision="rev-a",
        principal="research-agent",
        session=None,
        run="run-1",
        upstream="github",
        tool="search_issues",
        verdict=Verdict.DENY,
        code=Code.CAPABILITY_BLOCKED,
        check="arg_rules",
        rule="no-secret-repos",
        reason="no issues in secret repositories",
        arguments={"repo": "corp/secret-x", "q": {"b": 2, "a": 1}},
        log_args=False,
        latency={"envelope": 0.0000421234, "total": 0.0012345678},
        upstream_status=None,
    )
    kw.update(over)
    return build_record(**kw)


def test_digest_is_stable_under_key_order() -> None:
    a = {"repo": "x", "q": {"b": 2, "a": [1, {"y": 1, "x": 2}]}}
    b = {"q": {"a": [1, {"x": 2, "y": 1}], "b": 2}, "repo": "x"}
    assert args_digest(a) == args_digest(b)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", args_digest(a))
    assert args_digest(a) != args_digest({**a, "repo": "y"})


def test_args_only_with_log_args() -> None:
    masked = _record()
    assert "args" not in masked
    assert masked["args_digest"] == args_digest({"q": {"a": 1, "b": 2}, "repo": "corp/secret-x"})
    full = orjson.loads(orjson.dumps(_record(log_args=True)))  # as written to the log
    assert full["args"] == {"repo": "corp/secret-x", "q": {"b": 2, "a": 1}}


def test_record_fields() -> None:
    rec = _record(extra={"dataflow": "flagged"}, upstream_status=502)
    assert rec["v"] == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", rec["ts"])
    assert rec["verdict"] == "deny" and type(rec["verdict"]) is str
    assert rec["code"] == "capability_blocked" and type(rec["code"]) is str
    assert rec["latency_ms"] == {"envelope": 0.042, "total": 1.235}
    assert rec["upstream_status"] == 502 and rec["session"] is None
    assert rec["extra"] == {"dataflow": "flagged"}
    keys = "decision_id revision principal run upstream tool check rule reason".split()
    assert all(k in rec for k in keys)
    assert "extra" not in _record()
    assert _record(verdict="allow", code="ok")["verdict"] == "allow"


def test_utc_timestamp_format() -> None:
    assert utc_timestamp(1_700_000_000_123_456_789) == "2023-11-14T22:13:20.123456Z"
    assert utc_timestamp(1_700_000_001_000_000_000) == "2023-11-14T22:13:21.000000Z"


def test_record_round_trips_through_the_log(tmp_path: Path) -> None:
    rec = _record(log_args=True)
    with AuditLog(tmp_path) as log:
        log.write(rec)
    stored = orjson.loads((tmp_path / "audit.jsonl").read_bytes())
    assert {k: v for k, v in stored.items() if k not in ("prev", "hash")} == orjson.loads(orjson.dumps(rec))
    assert stored["args"] == {"repo": "corp/secret-x", "q": {"b": 2, "a": 1}}
    assert verify(tmp_path).ok
