"""AuditLog time rotation (`rotate_interval`) with a fake clock: the chain continues across files."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from proxy.audit.log import AuditLog, rotated_files
from proxy.audit.record import utc_timestamp
from proxy.audit.verify import verify
from proxy.config import AuditConfig
from proxy.errors import AuditError

DAY = 86400.0


class FakeClock:
    def __init__(self) -> None:
        # Aligned to the start of a real (recent) UTC day: record `ts` and clock agree.
        self.now = (time.time() // DAY) * DAY + 60

    def __call__(self) -> float:
        return self.now


def _rec(clock: FakeClock, i: int) -> dict[str, object]:
    return {"i": i, "ts": utc_timestamp(int(clock.now * 1e9))}


def _all_records(directory: Path) -> list[dict[str, object]]:
    files = [*rotated_files(directory, "audit"), directory / "audit.jsonl"]
    return [orjson.loads(x) for f in files for x in f.read_bytes().splitlines()]


def test_rotates_at_each_interval_and_the_chain_continues(tmp_path: Path) -> None:
    clock = FakeClock()
    with AuditLog(tmp_path, rotate_interval=DAY, clock=clock) as log:
        for day in range(3):
            for i in range(3):
                log.write(_rec(clock, day * 10 + i))
                clock.now += 3600  # three records within the day
            clock.now += DAY - 3 * 3600
    rotated = rotated_files(tmp_path, "audit")
    assert len(rotated) == 2
    assert [len(f.read_bytes().splitlines()) for f in rotated] == [3, 3]
    assert len((tmp_path / "audit.jsonl").read_bytes().splitlines()) == 3
    recs = _all_records(tmp_path)
    assert [r["i"] for r in recs] == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    first_of_second = orjson.loads(rotated[1].read_bytes().splitlines()[0])
    last_of_first = orjson.loads(rotated[0].read_bytes().splitlines()[-1])
    assert first_of_second["prev"] == last_of_first["hash"]
    res = verify(tmp_path)
    assert res.ok and res.records == 9 and len(res.files) == 3, res


def test_no_interval_means_no_time_rotation(tmp_path: Path) -> None:
    clock = FakeClock()
    with AuditLog(tmp_path, clock=clock) as log:
        for i in range(3):
            log.write(_rec(clock, i))
            clock.now += 10 * DAY
    assert rotated_files(tmp_path, "audit") == []


def test_interval_and_size_rotation_together(tmp_path: Path) -> None:
    clock = FakeClock()
    with AuditLog(tmp_path, rotate_interval=DAY, clock=clock, max_bytes=500) as log:
        for i in range(6):  # ~205 bytes each: size rotates every 2 records within the day
            log.write(_rec(clock, i))
        clock.now += DAY
        log.write(_rec(clock, 99))
    assert len(rotated_files(tmp_path, "audit")) == 3
    assert [r["i"] for r in _all_records(tmp_path)] == [0, 1, 2, 3, 4, 5, 99]
    assert verify(tmp_path).ok


def test_restart_keeps_the_file_of_the_same_interval_and_rotates_a_stale_one(tmp_path: Path) -> None:
    clock = FakeClock()
    with AuditLog(tmp_path, rotate_interval=DAY, clock=clock) as log:
        log.write(_rec(clock, 0))
    clock.now += 3600
    with AuditLog(tmp_path, rotate_interval=DAY, clock=clock) as log:
        log.write(_rec(clock, 1))  # same day: same file
    assert rotated_files(tmp_path, "audit") == []
    clock.now += DAY
    with AuditLog(tmp_path, rotate_interval=DAY, clock=clock) as log:
        log.write(_rec(clock, 2))  # the file was started yesterday: rotated first
    assert len(rotated_files(tmp_path, "audit")) == 1
    assert len((tmp_path / "audit.jsonl").read_bytes().splitlines()) == 1
    assert verify(tmp_path).ok


def test_deleting_a_middle_time_rotated_file_is_detected(tmp_path: Path) -> None:
    clock = FakeClock()
    with AuditLog(tmp_path, rotate_interval=DAY, clock=clock) as log:
        for i in range(4):
            log.write(_rec(clock, i))
            log.write(_rec(clock, i + 100))
            clock.now += DAY
    rotated = rotated_files(tmp_path, "audit")
    assert len(rotated) == 3 and verify(tmp_path).ok
    rotated[1].unlink()
    res = verify(tmp_path)
    assert not res.ok
    assert res.file == str(rotated[2]) and res.line == 1
    assert "file or records were deleted" in (res.problem or "")


def test_invalid_interval_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AuditError):
        AuditLog(tmp_path, rotate_interval=0)


def test_config_parses_rotate_interval() -> None:
    assert AuditConfig().rotate_interval is None
    assert AuditConfig.model_validate({"rotate_interval": "24h"}).rotate_interval == DAY
    assert AuditConfig.model_validate({"rotate_interval": 90}).rotate_interval == 90.0
    with pytest.raises(ValueError):
        AuditConfig.model_validate({"rotate_interval": "soon"})
    with pytest.raises(ValueError):
        AuditConfig.model_validate({"rotate_interval": 0})
