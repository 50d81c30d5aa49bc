"""Bounded retry of transient upstream failures, through the real proxy process.

Only read-only calls and tools the policy declares `idempotent: true` are retried; any other
writer is sent once, whether or not the client sent an idempotency key (promise 3). Asserted: the reply, the upstream's own request count, the audit
record's `attempts` and `envelope_upstream_retries_total`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_helpers import write_policy
from fake_upstream import FakeUpstream, fake_upstream

from tests.harness import ProxyProcess, free_port, metric_value, proxy_process, rpc

TOOLS = {
    "notes.echo": {"effect": "read"},
    "notes.write_note": {"effect": "write"},
    "notes.set_status": {"effect": "write", "idempotent": True},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, FakeUpstream]]:
    tmp = tmp_path_factory.mktemp("retries")
    dead = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    with fake_upstream() as fake:
        policies = write_policy(tmp / "policies", {"flaky": {}, "dead": {}}, tools=TOOLS, principals={})
        with proxy_process(tmp, {"flaky": fake.url, "dead": dead}, policies=policies,
                           identity={"mode": "static", "principal": "agent"},
                           config={"store": {"kind": "memory"},
                                   "retry": {"attempts": 3, "backoff": "50ms", "max_backoff": "1s"}}) as pp:
            yield pp, fake


def call(pp: ProxyProcess, upstream: str, tool: str, args: dict[str, Any],
         headers: dict[str, str] | None = None) -> dict[str, Any]:
    resp = rpc(pp.url(upstream), {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                                  "params": {"name": tool, "arguments": args}}, headers=headers)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()["result"]
    return result


def record_of(pp: ProxyProcess, result: dict[str, Any] | None = None) -> dict[str, Any]:
    records = pp.audit_records()
    if result is not None and "_meta" in result:
        decision_id = result["_meta"]["envelope/decision"]["decision_id"]
        return next(r for r in records if r["decision_id"] == decision_id)
    return records[-1]


def retries(pp: ProxyProcess, upstream: str) -> float:
    return metric_value(pp.metrics(), "envelope_upstream_retries_total", upstream=upstream)


def test_read_only_call_is_retried_through_503s(world: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = world
    before = retries(pp, "flaky")
    fake.fail["echo"] = [503, 503]
    result = call(pp, "flaky", "echo", {"text": "hi"})
    assert result["isError"] is False
    assert result["content"][0]["text"] == f"echo #{fake.calls['echo']}"
    assert fake.fail["echo"] == []
    rec = record_of(pp)
    assert (rec["tool"], rec["verdict"], rec["code"], rec["upstream_status"]) == ("echo", "allow", "ok", 200)
    assert rec["extra"]["attempts"] == 3
    assert retries(pp, "flaky") == before + 2


def test_retry_after_is_honoured(world: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = world
    fake.fail["echo"] = [429]
    fake.retry_after = "0.4"
    try:
        started = time.monotonic()
        result = call(pp, "flaky", "echo", {"text": "later"})
        assert time.monotonic() - started >= 0.4
    finally:
        fake.retry_after = None
    assert result["isError"] is False
    assert record_of(pp)["extra"]["attempts"] == 2


def test_attempts_are_bounded(world: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = world
    before_attempts = fake.attempts["echo"]
    fake.fail["echo"] = [503, 503, 503, 503]
    result = call(pp, "flaky", "echo", {"text": "no luck"})
    fake.fail["echo"] = []
    assert result["isError"] is True
    assert result["_meta"]["envelope/decision"]["code"] == "upstream_error"
    assert fake.attempts["echo"] - before_attempts == 3
    rec = record_of(pp, result)
    assert rec["extra"]["attempts"] == 3 and rec["upstream_status"] == 503


@pytest.mark.parametrize(("key", "status"), [(None, 503), ("retry-k1", 502)])
def test_a_writer_is_not_retried_keyed_or_not(
        world: tuple[ProxyProcess, FakeUpstream], key: str | None, status: int) -> None:
    # The key lets the envelope replay the agent's own repeats; it does not say the upstream can
    # take the request twice. Only the policy can (`idempotent: true`, below).
    pp, fake = world
    before, before_attempts = retries(pp, "flaky"), fake.attempts["write_note"]
    fake.fail["write_note"] = [status]
    headers = {"Idempotency-Key": key} if key else None
    result = call(pp, "flaky", "write_note", {"title": key or "once"}, headers=headers)
    fake.fail["write_note"] = []
    assert result["isError"] is True
    assert result["_meta"]["envelope/decision"]["code"] == "upstream_error"
    assert fake.attempts["write_note"] - before_attempts == 1
    extra = record_of(pp, result).get("extra", {})
    assert "attempts" not in extra and extra.get("idempotency_key") == key
    assert retries(pp, "flaky") == before


def test_writer_the_policy_declares_idempotent_is_retried(world: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = world
    before, before_attempts = retries(pp, "flaky"), fake.attempts["set_status"]
    fake.fail["set_status"] = [502]
    result = call(pp, "flaky", "set_status", {"status": "done"})
    assert result["isError"] is False
    assert fake.attempts["set_status"] - before_attempts == 2
    assert fake.calls["set_status"] == 1
    assert record_of(pp, result)["extra"]["attempts"] == 2
    assert retries(pp, "flaky") == before + 1


def test_connection_refused_is_retried_then_refused(world: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, _ = world
    before = retries(pp, "dead")
    result = call(pp, "dead", "echo", {"text": "anyone?"})
    assert result["isError"] is True
    assert result["_meta"]["envelope/decision"]["code"] == "upstream_error"
    assert record_of(pp, result)["extra"]["attempts"] == 3
    assert retries(pp, "dead") == before + 2
