"""Window aggregates of an audit log (the review page's picture): buckets by verdict, top refused
tools and codes, filters, the window's edges and the scan bound."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from proxy.audit.query import iter_records, matcher, ts_key
from proxy.audit.stats import MAX_BUCKETS, bucket_seconds, window_stats

NOW = datetime(2026, 12, 1, 1, 30, 30, tzinfo=UTC)


def rec(minutes_ago: float, verdict: str = "allow", *, tool: str = "read", code: str = "ok",
        principal: str = "ops") -> dict[str, Any]:
    return {"ts": ts_key(NOW - timedelta(minutes=minutes_ago)), "verdict": verdict,
            "upstream": "demo", "tool": tool, "code": code, "principal": principal}


def newest_first(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: r["ts"], reverse=True)


def stats(records: list[dict[str, Any]], window: timedelta = timedelta(hours=1),
          **kw: Any) -> dict[str, Any]:
    filters = {k: v for k, v in kw.items() if k != "max_scan"}
    extra = {"max_scan": kw["max_scan"]} if "max_scan" in kw else {}
    return window_stats(newest_first(records), since=NOW - window, until=NOW,
                        match=matcher(**filters), **extra)


def test_counts_per_minute_by_verdict_and_top_refused() -> None:
    records = [rec(0.2), rec(0.3), rec(0.4, "deny", tool="delete", code="approval_denied"),
               rec(5, "deny", tool="write", code="arg_rule_violation"),
               rec(5.1, "deny", tool="write", code="arg_rule_violation"),
               rec(30, "error", tool="write", code="upstream_error"),
               rec(61)]  # before the window
    s = stats(records)
    assert s["bucket_seconds"] == 60
    assert s["totals"] == {"allow": 2, "deny": 3, "error": 1}
    assert s["count"] == 6 and s["scanned"] == 6 and s["truncated"] is False
    # The newest bucket holds the three records of the last half minute (NOW is hh:30:30).
    last = s["buckets"][-1]
    assert (last["start"], last["allow"], last["deny"]) == ("2026-12-01T01:30:00.000000Z", 2, 1)
    assert sum(b["deny"] for b in s["buckets"]) == 3
    assert all(b["start"] < s["until"] for b in s["buckets"])
    assert s["top_refused_tools"] == [{"tool": "demo.write", "count": 3},
                                      {"tool": "demo.delete", "count": 1}]
    assert s["top_refused_codes"] == [{"code": "arg_rule_violation", "count": 2},
                                      {"code": "approval_denied", "count": 1},
                                      {"code": "upstream_error", "count": 1}]


def test_admin_action_records_are_not_calls() -> None:
    admin = [{**rec(0.5 + i / 10, "deny", tool=method, code="unauthorized"), "method": method}
             for i, method in enumerate(["<approval>"] * 5 + ["<intent>", "<idempotency>"])]
    s = stats([rec(0.2, "deny", tool="write", code="arg_rule_violation"), *admin])
    assert s["totals"] == {"allow": 0, "deny": 1, "error": 0} and s["count"] == 1
    assert s["top_refused_tools"] == [{"tool": "demo.write", "count": 1}]
    assert s["top_refused_codes"] == [{"code": "arg_rule_violation", "count": 1}]


def test_filters_apply_to_the_picture_too() -> None:
    records = [rec(1, "deny", principal="ops"), rec(2, "deny", principal="bot"), rec(3)]
    s = stats(records, principal="bot")
    assert s["totals"] == {"allow": 0, "deny": 1, "error": 0}
    assert s["top_refused_tools"] == [{"tool": "demo.read", "count": 1}]
    assert stats(records, verdict="allow")["top_refused_codes"] == []


def test_window_edges_and_wide_windows() -> None:
    s = stats([rec(0), rec(14.9), rec(15.1)], window=timedelta(minutes=15))
    assert s["count"] == 1  # `until` is exclusive, `since` inclusive; 15.1 minutes is outside
    assert bucket_seconds(timedelta(hours=3)) == 60
    assert bucket_seconds(timedelta(hours=24)) == 480
    wide = stats([rec(600)], window=timedelta(hours=24))
    assert len(wide["buckets"]) <= MAX_BUCKETS + 1 and wide["count"] == 1


def test_scan_bound_says_truncated_and_from_when_complete() -> None:
    records = [rec((i + 1) / 10) for i in range(50)]
    s = stats(records, max_scan=20)
    assert s["truncated"] is True and s["scanned"] == 20 and s["count"] == 20
    assert s["complete_from"] > newest_first(records)[20]["ts"]
    assert s["complete_from"] <= newest_first(records)[19]["ts"]


def test_reads_a_real_log_newest_first(tmp_path: Path) -> None:
    lines = [rec(10, "deny", tool="write", code="x"), rec(5), {"not": "a record"}, rec(1)]
    (tmp_path / "audit.jsonl").write_text("\n".join(map(_dump, lines)) + "\nnot json\n")
    s = window_stats(iter_records(tmp_path, newest_first=True), since=NOW - timedelta(hours=1),
                     until=NOW, match=matcher())
    assert s["totals"] == {"allow": 2, "deny": 1, "error": 0}


def _dump(r: dict[str, Any]) -> str:
    import orjson

    return orjson.dumps(r).decode()
