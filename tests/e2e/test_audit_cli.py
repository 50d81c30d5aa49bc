"""The audit log written by a real proxy, checked with `envelope-proxy audit verify`.

One record per call (counted by the decision ids seen on the wire), an intact chain verifies,
and edits, deletions and reorderings of a copy are detected naming the file and line.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import cli

from tests.harness import ProxyProcess, mcp_client, proxy_process, token

OPS = token("ops", tenant="acme")
READER = token("reader")


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[dict[str, Any]]:
    """A proxy after a known mix of calls: what was called and the decision ids seen."""
    import anyio

    tmp = tmp_path_factory.mktemp("audit-cli")
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("ops", "echo", {"text": "one"}),
        ("ops", "search_notes", {"query": "welcome"}),
        ("ops", "write_note", {"title": "a", "body": "b", "folder": "trash"}),  # fallback deny
        ("reader", "write_note", {"title": "a", "body": "b"}),  # capability
        ("ops", "write_note", {"title": "audit", "body": "b", "folder": "inbox"}),
        ("ops", "delete_note", {"title": "audit"}),  # misconfigured
        ("ops", "echo", {"text": "two"}),
        ("reader", "search_notes", {"query": "x", "limit": 0}),  # schema
    ]
    # Approvals off: delete_note stays refused as misconfigured (no 30 s approval wait).
    with proxy_process(tmp, {"notes": sse_upstream.url}, config={"approvals": {"enabled": False}}) as pp:

        async def go() -> tuple[list[str], int]:
            refused_ids, allowed = [], 0
            for who, tool, args in calls:
                bearer = OPS if who == "ops" else READER
                async with mcp_client(pp.url("notes"), "legacy", bearer=bearer) as c:
                    r = await c.call_tool(tool, args)
                if r.is_error:
                    refused_ids.append(r.meta["envelope/decision"]["decision_id"])
                else:
                    allowed += 1
            return refused_ids, allowed

        refused_ids, allowed = anyio.run(go)
        yield {"proxy": pp, "calls": calls, "refused_ids": refused_ids, "allowed": allowed,
               "tmp": tmp}


def verify(path: Path) -> tuple[int, str]:
    done = cli("audit", "verify", str(path))
    return done.returncode, done.stdout + done.stderr


def tampered_copy(audited: dict[str, Any], name: str) -> tuple[Path, list[str]]:
    pp: ProxyProcess = audited["proxy"]
    dst = audited["tmp"] / name
    shutil.copytree(pp.audit_dir, dst, ignore=shutil.ignore_patterns("*.lock"))
    lines = (dst / "audit.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) >= 6
    return dst, lines


def test_one_record_per_call(audited: dict[str, Any]) -> None:
    pp: ProxyProcess = audited["proxy"]
    records = pp.audit_records()
    assert len(records) == len(audited["calls"])
    assert len({r["decision_id"] for r in records}) == len(records)
    for decision_id in audited["refused_ids"]:
        assert sum(r["decision_id"] == decision_id for r in records) == 1
    assert len(audited["refused_ids"]) == 4
    assert sum(r["verdict"] == "allow" for r in records) == audited["allowed"] == 4
    assert [(r["principal"], r["tool"]) for r in records] == [(w, t) for w, t, _ in audited["calls"]]


def test_intact_log_verifies(audited: dict[str, Any]) -> None:
    rc, out = verify(audited["proxy"].audit_dir)
    assert rc == 0, out
    assert out.startswith("ok")
    assert f"{len(audited['calls'])} records" in out


def test_edited_field_is_named(audited: dict[str, Any]) -> None:
    dst, lines = tampered_copy(audited, "edited")
    rec = json.loads(lines[2])
    assert rec["verdict"] == "deny"
    rec["verdict"] = "allow"  # someone hides a refusal
    lines[2] = json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n"
    (dst / "audit.jsonl").write_text("".join(lines))
    rc, out = verify(dst)
    assert rc == 1, out
    assert "TAMPERED" in out
    assert f"TAMPERED: {dst / 'audit.jsonl'}:3: hash does not match the record's content (record edited)" in out


def test_deleted_line_is_named(audited: dict[str, Any]) -> None:
    dst, lines = tampered_copy(audited, "deleted")
    del lines[3]
    (dst / "audit.jsonl").write_text("".join(lines))
    rc, out = verify(dst)
    assert rc == 1, out
    # The record now on line 4 no longer continues from line 3.
    assert f"{dst / 'audit.jsonl'}:4:" in out
    assert "deleted" in out


def test_swapped_lines_are_detected(audited: dict[str, Any]) -> None:
    dst, lines = tampered_copy(audited, "swapped")
    lines[1], lines[2] = lines[2], lines[1]
    (dst / "audit.jsonl").write_text("".join(lines))
    rc, out = verify(dst)
    assert rc == 1, out
    assert f"{dst / 'audit.jsonl'}:2:" in out


def test_single_file_can_be_verified(audited: dict[str, Any]) -> None:
    rc, out = verify(audited["proxy"].audit_dir / "audit.jsonl")
    assert rc == 0, out


def test_a_proxy_restarted_after_a_crash_mid_write_keeps_the_log_verifiable(
        audited: dict[str, Any], sse_upstream: Any) -> None:
    # The process died inside a write: its log ends in a cut-short line. Restarted on it, the
    # proxy sets the file aside and continues the chain; `verify` names the torn line and checks
    # every record after it (on main it stopped there, TAMPERED, for good: nothing written
    # after the crash was ever verified again).
    import anyio

    tmp = audited["tmp"] / "crashed"
    dst, lines = tampered_copy(audited, "crashed/state/audit")
    (dst / "audit.jsonl").write_text("".join(lines) + lines[-1][:40])
    with proxy_process(tmp, {"notes": sse_upstream.url}, config={"approvals": {"enabled": False}}) as pp:

        async def go() -> None:
            async with mcp_client(pp.url("notes"), "legacy", bearer=OPS) as c:
                assert not (await c.call_tool("echo", {"text": "after the crash"})).is_error

        anyio.run(go)
    [aside] = sorted(dst.glob("audit-*.jsonl"))
    rc, out = verify(dst)
    assert rc == 0, out
    assert f"note: {aside}:{len(lines) + 1}: the last line is cut short" in out
    assert out.splitlines()[-1] == f"ok: {len(lines) + 1} records in 2 file(s), hash chain intact"


def test_a_path_that_does_not_exist_is_a_usage_error_not_tampering(audited: dict[str, Any]) -> None:
    rc, out = verify(audited["tmp"] / "no-such-dir")
    assert rc == 2 and "TAMPERED" not in out
    assert f"no such file or directory: {audited['tmp'] / 'no-such-dir'}" in out
