"""Output guardrails: detectors, redaction, block, warn, RE2 at policy load; applied through
the envelope's one inspection seam (`Envelope.complete` with the upstream's answer), asserted
on what is delivered and on the audit record."""

from __future__ import annotations

import base64
import json
import textwrap
import threading
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from envelope_helpers import build_revision

from proxy.audit.log import AuditLog
from proxy.config import Config
from proxy.envelope.checks.guardrails import engine_of, rules_for
from proxy.envelope.pipeline import Envelope
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    Code,
    Decision,
    Principal,
    Reply,
    RequestInfo,
    RunContext,
    Services,
    ToolCall,
    Verdict,
)
from proxy.errors import PolicyError
from proxy.observability.metrics import Metrics
from proxy.policy.loader import load_policy
from proxy.policy.vocab import BUILTIN_PATTERNS, DETECTORS, compile_pattern

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PEM = (
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA0Z3VS5JJcds3xfn/ygWyF8PbnGy0AHB7Mqv\n"
    "c2VjcmV0IGtleSBtYXRlcmlhbA==\n-----END RSA PRIVATE KEY-----"
)
JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
       "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U")
GITHUB = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
GITHUB_PAT = "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ"
SLACK = "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUvWx"


def _doc(tool_guardrails: list[dict[str, Any]] | None = None,
         default_guardrails: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "version": 1,
        "upstreams": {"docs": {"url": "http://127.0.0.1:1/mcp"}},
        "defaults": {"guardrails": default_guardrails or []},
        "tools": {"docs.fetch": {"effect": "read", "guardrails": tool_guardrails or []}},
    }


class _Pending:
    """A `docs.fetch` call under `doc`, ended through a real envelope (no store: nothing is
    recorded in a ledger) with an audit log in a temporary directory."""

    def __init__(self, doc: dict[str, Any], settings: Config | None = None):
        import tempfile

        self.directory = Path(tempfile.mkdtemp(prefix="guardrails-"))
        self.metrics = Metrics()
        services = (Services(metrics=self.metrics) if settings is None
                    else Services(metrics=self.metrics, settings=settings))
        self.envelope = Envelope(AuditLog(self.directory), self.metrics, ToolRegistry(), services)
        self.chain = self.envelope.install(build_revision(doc))
        self.call = ToolCall(
            decision_id="d1", upstream="docs", tool="fetch", arguments={},
            principal=Principal("p"), run=RunContext("r", "p"), request=RequestInfo("tools/call"),
        )

    def record(self) -> dict[str, Any]:
        return json.loads((self.directory / "audit.jsonl").read_text().splitlines()[-1])

    @property
    def extra(self) -> dict[str, Any]:
        return self.record().get("extra", {})


class _Guarded:
    def __init__(self, changed: bool, decision: Decision | None):
        self.changed = changed
        self.decision = decision


async def guard_reply(pending: _Pending, reply: dict[str, Any], metrics: Metrics | None = None) -> _Guarded:
    """End the call with the upstream's `reply`: whether what is delivered differs from the
    upstream's bytes, and the refusal that withholds it (None: delivered). `reply` is updated
    to what is delivered."""
    try:
        raw: bytes | None = json.dumps(reply).encode()
    except RecursionError:  # deeper than any wire reply; the envelope never needs the bytes
        raw = None
    outcome = await pending.envelope.complete(pending.envelope.begin_read(pending.call), Reply(reply, raw))
    if metrics is not None:  # the envelope counted into the pending's own metrics
        metrics.registry = pending.metrics.registry  # type: ignore[misc]
    if outcome.kind == "deliver":
        return _Guarded(outcome.raw is None, None)
    return _Guarded(True, outcome.decision)


def _reply(result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "result": result}


def _text(*texts: str) -> dict[str, Any]:
    return _reply({"content": [{"type": "text", "text": t} for t in texts], "isError": False})


