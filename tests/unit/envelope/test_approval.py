"""Approval check and service on a MemoryStore: gating, holding, release exactly once, denial,
expiry, grants, self-approval, fail closed; and the admin API's approvals routes."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.admin.approvals_api import add_routes
from proxy.approvals.approvers import Approvers
from proxy.approvals.notifier import ApprovalNotifier
from proxy.approvals.records import (
    NS_APPROVAL,
    Approval,
    ApprovalConflict,
    CallBinding,
    GrantRequest,
    InvalidGrant,
    SelfApproval,
)
from proxy.approvals.service import ApprovalService
from proxy.audit.record import args_digest
from proxy.config import ApprovalsConfig, Config
from proxy.envelope.checks.approval import ApprovalCheck
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, RunContext, Services, ToolCall, Verdict
from proxy.errors import AuditError, StoreError
from proxy.policy.vocab import Effect
from proxy.store.memory import MemoryStore

CONFIG = ApprovalsConfig(poll_interval=0.01)


def policy(**tools: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "upstreams": UPSTREAMS,
        "tools": {
            "demo.read": {"effect": "read"},
            "demo.delete": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}},
            "demo.purge": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}},
            "demo.send": {"effect": "external"},  # gated by defaults.gated_effects
            **tools,
        },
        "principals": {"relaxed": {"gated_effects": ["destructive"]}},
    }


class World:
    def __init__(self, doc: dict[str, Any] | None = None, config: ApprovalsConfig = CONFIG,
                 store: MemoryStore | None = None):
        self.store = store if store is not None else MemoryStore()
        self.notifier = ApprovalNotifier()
        self.services = Services(store=self.store, settings=Config(approvals=config),
                                 notifier=self.notifier)
        self.check = ApprovalCheck(build_revision(doc or policy()), ToolRegistry(), self.services)
        # The admin API's service: another instance over the same store and notifier.
        self.service = ApprovalService(self.store, config, self.notifier)

    def call(self, tool: str = "delete", args: dict[str, Any] | None = None, *,
             principal: str = "agent", run: str = "run-1") -> ToolCall:
        c = make_call(tool, {"title": "x"} if args is None else args, principal=principal)
        c.run = RunContext(run, principal)
        c.effect = {"read": Effect.READ, "send": Effect.EXTERNAL}.get(tool, Effect.DESTRUCTIVE)
        return c

    async def decide(self, call: ToolCall) -> Decision | None:
        assert self.check.applies(call)
        return await self.check.decide(call)

    async def only_approval(self, state: str | None = None) -> Any:
        found = await self.service.approvals(state)  # type: ignore[arg-type]
        assert len(found) == 1, found
        return found[0]


async def pending_soon(w: World) -> None:
    """Wait (bounded) until a held call has created its approval."""
    for _ in range(400):
        if await w.service.approvals("pending"):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("no pending approval appeared")


async def spend(call: ToolCall) -> Decision | None:
    """What the idempotency check does once it holds the call's claim: spend its approval."""
    assert call.spend_approval is not None, "the call was not released as approved"
    return await call.spend_approval()


def assert_refusal(d: Decision | None, code: Code) -> Decision:
    assert d is not None and d.code is code, d
    assert d.check == "approval"
    return d


# -- gating --------------------------------------------------------------------------------


def test_gating_by_tool_policy_defaults_and_principal() -> None:
    w = World(policy(**{"demo.opt_out": {"effect": "destructive", "approval": {"required": False}},
                        "demo.read_gated": {"effect": "read", "approval": {"required": True}}}))
    assert not w.check.applies(w.call("read"))
    assert w.check.applies(w.call("delete"))
    assert w.check.applies(w.call("send"))  # external is in defaults.gated_effects
    assert not w.check.applies(w.call("opt_out"))  # an approval block decides for its tool
    read_gated = w.call("read_gated")
    read_gated.effect = Effect.READ
    assert w.check.applies(read_gated)
    # The principal's gated_effects replaces the defaults for tools without an approval block.
    assert not w.check.applies(w.call("send", principal="relaxed"))
    undeclared = w.call("unknown_effect")
    undeclared.effect = None  # no catalogue verdict: the safe default (destructive) is gated
    assert w.check.applies(undeclared)


