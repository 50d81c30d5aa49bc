"""Idempotent replay through the real proxy process.

A repeat of a performed call (same client Idempotency-Key, or an `idempotent: true` tool called
again with the same arguments in the same run) is answered with the stored first result, marked
`_meta["envelope/replayed"]` and audited as replayed; the upstream performs it once. Two
concurrent duplicates: one performs, the other waits and gets the same result. With the
default SQLite store the record survives a proxy restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import cli, fixture_policy, write_policy
from fake_upstream import RESET, FakeUpstream, fake_upstream

from tests.harness import (
    ADMIN_TOKEN,
    ProxyProcess,
    free_port,
    mcp_client,
    metric_value,
    proxy_process,
    rpc,
    token,
)
from tests.redis_server import running_redis

OPS = token("ops", tenant="acme")
TOOLS = {
    "notes.echo": {"effect": "read"},
    "notes.write_note": {"effect": "write"},
    "notes.tally": {"effect": "write", "idempotent": True},
}
STATIC = {"mode": "static", "principal": "agent"}


def call_body(tool: str, args: dict[str, Any], id: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": args}}


def result_of(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()["result"]
    return result


def record(pp: ProxyProcess, decision_id: str) -> dict[str, Any]:
    [rec] = [r for r in pp.audit_records() if r["decision_id"] == decision_id]
    return rec


def without_meta(result: dict[str, Any]) -> dict[str, Any]:
    # The proxy's own answers carry resultType for 2026-07-28 clients; the fake upstream omits it.
    return {k: v for k, v in result.items() if k not in ("_meta", "resultType")}


# ---- the SDK client and the demo notes server ------------------------------------------------

@pytest.fixture(scope="module")
def sdk_proxy(tmp_path_factory: pytest.TempPathFactory, sse_upstream: Any) -> Iterator[ProxyProcess]:
    tmp = tmp_path_factory.mktemp("idem-sdk")
    with proxy_process(tmp, {"notes": sse_upstream.url}, config={"store": {"kind": "memory"}}) as pp:
        yield pp


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_replay_returns_the_identical_result_marked_replayed(sdk_proxy: ProxyProcess, mode: str) -> None:
    pp = sdk_proxy
    args = {"title": f"idem-{mode}", "body": "once", "folder": "inbox"}
    headers = {"Idempotency-Key": f"sdk-{mode}-1"}
    async with mcp_client(pp.url("notes"), mode, bearer=OPS, headers=headers) as c:
        first = await c.call_tool("write_note", args)
        again = await c.call_tool("write_note", args)
    assert first.is_error is False and again.is_error is False
    assert again.content == first.content
    assert again.structured_content == first.structured_content
    assert not (first.meta or {}).get("envelope/replayed")
    meta = again.meta or {}
    assert meta["envelope/replayed"] is True
    decision = meta["envelope/decision"]
    assert (decision["code"], decision["check"]) == ("replayed", "idempotency")

    replayed = record(pp, decision["decision_id"])
    assert (replayed["verdict"], replayed["code"], replayed["check"]) == ("allow", "replayed", "idempotency")
    assert replayed["upstream_status"] is None  # not forwarded
    assert replayed["extra"]["replayed"] is True
    assert replayed["extra"]["idempotency_key"] == f"sdk-{mode}-1"
    performed = record(pp, replayed["extra"]["replayed_from"])
    assert (performed["code"], performed["upstream_status"]) == ("ok", 200)
    assert performed["extra"]["idempotency_key"] == f"sdk-{mode}-1"
    assert performed["args_digest"] == replayed["args_digest"]
    assert metric_value(pp.metrics(), "envelope_idempotent_replays_total") >= 1


# ---- a counting upstream --------------------------------------------------------------------

@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, FakeUpstream]]:
    tmp = tmp_path_factory.mktemp("idem-count")
    with fake_upstream() as fake:
        policies = write_policy(tmp / "policies", {"counted": {}}, tools=TOOLS, principals={})
        with proxy_process(tmp, {"counted": fake.url}, policies=policies, identity=STATIC,
                           config={"store": {"kind": "memory"}}) as pp:
            yield pp, fake


def test_client_key_performs_once(counted: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = counted
    headers = {"Idempotency-Key": "count-1"}
    before = fake.calls["write_note"]
    first = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "a"}), headers=headers))
    second = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "a"}, 2), headers=headers))
    assert fake.calls["write_note"] == before + 1
    assert without_meta(second) == without_meta(first)
    assert second["_meta"]["envelope/replayed"] is True
    # The same key for other arguments is refused, not answered with the first result.
    clash = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "b"}, 3), headers=headers))
    assert clash["isError"] is True
    assert clash["_meta"]["envelope/decision"]["code"] == "idempotency_conflict"
    # The key in _meta works the same as the header.
    body = call_body("write_note", {"title": "c"}, 4)
    body["params"]["_meta"] = {"envelope/idempotency_key": "count-meta"}
    one = result_of(rpc(pp.url("counted"), body))
    two = result_of(rpc(pp.url("counted"), body))
    assert fake.calls["write_note"] == before + 2
    assert two["_meta"]["envelope/replayed"] is True and without_meta(two) == without_meta(one)


def test_idempotent_tool_replays_within_its_run(counted: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = counted
    before = fake.calls["tally"]
    run = {"X-Envelope-Run": "run-tally"}
    first = result_of(rpc(pp.url("counted"), call_body("tally", {"n": 1}), headers=run))
    second = result_of(rpc(pp.url("counted"), call_body("tally", {"n": 1}), headers=run))
    assert fake.calls["tally"] == before + 1
    assert second["_meta"]["envelope/replayed"] is True
    assert without_meta(second) == without_meta(first)
    # Another run, or other arguments, is another call.
    result_of(rpc(pp.url("counted"), call_body("tally", {"n": 1}), headers={"X-Envelope-Run": "run-other"}))
    result_of(rpc(pp.url("counted"), call_body("tally", {"n": 2}), headers=run))
    assert fake.calls["tally"] == before + 3
    # A plain writer without a key is not deduplicated.
    before_w = fake.calls["write_note"]
    result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "z"}), headers=run))
    result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "z"}), headers=run))
    assert fake.calls["write_note"] == before_w + 2


async def test_concurrent_duplicates_call_the_upstream_once(counted: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = counted
    fake.delay = 0.5  # the first is still in flight when the second arrives
    before = fake.calls["write_note"]
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "MCP-Protocol-Version": "2026-07-28", "Idempotency-Key": "concurrent-1"}
    body = json.dumps(call_body("write_note", {"title": "together"}))
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            a, b = await asyncio.gather(
                client.post(pp.url("counted"), content=body, headers=headers),
                client.post(pp.url("counted"), content=body, headers=headers),
            )
    finally:
        fake.delay = 0.0
    ra, rb = result_of(a), result_of(b)
    assert fake.calls["write_note"] == before + 1
    assert without_meta(ra) == without_meta(rb)
    assert ra["isError"] is False
    assert sorted(bool(r.get("_meta", {}).get("envelope/replayed")) for r in (ra, rb)) == [False, True]


# ---- SQLite (the default store) across a restart ----------------------------------------------

def test_replay_after_restart_with_sqlite(tmp_path: Path) -> None:
    pytest.importorskip("proxy.store.sqlite")
    with fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools=TOOLS, principals={})
        headers = {"Idempotency-Key": "restart-1"}
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC) as pp:
            first = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "r"}), headers=headers))
        assert (tmp_path / "state" / "state.db").exists()
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC) as pp:
            again = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "r"}), headers=headers))
            rec = record(pp, again["_meta"]["envelope/decision"]["decision_id"])
        assert fake.calls["write_note"] == 1
        assert again["_meta"]["envelope/replayed"] is True
        assert without_meta(again) == without_meta(first)
        assert rec["code"] == "replayed"


# ---- a first call whose outcome is unknown ----------------------------------------------------

def test_a_keyed_writer_that_timed_out_upstream_is_not_performed_again(tmp_path: Path) -> None:
    """The upstream got the call and performed it after the proxy stopped waiting: a retry with
    the same key must not reach the upstream a second time (the outcome was unknown, not a
    failure), while the claim lasts."""
    with fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"slow": {"timeout": "500ms"}},
                                tools={"notes.write_note": {"effect": "write"}}, principals={})
        config = {"store": {"kind": "memory"}, "idempotency": {"wait": 0.5}}
        with proxy_process(tmp_path, {"slow": fake.url}, policies=policies, identity=STATIC,
                           config=config) as pp:
            fake.delay = 1.0
            headers = {"Idempotency-Key": "slow-1"}
            first = result_of(rpc(pp.url("slow"), call_body("write_note", {"title": "t"}), headers=headers))
            assert first["_meta"]["envelope/decision"]["code"] == "upstream_timeout"
            fake.delay = 0.0
            for _ in range(100):  # the upstream finishes the first call on its own
                if fake.calls["write_note"] == 1:
                    break
                time.sleep(0.05)
            assert fake.calls["write_note"] == 1
            again = result_of(rpc(pp.url("slow"), call_body("write_note", {"title": "t"}, 2), headers=headers))
            assert fake.attempts["write_note"] == 1, "the retry reached the upstream a second time"
            assert again["isError"] is True
            assert again["_meta"]["envelope/decision"]["code"] == "idempotency_in_flight"


async def test_a_keyed_writer_whose_client_left_mid_call_is_not_performed_again(tmp_path: Path) -> None:
    """The client closes its connection while the upstream performs the call: the agent's retry
    with the same key must not reach the upstream a second time."""
    with fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"slow": {}},
                                tools={"notes.write_note": {"effect": "write"}}, principals={})
        config = {"store": {"kind": "memory"}, "idempotency": {"wait": 0.5}}
        with proxy_process(tmp_path, {"slow": fake.url}, policies=policies, identity=STATIC,
                           config=config) as pp:
            fake.delay = 1.0
            headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                       "MCP-Protocol-Version": "2026-07-28", "Idempotency-Key": "gone-1"}
            body = json.dumps(call_body("write_note", {"title": "t"}))
            async with httpx.AsyncClient(timeout=10) as client:
                asking = asyncio.create_task(client.post(pp.url("slow"), content=body, headers=headers))
                for _ in range(100):  # the call reached the upstream
                    if fake.attempts["write_note"] == 1:
                        break
                    await asyncio.sleep(0.02)
                asking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asking
            for _ in range(100):  # the upstream finishes it; the proxy audits the leaving client
                if fake.calls["write_note"] == 1 and pp.audit_records():
                    break
                await asyncio.sleep(0.05)
            assert [r["code"] for r in pp.audit_records()] == ["client_disconnected"]
            fake.delay = 0.0
            again = result_of(rpc(pp.url("slow"), call_body("write_note", {"title": "t"}, 2),
                                  headers={"Idempotency-Key": "gone-1"}))
            assert fake.attempts["write_note"] == 1, "the retry reached the upstream a second time"
            assert again["_meta"]["envelope/decision"]["code"] == "idempotency_in_flight"


@contextlib.contextmanager
def _store(kind: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The runtime config of a state store of `kind`: the SQLite file (the default) or a real
    redis-server started here."""
    if kind == "sqlite":
        yield {}
        return
    with running_redis(tmp_path / "redis") as server:
        yield {"store": {"kind": "redis", "url": server.url, "timeout": 1.0}}


