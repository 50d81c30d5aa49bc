"""Shadow runs through the real proxy process, the SDK client and the demo notes server.

Writer calls of a shadow run are recorded (GET /v1/shadow, `envelope-proxy shadow`), not
performed: the note never reaches the server, while read calls are still forwarded. The run
stays shadow without the header; a principal with `mode: shadow` is always shadow.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import cli, fixture_policy, write_policy

from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, token

OPS = token("ops", tenant="acme")
TRAINEE = token("trainee", groups=["writers"])
DEFAULT_TEXT = "Shadow run: this call was recorded, not performed."
# Shadow records hold arguments: /v1/shadow needs an approver token.
APPROVER_TOKEN = "shadow-reviewer-token"
APPROVER = {"Authorization": f"Bearer {APPROVER_TOKEN}"}


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("shadow")
    principals = {**fixture_policy()["principals"], "trainee": {"mode": "shadow"}}
    policies = write_policy(tmp / "policies", {"notes": {}}, principals=principals)
    with proxy_process(tmp, {"notes": sse_upstream.url}, policies=policies,
                       config={"store": {"kind": "memory"}, "approvals": {"approvers": {
                           "reviewer": {"token_sha256": hashlib.sha256(APPROVER_TOKEN.encode()).hexdigest()},
                       }}}) as proxy:
        yield proxy


def shadow_records(pp: ProxyProcess, run: str) -> list[dict[str, Any]]:
    assert httpx.get(f"{pp.admin}/v1/shadow", params={"run": run}, timeout=5).status_code == 401
    resp = httpx.get(f"{pp.admin}/v1/shadow", params={"run": run}, headers=APPROVER, timeout=5)
    assert resp.status_code == 200, resp.text
    records: list[dict[str, Any]] = resp.json()["records"]
    return records


async def found(pp: ProxyProcess, title: str) -> bool:
    async with mcp_client(pp.url("notes"), "auto", bearer=OPS) as c:
        hits = await c.call_tool("search_notes", {"query": title})
    return title in json.dumps(hits.structured_content)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_shadow_run_records_writes_and_forwards_reads(pp: ProxyProcess, mode: str) -> None:
    run = f"shadow-run-{mode}"
    title = f"shadowed-{mode}"
    args = {"title": title, "body": "not for real", "folder": "inbox"}
    headers = {"X-Envelope-Shadow": "1", "X-Envelope-Run": run}
    async with mcp_client(pp.url("notes"), mode, bearer=OPS, headers=headers) as c:
        write = await c.call_tool("write_note", args)
        read = await c.call_tool("echo", {"text": "still forwarded"})
    assert write.is_error is True  # so the SDK does not validate it against the outputSchema
    assert write.content[0].text == DEFAULT_TEXT
    meta = write.meta or {}
    assert meta["envelope/shadow"] is True
    assert (meta["envelope/decision"]["code"], meta["envelope/decision"]["check"]) == ("shadowed", "shadow")
    assert read.content[0].text == "still forwarded"  # the upstream answered
    assert not await found(pp, title)  # the note was never written

    # Later calls of the run without the header stay shadow.
    async with mcp_client(pp.url("notes"), mode, bearer=OPS, headers={"X-Envelope-Run": run}) as c:
        later = await c.call_tool("write_note", {**args, "body": "second try"})
    assert (later.meta or {})["envelope/shadow"] is True
    assert (later.meta or {})["envelope/decision"]["rule"] == "run"
    assert not await found(pp, title)

    records = shadow_records(pp, run)
    assert [r["arguments"]["body"] for r in records] == ["not for real", "second try"]
    first = records[0]
    assert first["arguments"] == args
    assert (first["principal"], first["upstream"], first["tool"], first["run"]) == ("ops", "notes", "write_note", run)
    assert first["decision_id"] == meta["envelope/decision"]["decision_id"]
    assert first["would_need_approval"] is False and first["time"].endswith("Z")

    [rec] = [r for r in pp.audit_records() if r["decision_id"] == first["decision_id"]]
    assert (rec["verdict"], rec["code"], rec["check"], rec["upstream_status"]) == ("allow", "shadowed", "shadow", None)
    assert rec["extra"]["shadow"] is True and rec["extra"]["shadow_record"] == first["id"]
    assert metric_value(pp.metrics(), "envelope_shadow_records_total") >= 2

    # A run without the header is live.
    async with mcp_client(pp.url("notes"), mode, bearer=OPS, headers={"X-Envelope-Run": f"live-{mode}"}) as c:
        live = await c.call_tool("write_note", args)
    assert "envelope/shadow" not in (live.meta or {})
    assert await found(pp, title)


async def test_principal_mode_shadow(pp: ProxyProcess) -> None:
    args = {"title": "trainee-note", "body": "practice", "folder": "drafts"}
    async with mcp_client(pp.url("notes"), "auto", bearer=TRAINEE, headers={"X-Envelope-Run": "trainee-1"}) as c:
        write = await c.call_tool("write_note", args)
        read = await c.call_tool("echo", {"text": "reads go through"})
    assert write.content[0].text == DEFAULT_TEXT
    assert (write.meta or {})["envelope/decision"]["rule"] == "principals.trainee.mode"
    assert read.content[0].text == "reads go through"
    assert not await found(pp, "trainee-note")
    [record] = shadow_records(pp, "trainee-1")
    assert record["principal"] == "trainee" and record["arguments"] == args


async def test_cli_lists_and_exports(pp: ProxyProcess) -> None:
    headers = {"X-Envelope-Shadow": "1", "X-Envelope-Run": "cli-run"}
    async with mcp_client(pp.url("notes"), "auto", bearer=OPS, headers=headers) as c:
        await c.call_tool("write_note", {"title": "cli-1", "body": "x", "folder": "inbox"})
    out = cli("shadow", "export", "--admin", pp.admin, "--run", "cli-run",
              "--token", APPROVER_TOKEN)
    assert out.returncode == 0, out.stderr
    [line] = out.stdout.splitlines()
    assert json.loads(line)["arguments"]["title"] == "cli-1"
    listed = cli("shadow", "list", "--admin", pp.admin, "--run", "cli-run",
                 env={**os.environ, "ENVELOPE_APPROVER_TOKEN": APPROVER_TOKEN})
    assert listed.returncode == 0, listed.stderr
    assert "notes.write_note" in listed.stdout and "run=cli-run" in listed.stdout
    down = cli("shadow", "list", "--admin", "http://127.0.0.1:1")
    assert down.returncode == 1