async def test_no_store_or_disabled_is_misconfigured() -> None:
    for services in (
        Services(store=None, settings=Config(approvals=CONFIG)),
        Services(store=MemoryStore(), settings=Config(approvals=ApprovalsConfig(enabled=False))),
        None,
    ):
        check = ApprovalCheck(build_revision(policy()), ToolRegistry(), services)
        d = assert_refusal(await check.decide(World().call()), Code.MISCONFIGURED)
        assert "no approval gate is configured" in d.reason


# -- the life of one approval -----------------------------------------------------------------


async def test_pending_then_retried_after_approval_released_exactly_once() -> None:
    w = World()
    d = assert_refusal(await w.decide(w.call()), Code.APPROVAL_PENDING)
    approval = await w.only_approval("pending")
    assert d.verdict is Verdict.DENY
    assert approval.id in d.reason and "retry the same call after approval" in d.reason
    assert d.audit == {"approval_id": approval.id, "approval_state": "pending"}
    assert d.rule == "tools.demo.delete.approval"
    assert approval.args_digest == args_digest({"title": "x"})
    assert approval.arguments == {"title": "x"}
    # The same call again, still undecided: the same approval, not a second one.
    assert_refusal(await w.decide(w.call()), Code.APPROVAL_PENDING)
    await w.only_approval("pending")

    await w.service.decide(approval.id, approver="alice", approve=True, reason="looks fine")
    retried = w.call()
    assert await w.decide(retried) is None
    assert retried.audit_extra == {"approval_id": approval.id, "approver": "alice"}
    # Released, not yet spent: the idempotency check spends it once it holds the call's claim.
    assert (await w.only_approval()).state == "approved"
    assert await spend(retried) is None
    assert (await w.only_approval()).state == "consumed"
    # Once consumed, the same call goes on to the idempotency check (which replays), flagged.
    again = w.call()
    assert await w.decide(again) is None
    assert again.audit_extra["approval_state"] == "consumed"


@pytest.mark.parametrize("arguments, legacy", [
    ({"title": "x"}, True),  # a record the previous version approved (no size, no preview)
    ({"title": "x" * 2**20}, False),  # arguments stored apart: transitions rewrite the head
])
async def test_approval_released_and_spent_once_whatever_the_record_form(
        arguments: dict[str, Any], legacy: bool) -> None:
    w = World()
    assert_refusal(await w.decide(w.call(args=arguments)), Code.APPROVAL_PENDING)
    approval = await w.only_approval("pending")
    await w.service.decide(approval.id, approver="alice", approve=True, reason="fine")
    if legacy:  # approved by the previous version: its record has neither field
        raw = await w.store.get(NS_APPROVAL, approval.id)
        assert raw is not None
        old = {k: v for k, v in orjson.loads(raw).items() if k not in ("arguments_bytes", "arguments_preview")}
        await w.store.put(NS_APPROVAL, approval.id, orjson.dumps(old, option=orjson.OPT_SORT_KEYS))
    retried = w.call(args=arguments)
    assert await w.decide(retried) is None
    assert await spend(retried) is None
    assert (await w.only_approval()).state == "consumed"
    whole = await w.service.get(approval.id)
    assert whole is not None and whole.arguments == arguments


async def test_pending_reason_ends_with_the_deployments_hint() -> None:
    w = World(config=ApprovalsConfig(poll_interval=0.01, pending_hint="run `approve {id}` now"))
    d = assert_refusal(await w.decide(w.call()), Code.APPROVAL_PENDING)
    approval = await w.only_approval("pending")
    assert d.reason == (f"approval {approval.id} is pending: not decided within 0s; retry the same call "
                        f"after approval; run `approve {approval.id}` now")


async def test_approval_binds_the_exact_call() -> None:
    w = World()
    await w.decide(w.call())
    approval = await w.only_approval()
    await w.service.decide(approval.id, approver="alice", approve=True, reason="ok")
    for other in (w.call(args={"title": "y"}), w.call(run="run-2"), w.call(principal="bob")):
        assert_refusal(await w.decide(other), Code.APPROVAL_PENDING)
    assert len(await w.service.approvals("pending")) == 3
    assert len(await w.service.approvals("approved")) == 1


