"""Anchors close the gap a hash chain leaves: a real proxy publishes its audit chain head (the
admin API, the process log), and `envelope-proxy audit verify --anchor/--anchors` proves a log
cut at its end or rewritten with every hash recomputed is not the one anchored, where plain
`verify` (rightly) finds the shorter or rewritten chain intact."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import cli

from proxy.audit.log import GENESIS, record_hash
from tests.harness import (
    ADMIN_TOKEN,
    ProxyProcess,
    mcp_client,
    proxy_process,
    stop,
    token,
    wait_port,
)

OPS = token("ops", tenant="acme")
CONFIG = {"approvals": {"enabled": False}}


def _calls(pp: ProxyProcess, n: int) -> None:
    import anyio

    async def go() -> None:
        async with mcp_client(pp.url("notes"), "legacy", bearer=OPS) as c:
            for i in range(n):
                assert not (await c.call_tool("echo", {"text": f"call {i}"})).is_error

    anyio.run(go)


def _head(pp: ProxyProcess, admin: str | None = None) -> dict[str, Any]:
    resp = httpx.get(f"{admin or pp.admin}/v1/audit/head",
                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
    assert resp.status_code == 200, resp.text
    head: dict[str, Any] = resp.json()
    return head


def _logged_heads(pp: ProxyProcess) -> list[str]:
    """The process log's `audit head {...}` lines, as a log shipper would carry them."""
    return [line for line in pp.log().splitlines() if "audit head {" in line]


def _head_of(line: str) -> dict[str, Any]:
    head: dict[str, Any] = json.loads(line[line.index("{"):])
    return head


