"""query_records / parse_time / Follower over real (rotated) audit logs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from proxy.audit import query as q
from proxy.audit.log import AuditLog, rotated_files
from proxy.audit.query import Follower, parse_time, query_records

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _rec(i: int, **kw: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "v": 1,
        "ts": q.ts_key(T0 + timedelta(minutes=i)),
        "decision_id": f"d{i:04d}",
        "principal": "alice" if i % 2 == 0 else "bob",
        "run": f"run-{i % 3}",
        "upstream": "github" if i % 4 < 2 else "notes",
        "tool": "echo" if i % 5 else "write_note",
        "verdict": "deny" if i % 7 == 0 else "allow",
        "code": "capability_blocked" if i % 7 == 0 else "ok",
        "rule": None,
        "reason": f"reason {i}",
    }
    rec.update(kw)
    return rec


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    """40 records a minute apart, rotated by size into many files."""
    with AuditLog(tmp_path, max_bytes=1500) as log:
        for i in range(40):
            log.write(_rec(i))
    assert len(rotated_files(tmp_path, "audit")) >= 5
    return tmp_path


def _ids(recs: list[dict[str, Any]]) -> list[int]:
    return [int(r["decision_id"][1:]) for r in recs]


def test_all_records_newest_first_across_rotated_files(logdir: Path) -> None:
    recs = query_records(logdir, limit=0)
    assert _ids(recs) == list(range(39, -1, -1))
    assert all(r["v"] == 1 and "hash" in r and "prev" in r for r in recs)
    assert _ids(query_records(logdir, limit=0, newest_first=False)) == list(range(40))


def test_limit_newest_first_and_oldest_first(logdir: Path) -> None:
    assert _ids(query_records(logdir, limit=5)) == [39, 38, 37, 36, 35]
    assert _ids(query_records(logdir, limit=3, newest_first=False)) == [0, 1, 2]
    assert len(query_records(logdir)) == 40  # default limit 100


def test_limit_stops_reading_old_files(logdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Path] = []
    real = q._file_lines

    def spy(path: Path) -> list[bytes]:
        opened.append(path)
        return real(path)

    monkeypatch.setattr(q, "_file_lines", spy)
    query_records(logdir, limit=2)
    assert opened == [logdir / "audit.jsonl"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("principal", "bob"),
        ("run", "run-1"),
        ("upstream", "notes"),
        ("tool", "write_note"),
        ("verdict", "deny"),
        ("code", "capability_blocked"),
        ("decision_id", "d0017"),
    ],
)
def test_each_filter(logdir: Path, field: str, value: str) -> None:
    expected = [i for i in range(39, -1, -1) if _rec(i)[field] == value]
    assert expected
    got = query_records(logdir, limit=0, **{field: value})
    assert _ids(got) == expected
    assert all(r[field] == value for r in got)


def test_filters_combine(logdir: Path) -> None:
    got = query_records(logdir, principal="alice", upstream="github", limit=0)
    assert _ids(got) == [i for i in range(39, -1, -1) if i % 2 == 0 and i % 4 < 2]
    assert query_records(logdir, principal="nobody") == []


def test_time_range(logdir: Path) -> None:
    since, until = T0 + timedelta(minutes=10), T0 + timedelta(minutes=15)
    assert _ids(query_records(logdir, since=since, until=until)) == [14, 13, 12, 11, 10]
    assert _ids(query_records(logdir, since=since, until=until, newest_first=False)) == [10, 11, 12, 13, 14]
    assert _ids(query_records(logdir, since=T0 + timedelta(minutes=37))) == [39, 38, 37]
    # naive datetimes are UTC
    assert _ids(query_records(logdir, until=datetime(2026, 1, 1, 0, 2))) == [1, 0]


def test_since_skips_files_rotated_before_it(logdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Path] = []
    real = q._file_lines
    monkeypatch.setattr(q, "_file_lines", lambda p: opened.append(p) or real(p))
    # Every rotated file was renamed "now", long after 2026-01-01: none can be skipped...
    assert len(query_records(logdir, since=T0, limit=0)) == 40
    # ...but a since after their rotation time skips them all unread.
    opened.clear()
    assert query_records(logdir, since=datetime.now(UTC) + timedelta(days=1)) == []
    assert opened == [logdir / "audit.jsonl"]


def test_several_logs_are_merged_by_time(tmp_path: Path) -> None:
    with AuditLog(tmp_path, name="audit-w0") as w0, AuditLog(tmp_path, name="audit-w1") as w1:
        for i in range(10):
            (w0 if i % 3 else w1).write(_rec(i))
    assert _ids(query_records(tmp_path, limit=4)) == [9, 8, 7, 6]
    assert _ids(query_records(tmp_path, newest_first=False, limit=0)) == list(range(10))


def test_damaged_lines_and_missing_directory(tmp_path: Path) -> None:
    assert query_records(tmp_path / "nope") == []
    with AuditLog(tmp_path) as log:
        log.write(_rec(1))
    with open(tmp_path / "audit.jsonl", "ab") as fh:
        fh.write(b"not json\n[1]\n")
    assert _ids(query_records(tmp_path)) == [1]


def test_parse_time_relative_and_rfc3339() -> None:
    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert parse_time("1h", now) == now - timedelta(hours=1)
    assert parse_time("90s", now) == now - timedelta(seconds=90)
    assert parse_time("15m", now) == now - timedelta(minutes=15)
    assert parse_time("2d", now) == now - timedelta(days=2)
    assert parse_time("1w", now) == now - timedelta(weeks=1)
    assert parse_time("2026-01-02T03:04:05Z") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_time("2026-01-02T05:04:05+02:00") == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_time("2026-01-02") == datetime(2026, 1, 2, tzinfo=UTC)
    before = datetime.now(UTC)
    assert before - timedelta(hours=1, seconds=5) < parse_time("1h") <= datetime.now(UTC) - timedelta(hours=1)
    for bad in ("yesterday", "1y", "", "-1h"):
        with pytest.raises(ValueError):
            parse_time(bad)
    # Out of datetime's range: a ValueError naming it (callers answer 400 / exit 2), never an
    # OverflowError (the admin API's 500, the CLI's traceback).
    for far in ("99999999999999999999d", "800000d", "9999-12-31T23:00:00-23:59",
                "0001-01-01T00:00:00+01:00"):
        with pytest.raises(ValueError, match="outside years 1 to 9999"):
            parse_time(far, now)


def test_follower_sees_new_records_across_rotation(tmp_path: Path) -> None:
    with AuditLog(tmp_path, max_bytes=700) as log:
        log.write(_rec(0))
        with Follower(tmp_path) as f:
            assert f.poll() == []
            log.write(_rec(1))
            assert _ids(f.poll()) == [1]
            for i in range(2, 12):  # rotates several times between polls... one at a time
                log.write(_rec(i))
                assert _ids(f.poll()) == [i]
            assert len(rotated_files(tmp_path, "audit")) >= 3
            # several rotations between two polls
            n = len(rotated_files(tmp_path, "audit"))
            for i in range(12, 20):
                log.write(_rec(i))
            assert len(rotated_files(tmp_path, "audit")) >= n + 3
            assert _ids(f.poll()) == list(range(12, 20))


def test_follower_picks_up_a_log_created_later(tmp_path: Path) -> None:
    with Follower(tmp_path) as f:
        assert f.poll() == []
        with AuditLog(tmp_path) as log:
            log.write(_rec(3))
        assert _ids(f.poll()) == [3]


def test_table_row_shows_no_escape_sequence_or_hidden_character() -> None:
    row = q.table_row(_rec(1, reason="'\x1b]0;ok\x07\u202e' is not valid", principal="p\x1b[2J"), width=200)
    assert "\x1b" not in row and "\x07" not in row and "\u202e" not in row
    assert "p\\u001b[2J" in row and "'\\u001b]0;ok\\u0007\\u202e' is not valid" in row


def test_table_row_truncates() -> None:
    row = q.table_row(_rec(1, reason="x" * 500, principal="p" * 40), width=120)
    cells = row.split()
    assert "ppppppppppppppp…" in cells and cells[-1] == "x" * 19 + "…"
    assert q.table_header().split()[:4] == ["TIME", "DECISION", "PRINCIPAL", "UPSTREAM.TOOL"]
    assert q.json_line({"b": 1, "a": 2}) == '{"a":2,"b":1}'
