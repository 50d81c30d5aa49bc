"""Hot reload of the policy directory in a running proxy: polling and SIGHUP.

A good edit takes effect without a restart and is counted; a broken edit is rejected with
file:line:column in the log and /v1/policy, and the last good revision keeps deciding.
"""

from __future__ import annotations

import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (
    FIXTURE_POLICIES,
    ProxyProcess,
    mcp_client,
    metric_value,
    proxy_process,
    token,
)

OPS = token("ops", tenant="acme")
MALLORY = token("mallory")
RELOADS = "envelope_policy_reloads_total"
OLD_REASON = "notes go to inbox or drafts"
NEW_REASON = "notes go to the inbox, nowhere else"


def revision_label(metrics: str) -> str:
    found = re.findall(r'^envelope_policy_revision_info\{revision="([^"]+)"\} 1\.0$', metrics, re.M)
    assert len(found) == 1, found
    return found[0]


def policy_status(pp: ProxyProcess) -> dict[str, Any]:
    return pp.admin_get("/v1/policy").json()


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


async def refusal(pp: ProxyProcess, bearer: str, args: dict[str, Any]) -> dict[str, Any]:
    async with mcp_client(pp.url("notes"), "auto", bearer=bearer) as c:
        r = await c.call_tool("write_note", args)
    assert r.is_error, r
    return r.meta["envelope/decision"]


async def poll(check: Callable[[], Any], within: float = 30.0) -> Any:
    """Await `check()` until it returns a truthy value (or fail after `within` seconds: a reload
    and an MCP session each can take seconds on a loaded 2-core CI machine)."""
    import anyio

    deadline = time.monotonic() + within
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {within}s")
        await anyio.sleep(0.1)


def copy_policies(tmp: Path) -> Path:
    dst = tmp / "policies"
    shutil.copytree(FIXTURE_POLICIES, dst)
    return dst


