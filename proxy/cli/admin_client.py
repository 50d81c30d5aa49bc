"""The one client of the admin API the CLI uses: base URL, bearer token, timeout, JSON in/out.

Every command that talks to a running proxy's admin listener (`approvals`, `shadow`) goes
through `AdminClient`; a failure is always one `AdminApiError`, whose `status` is None when the
listener cannot be reached (or its answer is not JSON) and the HTTP status otherwise, with the
server's own error message.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from proxy.errors import AdminApiError

DEFAULT_ADMIN_URL = "http://127.0.0.1:9090"
DEFAULT_TIMEOUT = 30.0
ADMIN_URL_ENV = "ENVELOPE_ADMIN_URL"
TOKEN_ENV = "ENVELOPE_APPROVER_TOKEN"


class _Response(Protocol):
    def read(self) -> bytes: ...


# How a request is sent: `urllib.request.urlopen`; unit tests pass a fake one.
Opener = Callable[[urllib.request.Request, float], AbstractContextManager[_Response]]


def _urlopen(request: urllib.request.Request, timeout: float) -> AbstractContextManager[_Response]:
    return urllib.request.urlopen(request, timeout=timeout)


def default_admin_url() -> str:
    """The admin listener URL commands default to: `ENVELOPE_ADMIN_URL`, else loopback:9090."""
    return os.environ.get(ADMIN_URL_ENV, DEFAULT_ADMIN_URL)


class AdminClient:
    """Requests to one admin listener with one bearer token (the approver's)."""

    def __init__(self, base_url: str, token: str = "", timeout: float = DEFAULT_TIMEOUT,
                 opener: Opener = _urlopen):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._open = opener

    @classmethod
    def from_flags(cls, admin: str, token: str | None) -> AdminClient:
        """The client for `--admin URL` and `--token` (absent: `ENVELOPE_APPROVER_TOKEN`)."""
        return cls(admin, token or os.environ.get(TOKEN_ENV, ""))

    def url(self, path: str, query: Mapping[str, object] | None = None) -> str:
        """The full URL of `path`, with the query's non-None values encoded."""
        params = {k: v for k, v in (query or {}).items() if v is not None}
        return self.base_url + path + (f"?{urllib.parse.urlencode(params)}" if params else "")

    def get(self, path: str, query: Mapping[str, object] | None = None) -> Any:
        return self.request("GET", path, query=query)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body=body)

    def request(self, method: str, path: str, *, query: Mapping[str, object] | None = None,
                body: Any = None) -> Any:
        """The parsed JSON answer of a successful request.

        Raises `AdminApiError`: with the HTTP status and the server's message when the API
        refuses (4xx/5xx); with status None when the listener cannot be reached, times out or
        answers something that is not JSON.
        """
        url = self.url(path, query)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with self._open(req, self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise AdminApiError(self.base_url, url, _server_message(exc), exc.code) from exc
        except OSError as exc:  # refused, unreachable, timed out (URLError is an OSError)
            raise AdminApiError(self.base_url, url, str(exc)) from exc
        try:
            return json.loads(raw or b"null")
        except ValueError as exc:
            raise AdminApiError(self.base_url, url, f"the answer is not JSON: {exc}") from exc


def _server_message(exc: urllib.error.HTTPError) -> str:
    """The server's message for a refusal: its JSON `error`, else the body, else the reason."""
    try:
        raw = exc.read()
    except OSError:
        raw = b""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("error") is not None:
        return str(data["error"])
    return raw.decode(errors="replace").strip() or str(exc.reason)