SECRETS = [{"detector": "secrets", "action": "redact"}]


# -- detectors ---------------------------------------------------------------------------


@pytest.mark.parametrize(("detector", "text", "secret"), [
    ("aws_access_key_id", f"key id {AWS_KEY} here", AWS_KEY),
    ("aws_access_key_id", "temp ASIAY34FZKBOKMUTVV7A.", "ASIAY34FZKBOKMUTVV7A"),
    ("aws_secret_access_key", f"aws_secret_access_key = {AWS_SECRET}\n", AWS_SECRET),
    ("aws_secret_access_key", f'{{"SecretAccessKey": "{AWS_SECRET}"}}', AWS_SECRET),
    ("private_key", f"here:\n{PEM}\nthanks", PEM),
    ("jwt", f"token {JWT} end", JWT),
    ("bearer_token", "Authorization: Bearer abcdef0123456789abcdef", "abcdef0123456789abcdef"),
    ("github_token", f"use {GITHUB}", GITHUB),
    ("github_token", f"use {GITHUB_PAT}", GITHUB_PAT),
    ("slack_token", f"slack {SLACK}", SLACK),
    ("generic_api_key", "api_key=sk_live_0123456789abcdef", "sk_live_0123456789abcdef"),
    ("generic_api_key", '{"apiKey": "Zm9vYmFyYmF6cXV4"}', "Zm9vYmFyYmF6cXV4"),
])
async def test_builtin_detector_redacts_only_the_secret(detector: str, text: str, secret: str) -> None:
    pending = _Pending(_doc([{"detector": detector, "action": "redact"}]))
    reply = _text(text)
    guarded = await guard_reply(pending, reply)
    out = reply["result"]["content"][0]["text"]
    assert guarded.changed and guarded.decision is None
    assert secret not in out
    assert f"[REDACTED:{detector}]" in out
    assert out.replace(f"[REDACTED:{detector}]", secret) == text  # the context stays readable
    assert pending.extra["guardrails"] == [
        {"id": detector, "detector": detector, "action": "redact", "matches": 1}]


@pytest.mark.parametrize("text", [
    "nothing to see here",
    "AKIA is a prefix, AKIAshort is not a key",
    "the secret key is short",
    "bearer of good news",
    "api_key=[none]",
    "a plain sentence about tokens and keys",
])
async def test_benign_text_is_left_alone(text: str) -> None:
    pending = _Pending(_doc(SECRETS))
    reply = _text(text)
    guarded = await guard_reply(pending, reply)
    assert not guarded.changed and guarded.decision is None
    assert reply["result"]["content"][0]["text"] == text
    assert "guardrails" not in pending.extra


def test_every_builtin_is_re2_and_secrets_names_them_all() -> None:
    assert set(DETECTORS) == {*BUILTIN_PATTERNS, "secrets"}
    for pattern in BUILTIN_PATTERNS.values():
        assert engine_of(compile_pattern(pattern)) == "re2"
    rules = rules_for(build_revision(_doc(SECRETS)), "docs.fetch")
    assert [r.detector for r in rules] == list(BUILTIN_PATTERNS)


# -- where results are scanned -------------------------------------------------------------


