"""Decision replay end to end: the real proxy records traffic (`serve --record`) from the SDK
client against the demo notes server; `envelope-proxy replay` re-decides it under the same
policy (no difference) and under an edited copy (the difference names the calls)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import cli, fixture_policy, write_policy

from tests.harness import mcp_client, proxy_process, token

OPS = token("ops", tenant="acme")

CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("echo", {"text": "hello replay"}, "ok"),
    ("write_note", {"title": "replay-inbox", "body": "b", "folder": "inbox"}, "ok"),
    ("write_note", {"title": "replay-archive", "body": "b", "folder": "archive"}, "capability_blocked"),
    ("write_note", {"title": "replay-secret", "body": "b", "folder": "secret"}, "capability_blocked"),
    ("search_notes", {"query": "x" * 60}, "schema_invalid"),
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[tuple[Path, Path]]:
    """(policy directory, record file) after a few allowed and refused calls through the proxy."""
    tmp = tmp_path_factory.mktemp("replay")
    policies = write_policy(tmp / "policies", {"notes": {}})
    record = tmp / "records" / "calls.jsonl"

    async def traffic() -> None:
        async with mcp_client(pp.url("notes"), "auto", bearer=OPS) as c:
            await c.list_tools()  # the proxy learns the announcements
            for tool, args, code in CALLS:
                result = await c.call_tool(tool, args)
                meta = (result.meta or {}).get("envelope/decision")
                assert (meta["code"] if meta else "ok") == code, (tool, args, result)

    with proxy_process(tmp, {"notes": sse_upstream.url}, policies=policies,
                       args=["--record", str(record)]) as pp:
        asyncio.run(traffic())
    yield policies, record


def test_record_file_has_one_line_per_decision(recorded: tuple[Path, Path]) -> None:
    _, record = recorded
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(r["tool"], r["decision"]["code"]) for r in lines] == [(t, c) for t, _, c in CALLS]
    echo = lines[0]
    assert echo["principal"]["id"] == "ops" and echo["principal"]["claims"]["tenant"] == "acme"
    assert echo["arguments"] == {"text": "hello replay"}
    assert echo["announced"]["inputSchema"]["properties"]["text"]["type"] == "string"
    assert echo["result"]["digest"].startswith("sha256:") and "hello replay" not in json.dumps(echo["result"])
    assert echo["request"]["method"] == "tools/call" and echo["request"]["protocol_version"]
    assert lines[3]["decision"]["rule"] == "no-secret-folder"


def test_replay_under_the_same_policy_changes_nothing(recorded: tuple[Path, Path]) -> None:
    policies, record = recorded
    done = cli("replay", "--policies", str(policies), "--fail-on-change", str(record))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 call(s) replayed" in done.stdout
    assert "0 newly refused, 0 newly allowed, 0 changed code, 5 unchanged" in done.stdout


def _edited_policy(directory: Path) -> Path:
    tools = copy.deepcopy(fixture_policy()["tools"])
    tools["notes.echo"]["rules"] = [{"id": "no-replay-echo", "forbid": 'args.text.contains("replay")',
                                     "reason": "no echoing replays"}]
    tools["notes.write_note"]["fallback"] = "allow"
    return write_policy(directory, {"notes": {}}, tools=tools)


def test_replay_under_an_edited_policy_names_the_changes(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    _, record = recorded
    edited = _edited_policy(tmp_path / "edited")
    done = cli("replay", "--policies", str(edited), "--fail-on-change", str(record))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "NEWLY REFUSED  notes.echo  principal=ops  ok (envelope) -> capability_blocked (arg_rules/no-replay-echo)" in out
    assert ("NEWLY ALLOWED  notes.write_note  principal=ops  "
            "capability_blocked (arg_rules/notes.write_note#fallback) -> ok (envelope)") in out
    assert "1 newly refused, 1 newly allowed, 0 changed code, 3 unchanged" in out

    without = cli("replay", "--policies", str(edited), str(record))
    assert without.returncode == 0, without.stdout + without.stderr
    assert without.stdout == out

    as_json = cli("replay", "--policies", str(edited), "--format", "json", str(record))
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["summary"] == {"newly_refused": 1, "newly_allowed": 1, "changed": 0, "unchanged": 3,
                                 "total": 5}
    refused = next(c for c in report["changes"] if c["kind"] == "newly_refused")
    assert (refused["tool"], refused["principal"], refused["new"]["rule"]) == ("echo", "ops", "no-replay-echo")
    allowed = next(c for c in report["changes"] if c["kind"] == "newly_allowed")
    assert (allowed["tool"], allowed["old"]["code"], allowed["new"]["code"]) == (
        "write_note", "capability_blocked", "ok")


def test_replay_reports_policy_errors_with_their_place(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    _, record = recorded
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "policy.yaml").write_text("version: 1\ntools:\n  notes.echo:\n    effect: sometimes\n")
    done = cli("replay", "--policies", str(broken), "--fail-on-change", str(record))
    assert done.returncode == 2
    assert f"{broken / 'policy.yaml'}:4:" in done.stderr
