"""Fail closed through the wire: an audit log that cannot be written refuses every call before
it reaches the upstream, /readyz says why, and the process keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import upstream_server  # noqa: F401  (puts the repo root on sys.path)

from tests.harness import mcp_client, metric_value, proxy_process, rpc, token


async def _titles(url: str) -> list[str]:
    """Every note title, asked of the upstream directly (not through the proxy)."""
    async with mcp_client(url, mode="legacy") as client:
        result = await client.call_tool("search_notes", {"query": ""})
    return [note["title"] for note in result.structured_content["result"]]


def test_unwritable_audit_log_refuses_calls_and_fails_readiness(tmp_path: Path, sse_upstream: Any) -> None:
    audit_dir = tmp_path / "state" / "audit"
    audit_dir.mkdir(parents=True)
    (audit_dir / "audit.jsonl").symlink_to("/dev/full")  # a disk that is always full
    with proxy_process(tmp_path, {"notes": sse_upstream.url}) as proxy:
        ready = httpx.get(f"{proxy.admin}/readyz", timeout=5)
        assert ready.status_code == 503
        assert "audit log not writable" in ready.json()["reasons"][0]
        # Its head is unknown: no head is served as if it were current.
        head = proxy.admin_get("/v1/audit/head")
        assert head.status_code == 503 and "its head is unknown" in head.json()["error"]
        assert "hash" not in head.json()

        ops = token("ops", ["writers"], tenant="acme")
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "write_note", "arguments": {"title": "never-written-7f3a", "body": "b", "folder": "inbox"}}}
        resp = rpc(proxy.url("notes"), body, bearer=ops)
        assert resp.status_code == 200
        result = resp.json()["result"]
        assert result["isError"] is True
        assert result["content"][0]["text"].startswith("Blocked by policy (audit_unavailable): ")
        # Never performed, and the reason does not say a result was withheld (there was none).
        assert "withheld" not in result["content"][0]["text"], result
        assert "refused" in result["content"][0]["text"], result
        assert result["_meta"]["envelope/decision"]["code"] == "audit_unavailable"

        # The write never happened: the note is not there when searched directly upstream.
        titles = asyncio.run(_titles(sse_upstream.url))
        assert "welcome" in titles and "never-written-7f3a" not in titles

        metrics = proxy.metrics()
        assert metric_value(metrics, "envelope_audit_write_failures_total") >= 1
        assert metric_value(metrics, "envelope_audit_records_total") == 0
        assert proxy.proc.poll() is None  # still serving


def test_audit_file_deleted_under_the_process_gets_the_next_records(tmp_path: Path, sse_upstream: Any) -> None:
    """`rm audit.jsonl` (or logrotate without copytruncate) under the running proxy: the calls
    that follow reach the upstream, so their records must land where people read them (a new
    audit.jsonl continuing the chain), never in the removed file's inode."""
    async def write(url: str, bearer: str, title: str) -> Any:
        async with mcp_client(url, mode="legacy", bearer=bearer) as client:
            return await client.call_tool("write_note", {"title": title, "body": "b", "folder": "inbox"})

    with proxy_process(tmp_path, {"notes": sse_upstream.url}) as proxy:
        ops = token("ops", ["writers"], tenant="acme")
        assert not asyncio.run(write(proxy.url("notes"), ops, "before-rm-5c1d")).is_error
        (proxy.audit_dir / "audit.jsonl").unlink()
        after = asyncio.run(write(proxy.url("notes"), ops, "after-rm-5c1d"))
        assert not after.is_error, after.content
        assert "after-rm-5c1d" in asyncio.run(_titles(sse_upstream.url))  # it was performed
        [rec] = [r for r in proxy.audit_records() if r["tool"] == "write_note"]
        assert (rec["verdict"], rec["code"], rec["upstream_status"]) == ("allow", "ok", 200)
        assert "removed or replaced under the running process" in proxy.log()