@pytest.mark.parametrize("store", ["sqlite", "redis"])
@pytest.mark.parametrize("failure", [500, RESET], ids=["http-500", "reset-after-body"])
def test_a_keyed_writer_with_an_unknown_outcome_is_not_sent_again(tmp_path: Path, store: str,
                                                                 failure: int) -> None:
    """The upstream answers HTTP 500, or drops the connection after reading the call: the write
    may have happened. The retry with the same key is refused on the wire, naming the first
    decision and that its outcome is unknown, and audited; it never reaches the upstream."""
    (tmp_path / "redis").mkdir()
    with fake_upstream() as fake, _store(store, tmp_path) as config:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools=TOOLS, principals={})
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as pp:
            fake.fail["write_note"] = [failure]
            headers = {"Idempotency-Key": f"unknown-{failure}"}
            first = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "u"}), headers=headers))
            assert first["isError"] is True
            assert first["_meta"]["envelope/decision"]["code"] == "upstream_error"
            first_id = first["_meta"]["envelope/decision"]["decision_id"]
            assert fake.attempts["write_note"] == 1

            again = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "u"}, 2),
                                  headers=headers))
            assert fake.attempts["write_note"] == 1, "the retry reached the upstream a second time"
            decision = again["_meta"]["envelope/decision"]
            assert again["isError"] is True
            assert (decision["code"], decision["check"]) == ("idempotency_in_flight", "idempotency")
            assert first_id in decision["reason"] and "outcome is unknown" in decision["reason"]
            rec = record(pp, decision["decision_id"])
            assert (rec["code"], rec["upstream_status"]) == ("idempotency_in_flight", None)
            assert rec["extra"]["outcome_unknown_from"] == first_id
            assert rec["extra"]["idempotency_key"] == f"unknown-{failure}"
            # A new key is a new call: it is performed.
            fresh = result_of(rpc(pp.url("counted"), call_body("write_note", {"title": "u"}, 3),
                                  headers={"Idempotency-Key": f"unknown-{failure}-b"}))
            assert fresh["isError"] is False and fake.calls["write_note"] == 1


