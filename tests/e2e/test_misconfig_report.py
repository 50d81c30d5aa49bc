"""Misconfiguration report end to end: one shape in the log, /v1/misconfigurations, the gauge,
the refusal and `envelope-proxy check`, on a real proxy process with a crafted policy.

A real process always has a state store, so the store-dependent envelope kinds (no idempotency
store, no shadow recorder) are covered by tests/unit/envelope/test_misconfig.py; here the
envelope layer shows through `approvals.enabled: false`. A tool on an undeclared upstream is a
load error (file:line:column) before it can be a misconfiguration, so that kind is unit-tested.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import cli

from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, token

OPS = token("ops")
GAUGE = "envelope_misconfigured_tools"

POLICY: dict[str, Any] = {
    "version": 1,
    "upstreams": {"notes": {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}},
    "defaults": {"unknown_tools": "deny"},
    "tools": {
        "notes.echo": {"effect": "read"},
        # registry: fallback deny and no allow rule.
        "notes.search_notes": {"effect": "read", "fallback": "deny"},
        # envelope: gated, and the runtime config disables approvals.
        "notes.delete_note": {"effect": "destructive"},
        # registry: the upstream does not offer it (known once its tools/list is learned).
        "notes.vanished": {"effect": "read"},
        # notes.write_note has no policy: registry, hidden and refused as unknown_tool.
    },
}

BEFORE_LIST = {
    ("notes.delete_note", "envelope", "no_approval_gate"),
    ("notes.search_notes", "registry", "fallback_deny"),
}
AFTER_LIST = BEFORE_LIST | {
    ("notes.vanished", "registry", "not_offered"),
    ("notes.write_note", "registry", "unknown_tool"),
}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("misconfig") / "policies"
    directory.mkdir()
    (directory / "policy.yaml").write_text(json.dumps(POLICY, indent=2))
    return directory


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any,
          policy_dir: Path) -> Iterator[ProxyProcess]:
    with proxy_process(tmp_path_factory.mktemp("misconfig-proxy"), {"notes": sse_upstream.url},
                       policies=policy_dir, config={"approvals": {"enabled": False}}) as pp:
        yield pp


def report(pp: ProxyProcess) -> list[dict[str, Any]]:
    resp = httpx.get(f"{pp.admin}/v1/misconfigurations", timeout=5)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    data = resp.json()
    assert isinstance(data, list)
    return data


def policy_misconfigured(pp: ProxyProcess) -> list[dict[str, Any]]:
    return pp.admin_get("/v1/policy").json()["misconfigured"]


def kinds(items: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(p["tool"], p["layer"], p["kind"]) for p in items}


def warnings(pp: ProxyProcess) -> list[str]:
    return [line for line in pp.log().splitlines() if "misconfigured tool " in line]


async def test_report_log_gauge_listing_and_refusals(proxy: ProxyProcess) -> None:
    from mcp import MCPError

    # At load: what the policy alone shows, one warning line each.
    assert kinds(report(proxy)) == BEFORE_LIST
    assert len(warnings(proxy)) == len(BEFORE_LIST)
    assert all(" WARNING " in line for line in warnings(proxy))
    metrics = proxy.metrics()
    assert metric_value(metrics, GAUGE, layer="registry") == 1
    assert metric_value(metrics, GAUGE, layer="envelope") == 1

    async with mcp_client(proxy.url("notes"), "auto", bearer=OPS) as c:
        listed = {t.name for t in (await c.list_tools()).tools}
        # Misconfigured tools stay advertised; only the tool with no policy is hidden.
        assert listed == {"echo", "search_notes", "delete_note"}

        items = report(proxy)
        assert kinds(items) == AFTER_LIST
        reasons = {p["tool"]: p["reason"] for p in items}
        for name in ("delete_note", "search_notes"):
            r = await c.call_tool(name, {"title": "welcome"} if name == "delete_note" else {"query": "x"})
            assert r.is_error is True
            decision = r.meta["envelope/decision"]
            assert (decision["code"], decision["check"]) == ("misconfigured", "catalogue")
            assert decision["reason"] == reasons[f"notes.{name}"]
            assert r.content[0].text == f"Blocked by policy (misconfigured): {reasons[f'notes.{name}']}"
        assert "approvals are disabled" in reasons["notes.delete_note"]
        assert "fallback deny and no allow rule" in reasons["notes.search_notes"]

        with pytest.raises(MCPError) as err:  # reported, but hidden and refused as unknown_tool
            await c.call_tool("write_note", {"title": "t", "body": "b"})
        assert err.value.code == -32602
        assert err.value.error.data["envelope/decision"]["code"] == "unknown_tool"

        assert (await c.call_tool("echo", {"text": "hi"})).is_error is False
        await c.list_tools()  # a second tools/list reveals nothing new: no new lines

    metrics = proxy.metrics()
    assert metric_value(metrics, GAUGE, layer="registry") == 3
    assert metric_value(metrics, GAUGE, layer="envelope") == 1
    lines = warnings(proxy)
    assert len(lines) == len(AFTER_LIST)  # once each, not once per tools/list
    for tool, layer, kind in AFTER_LIST:
        assert sum(f"misconfigured tool {tool} [{layer}, {kind}]" in line for line in lines) == 1
    # /v1/policy carries the same objects.
    assert policy_misconfigured(proxy) == report(proxy)


def test_check_prints_what_the_policy_alone_shows(policy_dir: Path) -> None:
    out = cli("check", str(policy_dir))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"ok: {policy_dir}: ")
    assert "assuming the default runtime (sqlite store, approvals enabled)" in lines[1]
    assert "tools/list not known without a running proxy" in lines[1]
    assert lines[1].startswith("1 misconfiguration ")
    assert lines[2:] == ["  notes.search_notes [registry] fallback_deny: tool 'notes.search_notes' "
                         "has fallback deny and no allow rule, so no call can ever run"]
    # With the default runtime delete_note has its approval gate: not reported.
    assert "delete_note" not in out.stdout
    strict = cli("check", "--strict", str(policy_dir))
    assert strict.returncode == 1 and strict.stdout == out.stdout
