"""Request bodies in a content coding, through the real proxy in front of the SDK demo server
(and of the hostile upstream, which records the headers it receives and, being aiohttp, decodes
a body by its `Content-Encoding`).

aiohttp decodes a gzip body as the proxy reads it: the proxy inspects and forwards the decoded
JSON without the client's `Content-Encoding` (the upstream would otherwise try to decode plain
JSON), and the body cap applies to the decoded size, so a small gzip bomb is refused 413 without
inflating into the proxy's memory.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc
from hostile_upstream import hostile_server

from tests.harness import ProxyProcess, metric_value, proxy_process, token

OPS = token("ops", tenant="acme")
CAP = 2**20  # limits.max_body_bytes: well below the bomb's inflated size
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
           "MCP-Protocol-Version": "2025-06-18", "Authorization": f"Bearer {OPS}"}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("request-encoding")
    with proxy_process(tmp, {"notes": sse_upstream.url},
                       config={"limits": {"max_body_bytes": CAP}}) as pp:
        yield pp


def _message(resp: httpx.Response) -> dict[str, Any]:
    """The JSON-RPC message of a reply, JSON or a one-message SSE stream."""
    assert resp.status_code == 200, (resp.status_code, resp.text)
    if resp.headers["content-type"].startswith("text/event-stream"):
        [data] = [line[5:] for line in resp.text.splitlines() if line.startswith("data:")]
        return dict(json.loads(data))
    return dict(resp.json())


def _post(proxy: ProxyProcess, message: dict[str, Any], session: str | None = None,
          encoding: str | None = "gzip", body: bytes | None = None) -> httpx.Response:
    headers = dict(HEADERS)
    if session is not None:
        headers["Mcp-Session-Id"] = session
    if body is None:
        body = json.dumps(message).encode()
        if encoding == "gzip":
            body = gzip.compress(body)
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    return httpx.post(proxy.url("notes"), content=body, headers=headers, timeout=10)


def _session(proxy: ProxyProcess) -> str:
    """A session opened with gzip bodies, as a client that compresses every request would."""
    resp = _post(proxy, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "gzip-client", "version": "1"}}})
    assert _message(resp)["result"]["serverInfo"]["name"]
    session = resp.headers["Mcp-Session-Id"]
    done = _post(proxy, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    assert done.status_code == 202, done.text
    return session


def _vm_hwm(proxy: ProxyProcess) -> int:
    """The proxy process's peak resident memory, in bytes."""
    for line in Path(f"/proc/{proxy.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_gzip_tools_call_reaches_the_upstream_decoded(proxy: ProxyProcess) -> None:
    session = _session(proxy)
    text = "compressed " * 5000  # 55 kB of JSON, well under the cap once decoded
    resp = _post(proxy, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                         "params": {"name": "echo", "arguments": {"text": text}}}, session)
    reply = _message(resp)
    assert reply["id"] == 2
    assert reply["result"]["structuredContent"] == {"result": text}
    assert not reply["result"].get("isError")
    [record] = [r for r in proxy.audit_records() if r.get("tool") == "echo"]
    assert (record["code"], record["upstream_status"]) == ("ok", 200)


def test_a_gzip_bomb_is_refused_413_without_inflating(proxy: ProxyProcess) -> None:
    session = _session(proxy)
    text = "0" * (10 * 2**20)  # 10 MB when inflated
    bomb = gzip.compress(json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "echo", "arguments": {"text": text}}}).encode(), compresslevel=9)
    assert len(bomb) <= 20_000
    before_records = len(proxy.audit_records())
    before_rejected = metric_value(proxy.metrics(), "envelope_rejected_requests_total",
                                   reason="too_large")
    before = _vm_hwm(proxy)
    resp = _post(proxy, {}, session, body=bomb)
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == -32600
    assert f"larger than {CAP} bytes" in resp.json()["error"]["message"]
    # At most the cap and a decoding step were held, never the 10 MB the bomb inflates to.
    assert _vm_hwm(proxy) - before < 4 * 2**20
    assert metric_value(proxy.metrics(), "envelope_rejected_requests_total",
                        reason="too_large") == before_rejected + 1
    assert len(proxy.audit_records()) == before_records  # nothing reached the envelope
    # The proxy still serves compressed calls.
    again = _post(proxy, {"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                          "params": {"name": "echo", "arguments": {"text": "after"}}}, session)
    assert _message(again)["result"]["structuredContent"] == {"result": "after"}


def test_a_body_that_is_not_valid_gzip_is_a_parse_error(proxy: ProxyProcess) -> None:
    session = _session(proxy)
    broken = gzip.compress(b'{"jsonrpc": "2.0"}')[:12] + b"not deflate data" * 4
    resp = _post(proxy, {}, session, body=broken)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["message"]) == (
        -32700, "Parse error: the body cannot be decoded from its Content-Encoding")


def test_a_body_in_a_coding_the_proxy_cannot_read_is_refused_415(proxy: ProxyProcess) -> None:
    session = _session(proxy)
    # Valid JSON labelled with a coding the proxy does not decode: it would inspect one thing and
    # the upstream read another, so nothing is forwarded.
    plain = json.dumps({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                        "params": {"name": "echo", "arguments": {"text": "x"}}}).encode()
    resp = _post(proxy, {}, session, encoding="compress", body=plain)
    assert resp.status_code == 415, resp.text
    assert resp.json()["error"]["code"] == -32600
    # deflate is decoded like gzip.
    ok = _post(proxy, {}, session, encoding="deflate", body=zlib.compress(plain))
    assert _message(ok)["result"]["structuredContent"] == {"result": "x"}


def test_the_upstream_gets_the_decoded_body_without_content_encoding(
        tmp_path: Path) -> None:
    doc = {"version": 1, "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "5s"}},
           "defaults": {"unknown_tools": "deny"},
           "tools": {"h.read_page": {"effect": "read"}}}
    with hostile_server() as hostile, \
            proxy_process(tmp_path, {"h": hostile.url},
                          policies=write_doc(tmp_path / "policy", doc)) as pp:
        body = gzip.compress(json.dumps({
            "jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "read_page", "arguments": {"text": "decoded"}}}).encode())
        headers = {**HEADERS, "MCP-Protocol-Version": "2026-07-28", "Content-Encoding": "gzip",
                   "Mcp-Method": "tools/call", "Mcp-Name": "read_page"}
        resp = httpx.post(pp.url("h"), content=body, headers=headers, timeout=10)
        reply = _message(resp)
        assert not reply["result"].get("isError"), reply
        [received] = hostile.control.calls("read_page")
        assert received["params"]["arguments"] == {"text": "decoded"}
        assert "content-encoding" not in received["headers"]
        assert received["status"] == 200