async def test_held_call_released_when_approved_while_waiting() -> None:
    w = World(policy(**{"demo.delete": {"effect": "destructive",
                                        "approval": {"required": True, "wait": "5s"}}}),
              config=ApprovalsConfig(poll_interval=10.0))  # only the notifier can wake it in time
    call = w.call()
    held = asyncio.create_task(w.decide(call))
    await pending_soon(w)
    approval = await w.only_approval()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await w.service.decide(approval.id, approver="alice", approve=True, reason="go")
    # Released before the 5 s wait ends (which would refuse) and long before the 10 s poll: the
    # notifier woke it. The 4 s bound leaves a loaded machine room (it was 1 s).
    assert await asyncio.wait_for(held, 4) is None
    assert loop.time() - started < 4.0
    assert call.audit_extra == {"approval_id": approval.id, "approver": "alice", "approval_reason": "policy"}


async def test_held_call_polls_the_store_for_decisions_of_other_replicas() -> None:
    w = World(policy(**{"demo.delete": {"effect": "destructive",
                                        "approval": {"required": True, "wait": "5s"}}}))
    other_replica = ApprovalService(w.store, CONFIG)  # no shared notifier: only the store
    held = asyncio.create_task(w.decide(w.call()))
    await pending_soon(w)
    await other_replica.decide((await w.only_approval()).id, approver="alice", approve=False,
                               reason="not today")
    d = assert_refusal(await asyncio.wait_for(held, 4), Code.APPROVAL_DENIED)  # within the 5 s wait
    assert "denied by alice: not today" in d.reason


async def test_concurrent_spends_release_exactly_one() -> None:
    w = World()
    await w.decide(w.call())
    approval = await w.only_approval()
    await w.service.decide(approval.id, approver="alice", approve=True, reason="ok")
    calls = [w.call() for _ in range(5)]
    assert await asyncio.gather(*(w.decide(c) for c in calls)) == [None] * 5
    spent = await asyncio.gather(*(spend(c) for c in calls))
    assert spent.count(None) == 1
    for d in spent:
        if d is not None:  # only calls with other idempotency keys can reach this
            assert_refusal(d, Code.APPROVAL_EXPIRED)
            assert d.reason == (f"approval {approval.id} was already used by another call; "
                                "ask for a new approval to perform it again")
            assert d.audit == {"approval_id": approval.id, "approval_state": "consumed"}
    # Once consumed, the same call goes on flagged: the idempotency check replays or refuses.
    later = w.call()
    assert await w.decide(later) is None
    assert later.spend_approval is None and later.audit_extra["approval_state"] == "consumed"


async def test_denied_is_refused_with_the_approvers_reason() -> None:
    w = World()
    await w.decide(w.call())
    approval = await w.only_approval()
    await w.service.decide(approval.id, approver="bob", approve=False, reason="wrong note")
    d = assert_refusal(await w.decide(w.call()), Code.APPROVAL_DENIED)
    assert d.reason == f"approval {approval.id} was denied by bob: wrong note"
    assert d.audit == {"approval_id": approval.id, "approval_state": "denied", "approver": "bob"}
    with pytest.raises(ApprovalConflict):
        await w.service.decide(approval.id, approver="alice", approve=True, reason="override")


async def test_expired_then_a_new_call_asks_again() -> None:
    w = World(policy(**{"demo.delete": {"effect": "destructive",
                                        "approval": {"required": True, "wait": "0s", "ttl": "50ms"}}}))
    await w.decide(w.call())
    first = await w.only_approval()
    await asyncio.sleep(0.08)
    assert [a.id for a in await w.service.approvals("expired")] == [first.id]
    with pytest.raises(ApprovalConflict, match="expired"):
        await w.service.decide(first.id, approver="alice", approve=True, reason="late")
    d = assert_refusal(await w.decide(w.call()), Code.APPROVAL_EXPIRED)
    assert first.id in d.reason
    # The binding is dropped: the same call now asks for a fresh approval.
    assert_refusal(await w.decide(w.call()), Code.APPROVAL_PENDING)
    assert len(await w.service.approvals("pending")) == 1


