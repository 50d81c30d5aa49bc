"""The adversarial pass on HTTP (OpenAPI) upstreams, both ways in: the real proxy process in
front of the hostile REST service of `hostile_rest.py`, called as an MCP client (`/mcp/hostile`)
and as a plain HTTP client (`/http/hostile/...`).

The four promises, attacked: a path or header parameter must not change the request the policy
decided on (dot segments, CR/LF), everything the backend sends toward the agent is inspected
(gzip-encoded bodies, response headers), a writer reaches the backend at most once (no resend
after a reset, even with an idempotency key the backend never sees), and a failure refuses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc
from hostile_rest import INJECTED_NUMBER, INJECTED_ORDER, SECRET, SPEC

from tests.harness import ROOT, ProxyProcess, free_port, proxy_process, rpc, stop, token, wait_port

AGENT = token("agent", groups=["ops"])
PROBLEM = "application/problem+json"
POLICY: dict[str, Any] = {
    "version": 1,
    "upstreams": {"hostile": {"url": "http://127.0.0.1:1", "openapi": "hostile.json", "timeout": "3s"},
                  # The same service behind the proxy's own credential, in a header the spec also
                  # declares as a parameter (named in another case).
                  "keyed": {"url": "http://127.0.0.1:1", "openapi": "hostile.json", "timeout": "3s",
                            "headers": {"x-tag": "the proxy's credential"}}},
    "defaults": {"unknown_tools": "deny", "guardrails": [{"detector": "secrets", "action": "redact"}]},
    "tools": {
        "hostile.getItem": {"effect": "read"},
        "hostile.getGzipped": {"effect": "read"},
        "hostile.getGzippedTwice": {"effect": "read"},
        "hostile.getMyItems": {"effect": "read", "allow": "false"},
        "hostile.getDeep": {"effect": "read"},
        "hostile.getShort": {"effect": "read"},
        "hostile.getLeaky": {"effect": "read"},
        "hostile.getWide": {"effect": "read"},
        "hostile.getWideText": {"effect": "read"},
        "hostile.getSplit": {"effect": "read"},
        "hostile.getMoved": {"effect": "read"},
        "hostile.createOrder": {"effect": "write"},
        "hostile.getEarly": {"effect": "read"},
        "hostile.getUnchanged": {"effect": "read"},
        "hostile.getTrickle": {"effect": "read"},
        "hostile.getTicket": {"effect": "read", "output": "untrusted"},
        "hostile.refundOrder": {"effect": "write"},
        # Untrusted, but for its id (a label by path: the structured walk reads the output).
        # Trusted, but for its customer-written comment (a label by path).
        "hostile.getMemo": {"effect": "read", "output": "trusted", "labels": {"/comment": {"output": "untrusted"}}},
        "hostile.getNote": {"effect": "read", "output": "untrusted", "labels": {"/id": {"output": "trusted"}}},
        "keyed.getItem": {"effect": "read"},
    },
}


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "e2e" / "hostile_rest.py"),
                             "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory, backend: str) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("openapi-adversarial")
    policies = write_doc(tmp / "policies", POLICY)
    (policies / "hostile.json").write_text(json.dumps(SPEC))
    with proxy_process(tmp, {"hostile": backend, "keyed": backend}, policies=policies) as proxy:
        yield proxy


def _http(pp: ProxyProcess, method: str, path: str, headers: dict[str, str] | None = None,
          **kw: Any) -> httpx.Response:
    hdrs = {"Authorization": f"Bearer {AGENT}", **(headers or {})}
    return httpx.request(method, f"{pp.base}/http/hostile{path}", headers=hdrs, timeout=15, **kw)


def _tool(pp: ProxyProcess, name: str, arguments: dict[str, Any],
          meta: dict[str, Any] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"name": name, "arguments": arguments}
    if meta:
        params["_meta"] = meta
    resp = rpc(pp.url("hostile"), {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params},
               bearer=AGENT, timeout=15)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def _seen(backend: str) -> list[dict[str, Any]]:
    """What reached the backend, without the proxies' health probes (a HEAD every 10 s, which
    may land between two looks)."""
    requests: list[dict[str, Any]] = httpx.get(f"{backend}/_stats", timeout=5).json()["requests"]
    return [r for r in requests if r["method"] != "HEAD"]


def _records(pp: ProxyProcess, decision_id: str) -> list[dict[str, Any]]:
    return [r for r in pp.audit_records() if r["decision_id"] == decision_id]


def _mcp_refusal(answer: dict[str, Any]) -> dict[str, Any]:
    """The decision an MCP refusal carries (an `isError` result with it in `_meta`)."""
    result = answer["result"]
    assert result.get("isError") is True, answer
    decision: dict[str, Any] = result["_meta"]["envelope/decision"]
    return decision


# ---- a path parameter must not change the target -------------------------------------------

@pytest.mark.parametrize("value", ["..", ".", "", "a/../../admin", "a\\..\\admin", "x\x00y"])
def test_mcp_path_parameter_that_would_leave_its_segment_is_refused(
        pp: ProxyProcess, backend: str, value: str) -> None:
    before = len(_seen(backend))
    decision = _mcp_refusal(_tool(pp, "getItem", {"itemId": value}))
    assert (decision["code"], decision["check"]) == ("schema_invalid", "schema")
    assert _seen(backend)[before:] == []  # never sent
    [rec] = _records(pp, decision["decision_id"])
    assert rec["code"] == "schema_invalid" and rec["upstream_status"] is None


@pytest.mark.parametrize("value", ["%2e%2e", "..a", "wel/come", "caf\u00e9"])
def test_mcp_path_parameter_is_sent_inside_its_one_segment(pp: ProxyProcess, backend: str, value: str) -> None:
    before = len(_seen(backend))
    answer = _tool(pp, "getItem", {"itemId": value})
    assert answer["result"]["structuredContent"] == {"id": value}
    [seen] = _seen(backend)[before:]
    assert seen["raw_path"].count("/") == 2 and seen["raw_path"].startswith("/items/"), seen


@pytest.mark.parametrize("raw", ["/items/%2e%2e", "/items/%2E", "/items/%2e", "/items/a%2F%2E%2E%2Fadmin",
                                 "/items/a%00b"])
def test_http_path_parameter_that_would_leave_its_segment_is_refused(
        pp: ProxyProcess, backend: str, raw: str) -> None:
    before = len(_seen(backend))
    resp = _http(pp, "GET", raw)
    assert resp.status_code == 403, resp.text
    assert resp.headers["Content-Type"].startswith(PROBLEM)
    assert resp.json()["code"] == "schema_invalid"
    assert _seen(backend)[before:] == []
    assert len(_records(pp, resp.json()["decision_id"])) == 1


def test_http_path_parameter_that_is_not_utf8_is_refused(pp: ProxyProcess, backend: str) -> None:
    before = len(_seen(backend))
    resp = _http(pp, "GET", "/items/%ff")  # was decoded to U+FFFD and sent as a value never given
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "invalid_request"
    assert _seen(backend)[before:] == []


# ---- header parameters: never split, never non-ASCII -------------------------------------

@pytest.mark.parametrize("value", ["a\r\nX-Injected: 1", "a\nb", "caf\u00e9", "a\x00b"])
def test_mcp_header_parameter_with_control_or_non_ascii_is_refused(
        pp: ProxyProcess, backend: str, value: str) -> None:
    before = len(_seen(backend))
    decision = _mcp_refusal(_tool(pp, "getItem", {"itemId": "1", "X-Tag": value}))
    # The schema refuses it, rather than the transport failing (which counted the upstream down).
    assert (decision["code"], decision["check"]) == ("schema_invalid", "schema")
    assert _seen(backend)[before:] == []


def test_http_front_passes_only_declared_headers_and_query(pp: ProxyProcess, backend: str) -> None:
    resp = _http(pp, "GET", "/items/1?q=a%26b%3Dc%23d&undeclared=1", headers={
        "X-Tag": "t", "Cookie": "sid=agent", "X-HTTP-Method-Override": "DELETE",
        "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Host": "admin.internal"})
    assert resp.status_code == 200, resp.text
    seen = _seen(backend)[-1]
    assert seen["raw_path"] == "/items/1?q=a%26b%3Dc%23d"
    sent = {k.lower() for k in seen["headers"]}
    assert sent <= {"host", "accept-encoding", "x-tag"}, sent
    assert seen["headers"]["Host"] == backend.removeprefix("http://")


@pytest.mark.parametrize("front", ["mcp", "http"])
def test_a_header_parameter_never_overrides_the_proxys_own_header_whatever_its_case(
        pp: ProxyProcess, backend: str, front: str) -> None:
    """The upstream's configured `headers` go last: an agent's value for a header parameter of
    the same name in another case is replaced, never sent beside it (a server reading the first
    field took the agent's)."""
    if front == "mcp":
        resp = rpc(pp.url("keyed"), {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "getItem", "arguments": {"itemId": "1", "X-Tag": "the agent's"}}}, bearer=AGENT, timeout=15)
        assert resp.json()["result"]["structuredContent"] == {"id": "1"}, resp.text
    else:
        resp = httpx.get(f"{pp.base}/http/keyed/items/1", timeout=15, headers={
            "Authorization": f"Bearer {AGENT}", "X-Tag": "the agent's"})
        assert resp.status_code == 200, resp.text
    sent = [v for k, v in _seen(backend)[-1]["raw_headers"] if k.lower() == "x-tag"]
    assert sent == ["the proxy's credential"]