async def test_redacts_content_structured_content_and_embedded_resources() -> None:
    pending = _Pending(_doc(default_guardrails=SECRETS))
    reply = _reply({
        "content": [
            {"type": "text", "text": f"id={AWS_KEY}"},
            {"type": "resource", "resource": {"uri": "file:///creds", "mimeType": "text/plain",
                                              "text": f"aws_secret_access_key={AWS_SECRET}"}},
            {"type": "image", "data": "aGVsbG8=", "mimeType": "image/png"},
        ],
        "structuredContent": {"creds": [{"id": AWS_KEY, "n": 3, "ok": True},
                                        {"nested": {"deep": [f"x {AWS_KEY} y"]}}],
                              "note": "fine"},
        "isError": False,
    })
    guarded = await guard_reply(pending, reply)
    result = reply["result"]
    assert guarded.changed
    dumped = json.dumps(result)
    assert AWS_KEY not in dumped and AWS_SECRET not in dumped
    assert result["content"][0]["text"] == "id=[REDACTED:aws_access_key_id]"
    assert result["content"][1]["resource"]["text"] == (
        "aws_secret_access_key=[REDACTED:aws_secret_access_key]")
    assert result["content"][1]["resource"]["uri"] == "file:///creds"
    assert result["content"][2]["data"] == "aGVsbG8="
    structured = result["structuredContent"]
    assert structured["creds"][0] == {"id": "[REDACTED:aws_access_key_id]", "n": 3, "ok": True}
    assert structured["creds"][1]["nested"]["deep"] == ["x [REDACTED:aws_access_key_id] y"]
    assert structured["note"] == "fine"
    entries = {e["detector"]: e for e in pending.extra["guardrails"]}
    assert entries["aws_access_key_id"]["matches"] == 3
    assert entries["aws_secret_access_key"]["matches"] == 1
    assert AWS_KEY not in json.dumps(pending.record())  # counts, never the secret


async def test_deeply_nested_structured_content_does_not_recurse() -> None:
    pending = _Pending(_doc(SECRETS))
    deep: Any = AWS_KEY
    for _ in range(5000):
        deep = {"x": [deep]}
    reply = _reply({"content": [], "structuredContent": deep})
    assert (await guard_reply(pending, reply)).decision is None
    node = reply["result"]["structuredContent"]
    for _ in range(5000):
        node = node["x"][0]
    assert node == "[REDACTED:aws_access_key_id]"


async def test_an_error_reply_is_scanned_too() -> None:
    """A JSON-RPC error of an untrusted tool carries upstream text to the client too."""
    pending = _Pending(_doc(SECRETS))
    error = {"jsonrpc": "2.0", "id": 1, "error": {"code": -32000, "message": f"failed: {AWS_KEY}",
                                                  "data": {"detail": AWS_KEY}}}
    assert (await guard_reply(pending, error)).changed
    assert AWS_KEY not in json.dumps(error)
    assert error["error"]["message"] == "failed: [REDACTED:aws_access_key_id]"


async def test_no_guardrails_is_a_no_op() -> None:
    pending = _Pending(_doc())
    reply = _text(AWS_KEY)
    assert (await guard_reply(pending, reply)).changed is False
    assert reply["result"]["content"][0]["text"] == AWS_KEY


# -- block, warn, policy patterns ------------------------------------------------------------


async def test_block_replaces_the_result_with_a_refusal_decision() -> None:
    metrics = Metrics()
    pending = _Pending(_doc([{"detector": "private_key", "action": "block", "id": "no-keys"},
                             {"detector": "aws_access_key_id", "action": "redact"}]))
    guarded = await guard_reply(pending, _text(f"{PEM} and {AWS_KEY}"), metrics)
    decision = guarded.decision
    assert decision is not None
    assert decision.verdict is Verdict.DENY and decision.code is Code.GUARDRAIL_BLOCKED
    assert decision.check == "guardrails" and decision.rule == "no-keys"
    assert "BEGIN" not in decision.reason and "no-keys" in decision.reason
    assert pending.extra["guardrails"] == [
        {"id": "no-keys", "detector": "private_key", "action": "block", "matches": 1},
        {"id": "aws_access_key_id", "detector": "aws_access_key_id", "action": "redact", "matches": 1},
    ]
    text = pending.metrics.render()[0].decode()
    assert 'envelope_guardrail_actions_total{action="block",tool="fetch"} 1.0' in text
    assert 'action="redact"' not in text  # a blocked result redacts nothing


