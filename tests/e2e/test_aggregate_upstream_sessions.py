"""One client session on the aggregated `/mcp` is one upstream session, on every worker.

The real proxy process with `workers: 2` (a new connection lands on either worker), the
embedded SQLite store the workers share, and an official-SDK upstream that keeps state per
session (tests/e2e/session_server.py: `count` answers `<session number>:<calls in this
session>:<session id>`). Before, each worker that served a client session opened an upstream
session of its own, so an upstream that keeps state per session saw one client session split in
two (its counts restarted on the other worker) and a DELETE ended only the sessions of the
worker that took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import write_doc

from tests.harness import free_port, proxy_process, stop, token, wait_port
from tests.redis_server import running_redis

ALICE = token("alice")
LEGACY = "2025-11-25"
HERE = Path(__file__).parent


@contextlib.contextmanager
def session_upstream(port: int | None = None) -> Iterator[str]:
    """tests/e2e/session_server.py on `port` (a free one by default), until the block ends."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "session_server.py"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)


def _policy(directory: Path, **extra: Any) -> Path:
    return write_doc(directory, {
        "version": 1, "upstreams": {"counter": {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"}},
        "tools": {"counter.count": {"effect": "read"}}, "defaults": {"unknown_tools": "deny"}, **extra})


def _post(url: str, method: str, params: dict[str, Any], session: str | None = None) -> httpx.Response:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "Authorization": f"Bearer {ALICE}", "MCP-Protocol-Version": LEGACY}
    if session:
        headers["Mcp-Session-Id"] = session
    body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
    return httpx.post(url, json=body, headers=headers, timeout=20)  # a new connection: either worker


def _initialize(url: str) -> str:
    created = _post(url, "initialize", {"protocolVersion": LEGACY, "capabilities": {},
                                        "clientInfo": {"name": "t", "version": "1"}})
    assert created.status_code == 200, created.text
    return created.headers["Mcp-Session-Id"]


def _count(answer: str) -> tuple[int, str]:
    """(the call's number in its upstream session, that session's id)."""
    _, calls, session = answer.split(":", 2)
    return int(calls), session


def _direct_count(upstream: str) -> str:
    """`count` in a session of its own, straight to the upstream (its number tells how many
    sessions counted before it)."""
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": LEGACY}
    opened = httpx.post(upstream, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
        headers=headers, timeout=10)
    headers["Mcp-Session-Id"] = opened.headers["Mcp-Session-Id"]
    httpx.post(upstream, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers, timeout=10)
    called = httpx.post(upstream, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                        "params": {"name": "count", "arguments": {}}}, headers=headers, timeout=10)
    return str(called.json()["result"]["content"][0]["text"])


def _upstream_knows(upstream: str, session: str) -> bool:
    """Whether the upstream still has `session` (a call in it is answered, not 404)."""
    answer = httpx.post(upstream, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
                        headers={"Accept": "application/json, text/event-stream", "Mcp-Session-Id": session,
                                 "MCP-Protocol-Version": LEGACY}, timeout=10)
    return answer.status_code != 404