@pytest.fixture(scope="module")
def polled(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("reload-poll")
    with proxy_process(tmp, {"notes": sse_upstream.url}, policies=copy_policies(tmp)) as pp:
        yield pp


@pytest.fixture(scope="module")
def hup(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("reload-hup")
    with proxy_process(tmp, {"notes": sse_upstream.url}, policies=copy_policies(tmp),
                       config={"reload_interval": 0}) as pp:
        yield pp


TRASH = {"title": "t", "body": "b", "folder": "trash"}
INBOX = {"title": "t", "body": "b", "folder": "inbox"}


def test_the_start_up_load_sets_the_last_load_time(polled: ProxyProcess) -> None:
    # On main the gauge stayed 0 until the first reload: "policy loaded in 1970" to an alert on
    # time() - envelope_policy_last_reload_timestamp_seconds.
    metrics = polled.metrics()
    assert metric_value(metrics, RELOADS, result="success") == 0
    loaded = metric_value(metrics, "envelope_policy_last_reload_timestamp_seconds")
    assert time.time() - 600 < loaded <= time.time()


async def test_good_edit_takes_effect(polled: ProxyProcess) -> None:
    assert (await refusal(polled, OPS, TRASH))["reason"] == OLD_REASON
    metrics = polled.metrics()
    successes = metric_value(metrics, RELOADS, result="success")
    revision = revision_label(metrics)
    assert policy_status(polled)["revision"] == revision

    edit(polled.policies / "tools.yaml", f'fallback_reason: "{OLD_REASON}"', f'fallback_reason: "{NEW_REASON}"')

    async def changed() -> bool:
        return (await refusal(polled, OPS, TRASH))["reason"] == NEW_REASON

    await poll(changed)
    metrics = polled.metrics()
    assert metric_value(metrics, RELOADS, result="success") == successes + 1
    new_revision = revision_label(metrics)
    assert new_revision != revision
    status = policy_status(polled)
    assert status["revision"] == new_revision
    assert status["last_reload"]["result"] == "success"
    # Decisions are audited under the revision that made them.
    assert polled.audit_records()[-1]["revision"] == new_revision
    assert polled.audit_records()[0]["revision"] == revision


async def _reloads_counted(proxy: ProxyProcess, result: str, count: float) -> None:
    """Until the proxy has counted `count` reloads with `result` (`success`, `failure`)."""

    async def counted() -> bool:
        return metric_value(proxy.metrics(), RELOADS, result=result) == count

    await poll(counted)


async def test_broken_edit_is_rejected(polled: ProxyProcess) -> None:
    metrics = polled.metrics()
    failures = metric_value(metrics, RELOADS, result="failure")
    successes = metric_value(metrics, RELOADS, result="success")
    revision = revision_label(metrics)
    tools = polled.policies / "tools.yaml"
    old_allow = """allow: '"writers" in principal.groups || principal.id == "ops"'"""
    bad_allow = """allow: '"writers" in principal.groups || principal.id == '"""
    edit(tools, old_allow, bad_allow)
    lineno = next(i for i, line in enumerate(tools.read_text().splitlines(), 1) if bad_allow in line)
    line = tools.read_text().splitlines()[lineno - 1]
    column = line.rindex("'") + 1  # the parser fails where the expression ends
    where = f"{tools}:{lineno}:{column}: "

    await _reloads_counted(polled, "failure", failures + 1)
    metrics = polled.metrics()
    assert metric_value(metrics, RELOADS, result="success") == successes
    assert revision_label(metrics) == revision
    log = polled.log()
    assert where in log, log[-2000:]
    assert "policy reload rejected" in log
    status = policy_status(polled)
    assert status["revision"] == revision
    last = status["last_reload"]
    assert last["result"] == "failure"
    assert any(e.startswith(where) and "CEL" in e for e in last["errors"]), last
    # The last good revision keeps deciding: its reason and its (working) allow expression.
    assert (await refusal(polled, OPS, TRASH))["reason"] == NEW_REASON
    decision = await refusal(polled, MALLORY, INBOX)
    assert decision["code"] == "unauthorized"
    assert polled.audit_records()[-1]["revision"] == revision
    # Fixing the file is picked up again.
    edit(tools, bad_allow, old_allow)

    await _reloads_counted(polled, "success", successes + 1)
    assert policy_status(polled)["last_reload"]["result"] == "success"


async def test_a_file_nested_too_deeply_is_rejected_with_its_place(polled: ProxyProcess) -> None:
    # Lists inside lists, past MAX_NESTING (128) and past Python's stack: on main the reload
    # "failed unexpectedly" with a RecursionError traceback, no file:line:column.
    metrics = polled.metrics()
    failures = metric_value(metrics, RELOADS, result="failure")
    successes = metric_value(metrics, RELOADS, result="success")
    revision = revision_label(metrics)
    deep = polled.policies / "deep.yaml"
    deep.write_text("defaults:\n  mask: " + "[" * 2000 + "]" * 2000 + "\n")
    where = f"{deep}:2:{len('  mask: ') + 127}: nested deeper than 128 levels"

    await _reloads_counted(polled, "failure", failures + 1)
    assert revision_label(polled.metrics()) == revision
    last = policy_status(polled)["last_reload"]
    assert last["result"] == "failure" and any(e.startswith(where) for e in last["errors"]), last
    assert where in polled.log() and "RecursionError" not in polled.log()
    assert (await refusal(polled, OPS, TRASH))["reason"] == NEW_REASON  # the old one serves
    deep.unlink()

    await _reloads_counted(polled, "success", successes + 1)


async def test_a_policy_file_that_cannot_be_read_is_a_rejected_reload(polled: ProxyProcess) -> None:
    # A symlink loop named like a policy file: `check` refuses it ("cannot read"); on main the
    # watcher skipped it, so nothing was reloaded, counted or logged.
    failures = metric_value(polled.metrics(), RELOADS, result="failure")
    successes = metric_value(polled.metrics(), RELOADS, result="success")
    loop = polled.policies / "loop.yaml"
    loop.symlink_to("loop.yaml")
    where = f"{loop}:1:1: cannot read: "

    await _reloads_counted(polled, "failure", failures + 1)
    last = policy_status(polled)["last_reload"]
    assert any(e.startswith(where) and "symbolic links" in e for e in last["errors"]), last
    loop.unlink()

    await _reloads_counted(polled, "success", successes + 1)


async def test_a_policy_file_replaced_by_a_directory_is_a_rejected_reload(polled: ProxyProcess) -> None:
    # On main it loaded as if the file had been deleted: a successful reload without the tools
    # it declared. Now the last good revision keeps serving and the reload says why.
    failures = metric_value(polled.metrics(), RELOADS, result="failure")
    successes = metric_value(polled.metrics(), RELOADS, result="success")
    revision = revision_label(polled.metrics())
    reason = (await refusal(polled, OPS, TRASH))["reason"]
    tools = polled.policies / "tools.yaml"
    kept = tools.rename(polled.policies / ".tools.yaml.kept")  # hidden: not a policy file
    tools.mkdir()
    where = f"{tools}:1:1: a directory named like a policy file: not loaded"

    await _reloads_counted(polled, "failure", failures + 1)
    assert metric_value(polled.metrics(), RELOADS, result="success") == successes
    assert revision_label(polled.metrics()) == revision
    last = policy_status(polled)["last_reload"]
    assert any(e.startswith(where) for e in last["errors"]), last
    assert (await refusal(polled, OPS, TRASH))["reason"] == reason  # the old one serves
    tools.rmdir()
    kept.rename(tools)

    await _reloads_counted(polled, "success", successes + 1)


async def test_sighup_reloads(hup: ProxyProcess) -> None:
    import anyio

    before = await refusal(hup, OPS, TRASH)
    assert before["reason"] == OLD_REASON
    successes = metric_value(hup.metrics(), RELOADS, result="success")
    revision = revision_label(hup.metrics())
    edit(hup.policies / "tools.yaml", "      - id: no-secret-folder\n",
         '      - id: no-trash\n        forbid: \'args.folder == "trash"\'\n        reason: "trash is not a folder"\n'
         "      - id: no-secret-folder\n")
    await anyio.sleep(1.0)  # reload_interval 0: no polling, nothing changes on its own
    assert (await refusal(hup, OPS, TRASH))["rule"] == "notes.write_note#fallback"
    assert metric_value(hup.metrics(), RELOADS, result="success") == successes

    hup.proc.send_signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return (await refusal(hup, OPS, TRASH))["rule"] == "no-trash"

    await poll(reloaded)
    decision = await refusal(hup, OPS, TRASH)
    assert decision["reason"] == "trash is not a folder"
    assert metric_value(hup.metrics(), RELOADS, result="success") == successes + 1
    assert revision_label(hup.metrics()) != revision
    status = policy_status(hup)
    assert status["last_reload"]["result"] == "success"
    assert status["last_reload"]["trigger"] == "SIGHUP"
    assert hup.proc.poll() is None  # SIGHUP reloads; it does not stop the proxy
