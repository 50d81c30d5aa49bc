"""Several replicas, one truth: two real `envelope-proxy` processes (A and B) share one real
`redis-server` started here. Same policy, same counting upstream, separate state directories
(so separate audit logs), the same approver configured on both.

- an approval granted through A's admin API releases the call retried on B, performed once;
- a call performed on A and retried on B is replayed by B, never performed twice;
- a tool limited to `3/min` has one bucket for both replicas: three calls pass (on A, B, A), the
  fourth is refused `rate_limited` on either, with the time to wait;
- a replica that loses Redis fails closed for gated and rate-limited calls (`store_unavailable`),
  keeps serving read-only calls, says so on /readyz, and recovers by itself when Redis comes back.

Redis tests skip (naming what is missing) without a `redis-server` binary, and fail instead
under ENVELOPE_REQUIRE_REDIS=1 (see tests/redis_server.py).
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import write_policy
from fake_upstream import FakeUpstream, fake_upstream

from tests.harness import ProxyProcess, proxy_process, rpc
from tests.redis_server import RedisServer, running_redis

STATIC = {"mode": "static", "principal": "agent"}
ALICE_TOKEN = "alice-replica-approver-token"
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
TOOLS = {
    "notes.echo": {"effect": "read"},
    "notes.write_note": {"effect": "write"},
    "notes.delete_note": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}},
    "notes.lookup": {"effect": "read", "rate": "3/min"},
}
APPROVAL_ID = re.compile(r"\b(apr-[0-9a-zA-Z]+)\b")


def _config(redis_url: str) -> dict[str, Any]:
    return {
        "store": {"kind": "redis", "url": redis_url, "timeout": 1.0},
        "approvals": {
            "poll_interval": "100ms",
            "approvers": {"alice": {"token_sha256": hashlib.sha256(ALICE_TOKEN.encode()).hexdigest()}},
        },
    }


def call_body(tool: str, args: dict[str, Any], id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": args}}


def call(pp: ProxyProcess, tool: str, args: dict[str, Any], run: str,
         headers: dict[str, str] | None = None, timeout: float = 15) -> dict[str, Any]:
    resp = rpc(pp.url("counted"), call_body(tool, args), timeout=timeout,
               headers={"X-Envelope-Run": run, **(headers or {})})
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()["result"]
    return result


def code_of(result: dict[str, Any]) -> str | None:
    decision = (result.get("_meta") or {}).get("envelope/decision")
    return decision["code"] if decision else None


def decision_id(result: dict[str, Any]) -> str:
    return str(result["_meta"]["envelope/decision"]["decision_id"])


def pending_id(result: dict[str, Any]) -> str:
    assert result["isError"] is True, result
    decision = result["_meta"]["envelope/decision"]
    assert (decision["code"], decision["check"]) == ("approval_pending", "approval"), decision
    found = APPROVAL_ID.search(decision["reason"])
    assert found, decision["reason"]
    return found.group(1)


def record(pp: ProxyProcess, decision: str) -> dict[str, Any]:
    found = [r for r in pp.audit_records() if r["decision_id"] == decision]
    assert len(found) == 1, (decision, found)
    return found[0]


def approve(pp: ProxyProcess, approval: str, reason: str = "ok") -> dict[str, Any]:
    r = httpx.post(f"{pp.admin}/v1/approvals/{approval}/approve", json={"reason": reason},
                   headers=ALICE, timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def performed_record(pp: ProxyProcess, tool: str, run: str) -> dict[str, Any]:
    """The one record of `tool` in `run` that reached the upstream (a forwarded result carries
    no decision id in its `_meta`)."""
    found = [r for r in pp.audit_records()
             if r["tool"] == tool and r.get("run") == run and r["upstream_status"] is not None]
    assert len(found) == 1, found
    return found[0]


def without_meta(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("_meta", "resultType")}


@dataclass
class Cluster:
    redis: RedisServer
    upstream: FakeUpstream
    a: ProxyProcess
    b: ProxyProcess


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("replicas")
    with running_redis(tmp) as server, fake_upstream() as fake:
        policies = write_policy(tmp / "policies", {"counted": {}}, tools=TOOLS, principals={})
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        config = _config(server.url)
        with proxy_process(tmp / "a", {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as a, \
             proxy_process(tmp / "b", {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as b:
            assert a.state_dir != b.state_dir
            yield Cluster(server, fake, a, b)


# ---- 1. an approval through A releases the call retried on B ---------------------------------

def test_approval_granted_on_a_releases_the_call_retried_on_b(cluster: Cluster) -> None:
    a, b, fake = cluster.a, cluster.b, cluster.upstream
    args, run = {"title": "r1"}, "run-replica-1"
    before = fake.calls["delete_note"]

    first = call(b, "delete_note", args, run)
    approval = pending_id(first)
    assert fake.calls["delete_note"] == before

    # A sees B's pending approval (shared store) and decides it.
    listed = httpx.get(f"{a.admin}/v1/approvals?state=pending", headers=ALICE, timeout=10)
    assert listed.status_code == 200, listed.text
    assert approval in [x["id"] for x in listed.json()["approvals"]]
    assert approve(a, approval, "replica test")["state"] == "approved"

    performed = call(b, "delete_note", args, run)
    assert performed["isError"] is False, performed
    assert fake.calls["delete_note"] == before + 1
    rec = performed_record(b, "delete_note", run)
    assert (rec["verdict"], rec["code"], rec["upstream_status"]) == ("allow", "ok", 200)
    assert rec["extra"]["approval_id"] == approval
    assert rec["extra"]["approver"] == "alice"
    # The decision is A's, the release is B's: A's own log has the decision's `<approval>`
    # record and no record of the release; B's release names that decision.
    on_a = [r for r in a.audit_records() if r.get("run") == run]
    assert [(r["method"], r["extra"]["decision"]) for r in on_a] == [("<approval>", "approved")]
    assert rec["extra"]["approval_record"] == on_a[0]["decision_id"]

    # Retried again, on either replica: replayed, never performed a second time.
    again_b = call(b, "delete_note", args, run)
    again_a = call(a, "delete_note", args, run)
    assert fake.calls["delete_note"] == before + 1
    for again in (again_b, again_a):
        assert again["_meta"]["envelope/replayed"] is True, again
        assert code_of(again) == "replayed"
        assert without_meta(again) == without_meta(performed)
    shown = httpx.get(f"{b.admin}/v1/approvals/{approval}", headers=ALICE, timeout=10).json()
    assert (shown["state"], shown["approver"]) == ("consumed", "alice")


# ---- 2. performed on A, retried on B: replayed ------------------------------------------------

def test_gated_call_performed_on_a_is_replayed_on_b(cluster: Cluster) -> None:
    a, b, fake = cluster.a, cluster.b, cluster.upstream
    args, run = {"title": "r2"}, "run-replica-2"
    before = fake.calls["delete_note"]

    approval = pending_id(call(a, "delete_note", args, run))
    approve(b, approval)  # decided on B this time
    performed = call(a, "delete_note", args, run)
    assert performed["isError"] is False, performed
    assert fake.calls["delete_note"] == before + 1

    replayed = call(b, "delete_note", args, run)
    assert fake.calls["delete_note"] == before + 1
    assert replayed["_meta"]["envelope/replayed"] is True, replayed
    assert without_meta(replayed) == without_meta(performed)
    rec = record(b, decision_id(replayed))
    assert (rec["verdict"], rec["code"], rec["check"]) == ("allow", "replayed", "idempotency")
    assert rec["upstream_status"] is None
    assert rec["extra"]["replayed"] is True
    first = performed_record(a, "delete_note", run)  # in A's log, not B's
    assert rec["extra"]["replayed_from"] == first["decision_id"]
    assert first["extra"]["approval_id"] == approval
    assert not [r for r in b.audit_records() if r["decision_id"] == first["decision_id"]]


def test_keyed_call_performed_on_a_is_replayed_on_b(cluster: Cluster) -> None:
    a, b, fake = cluster.a, cluster.b, cluster.upstream
    args, run = {"title": "k1", "body": "once"}, "run-replica-key"
    key = {"Idempotency-Key": "replica-key-1"}
    before = fake.calls["write_note"]

    performed = call(a, "write_note", args, run, headers=key)
    assert performed["isError"] is False, performed
    replayed = call(b, "write_note", args, run, headers=key)
    assert fake.calls["write_note"] == before + 1
    assert replayed["_meta"]["envelope/replayed"] is True, replayed
    assert without_meta(replayed) == without_meta(performed)
    rec = record(b, decision_id(replayed))
    assert rec["code"] == "replayed" and rec["extra"]["replayed"] is True
    assert rec["extra"]["idempotency_key"] == "replica-key-1"
    assert rec["extra"]["replayed_from"] == performed_record(a, "write_note", run)["decision_id"]
    # The same key for other arguments is a conflict on the other replica too.
    clash = call(b, "write_note", {"title": "k1", "body": "other"}, run, headers=key)
    assert code_of(clash) == "idempotency_conflict"
    assert fake.calls["write_note"] == before + 1


def test_concurrent_duplicates_on_both_replicas_perform_once(cluster: Cluster) -> None:
    a, b, fake = cluster.a, cluster.b, cluster.upstream
    args, run = {"title": "c1", "body": "race"}, "run-replica-race"
    key = {"Idempotency-Key": "replica-race-1"}
    before = fake.calls["write_note"]
    fake.delay = 0.7  # the first is still in flight when the other replica gets its duplicate
    results: dict[str, dict[str, Any]] = {}
    try:
        def one(name: str, pp: ProxyProcess) -> None:
            results[name] = call(pp, "write_note", args, run, headers=key, timeout=30)

        threads = [threading.Thread(target=one, args=(n, p)) for n, p in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        fake.delay = 0.0
    assert set(results) == {"a", "b"}
    assert fake.calls["write_note"] == before + 1
    assert all(r["isError"] is False for r in results.values()), results
    replayed = [n for n, r in results.items() if (r.get("_meta") or {}).get("envelope/replayed")]
    assert len(replayed) == 1, results
    assert without_meta(results["a"]) == without_meta(results["b"])


# ---- 3. one token bucket for both replicas ------------------------------------------------------

def test_a_rate_limit_is_one_bucket_across_replicas(cluster: Cluster) -> None:
    a, b, fake = cluster.a, cluster.b, cluster.upstream
    results = [call(pp, "lookup", {"n": n}, f"run-rate-{n}") for n, pp in enumerate((a, b, a))]
    assert [r["isError"] for r in results] == [False, False, False]
    assert fake.calls["lookup"] == 3
    on_b, on_a = call(b, "lookup", {"n": 3}, "run-rate-3"), call(a, "lookup", {"n": 4}, "run-rate-4")
    assert fake.calls["lookup"] == 3  # neither was forwarded
    for refused in (on_b, on_a):
        d = refused["_meta"]["envelope/decision"]
        assert (d["code"], d["rule"]) == ("rate_limited", "tools.counted.lookup.rate"), d
        assert 15.0 < d["retry_after"] <= 20.0, d  # one token a third of a minute, on Redis's clock
        assert d["reason"].endswith(f"retry in {d['retry_after']:.1f}s")
    rec = record(b, decision_id(on_b))
    assert (rec["verdict"], rec["code"], rec["upstream_status"]) == ("deny", "rate_limited", None)
    assert rec["extra"]["retry_after"] == on_b["_meta"]["envelope/decision"]["retry_after"]


# ---- 4. losing Redis: fail closed, recover without a restart ----------------------------------

def _readyz(pp: ProxyProcess) -> httpx.Response:
    return httpx.get(f"{pp.admin}/readyz", timeout=5)


def _wait_ready(pp: ProxyProcess, ready: bool, within: float = 15.0) -> httpx.Response:
    deadline = time.monotonic() + within
    while True:
        r = _readyz(pp)
        if (r.status_code == 200) == ready:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"/readyz still {r.status_code} {r.text} after {within}s")
        time.sleep(0.1)


def test_replica_losing_redis_fails_closed_and_recovers(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server, fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools=TOOLS, principals={})
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=_config(server.url)) as pp:
            assert _wait_ready(pp, True).json()["ready"] is True
            port = server.port

            server.kill()
            # A gated call can neither read nor create its approval: refused, never performed.
            started = time.monotonic()
            down = call(pp, "delete_note", {"title": "lost"}, "run-lost")
            assert time.monotonic() - started < 10
            assert down["isError"] is True
            decision = down["_meta"]["envelope/decision"]
            # The first check that needs the store refuses (delegation records the run's
            # lineage before shadow and approval look at it); whichever: store_unavailable.
            assert decision["code"] == "store_unavailable", decision
            assert decision["check"] in ("delegation", "shadow", "approval"), decision
            assert f"127.0.0.1:{port}" in decision["reason"], decision  # names the store
            assert fake.calls["delete_note"] == 0
            rec = record(pp, decision["decision_id"])
            assert (rec["verdict"], rec["code"]) == ("error", "store_unavailable")
            assert rec["upstream_status"] is None

            # A keyed writer needs its idempotency record: refused as well.
            keyed = call(pp, "write_note", {"title": "lost"}, "run-lost",
                         headers={"Idempotency-Key": "lost-1"})
            assert code_of(keyed) == "store_unavailable", keyed
            assert fake.calls["write_note"] == 0

            # A rate-limited call cannot take its token: refused, never performed.
            limited = call(pp, "lookup", {}, "run-lost")
            decision = limited["_meta"]["envelope/decision"]
            assert (decision["code"], decision["check"]) == ("store_unavailable", "rate_limit"), decision
            assert fake.calls["lookup"] == 0

            # Read-only calls need no state: still served.
            read = call(pp, "echo", {"text": "still here"}, "run-lost")
            assert read["isError"] is False, read
            assert fake.calls["echo"] == 1

            # Readiness names the store.
            r = _wait_ready(pp, False)
            assert r.status_code == 503
            reasons = " ".join(r.json()["reasons"])
            assert "state store (redis) unavailable" in reasons, r.json()
            assert httpx.get(f"{pp.admin}/healthz", timeout=5).status_code == 200

            # Redis returns on the same port (empty: no persistence); no proxy restart.
            server.start()
            assert server.port == port
            _wait_ready(pp, True)
            back = call(pp, "delete_note", {"title": "back"}, "run-back")
            approval = pending_id(back)
            approve(pp, approval)
            done = call(pp, "delete_note", {"title": "back"}, "run-back")
            assert done["isError"] is False, done
            assert fake.calls["delete_note"] == 1
            again = call(pp, "delete_note", {"title": "back"}, "run-back")
            assert again["_meta"]["envelope/replayed"] is True
            assert fake.calls["delete_note"] == 1
            assert pp.proc.poll() is None
            assert "state store (redis) available again" in pp.log()


def test_a_hung_redis_refuses_the_calls_that_need_it_with_a_reply_and_a_record(tmp_path: Path) -> None:
    """Redis paused (SIGSTOP: the port is open, nothing answers). A read whose untrusted
    result the data-flow ledger must record (enforce) reaches the upstream, then meets the
    store's deadline while its completion runs: the client gets the refusal
    (`store_unavailable`, the result withheld) and the call exactly one audit record, never a
    dropped connection; several at once alike. A call that needs no store keeps flowing, and
    once Redis answers again everything does."""
    tools = {**TOOLS, "notes.fetch": {"effect": "read"}}
    with running_redis(tmp_path) as server, fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools=tools, principals={},
                                dataflow={"mode": "enforce"})
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=_config(server.url)) as pp:
            server.pause()
            try:
                results: list[Any] = []

                def fetch(i: int) -> None:
                    try:
                        results.append(call(pp, "fetch", {"n": i}, f"run-hung-{i}", timeout=30))
                    except Exception as exc:  # reported below
                        results.append(exc)

                threads = [threading.Thread(target=fetch, args=(i,)) for i in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                assert len(results) == 3 and all(isinstance(r, dict) for r in results), results
                for r in results:
                    assert r["isError"] is True, r
                    decision = r["_meta"]["envelope/decision"]
                    assert decision["code"] == "store_unavailable", decision
                    assert "withheld" in decision["reason"], decision
                    rec = record(pp, decision["decision_id"])
                    assert (rec["verdict"], rec["code"], rec["upstream_status"]) == ("error", "store_unavailable", 200)
                    assert rec["extra"]["withheld"] == {"verdict": "allow", "code": "ok"}
                assert fake.calls["fetch"] == 3
            finally:
                server.resume()
            _wait_ready(pp, True)
            back = call(pp, "fetch", {"n": 9}, "run-hung-back")
            assert back["isError"] is False, back
            assert pp.proc.poll() is None


def _redis_command(port: int, *args: str) -> bytes:
    """One command to the test's redis-server over RESP; its raw reply."""
    packed = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a)}\r\n{a}\r\n".encode() for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(packed)
        return s.recv(4096)


