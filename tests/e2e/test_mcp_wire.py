"""MCP on the wire through the real proxy: every upstream mode x every SDK client mode.

One proxy serves three copies of the fixture's notes upstream: `notes` (SSE answers), `notes_json`
(plain JSON answers) and `notes_stateless` (2026-07-28, no sessions). Clients are the official SDK
in `auto` (stateless revision) and `legacy` (sessions) mode. Asserted is what users see: tool
lists, results, refusals with their `_meta` decision, and the audit record of every call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from e2e_helpers import upstream_server, write_policy
from mcp import MCPError

from tests.harness import ProxyProcess, mcp_client, proxy_process, token

UPSTREAM_MODES = ("sse", "json", "stateless")
CLIENT_MODES = ("auto", "legacy")
NAMES = {"sse": "notes", "json": "notes_json", "stateless": "notes_stateless"}

OPS = token("ops", tenant="acme")
READER = token("reader")
MALLORY = token("mallory", groups=["readers"])


class World:
    def __init__(self, proxy: ProxyProcess, direct: dict[str, str]):
        self.proxy = proxy
        self.direct = direct  # upstream mode -> the SDK server's own URL


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("wire")
    with (
        upstream_server("sse") as sse,
        upstream_server("json") as js,
        upstream_server("stateless") as st,
    ):
        ups = {"sse": sse, "json": js, "stateless": st}
        policies = write_policy(tmp / "policies", {NAMES[m]: {} for m in UPSTREAM_MODES})
        # Approvals off: delete_note (destructive) stays refused as misconfigured here; the gate
        # itself is tested in test_approvals.py.
        with proxy_process(tmp, {NAMES[m]: ups[m].url for m in UPSTREAM_MODES}, policies=policies,
                           config={"approvals": {"enabled": False}}) as pp:
            yield World(pp, {m: ups[m].url for m in UPSTREAM_MODES})


COMBOS = [
    pytest.param(u, c, id=f"{u}-upstream-{c}-client")
    for u in UPSTREAM_MODES for c in CLIENT_MODES
]


def new_records(proxy: ProxyProcess, before: int) -> list[dict[str, Any]]:
    return proxy.audit_records()[before:]


def the_record(proxy: ProxyProcess, decision_id: str) -> dict[str, Any]:
    found = [r for r in proxy.audit_records() if r["decision_id"] == decision_id]
    assert len(found) == 1, f"expected one audit record for {decision_id}, got {found}"
    return found[0]


def assert_refused(result: Any, code: str, *, check: str, rule: str | None = None,
                   reason: str | None = None, proxy: ProxyProcess) -> dict[str, Any]:
    """A policy refusal as the model and the client see it, and its audit record."""
    assert result.is_error is True
    text = result.content[0].text
    assert text.startswith(f"Blocked by policy ({code}): "), text
    meta = (result.meta or {})["envelope/decision"]
    assert {"code", "check", "rule", "reason", "decision_id"} <= set(meta), meta
    assert meta["code"] == code
    assert meta["check"] == check
    if rule is not None:
        assert meta["rule"] == rule
    if reason is not None:
        assert meta["reason"] == reason
    assert text == f"Blocked by policy ({code}): {meta['reason']}"
    rec = the_record(proxy, meta["decision_id"])
    assert rec["code"] == code
    assert rec["verdict"] == "deny"
    assert rec["check"] == check
    assert rec["rule"] == meta["rule"]
    assert rec["reason"] == meta["reason"]
    assert rec["upstream_status"] is None
    assert "args" not in rec and rec["args_digest"].startswith("sha256:")
    return meta


async def call_both(world: World, umode: str, cmode: str, tool: str, args: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The same call through the proxy (as ops) and directly; plus the proxy's audit record."""
    pp = world.proxy
    before = len(pp.audit_records())
    async with mcp_client(pp.url(NAMES[umode]), cmode, bearer=OPS) as c:
        via = await c.call_tool(tool, args)
    recs = new_records(pp, before)
    assert len(recs) == 1, recs
    async with mcp_client(world.direct[umode], cmode) as c:
        direct = await c.call_tool(tool, args)
    return via, direct, recs[0]


def assert_allowed_record(rec: dict[str, Any], umode: str, tool: str) -> None:
    assert rec["verdict"] == "allow"
    assert rec["code"] == "ok"
    assert rec["upstream_status"] == 200
    assert rec["principal"] == "ops"
    assert rec["upstream"] == NAMES[umode]
    assert rec["tool"] == tool
    assert rec["extra"]["is_error"] is False


def test_legacy_client_talks_to_stateless_server_directly(world: World) -> None:
    """Precondition of the legacy x stateless combination: the SDK can do it without a proxy."""
    import anyio

    async def go() -> list[str]:
        async with mcp_client(world.direct["stateless"], "legacy") as c:
            return [t.name for t in (await c.list_tools()).tools]

    assert "echo" in anyio.run(go)