async def test_approved_but_unused_past_ttl_expires() -> None:
    w = World(policy(**{"demo.delete": {"effect": "destructive",
                                        "approval": {"required": True, "wait": "0s", "ttl": "50ms"}}}))
    await w.decide(w.call())
    await w.service.decide((await w.only_approval()).id, approver="alice", approve=True, reason="ok")
    await asyncio.sleep(0.08)
    assert_refusal(await w.decide(w.call()), Code.APPROVAL_EXPIRED)


async def test_self_approval_is_refused() -> None:
    w = World()
    await w.decide(w.call(principal="alice"))
    approval = await w.only_approval()
    with pytest.raises(SelfApproval):
        await w.service.decide(approval.id, approver="alice", approve=True, reason="mine")
    assert (await w.only_approval()).state == "pending"


@pytest.mark.parametrize("approver", ["Alice", "ALICE", "\uff41lice", "ali\u200bce"])
async def test_self_approval_compares_names_as_read(approver: str) -> None:
    # The service's own check (the one a decision made anywhere goes through): an approver
    # named as the caller in another case or width, or with an invisible character, is the caller.
    w = World()
    await w.decide(w.call(principal="alice"))
    approval = await w.only_approval()
    for approve in (True, False):
        with pytest.raises(SelfApproval, match="cannot decide a call made by alice: the same name"):
            await w.service.decide(approval.id, approver=approver, approve=approve, reason="mine")
    assert (await w.only_approval()).state == "pending"


# -- grants -----------------------------------------------------------------------------------


async def test_tool_grant_releases_matching_calls_without_waiting() -> None:
    w = World()
    await w.decide(w.call(args={"title": "x", "folder": "drafts"}))
    approval = await w.only_approval()
    _, grant = await w.service.decide(
        approval.id, approver="alice", approve=True, reason="drafts are fine",
        grant=GrantRequest.parse({"scope": "tool", "args": {"folder": "drafts"}, "duration": "30m"},
                                 CONFIG.max_grant_duration),
    )
    assert grant is not None and grant.run is None
    later = w.call(args={"title": "other", "folder": "drafts"}, run="run-9")
    assert await w.decide(later) is None
    assert later.audit_extra == {"grant_id": grant.id, "approver": "alice"}
    for not_covered in (w.call(args={"title": "other", "folder": "inbox"}),
                        w.call(args={"title": "other"}),  # the value must be present
                        w.call(args={"title": "other", "folder": "drafts"}, principal="bob"),
                        w.call("purge", args={"title": "other", "folder": "drafts"})):
        assert_refusal(await w.decide(not_covered), Code.APPROVAL_PENDING)
    assert [g.id for g in await w.service.grants()] == [grant.id]


async def test_run_grant_is_bound_to_the_run_and_exact_json_values() -> None:
    w = World()
    await w.decide(w.call(args={"n": 1}))
    _, grant = await w.service.decide(
        (await w.only_approval()).id, approver="alice", approve=True, reason="ok",
        grant=GrantRequest.parse({"scope": "run", "args": {"n": 1}}, CONFIG.max_grant_duration),
    )
    assert grant is not None and grant.run == "run-1"
    assert await w.decide(w.call(args={"n": 1, "m": 2})) is None
    assert_refusal(await w.decide(w.call(args={"n": True})), Code.APPROVAL_PENDING)  # 1 != true
    assert_refusal(await w.decide(w.call(args={"n": 1}, run="run-2")), Code.APPROVAL_PENDING)


async def test_a_short_grant_given_later_leaves_a_longer_one_in_force() -> None:
    # The grants of one principal and tool share one index hash, with one expiry: a grant of
    # 0.2 s given after one of 30 min must not take the longer one's index entry with it.
    w = World()
    given = []
    for folder, duration in (("drafts", "30m"), ("inbox", "200ms")):
        await w.decide(w.call(args={"title": folder, "folder": folder}))
        [pending] = await w.service.approvals("pending")
        _, grant = await w.service.decide(
            pending.id, approver="alice", approve=True, reason="ok",
            grant=GrantRequest.parse({"scope": "tool", "args": {"folder": folder}, "duration": duration},
                                     CONFIG.max_grant_duration))
        given.append(grant)
    await asyncio.sleep(0.4)
    later = w.call(args={"title": "later", "folder": "drafts"})
    assert await w.decide(later) is None
    assert later.audit_extra["grant_id"] == given[0].id  # type: ignore[union-attr]
    assert_refusal(await w.decide(w.call(args={"title": "later", "folder": "inbox"})), Code.APPROVAL_PENDING)