def _verify(path: Path, *args: str) -> tuple[int, str]:
    done = cli("audit", "verify", str(path), *args)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def anchored(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[dict[str, Any]]:
    """Three calls, the heads then; two more, the head then; the proxy stopped."""
    tmp = tmp_path_factory.mktemp("audit-anchor")
    config = {**CONFIG, "audit": {"anchor_interval": "100ms"}}
    with proxy_process(tmp, {"notes": sse_upstream.url}, config=config) as pp:
        _calls(pp, 3)
        deadline = time.monotonic() + 10
        while not any(_head_of(x)["records"] == 3 for x in _logged_heads(pp)):
            assert time.monotonic() < deadline, pp.log()
            time.sleep(0.05)
        middle = _head(pp)
        _calls(pp, 2)
        end = _head(pp)
        stop(pp.proc)
        yield {"proxy": pp, "tmp": tmp, "middle": middle, "end": end, "logged": _logged_heads(pp)}


def _copy(anchored: dict[str, Any], name: str) -> tuple[Path, list[bytes]]:
    pp: ProxyProcess = anchored["proxy"]
    dst = anchored["tmp"] / name
    shutil.copytree(pp.audit_dir, dst, ignore=shutil.ignore_patterns("*.lock"))
    return dst, (dst / "audit.jsonl").read_bytes().splitlines(keepends=True)


def test_the_head_is_served_and_logged(anchored: dict[str, Any]) -> None:
    records = anchored["proxy"].audit_records()
    assert len(records) == 5
    middle, end = anchored["middle"], anchored["end"]
    assert (middle["chain"], middle["records"], middle["hash"], middle["file"]) == (
        "audit", 3, records[2]["hash"], "audit.jsonl")
    assert (end["records"], end["hash"]) == (5, records[4]["hash"])
    logged = [_head_of(line) for line in anchored["logged"]]
    # Logged when the head moved, never twice the same; the last one is the final head.
    assert [h["records"] for h in logged] == sorted({h["records"] for h in logged})
    assert 3 in [h["records"] for h in logged]
    assert (logged[-1]["records"], logged[-1]["hash"]) == (5, end["hash"])
    assert all(line.split(" ")[2:4] == ["INFO", "proxy.audit.anchor:"] for line in anchored["logged"])


def test_an_intact_log_passes_naming_the_records_after_each_anchor(anchored: dict[str, Any]) -> None:
    pp: ProxyProcess = anchored["proxy"]
    rc, out = _verify(pp.audit_dir, "--anchor", anchored["middle"]["hash"])
    assert rc == 0, out
    assert out.splitlines() == ["ok: 5 records in 1 file(s), hash chain intact",
                                f"anchor {anchored['middle']['hash']}: in the chain, "
                                "2 records after the anchor"]
    # The process log's lines, as shipped, are an anchors file.
    anchors = anchored["tmp"] / "shipped.log"
    anchors.write_text("\n".join(anchored["logged"]) + "\n")
    rc, out = _verify(pp.audit_dir, "--anchors", str(anchors))
    assert rc == 0, out
    assert out.count("in the chain") == len(anchored["logged"])
    assert out.rstrip().endswith("in the chain, 0 records after the anchor")


def test_records_cut_from_the_end_fail_the_anchor(anchored: dict[str, Any]) -> None:
    dst, lines = _copy(anchored, "cut")
    os.truncate(dst / "audit.jsonl", sum(len(x) for x in lines[:3]))  # the last two records gone
    rc, out = _verify(dst)
    assert (rc, out) == (0, "ok: 3 records in 1 file(s), hash chain intact\n")  # the documented gap
    end = anchored["end"]["hash"]
    rc, out = _verify(dst, "--anchor", end)
    assert rc == 1, out
    assert out.startswith(f"TAMPERED: anchor {end} is not in the log: records were cut from its end")
    assert "3 records in 1 file(s): hash chain intact, but it is not the chain that was anchored" in out
    # The earlier anchor still holds: the cut is below the later one only.
    rc, out = _verify(dst, "--anchor", anchored["middle"]["hash"])
    assert rc == 0 and "in the chain, 0 records after the anchor" in out, out


def test_a_rewritten_log_fails_the_anchor(anchored: dict[str, Any]) -> None:
    dst, lines = _copy(anchored, "rewritten")
    prev = GENESIS
    rewritten = []
    for i, raw in enumerate(lines):
        rec = json.loads(raw)
        if i == 1:
            rec["args"] = {"text": "something else"}  # someone rewrites what was called
        rec["prev"] = prev
        rec["hash"] = prev = record_hash(rec)
        rewritten.append(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
    (dst / "audit.jsonl").write_text("".join(rewritten))
    assert _verify(dst) == (0, "ok: 5 records in 1 file(s), hash chain intact\n")
    anchors = anchored["tmp"] / "served.jsonl"
    anchors.write_text(json.dumps(anchored["middle"]) + "\n")
    rc, out = _verify(dst, "--anchors", str(anchors))
    assert rc == 1, out
    middle = anchored["middle"]
    assert (f"TAMPERED: anchor {middle['hash']} (chain audit, {middle['ts']}, from {anchors}:1) "
            "is not in the log") in out


def test_a_log_cut_under_the_running_proxy_keeps_its_served_head(tmp_path: Path,
                                                                  sse_upstream: Any) -> None:
    config = {**CONFIG, "audit": {"anchor_interval": 0}}
    with proxy_process(tmp_path, {"notes": sse_upstream.url}, config=config) as pp:
        _calls(pp, 2)
        head = _head(pp)
        path = pp.audit_dir / "audit.jsonl"
        os.truncate(path, len(path.read_bytes().splitlines(keepends=True)[0]))
        # The head is the writer's own, not re-read from the file it guards.
        assert _head(pp)["hash"] == head["hash"]
        rc, out = _verify(pp.audit_dir, "--anchor", head["hash"])
        assert rc == 1 and f"TAMPERED: anchor {head['hash']} is not in the log" in out, out
        assert _verify(pp.audit_dir)[0] == 0
        stop(pp.proc)
    assert "audit head" not in pp.log()  # anchor_interval 0: never logged, not even at shutdown


def test_each_worker_serves_its_own_chain(tmp_path: Path, sse_upstream: Any) -> None:
    with proxy_process(tmp_path, {"notes": sse_upstream.url},
                       config={**CONFIG, "workers": 2}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)  # the second worker is up too
        heads = [_head(pp, f"http://127.0.0.1:{pp.admin_port + i}") for i in range(2)]
        assert [h["chain"] for h in heads] == ["audit-w0", "audit-w1"]
        assert all(h["hash"] == GENESIS and h["file"] is None for h in heads)  # no call yet


def test_the_head_logged_at_shutdown_catches_a_cut_made_while_the_proxy_was_down(
        tmp_path: Path, sse_upstream: Any) -> None:
    config = {**CONFIG, "audit": {"anchor_interval": "1h"}}  # no periodic line in this test
    with proxy_process(tmp_path, {"notes": sse_upstream.url}, config=config) as first:
        _calls(first, 2)
        stop(first.proc)
    heads = _logged_heads(first)
    assert len(heads) == 1 and _head_of(heads[0])["records"] == 2  # the final head, at shutdown
    path = first.audit_dir / "audit.jsonl"
    os.truncate(path, len(path.read_bytes().splitlines(keepends=True)[0]))
    # Restarted on the cut log, the proxy continues its chain from what is left.
    with proxy_process(tmp_path, {"notes": sse_upstream.url}, config=config) as second:
        _calls(second, 1)
    assert _verify(first.audit_dir) == (0, "ok: 2 records in 1 file(s), hash chain intact\n")
    shipped = tmp_path / "heads.log"
    shipped.write_text(heads[0] + "\n")
    rc, out = _verify(first.audit_dir, "--anchors", str(shipped))
    assert rc == 1 and f"TAMPERED: anchor {_head_of(heads[0])['hash']}" in out, out
