"""Capability narrowing, Rule-of-Two profiles, delegation depth and roster through the wire: the
real proxy process, the official SDK client and the demo notes server.

- `X-Envelope-Capability: read-only` narrows a read-write principal; it never widens a
  read-only one;
- a Rule-of-Two profile denying external side effects forces read-only (writers refused and
  hidden); one denying sensitive data refuses a tool whose output is secret;
- session -> child -> grandchild run; the great-grandchild is refused `depth_exceeded`, from the
  proxy's own lineage records (the client never sends a depth);
- a child agent not on the holder's roster is refused `not_on_roster`;
- a principal limited to `3/min` gets three calls through and the fourth refused
  `rate_limited` with the time to wait (reply, audit record, metric); another is unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import cli, fixture_policy, write_policy

from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, token

OPS = token("ops", tenant="acme")
READER = token("reader")
NOEXT = token("noext", groups=["writers"])
NOSECRET = token("nosecret")
BOSS = token("boss", groups=["writers"])
LIMITED = token("limited")

NOTE = {"title": "t", "body": "b", "folder": "inbox"}


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("delegation")
    base = fixture_policy()
    tools = {**base["tools"]}
    tools["notes.search_notes"] = {**tools["notes.search_notes"], "sensitivity": "secret"}
    principals = {
        **base["principals"],
        "noext": {"capability": "read-write", "rule_of_two": {"external_side_effects": False}},
        "nosecret": {"rule_of_two": {"sensitive_data": False}},
        "boss": {"roster": ["researcher", "summarizer"]},
        "limited": {"rate": "3/min"},
    }
    policies = write_policy(tmp / "policies", {"notes": {}}, tools=tools, principals=principals)
    with proxy_process(tmp, {"notes": sse_upstream.url}, policies=policies) as proxy:
        yield proxy


def decision(result: Any) -> dict[str, Any]:
    return dict((result.meta or {}).get("envelope/decision") or {})


# ---- capability narrowing by header -----------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_header_narrows_read_write_to_read_only(pp: ProxyProcess, mode: str) -> None:
    async with mcp_client(pp.url("notes"), mode, bearer=OPS) as c:
        assert (await c.call_tool("write_note", NOTE)).is_error is False
    async with mcp_client(pp.url("notes"), mode, bearer=OPS,
                          headers={"X-Envelope-Capability": "read-only"}) as c:
        refused = await c.call_tool("write_note", NOTE)
        read = await c.call_tool("echo", {"text": "reads still work"})
    assert refused.is_error is True
    d = decision(refused)
    assert (d["code"], d["check"], d["rule"]) == (
        "capability_blocked", "capability", "request:X-Envelope-Capability")
    assert read.content[0].text == "reads still work"


async def test_header_cannot_widen_read_only(pp: ProxyProcess) -> None:
    async with mcp_client(pp.url("notes"), "auto", bearer=READER,
                          headers={"X-Envelope-Capability": "read-write"}) as c:
        names = [t.name for t in (await c.list_tools()).tools]
        refused = await c.call_tool("write_note", NOTE)
    assert "write_note" not in names
    d = decision(refused)
    assert (d["code"], d["rule"]) == ("capability_blocked", "principals.reader.capability")


# ---- Rule of Two ----------------------------------------------------------------------------

async def test_denying_external_side_effects_forces_read_only(pp: ProxyProcess) -> None:
    async with mcp_client(pp.url("notes"), "auto", bearer=NOEXT) as c:
        names = [t.name for t in (await c.list_tools()).tools]
        refused = await c.call_tool("write_note", NOTE)
        read = await c.call_tool("echo", {"text": "ok"})
    assert "write_note" not in names and "echo" in names
    d = decision(refused)
    assert (d["code"], d["rule"]) == ("capability_blocked", "principals.noext.rule_of_two.external_side_effects")
    assert read.is_error is False


async def test_denying_sensitive_data_refuses_secret_output(pp: ProxyProcess) -> None:
    async with mcp_client(pp.url("notes"), "auto", bearer=NOSECRET) as c:
        refused = await c.call_tool("search_notes", {"query": "x"})
        read = await c.call_tool("echo", {"text": "public"})
    d = decision(refused)
    assert (d["code"], d["rule"]) == ("capability_blocked", "principals.nosecret.rule_of_two.sensitive_data")
    assert "secret" in d["reason"]
    assert read.content[0].text == "public"


def test_check_reports_a_profile_holding_all_three(tmp_path: Any) -> None:
    policies = write_policy(tmp_path / "p", {"notes": {}}, principals={
        "lethal": {"rule_of_two": {"untrusted_input": True, "sensitive_data": True,
                                   "external_side_effects": True}},
        "safe": {"rule_of_two": {"external_side_effects": False}},
    })
    ok = cli("check", str(policies))
    assert "warning: principal 'lethal'" in ok.stdout and "'safe'" not in ok.stdout
    strict = cli("check", "--strict", str(policies))
    assert strict.returncode == 1 and "error: principal 'lethal'" in strict.stdout


# ---- delegation -----------------------------------------------------------------------------

async def _echo(pp: ProxyProcess, run: str, parent: str | None = None, agent: str | None = None,
                bearer: str = OPS, mode: str = "auto") -> Any:
    headers = {"X-Envelope-Run": run}
    if parent:
        headers["X-Envelope-Parent-Run"] = parent
    if agent:
        headers["X-Envelope-Agent"] = agent
    async with mcp_client(pp.url("notes"), mode, bearer=bearer, headers=headers) as c:
        return await c.call_tool("echo", {"text": run})


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_depth_bound(pp: ProxyProcess, mode: str) -> None:
    s, c, g, gg = (f"{mode}-{x}" for x in ("session", "child", "grandchild", "great"))
    assert (await _echo(pp, s, mode=mode)).is_error is False
    assert (await _echo(pp, c, s, mode=mode)).is_error is False
    assert (await _echo(pp, g, c, mode=mode)).is_error is False
    refused = await _echo(pp, gg, g, mode=mode)
    assert refused.is_error is True
    d = decision(refused)
    assert (d["code"], d["check"], d["rule"]) == ("depth_exceeded", "delegation", "defaults.max_depth")
    assert "depth 3" in d["reason"] and "bound is 2" in d["reason"]
    # The client cannot talk its way back up: naming a root, or no parent, changes nothing.
    assert decision(await _echo(pp, gg, s, mode=mode))["code"] == "depth_exceeded"
    assert decision(await _echo(pp, gg, mode=mode))["code"] == "depth_exceeded"
    # The audit record carries the lineage.
    rec = [r for r in pp.audit_records() if r.get("run") == g][-1]
    assert (rec["extra"]["run_parent"], rec["extra"]["run_depth"]) == (c, 2)


async def test_unknown_parent_counts_as_a_root(pp: ProxyProcess) -> None:
    assert (await _echo(pp, "orphan-child", "never-seen-root")).is_error is False
    assert (await _echo(pp, "orphan-grandchild", "orphan-child")).is_error is False
    assert decision(await _echo(pp, "orphan-great", "orphan-grandchild"))["code"] == "depth_exceeded"


async def test_roster(pp: ProxyProcess) -> None:
    assert (await _echo(pp, "boss-root", bearer=BOSS)).is_error is False
    ok = await _echo(pp, "boss-child-1", "boss-root", agent="researcher", bearer=BOSS)
    assert ok.is_error is False
    refused = await _echo(pp, "boss-child-2", "boss-root", agent="shell-runner", bearer=BOSS)
    d = decision(refused)
    assert (d["code"], d["check"], d["rule"]) == ("not_on_roster", "delegation", "principals.boss.roster")
    assert "shell-runner" in d["reason"]
    unnamed = await _echo(pp, "boss-child-3", "boss-root", bearer=BOSS)
    assert decision(unnamed)["code"] == "not_on_roster"


def test_an_agent_name_that_is_no_id_is_refused_and_audited(pp: ProxyProcess) -> None:
    # The agent name is compared with the roster and kept in lineage and every audit record of
    # the run: held to the rule of the roster's own names (it was taken at any length).
    before = len(pp.audit_records())
    counted = metric_value(pp.metrics(), "envelope_rejected_requests_total", reason="invalid_header")
    answer = httpx.post(pp.url("notes"), headers={
        "Authorization": f"Bearer {BOSS}", "X-Envelope-Run": "boss-long-agent",
        "X-Envelope-Parent-Run": "boss-root", "X-Envelope-Agent": "r" * 257,
        "Accept": "application/json, text/event-stream", "Content-Type": "application/json"},
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
              "params": {"name": "echo", "arguments": {"text": "hi"}}}, timeout=10)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "header X-Envelope-Agent: not an agent name: it has 257 characters (at most 256)" in message, message
    [rec] = pp.audit_records()[before:]
    assert (rec["code"], rec["check"], rec["extra"]["header"]) == (
        "invalid_request", "guard", "X-Envelope-Agent")
    assert not any(r.get("run") == "boss-long-agent" for r in pp.audit_records())
    assert metric_value(pp.metrics(), "envelope_rejected_requests_total", reason="invalid_header") == counted + 1


async def test_an_agent_name_at_the_bound_reaches_the_roster_check(pp: ProxyProcess) -> None:
    assert (await _echo(pp, "boss-root-2", bearer=BOSS)).is_error is False
    d = decision(await _echo(pp, "boss-child-256", "boss-root-2", agent="r" * 256, bearer=BOSS))
    assert d["code"] == "not_on_roster" and "r" * 256 in d["reason"]


# ---- rate limits ----------------------------------------------------------------------------

async def test_a_principal_limited_to_three_a_minute(pp: ProxyProcess) -> None:
    async with mcp_client(pp.url("notes"), "auto", bearer=LIMITED) as c:
        passed = [await c.call_tool("echo", {"text": f"call {n}"}) for n in range(3)]
        refused = await c.call_tool("echo", {"text": "call 3"})
    async with mcp_client(pp.url("notes"), "auto", bearer=OPS) as c:
        others = [await c.call_tool("echo", {"text": f"ops {n}"}) for n in range(5)]
    assert [r.content[0].text for r in passed] == ["call 0", "call 1", "call 2"]
    assert [r.is_error for r in others] == [False] * 5  # another principal: its own (no) limit
    assert refused.is_error is True
    d = decision(refused)
    assert (d["code"], d["check"], d["rule"]) == ("rate_limited", "rate_limit", "principals.limited.rate")
    # A third of a minute per token, less the time the three calls took.
    assert 15.0 < d["retry_after"] <= 20.0, d
    text = refused.content[0].text
    assert text == (f"Blocked by policy (rate_limited): principal 'limited' is over its rate of 3/min "
                    f"(principals.limited.rate); retry in {d['retry_after']:.1f}s")
    rec = [r for r in pp.audit_records() if r["decision_id"] == d["decision_id"]]
    assert len(rec) == 1 and rec[0]["extra"]["retry_after"] == d["retry_after"]
    assert (rec[0]["principal"], rec[0]["upstream_status"]) == ("limited", None)  # never forwarded
    assert metric_value(pp.metrics(), "envelope_decisions_total", upstream="notes", tool="echo",
                        verdict="deny", code="rate_limited") == 1.0