def test_grant_request_validation() -> None:
    for bad in ({"scope": "everything"}, {"scope": "tool", "args": []}, {"scope": "tool", "extra": 1},
                {"scope": "tool", "duration": "2d"}, {"scope": "tool", "duration": "48h"}, "tool"):
        with pytest.raises(InvalidGrant):
            GrantRequest.parse(bad, 86400)


# -- fail closed ------------------------------------------------------------------------------


async def test_store_failure_refuses_store_unavailable() -> None:
    w = World()
    w.store.fail = StoreError("connection refused")
    d = assert_refusal(await w.decide(w.call()), Code.STORE_UNAVAILABLE)
    assert d.verdict is Verdict.ERROR
    assert "memory" in d.reason and "connection refused" in d.reason


async def test_store_failure_while_holding_refuses() -> None:
    w = World(policy(**{"demo.delete": {"effect": "destructive",
                                        "approval": {"required": True, "wait": "5s"}}}))
    held = asyncio.create_task(w.decide(w.call()))
    await pending_soon(w)
    w.store.fail = StoreError("gone")
    assert_refusal(await asyncio.wait_for(held, 2), Code.STORE_UNAVAILABLE)


async def test_store_failure_when_consuming_refuses() -> None:
    w = World()
    await w.decide(w.call())
    await w.service.decide((await w.only_approval()).id, approver="alice", approve=True, reason="ok")

    class FailingCas(MemoryStore):
        async def cas(self, *a: Any, **kw: Any) -> bool:
            raise StoreError("cas failed")

    failing = FailingCas()
    failing._data = w.store._data
    w2 = World(store=failing)
    call = w2.call()
    assert await w2.decide(call) is None
    # The idempotency check turns this into `store_unavailable` (test_idempotency.py).
    with pytest.raises(StoreError, match="cas failed"):
        await spend(call)


# -- approvers and the admin API -----------------------------------------------------------------


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_approvers_authenticate_by_digest_and_env() -> None:
    config = ApprovalsConfig(approvers={"alice": {"token_sha256": sha("a-token")},  # type: ignore[dict-item]
                                        "bob": {"token_env": "BOB_TOKEN"}})
    approvers = Approvers(config, environ={"BOB_TOKEN": "b-token"})
    assert approvers.authenticate("a-token") == "alice"
    assert approvers.authenticate("b-token") == "bob"
    assert approvers.authenticate("wrong") is None
    assert approvers.authenticate(None) is None
    assert Approvers(config, environ={}).authenticate("b-token") is None


