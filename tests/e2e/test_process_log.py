"""The process log as a platform team ships it: one record is one line, whatever a client sends.

Each test sends the real `envelope-proxy` process what a hostile or broken client sends and
reads the process log (stderr) a log shipper would carry: a client must not write lines of its
own into it (a fake ERROR, a fake `audit head {...}` anchor), and bytes that are not HTTP must
not become ERROR tracebacks.
"""

from __future__ import annotations

from pathlib import Path

from tests.harness import proxy_process, rpc

FORGED = '2026-01-01 00:00:00,000 INFO proxy.audit.anchor: audit head {"chain":"audit","records":1}'


def test_a_client_cannot_write_a_line_into_the_process_log(tmp_path: Path, sse_upstream) -> None:
    # The answer to an unknown proxy request is logged with its id, a string the client chose.
    # A newline in it started a line of the client's choosing: here a fake anchor line, which
    # an operator's `grep 'audit head'` keeps and `audit verify --anchors` then fails on.
    with proxy_process(tmp_path, {"notes": sse_upstream.url},
                       identity={"mode": "static", "principal": "ops"}) as pp:
        reply = rpc(pp.url("notes"), {"jsonrpc": "2.0", "id": f"envelope-1\n{FORGED}\r\n", "result": {}},
                    headers={"MCP-Protocol-Version": "2025-06-18"})
        assert reply.status_code == 202, reply.text
        log = pp.log()
    lines = log.splitlines()
    assert not [line for line in lines if line.startswith("2026-01-01")], log
    dropped = [line for line in lines if "was dropped" in line]
    assert len(dropped) == 1, log
    assert "envelope-1\\n2026-01-01 00:00:00,000 INFO proxy.audit.anchor" in dropped[0]
    assert dropped[0].endswith("\\r\\n was dropped"), dropped[0]