async def test_block_uses_the_rule_reason() -> None:
    pending = _Pending(_doc([{"pattern": r"(?i)internal use only", "id": "classified",
                              "action": "block", "reason": "classified documents stay inside"}]))
    guarded = await guard_reply(pending, _reply({"content": [], "structuredContent": {"s": "INTERNAL USE ONLY"}}))
    assert guarded.decision is not None
    assert guarded.decision.reason == "classified documents stay inside"


async def test_warn_changes_nothing_but_is_audited_and_counted() -> None:
    metrics = Metrics()
    pending = _Pending(_doc([{"detector": "jwt", "action": "warn"}]))
    reply = _text(f"a {JWT}", f"b {JWT}")
    before = json.dumps(reply)
    guarded = await guard_reply(pending, reply, metrics)
    assert not guarded.changed and guarded.decision is None
    assert json.dumps(reply) == before
    assert pending.extra["guardrails"] == [
        {"id": "jwt", "detector": "jwt", "action": "warn", "matches": 2}]
    assert 'envelope_guardrail_actions_total{action="warn",tool="fetch"} 1.0' in pending.metrics.render()[0].decode()


async def test_warn_and_block_judge_the_text_before_redaction() -> None:
    pending = _Pending(_doc([{"detector": "aws_access_key_id", "action": "redact"},
                             {"pattern": "AKIA[A-Z0-9]{16}", "id": "aws-seen", "action": "warn"}]))
    reply = _text(AWS_KEY)
    await guard_reply(pending, reply)
    assert reply["result"]["content"][0]["text"] == "[REDACTED:aws_access_key_id]"
    assert [e["id"] for e in pending.extra["guardrails"]] == ["aws_access_key_id", "aws-seen"]


FULLWIDTH_KEY = "".join(chr(ord(c) + 0xFEE0) for c in AWS_KEY)


@pytest.mark.parametrize("hidden", [
    "AKIA\u200bIOSFODNN7EXAMPLE",  # zero-width space
    "AKIA\u200dIOSF\u2060ODNN7EXAMPLE",  # zero-width joiner, word joiner
    "AKIA\u202eIOSFODNN7\u202cEXAMPLE",  # bidi override and pop
    "AKIA\u00adIOSFODNN7EXAMPLE",  # soft hyphen
    "AKIA\U000e0041IOSFODNN7EXAMPLE",  # tag character
    "AKIA\ufe0fIOSF\u034fODNN7EXAMPLE",  # variation selector, combining grapheme joiner
    FULLWIDTH_KEY,
])
async def test_a_secret_behind_invisible_or_fullwidth_characters_is_redacted(hidden: str) -> None:
    pending = _Pending(_doc(SECRETS))
    reply = _text(f"key: {hidden} (\uff44\uff4f not share)")
    guarded = await guard_reply(pending, reply)
    assert guarded.changed and guarded.decision is None
    # the reader's view is delivered, redacted
    assert reply["result"]["content"][0]["text"] == "key: [REDACTED:aws_access_key_id] (do not share)"
    assert pending.extra["guardrails"] == [
        {"id": "aws_access_key_id", "detector": "aws_access_key_id", "action": "redact", "matches": 1}]


async def test_a_hidden_secret_in_a_key_is_blocked_and_warned() -> None:
    pending = _Pending(_doc([{"detector": "aws_access_key_id", "action": "block"},
                             {"pattern": "AKIA[A-Z0-9]{16}", "id": "aws-seen", "action": "warn"}]))
    guarded = await guard_reply(pending, _reply({"content": [], "_meta": {FULLWIDTH_KEY: 1}}))
    assert guarded.decision is not None and guarded.decision.code == Code.GUARDRAIL_BLOCKED
    assert [e["id"] for e in pending.extra["guardrails"]] == ["aws_access_key_id", "aws-seen"]