# ---- what the backend sends back is inspected ----------------------------------------------

def test_mcp_gzip_encoded_secret_is_decoded_and_redacted(pp: ProxyProcess, backend: str) -> None:
    answer = _tool(pp, "getGzipped", {})
    assert answer["result"]["structuredContent"] == {"note": "key [REDACTED:aws_access_key_id]"}
    assert _seen(backend)[-1]["headers"]["Accept-Encoding"] == "identity"


def test_http_gzip_encoded_secret_is_decoded_and_redacted(pp: ProxyProcess) -> None:
    resp = _http(pp, "GET", "/gzipped")
    assert resp.status_code == 200
    assert "content-encoding" not in resp.headers  # the body delivered is the decoded one
    assert resp.json() == {"note": "key [REDACTED:aws_access_key_id]"}
    assert int(resp.headers["Content-Length"]) == len(resp.content)


@pytest.mark.parametrize("front", ["mcp", "http"])
@pytest.mark.parametrize("tool, path", [("getWide", "/wide"), ("getWideText", "/wide-text"),
                                        ("getSplit", "/split")])
def test_a_body_another_reader_reads_otherwise_refuses_rather_than_passing_unread(
        pp: ProxyProcess, front: str, tool: str, path: str) -> None:
    """The guardrails read a body as UTF-8 (where UTF-16 is the secret's letters between NULs,
    and a byte that is not UTF-8 is U+FFFD inside it: no match); a JSON reader detects UTF-16
    (RFC 4627; Python's `json`, httpx's `.json()`), a text reader follows `charset=` or drops
    bytes that are not UTF-8: the agent read the secret. Refused instead."""
    if front == "mcp":
        answer = _tool(pp, tool, {})
        assert SECRET not in json.dumps(answer).replace("\\u0000", ""), answer
        decision = _mcp_refusal(answer)
    else:
        resp = _http(pp, "GET", path)
        for encoding in ("utf-8", "utf-16", "utf-16-le"):  # as any reader may read it
            assert SECRET not in resp.content.decode(encoding, "replace"), resp.content
        assert SECRET not in resp.content.decode("utf-8", "ignore"), resp.content
        assert resp.status_code == 502 and resp.headers["Content-Type"].startswith(PROBLEM), resp.text
        decision = resp.json()
    assert decision["code"] == "upstream_error"
    assert len(_records(pp, decision["decision_id"])) == 1