def test_what_certainly_was_not_performed_frees_the_key(tmp_path: Path) -> None:
    """An upstream refusing the call (HTTP 4xx), and a tool the policy declares idempotent, leave
    the key free: the retry is performed."""
    with fake_upstream() as fake:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools=TOOLS, principals={})
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC) as pp:
            fake.fail["write_note"] = [409]
            fake.fail["tally"] = [500]
            for tool, key in (("write_note", "refused-1"), ("tally", "tally-1")):
                headers = {"Idempotency-Key": key}
                first = result_of(rpc(pp.url("counted"), call_body(tool, {"n": 1}), headers=headers))
                assert first["_meta"]["envelope/decision"]["code"] == "upstream_error"
                again = result_of(rpc(pp.url("counted"), call_body(tool, {"n": 1}, 2), headers=headers))
                assert again["isError"] is False, again
                assert (fake.attempts[tool], fake.calls[tool]) == (2, 1)


def test_a_keyed_writer_never_sent_frees_its_key_and_budget(tmp_path: Path) -> None:
    """No connection to the upstream (nothing listens on its port): certainly not performed. The
    retry with the same key is sent again (not refused as unknown), and neither call spent the
    run's budget of 1."""
    defaults = {**fixture_policy()["defaults"], "max_calls_per_run": 1}
    policies = write_policy(tmp_path / "policies", {"down": {}}, tools=TOOLS, principals={},
                            defaults=defaults)
    closed = f"http://127.0.0.1:{free_port()}/mcp"
    with proxy_process(tmp_path, {"down": closed}, policies=policies, identity=STATIC) as pp:
        headers = {"Idempotency-Key": "never-sent-1", "X-Envelope-Run": "down-run"}
        codes = []
        for n in range(3):
            reply = result_of(rpc(pp.url("down"), call_body("write_note", {"title": "d"}, n), headers=headers))
            codes.append(reply["_meta"]["envelope/decision"]["code"])
        assert codes == ["upstream_error"] * 3, codes
        assert [r["code"] for r in pp.audit_records()] == ["upstream_error"] * 3