async def test_non_ascii_text_without_a_hidden_secret_is_delivered_as_sent() -> None:
    pending = _Pending(_doc(SECRETS))
    text = f"\uff46\uff55\uff4c\uff4c \ufb01\u200b na\u00efve \u2014 key {AWS_KEY}"
    reply = _text(text)
    await guard_reply(pending, reply)
    # only the plain match is redacted; the other characters stay as the upstream sent them
    assert reply["result"]["content"][0]["text"] == text.replace(AWS_KEY, "[REDACTED:aws_access_key_id]")


async def test_policy_pattern_redacts_with_its_id_and_secret_group() -> None:
    pending = _Pending(_doc([{"pattern": r"acct-(?P<secret>\d{8})", "id": "account", "action": "redact"}]))
    reply = _text("pay acct-12345678 and acct-87654321")
    await guard_reply(pending, reply)
    assert reply["result"]["content"][0]["text"] == "pay acct-[REDACTED:account] and acct-[REDACTED:account]"


def test_defaults_run_before_the_tools_own_rules() -> None:
    doc = _doc([{"pattern": "x+", "id": "tool-x"}], [{"detector": "slack_token", "id": "slack"}])
    assert [r.id for r in rules_for(build_revision(doc), "docs.fetch")] == ["slack", "tool-x"]
    assert [r.id for r in rules_for(build_revision(doc), "docs.other")] == ["slack"]


async def test_a_guardrail_that_raises_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> Any:
        raise RuntimeError("boom")

    import proxy.envelope.inspect as inspect_module

    monkeypatch.setattr(inspect_module, "scan_payload", boom)
    pending = _Pending(_doc(SECRETS))
    guarded = await guard_reply(pending, _text("x"))
    assert guarded.decision is not None and guarded.decision.code is Code.INTERNAL_ERROR
    assert guarded.decision.check == "guardrails"
    assert pending.record()["code"] == "internal_error"  # audited, not delivered


# -- RE2: linear time, load errors -----------------------------------------------------------


async def test_catastrophic_backtracking_pattern_runs_on_re2() -> None:
    """`(a+)+$` takes exponential time on a backtracking engine (Python's `re`) against
    "aaa...a!"; RE2 matches in time linear in the input, so the pattern is accepted and this
    finishes at once. The test asserts correctness and that the engine is RE2 (no timing)."""
    regex = compile_pattern("(a+)+$")
    assert engine_of(regex) == "re2"
    assert type(regex).__module__.startswith("re2")
    evil = "a" * 100_000 + "!"
    assert regex.search(evil) is None
    assert regex.search("a" * 100_000) is not None
    pending = _Pending(_doc([{"pattern": "(a+)+$", "id": "evil", "action": "block"}]))
    assert engine_of(rules_for(pending.chain.revision, "docs.fetch")[0].regex) == "re2"
    assert (await guard_reply(pending, _text(evil))).decision is None
    blocked = await guard_reply(_Pending(_doc([{"pattern": "(a+)+$", "id": "evil", "action": "block"}])),
                                _text("a" * 100_000))
    assert blocked.decision is not None and blocked.decision.code is Code.GUARDRAIL_BLOCKED


def _policy(tmp_path: Path, guardrails: str) -> Path:
    d = tmp_path / "policy"
    d.mkdir()
    (d / "p.yaml").write_text(textwrap.dedent("""\
        version: 1
        upstreams:
          docs: {url: "http://127.0.0.1:1/mcp"}
        tools:
          docs.fetch:
            effect: read
            guardrails:
        """) + textwrap.indent(textwrap.dedent(guardrails), "      "))
    return d


