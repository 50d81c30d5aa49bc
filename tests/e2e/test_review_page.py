"""The review page in a real browser: Debian's headless chromium driven by Selenium, against the
real proxy process, the demo notes server and the official SDK client.

A gated call (`demo.delete_note`, held up to 20 s) waits while the page approves or denies it;
the refused call and its detail (check, rule, reason) show in the decisions list; an argument
that looks like HTML renders as text. Also the page's headers (CSP) and the token the
argument-bearing endpoints require.

Without chromium, chromedriver or selenium the browser tests are skipped, unless
ENVELOPE_REQUIRE_BROWSER=1 (CI), when they fail instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import upstream_server, write_doc

from tests.harness import ProxyProcess, mcp_client, proxy_process, token

OPS = token("ops", tenant="acme")
ALICE_TOKEN = "alice-review-token"
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
XSS = "<img src=x onerror=alert(1)>"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 15.0  # seconds the browser side waits for an element or a text


def _policy(directory: Path) -> Path:
    doc = {
        "version": 1,
        "upstreams": {"demo": {"url": "http://127.0.0.1:1/mcp", "timeout": "30s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {
            "demo.delete_note": {"effect": "destructive", "log_args": True,
                                 "approval": {"required": True, "wait": "20s"}},
            "demo.write_note": {
                "effect": "write", "log_args": True,
                "rules": [{"id": "no-secret-folder", "forbid": 'has(args.folder) && args.folder == "secret"',
                           "reason": "no notes in the secret folder"}],
            },
            "demo.search_notes": {"effect": "read"},
        },
    }
    return write_doc(directory, doc)


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("review")
    config = {"approvals": {
        "poll_interval": "100ms",
        "approvers": {"alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()}},
    }}
    with upstream_server("sse") as up, proxy_process(
        tmp, {"demo": up.url}, policies=_policy(tmp / "policies"), config=config
    ) as proxy:
        yield proxy


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'selenium>=4')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = _browser_missing()
    if missing:
        if os.environ.get("ENVELOPE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"ENVELOPE_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="envelope-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# -- helpers ----------------------------------------------------------------------------------


async def call(pp: ProxyProcess, tool: str, args: dict[str, Any]) -> Any:
    async with mcp_client(pp.url("demo"), "auto", bearer=OPS) as c:
        return await c.call_tool(tool, args)


def meta(result: Any) -> dict[str, Any]:
    return dict((result.meta or {})["envelope/decision"])


def latest(pp: ProxyProcess, tool: str, **args: Any) -> dict[str, Any]:
    """The newest audit record of `tool` whose recorded arguments hold `args` (log_args)."""
    found = [r for r in pp.audit_records() if r["tool"] == tool
             and all(r.get("args", {}).get(k) == v for k, v in args.items())]
    assert found, (tool, args)
    return found[-1]


async def pending_for(pp: ProxyProcess, title: str, within: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(base_url=pp.admin, headers=ALICE, timeout=5) as http:
        while time.monotonic() < deadline:
            r = await http.get("/v1/approvals", params={"state": "pending"})
            assert r.status_code == 200, r.text
            found = [a for a in r.json()["approvals"] if a["arguments"].get("title") == title]
            if found:
                return dict(found[0])
            await asyncio.sleep(0.05)
    raise AssertionError(f"no pending approval for {title!r}")


def wait_for(driver: Any, css: str, text: str | None = None) -> Any:
    """The first element matching `css` (whose text contains `text`), waiting up to WAIT."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def found(d: Any) -> Any:
        for e in d.find_elements(By.CSS_SELECTOR, css):
            if e.is_displayed() and (text is None or text in e.text):
                return e
        return False

    return WebDriverWait(driver, WAIT, poll_frequency=0.1).until(
        found, f"no visible {css!r} containing {text!r}")


def open_signed_in(driver: Any, pp: ProxyProcess) -> None:
    """A fresh page load; the token typed once (it lives in this tab's sessionStorage)."""
    driver.get(f"{pp.admin}/review")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{pp.admin}/review")
    wait_for(driver, "#token").send_keys(ALICE_TOKEN)
    driver.find_element("id", "login-submit").click()
    wait_for(driver, "#app")
    assert driver.execute_script("return sessionStorage.getItem('envelope-review-token')") == ALICE_TOKEN


def decide_in_page(driver: Any, approval_id: str, action: str, reason: str) -> None:
    card = wait_for(driver, f'.approval[data-approval-id="{approval_id}"]')
    card.find_element("css selector", 'input[data-role="reason"]').send_keys(reason)
    card.find_element("css selector", f'button[data-action="{action}"]').click()
    wait_for(driver, "#flash", f"Approval {approval_id}")