@pytest.mark.parametrize("front", ["mcp", "http"])
def test_a_coding_named_in_two_fields_refuses(pp: ProxyProcess, front: str) -> None:
    """Two `Content-Encoding` fields are two codings (RFC 9110 5.3), which the proxy does not
    undo: only the first was read, and the body relayed (gzip still) carried the secret past
    the guardrails to an agent that gunzips it."""
    if front == "mcp":
        decision = _mcp_refusal(_tool(pp, "getGzippedTwice", {}))
    else:
        resp = _http(pp, "GET", "/gzipped-twice")
        assert resp.status_code == 502 and resp.headers["Content-Type"].startswith(PROBLEM), resp.content[:80]
        decision = resp.json()
    assert decision["code"] == "upstream_error"
    assert "Content-Encoding" in decision["reason"], decision
    assert len(_records(pp, decision["decision_id"])) == 1


def test_http_response_headers_are_only_the_body_describing_ones(pp: ProxyProcess) -> None:
    resp = _http(pp, "GET", "/leaky")
    assert resp.status_code == 200
    assert resp.json() == {"ok": True}
    assert SECRET not in str(resp.headers)  # X-Debug-Token: never inspected, so never relayed
    assert "set-cookie" not in resp.headers and "etag" not in resp.headers
    # A relayed header is inspected with the body: the secret in it is redacted.
    assert resp.headers["Cache-Control"] == 'no-store, x-debug="[REDACTED:aws_access_key_id]"'
    assert resp.headers["Content-Type"].startswith("application/json")


