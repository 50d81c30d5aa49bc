"""Output guardrails on large and cut-up replies, through the real process: the upstream
(`scripted_upstream.py`) writes exactly the bytes a test gives it.

A reply of millions of characters is scanned in a worker thread: while it is scanned, another
client's small call is answered, and the large reply is still inspected to its last character
(a key at its end blocked or redacted as the policy says). A key cut in two across the text
blocks of one result is one key (the blocks are read in order, as a model reads them); a key in
a base64 text blob is decoded and found.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc
from scripted_upstream import Script, ScriptedUpstream, scripted_server
from test_response_path import Client
from test_stream_forms import event, message

from tests.harness import proxy_process

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
TOOLS = [{"name": name, "inputSchema": {"type": "object"}} for name in ("huge", "large", "small", "split")]
JSON_HEADERS = {"Content-Type": "application/json"}
# Costly to scan (each `api_key=` is tried, and the zero-width spaces make a second, folded
# reading: seconds for a few MB) and matching no detector, until the key at its very end.
COSTLY = "api_key=\u200b ab " * 300_000


def policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "60s"}},
        "defaults": {"unknown_tools": "deny", "guardrails": [{"detector": "secrets", "action": "redact"}]},
        "tools": {"h.huge": {"effect": "read",
                             "guardrails": [{"detector": "aws_access_key_id", "action": "block", "id": "keys"}]},
                  "h.large": {"effect": "read"}, "h.small": {"effect": "read"}, "h.split": {"effect": "read"}},
    })


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with scripted_server(TOOLS) as up:
        yield up


@pytest.fixture(scope="module")
def proxy(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("guardrails-offloop")
    with proxy_process(tmp, {"h": upstream.url}, policies=policy(tmp / "policy")) as pp:
        yield pp


def result(*texts: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": t} for t in texts], "isError": False}


def call(client: Client, tool: str) -> dict[str, Any]:
    client.http.timeout = httpx.Timeout(120)  # the huge reply's scan takes seconds on a busy machine
    return client.call(tool, {})


def record_of(pp: Any, tool: str) -> dict[str, Any]:
    return [r for r in pp.audit_records() if r.get("tool") == tool][-1]


def test_a_small_call_is_answered_while_a_huge_reply_is_scanned_and_the_huge_reply_is_still_blocked(
        upstream: ScriptedUpstream, proxy: Any) -> None:
    upstream.scripts["tools/call:huge"] = Script([message(id=None, result=result(COSTLY + AWS_KEY))],
                                                 headers=JSON_HEADERS)
    upstream.scripts["tools/call:small"] = Script([message(id=None, result=result("small"))], headers=JSON_HEADERS)
    huge: dict[str, Any] = {}
    big = threading.Thread(target=lambda: huge.update(call(Client(proxy.url("h"), stateless=True), "huge")))
    big.start()
    try:
        for _ in range(3000):  # the upstream has the huge call: its reply is on its way
            if any(c["params"]["name"] == "huge" for c in upstream.calls()):
                break
            big.join(0.01)
        small = call(Client(proxy.url("h"), stateless=True), "small")
        scanned_meanwhile = big.is_alive()
    finally:
        big.join(120)
    assert small["result"]["content"] == [{"type": "text", "text": "small"}]
    assert scanned_meanwhile  # answered while the huge reply was still being scanned
    text = huge["result"]["content"][0]["text"]
    assert huge["result"]["isError"] is True and "guardrail_blocked" in text and AWS_KEY not in text
    rec = record_of(proxy, "huge")
    assert rec["code"] == "guardrail_blocked" and rec["rule"] == "keys"
    assert {"id": "keys", "detector": "aws_access_key_id", "action": "block", "matches": 1} in rec["extra"]["guardrails"]


def test_a_key_at_the_end_of_a_large_reply_is_redacted(upstream: ScriptedUpstream, proxy: Any) -> None:
    prose = "The quick brown fox jumps over the lazy dog. " * 100_000
    upstream.scripts["tools/call:large"] = Script([message(id=None, result=result(prose + AWS_KEY))],
                                                  headers=JSON_HEADERS)
    answer = call(Client(proxy.url("h"), stateless=True), "large")
    assert answer["result"]["content"][0]["text"] == prose + "[REDACTED:aws_access_key_id]"
    assert record_of(proxy, "large")["extra"]["guardrails"][0]["matches"] == 1


@pytest.mark.parametrize("form", ["json", "sse"])
def test_a_key_cut_across_two_text_blocks_and_one_in_a_base64_text_blob_are_redacted(
        upstream: ScriptedUpstream, proxy: Any, form: str) -> None:
    blob = {"type": "resource", "resource": {"uri": "file:///creds.env", "mimeType": "text/plain",
                                             "blob": base64.b64encode(f"KEY={AWS_KEY}\n".encode()).decode()}}
    body = {"content": [{"type": "text", "text": f"key {AWS_KEY[:10]}"}, {"type": "text", "text": AWS_KEY[10:]},
                        blob], "isError": False}
    answer_bytes = message(id=None, result=body)
    upstream.scripts["tools/call:split"] = (Script([answer_bytes], headers=JSON_HEADERS) if form == "json"
                                            else Script([event(answer_bytes)]))
    answer = call(Client(proxy.url("h"), stateless=True), "split")
    content = answer["result"]["content"]
    assert [b.get("text") for b in content[:2]] == ["key [REDACTED:aws_access_key_id]", ""]
    assert base64.b64decode(content[2]["resource"]["blob"]) == b"KEY=[REDACTED:aws_access_key_id]\n"
    assert AWS_KEY not in json.dumps(answer)
    assert record_of(proxy, "split")["extra"]["guardrails"][0]["matches"] == 2


def test_a_scan_past_the_configured_timeout_withholds_the_reply_and_the_proxy_serves_on(
        upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """`limits.guardrail_scan_timeout`: an operator's bound on one message's scan. The costly
    reply takes seconds to scan; past 20 ms it is withheld (fail closed: never delivered
    unread), the refusal and the audit record say why, and the next call is served."""
    upstream.scripts["tools/call:huge"] = Script([message(id=None, result=result(COSTLY + AWS_KEY))],
                                                 headers=JSON_HEADERS)
    upstream.scripts["tools/call:small"] = Script([message(id=None, result=result("small"))], headers=JSON_HEADERS)
    with proxy_process(tmp_path, {"h": upstream.url}, policies=policy(tmp_path / "policy"),
                       config={"limits": {"guardrail_scan_timeout": "20ms"}}) as pp:
        huge = call(Client(pp.url("h"), stateless=True), "huge")
        small = call(Client(pp.url("h"), stateless=True), "small")
        rec = record_of(pp, "huge")
    text = huge["result"]["content"][0]["text"]
    assert huge["result"]["isError"] is True and "internal_error" in text
    assert "did not finish within 0.02 s (limits.guardrail_scan_timeout)" in text
    assert "api_key" not in json.dumps(huge) and AWS_KEY not in json.dumps(huge)
    assert (rec["code"], rec["check"]) == ("internal_error", "guardrails")
    assert small["result"]["content"] == [{"type": "text", "text": "small"}]
