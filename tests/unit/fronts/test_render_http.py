"""`render.http_response`: what a plain HTTP client gets for each way a call ends."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.envelope.outcome import held_result, refusal_result
from proxy.envelope.types import ALLOWED, Code, Decision, Outcome, Verdict, deny
from proxy.fronts.render import PROBLEM_JSON, http_response

UPSTREAM_HEADERS = {"Content-Type": "application/json", "Content-Length": "17", "X-Trace": "t1"}


def _body(response: Any) -> Any:
    return orjson.loads(response.body)


def test_refusal_is_problem_details_with_the_mcp_text_and_the_decision() -> None:
    decision = deny(Code.CAPABILITY_BLOCKED, "arg_rules", "no refunds above 100", "big-refund")
    response = http_response(Outcome("refuse", decision, "d1"), None)
    assert response.status == 403
    assert response.content_type == PROBLEM_JSON
    body = _body(response)
    assert body == {
        "type": "urn:envelope-proxy:problem:capability_blocked", "title": "Capability blocked",
        "status": 403, "detail": refusal_result(decision, "d1")["content"][0]["text"],
        "code": "capability_blocked", "check": "arg_rules", "rule": "big-refund",
        "reason": "no refunds above 100", "decision_id": "d1",
    }
    assert body["detail"] == "Blocked by policy (capability_blocked): no refunds above 100"


def test_status_by_code() -> None:
    cases = {Code.UNKNOWN_TOOL: 403, Code.SCHEMA_INVALID: 403, Code.UNAUTHORIZED: 403,
             Code.UPSTREAM_TIMEOUT: 504, Code.UPSTREAM_ERROR: 502, Code.RATE_LIMITED: 429}
    for code, status in cases.items():
        response = http_response(Outcome("refuse", deny(code, "x", "why"), "d"), None)
        assert (code, response.status) == (code, status)
        assert response.content_type == PROBLEM_JSON


def test_held_approval_is_428_with_retry_after_and_the_approval_id() -> None:
    decision = Decision(Verdict.DENY, Code.APPROVAL_PENDING, "approval", "approval a1 is pending",
                        "tools.billing.refund.approval", audit={"approval_id": "a1"})
    response = http_response(Outcome("refuse", decision, "d2"), None)
    assert response.status == 428
    assert int(response.headers["Retry-After"]) > 0
    body = _body(response)
    assert body["approval_id"] == "a1" and body["code"] == "approval_pending"


def test_rate_limit_says_when_to_retry() -> None:
    decision = Decision(Verdict.DENY, Code.RATE_LIMITED, "rate_limit", "retry in 2.4s", retry_after=2.4)
    response = http_response(Outcome("refuse", decision, "d"), None)
    assert response.status == 429 and response.headers["Retry-After"] == "3"
    assert _body(response)["retry_after"] == 2.4


def test_unchanged_answer_is_relayed_as_it_came() -> None:
    raw = b'{"id": "inv-1"}\n'
    outcome = Outcome("deliver", ALLOWED, "d3", {"result": {}}, raw, 201)
    response = http_response(outcome, UPSTREAM_HEADERS)
    assert response.status == 201 and response.body == raw
    assert response.headers["X-Trace"] == "t1"
    assert response.headers["Content-Type"] == "application/json"
    assert "17" not in response.headers.getall("Content-Length", [])


def test_rewritten_json_answer_is_rendered_from_structured_content() -> None:
    result = {"content": [{"type": "text", "text": '{"key":"[REDACTED]"}'}],
              "structuredContent": {"key": "[REDACTED]"}}
    outcome = Outcome("deliver", ALLOWED, "d4", {"result": result}, None, 200)
    response = http_response(outcome, UPSTREAM_HEADERS)
    assert response.status == 200
    assert _body(response) == {"key": "[REDACTED]"}
    assert response.content_type == "application/json"
    assert response.headers["X-Trace"] == "t1"


def test_rewritten_array_answer_is_unwrapped() -> None:
    result = {"content": [{"type": "text", "text": '[1,"[REDACTED]"]'}],
              "structuredContent": {"result": [1, "[REDACTED]"]}}
    response = http_response(Outcome("deliver", ALLOWED, "d", {"result": result}, None, 200),
                             UPSTREAM_HEADERS)
    assert _body(response) == [1, "[REDACTED]"]


def test_rewritten_text_error_answer_keeps_its_status_and_drops_the_mcp_prefix() -> None:
    result = {"content": [{"type": "text", "text": "HTTP 500: boom [REDACTED]"}], "isError": True}
    outcome = Outcome("deliver", ALLOWED, "d", {"result": result}, None, 500)
    response = http_response(outcome, {"Content-Type": "text/plain; charset=utf-8"})
    assert response.status == 500 and response.body == b"boom [REDACTED]"
    assert response.content_type == "text/plain"


def test_replay_is_the_held_result_marked() -> None:
    decision = Decision(Verdict.ALLOW, Code.REPLAYED, "idempotency", "replayed",
                        result={"content": [{"type": "text", "text": '{"id":"inv-1"}'}],
                                "structuredContent": {"id": "inv-1"}})
    outcome = Outcome("held", decision, "d5", held_result(decision, "d5"))
    response = http_response(outcome, None)
    assert response.status == 200
    assert response.headers["X-Envelope-Decision"] == "replayed"
    assert _body(response) == {"id": "inv-1"}