def test_http_redirect_is_neither_followed_nor_pointed_at(pp: ProxyProcess, backend: str) -> None:
    before = len(_seen(backend))
    resp = _http(pp, "GET", "/moved")
    assert resp.status_code == 302
    assert "location" not in resp.headers
    assert [s["raw_path"] for s in _seen(backend)[before:]] == ["/moved"]


def test_mcp_redirect_is_an_error_result_neither_followed_nor_pointed_at(
        pp: ProxyProcess, backend: str) -> None:
    # An empty success would tell the agent the operation ran.
    before = len(_seen(backend))
    audited = len([r for r in pp.audit_records() if r["tool"] == "getMoved"])
    result = _tool(pp, "getMoved", {})["result"]
    assert result["isError"] is True, result
    assert result["content"][0]["text"].startswith("HTTP 302: "), result
    assert "evil.example" not in json.dumps(result)
    assert [s["raw_path"] for s in _seen(backend)[before:]] == ["/moved"]
    records = [r for r in pp.audit_records() if r["tool"] == "getMoved"]
    assert len(records) == audited + 1 and records[-1]["upstream_status"] == 302, records[-1]


# ---- a writer reaches the backend at most once ----------------------------------------------

@pytest.mark.parametrize("front", ["mcp", "http"])
def test_keyed_post_is_not_resent_after_a_reset(pp: ProxyProcess, backend: str, front: str) -> None:
    httpx.post(f"{backend}/_reset", timeout=5)
    before = len(_seen(backend))
    key = f"order-{front}-reset"
    if front == "mcp":
        decision = _mcp_refusal(_tool(pp, "createOrder", {"sku": "x"}, meta={"envelope/idempotency_key": key}))
    else:
        resp = _http(pp, "POST", "/orders", headers={"Idempotency-Key": key}, json={"sku": "x"})
        assert resp.status_code >= 500, resp.text
        decision = resp.json()
    assert decision["code"] == "upstream_error"
    posts = [s for s in _seen(backend)[before:] if s["method"] == "POST"]
    assert len(posts) == 1, posts  # the backend never saw the key: a resend would run it twice
    assert len(_records(pp, decision["decision_id"])) == 1


# ---- the operation sent is the operation decided ---------------------------------------------

def test_mcp_path_parameter_equal_to_a_concrete_sibling_is_refused(pp: ProxyProcess, backend: str) -> None:
    # getMyItems (GET /items/mine) is denied; getItem(itemId="mine") is the same request, which
    # the service routes to getMyItems: it must not run an operation the policy refused.
    assert _mcp_refusal(_tool(pp, "getMyItems", {}))["code"] == "unauthorized"
    before = len(_seen(backend))
    decision = _mcp_refusal(_tool(pp, "getItem", {"itemId": "mine"}))
    assert decision["check"] == "forward"  # allowed, but no request is built: never sent
    assert _seen(backend)[before:] == []
    assert len(_records(pp, decision["decision_id"])) == 1
    resp = _http(pp, "GET", "/items/mine")  # the plain HTTP front matches the concrete one
    assert resp.status_code == 403 and resp.json()["code"] == "unauthorized"
    assert _seen(backend)[before:] == []


# ---- a backend's malformed answers refuse or are inspected, and are audited -------------------

