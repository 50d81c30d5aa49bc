"""Output guardrails through the wire: the real proxy process, the SDK client and the demo notes
server answering in JSON and in SSE.

A planted AWS key (and its secret) in a tool's result reaches the client as
`[REDACTED:aws_access_key_id]`, in `content` text and in `structuredContent`; a `block` rule
turns the result into a `guardrail_blocked` refusal; a `warn` rule changes nothing but is
audited and counted. The audit records say which rule fired and how often, never the secret.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_helpers import upstream_server, write_policy

from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, token

ALICE = token("alice")
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PLANTED = f"aws_access_key_id = {AWS_KEY}\naws_secret_access_key = {AWS_SECRET}\n"
REDACTED = ("aws_access_key_id = [REDACTED:aws_access_key_id]\n"
            "aws_secret_access_key = [REDACTED:aws_secret_access_key]\n")

TOOLS: dict[str, Any] = {
    "notes.echo": {
        "effect": "read",
        "guardrails": [
            {"pattern": "(?i)top secret", "id": "classified", "action": "block",
             "reason": "classified material stays inside"},
            {"pattern": r"(?i)\binternal only\b", "id": "internal-note", "action": "warn"},
        ],
    },
    "notes.search_notes": {"effect": "read"},
    "notes.write_note": {"effect": "write"},
}
DEFAULTS = {"unknown_tools": "deny", "guardrails": [{"detector": "secrets", "action": "redact"}]}


@pytest.fixture(scope="module", params=["json", "sse"])
def pp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"guardrails-{mode}")
    policies = write_policy(tmp / "policies", {"notes": {}}, tools=TOOLS, defaults=DEFAULTS, principals={})
    with upstream_server(mode) as up, proxy_process(tmp, {"notes": up.url}, policies=policies) as proxy:
        proxy.extra["mode"] = mode
        yield proxy


def _records(pp: ProxyProcess, tool: str) -> list[dict[str, Any]]:
    return [r for r in pp.audit_records() if r.get("tool") == tool]


@pytest.mark.parametrize("client_mode", ["auto", "legacy"])
async def test_planted_aws_key_is_redacted_in_content_and_structured_content(
        pp: ProxyProcess, client_mode: str) -> None:
    async with mcp_client(pp.url("notes"), client_mode, bearer=ALICE) as c:
        r = await c.call_tool("echo", {"text": PLANTED})
    assert r.is_error is False
    assert r.content[0].text == REDACTED
    assert r.structured_content == {"result": REDACTED}
    assert AWS_KEY not in json.dumps(r.model_dump(mode="json"))
    rec = _records(pp, "echo")[-1]
    assert rec["code"] == "ok"
    entries = {e["detector"]: e for e in rec["extra"]["guardrails"]}
    # content text and structuredContent: one key each
    assert entries["aws_access_key_id"] == {"id": "aws_access_key_id", "detector": "aws_access_key_id",
                                            "action": "redact", "matches": 2}
    assert entries["aws_secret_access_key"]["matches"] == 2
    raw = json.dumps(rec)
    assert AWS_SECRET not in raw  # the audit names the detector and counts, never the secret


async def test_stored_note_is_redacted_in_nested_structured_content(pp: ProxyProcess) -> None:
    title = f"creds-{pp.extra['mode']}"
    async with mcp_client(pp.url("notes"), "legacy", bearer=ALICE) as c:
        w = await c.call_tool("write_note", {"title": title, "body": f"deploy key {AWS_KEY} (rotate)"})
        assert w.is_error is False
        r = await c.call_tool("search_notes", {"query": title})
    assert r.is_error is False
    hits = r.structured_content["result"]
    assert hits == [{"title": title, "folder": "inbox",
                     "body": "deploy key [REDACTED:aws_access_key_id] (rotate)"}]
    assert all(AWS_KEY not in item.text for item in r.content if item.type == "text")


@pytest.mark.parametrize("client_mode", ["auto", "legacy"])
async def test_block_rule_replaces_the_result_with_a_refusal(pp: ProxyProcess, client_mode: str) -> None:
    before = metric_value(pp.metrics(), "envelope_guardrail_actions_total", tool="echo", action="block")
    async with mcp_client(pp.url("notes"), client_mode, bearer=ALICE) as c:
        r = await c.call_tool("echo", {"text": "TOP SECRET: launch codes 0000"})
    assert r.is_error is True
    assert r.content[0].text == ("Blocked by policy (guardrail_blocked): "
                                 "classified material stays inside")
    assert "launch codes" not in json.dumps(r.model_dump(mode="json"))
    meta = r.meta["envelope/decision"]
    assert meta["code"] == "guardrail_blocked" and meta["check"] == "guardrails"
    assert meta["rule"] == "classified"
    rec = _records(pp, "echo")[-1]
    assert rec["decision_id"] == meta["decision_id"]
    assert (rec["verdict"], rec["code"], rec["rule"]) == ("deny", "guardrail_blocked", "classified")
    assert rec["extra"]["guardrails"] == [
        {"id": "classified", "detector": "pattern", "action": "block", "matches": 2}]  # text + structured
    text = pp.metrics()
    assert metric_value(text, "envelope_guardrail_actions_total", tool="echo", action="block") == before + 1
    assert metric_value(text, "envelope_decisions_total", tool="echo", code="guardrail_blocked") >= 1


async def test_warn_rule_changes_nothing_but_is_audited(pp: ProxyProcess) -> None:
    before = metric_value(pp.metrics(), "envelope_guardrail_actions_total", tool="echo", action="warn")
    text = "for internal only distribution"
    async with mcp_client(pp.url("notes"), "auto", bearer=ALICE) as c:
        r = await c.call_tool("echo", {"text": text})
    assert r.is_error is False
    assert r.content[0].text == text
    assert r.structured_content == {"result": text}
    rec = _records(pp, "echo")[-1]
    assert rec["code"] == "ok"
    assert rec["extra"]["guardrails"] == [
        {"id": "internal-note", "detector": "pattern", "action": "warn", "matches": 2}]
    assert metric_value(pp.metrics(), "envelope_guardrail_actions_total",
                        tool="echo", action="warn") == before + 1


async def test_clean_results_pass_untouched(pp: ProxyProcess) -> None:
    async with mcp_client(pp.url("notes"), "auto", bearer=ALICE) as c:
        r = await c.call_tool("echo", {"text": "hello"})
    assert r.content[0].text == "hello" and r.is_error is False
    assert "guardrails" not in _records(pp, "echo")[-1].get("extra", {})


async def test_aggregated_endpoint_redacts_and_blocks(tmp_path: Any) -> None:
    policies = write_policy(tmp_path / "policies", {"notes": {}}, tools=TOOLS, defaults=DEFAULTS,
                            principals={})
    config = {"aggregate": {"enabled": True}, "health_interval": 0}
    with upstream_server("json") as up, proxy_process(tmp_path, {"notes": up.url}, policies=policies,
                                                      config=config) as proxy:
        async with mcp_client(f"{proxy.base}/mcp", "legacy", bearer=ALICE) as c:
            r = await c.call_tool("notes.echo", {"text": PLANTED})
            assert r.is_error is False and r.content[0].text == REDACTED
            assert r.structured_content == {"result": REDACTED}
            b = await c.call_tool("notes.echo", {"text": "top secret"})
        assert b.is_error is True and b.meta["envelope/decision"]["code"] == "guardrail_blocked"
        codes = [rec["code"] for rec in proxy.audit_records() if rec.get("tool") == "echo"]
        assert codes[-2:] == ["ok", "guardrail_blocked"]


@pytest.mark.parametrize("hidden", [
    "AKIA\u200bIOSFODNN7EXAMPLE",  # a zero-width space inside the key
    "AKIA\u202eIOSFODNN7\u202cEXAMPLE",  # bidi controls
    "".join(chr(ord(c) + 0xFEE0) for c in AWS_KEY),  # fullwidth forms
    "\x00".join(AWS_KEY),  # a NUL between every two characters (all ASCII: no Unicode at all)
    "AKIA\x7fIOSFO\x1bDNN7\x08EXAMPLE",  # DEL, escape, backspace
    "AKIA\x90IOSFODNN7\x9fEXAMPLE",  # C1 controls
])
async def test_a_key_behind_invisible_or_fullwidth_characters_is_redacted(pp: ProxyProcess, hidden: str) -> None:
    async with mcp_client(pp.url("notes"), "auto", bearer=ALICE) as c:
        r = await c.call_tool("echo", {"text": f"key {hidden}"})
    assert r.is_error is False
    assert r.content[0].text == "key [REDACTED:aws_access_key_id]"
    assert r.structured_content == {"result": "key [REDACTED:aws_access_key_id]"}
    assert _records(pp, "echo")[-1]["extra"]["guardrails"] == [
        {"id": "aws_access_key_id", "detector": "aws_access_key_id", "action": "redact", "matches": 2}]