async def test_a_client_session_is_one_upstream_session_on_either_worker(tmp_path: Path) -> None:
    # The official SDK's legacy client on a new connection per request: its calls land on both
    # workers, yet count up in one upstream session; its DELETE on leaving (on whichever worker)
    # ends that upstream session.
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    with session_upstream() as upstream, proxy_process(
            tmp_path, {"counter": upstream}, policies=_policy(tmp_path / "p"),
            config={"workers": 2, "aggregate": {"enabled": True}}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        used = []
        for _ in range(3):
            http = httpx2.AsyncClient(limits=httpx2.Limits(max_keepalive_connections=0),
                                      headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
            async with http, Client(streamable_http_client(f"{pp.base}/mcp", http_client=http), mode="legacy",
                                    cache=None) as client:
                counted = [_count(str((await client.call_tool("counter.count", {})).content[0].text))
                           for _ in range(10)]
            assert [n for n, _ in counted] == list(range(1, 11)), counted
            assert len({s for _, s in counted}) == 1, counted
            used.append(counted[0][1])
        assert len(set(used)) == 3  # one upstream session per client session
        by_worker = [[r for r in records if r["tool"] == "count"] for records in pp.worker_audit_records()]
        assert sum(map(len, by_worker)) == 30 and all(by_worker), [len(r) for r in by_worker]
        assert not any(_upstream_knows(upstream, session) for session in used)


def test_workers_taking_up_a_new_session_at_once_open_one_upstream_session(tmp_path: Path) -> None:
    # Ten first calls of a client session at once, on ten connections: both workers find no
    # upstream session for it and open one; the first stored is the one every call uses (the
    # other worker closes its own before any call went through it).
    with session_upstream() as upstream, proxy_process(
            tmp_path, {"counter": upstream}, policies=_policy(tmp_path / "p"),
            config={"workers": 2, "aggregate": {"enabled": True}}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        url = f"{pp.base}/mcp"
        for _ in range(3):
            session = _initialize(url)

            async def burst(session: str = session) -> list[httpx.Response]:
                return list(await asyncio.gather(*(asyncio.to_thread(
                    _post, url, "tools/call", {"name": "counter.count", "arguments": {}}, session)
                    for _ in range(10))))

            answers = asyncio.run(burst())
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            counted = sorted(_count(a.json()["result"]["content"][0]["text"]) for a in answers)
            assert [n for n, _ in counted] == list(range(1, 11)), counted
            assert len({s for _, s in counted}) == 1, counted
            ended = httpx.delete(url, headers={"Authorization": f"Bearer {ALICE}", "Mcp-Session-Id": session,
                                               "MCP-Protocol-Version": LEGACY}, timeout=10)
            assert ended.status_code == 200
            assert not _upstream_knows(upstream, counted[0][1])


def test_after_the_upstream_forgot_the_session_every_worker_moves_to_one_new_one(tmp_path: Path) -> None:
    # The upstream restarts (its sessions are gone): the first worker whose call is answered 404
    # opens a new session and puts it in place of the old one in the store; the other worker,
    # answered 404 in turn, takes that one up instead of opening its own. Each call is sent
    # again once after the 404 (the upstream did not run it) and counted once.
    port = free_port()
    upstream = f"http://127.0.0.1:{port}/mcp"
    with proxy_process(tmp_path, {"counter": upstream}, policies=_policy(tmp_path / "p"),
                       config={"workers": 2, "aggregate": {"enabled": True}}) as pp:
        wait_port(pp.admin_port + 1, pp.proc)
        url = f"{pp.base}/mcp"
        session = _initialize(url)

        def calls(n: int) -> list[tuple[int, str]]:
            answers = [_post(url, "tools/call", {"name": "counter.count", "arguments": {}}, session) for _ in range(n)]
            return [_count(a.json()["result"]["content"][0]["text"]) for a in answers]

        with session_upstream(port):
            before = calls(8)
        with session_upstream(port):  # a new process: it knows no session
            after = calls(12)
        assert [n for n, _ in before] == list(range(1, 9)) and len({s for _, s in before}) == 1, before
        assert [n for n, _ in after] == list(range(1, 13)) and len({s for _, s in after}) == 1, after
        assert after[0][1] != before[0][1]
        by_worker = [[r for r in records if r["tool"] == "count"] for records in pp.worker_audit_records()]
        assert sum(map(len, by_worker)) == 20 and all(by_worker), [len(r) for r in by_worker]


def test_a_store_that_cannot_say_which_upstream_session_refuses_the_call(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    with running_redis(tmp_path / "redis") as redis, session_upstream() as upstream, proxy_process(
            tmp_path, {"counter": upstream}, policies=_policy(tmp_path / "p"),
            config={"aggregate": {"enabled": True}, "store": {"kind": "redis", "url": redis.url, "timeout": 1.0}}) as pp:
        url = f"{pp.base}/mcp"
        session = _initialize(url)
        redis.kill()
        # The client session is known in this process's memory; which upstream session it uses
        # with `counter` is not, and cannot be read: refused, audited, nothing sent upstream.
        refused = _post(url, "tools/call", {"name": "counter.count", "arguments": {}}, session)
        assert refused.status_code == 200, refused.text
        result = refused.json()["result"]
        assert result["isError"] is True
        reason = result["content"][0]["text"]
        assert "state store cannot say which upstream session" in reason, reason
        assert reason.startswith("Blocked by policy (upstream_error): upstream 'counter' failed"), reason
        [record] = [r for r in pp.audit_records() if r["tool"] == "count"]
        assert (record["upstream"], record["code"]) == ("counter", "upstream_error"), record
        assert "state store cannot say which upstream session" in record["reason"], record
        assert _direct_count(upstream).startswith("1:1:")  # the first session that ever counted


def test_replicas_sharing_the_secret_share_the_upstream_session(tmp_path: Path) -> None:
    # Two replicas (two serves) on one Redis: configured with the same
    # `approvals.in_band_secret_env`, a client session's calls alternating between them count up
    # in one upstream session. Without it each replica cannot open the other's sealed entry and
    # uses a session of its own (as before): the calls still pass, the counts split.
    (tmp_path / "redis").mkdir()
    with running_redis(tmp_path / "redis") as redis, session_upstream() as upstream:
        for shared in (True, False):
            run = tmp_path / ("shared" if shared else "apart")
            policy = _policy(run / "p")
            (run / "a").mkdir()
            (run / "b").mkdir()
            config = {"aggregate": {"enabled": True}, "store": {"kind": "redis", "url": redis.url},
                      "approvals": {"in_band_secret_env": "REPLICA_SECRET"}}
            with proxy_process(run / "a", {"counter": upstream}, policies=policy, config=config,
                               env={"REPLICA_SECRET": "one secret for both"}) as a, proxy_process(
                    run / "b", {"counter": upstream}, policies=policy, config=config,
                    env={"REPLICA_SECRET": "one secret for both" if shared else "another secret"}) as b:
                session = _initialize(f"{a.base}/mcp")
                counted = [_count(_post(f"{(a, b)[i % 2].base}/mcp", "tools/call",
                                        {"name": "counter.count", "arguments": {}}, session)
                                  .json()["result"]["content"][0]["text"]) for i in range(8)]
            if shared:
                assert [n for n, _ in counted] == list(range(1, 9)) and len({s for _, s in counted}) == 1, counted
            else:
                assert [n for n, _ in counted] == [1, 1, 2, 2, 3, 3, 4, 4], counted
                assert len({s for _, s in counted[0::2]}) == 1 and len({s for _, s in counted[1::2]}) == 1
