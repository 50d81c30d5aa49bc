"""Promise 2 on every form in which an upstream's bytes reach the agent, through the real
process on both listeners and both client revisions: the upstream (`scripted_upstream.py`)
writes exactly the bytes a test gives it.

Each test asserts what the client receives, the call's audit record and, where text is
untrusted, that a sink copying it is refused (the run's ledger recorded it).
"""

from __future__ import annotations

import decimal
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from e2e_helpers import write_doc
from scripted_upstream import Script, ScriptedUpstream, scripted_server
from test_response_path import HOSTILE, INJECTION, SECRET, Client, assert_copy_is_flagged, sse

from tests.harness import proxy_process

TOOLS = [{"name": name, "inputSchema": {"type": "object"}}
         for name in ("read_page", "write_note", "delete_all")]
JSON_HEADERS = {"Content-Type": "application/json"}


def policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "3s"}},
        "defaults": {"unknown_tools": "deny",
                     "guardrails": [{"detector": "secrets", "action": "redact"}]},
        "tools": {"h.read_page": {"effect": "read", "output": "untrusted"},
                  "h.write_note": {"effect": "write"}},
        "dataflow": {"mode": "enforce"},
    })


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with scripted_server(TOOLS) as up:
        yield up


@pytest.fixture(scope="module", params=["fast", "aiohttp"])
def proxy(request: pytest.FixtureRequest, upstream: ScriptedUpstream,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp(f"forms-{request.param}")
    with proxy_process(tmp, {"h": upstream.url}, policies=policy(tmp / "policy"),
                       config={"listener": {"kind": request.param}, "aggregate": {"enabled": True}}) as pp:
        yield pp


@pytest.fixture(params=[False, True], ids=["legacy", "stateless"])
def client(request: pytest.FixtureRequest, proxy: Any, upstream: ScriptedUpstream) -> Client:
    upstream.scripts.clear()
    return Client(proxy.url("h"), stateless=request.param,
                  headers={"X-Envelope-Run": f"run-{len(proxy.audit_records())}-{request.param}"})


def message(**members: Any) -> bytes:
    """A JSON-RPC message; an `id` of None stands for the request's (`{id}` in a script)."""
    body = json.dumps({"jsonrpc": "2.0", **members})
    return body.replace('"id": null', '"id": {id}').encode()


def event(data: bytes, end: bytes = b"\n") -> bytes:
    return b"data: " + data + end + end


def new_records(pp: Any, before: int) -> list[dict[str, Any]]:
    return pp.audit_records()[before:]


def call(client: Client, tool: str = "read_page") -> tuple[str, dict[str, Any]]:
    """POST a tools/call; the response's text and its answer."""
    client.ids += 1
    response = client.post({"jsonrpc": "2.0", "id": client.ids, "method": "tools/call",
                            "params": {"name": tool, "arguments": {}}})
    [answer] = [m for m in client.messages(response) if m.get("id") == client.ids]
    return response.text, answer


CLEAN = {"content": [{"type": "text", "text": "clean"}]}
TWO_PAYLOADS = {
    # The MCP SDK reads `error` when both are there, and `params` when there is a `method`: the
    # proxy inspected `result`.
    "json answer, result and error": Script(
        [message(id=None, result=CLEAN, error={"code": -32000, "message": HOSTILE})],
        headers=JSON_HEADERS),
    "sse answer, result and error": Script(
        [event(message(id=None, result=CLEAN, error={"code": -32000, "message": HOSTILE}))]),
    "sse notification, params and result": Script(
        [event(message(method="notifications/message", params={"level": "info", "data": HOSTILE},
                       result={})),
         event(message(id=None, result=CLEAN))]),
    "sse sampling request, params and error": Script(
        [event(message(id="srv-1", method="sampling/createMessage", params={
            "messages": [{"role": "user", "content": {"type": "text", "text": HOSTILE}}],
            "maxTokens": 10}, error={"code": 1, "message": "x"})),
         event(message(id=None, result=CLEAN))]),
}


@pytest.mark.parametrize("form", list(TWO_PAYLOADS))
def test_a_message_with_two_payloads_is_withheld_and_the_call_refused(
        proxy: Any, upstream: ScriptedUpstream, client: Client, form: str) -> None:
    upstream.scripts["tools/call:read_page"] = TWO_PAYLOADS[form]
    before = len(proxy.audit_records())
    text, answer = call(client)
    assert SECRET not in text and INJECTION not in text, text
    result = answer["result"]
    assert result["isError"] is True
    assert result["_meta"]["envelope/decision"]["code"] == "upstream_error", result
    [record] = new_records(proxy, before)
    assert record["tool"] == "read_page" and record["code"] == "upstream_error"
    assert record["check"] == "inspect"


def test_a_relayed_answer_with_two_payloads_is_withheld_and_audited(
        proxy: Any, upstream: ScriptedUpstream, client: Client) -> None:
    upstream.scripts["completion/complete"] = Script(
        [message(id=None, result={"completion": {"values": []}}, error={"code": 1, "message": HOSTILE})],
        headers=JSON_HEADERS)
    before = len(proxy.audit_records())
    reply = client.request("completion/complete", {})
    assert SECRET not in json.dumps(reply) and INJECTION not in json.dumps(reply)
    assert "result" not in reply and "upstream_error" in reply["error"]["message"], reply
    [record] = new_records(proxy, before)
    assert record["method"] == "completion/complete" and record["code"] == "upstream_error"


BESIDE_CONTENT = {
    # 2026-07-28: the server asks the client to sample; the client hands the text to its model.
    "input_required": {"resultType": "input_required", "requestState": "s-1", "inputRequests": {
        "ask": {"method": "sampling/createMessage", "params": {
            "messages": [{"role": "user", "content": {"type": "text", "text": HOSTILE}}],
            "maxTokens": 9}}}},
    "task status": {"task": {"taskId": "t-1", "status": "working", "statusMessage": HOSTILE,
                             "createdAt": "2026-12-02T00:00:00Z", "ttl": 60000}},
}


@pytest.mark.parametrize("form", list(BESIDE_CONTENT))
def test_untrusted_text_beside_a_results_content_is_inspected_and_recorded(
        upstream: ScriptedUpstream, client: Client, form: str) -> None:
    upstream.scripts["tools/call:read_page"] = Script(
        [message(id=None, result=BESIDE_CONTENT[form])], headers=JSON_HEADERS)
    upstream.scripts["tools/call:write_note"] = Script([message(id=None, result=CLEAN)],
                                                       headers=JSON_HEADERS)
    text, _ = call(client)
    assert SECRET not in text and INJECTION in text
    assert_copy_is_flagged(client, "h.read_page")


UNREADABLE = {
    # JSON the MCP SDK reads and orjson does not.
    "NaN": b'{"jsonrpc": "2.0", "id": {id}, "result": {"completion": {"values": ["%s"]}, "n": NaN}}',
    "1e400": b'{"jsonrpc": "2.0", "id": {id}, "result": {"completion": {"values": ["%s"]}, "n": 1e400}}',
    # A batch, which the TypeScript SDK reads.
    "array": b'[{"jsonrpc": "2.0", "id": {id}, "result": {"completion": {"values": ["%s"]}}}]',
}


@pytest.mark.parametrize("form", list(UNREADABLE))
def test_a_json_answer_the_proxy_cannot_read_is_withheld(
        proxy: Any, upstream: ScriptedUpstream, client: Client, form: str) -> None:
    upstream.scripts["completion/complete"] = Script([UNREADABLE[form] % HOSTILE.encode()],
                                                     headers=JSON_HEADERS)
    reply = client.request("completion/complete", {})
    assert SECRET not in json.dumps(reply) and INJECTION not in json.dumps(reply)
    assert "cannot read" in reply["error"]["message"], reply


def test_an_unreadable_tools_list_is_withheld_not_relayed_unfiltered(
        upstream: ScriptedUpstream, client: Client) -> None:
    listing = json.dumps({"tools": TOOLS}).encode()[:-1] + b', "n": NaN}'
    upstream.scripts["tools/list"] = Script([b'{"jsonrpc": "2.0", "id": {id}, "result": ' + listing + b"}"],
                                            headers=JSON_HEADERS)
    reply = client.request("tools/list", {})
    assert "delete_all" not in json.dumps(reply), reply  # the policy hides it (unknown tool)
    del upstream.scripts["tools/list"]
    names = [t["name"] for t in client.request("tools/list", {})["result"]["tools"]]
    assert names == ["read_page", "write_note"]


def test_tool_descriptions_pass_the_output_guardrails(upstream: ScriptedUpstream, client: Client) -> None:
    upstream.tools[0]["description"] = f"Reads a page. {HOSTILE}"
    try:
        reply = client.request("tools/list", {})
    finally:
        upstream.tools[0].pop("description")
    [tool] = [t for t in reply["result"]["tools"] if t["name"] == "read_page"]
    assert SECRET not in tool["description"] and "[REDACTED:aws_access_key_id]" in tool["description"]


def test_tool_descriptions_pass_the_output_guardrails_on_the_aggregate(
        proxy: Any, upstream: ScriptedUpstream, client: Client) -> None:
    upstream.tools[0]["description"] = f"Reads a page. {HOSTILE}"
    try:
        reply = Client(f"{proxy.base}/mcp", stateless=client.stateless).request("tools/list", {})
    finally:
        upstream.tools[0].pop("description")
    [tool] = [t for t in reply["result"]["tools"] if t["name"] == "h.read_page"]
    assert SECRET not in tool["description"] and "[REDACTED:aws_access_key_id]" in tool["description"]


PROGRESS = message(method="notifications/progress", params={"progressToken": "p", "progress": 1})


@pytest.mark.parametrize("pace", ["endless stream", "one byte a second"])
def test_a_relayed_answer_is_cut_off_at_the_upstream_timeout(
        upstream: ScriptedUpstream, client: Client, pace: str) -> None:
    """Not only its start: a relayed request's whole answer is bounded as a call's is."""
    upstream.scripts["completion/complete"] = (
        # 8 s and more of progress (never an answer), against the upstream's timeout of 3 s.
        Script([event(PROGRESS)] * 800, pause=0.01) if pace == "endless stream" else
        Script([message(id=None, result={"completion": {"values": []}})], split=1, pause=1.0,
               headers=JSON_HEADERS))
    client.ids += 1
    response = client.post({"jsonrpc": "2.0", "id": client.ids, "method": "completion/complete",
                            "params": {}})
    [answer] = [m for m in client.messages(response) if m.get("id") == client.ids]
    assert answer["error"]["message"] == "upstream 'h' did not answer within 3s", answer


def test_a_comment_after_a_cr_line_end_is_not_relayed(upstream: ScriptedUpstream, client: Client) -> None:
    upstream.scripts["completion/complete"] = Script(
        [b"data: " + message(id=None, result={"completion": {"values": ["x"]}})
         + b"\r: " + SECRET.encode() + b"\r\r\n"])
    client.ids += 1
    response = client.post({"jsonrpc": "2.0", "id": client.ids, "method": "completion/complete",
                            "params": {}})
    assert SECRET not in response.text, response.text
    assert [m["id"] for m in client.messages(response)] == [client.ids]


def stream_of_every_form(text: str) -> bytes:
    """A call's stream: a log notification, a progress notification, a sampling request and an
    elicitation carrying `text`, then a clean result, in every SSE syntax a parser must read: CRLF,
    CR and LF line ends, comments, `retry:`, `id:`, multi-line `data:`."""
    note = message(method="notifications/message", params={"level": "info", "data": text})
    progress = message(method="notifications/progress", params={
        "progressToken": "p", "progress": 1, "message": text})
    sampling = message(id="srv-1", method="sampling/createMessage", params={
        "messages": [{"role": "user", "content": {"type": "text", "text": text}}], "maxTokens": 9})
    elicit = message(id="srv-2", method="elicitation/create", params={
        "message": text, "requestedSchema": {"type": "object", "properties": {}}})
    result = message(id=None, result={"content": [{"type": "text", "text": "done"}]})
    half = result.index(b', "result"')  # between two members: the line end joins them
    return (b": a comment\r\nretry: 50\r\n\r\n"
            + b"event: message\r\ndata: " + note + b"\r\n\r\n"
            + b"data: " + progress + b"\r\r"
            + b"id: 7\ndata: " + sampling + b"\n\n"
            + b": x\rdata: " + elicit + b"\r\n\r\n"
            + b"data: " + result[:half] + b"\ndata: " + result[half:] + b"\r\n\r\n")


@pytest.mark.parametrize("split", ["whole", "every byte"])
def test_every_message_of_a_call_stream_is_inspected_and_recorded_in_any_syntax(
        proxy: Any, upstream: ScriptedUpstream, client: Client, split: str) -> None:
    body = stream_of_every_form(HOSTILE)
    upstream.scripts["tools/call:read_page"] = Script([body], split=0 if split == "whole" else 1)
    before = len(proxy.audit_records())
    text, answer = call(client)
    assert SECRET not in text and text.count("[REDACTED:aws_access_key_id]") == 4, text
    assert answer["result"]["content"][0]["text"] == "done"
    [record] = new_records(proxy, before)
    assert record["code"] == "ok" and record["extra"]["guardrails"][0]["matches"] == 4
    # Only the stream's messages carried the injection: the ledger has it from them.
    assert_copy_is_flagged(client, "h.read_page")


def named_twice(member: str, first: Any, second: Any, **members: Any) -> bytes:
    """A JSON-RPC message whose object holding `member` names it twice: `first`, then `second`
    (orjson keeps the last, a first-wins parser the first). `member` may be written with an
    escape (`\\u0063ontent`); `members` come before it."""
    head = json.dumps({"jsonrpc": "2.0", **members})[:-1]
    return (f'{head}, "{member}": {json.dumps(first)}, "{member}": {json.dumps(second)}}}'
            .replace('"id": null', '"id": {id}').encode())


def result_named_twice(member: str = "content") -> bytes:
    """A tools/call answer whose result has `content` twice: the hostile block first."""
    hostile = [{"type": "text", "text": HOSTILE}]
    clean = [{"type": "text", "text": "clean"}]
    body = named_twice(member, hostile, clean)  # {"jsonrpc": "2.0", "content": ..., "content": ...}
    return b'{"jsonrpc": "2.0", "id": {id}, "result": {' + body[len(b'{"jsonrpc": "2.0", '):] + b"}"


NAMED_TWICE = {
    "json answer": Script([result_named_twice()], headers=JSON_HEADERS),
    "json answer, escaped name": Script([result_named_twice("\\u0063ontent")], headers=JSON_HEADERS),
    "sse answer": Script([event(result_named_twice())]),
    "sse notification": Script([
        event(named_twice("params", {"level": "info", "data": HOSTILE}, {"level": "info", "data": "x"},
                          method="notifications/message")),
        event(message(id=None, result=CLEAN))]),
    "sse answer, the message's own result": Script([event(named_twice(
        "result", {"content": [{"type": "text", "text": HOSTILE}]}, CLEAN, id=None))]),
}


def first_wins(data: str) -> Any:
    """What a parser that keeps the first of two same-named members reads."""
    return json.loads(data, object_pairs_hook=lambda pairs: dict(reversed(pairs)))


def assert_read_one_way(text: str) -> None:
    """Every message of a response (a JSON body, or each SSE event's data) reads the same to a
    first-wins parser as to a last-wins one."""
    datas = [text] if text.startswith("{") else [ev["data"] for ev in sse(text) if ev.get("data")]
    for data in datas:
        assert first_wins(data) == json.loads(data), data


@pytest.mark.parametrize("form", list(NAMED_TWICE))
def test_a_member_named_twice_reaches_the_client_as_inspected(
        proxy: Any, upstream: ScriptedUpstream, client: Client, form: str) -> None:
    """orjson keeps the last of two same-named members, and the envelope inspects that; the
    answer relayed as its bytes gave a first-wins client the hostile block nobody inspected."""
    upstream.scripts["tools/call:read_page"] = NAMED_TWICE[form]
    before = len(proxy.audit_records())
    text, answer = call(client)
    assert SECRET not in text and INJECTION not in text, text
    assert answer["result"]["content"] == [{"type": "text", "text": "clean"}], answer
    assert_read_one_way(text)
    [record] = new_records(proxy, before)
    assert record["code"] == "ok"


NAMED_TWICE_RELAYED = {
    "json": Script([named_twice("result", {"completion": {"values": [HOSTILE]}},
                                {"completion": {"values": []}}, id=None)], headers=JSON_HEADERS),
    "sse": Script([event(named_twice("result", {"completion": {"values": [HOSTILE]}},
                                     {"completion": {"values": []}}, id=None))]),
}


@pytest.mark.parametrize("form", list(NAMED_TWICE_RELAYED))
def test_a_relayed_answer_naming_a_member_twice_reaches_the_client_as_inspected(
        upstream: ScriptedUpstream, client: Client, form: str) -> None:
    upstream.scripts["completion/complete"] = NAMED_TWICE_RELAYED[form]
    client.ids += 1
    response = client.post({"jsonrpc": "2.0", "id": client.ids, "method": "completion/complete",
                            "params": {}})
    assert SECRET not in response.text and INJECTION not in response.text, response.text
    assert_read_one_way(response.text)
    [answer] = [m for m in client.messages(response) if m.get("id") == client.ids]
    assert answer["result"] == {"completion": {"values": []}}, answer


def test_an_answer_naming_each_member_once_is_relayed_as_its_bytes(
        upstream: ScriptedUpstream, client: Client) -> None:
    """Spaced JSON (not what orjson writes) read a second time, found unambiguous: not rewritten."""
    body = message(id=None, result={"content": [{"type": "text", "text": "spaced, é"}]})
    upstream.scripts["tools/call:read_page"] = Script([body], headers=JSON_HEADERS)
    text, _ = call(client)
    assert text == body.decode().replace("{id}", str(client.ids))


def with_a_bad_byte(body: bytes) -> bytes:
    """`body` with a byte that is not UTF-8 (0xFF) inside SECRET: the proxy reads U+FFFD there
    (no secret), a client that drops bad bytes reads SECRET whole."""
    return body.replace(SECRET.encode(), SECRET[:10].encode() + b"\xff" + SECRET[10:].encode())


def leniently(content: bytes) -> str:
    """What a client that skips bytes that are not UTF-8 reads."""
    return content.decode("utf-8", "ignore")


KEYED = {"content": [{"type": "text", "text": f"the key is {SECRET}"}]}
NOT_UTF8 = {
    "sse answer": ("tools/call:read_page", Script([event(with_a_bad_byte(message(id=None, result=KEYED)))])),
    "sse answer, in the event's name": ("tools/call:read_page", Script([
        b"event: message\xff\n" + event(message(id=None, result=CLEAN))])),
    "sse notification": ("tools/call:read_page", Script([
        event(with_a_bad_byte(message(method="notifications/message",
                                      params={"level": "info", "data": f"the key is {SECRET}"}))),
        event(message(id=None, result=CLEAN))])),
    "sse relayed answer": ("completion/complete", Script([
        event(with_a_bad_byte(message(id=None, result={"completion": {"values": [SECRET]}})))])),
}


@pytest.mark.parametrize("form", list(NOT_UTF8))
def test_bytes_that_are_not_utf8_reach_the_client_as_inspected(
        proxy: Any, upstream: ScriptedUpstream, client: Client, form: str) -> None:
    """The envelope reads a byte that is not UTF-8 as U+FFFD; relayed as the upstream wrote it,
    a client that skips such bytes (or reads latin-1) got a secret the guardrails never saw
    (`AKIAIOSFOD<0xFF>NN7EXAMPLE`). The event is rebuilt from what was read."""
    key, script = NOT_UTF8[form]
    upstream.scripts[key] = script
    method = key.partition(":")[0]
    params = {"name": "read_page", "arguments": {}} if method == "tools/call" else {}
    before = len(proxy.audit_records())
    client.ids += 1
    response = client.post({"jsonrpc": "2.0", "id": client.ids, "method": method, "params": params})
    assert response.status_code == 200, response.text
    assert b"\xff" not in response.content, response.content
    assert SECRET not in leniently(response.content), response.content
    [answer] = [m for m in client.messages(response) if m.get("id") == client.ids]
    assert "result" in answer, answer
    if method == "tools/call":
        [record] = new_records(proxy, before)
        assert record["code"] == "ok" and record["upstream"] == "h", record


BIG = "123456789012345678901234567890"  # past 64 bits: orjson reads a float
LONG = "0.12345678901234567890123"  # 23 significant digits: read rounded to 17
LONG_NUMBERS = {
    "json answer, an integer past 64 bits": ("tools/call:read_page", Script([message(id=None, result={
        **CLEAN, "structuredContent": {"amount": "@"}}).replace(b'"@"', BIG.encode())], headers=JSON_HEADERS)),
    "sse answer, a long fraction": ("tools/call:read_page", Script([event(message(id=None, result={
        **CLEAN, "structuredContent": {"rate": "@"}}).replace(b'"@"', LONG.encode()))])),
    "sse notification, an integer past 64 bits": ("tools/call:read_page", Script([
        event(message(method="notifications/progress", params={"progressToken": "p", "progress": "@"})
              .replace(b'"@"', BIG.encode())),
        event(message(id=None, result=CLEAN))])),
    "json relayed answer": ("completion/complete", Script([message(id=None, result={
        "completion": {"values": ["x"], "total": "@"}}).replace(b'"@"', BIG.encode())], headers=JSON_HEADERS)),
}


def exactly(data: str) -> Any:
    """What a client that reads numbers exactly (Python's int, Decimal) reads."""
    return json.loads(data, parse_float=decimal.Decimal)


def assert_numbers_read_one_way(text: str) -> None:
    """Every message of a response reads the same to an exact-number client as what the proxy
    read (orjson: doubles past 64-bit integers), written back."""
    datas = [text] if text.startswith("{") else [ev["data"] for ev in sse(text) if ev.get("data")]
    for data in datas:
        assert exactly(data) == exactly(orjson.dumps(orjson.loads(data)).decode()), data


@pytest.mark.parametrize("form", list(LONG_NUMBERS))
def test_a_number_the_proxy_reads_rounded_reaches_the_client_as_read(
        proxy: Any, upstream: ScriptedUpstream, client: Client, form: str) -> None:
    """A number past what a double holds (an integer past 64 bits, more than 17 significant
    digits) is what the proxy inspected and recorded only as its rounded double; relayed as
    written, an exact-number client read digits nobody inspected. Such a message is rendered
    from what the proxy read (I-JSON, RFC 7493: no interoperable reader expects more)."""
    key, script = LONG_NUMBERS[form]
    upstream.scripts[key] = script
    method = key.partition(":")[0]
    params = {"name": "read_page", "arguments": {}} if method == "tools/call" else {}
    before = len(proxy.audit_records())
    client.ids += 1
    response = client.post({"jsonrpc": "2.0", "id": client.ids, "method": method, "params": params})
    assert response.status_code == 200, response.text
    assert BIG not in response.text and LONG not in response.text, response.text
    assert_numbers_read_one_way(response.text)
    [answer] = [m for m in client.messages(response) if m.get("id") == client.ids]
    assert "result" in answer, answer
    if method == "tools/call":
        [record] = new_records(proxy, before)
        assert record["code"] == "ok", record