@pytest.mark.parametrize("front", ["mcp", "http"])
def test_json_too_deep_to_parse_is_a_text_result_audited_once(pp: ProxyProcess, front: str) -> None:
    # Was a RecursionError in the executor: a bare 500, and no audit record of a call that ran.
    before = [r for r in pp.audit_records() if r["tool"] == "getDeep"]
    if front == "mcp":
        result = _tool(pp, "getDeep", {})["result"]
        assert "structuredContent" not in result and result["content"][0]["text"].startswith("[[[")
    else:
        resp = _http(pp, "GET", "/deep")
        assert resp.status_code == 200, resp.text[:200]
        assert resp.content.startswith(b"[[[")
    after = [r for r in pp.audit_records() if r["tool"] == "getDeep"]
    assert len(after) == len(before) + 1 and after[-1]["code"] == "ok"


@pytest.mark.parametrize("front", ["mcp", "http"])
def test_a_body_shorter_than_its_content_length_refuses(pp: ProxyProcess, front: str) -> None:
    if front == "mcp":
        decision = _mcp_refusal(_tool(pp, "getShort", {}))
    else:
        resp = _http(pp, "GET", "/short")
        assert resp.status_code >= 500 and resp.headers["Content-Type"].startswith(PROBLEM), resp.text
        decision = resp.json()
    assert decision["code"] == "upstream_error"
    assert len(_records(pp, decision["decision_id"])) == 1


def test_an_idempotency_key_replays_across_fronts_and_refuses_other_arguments(
        pp: ProxyProcess, backend: str) -> None:
    before = len([s for s in _seen(backend) if s["method"] == "POST"])
    first = _http(pp, "POST", "/orders", headers={"Idempotency-Key": "order-both"}, json={"sku": "a"})
    assert first.status_code == 201, first.text
    replay = _tool(pp, "createOrder", {"sku": "a"}, meta={"envelope/idempotency_key": "order-both"})
    assert replay["result"]["structuredContent"] == {"created": True}
    assert replay["result"]["_meta"]["envelope/decision"]["code"] == "replayed"
    other = _http(pp, "POST", "/orders", headers={"Idempotency-Key": "order-both"}, json={"sku": "b"})
    assert other.status_code == 403 and other.json()["code"] == "idempotency_conflict"
    assert len([s for s in _seen(backend) if s["method"] == "POST"]) == before + 1



# ---- data flow ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flow_pp(tmp_path_factory: pytest.TempPathFactory, backend: str) -> Iterator[ProxyProcess]:
    """The same upstream with data flow enforced (its own process: the other tests make calls
    in no run, and their untrusted answers must not flag one another)."""
    tmp = tmp_path_factory.mktemp("openapi-adversarial-flow")
    policies = write_doc(tmp / "policies", {**POLICY, "dataflow": {"mode": "enforce"}})
    (policies / "hostile.json").write_text(json.dumps(SPEC))
    with proxy_process(tmp, {"hostile": backend, "keyed": backend}, policies=policies) as proxy:
        yield proxy


@pytest.mark.parametrize("front", ["mcp", "http"])
def test_untrusted_text_cannot_flow_into_a_writers_path_parameter(
        flow_pp: ProxyProcess, backend: str, front: str) -> None:
    run = {"X-Envelope-Run": f"run-{uuid.uuid4().hex}"}
    read = _http(flow_pp, "GET", "/tickets/t1", headers=run)
    assert read.status_code == 200 and INJECTED_ORDER in read.text
    before = len(_seen(backend))
    if front == "http":
        resp = _http(flow_pp, "POST", f"/orders/{INJECTED_ORDER}/refund", headers=run)
        assert resp.status_code == 403, resp.text
        decision = resp.json()
    else:
        answer = rpc(flow_pp.url("hostile"), {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "refundOrder", "arguments": {"orderId": INJECTED_ORDER}}}, bearer=AGENT, headers=run,
            timeout=15)
        decision = _mcp_refusal(answer.json())
    assert (decision["code"], decision["check"]) == ("dataflow_policy_blocked", "dataflow")
    assert _seen(backend)[before:] == []