@pytest.mark.parametrize(("umode", "cmode"), COMBOS)
async def test_tools_list_filtered_per_principal(world: World, umode: str, cmode: str) -> None:
    url = world.proxy.url(NAMES[umode])
    async with mcp_client(world.direct[umode], cmode) as c:
        direct = {t.name: t for t in (await c.list_tools()).tools}
    assert set(direct) == {"search_notes", "echo", "write_note", "delete_note"}
    async with mcp_client(url, cmode, bearer=OPS) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
    # Every tool with a policy is listed, delete_note too: a gated tool is listed whether its
    # approval gate is there or not (a misconfigured tool is listed and refused with its reason).
    assert set(tools) == {"search_notes", "echo", "write_note", "delete_note"}
    for name, tool in tools.items():  # visible tools are relayed as the upstream described them
        assert tool.input_schema == direct[name].input_schema
        assert tool.description == direct[name].description
    async with mcp_client(url, cmode, bearer=READER) as c:
        reader = {t.name for t in (await c.list_tools()).tools}
    assert reader == {"search_notes", "echo"}


@pytest.mark.parametrize(("umode", "cmode"), COMBOS)
async def test_allowed_calls_match_direct_calls(world: World, umode: str, cmode: str) -> None:
    pp = world.proxy
    via, direct, rec = await call_both(world, umode, cmode, "search_notes", {"query": "welcome", "limit": 5})
    assert via.is_error is False
    assert via.content == direct.content
    assert via.structured_content == direct.structured_content
    assert via.structured_content["result"][0]["title"] == "welcome"
    assert_allowed_record(rec, umode, "search_notes")
    assert "args" not in rec

    via, direct, rec = await call_both(world, umode, cmode, "echo", {"text": f"hello {umode} {cmode} ü"})
    assert via.content == direct.content
    assert via.structured_content == direct.structured_content == {"result": f"hello {umode} {cmode} ü"}
    assert_allowed_record(rec, umode, "echo")
    assert rec["args"] == {"text": f"hello {umode} {cmode} ü"}  # log_args: true

    title = f"note-{umode}-{cmode}"
    args = {"title": title, "body": "b", "folder": "drafts"}
    via, direct, rec = await call_both(world, umode, cmode, "write_note", args)
    assert via.is_error is False
    assert via.content == direct.content  # replacing the same note: identical answers
    assert via.structured_content == direct.structured_content
    assert via.structured_content["saved"] == title
    assert_allowed_record(rec, umode, "write_note")
    assert "args" not in rec and rec["args_digest"].startswith("sha256:")
    # Every record written by this test verifies as part of the whole chain.
    assert all("hash" in r and "prev" in r for r in pp.audit_records())


@pytest.mark.parametrize(("umode", "cmode"), COMBOS)
async def test_refusals(world: World, umode: str, cmode: str) -> None:
    pp = world.proxy
    name = NAMES[umode]
    url = pp.url(name)
    before = len(pp.audit_records())
    async with mcp_client(url, cmode, bearer=OPS) as c:
        # Unknown tool: a JSON-RPC error, as for any tool the server does not have.
        with pytest.raises(MCPError) as err:
            await c.call_tool("no_such_tool", {})
        assert err.value.code == -32602
        assert "Unknown tool" in str(err.value)
        data = err.value.error.data["envelope/decision"]
        assert data["code"] == "unknown_tool"
        rec = the_record(pp, data["decision_id"])
        assert (rec["code"], rec["verdict"], rec["tool"]) == ("unknown_tool", "deny", "no_such_tool")

        r = await c.call_tool("search_notes", {"query": "x", "limit": 500})
        meta = assert_refused(r, "schema_invalid", check="schema", proxy=pp)
        assert "/limit" in r.content[0].text
        assert meta["rule"] == f"tools.{name}.search_notes.schema"

        r = await c.call_tool("write_note", {"title": "t", "body": "b", "folder": "secret-drafts"})
        assert_refused(r, "capability_blocked", check="arg_rules", rule="no-secret-folder",
                       reason="secret folders are off limits", proxy=pp)

        r = await c.call_tool("write_note", {"title": "t", "body": "b", "folder": "trash"})
        assert_refused(r, "capability_blocked", check="arg_rules", rule=f"{name}.write_note#fallback",
                       reason="notes go to inbox or drafts", proxy=pp)

        r = await c.call_tool("delete_note", {"title": "welcome"})
        meta = assert_refused(r, "misconfigured", check="catalogue", proxy=pp)
        assert "approval" in meta["reason"]

    async with mcp_client(url, cmode, bearer=READER) as c:
        r = await c.call_tool("write_note", {"title": "t", "body": "b", "folder": "inbox"})
        assert_refused(r, "capability_blocked", check="capability", proxy=pp)

    async with mcp_client(url, cmode, bearer=MALLORY) as c:
        r = await c.call_tool("write_note", {"title": "t", "body": "b", "folder": "inbox"})
        meta = assert_refused(r, "unauthorized", check="authz", proxy=pp)

    # Seven calls, seven records, none forwarded.
    recs = new_records(pp, before)
    assert len(recs) == 7
    assert [r["principal"] for r in recs] == ["ops"] * 5 + ["reader", "mallory"]
    # The welcome note was not deleted.
    async with mcp_client(world.direct[umode], cmode) as c:
        hits = await c.call_tool("search_notes", {"query": "welcome"})
    assert hits.structured_content["result"]
