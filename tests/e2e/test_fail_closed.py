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
        assert result["_meta"]["envelope/decision"]["code"] == "audit_unavailable"

        # The write never happened: the note is not there when searched directly upstream.
        titles = asyncio.run(_titles(sse_upstream.url))
        assert "welcome" in titles and "never-written-7f3a" not in titles

        metrics = proxy.metrics()
        assert metric_value(metrics, "envelope_audit_write_failures_total") >= 1
        assert metric_value(metrics, "envelope_audit_records_total") == 0
        assert proxy.proc.poll() is None  # still serving