@pytest.mark.parametrize("front", ["mcp", "http"])
@pytest.mark.parametrize("note, injected", [("n1", INJECTED_ORDER), ("big", str(INJECTED_NUMBER))])
def test_untrusted_text_that_parsing_loses_is_recorded(
        flow_pp: ProxyProcess, backend: str, front: str, note: str, injected: str) -> None:
    """A body giving a member twice parses to its last value, an integer past 64 bits to a float;
    the body the agent reads has both values, the digits whole. With a label by path, the text
    was skipped as "a copy of structuredContent" (equal once parsed), so the injected order
    never reached the ledger and a refund of it ran."""
    run = {"X-Envelope-Run": f"run-{uuid.uuid4().hex}"}
    if front == "http":
        read = _http(flow_pp, "GET", f"/notes/{note}", headers=run)
        assert read.status_code == 200 and injected in read.text, read.text
    else:
        answer = rpc(flow_pp.url("hostile"), {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "getNote", "arguments": {"noteId": note}}}, bearer=AGENT, headers=run, timeout=15).json()
        assert answer["result"]["structuredContent"]["text"] == "closed", answer
        assert injected in answer["result"]["content"][0]["text"], answer
    before = len(_seen(backend))
    resp = _http(flow_pp, "POST", f"/orders/{injected}/refund", headers=run)
    assert resp.status_code == 403, resp.text
    assert (resp.json()["code"], resp.json()["check"]) == ("dataflow_policy_blocked", "dataflow")
    assert _seen(backend)[before:] == []
    assert len(_records(flow_pp, resp.json()["decision_id"])) == 1


@pytest.mark.parametrize("front", ["mcp", "http"])
@pytest.mark.parametrize("memo", ["plain", "bom"])
def test_untrusted_part_of_a_body_that_is_text_only_is_recorded(
        flow_pp: ProxyProcess, backend: str, front: str, memo: str) -> None:
    """A JSON body after a byte order mark does not parse (orjson): the result is its text,
    with no structuredContent for the label by path to apply to, and the text had the tool's
    label (trusted): the untrusted comment in it never reached the ledger and the refund it
    asks for ran. A JSON reader (httpx's `.json()`, a model) reads the comment all the same."""
    run = {"X-Envelope-Run": f"run-{uuid.uuid4().hex}"}
    if front == "http":
        read = _http(flow_pp, "GET", f"/memos/{memo}", headers=run)
        assert read.status_code == 200 and read.json()["comment"].count(INJECTED_ORDER) == 1, read.text
    else:
        answer = rpc(flow_pp.url("hostile"), {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "getMemo", "arguments": {"memoId": memo}}}, bearer=AGENT, headers=run, timeout=15).json()
        assert INJECTED_ORDER in answer["result"]["content"][0]["text"], answer
    before = len(_seen(backend))
    resp = _http(flow_pp, "POST", f"/orders/{INJECTED_ORDER}/refund", headers=run)
    assert resp.status_code == 403, resp.text
    assert (resp.json()["code"], resp.json()["check"]) == ("dataflow_policy_blocked", "dataflow")
    assert _seen(backend)[before:] == []


@pytest.mark.parametrize("front", ["mcp", "http"])
def test_informational_and_not_modified_answers(pp: ProxyProcess, front: str) -> None:
    # A 103 before the answer is skipped: the 200 after it is the one inspected and delivered.
    if front == "mcp":
        early = _tool(pp, "getEarly", {})["result"]["structuredContent"]
        assert early == {"final": True, "token": "[REDACTED:aws_access_key_id]"}
        assert _tool(pp, "getUnchanged", {})["result"]["content"] == []
    else:
        resp = _http(pp, "GET", "/early")
        assert resp.status_code == 200 and "link" not in resp.headers
        assert resp.json() == {"final": True, "token": "[REDACTED:aws_access_key_id]"}
        unchanged = _http(pp, "GET", "/unchanged")
        assert unchanged.status_code == 304 and unchanged.content == b""



def test_a_slow_trickle_is_cut_at_the_upstream_timeout(pp: ProxyProcess) -> None:
    started = time.monotonic()
    resp = _http(pp, "GET", "/trickle")  # no read waits long; the whole exchange is bounded
    assert resp.status_code == 504, resp.text
    assert resp.json()["code"] == "upstream_timeout"
    assert time.monotonic() - started < 8  # the upstream's timeout is 3 s; the trickle takes 10
    assert len(_records(pp, resp.json()["decision_id"])) == 1
