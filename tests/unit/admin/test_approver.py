"""`proxy.admin.approver`: who is asking on the admin routes, and an approver action's body."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from proxy.admin.approver import approver, authenticate, bearer, reasoned, unauthorized
from proxy.approvals.approvers import Approvers
from proxy.config import ApprovalsConfig, ApproverConfig

APPROVERS = Approvers(ApprovalsConfig(approvers={
    "op": ApproverConfig(token_sha256=hashlib.sha256(b"op-token").hexdigest())}))


def _request(authorization: str | None) -> web.Request:
    headers = {} if authorization is None else {"Authorization": authorization}
    return make_mocked_request("POST", "/v1/x", headers=headers)


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer op-token", "op-token"),
    ("bearer   op-token  ", "op-token"),  # the scheme is case-insensitive; spaces around the token
    ("BEARER op-token", "op-token"),
    ("Bearer", None), ("Bearer    ", None),  # no token
    ("Basic b3A6b3A=", None), ("op-token", None), (None, None),
])
def test_bearer_reads_only_a_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer(_request(header)) == token


def test_authenticate_names_the_approver_or_nobody() -> None:
    assert authenticate(APPROVERS, _request("Bearer op-token")) == "op"
    assert authenticate(APPROVERS, _request("Bearer op-token2")) is None
    assert authenticate(None, _request("Bearer op-token")) is None  # no approvers: nobody


def test_a_missing_and_a_wrong_token_get_their_own_401() -> None:
    missing, wrong = unauthorized(_request(None)), unauthorized(_request("Bearer nope"))
    assert (missing.status, wrong.status) == (401, 401)
    assert missing.headers["WWW-Authenticate"] == 'Bearer realm="envelope-approvals"'
    assert b"is required" in missing.body and b"not an approver's token" in wrong.body


class _Noted:
    def __init__(self) -> None:
        self.failures: list[tuple[str, str, str]] = []

    def failed(self, request: web.Request, token: str, subject: str, action: str) -> None:
        self.failures.append((token, subject, action))


def test_a_failed_attempt_is_noted_once_with_what_it_named() -> None:
    noted = _Noted()
    answer = approver(_request("Bearer nope"), APPROVERS, (noted, "release", lambda r: "d-1"))
    assert isinstance(answer, web.Response) and answer.status == 401
    assert noted.failures == [("unknown", "d-1", "release")]
    assert approver(_request("Bearer op-token"), APPROVERS, (noted, "release", lambda r: "d-1")) == "op"
    assert len(noted.failures) == 1  # a success notes nothing
    assert isinstance(approver(_request(None), APPROVERS, (None, "deny", lambda r: "x")), web.Response)


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async def action(request: web.Request) -> web.Response:
        body = await reasoned(request, 64, frozenset({"reason", "grant"}))
        return body if isinstance(body, web.Response) else web.json_response(body)

    app = web.Application()
    app.router.add_post("/act", action)
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.mark.parametrize(("body", "status", "error"), [
    (b'{"reason": "  checked  "}', 200, None),
    (b'{"reason": "ok", "grant": {"scope": "tool"}}', 200, None),
    (b"", 400, "a reason is required"),
    (b"{}", 400, "a reason is required"),
    (b'{"reason": " \\n\\t"}', 400, "a reason is required"),
    (b'{"reason": 7}', 400, "a reason is required"),
    (b'{"reason": "ok", "more": 1}', 400, "unexpected field(s): more"),
    (b'["reason"]', 400, 'body must be a JSON object: {"reason": "..."}'),
    (b"{not json", 400, 'body must be a JSON object: {"reason": "..."}'),
    (b'{"reason": "' + b"x" * 100 + b'"}', 413, "body larger than 64 bytes"),
])
async def test_an_action_body_needs_a_reason_and_nothing_unexpected(
        client: TestClient[Any, Any], body: bytes, status: int, error: str | None) -> None:
    resp = await client.post("/act", data=body, headers={"Content-Type": "application/json"})
    assert resp.status == status, await resp.text()
    answer = await resp.json()
    if error is None:
        assert answer["reason"] == answer["reason"].strip() and answer["reason"]
    else:
        assert answer == {"error": error}