@pytest.mark.parametrize(("entry", "message"), [
    ('- {id: la, pattern: "(?=secret)s"}\n', "not a valid RE2 pattern: invalid perl operator: (?="),
    ('- {id: br, pattern: "(a)\\\\1"}\n', "not a valid RE2 pattern: invalid escape sequence"),
    ('- {id: bad, pattern: "[unclosed"}\n', "not a valid RE2 pattern: missing ]"),
    ('- {id: empty, pattern: "a*"}\n', "matches the empty string"),
])
def test_a_bad_pattern_is_a_load_error_with_its_location(tmp_path: Path, entry: str, message: str) -> None:
    d = _policy(tmp_path, entry)
    with pytest.raises(PolicyError) as info:
        load_policy(d)
    problems = info.value.problems
    assert len(problems) == 1, problems
    p = problems[0]
    # file:line:column of the pattern scalar itself (6 spaces of indent, 1-based columns)
    assert p.file.endswith("p.yaml") and p.line == 8 and p.column == entry.index('"') + 7
    assert "tools.docs.fetch.guardrails[0].pattern" in p.message and message in p.message


def test_unknown_detector_and_missing_kind_are_load_errors(tmp_path: Path) -> None:
    d = _policy(tmp_path, """\
        - {detector: aws_keys}
        - {action: block}
        - {pattern: "x+"}
        - {detector: jwt, action: shred}
        """)
    with pytest.raises(PolicyError) as info:
        load_policy(d)
    messages = sorted(f"{p.line}: {p.message}" for p in info.value.problems)
    assert any(m.startswith("8: ") and "unknown detector 'aws_keys'" in m for m in messages), messages
    assert any(m.startswith("9: ") and "exactly one of 'detector' or 'pattern'" in m for m in messages)
    assert any(m.startswith("10: ") and "needs an 'id'" in m for m in messages)
    assert any(m.startswith("11: ") and "action" in m for m in messages)


def test_a_good_policy_loads_and_compiles_on_re2(tmp_path: Path) -> None:
    d = _policy(tmp_path, """\
        - {detector: secrets, action: redact}
        - {id: evil, pattern: "(a+)+$", action: warn}
        """)
    revision = load_policy(d)
    rules = rules_for(revision, "docs.fetch")
    assert [r.id for r in rules][-1] == "evil"
    assert all(engine_of(r.regex) == "re2" for r in rules)


# -- one text across blocks, base64 text, large replies off the event loop -------------------


async def test_a_secret_cut_across_two_text_blocks_is_redacted_where_it_starts() -> None:
    pending = _Pending(_doc(default_guardrails=SECRETS))
    reply = _text(f"key id {AWS_KEY[:8]}", f"{AWS_KEY[8:]} (rotate it)", "a third block")
    guarded = await guard_reply(pending, reply)
    blocks = reply["result"]["content"]
    assert guarded.changed and guarded.decision is None
    # what a model reads, the blocks in order, holds the marker and no piece of the key
    assert [b["text"] for b in blocks] == ["key id [REDACTED:aws_access_key_id]", " (rotate it)",
                                           "a third block"]
    assert pending.extra["guardrails"] == [
        {"id": "aws_access_key_id", "detector": "aws_access_key_id", "action": "redact", "matches": 1}]


async def test_a_secret_cut_across_text_blocks_is_blocked_and_a_match_inside_one_counts_once() -> None:
    pending = _Pending(_doc([{"detector": "aws_access_key_id", "action": "block", "id": "keys"},
                             {"detector": "aws_secret_access_key", "action": "warn"}]))
    reply = _text(f"aws_secret_access_key = {AWS_SECRET}", "", f"then {AWS_KEY[:4]}", f"{AWS_KEY[4:]}.")
    guarded = await guard_reply(pending, reply)
    assert guarded.decision is not None and guarded.decision.code is Code.GUARDRAIL_BLOCKED
    assert pending.extra["guardrails"] == [
        {"id": "keys", "detector": "aws_access_key_id", "action": "block", "matches": 1},
        {"id": "aws_secret_access_key", "detector": "aws_secret_access_key", "action": "warn", "matches": 1}]


