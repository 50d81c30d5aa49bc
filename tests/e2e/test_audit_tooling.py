"""`envelope-proxy audit query|tail` over the audit log of a real proxy process.

A few calls through the SDK client, then the CLI reads them back: query filters and prints
exactly those records, tail prints the last N, tail -f shows a record made after it started.
The echo policy logs arguments with `mask: [/secret]`: the log holds "***", never the secret.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import CLI, ROOT, cli, fixture_policy, write_policy

from tests.harness import ProxyProcess, mcp_client, proxy_process, token

OPS = token("ops", tenant="acme")
SECRET = "hunter2-do-not-log"
TEXTS = ["one", "two", "three"]


def _call(pp: ProxyProcess, tool: str, args: dict[str, Any]) -> Any:
    import anyio

    async def go() -> Any:
        async with mcp_client(pp.url("notes"), "legacy", bearer=OPS) as c:
            return await c.call_tool(tool, args)

    return anyio.run(go)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("audit-tooling")
    tools = dict(fixture_policy()["tools"])
    tools["notes.echo"] = {
        "effect": "read",
        "log_args": True,
        "mask": ["/secret"],
        "schema": {"type": "object", "properties": {"text": {"type": "string"},
                                                    "secret": {"type": "string"}},
                   "required": ["text"]},
    }
    policies = write_policy(tmp / "policies", {"notes": {}}, tools=tools)
    config = {"approvals": {"enabled": False}, "audit": {"rotate_interval": "1h"}}
    with proxy_process(tmp, {"notes": sse_upstream.url}, policies=policies, config=config) as pp:
        for text in TEXTS:
            _call(pp, "echo", {"text": text, "secret": SECRET})
        _call(pp, "search_notes", {"query": "welcome"})
        yield pp


def _json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.splitlines() if x.strip()]


def test_query_tool_json_returns_exactly_the_calls(proxy: ProxyProcess) -> None:
    done = cli("audit", "query", str(proxy.audit_dir), "--tool", "echo", "--format", "json")
    assert done.returncode == 0, done.stderr
    recs = _json_lines(done.stdout)
    written = [r for r in proxy.audit_records() if r["tool"] == "echo"]
    assert len(recs) == len(TEXTS) == len(written)
    assert recs == list(reversed(written))  # newest first, as written
    assert [r["args"]["text"] for r in recs] == list(reversed(TEXTS))
    assert all(r["v"] == 1 and r["principal"] == "ops" and r["upstream"] == "notes" for r in recs)
    one = cli("audit", "query", str(proxy.audit_dir), "--decision-id", recs[1]["decision_id"],
              "--format", "json")
    assert _json_lines(one.stdout) == [recs[1]]
    assert _json_lines(cli("audit", "query", str(proxy.audit_dir), "--tool", "echo", "--limit", "1",
                           "--format", "json").stdout) == recs[:1]
    assert cli("audit", "query", str(proxy.audit_dir), "--since", "1h", "--tool", "echo",
               "--format", "json").stdout.count("\n") == 3
    assert cli("audit", "query", str(proxy.audit_dir), "--until", "1h", "--format", "json").stdout == ""


def test_masked_arguments_are_written_masked(proxy: ProxyProcess) -> None:
    from proxy.audit.record import args_digest

    raw = b"".join(p.read_bytes() for p in proxy.audit_dir.glob("*.jsonl"))
    assert SECRET.encode() not in raw
    echo = [r for r in proxy.audit_records() if r["tool"] == "echo"]
    assert all(r["args"]["secret"] == "***" for r in echo)
    assert echo[0]["args_digest"] == args_digest({"text": "one", "secret": SECRET})
    assert cli("audit", "verify", str(proxy.audit_dir)).returncode == 0


def test_query_table(proxy: ProxyProcess) -> None:
    done = cli("audit", "query", str(proxy.audit_dir), "--principal", "ops")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["TIME", "DECISION", "PRINCIPAL"]
    assert len(lines) == 1 + len(proxy.audit_records())
    assert "notes.search_notes" in lines[1] and "notes.echo" in lines[2]
    bad = cli("audit", "query", str(proxy.audit_dir), "--since", "yesterday")
    assert bad.returncode == 2 and "not a time" in bad.stderr


def test_tail_prints_the_last_n(proxy: ProxyProcess) -> None:
    done = cli("audit", "tail", "-n", "2", "--format", "json", str(proxy.audit_dir))
    assert done.returncode == 0, done.stderr
    assert _json_lines(done.stdout) == proxy.audit_records()[-2:]  # oldest of them first


def test_tail_follow_shows_a_new_record(proxy: ProxyProcess) -> None:
    proc = subprocess.Popen([*CLI, "audit", "tail", "-f", "-n", "1", "--format", "json",
                             str(proxy.audit_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        first = json.loads(lines.get(timeout=20))  # the last record: the follower runs now
        assert first == proxy.audit_records()[-1]
        result = _call(proxy, "search_notes", {"query": "after-tail"})
        assert not result.is_error
        new = json.loads(lines.get(timeout=20))
        assert new["tool"] == "search_notes" and new["hash"] != first["hash"]
        assert new == proxy.audit_records()[-1]
    finally:
        proc.terminate()
        rc = proc.wait(10)
    assert rc == 0, proc.stderr.read() if proc.stderr else ""  # a clean exit, no traceback


def test_tail_of_a_missing_directory(tmp_path: Path) -> None:
    done = cli("audit", "tail", str(tmp_path / "nope"))
    assert done.returncode == 2 and "not a directory" in done.stderr