def show_detail(driver: Any, decision_id: str, **filters: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import Select

    for name, value in filters.items():
        field = driver.find_element("id", f"f-{name}")
        if field.tag_name == "select":
            Select(field).select_by_value(value)
        else:
            field.clear()
            field.send_keys(value)
    driver.find_element("id", "decisions-refresh").click()
    for attempt in range(20):  # the list may be re-rendered between finding a row and clicking
        try:
            wait_for(driver, f'tr[data-decision-id="{decision_id}"]').click()
            wait_for(driver, "#detail-id", decision_id)
            return
        except StaleElementReferenceException:
            if attempt == 19:
                raise
            time.sleep(0.1)


def detail(driver: Any, field: str) -> str:
    return str(driver.find_element("css selector", f'#detail-fields dd[data-field="{field}"]').text)


# -- the page without a browser ---------------------------------------------------------------


def test_page_headers_and_token_required(pp: ProxyProcess) -> None:
    page = httpx.get(f"{pp.admin}/review", timeout=5)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert ALICE_TOKEN not in page.text and "<script>" not in page.text  # no inline script
    js = httpx.get(f"{pp.admin}/review/static/review.js", timeout=5)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in js.text
    assert httpx.get(f"{pp.admin}/review/static/review.css", timeout=5).status_code == 200
    for bad in ("../app.py", "..%2Fapp.py", "nothing.js", ".hidden.js"):
        assert httpx.get(f"{pp.admin}/review/static/{bad}", timeout=5).status_code == 404, bad
    # Argument-bearing endpoints need an approver token, and so do those that describe upstreams.
    for path in ("/v1/decisions", "/v1/decisions/nope", "/v1/shadow", "/v1/approvals",
                 "/v1/policy", "/v1/upstreams"):
        assert httpx.get(f"{pp.admin}{path}", timeout=5).status_code == 401, path
        wrong = {"Authorization": "Bearer not-a-token"}
        assert httpx.get(f"{pp.admin}{path}", headers=wrong, timeout=5).status_code == 401, path
    assert httpx.get(f"{pp.admin}/v1/policy", headers=ALICE, timeout=5).status_code == 200
    assert httpx.get(f"{pp.admin}/v1/misconfigurations", timeout=5).status_code == 200
    r = httpx.get(f"{pp.admin}/v1/decisions", headers=ALICE, params={"limit": 5}, timeout=5)
    assert r.status_code == 200 and isinstance(r.json()["decisions"], list)
    assert httpx.get(f"{pp.admin}/v1/decisions/nope", headers=ALICE, timeout=5).status_code == 404
    assert httpx.get(f"{pp.admin}/v1/decisions", headers=ALICE, params={"limit": 0},
                     timeout=5).status_code == 400
    assert httpx.get(f"{pp.admin}/v1/decisions", headers=ALICE, params={"since": "yesterday"},
                     timeout=5).status_code == 400


async def test_decisions_api_filters(pp: ProxyProcess) -> None:
    refused = await call(pp, "write_note", {"title": "api-secret", "body": "b", "folder": "secret"})
    decision_id = meta(refused)["decision_id"]
    async with httpx.AsyncClient(base_url=pp.admin, headers=ALICE, timeout=5) as http:
        r = await http.get("/v1/decisions", params={"verdict": "deny", "tool": "write_note",
                                                    "principal": "ops", "since": "10m"})
        assert r.status_code == 200, r.text
        ids = [d["decision_id"] for d in r.json()["decisions"]]
        assert decision_id in ids
        assert all(d["verdict"] == "deny" for d in r.json()["decisions"])
        one = (await http.get(f"/v1/decisions/{decision_id}")).json()
        assert (one["rule"], one["args"]["folder"]) == ("no-secret-folder", "secret")
        r = await http.get("/v1/decisions", params={"principal": "nobody"})
        assert r.json() == {"decisions": [], "count": 0}


# -- in the browser ---------------------------------------------------------------------------


async def test_approve_in_page_releases_the_held_call(pp: ProxyProcess, browser: Any) -> None:
    written = await call(pp, "write_note", {"title": "page-approve", "body": "b"})
    assert written.is_error is False, written
    held = asyncio.create_task(call(pp, "delete_note", {"title": "page-approve"}))
    try:
        approval = await pending_for(pp, "page-approve")
        await asyncio.to_thread(open_signed_in, browser, pp)
        await asyncio.to_thread(decide_in_page, browser, approval["id"], "approve",
                                "cleanup ticket 42 (review page)")
        result = await asyncio.wait_for(held, 15)
    finally:
        held.cancel()
    assert result.is_error is False, result
    assert result.structured_content == {"deleted": "page-approve", "existed": True}
    rec = latest(pp, "delete_note", title="page-approve")
    assert rec["verdict"] == "allow"
    assert (rec["extra"]["approval_id"], rec["extra"]["approver"]) == (approval["id"], "alice")
    async with httpx.AsyncClient(base_url=pp.admin, headers=ALICE, timeout=5) as http:
        shown = (await http.get(f"/v1/approvals/{approval['id']}")).json()
    assert (shown["state"], shown["decision_reason"]) == ("consumed", "cleanup ticket 42 (review page)")

    # The released call's detail names its approval.
    await asyncio.to_thread(show_detail, browser, rec["decision_id"], verdict="allow",
                            tool="delete_note")
    assert detail(browser, "approval") == approval["id"]
    assert detail(browser, "approver") == "alice"
    assert detail(browser, "upstream status") == "200"


async def test_deny_in_page_refuses_the_held_call(pp: ProxyProcess, browser: Any) -> None:
    held = asyncio.create_task(call(pp, "delete_note", {"title": "page-deny"}))
    try:
        approval = await pending_for(pp, "page-deny")
        await asyncio.to_thread(open_signed_in, browser, pp)
        await asyncio.to_thread(decide_in_page, browser, approval["id"], "deny",
                                "not this one, said the page")
        result = await asyncio.wait_for(held, 15)
    finally:
        held.cancel()
    assert result.is_error is True
    m = meta(result)
    assert (m["code"], m["check"]) == ("approval_denied", "approval")
    assert "denied by alice: not this one, said the page" in result.content[0].text


async def test_refused_call_listed_with_its_detail(pp: ProxyProcess, browser: Any) -> None:
    refused = await call(pp, "write_note", {"title": "page-secret", "body": "b", "folder": "secret"})
    assert refused.is_error is True
    m = meta(refused)
    rec = next(r for r in pp.audit_records() if r["decision_id"] == m["decision_id"])
    await asyncio.to_thread(open_signed_in, browser, pp)
    await asyncio.to_thread(show_detail, browser, m["decision_id"], verdict="deny",
                            tool="write_note", principal="ops")
    row = browser.find_element("css selector", f'tr[data-decision-id="{m["decision_id"]}"]')
    assert "deny" in row.text and rec["code"] in row.text
    assert detail(browser, "check") == rec["check"]
    assert detail(browser, "rule") == "no-secret-folder"
    assert detail(browser, "reason") == rec["reason"] and "secret folder" in rec["reason"]
    assert detail(browser, "revision") == rec["revision"]
    assert json.loads(browser.find_element("id", "detail-args").text)["folder"] == "secret"
    # Policy status is shown too.
    async with httpx.AsyncClient(timeout=5) as http:
        revision = (await http.get(f"{pp.admin}/v1/policy", headers=ALICE)).json()["revision"]
    assert wait_for(browser, '#policy-info dd[data-field="revision"]').text == revision


async def test_html_in_arguments_renders_as_text(pp: ProxyProcess, browser: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    written = await call(pp, "write_note", {"title": XSS, "body": XSS})
    assert written.is_error is False
    held = asyncio.create_task(call(pp, "delete_note", {"title": XSS}))
    try:
        approval = await pending_for(pp, XSS)
        await asyncio.to_thread(open_signed_in, browser, pp)
        card = await asyncio.to_thread(wait_for, browser,
                                       f'.approval[data-approval-id="{approval["id"]}"]')
        args = card.find_element("css selector", 'pre[data-role="arguments"]')
        assert json.loads(args.text) == {"title": XSS}
        await asyncio.to_thread(show_detail, browser, latest(pp, "write_note", title=XSS)["decision_id"],
                                verdict="allow", tool="write_note", principal="ops")
        assert json.loads(browser.find_element("id", "detail-args").text)["title"] == XSS
        # Rendered as text: no element was created from the value, no script ran.
        assert browser.find_elements("tag name", "img") == []
        with pytest.raises(NoAlertPresentException):
            _ = browser.switch_to.alert.text
        assert XSS in browser.find_element("id", "detail-raw").text
        async with httpx.AsyncClient(base_url=pp.admin, headers=ALICE, timeout=5) as http:
            r = await http.post(f"/v1/approvals/{approval['id']}/deny", json={"reason": "test done"})
            assert r.status_code == 200, r.text
        result = await asyncio.wait_for(held, 15)
        assert meta(result)["code"] == "approval_denied"
    finally:
        held.cancel()
