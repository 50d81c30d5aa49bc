"""Run lineage and the per-run concurrency bound shared by two replicas on one real Redis.

- a run recorded on A is the parent B computes a child's depth from; the too-deep run is refused
  on both replicas;
- a run's calls in flight on A count against its bound on B (`rate_limited`), and the slot is
  free again once the call finished.

Skips without a `redis-server` binary (fails under ENVELOPE_REQUIRE_REDIS=1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from e2e_helpers import write_policy
from fake_upstream import FakeUpstream, fake_upstream

from tests.harness import ProxyProcess, proxy_process, rpc
from tests.redis_server import running_redis

STATIC = {"mode": "static", "principal": "agent"}
TOOLS = {"notes.echo": {"effect": "read"}}


@dataclass
class Pair:
    upstream: FakeUpstream
    a: ProxyProcess
    b: ProxyProcess


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("replicas-lineage")
    with running_redis(tmp) as server, fake_upstream() as fake:
        # A held call (the concurrency test) may wait for B's calls on a slow machine.
        policies = write_policy(tmp / "policies", {"counted": {"timeout": "60s"}}, tools=TOOLS,
                                principals={"agent": {"max_concurrent_per_run": 1}})
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        config = {"store": {"kind": "redis", "url": server.url, "timeout": 1.0}}
        with proxy_process(tmp / "a", {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as a, \
             proxy_process(tmp / "b", {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as b:
            yield Pair(fake, a, b)


def echo(pp: ProxyProcess, run: str, parent: str | None = None,
         timeout: float = 15) -> dict[str, Any]:
    headers = {"X-Envelope-Run": run}
    if parent:
        headers["X-Envelope-Parent-Run"] = parent
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo", "arguments": {}}}
    resp = rpc(pp.url("counted"), body, headers=headers, timeout=timeout)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()["result"]
    return result


def code_of(result: dict[str, Any]) -> str | None:
    d = (result.get("_meta") or {}).get("envelope/decision")
    return d["code"] if d else None


def test_lineage_is_shared_across_replicas(pair: Pair) -> None:
    a, b = pair.a, pair.b
    assert echo(a, "L-session")["isError"] is False
    assert echo(b, "L-child", "L-session")["isError"] is False
    assert echo(a, "L-grandchild", "L-child")["isError"] is False
    refused = echo(b, "L-great", "L-grandchild")
    assert code_of(refused) == "depth_exceeded", refused
    # A never saw L-great, yet refuses it from the shared record, with no parent named.
    assert code_of(echo(a, "L-great")) == "depth_exceeded"
    rec = [r for r in b.audit_records() if r.get("run") == "L-child"][-1]
    assert (rec["extra"]["run_parent"], rec["extra"]["run_depth"]) == ("L-session", 1)


def in_flight(fake: FakeUpstream, call: Any) -> threading.Thread:
    """Start `call` in a thread and return once it reached the (holding) upstream."""
    before = fake.attempts["echo"]
    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 15
    while fake.attempts["echo"] == before:
        assert time.monotonic() < deadline, "the call never reached the upstream"
        time.sleep(0.05)
    return thread


def test_concurrency_bound_is_shared_across_replicas(pair: Pair) -> None:
    a, b, fake = pair.a, pair.b, pair.upstream
    fake.hold = threading.Event()
    try:
        slow: dict[str, Any] = {}
        t = in_flight(fake, lambda: slow.update(echo(a, "C-run", timeout=60)))
        # A's call is at the upstream, holding the run's one slot.
        refused = echo(b, "C-run")
        assert code_of(refused) == "rate_limited", refused
        reason = refused["_meta"]["envelope/decision"]["reason"]
        assert "1 call in flight" in reason
        other: dict[str, Any] = {}
        o = in_flight(fake, lambda: other.update(echo(b, "C-other-run", timeout=60)))
        fake.hold.set()
        for thread in (t, o):
            thread.join(30)
        assert other["isError"] is False  # other runs are not affected
        assert slow["isError"] is False
    finally:
        fake.hold.set()
        fake.hold = None
    assert echo(b, "C-run")["isError"] is False  # the slot was released
