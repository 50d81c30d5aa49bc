"""The CLI's one admin API client: what it sends, what it returns, and its one error type."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from email.message import Message

import pytest

from proxy.cli.admin_client import AdminClient
from proxy.errors import AdminApiError, EnvelopeError

BASE = "http://127.0.0.1:9090"


class FakeOpener:
    """Stands in for urlopen: records each request, then answers or raises as told."""

    def __init__(self, body: bytes = b"{}", error: Exception | None = None):
        self.body = body
        self.error = error
        self.requests: list[tuple[urllib.request.Request, float]] = []

    @contextmanager
    def __call__(self, request: urllib.request.Request, timeout: float) -> Iterator[io.BytesIO]:
        self.requests.append((request, timeout))
        if self.error is not None:
            raise self.error
        yield io.BytesIO(self.body)


def http_error(url: str, code: int, body: bytes, reason: str = "Forbidden") -> urllib.error.HTTPError:
    return urllib.error.HTTPError(url, code, reason, Message(), io.BytesIO(body))


def test_get_sends_the_token_and_the_query_and_returns_json() -> None:
    opener = FakeOpener(json.dumps({"records": [1]}).encode())
    client = AdminClient(BASE + "/", "tok", timeout=7, opener=opener)
    assert client.get("/v1/shadow", {"run": None, "limit": 5}) == {"records": [1]}
    [(request, timeout)] = opener.requests
    assert request.full_url == f"{BASE}/v1/shadow?limit=5"
    assert request.get_method() == "GET"
    assert request.get_header("Authorization") == "Bearer tok"
    assert request.data is None and request.get_header("Content-type") is None
    assert timeout == 7


def test_post_sends_json() -> None:
    opener = FakeOpener(b'{"id": "a", "state": "approved"}')
    client = AdminClient(BASE, "tok", opener=opener)
    assert client.post("/v1/approvals/a/approve", {"reason": "ok"})["state"] == "approved"
    [(request, _)] = opener.requests
    assert request.get_method() == "POST"
    assert json.loads(request.data) == {"reason": "ok"}
    assert request.get_header("Content-type") == "application/json"


@pytest.mark.parametrize(("body", "message"), [
    (b'{"error": "cannot decide a call made by ops"}', "cannot decide a call made by ops"),
    (b'{"error": "two\\nlines"}', "two lines"),  # always one line
    (b"plain text from a proxy in between", "plain text from a proxy in between"),
    (b"", "Forbidden"),  # nothing said: the reason phrase
])
def test_a_refusal_carries_the_status_and_the_servers_message(body: bytes, message: str) -> None:
    url = f"{BASE}/v1/approvals/a/approve"
    client = AdminClient(BASE, opener=FakeOpener(error=http_error(url, 403, body)))
    with pytest.raises(AdminApiError) as info:
        client.post("/v1/approvals/a/approve", {"reason": "x"})
    exc = info.value
    assert isinstance(exc, EnvelopeError)
    assert (exc.status, exc.message, exc.url) == (403, message, url)
    assert str(exc) == f"{url}: HTTP 403: {message}"


@pytest.mark.parametrize("error", [
    urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")),
    TimeoutError("timed out"),
])
def test_cannot_reach_is_one_line_without_a_status(error: Exception) -> None:
    client = AdminClient(BASE, opener=FakeOpener(error=error))
    with pytest.raises(AdminApiError) as info:
        client.get("/v1/grants")
    assert info.value.status is None
    assert str(info.value).startswith(f"cannot reach the admin API at {BASE}: ")
    assert "\n" not in str(info.value)


def test_an_answer_that_is_not_json_is_an_error() -> None:
    client = AdminClient(BASE, opener=FakeOpener(b"<html>login</html>"))
    with pytest.raises(AdminApiError, match="the answer is not JSON") as info:
        client.get("/v1/grants")
    assert info.value.status is None


def test_from_flags_takes_the_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVELOPE_APPROVER_TOKEN", "from-env")
    assert AdminClient.from_flags(BASE, None).token == "from-env"
    assert AdminClient.from_flags(BASE, "flag").token == "flag"
    monkeypatch.delenv("ENVELOPE_APPROVER_TOKEN")
    assert AdminClient.from_flags(BASE, None).token == ""


def test_url_keeps_paths_and_drops_absent_query_values() -> None:
    client = AdminClient(BASE)
    assert client.url("/v1/approvals", {"state": "pending"}) == f"{BASE}/v1/approvals?state=pending"
    assert client.url("/v1/approvals", None) == f"{BASE}/v1/approvals"


def test_a_release_needs_a_reason_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    # As `approvals approve|deny`: refused before anything is sent.
    from proxy.cli import main

    with pytest.raises(SystemExit) as info:
        main(["idempotency", "release", "0" * 32, "--admin", "http://127.0.0.1:9"])
    assert info.value.code == 2
    assert "--reason" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["shadow", "list"],
    ["approvals", "list"],
    ["approvals", "approve", "apr-1", "--reason", "ok"],
    ["idempotency", "release", "0" * 32, "--reason", "checked"],
])
def test_every_admin_command_says_in_one_line_that_the_api_is_down(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main
    from tests.harness import free_port

    base = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main([*argv, "--admin", base, "--token", "t"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"envelope-proxy {argv[0]}: cannot reach the admin API at {base}: ")
    assert err.count("\n") == 1

