"""Anchors: the head an `AuditLog` publishes, the heads `audit verify --anchor/--anchors` reads,
and what `verify` says of an anchor that is (or is no longer) in the chain."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from proxy.audit.anchor import Anchor, HeadPublisher, parse_hash, parse_line, read_anchors
from proxy.audit.log import GENESIS, AuditLog
from proxy.audit.verify import verify
from proxy.cli import main
from proxy.errors import AuditError

HASH = "sha256:" + "ab" * 32


def _write(log: AuditLog, n: int) -> list[str]:
    return [log.write({"log": log.path.name, "i": i}) for i in range(n)]


def test_head_is_the_last_record_and_its_file(tmp_path: Path) -> None:
    with AuditLog(tmp_path) as log:
        empty = log.head()
        assert (empty["chain"], empty["records"], empty["hash"], empty["file"]) == (
            "audit", 0, GENESIS, None)
        hashes = _write(log, 3)
        head = log.head()
        assert (head["chain"], head["records"], head["hash"], head["file"]) == (
            "audit", 3, hashes[-1], "audit.jsonl")
        assert head["ts"].endswith("Z")
    with AuditLog(tmp_path, name="audit-w1") as log:
        assert log.head()["chain"] == "audit-w1"


def test_head_after_a_rotation_names_the_rotated_file(tmp_path: Path) -> None:
    with AuditLog(tmp_path) as log:
        last = _write(log, 2)[-1]
        rotated = log._rotate()  # as a restart right after a rotation finds the directory
    with AuditLog(tmp_path) as log:
        head = log.head()
        assert (head["hash"], head["file"], head["records"]) == (last, rotated.name, 0)


def test_head_is_refused_while_the_log_is_not_writable_or_closed(tmp_path: Path) -> None:
    log = AuditLog(tmp_path)
    _write(log, 1)
    log._fail(OSError("disk full"))
    with pytest.raises(AuditError, match="not writable \\(disk full\\): its head is unknown"):
        log.head()
    _write(log, 1)  # writable again: a head again
    assert log.head()["records"] == 2
    log.close()
    with pytest.raises(AuditError, match="is closed: its head is unknown"):
        log.head()


def test_publisher_logs_the_head_only_when_it_moved(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.audit.anchor")
    with AuditLog(tmp_path) as log:
        publisher = HeadPublisher(log)
        publisher.publish()  # an empty log: nothing to anchor
        hashes = _write(log, 2)
        publisher.publish()
        publisher.publish()
        log._fail(OSError("disk full"))
        _write(log, 1)
        log._fail(OSError("disk full"))
        publisher.publish()  # not writable: no head, never the old one again as current
    lines = [r.getMessage() for r in caplog.records if r.name == "proxy.audit.anchor"]
    assert len(lines) == 1 and lines[0].startswith("audit head {")
    assert parse_line(lines[0]).hash == hashes[-1]
    assert orjson.loads(lines[0][len("audit head "):])["records"] == 2


def test_parse_hash_takes_only_a_sha256_hash() -> None:
    assert parse_hash(f" {HASH} ") == HASH
    for bad in ("", "sha256:", HASH.upper(), HASH[:-1], HASH + "0", "md5:" + "ab" * 32, "ab" * 32):
        with pytest.raises(ValueError, match="not an audit hash"):
            parse_hash(bad)


def test_parse_line_reads_a_head_as_served_and_as_logged() -> None:
    head = {"chain": "audit-w1", "records": 7, "hash": HASH, "file": "audit-w1.jsonl",
            "ts": "2026-01-02T03:04:05.000006Z"}
    served = orjson.dumps(head).decode()
    expected = Anchor(HASH, "audit-w1", "2026-01-02T03:04:05.000006Z", "a:1")
    assert parse_line(served, "a:1") == expected
    logged = f"2026-01-02 03:04:05,000 INFO proxy.audit.anchor: audit head {served}"
    assert parse_line(logged, "a:1") == expected
    assert parse_line(orjson.dumps({"hash": HASH}).decode()) == Anchor(HASH)
    assert expected.describe() == f"{HASH} (chain audit-w1, 2026-01-02T03:04:05.000006Z, from a:1)"


@pytest.mark.parametrize(("line", "message"), [
    ("audit head", "no JSON object"),
    ("audit head {not json", "not JSON"),
    ('{"chain": "audit"}', 'no "hash"'),
    ('{"hash": 5}', 'no "hash"'),
    ('{"hash": "sha256:xyz"}', "not an audit hash"),
])
def test_parse_line_refuses_what_is_not_a_head(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_line(line)


def test_read_anchors_names_the_bad_line(tmp_path: Path) -> None:
    file = tmp_path / "anchors.jsonl"
    file.write_text(f'{{"hash": "{HASH}"}}\n\n{{"hash": "{GENESIS}"}}\n')
    assert [a.hash for a in read_anchors(file)] == [HASH, GENESIS]
    assert read_anchors(file)[1].source == f"{file}:3"
    file.write_text(f'{{"hash": "{HASH}"}}\nsomething else\n')
    with pytest.raises(ValueError, match=f"^{file}:2: no JSON object"):
        read_anchors(file)
    with pytest.raises(ValueError, match="cannot read anchors"):
        read_anchors(tmp_path / "missing")


def test_verify_counts_the_records_after_each_anchor_across_files(tmp_path: Path) -> None:
    with AuditLog(tmp_path) as log:
        first = _write(log, 3)
        log._rotate()
        second = _write(log, 2)
    with AuditLog(tmp_path, name="other") as other:
        theirs = _write(other, 4)
    result = verify(tmp_path, [first[1], second[-1], theirs[0], GENESIS, HASH])
    assert result.ok and result.records == 9
    # GENESIS: before the first record of each chain (the last chain verified wins).
    assert result.after == {first[1]: 3, second[-1]: 0, theirs[0]: 3, GENESIS: 4}


def _cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["audit", "verify", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_anchor_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    audit = tmp_path / "audit"
    with AuditLog(audit) as log:
        hashes = _write(log, 4)
        kept = log.head()
    anchors = tmp_path / "anchors.jsonl"
    anchors.write_text(orjson.dumps(kept).decode() + "\n")

    rc, out, _ = _cli(str(audit), "--anchor", hashes[1], "--anchors", str(anchors), capsys=capsys)
    assert rc == 0, out
    assert out.splitlines() == [
        "ok: 4 records in 1 file(s), hash chain intact",
        f"anchor {hashes[1]}: in the chain, 2 records after the anchor",
        f"anchor {hashes[3]} (chain audit, {kept['ts']}, from {anchors}:1): in the chain, "
        "0 records after the anchor",
    ]
    rc, out, _ = _cli(str(audit), "--anchor", HASH, "--anchor", hashes[0], capsys=capsys)
    assert rc == 1
    assert out.splitlines()[0].startswith(f"TAMPERED: anchor {HASH} is not in the log")
    assert "4 records in 1 file(s): hash chain intact, but it is not the chain that was anchored" in out
    assert hashes[0] not in out  # only the missing anchor is named

    rc, out, err = _cli(str(audit), "--anchor", "sha256:nothex", capsys=capsys)
    assert (rc, out) == (2, "") and "not an audit hash: 'sha256:nothex'" in err
    anchors.write_text("not a head\n")
    rc, out, err = _cli(str(audit), "--anchors", str(anchors), capsys=capsys)
    assert (rc, out) == (2, "") and f"{anchors}:1: no JSON object" in err
    # No anchors: the output and exit status verify always had.
    rc, out, _ = _cli(str(audit), capsys=capsys)
    assert (rc, out) == (0, "ok: 4 records in 1 file(s), hash chain intact\n")


def test_cli_anchor_found_only_in_another_log_is_tampering(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Workers share a directory, one log each. Whoever rewrites one log (here: `audit`, with
    every hash recomputed) and keeps its old records as a new log of another name still holds
    the anchored hash in the directory: the head names its log, and that log no longer has it."""
    audit = tmp_path / "audit"
    with AuditLog(audit) as log:
        _write(log, 3)
        kept = log.head()
    with AuditLog(audit, name="worker-2") as other:
        theirs = _write(other, 2)
        theirs_head = other.head()
    (audit / "copy.jsonl").write_bytes((audit / "audit.jsonl").read_bytes())
    (audit / "audit.jsonl").unlink()
    with AuditLog(audit) as log:
        _write(log, 1)
    anchors = tmp_path / "anchors.jsonl"
    anchors.write_text(orjson.dumps(kept).decode() + "\n" + orjson.dumps(theirs_head).decode() + "\n")

    assert verify(audit).ok  # every log's chain is intact on its own
    rc, out, _ = _cli(str(audit), "--anchors", str(anchors), capsys=capsys)
    assert rc == 1
    assert out.splitlines() == [
        f"TAMPERED: anchor {kept['hash']} (chain audit, {kept['ts']}, from {anchors}:1) is not in "
        "log audit, only in copy: log audit was cut below it or rewritten",
        "6 records in 3 file(s): hash chain intact, but it is not the chain that was anchored",
    ]
    # Each head in its own log: intact; a bare hash names no log and is found in any.
    rc, out, _ = _cli(str(audit), "--anchor", kept["hash"], "--anchor", theirs[-1], capsys=capsys)
    assert rc == 0, out
    assert verify(audit, [kept["hash"], GENESIS]).logs == {
        kept["hash"]: {"copy"}, GENESIS: {"audit", "copy", "worker-2"}}
