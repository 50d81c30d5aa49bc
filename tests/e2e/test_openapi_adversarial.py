"""The adversarial pass on HTTP (OpenAPI) upstreams, both ways in: the real proxy process in
front of the hostile REST service of `hostile_rest.py`, called as an MCP client (`/mcp/hostile`)
and as a plain HTTP client (`/http/hostile/...`).

The four promises, attacked: a path or header parameter must not change the request the policy
decided on (dot segments, CR/LF), everything the backend sends toward the agent is inspected
(gzip-encoded bodies, response headers), a writer reaches the backend at most once (no resend
after a reset, even with an idempotency key the backend never sees), and a failure refuses.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc

from tests.harness import ROOT, ProxyProcess, free_port, proxy_process, rpc, stop, token, wait_port

sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from hostile_rest import SECRET, SPEC  # noqa: E402

AGENT = token("agent", groups=["ops"])
PROBLEM = "application/problem+json"
POLICY: dict[str, Any] = {
    "version": 1,
    "upstreams": {"hostile": {"url": "http://127.0.0.1:1", "openapi": "hostile.json", "timeout": "3s"}},
    "defaults": {"unknown_tools": "deny", "guardrails": [{"detector": "secrets", "action": "redact"}]},
    "tools": {
        "hostile.getItem": {"effect": "read"},
        "hostile.getGzipped": {"effect": "read"},
        "hostile.getLeaky": {"effect": "read"},
        "hostile.getMoved": {"effect": "read"},
        "hostile.createOrder": {"effect": "write"},
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
    import json

    tmp = tmp_path_factory.mktemp("openapi-adversarial")
    policies = write_doc(tmp / "policies", POLICY)
    (policies / "hostile.json").write_text(json.dumps(SPEC))
    with proxy_process(tmp, {"hostile": backend}, policies=policies) as proxy:
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
    requests: list[dict[str, Any]] = httpx.get(f"{backend}/_stats", timeout=5).json()["requests"]
    return requests


def _records(pp: ProxyProcess, decision_id: str) -> list[dict[str, Any]]:
    return [r for r in pp.audit_records() if r["decision_id"] == decision_id]


# ---- a path parameter must not change the target -------------------------------------------

@pytest.mark.parametrize("value", ["..", ".", "", "%2e%2e", "%2E", "a/../../admin"])
def test_mcp_path_parameter_never_leaves_its_segment(pp: ProxyProcess, backend: str, value: str) -> None:
    before = len(_seen(backend))
    answer = _tool(pp, "getItem", {"itemId": value})
    seen = _seen(backend)[before:]
    if "error" in answer:  # refused before the backend: never sent
        assert seen == []
        return
    # Sent: exactly the operation decided on, the value inside its one segment.
    assert [s["raw_path"].rsplit("/", 1)[0] for s in seen] == ["/items"], seen
    assert SECRET not in str(answer)


@pytest.mark.parametrize("raw", ["/items/..", "/items/.", "/items/%2e%2e", "/items/%2E", "/items/%2e"])
def test_http_dot_segment_path_parameter_is_refused(pp: ProxyProcess, backend: str, raw: str) -> None:
    before = len(_seen(backend))
    resp = _http(pp, "GET", raw)
    seen = _seen(backend)[before:]
    assert all(s["raw_path"].startswith("/items/") for s in seen), seen
    assert SECRET not in resp.text
    if seen == []:
        assert resp.status_code in (400, 403, 404), resp.text


# ---- header parameters: never split, never non-ASCII -------------------------------------

@pytest.mark.parametrize("value", ["a\r\nX-Injected: 1", "a\nb", "caf\u00e9", "a\x00b"])
def test_mcp_header_parameter_with_control_or_non_ascii_is_refused(
        pp: ProxyProcess, backend: str, value: str) -> None:
    before = len(_seen(backend))
    answer = _tool(pp, "getItem", {"itemId": "1", "X-Tag": value})
    assert _seen(backend)[before:] == []
    assert "error" in answer or answer["result"].get("isError") is True, answer
    assert all("X-Injected" not in s["headers"] for s in _seen(backend))


# ---- what the backend sends back is inspected ----------------------------------------------

def test_mcp_gzip_encoded_secret_is_inspected(pp: ProxyProcess) -> None:
    answer = _tool(pp, "getGzipped", {})
    assert SECRET not in str(answer)
    assert "result" in answer or "error" in answer


def test_http_gzip_encoded_secret_is_inspected(pp: ProxyProcess) -> None:
    resp = _http(pp, "GET", "/gzipped")  # httpx decodes gzip as any agent would
    assert SECRET not in resp.text


def test_http_response_headers_carry_no_uninspected_secret_or_cookie(pp: ProxyProcess) -> None:
    resp = _http(pp, "GET", "/leaky")
    assert resp.status_code == 200
    assert resp.json() == {"ok": True}
    assert SECRET not in str(resp.headers)
    assert "set-cookie" not in resp.headers


def test_http_redirect_is_not_followed(pp: ProxyProcess, backend: str) -> None:
    before = len(_seen(backend))
    resp = httpx.get(f"{pp.base}/http/hostile/moved", headers={"Authorization": f"Bearer {AGENT}"},
                     timeout=15, follow_redirects=False)
    assert len(_seen(backend)) == before + 1
    assert resp.status_code == 302


# ---- a writer reaches the backend at most once ----------------------------------------------

@pytest.mark.parametrize("front", ["mcp", "http"])
def test_keyed_post_is_not_resent_after_a_reset(pp: ProxyProcess, backend: str, front: str) -> None:
    httpx.post(f"{backend}/_reset", timeout=5)
    before = len(_seen(backend))
    key = f"order-{front}-1"
    if front == "mcp":
        answer = _tool(pp, "createOrder", {"sku": "x"}, meta={"envelope/idempotency_key": key})
        refused = "error" in answer or answer["result"].get("isError") is True
    else:
        resp = _http(pp, "POST", "/orders", headers={"Idempotency-Key": key}, json={"sku": "x"})
        refused = resp.status_code >= 400
    posts = [s for s in _seen(backend)[before:] if s["method"] == "POST"]
    assert len(posts) == 1, posts
    assert refused