def test_a_redis_that_refuses_writes_is_not_ready(tmp_path: Path) -> None:
    """Redis answers PING but refuses every write (`-OOM` at `maxmemory`; a read-only replica
    answers `-READONLY` the same way): gated, keyed, limited and recorded calls are all refused
    `store_unavailable`, so /readyz says so (a load balancer sends the agents elsewhere), and is
    ready again once writes are taken."""
    with running_redis(tmp_path) as server, fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools=TOOLS, principals={})
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=_config(server.url)) as pp:
            _wait_ready(pp, True)
            assert _redis_command(server.port, "CONFIG", "SET", "maxmemory", "1").startswith(b"+OK")
            keyed = call(pp, "write_note", {"title": "oom"}, "run-oom", headers={"Idempotency-Key": "oom-1"})
            assert code_of(keyed) == "store_unavailable" and "maxmemory" in keyed["content"][0]["text"], keyed
            assert fake.calls["write_note"] == 0
            reasons = " ".join(_wait_ready(pp, False).json()["reasons"])
            assert "state store (redis) unavailable" in reasons and "maxmemory" in reasons, reasons
            assert _redis_command(server.port, "CONFIG", "SET", "maxmemory", "0").startswith(b"+OK")
            _wait_ready(pp, True)
            done = call(pp, "write_note", {"title": "oom"}, "run-oom", headers={"Idempotency-Key": "oom-1"})
            assert done["isError"] is False, done
