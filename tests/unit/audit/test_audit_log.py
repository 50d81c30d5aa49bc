"""AuditLog + verify: the chain holds across restarts and rotations, tampering is named."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.audit import log as log_module
from proxy.audit.log import GENESIS, AuditLog, record_hash
from proxy.audit.verify import verify
from proxy.errors import AuditError


def _write(directory: Path, n: int, **kw: object) -> AuditLog:
    log = AuditLog(directory, **kw)  # type: ignore[arg-type]
    for i in range(n):
        log.write({"i": i, "tool": "github.search_issues", "nested": {"b": 1, "a": [i]}})
    return log


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _rewrite(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def test_write_adds_prev_and_hash_and_verifies(tmp_path: Path) -> None:
    log = _write(tmp_path, 5)
    assert log.records_written == 5 and log.healthy and log.check_writable()
    recs = [orjson.loads(x) for x in _lines(log.path)]
    assert recs[0]["prev"] == GENESIS
    for a, b in itertools.pairwise(recs):
        assert b["prev"] == a["hash"]
    assert all(record_hash(r) == r["hash"] for r in recs)
    assert log.last_hash == recs[-1]["hash"]
    log.close()
    for target in (tmp_path, log.path):
        res = verify(target)
        assert res.ok and res.records == 5 and res.problem is None, res


def test_write_returns_hash_and_does_not_mutate_the_record(tmp_path: Path) -> None:
    with AuditLog(tmp_path) as log:
        rec = {"a": 1, "hash": "forged", "prev": "forged"}
        h = log.write(rec)
        assert rec == {"a": 1, "hash": "forged", "prev": "forged"}
        stored = orjson.loads(log.path.read_bytes())
        assert stored["hash"] == h and stored["prev"] == GENESIS


def test_unserializable_values_are_escaped_not_lost(tmp_path: Path) -> None:
    """A header value decoded with surrogate escapes (an undecodable byte) or any non-JSON value
    cannot make a decision go unrecorded: it is escaped, the record says so, the chain verifies."""
    with AuditLog(tmp_path) as log:
        log.write({"session": "sess-\udcff", "x": object(), "ok": "plain"})
        assert log.healthy
    rec = orjson.loads(log.path.read_bytes())
    assert rec["session"] == "sess-\\udcff" and rec["ok"] == "plain" and rec["sanitized"] is True
    assert rec["x"].startswith("<object object")
    assert verify(tmp_path).ok


@pytest.mark.parametrize("k", [1, 4, 8])
def test_edited_record_is_named(tmp_path: Path, k: int) -> None:
    _write(tmp_path, 8).close()
    path = tmp_path / "audit.jsonl"
    lines = _lines(path)
    rec = orjson.loads(lines[k - 1])
    rec["tool"] = "github.delete_repo"
    lines[k - 1] = orjson.dumps(rec) + b"\n"
    _rewrite(path, lines)
    for target in (tmp_path, path):
        res = verify(target)
        assert not res.ok and res.line == k and res.file == str(path)
        assert res.problem == f"line {k}: hash does not match the record's content (record edited)"
        assert res.records == k - 1


@pytest.mark.parametrize("k", [2, 5, 7])
def test_deleted_record_is_named(tmp_path: Path, k: int) -> None:
    _write(tmp_path, 8).close()
    path = tmp_path / "audit.jsonl"
    lines = _lines(path)
    del lines[k - 1]
    _rewrite(path, lines)
    res = verify(path)
    assert not res.ok and res.line == k
    assert res.problem == (
        f"line {k}: prev does not match the hash of line {k - 1} "
        "(a record was deleted, inserted or reordered)"
    )


def test_deleting_the_first_record(tmp_path: Path) -> None:
    _write(tmp_path, 4).close()
    path = tmp_path / "audit.jsonl"
    _rewrite(path, _lines(path)[1:])
    # A lone file may be a rotated continuation: accepted. The directory must start at genesis.
    assert verify(path).ok
    res = verify(tmp_path)
    assert not res.ok and res.line == 1
    assert res.problem == "line 1: chain does not start at genesis (records before it were removed)"


def test_swapped_records_are_detected_at_the_first_moved_line(tmp_path: Path) -> None:
    _write(tmp_path, 6).close()
    path = tmp_path / "audit.jsonl"
    lines = _lines(path)
    lines[2], lines[3] = lines[3], lines[2]
    _rewrite(path, lines)
    res = verify(path)
    assert not res.ok and res.line == 3
    assert "prev does not match the hash of line 2" in (res.problem or "")


def test_inserted_record_with_recomputed_hash_breaks_the_chain(tmp_path: Path) -> None:
    _write(tmp_path, 4).close()
    path = tmp_path / "audit.jsonl"
    lines = _lines(path)
    forged = {"i": 99, "prev": orjson.loads(lines[1])["hash"]}
    forged["hash"] = record_hash(forged)
    lines.insert(2, orjson.dumps(forged) + b"\n")
    _rewrite(path, lines)
    res = verify(path)
    assert not res.ok and res.line == 4  # line 3 (forged) is self-consistent; line 4's prev breaks


@pytest.mark.parametrize(
    ("garbage", "problem"),
    [
        (b'{"i": 3, "prev": "sha', "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "not an audit record (no hash or prev)"),
    ],
)
def test_garbage_line_is_named(tmp_path: Path, garbage: bytes, problem: str) -> None:
    _write(tmp_path, 5).close()
    path = tmp_path / "audit.jsonl"
    lines = _lines(path)
    lines[2] = garbage + b"\n"
    _rewrite(path, lines)
    res = verify(path)
    assert not res.ok and res.line == 3 and res.problem == f"line 3: {problem}"


def test_reopen_continues_the_chain(tmp_path: Path) -> None:
    _write(tmp_path, 3).close()
    log = _write(tmp_path, 3)
    assert log.records_written == 3
    log.close()
    res = verify(tmp_path)
    assert res.ok and res.records == 6


def test_reopen_reads_only_the_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, 2000).close()
    size = (tmp_path / "audit.jsonl").stat().st_size
    assert size > 4 * log_module._TAIL_CHUNK
    reads: list[int] = []
    real = log_module._lines_reversed

    def spy(fh: Any, size: int) -> Any:
        orig_read = fh.read

        def read(n: int = -1) -> bytes:
            reads.append(n)
            return orig_read(n)

        fh.read = read
        return real(fh, size)

    monkeypatch.setattr(log_module, "_lines_reversed", spy)
    _write(tmp_path, 1).close()
    assert sum(reads) <= log_module._TAIL_CHUNK
    assert verify(tmp_path).ok


@pytest.mark.parametrize("data", [b"", b"\n", b"a", b"abc\n", b"\n\nab\ncdefghijklmnop\nq",
                                  b"x" * 40 + b"\n" + b"y" * 3 + b"\n\n" + b"z" * 17])
def test_lines_read_backwards_are_the_files_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes
) -> None:
    # Chunks of 4 bytes: lines longer than a chunk, newlines at a chunk's edges, empty lines.
    monkeypatch.setattr(log_module, "_TAIL_CHUNK", 4)
    path = tmp_path / "f"
    path.write_bytes(data)
    with open(path, "rb") as fh:
        assert list(log_module._lines_reversed(fh, len(data))) == data.split(b"\n")[::-1]


def test_second_writer_is_refused(tmp_path: Path) -> None:
    with AuditLog(tmp_path):
        with pytest.raises(AuditError, match="another process"):
            AuditLog(tmp_path)
        AuditLog(tmp_path, name="audit-w2").close()  # another worker's log is fine


def test_damaged_tail_is_moved_aside_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path, 4).close()
    path = tmp_path / "audit.jsonl"
    last_good = orjson.loads(_lines(path)[2])["hash"]
    lines = _lines(path)
    lines[3] = lines[3][:20]  # crash mid-write: partial last line, no newline
    _rewrite(path, lines)

    log = _write(tmp_path, 2)
    log.close()
    assert "damaged" in caplog.text
    rotated = sorted(tmp_path.glob("audit-*.jsonl"))
    assert len(rotated) == 1
    # The damaged file is kept as-is; the new file continues from the last intact record.
    assert rotated[0].read_bytes().endswith(lines[3])
    assert orjson.loads(_lines(path)[0])["prev"] == last_good
    # The directory verifies past the torn line (named, not a problem): every record written
    # after the restart is checked too, not hidden behind the crash's artefact.
    res = verify(tmp_path)
    assert res.ok and res.records == 5, res
    assert res.torn == [f"{rotated[0]}:4"]
    assert verify(path).ok  # the new file on its own is intact
    # Records cut from before the torn line are still a break in the chain: the next file's
    # first prev names the record the restart continued from.
    _rewrite(rotated[0], [*lines[:2], lines[3]])
    res = verify(tmp_path)
    assert not res.ok and res.file == str(path) and res.line == 1
    assert "prev does not match the hash of the last record of" in (res.problem or "")


def test_a_last_line_that_ends_with_its_newline_is_never_taken_for_a_torn_one(tmp_path: Path) -> None:
    _write(tmp_path, 3).close()
    path = tmp_path / "audit.jsonl"
    path.write_bytes(path.read_bytes() + b'{"ts": "2026\n')
    res = verify(tmp_path)
    assert not res.ok and res.line == 4 and res.problem == "line 4: not valid JSON" and res.torn == []


def test_a_file_with_no_intact_record_continues_the_chain_of_the_rotated_ones(tmp_path: Path) -> None:
    # A crash part-way through the first record after a rotation: the new file continues from
    # the rotated file's last record, not from genesis; the directory's chain is whole, with the
    # torn file named (and still whole without it).
    _write(tmp_path, 3).close()
    path = tmp_path / "audit.jsonl"
    previous = tmp_path / "audit-20260101T000000000000.jsonl"
    path.rename(previous)
    last = orjson.loads(_lines(previous)[-1])["hash"]
    path.write_bytes(b'{"ts": "2026-01-0')
    _write(tmp_path, 2).close()
    assert orjson.loads(_lines(path)[0])["prev"] == last
    [damaged] = [f for f in tmp_path.glob("audit-*.jsonl") if f != previous]
    result = verify(tmp_path)
    assert result.ok and result.records == 5 and result.torn == [f"{damaged}:1"], result
    damaged.unlink()
    result = verify(tmp_path)
    assert result.ok and result.records == 5, result


def test_missing_final_newline_on_valid_record_is_repaired(tmp_path: Path) -> None:
    _write(tmp_path, 2).close()
    path = tmp_path / "audit.jsonl"
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    _write(tmp_path, 1).close()
    assert verify(tmp_path).ok and verify(tmp_path).records == 3
    assert not list(tmp_path.glob("audit-*.jsonl"))


def test_rotation_continues_the_chain(tmp_path: Path) -> None:
    log = _write(tmp_path, 40, max_bytes=2000)
    log.close()
    rotated = sorted(tmp_path.glob("audit-*.jsonl"))
    assert len(rotated) >= 2
    for p in [*rotated, log.path]:
        assert p.stat().st_size <= 2000
    res = verify(tmp_path)
    assert res.ok and res.records == 40
    assert res.files == [str(p) for p in rotated] + [str(log.path)]
    first_of_current = orjson.loads(_lines(log.path)[0])
    assert first_of_current["prev"] == orjson.loads(_lines(rotated[-1])[-1])["hash"]


def test_deleting_a_rotated_file_is_detected(tmp_path: Path) -> None:
    _write(tmp_path, 40, max_bytes=2000).close()
    rotated = sorted(tmp_path.glob("audit-*.jsonl"))
    rotated[1].unlink()
    res = verify(tmp_path)
    assert not res.ok and res.file == str(
        rotated[2] if len(rotated) > 2 else tmp_path / "audit.jsonl"
    )
    assert res.line == 1
    assert f"the last record of {rotated[0].name}" in (res.problem or "")


def test_deleting_the_oldest_rotated_file_is_detected(tmp_path: Path) -> None:
    _write(tmp_path, 40, max_bytes=2000).close()
    sorted(tmp_path.glob("audit-*.jsonl"))[0].unlink()
    res = verify(tmp_path)
    assert not res.ok and res.line == 1 and "genesis" in (res.problem or "")


def test_restart_right_after_rotation_continues_from_rotated_file(tmp_path: Path) -> None:
    _write(tmp_path, 40, max_bytes=2000).close()
    path = tmp_path / "audit.jsonl"
    # Simulate a crash after the rename, before the first record of the new file.
    last = sorted(tmp_path.glob("audit-*.jsonl"))[-1]
    path.rename(last.with_name("audit-99991231T235959999999.jsonl"))
    path.touch()
    _write(tmp_path, 2).close()
    res = verify(tmp_path)
    assert res.ok and res.records == 42


def test_verify_separate_chains_per_name(tmp_path: Path) -> None:
    _write(tmp_path, 3).close()
    AuditLog(tmp_path, name="audit-w2").close()
    _write(tmp_path, 3, name="audit-w2").close()
    res = verify(tmp_path)
    assert res.ok and res.records == 6 and len(res.files) == 2


def test_verify_missing_and_empty(tmp_path: Path) -> None:
    assert not verify(tmp_path / "nope.jsonl").ok
    res = verify(tmp_path)
    assert not res.ok and "no audit log files" in (res.problem or "")
    AuditLog(tmp_path).close()
    assert verify(tmp_path).ok and verify(tmp_path).records == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_write_failure_flips_healthy_and_recovers(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.symlink_to("/dev/full")
    log = AuditLog(tmp_path)
    assert log.healthy
    with pytest.raises(AuditError) as exc:
        log.write({"i": 0})
    assert isinstance(exc.value.__cause__, OSError)
    assert log.last_error and "No space left" in log.last_error
    assert not log.healthy and not log.check_writable()
    # The readiness probe refuses a device that swallows nothing (it cannot reserve space).
    assert log.last_error and "not a regular file" in log.last_error
    with pytest.raises(AuditError):
        log.write({"i": 1})
    # Space is back (the file is a real file again): the next write succeeds.
    path.unlink()
    log.write({"i": 2})
    assert log.healthy and log.last_error is None and log.check_writable()
    log.close()
    res = verify(tmp_path)
    assert res.ok and res.records == 1


def test_startup_probe_finds_an_unwritable_log_before_any_record(tmp_path: Path) -> None:
    (tmp_path / "audit.jsonl").symlink_to("/dev/full")
    log = AuditLog(tmp_path)
    assert log.healthy  # nothing has failed yet...
    assert not log.check_writable(force=True)  # ...but the forced probe knows
    assert not log.healthy



def test_partial_write_is_cut_off_on_recovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _write(tmp_path, 2)
    real_write = os.write
    calls = {"n": 0}

    def flaky(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data[:10]))  # partial line lands on disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log_module.os, "write", flaky)
    with pytest.raises(AuditError):
        log.write({"i": "lost"})
    assert not log.healthy
    monkeypatch.setattr(log_module.os, "write", real_write)
    assert log.check_writable()  # probe reopens and cuts the partial line off
    log.write({"i": 3})
    assert log.healthy and log.records_written == 3
    log.close()
    res = verify(tmp_path)
    assert res.ok and res.records == 3, res


def test_failing_handle_recovers_by_reopening(tmp_path: Path) -> None:
    log = _write(tmp_path, 1)

    class Broken:
        def fileno(self) -> int:
            raise ValueError("I/O operation on closed file")

        def close(self) -> None:
            pass

    real_fh = log._fh
    log._fd = -1  # writes now fail with EBADF, as on a handle gone bad
    log._fh = Broken()  # type: ignore[assignment]
    with pytest.raises(AuditError):
        log.write({"i": 1})
    assert not log.healthy
    log.write({"i": 2})
    assert log.healthy
    log.close()
    assert real_fh is not None
    real_fh.close()
    assert verify(tmp_path).records == 2


def test_closed_log_refuses_writes(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    log.close()
    log.close()
    assert not log.check_writable()
    with pytest.raises(AuditError, match="closed"):
        log.write({"a": 1})


def test_fsync_mode_writes(tmp_path: Path) -> None:
    _write(tmp_path, 3, fsync=True).close()
    assert verify(tmp_path).records == 3


def test_fsync_mode_rotates(tmp_path: Path) -> None:
    _write(tmp_path, 20, fsync=True, max_bytes=1000).close()
    res = verify(tmp_path)
    assert res.ok and res.records == 20 and len(res.files) > 1


@pytest.mark.parametrize("how", ["deleted", "renamed"])
def test_a_file_removed_under_the_writer_gets_the_next_record_in_a_new_file(tmp_path: Path, how: str) -> None:
    """A log file deleted (or renamed away, as logrotate without copytruncate does) under the
    running writer would take every later record out of sight: the next record goes to a new
    `audit.jsonl`, continuing the chain, so verify names the records that were removed."""
    log = _write(tmp_path, 3)
    if how == "deleted":
        log.path.unlink()
    else:
        log.path.rename(tmp_path / "audit.jsonl.1")
    last = log.last_hash
    log.write({"i": 3, "tool": "after"})
    log.write({"i": 4, "tool": "after"})
    recs = [orjson.loads(x) for x in _lines(log.path)]
    assert [r["i"] for r in recs] == [3, 4]
    assert recs[0]["prev"] == last  # the chain goes on from the removed file's last record
    log.close()
    res = verify(tmp_path)
    assert not res.ok and res.line == 1 and "were removed" in (res.problem or ""), res
    if how == "renamed":
        assert len(_lines(tmp_path / "audit.jsonl.1")) == 3  # nothing more went to the renamed file
