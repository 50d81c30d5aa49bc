"""A run's call budget (`max_calls_per_run`) through the real proxy process: only calls sent
upstream count. A call refused by a later check (here the approval gate) gives its token back,
with the SQLite file and with a real redis-server; N calls racing the last token on two replicas
sharing Redis let exactly one through.

Redis tests skip (naming what is missing) without a `redis-server` binary, and fail instead
under ENVELOPE_REQUIRE_REDIS=1 (see tests/redis_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import fixture_policy, write_policy
from fake_upstream import fake_upstream

from tests.harness import ProxyProcess, proxy_process, rpc
from tests.redis_server import running_redis

STATIC = {"mode": "static", "principal": "agent"}
TOOLS = {
    "notes.write_note": {"effect": "write"},
    "notes.delete_note": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}},
}


def _policies(directory: Path, budget: int) -> Path:
    defaults = {**fixture_policy()["defaults"], "max_calls_per_run": budget}
    return write_policy(directory, {"counted": {}}, tools=TOOLS, principals={}, defaults=defaults)


def _body(tool: str, args: dict[str, Any], id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": args}}


def _call(pp: ProxyProcess, tool: str, args: dict[str, Any], run: str) -> dict[str, Any]:
    resp = rpc(pp.url("counted"), _body(tool, args), headers={"X-Envelope-Run": run})
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()["result"]
    return result


def _code(result: dict[str, Any]) -> str | None:
    decision = (result.get("_meta") or {}).get("envelope/decision")
    return decision["code"] if decision else None


@contextlib.contextmanager
def _store(kind: str, directory: Path) -> Iterator[dict[str, Any]]:
    if kind == "sqlite":
        yield {}
        return
    with running_redis(directory) as server:
        yield {"store": {"kind": "redis", "url": server.url, "timeout": 1.0}}


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_call_refused_by_a_later_check_does_not_spend_the_budget(tmp_path: Path, store: str) -> None:
    (tmp_path / "redis").mkdir()
    with fake_upstream() as fake, _store(store, tmp_path / "redis") as config:
        with proxy_process(tmp_path, {"counted": fake.url}, policies=_policies(tmp_path / "policies", 2),
                           identity=STATIC, config=config) as pp:
            run = "budget-run"
            held = _call(pp, "delete_note", {"id": "n-1"}, run)
            assert _code(held) == "approval_pending"  # refused by the approval check, after the budget's
            first = _call(pp, "write_note", {"title": "one"}, run)
            second = _call(pp, "write_note", {"title": "two"}, run)
            assert (first["isError"], second["isError"]) == (False, False), (first, second)
            assert fake.calls["write_note"] == 2
            spent = _call(pp, "write_note", {"title": "three"}, run)
            assert _code(spent) == "rate_limited", spent
            assert "has made the 2 calls its budget allows" in spent["_meta"]["envelope/decision"]["reason"]
            assert fake.calls["write_note"] == 2
            codes = [r["code"] for r in pp.audit_records() if r.get("run") == run]
            assert codes == ["approval_pending", "ok", "ok", "rate_limited"]


async def test_calls_racing_the_last_token_on_two_replicas_let_one_through(tmp_path: Path) -> None:
    """Budget 1 shared by two replicas: a call refused by the approval gate on A gives its token
    back; then 10 calls at once, 5 on each replica, for the one token: exactly one is performed,
    the other nine are refused `rate_limited`."""
    with running_redis(tmp_path) as server, fake_upstream() as fake:
        policies = _policies(tmp_path / "policies", 1)
        config = {"store": {"kind": "redis", "url": server.url, "timeout": 1.0}}
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with proxy_process(tmp_path / "a", {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as a, \
             proxy_process(tmp_path / "b", {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as b:
            run = "race-run"
            assert _code(_call(a, "delete_note", {"id": "n-1"}, run)) == "approval_pending"
            headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                       "MCP-Protocol-Version": "2026-07-28", "X-Envelope-Run": run}
            async with httpx.AsyncClient(timeout=20) as client:
                replies = await asyncio.gather(*(
                    client.post((a if i % 2 else b).url("counted"), headers=headers,
                                content=json.dumps(_body("write_note", {"title": f"race-{i}"}, i)))
                    for i in range(10)))
            results = [r.json()["result"] for r in replies]
            codes = sorted(str(_code(r)) for r in results)
            assert codes == ["None"] + ["rate_limited"] * 9, codes  # a forwarded result has no decision meta
            assert fake.calls["write_note"] == 1