# ---- an approver releases a key whose outcome is unknown --------------------------------------

def _release(pp: ProxyProcess, decision_id: str, token: str | None = ADMIN_TOKEN,
             reason: str = "checked upstream: not performed") -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{pp.admin}/v1/idempotency/{decision_id}/release", json={"reason": reason},
                      headers=headers, timeout=10)


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_an_approver_releases_a_key_whose_outcome_is_unknown(tmp_path: Path, store: str) -> None:
    """The upstream answers HTTP 500 once: the retry is refused. Without a token the release is
    401; an approver releases the key by the decision id the refusal names; the retry is then
    performed (the upstream counts 2 calls); the release and the retry are audited; releasing
    again is 404, and so is releasing the key of a call that was performed (done)."""
    (tmp_path / "redis").mkdir()
    with fake_upstream() as fake, _store(store, tmp_path) as config:
        policies = write_policy(tmp_path / "policies", {"counted": {}}, tools=TOOLS, principals={})
        with proxy_process(tmp_path, {"counted": fake.url}, policies=policies, identity=STATIC,
                           config=config) as pp:
            fake.fail["write_note"] = [500]
            headers = {"Idempotency-Key": "release-1"}
            body = call_body("write_note", {"title": "r"})
            first = result_of(rpc(pp.url("counted"), body, headers=headers))
            assert first["_meta"]["envelope/decision"]["code"] == "upstream_error"
            first_id = first["_meta"]["envelope/decision"]["decision_id"]
            refused = result_of(rpc(pp.url("counted"), body, headers=headers))
            assert refused["_meta"]["envelope/decision"]["code"] == "idempotency_in_flight"
            assert fake.attempts["write_note"] == 1

            anonymous = _release(pp, first_id, token=None)
            assert anonymous.status_code == 401, anonymous.text
            assert _release(pp, first_id, token="not-an-approver").status_code == 401
            still = result_of(rpc(pp.url("counted"), body, headers=headers))
            assert still["_meta"]["envelope/decision"]["code"] == "idempotency_in_flight"
            assert fake.attempts["write_note"] == 1

            if store == "sqlite":
                released = _release(pp, first_id)
                assert released.status_code == 200, released.text
                answer = released.json()
            else:  # the CLI, next to approve and deny
                done_cli = cli("idempotency", "release", first_id, "--reason",
                               "checked upstream: not performed", "--json",
                               "--admin", pp.admin, "--token", ADMIN_TOKEN)
                assert done_cli.returncode == 0, done_cli.stderr
                answer = json.loads(done_cli.stdout)
            assert (answer["decision_id"], answer["released"], answer["idempotency_key"],
                    answer["tool"]) == (first_id, True, "release-1", "write_note")

            retry = result_of(rpc(pp.url("counted"), body, headers=headers))
            assert retry["isError"] is False, retry
            assert (fake.attempts["write_note"], fake.calls["write_note"]) == (2, 1)
            [performed] = [r for r in pp.audit_records() if r["tool"] == "write_note"
                           and r["code"] == "ok"]
            retry_id = performed["decision_id"]
            # The retry's result is kept: the next repeat replays it, never performs it again.
            again = result_of(rpc(pp.url("counted"), body, headers=headers))
            assert again["_meta"]["envelope/replayed"] is True
            assert fake.attempts["write_note"] == 2

            second = _release(pp, first_id)
            assert second.status_code == 404, second.text
            # The CLI says the same, and exits 1.
            again_cli = cli("idempotency", "release", first_id, "--reason", "again",
                            "--admin", pp.admin, "--token", ADMIN_TOKEN)
            assert again_cli.returncode == 1 and "404" in again_cli.stderr, again_cli.stderr
            done = _release(pp, retry_id)  # performed, its result stored: nothing unknown
            assert done.status_code == 404, done.text

            records = pp.audit_records()
            [rel] = [r for r in records if r["decision_id"] == answer["record"]]
            assert (rel["method"], rel["tool"], rel["check"], rel["verdict"], rel["code"]) == (
                "<idempotency>", "<idempotency>", "idempotency", "allow", "ok")
            assert rel["extra"]["approver"] == "operator"
            assert rel["extra"]["released_from"] == first_id
            assert rel["extra"]["idempotency_key"] == "release-1"
            assert "checked upstream: not performed" in rel["reason"]
            assert (rel["principal"], rel["upstream"], rel["extra"]["tool"]) == (
                "agent", "counted", "write_note")
            assert performed["upstream_status"] == 200
            assert performed["extra"]["idempotency_key"] == "release-1"
            assert records.index(rel) < records.index(performed)
            failed = [r for r in records if r["code"] == "unauthorized"]
            assert failed and failed[0]["extra"]["decision_id"] == first_id
            assert failed[0]["extra"]["action"] == "release"
            assert metric_value(pp.metrics(), "envelope_idempotency_releases_total") == 1
