"""The process log as a platform team ships it: one record is one line, whatever a client sends.

Each test sends the real `envelope-proxy` process what a hostile or broken client sends and
reads the process log (stderr) a log shipper would carry: a client must not write lines of its
own into it (a fake ERROR, a fake `audit head {...}` anchor), and bytes that are not HTTP must
not become ERROR tracebacks.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from mcp import Client

from tests.harness import metric_value, proxy_process, rpc

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


# Bidi controls (embeddings, overrides, isolates, marks) and zero-width characters: a log
# viewer (a browser UI of the log shipper, a bidi-aware terminal) reorders or hides the text
# around them, so a line can read other than it says.
HIDDEN = "\u202e\u2066\u2069\u200f\u200b\ufeff"


def test_a_client_cannot_reorder_or_hide_text_in_a_process_log_line(tmp_path: Path, sse_upstream) -> None:
    # The same logged id, holding a right-to-left override: the rest of the line (the proxy's
    # own words) displayed reversed, e.g. `was dropped` read as something else.
    with proxy_process(tmp_path, {"notes": sse_upstream.url},
                       identity={"mode": "static", "principal": "ops"}) as pp:
        reply = rpc(pp.url("notes"), {"jsonrpc": "2.0", "id": f"envelope-2{HIDDEN}degnahc", "result": {}},
                    headers={"MCP-Protocol-Version": "2025-06-18"})
        assert reply.status_code == 202, reply.text
        log = pp.log()
    assert not [ch for ch in HIDDEN if ch in log], [line for line in log.splitlines() if "envelope-2" in line]
    [dropped] = [line for line in log.splitlines() if "was dropped" in line]
    assert "envelope-2\\u202e\\u2066\\u2069\\u200f\\u200b\\ufeffdegnahc was dropped" in dropped, dropped


def _raw(port: int, data: bytes) -> bytes:
    """The first line of what `port` answers `data`, read to the close (a refusal closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        return answer.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("listener", ["fast", "aiohttp"])
def test_bytes_that_are_not_http_are_no_errors_in_the_log(tmp_path: Path, sse_upstream, listener: str) -> None:
    # The admin listener (aiohttp) answered each malformed request 400 and logged it at ERROR
    # with a traceback: a port scan or a TLS probe of the admin Service filled the log and set
    # off error alerts. The MCP listener (fast) never logged them. Each is counted instead
    # (`bad_request`): it was counted nowhere, and a platform team alerting on scans saw none.
    garbage = [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS hello on a plain port
        b"GET /healthz HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX\x01Y: z\r\n\r\n",
        b"GET /healthz\nFAKE HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nBREW /metrics HTTP/1.1\r\n\r\n",
    ]
    with proxy_process(tmp_path, {"notes": sse_upstream.url}, identity={"mode": "static", "principal": "ops"},
                       config={"listener": {"kind": listener}}) as pp:
        for data in garbage:
            for port in (pp.admin_port, pp.port):
                assert _raw(port, data).startswith(b"HTTP/1."), data  # answered, not dropped
        metrics = pp.metrics()
        log = pp.log()
    assert "ERROR" not in log and "Traceback" not in log, log
    assert metric_value(metrics, "envelope_rejected_requests_total", reason="bad_request") == len(garbage)
    assert metric_value(metrics, "envelope_admin_rejected_requests_total",
                        reason="bad_request") == len(garbage)


@pytest.mark.parametrize("listener", ["fast", "aiohttp"])
def test_a_session_client_leaving_is_no_error_in_the_log(tmp_path: Path, sse_upstream, listener: str) -> None:
    # A 2025-11-25 client holds a GET stream open beside its calls and closes every connection
    # when it is done, as the SDK's legacy client (and the README's tour) does. The fast
    # listener then failed writing the end of the relayed stream to the closed connection and
    # logged an ERROR with a traceback for a client that simply left.
    async def session() -> list[str]:
        async with Client(f"http://127.0.0.1:{pp.port}/mcp/notes", mode="legacy") as client:
            return [tool.name for tool in (await client.list_tools()).tools]

    with proxy_process(tmp_path, {"notes": sse_upstream.url}, identity={"mode": "static", "principal": "ops"},
                       config={"listener": {"kind": listener}}) as pp:
        for _ in range(3):
            assert "search_notes" in asyncio.run(session())
        time.sleep(0.5)  # the relays notice the closed connections
        log = pp.log()
    assert "ERROR" not in log and "Traceback" not in log, log
