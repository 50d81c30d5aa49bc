"""Decision recording and replay (`serve --record`, `envelope-proxy replay`): the record line,
the static re-decision and the diff, on crafted records and the fixture policy."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.envelope.pipeline import Chain, Pending
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    ALLOWED,
    Code,
    Decision,
    Principal,
    RequestInfo,
    RunContext,
    ToolCall,
    ToolInfo,
    Verdict,
    deny,
)
from proxy.policy.loader import load_policy
from proxy.tools.replay import (
    RECORD_VERSION,
    Recorder,
    RecordError,
    Replayer,
    compare,
    load_records,
    outcome,
    replay,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "policies"


@pytest.fixture(scope="module")
def revision() -> Any:
    return load_policy(FIXTURES)


def _call(tool: str, args: dict[str, Any], principal: str = "writer", groups: tuple[str, ...] = ("writers",),
          **claims: Any) -> ToolCall:
    return ToolCall(
        decision_id=f"d-{tool}-{len(args)}", upstream="notes", tool=tool, arguments=args,
        principal=Principal(principal, groups, claims, "jwt"),
        run=RunContext(id="run-1", principal=principal, parent="parent-0", depth=1, session="s-1"),
        request=RequestInfo("tools/call", "2026-07-28", {"x-tenant": "acme"}),
        upstream_tool=ToolInfo(tool, {"type": "object"}, {"readOnlyHint": True}),
    )


def _record_line(tmp_path: Path, revision: Any, call: ToolCall, decision: Decision,
                 reply: dict[str, Any] | None) -> dict[str, Any]:
    chain = Chain(revision, ToolRegistry())
    rec = Recorder(tmp_path / "rec" / "calls.jsonl")
    rec.record(Pending(call, chain, decision, 0.0, 0.0), decision, reply)
    rec.close()
    [line] = (tmp_path / "rec" / "calls.jsonl").read_text().splitlines()
    return json.loads(line)


def test_record_line_has_everything_to_redecide_but_not_the_result(tmp_path: Path, revision: Any) -> None:
    call = _call("echo", {"text": "hi", "n": 1}, tenant="acme")
    result = {"content": [{"type": "text", "text": "the secret result"}], "isError": False}
    line = _record_line(tmp_path, revision, call, ALLOWED, {"jsonrpc": "2.0", "id": 1, "result": result})
    assert line["v"] == RECORD_VERSION and line["time"].endswith("Z")
    assert line["decision_id"] == call.decision_id and line["revision"] == revision.revision
    assert line["principal"] == {"id": "writer", "groups": ["writers"], "claims": {"tenant": "acme"},
                                 "source": "jwt"}
    assert line["run"] == {"id": "run-1", "parent": "parent-0", "depth": 1, "shadow": False,
                           "tainted": False, "secret": False, "session": "s-1", "shadow_sticky": False}
    assert line["request"] == {"method": "tools/call", "protocol_version": "2026-07-28",
                               "headers": {"x-tenant": "acme"}}
    assert (line["upstream"], line["tool"], line["arguments"]) == ("notes", "echo", {"text": "hi", "n": 1})
    assert line["announced"] == {"inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}
    assert line["decision"] == {"verdict": "allow", "code": "ok", "check": "envelope", "rule": None,
                                "reason": "allowed by policy"}
    canonical = orjson.dumps(result, option=orjson.OPT_SORT_KEYS)
    assert line["result"] == {"digest": "sha256:" + hashlib.sha256(canonical).hexdigest(),
                              "is_error": False, "labels": {"output": "untrusted", "source": "default"}}
    assert "the secret result" not in json.dumps(line)


def test_record_line_of_a_refusal_and_its_final_outcome(tmp_path: Path, revision: Any) -> None:
    call = _call("write_note", {"title": "t", "folder": "secret"})
    refused = deny(Code.CAPABILITY_BLOCKED, "arg_rules", "secret folders are off limits", "no-secret-folder")
    line = _record_line(tmp_path, revision, call, refused, None)
    assert line["decision"]["code"] == "capability_blocked" and line["decision"]["rule"] == "no-secret-folder"
    assert line["outcome"] == line["decision"] and line["result"] is None


def test_recording_failure_is_logged_and_counted_never_raised(tmp_path: Path, revision: Any,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "adir").mkdir()
    rec = Recorder(tmp_path / "adir")  # a directory: cannot be opened for writing
    call = _call("echo", {"text": "x"})
    rec.record(Pending(call, Chain(revision, ToolRegistry()), ALLOWED, 0.0, 0.0), ALLOWED)
    rec.record(Pending(call, Chain(revision, ToolRegistry()), ALLOWED, 0.0, 0.0), ALLOWED)
    assert rec.failures == 3 and rec.records == 0  # the open, then both records
    assert "decision record not written" in caplog.text


def _rec(line: int, tool: str, args: dict[str, Any], old: dict[str, Any], principal: str = "writer",
         groups: list[str] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "v": 1, "_line": line, "decision_id": f"d{line}", "revision": "old-rev",
        "principal": {"id": principal, "groups": ["writers"] if groups is None else groups,
                      "claims": {}, "source": "jwt"},
        "run": {"id": "r", "parent": None, "depth": 0, "shadow": False, "tainted": False,
                "secret": False, "session": None, "shadow_sticky": False},
        "request": {"method": "tools/call", "protocol_version": "2026-07-28", "headers": {}},
        "shadow_requested": False, "idempotency_key": None,
        "upstream": "notes", "tool": tool, "arguments": args,
        "announced": {"inputSchema": {"type": "object"}, "annotations": {}},
        "decision": {"check": "envelope", "rule": None, "reason": "", **old},
        "extra": extra or {},
    }


OK = {"verdict": "allow", "code": "ok"}


def test_replay_diff_names_newly_refused_newly_allowed_and_changed(revision: Any) -> None:
    records = [
        # unchanged: allowed then, allowed now
        _rec(1, "echo", {"text": "hi"}, OK),
        # newly refused: the fixture policy's fallback refuses folder "archive"
        _rec(2, "write_note", {"title": "t", "body": "b", "folder": "archive"}, OK),
        # newly allowed: inbox is allowed by rule inbox-or-drafts
        _rec(3, "write_note", {"title": "t", "body": "b", "folder": "inbox"},
             {"verdict": "deny", "code": "capability_blocked", "check": "arg_rules", "rule": "old-rule"}),
        # changed: was unauthorized, now the forbid rule refuses it
        _rec(4, "write_note", {"title": "t", "body": "b", "folder": "secret-x"},
             {"verdict": "deny", "code": "unauthorized", "check": "authz"}),
        # unchanged refusal (same code, check and rule)
        _rec(5, "write_note", {"title": "t", "body": "b", "folder": "secret-y"},
             {"verdict": "deny", "code": "capability_blocked", "check": "arg_rules", "rule": "no-secret-folder"}),
    ]
    report = asyncio.run(replay(records, revision))
    kinds = {c.line: c.kind for c in report.changes}
    assert kinds == {2: "newly_refused", 3: "newly_allowed", 4: "changed"}
    by_line = {c.line: c for c in report.changes}
    assert by_line[2].new.code == "capability_blocked" and by_line[2].new.check == "arg_rules"
    assert by_line[4].old.code == "unauthorized" and by_line[4].new.rule == "no-secret-folder"
    assert report.counts() == {"newly_refused": 1, "newly_allowed": 1, "changed": 1, "unchanged": 2,
                               "total": 5}
    text = report.text()
    assert "NEWLY REFUSED  notes.write_note  principal=writer  ok (envelope) -> capability_blocked" in text
    assert text.splitlines()[-1].startswith("5 call(s) replayed under revision")
    as_json = report.as_json()
    assert as_json["summary"]["changed"] == 1 and as_json["changes"][0]["old"]["code"] == "ok"


def test_gated_calls_are_decided_statically_as_needing_approval(revision: Any) -> None:
    # delete_note is destructive: gated by default. Replay never waits for an approver.
    rec = _rec(1, "delete_note", {"title": "t"}, OK, extra={"approval_id": "a1", "approver": "bob"})
    decision = asyncio.run(asyncio.wait_for(Replayer(revision).decide(rec), 5))
    assert (decision.code, decision.check) == (Code.APPROVAL_PENDING, "approval")
    assert compare(rec, decision) is None  # allowed after approval == needs approval
    rec_pending = _rec(2, "delete_note", {"title": "t"},
                       {"verdict": "deny", "code": "approval_denied", "check": "approval",
                        "rule": "defaults.gated_effects"})
    assert compare(rec_pending, decision) is None
    # Recorded without the gate (allowed, no approval): now it needs approval.
    change = compare(_rec(3, "delete_note", {"title": "t"}, OK), decision)
    assert change is not None and change.kind == "newly_refused"


def test_a_sticky_shadow_run_is_replayed_as_shadow(revision: Any) -> None:
    # The run was shadow from an earlier call: replay seeds the flag where the shadow check reads
    # it (the run of the record's principal), so the writer is shadowed again.
    rec = _rec(1, "write_note", {"title": "t", "folder": "inbox"},
               {"verdict": "allow", "code": "shadowed", "check": "shadow", "rule": "run"})
    rec["run"]["shadow_sticky"] = True
    decision = asyncio.run(asyncio.wait_for(Replayer(revision).decide(rec), 5))
    assert (decision.code, decision.check) == (Code.SHADOWED, "shadow")
    assert compare(rec, decision) is None


def test_stateful_outcomes_are_folded() -> None:
    assert outcome({"verdict": "allow", "code": "replayed", "check": "idempotency"}).code == "ok"
    assert outcome({"verdict": "error", "code": "idempotency_in_flight", "check": "idempotency"}).allowed
    assert outcome({"verdict": "deny", "code": "approval_expired", "check": "approval"}).code == "approval_pending"
    assert outcome({"verdict": "deny", "code": "rate_limited", "check": "rate_limit"}).allowed
    same = Decision(Verdict.DENY, Code.UNAUTHORIZED, "authz", "no")
    rec = _rec(1, "echo", {}, {"verdict": "deny", "code": "unauthorized", "check": "authz"})
    assert compare(rec, same) is None


def test_rate_limits_are_no_change_however_fast_replay_runs(tmp_path: Path) -> None:
    # Recorded a minute apart, replayed back to back: the new policy's bucket runs dry, and
    # that is not a change (the recording's timing decided it).
    policy = tmp_path / "policy"
    policy.mkdir()
    doc = (FIXTURES / "tools.yaml").read_text() + "\nprincipals:\n  writer: {rate: 1/min}\n"
    (policy / "policy.yaml").write_text(doc)
    replayer = Replayer(load_policy(policy))

    async def both() -> list[Decision]:
        return [await replayer.decide(_rec(n, "echo", {"text": "x"}, OK)) for n in (1, 2)]

    first, second = asyncio.run(asyncio.wait_for(both(), 5))
    assert (first.code, second.code) == (Code.OK, Code.RATE_LIMITED)
    assert compare(_rec(2, "echo", {"text": "x"}, OK), second) is None


def test_identical_duplicates_do_not_wait_on_idempotency(revision: Any) -> None:
    rec = _rec(1, "echo", {"text": "x"}, OK)
    rec["idempotency_key"] = "k1"  # a client key: the idempotency check applies
    replayer = Replayer(revision)

    async def twice() -> list[Decision]:
        return [await replayer.decide(rec), await replayer.decide(rec)]

    first, second = asyncio.run(asyncio.wait_for(twice(), 5))
    assert first.code is Code.OK and second.code is Code.OK


def test_load_records_reports_file_and_line(tmp_path: Path) -> None:
    good = json.dumps(_rec(1, "echo", {}, OK))
    path = tmp_path / "r.jsonl"
    path.write_text(good + "\nnot json\n" + good + "\n")
    with pytest.raises(RecordError, match=r"r\.jsonl:2: not JSON"):
        load_records(path)
    path.write_text(good + "\n" + good[:20])  # a crash mid-write: the torn tail is skipped
    assert [r["_line"] for r in load_records(path)] == [1]


def test_replay_cli_takes_the_cel_engine_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # README: "Force one with ENVELOPE_CEL_ENGINE"; `check` and `test` did, `replay` ignored it.
    from proxy.cli import main

    records = tmp_path / "calls.jsonl"
    records.write_text("")
    policies = str(Path(__file__).resolve().parents[1] / "fixtures" / "policies")
    monkeypatch.setenv("ENVELOPE_CEL_ENGINE", "no-such-engine")
    assert main(["replay", "--policies", policies, str(records)]) == 2
    assert "unknown CEL engine 'no-such-engine'" in capsys.readouterr().err
    # The flag beats the environment.
    assert main(["replay", "--policies", policies, "--cel-engine", "auto", str(records)]) == 0