async def test_a_secret_cut_across_blocks_behind_an_invisible_character_is_redacted() -> None:
    pending = _Pending(_doc(default_guardrails=SECRETS))
    reply = _text(f"id {AWS_KEY[:6]}\u200b", f"{AWS_KEY[6:]}!")
    await guard_reply(pending, reply)
    assert [b["text"] for b in reply["result"]["content"]] == ["id [REDACTED:aws_access_key_id]", "!"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(("block", "where"), [
    ({"type": "resource", "resource": {"uri": "file:///creds.env", "mimeType": "text/plain",
                                       "blob": _b64(f"AWS_KEY={AWS_KEY}\n".encode())}}, ("resource", "blob")),
    ({"type": "resource", "resource": {"uri": "file:///c.json", "mimeType": "application/json",
                                       "blob": _b64(f'{{"id": "{AWS_KEY}", "n": "\xe9"}}'.encode("latin-1"))}},
     ("resource", "blob")),
    # no textual type, but the bytes are UTF-8 text: a client may show them
    ({"type": "audio", "mimeType": "audio/wav", "data": _b64(f"transcript: {AWS_KEY}".encode())}, ("data",)),
    # longer than the head read first to tell binary from text (`SNIFF_CHARS`), a cut
    # character at the head's end
    ({"type": "audio", "mimeType": "audio/wav",
      "data": _b64(("x" + "\u00e9" * 1600 + AWS_KEY).encode())}, ("data",)),
    ({"type": "image", "mimeType": "image/svg+xml",
      "data": _b64(f"<svg><text>{AWS_KEY}</text></svg>".encode())}, ("data",)),
])
async def test_a_secret_in_base64_text_is_redacted_and_re_encoded(block: dict[str, Any], where: tuple[str, ...]) -> None:
    pending = _Pending(_doc(default_guardrails=SECRETS))
    reply = _reply({"content": [block], "isError": False})
    guarded = await guard_reply(pending, reply)
    node = reply["result"]["content"][0]
    for key in where:
        node = node[key]
    decoded = base64.b64decode(node)
    assert guarded.changed and AWS_KEY.encode() not in decoded
    assert b"[REDACTED:aws_access_key_id]" in decoded
    assert pending.extra["guardrails"][0]["matches"] == 1


async def test_a_secret_in_base64_text_is_blocked_in_resource_contents() -> None:
    pending = _Pending(_doc([{"detector": "secrets", "action": "block"}]))
    reply = _reply({"contents": [{"uri": "file:///k", "mimeType": "application/x-yaml",
                                  "blob": _b64(f"key: {AWS_KEY}".encode())}]})
    guarded = await guard_reply(pending, reply)
    assert guarded.decision is not None and guarded.decision.code is Code.GUARDRAIL_BLOCKED


@pytest.mark.parametrize("size", [0, 8192])
async def test_a_binary_image_is_delivered_as_sent(size: int) -> None:
    # PNG bytes (not UTF-8) that happen to hold a key's letters: an image, not text
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * size + AWS_KEY.encode() + b"\xff\xfe\x00"
    pending = _Pending(_doc(default_guardrails=SECRETS))
    reply = _reply({"content": [{"type": "image", "mimeType": "image/png", "data": _b64(png)}]})
    guarded = await guard_reply(pending, reply)
    assert not guarded.changed and guarded.decision is None
    assert base64.b64decode(reply["result"]["content"][0]["data"]) == png


async def test_a_large_reply_is_scanned_in_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.envelope.inspect as inspect_module

    threads: list[int] = []
    real = inspect_module.scan_payload

    def recording(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(inspect_module, "scan_payload", recording)
    pending = _Pending(_doc(default_guardrails=SECRETS))
    small = _text(f"id {AWS_KEY}")
    await guard_reply(pending, small)
    large = _text("x" * inspect_module.INLINE_SCAN_CHARS + f" id {AWS_KEY}")
    pending = _Pending(_doc(default_guardrails=SECRETS))
    guarded = await guard_reply(pending, large)
    assert threads[0] == threading.get_ident() and threads[1] != threading.get_ident()
    assert guarded.changed and large["result"]["content"][0]["text"].endswith("id [REDACTED:aws_access_key_id]")


async def test_a_scan_that_does_not_end_in_time_withholds_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.envelope.inspect as inspect_module

    release = threading.Event()

    def stuck(*args: Any) -> Any:
        release.wait(10)
        raise AssertionError("never delivered")

    monkeypatch.setattr(inspect_module, "scan_payload", stuck)
    pending = _Pending(_doc(default_guardrails=SECRETS),
                       Config.model_validate({"limits": {"guardrail_scan_timeout": "50ms"}}))
    try:
        guarded = await guard_reply(pending, _text("x" * (inspect_module.INLINE_SCAN_CHARS + 1)))
    finally:
        release.set()
    decision = guarded.decision
    assert decision is not None and decision.code is Code.INTERNAL_ERROR and decision.check == "guardrails"
    assert "did not finish within 0.05 s (limits.guardrail_scan_timeout)" in decision.reason
    assert "withheld" in decision.reason
    record = pending.record()
    assert record["code"] == "internal_error" and "did not finish" in record["reason"]
    assert 'envelope_check_errors_total{check="guardrails"} 1.0' in pending.metrics.render()[0].decode()


@pytest.mark.parametrize("piece", ["e\u0301", "\uff21\u200b", "\u1100\u1161\u11a8", "a\u0323\u0302",
                                   "\u00c5\u212b", "\ufb01x", "\u3000"])
def test_a_long_text_folds_in_chunks_as_it_would_whole(piece: str) -> None:
    from proxy.envelope.checks.guardrails import SKELETON_CHUNK, skeleton
    from proxy.envelope.invisible import invisible_class

    for shift in range(len(piece) + 2):  # the piece astride every cut
        text = ("x" * (SKELETON_CHUNK - shift) + piece) * 3 + "\u4e00" * 10
        assert skeleton(text) == invisible_class().sub("", unicodedata.normalize("NFKC", text))


def test_the_plain_fast_path_skips_exactly_the_texts_without_an_invisible_character() -> None:
    """`plain` (what the guardrails' and the ledger's folds take as it is) and the invisible
    class agree on every ASCII character: a control that is not whitespace is invisible, and a
    text of ASCII holding one is not plain."""
    from proxy.envelope.invisible import invisible_class, plain, visible

    invisible = {chr(c) for c in range(128) if invisible_class().match(chr(c))}
    assert invisible == {chr(c) for c in range(128) if unicodedata.category(chr(c)) == "Cc" and not chr(c).isspace()}
    for c in map(chr, range(128)):
        assert plain(f"ab{c}cd") is (c not in invisible), repr(c)
    assert visible("A\x00K\x1bI\x7fA\x90\x9f") == "AKIA"
    assert visible("a\tb\nc\x0bd\x0ce\x1cf\x85g") == "a\tb\nc\x0bd\x0ce\x1cf\x85g"  # whitespace parts words


_FLOW_OFF = {"dataflow": {"mode": "off"}}


@pytest.mark.parametrize("doc, built", [
    ({**_doc(), **_FLOW_OFF}, False),
    (_doc(), True),  # the data flow's default shadow mode folds what it records
    ({**_doc(tool_guardrails=[{"detector": "secrets", "action": "redact"}]), **_FLOW_OFF}, True),
    ({**_doc(default_guardrails=[{"detector": "secrets", "action": "block"}]), **_FLOW_OFF}, True),
])
def test_the_invisible_class_is_built_by_a_policy_that_reads_text(doc: dict[str, Any], built: bool) -> None:
    """Built at policy load (the chain), never by the first scan or record; a policy without
    guardrails and with data flow off never pays for it (nor does an import: start-up)."""
    from proxy.envelope.invisible import invisible_class

    invisible_class.cache_clear()
    _Pending(doc)
    assert (invisible_class.cache_info().currsize == 1) is built
