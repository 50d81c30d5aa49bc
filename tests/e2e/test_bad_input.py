"""Misbehaving clients against the real proxy: raw HTTP, answered with HTTP + JSON-RPC errors.

After all of them the proxy still serves, counts every rejection by reason, and its audit log
still verifies (`envelope-proxy audit verify` exit 0).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest
from e2e_helpers import cli

from tests.harness import ProxyProcess, mcp_client, metric_value, proxy_process, rpc, token

OPS = token("ops", tenant="acme")
REJECTED = "envelope_rejected_requests_total"

# reason label -> how many rejections of that reason this module causes
EXPECTED_REJECTIONS = {
    "parse_error": 3,  # malformed JSON, invalid UTF-8, the liveness probe after the huge body
    "batch": 1,
    "invalid_request": 3,
    "too_large": 1,
    "too_deep": 1,
    "bad_host": 1,
    "bad_origin": 1,
    "unauthenticated": 3,
}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("bad-input")
    with proxy_process(tmp, {"notes": sse_upstream.url}) as pp:
        yield pp


@pytest.fixture(scope="module")
def baseline(proxy: ProxyProcess) -> dict[str, Any]:
    """One valid call before the abuse starts, and the counters at that point."""
    import anyio

    async def go() -> Any:
        async with mcp_client(proxy.url("notes"), "auto", bearer=OPS) as c:
            return await c.call_tool("echo", {"text": "before"})

    result = anyio.run(go)
    assert result.structured_content == {"result": "before"}
    text = proxy.metrics()
    return {
        "records": proxy.audit_records(),
        "rejected": {r: metric_value(text, REJECTED, reason=r) for r in EXPECTED_REJECTIONS},
    }


def call_body(**params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "echo", "arguments": {"text": "x"}, **params}}


def assert_rpc_error(resp: httpx.Response, status: int, code: int) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["jsonrpc"] == "2.0"
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body


def test_malformed_json(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    resp = rpc(proxy.url("notes"), None, bearer=OPS, raw=b'{"jsonrpc": "2.0", "id": 1, "method": ')
    body = assert_rpc_error(resp, 400, -32700)
    assert body["id"] is None


def test_batch_is_refused(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    resp = rpc(proxy.url("notes"), [call_body(), call_body()], bearer=OPS)
    assert_rpc_error(resp, 400, -32600)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        pytest.param(call_body(arguments="text=x"), -32602, id="arguments-a-string"),
        pytest.param(call_body(name=42), -32602, id="name-an-int"),
        pytest.param({**call_body(), "jsonrpc": "1.0"}, -32600, id="jsonrpc-1.0"),
    ],
)
def test_wrong_types(proxy: ProxyProcess, baseline: dict[str, Any], body: Any, code: int) -> None:
    assert_rpc_error(rpc(proxy.url("notes"), body, bearer=OPS), 400, code)


def test_huge_body(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    big = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"text":"' \
        + b"a" * (50 * 2**20) + b'"}}}'
    try:
        resp = rpc(proxy.url("notes"), None, bearer=OPS, raw=big, timeout=30)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the proxy answered 413 and closed the connection while we were still sending
    else:
        assert resp.status_code == 413, resp.text[:200]
    # The proxy still serves: a fresh request gets a fresh (parse error) answer.
    ok = rpc(proxy.url("notes"), None, bearer=OPS, raw=b"{")
    assert_rpc_error(ok, 400, -32700)


def test_deep_nesting(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    deep = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"text":' \
        + b"[" * 10_000 + b"]" * 10_000 + b"}}}"
    resp = rpc(proxy.url("notes"), None, bearer=OPS, raw=deep)
    assert resp.status_code == 400
    assert "error" in resp.json()


def test_invalid_utf8(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    raw = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"text":"\xff\xfe"}}}'
    assert_rpc_error(rpc(proxy.url("notes"), None, bearer=OPS, raw=raw), 400, -32700)


def test_bad_host(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    resp = rpc(proxy.url("notes"), call_body(), bearer=OPS, headers={"Host": "evil.example"})
    assert resp.status_code == 421
    assert "error" in resp.json()


def test_bad_origin(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    resp = rpc(proxy.url("notes"), call_body(), bearer=OPS, headers={"Origin": "https://evil.example"})
    assert resp.status_code == 403
    assert "error" in resp.json()


@pytest.mark.parametrize(
    "bearer",
    [
        pytest.param(None, id="no-token"),
        pytest.param(jwt.encode({"sub": "ops", "exp": int(time.time()) + 600}, "another-secret-0123456789abcdefghij",
                                algorithm="HS256"), id="bad-signature"),
        pytest.param(token("ops", exp=int(time.time()) - 3600), id="expired"),
    ],
)
def test_unauthenticated(proxy: ProxyProcess, baseline: dict[str, Any], bearer: str | None) -> None:
    resp = rpc(proxy.url("notes"), call_body(), bearer=bearer)
    assert resp.status_code == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "error" in resp.json()


def test_unknown_upstream(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    resp = rpc(f"{proxy.base}/mcp/nope", call_body(), bearer=OPS)
    assert resp.status_code == 404
    assert "nope" in resp.json()["error"]["message"]


async def test_after_all_of_them(proxy: ProxyProcess, baseline: dict[str, Any]) -> None:
    # The proxy still serves a valid call.
    async with mcp_client(proxy.url("notes"), "legacy", bearer=OPS) as c:
        result = await c.call_tool("echo", {"text": "after"})
    assert result.is_error is False
    assert result.structured_content == {"result": "after"}
    # Every rejection was counted by reason.
    text = proxy.metrics()
    for reason, n in EXPECTED_REJECTIONS.items():
        got = metric_value(text, REJECTED, reason=reason) - baseline["rejected"][reason]
        assert got == n, f"{REJECTED}{{reason={reason!r}}} rose by {got}, expected {n}"
    # Rejected requests were never audited as decisions; earlier records are unchanged.
    records = proxy.audit_records()
    before = baseline["records"]
    assert records[: len(before)] == before
    assert [r["args"]["text"] for r in records[len(before):]] == ["after"]
    done = cli("audit", "verify", str(proxy.audit_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok")


def test_a_tools_call_without_an_id_is_refused_not_forwarded(proxy: ProxyProcess,
                                                             baseline: dict[str, Any]) -> None:
    """A `tools/call` sent as a notification would bypass the envelope (nothing answers a
    notification): it is refused, never forwarded, never performed."""
    before = len(proxy.audit_records())
    body = {k: v for k, v in call_body().items() if k != "id"}
    err = assert_rpc_error(rpc(proxy.url("notes"), body, bearer=OPS), 400, -32600)
    assert "must be a request" in err["error"]["message"]
    assert len(proxy.audit_records()) == before


def test_an_mcp_method_header_that_disagrees_with_the_body_is_refused(proxy: ProxyProcess,
                                                                     baseline: dict[str, Any]) -> None:
    resp = rpc(proxy.url("notes"), call_body(), bearer=OPS, headers={"Mcp-Method": "tools/list"})
    err = assert_rpc_error(resp, 400, -32020)
    assert "does not match" in err["error"]["message"] and err["id"] == 7