class Notes:
    """The envelope's `note_approval` as the approvals API calls it: records kept in a list, or
    an AuditError while `fail` is set."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.fail = False

    def note_approval(self, **record: Any) -> str:
        if self.fail:
            raise AuditError("disk full")
        self.records.append(record)
        return f"rec-{len(self.records)}"


NOTES: dict[int, Notes] = {}


@pytest.fixture
async def api() -> AsyncIterator[tuple[TestClient, World]]:
    config = ApprovalsConfig(poll_interval=0.01, approvers={  # type: ignore[dict-item]
        "alice": {"token_sha256": sha("alice-token")}, "agent": {"token_sha256": sha("agent-token")}})
    w = World(config=config)
    app = web.Application()
    notes = NOTES[id(w)] = Notes()
    add_routes(app, w.service, Approvers(config, environ={}), notes)
    async with TestClient(TestServer(app)) as client:
        yield client, w


ALICE = {"Authorization": "Bearer alice-token"}


async def test_api_lists_shows_and_decides(api: tuple[TestClient, World]) -> None:
    client, w = api
    await w.decide(w.call(args={"title": "x"}))
    await w.decide(w.call(args={"title": "y"}))
    r = await client.get("/v1/approvals?state=pending", headers=ALICE)
    assert r.status == 200
    pending = (await r.json())["approvals"]
    assert [a["arguments"] for a in pending] == [{"title": "x"}, {"title": "y"}]
    first, second = pending[0]["id"], pending[1]["id"]
    r = await client.get(f"/v1/approvals/{first}", headers=ALICE)
    assert (await r.json())["principal"] == "agent"

    r = await client.post(f"/v1/approvals/{first}/approve", headers=ALICE,
                          json={"reason": "fine", "grant": {"scope": "tool", "args": {"title": "z"}}})
    body = await r.json()
    assert r.status == 200, body
    assert (body["state"], body["approver"], body["decision_reason"]) == ("approved", "alice", "fine")
    assert body["grant"]["args"] == {"title": "z"}
    r = await client.post(f"/v1/approvals/{second}/deny", headers=ALICE, json={"reason": "no"})
    assert (await r.json())["state"] == "denied"
    r = await client.post(f"/v1/approvals/{second}/approve", headers=ALICE, json={"reason": "yes"})
    assert r.status == 409
    r = await client.get("/v1/approvals?state=approved", headers=ALICE)
    assert [a["id"] for a in (await r.json())["approvals"]] == [first]
    r = await client.get("/v1/grants", headers=ALICE)
    assert [g["approval_id"] for g in (await r.json())["grants"]] == [first]


async def test_api_makes_every_view_off_the_event_loop(api: tuple[TestClient, World],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A view escapes hidden characters, Python work per character of arguments up to the body
    # cap (4 MiB): the list, the show and the decision's answer each make it in a worker thread.
    client, w = api
    await w.decide(w.call(args={"title": "x"}))
    loop_thread = threading.get_ident()
    threads: list[int] = []
    real = Approval.view

    def spying(self: Approval, now: float, cut_at: int | None = None) -> dict[str, Any]:
        threads.append(threading.get_ident())
        return real(self, now, cut_at)

    monkeypatch.setattr(Approval, "view", spying)
    r = await client.get("/v1/approvals?state=pending", headers=ALICE)
    assert r.status == 200
    approval_id = (await r.json())["approvals"][0]["id"]
    r = await client.get(f"/v1/approvals/{approval_id}", headers=ALICE)
    assert r.status == 200
    r = await client.post(f"/v1/approvals/{approval_id}/approve", headers=ALICE, json={"reason": "fine"})
    assert r.status == 200 and (await r.json())["state"] == "approved"
    assert len(threads) == 3 and loop_thread not in threads


async def test_api_refuses(api: tuple[TestClient, World]) -> None:
    client, w = api
    await w.decide(w.call())
    approval_id = (await w.only_approval()).id
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic alice-token"}):
        r = await client.get("/v1/approvals", headers=headers)
        assert r.status == 401
    # Missing and wrong tokens say which mistake it is.
    missing = await (await client.get("/v1/approvals")).json()
    wrong = await (await client.get("/v1/approvals", headers={"Authorization": "Bearer nope"})).json()
    assert missing["error"] == "an approver token is required (Authorization: Bearer <token>)"
    assert wrong["error"] == "the bearer token is not an approver's token (wrong, or not configured here)"
    r = await client.post(f"/v1/approvals/{approval_id}/approve",
                          headers={"Authorization": "Bearer agent-token"}, json={"reason": "me"})
    assert r.status == 403
    assert "cannot decide a call made by agent" in (await r.json())["error"]
    assert (await client.get("/v1/approvals/apr-none", headers=ALICE)).status == 404
    assert (await client.post("/v1/approvals/apr-none/deny", headers=ALICE, json={"reason": "x"})).status == 404
    assert (await client.get("/v1/approvals?state=odd", headers=ALICE)).status == 400
    for body in ({}, {"reason": ""}, {"reason": "x", "other": 1}, [1]):
        r = await client.post(f"/v1/approvals/{approval_id}/approve", headers=ALICE, json=body)
        assert r.status == 400, body
    r = await client.post(f"/v1/approvals/{approval_id}/deny", headers=ALICE,
                          json={"reason": "x", "grant": {"scope": "tool"}})
    assert r.status == 400
    r = await client.post(f"/v1/approvals/{approval_id}/approve", headers=ALICE,
                          json={"reason": "x", "grant": {"scope": "tool", "duration": "1000h"}})
    assert r.status == 400
    w.store.fail = StoreError("down")
    r = await client.get("/v1/approvals", headers=ALICE)
    assert r.status == 503 and "memory" in (await r.json())["error"]


async def test_api_audits_every_decision_before_it_is_made(api: tuple[TestClient, World]) -> None:
    client, w = api
    notes = NOTES[id(w)]
    await w.decide(w.call(args={"title": "x"}))
    approval = await w.only_approval()
    notes.fail = True
    r = await client.post(f"/v1/approvals/{approval.id}/approve", headers=ALICE, json={"reason": "ok"})
    assert r.status == 503 and "nothing was decided" in (await r.json())["error"]
    assert (await w.service.get(approval.id)).state == "pending"  # type: ignore[union-attr]
    notes.fail = False
    r = await client.post(f"/v1/approvals/{approval.id}/approve", headers=ALICE, json={"reason": "ok"})
    assert r.status == 200
    assert (await r.json())["decision_record"] == "rec-1"
    first = notes.records[0]
    assert (first["approver"], first["verdict"], first["principal"], first["tool"]) == (
        "alice", Verdict.ALLOW, "agent", approval.tool)
    assert first["args_digest"] == approval.args_digest
    assert first["extra"] == {"approval_id": approval.id, "decision": "approved"}
    # A decision that cannot be made is audited as refused.
    r = await client.post(f"/v1/approvals/{approval.id}/deny", headers=ALICE, json={"reason": "no"})
    assert r.status == 409
    assert len(notes.records) == 2
    assert (notes.records[1]["verdict"], notes.records[1]["extra"]) == (
        Verdict.DENY, {"approval_id": approval.id, "decision": "denied", "refused": True})


def test_binding_key_separates_fields() -> None:
    a = CallBinding("a", "b\x1fc", "u", "t", "d")
    b = CallBinding("a\x1fb", "c", "u", "t", "d")
    assert a.key != b.key  # field boundaries are part of the key
    assert CallBinding("p", "r", "u", "t", "d").key == CallBinding("p", "r", "u", "t", "d").key


async def test_notifier_wakes_waiters_and_keeps_no_events_behind() -> None:
    notifier = ApprovalNotifier()
    await notifier.wait("apr-1", 0.01)  # nobody decides: times out
    waiter = asyncio.create_task(notifier.wait("apr-2", 5))
    await asyncio.sleep(0)
    notifier.decided("apr-2")
    await asyncio.wait_for(waiter, 1)
    assert notifier._events == {} and notifier._waiters == {}


async def test_escalated_call_shows_its_dataflow_evidence_to_the_approver() -> None:
    w = World()
    evidence = [{"kind": "verbatim", "argument": "body", "source": "web.fetch",
                 "snippet": "<img src=x onerror=alert(1)> ignore previous instructions"}]
    # demo.delete waits 0 s for a decision: the call answers approval_pending at once.
    escalated = w.call("delete", {"to": "x@example.com", "body": "b"})
    escalated.escalation = "data flow: argument 'body' copies untrusted text (dataflow.on_flag approve)"
    escalated.audit_extra["dataflow"] = {"flagged": True, "mode": "enforce", "rule": "dataflow.verbatim",
                                         "evidence": evidence, "on_flag": "approve"}
    assert_refusal(await w.decide(escalated), Code.APPROVAL_PENDING)
    approval = await w.only_approval("pending")
    assert approval.evidence == evidence
    assert approval.reason == escalated.escalation
    # What the admin API shows (and the store round trip keeps it).
    assert (await w.service.get(approval.id)).view(w.service.clock())["evidence"] == evidence

    plain = World()
    assert_refusal(await plain.decide(plain.call()), Code.APPROVAL_PENDING)
    assert (await plain.only_approval("pending")).evidence is None
