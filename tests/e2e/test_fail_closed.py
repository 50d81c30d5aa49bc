"""Fail closed through the wire: an audit log that cannot be written refuses every call before
it reaches the upstream, /readyz says why, and the process keeps serving; a log file removed
under the process gets the next records; a store past its timeout refuses with a reply."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import upstream_server, write_policy  # noqa: F401  (puts the repo root on sys.path)
from fake_upstream import fake_upstream

from tests.harness import mcp_client, metric_value, proxy_process, rpc, token


async def _titles(url: str) -> list[str]:
    """Every note title, asked of the upstream directly (not through the proxy)."""
    async with mcp_client(url, mode="legacy") as client:
        result = await client.call_tool("search_notes", {"query": ""})
    return [note["title"] for note in result.structured_content["result"]]


def _readiness_becomes(proxy: Any, status: int) -> httpx.Response:
    """/readyz once it answers `status` (polled for up to ~10 s); fails if it never does."""
    for _ in range(100):
        ready = httpx.get(f"{proxy.admin}/readyz", timeout=5)
        if ready.status_code == status:
            return ready
        time.sleep(0.1)
    assert ready.status_code == status, ready.text
    return ready


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


def test_a_write_lock_held_past_the_store_timeout_refuses_with_a_reply_and_a_record(tmp_path: Path) -> None:
    """Another process holds the SQLite store's write lock longer than `store.timeout` (a
    stuck worker, an operator's sqlite3 shell). A read whose untrusted result the ledger must
    record reaches the upstream, then meets the store's deadline in its completion: the client
    gets the refusal (`store_unavailable`, the result withheld) and the call its one audit
    record, never a dropped connection; once the lock goes, calls pass again."""
    with fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools={"notes.fetch": {"effect": "read"}},
                                principals={}, dataflow={"mode": "enforce"})
        db = tmp_path / "state.db"
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies,
                           identity={"mode": "static", "principal": "agent"},
                           config={"store": {"kind": "sqlite", "path": str(db), "timeout": 1.0}}) as proxy:
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "fetch", "arguments": {}}}
            warm = rpc(proxy.url("counted"), body, headers={"X-Envelope-Run": "run-warm"})
            assert warm.json()["result"]["isError"] is False, warm.text
            holder = sqlite3.connect(db, timeout=0.1)
            holder.execute("BEGIN IMMEDIATE")
            try:
                resp = rpc(proxy.url("counted"), body, headers={"X-Envelope-Run": "run-locked"}, timeout=30)
            finally:
                holder.rollback()
                holder.close()
            result = resp.json()["result"]
            decision = result["_meta"]["envelope/decision"]
            assert result["isError"] is True and decision["code"] == "store_unavailable", result
            assert "withheld" in decision["reason"], decision
            assert fake.calls["fetch"] == 2  # it was performed; its result is what is withheld
            [rec] = [r for r in proxy.audit_records() if r["decision_id"] == decision["decision_id"]]
            assert (rec["verdict"], rec["code"], rec["upstream_status"]) == ("error", "store_unavailable", 200)
            again = rpc(proxy.url("counted"), body, headers={"X-Envelope-Run": "run-after"})
            assert again.json()["result"]["isError"] is False, again.text


def test_a_state_db_removed_under_the_process_fails_readiness(tmp_path: Path) -> None:
    """`rm state.db*` under the running proxy: the process goes on with the state it holds open
    (calls keep working), but that state is gone at the next start and any other process opening
    the path starts empty, so /readyz says so instead of staying silent."""
    with fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools={"notes.fetch": {"effect": "read"}},
                                principals={})
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies,
                           identity={"mode": "static", "principal": "agent"}) as proxy:
            assert httpx.get(f"{proxy.admin}/readyz", timeout=5).status_code == 200
            for path in proxy.state_dir.glob("state.db*"):
                path.unlink()
            ready = _readiness_becomes(proxy, 503)
            assert "removed or replaced under the running process" in " ".join(ready.json()["reasons"])
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "fetch", "arguments": {}}}
            served = rpc(proxy.url("counted"), body, headers={"X-Envelope-Run": "run-after-rm"})
            assert served.json()["result"]["isError"] is False, served.text


def test_a_state_db_that_cannot_be_written_fails_readiness(tmp_path: Path) -> None:
    """Another process holds the SQLite store's write lock past `store.timeout`: reads still
    answer (WAL), but every gated, keyed, limited or recorded call is refused, so /readyz must
    say the store cannot answer (readiness is a write, as for Redis). Once the lock goes, the
    proxy is ready again."""
    with fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools={"notes.fetch": {"effect": "read"}},
                                principals={})
        db = tmp_path / "state.db"
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies,
                           identity={"mode": "static", "principal": "agent"},
                           config={"store": {"kind": "sqlite", "path": str(db), "timeout": 0.5}}) as proxy:
            assert httpx.get(f"{proxy.admin}/readyz", timeout=5).status_code == 200
            holder = sqlite3.connect(db, timeout=0.1)
            holder.execute("BEGIN IMMEDIATE")
            try:
                ready = _readiness_becomes(proxy, 503)
                reasons = " ".join(ready.json()["reasons"])
                assert "database is locked" in reasons, reasons
            finally:
                holder.rollback()
                holder.close()
            ready = _readiness_becomes(proxy, 200)
            assert "state store (sqlite) unavailable" in proxy.log()
