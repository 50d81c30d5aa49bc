"""In-band approval: the signed `requestState` (RequestStateSigner), the approval check with a
fake "hold" channel (a session's elicitation) and a "defer" channel (2026-07-28 input_required),
and the wire helpers of the MCP front."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.approvals.notifier import ApprovalNotifier
from proxy.approvals.records import CallBinding, InvalidRequestState
from proxy.approvals.service import ApprovalService
from proxy.approvals.signer import STATE_PREFIX, RequestStateSigner
from proxy.config import ApprovalsConfig, Config
from proxy.envelope.checks.approval import ApprovalCheck
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import ApprovalPrompt, Code, InBandAnswer, RunContext, Services, ToolCall
from proxy.fronts.inband import (
    INPUT_KEY,
    REVEAL_CHARS,
    DeferChannel,
    SessionCapabilities,
    elicitation_params,
    parse_answer,
    stateless_elicitation,
    strip_stateless,
)
from proxy.policy.vocab import Effect
from proxy.store.memory import MemoryStore

BINDING = CallBinding("agent", "run-1", "demo", "delete", "sha256:" + "0" * 64)
OTHER = CallBinding("agent", "run-1", "demo", "delete", "sha256:" + "1" * 64)


# -- RequestStateSigner -----------------------------------------------------------------------


def test_state_round_trip_binds_approval_and_call() -> None:
    signer = RequestStateSigner(b"k" * 32)
    token = signer.seal("apr-1", BINDING)
    assert token.startswith(STATE_PREFIX)
    opened = signer.open(token, BINDING)
    assert opened.approval_id == "apr-1" and opened.binding_key == BINDING.key
    assert len(opened.nonce) == 32
    # Two states for the same approval differ (fresh nonce each).
    assert signer.open(signer.seal("apr-1", BINDING), BINDING).nonce != opened.nonce


@pytest.mark.parametrize("mutate", [
    lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),  # signature
    lambda t: t.replace(STATE_PREFIX, STATE_PREFIX + "x", 1),  # payload
    lambda t: "something-else",
    lambda t: t.rpartition(".")[0],  # no signature
    lambda t: STATE_PREFIX + "e30." + t.rpartition(".")[2],  # another payload, old signature
])
def test_tampered_state_is_refused(mutate: Any) -> None:
    signer = RequestStateSigner(b"k" * 32)
    with pytest.raises(InvalidRequestState):
        signer.open(mutate(signer.seal("apr-1", BINDING)), BINDING)


def test_state_of_another_secret_call_or_expired_is_refused() -> None:
    now = [1000.0]
    signer = RequestStateSigner(b"k" * 32, ttl=60, clock=lambda: now[0])
    token = signer.seal("apr-1", BINDING)
    with pytest.raises(InvalidRequestState, match="signature"):
        RequestStateSigner(b"other" * 8, clock=lambda: now[0]).open(token, BINDING)
    with pytest.raises(InvalidRequestState, match="another call"):
        signer.open(token, OTHER)
    now[0] += 61
    with pytest.raises(InvalidRequestState, match="expired"):
        signer.open(token, BINDING)


def test_secret_from_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INBAND_SECRET", "shared-secret")
    config = ApprovalsConfig(in_band_secret_env="INBAND_SECRET", in_band_state_ttl="5m")
    a, b = RequestStateSigner.from_config(config), RequestStateSigner.from_config(config)
    assert a.ttl == 300
    b.open(a.seal("apr-1", BINDING), BINDING)  # replicas with the same secret agree
    with pytest.raises(InvalidRequestState):
        RequestStateSigner().open(a.seal("apr-1", BINDING), BINDING)  # the per-process secret


# -- the check --------------------------------------------------------------------------------


def doc(in_band: bool = True, wait: str = "2s") -> dict[str, Any]:
    return {"version": 1, "upstreams": UPSTREAMS, "tools": {
        "demo.delete": {"effect": "destructive",
                        "approval": {"required": True, "wait": wait, "in_band": in_band}}}}


@dataclass
class HoldChannel:
    reply: InBandAnswer | None = None
    delay: float = 0.0
    mode: Literal["hold", "defer"] = "hold"
    answer: InBandAnswer | None = None
    state: str | None = None
    asked: list[ApprovalPrompt] = field(default_factory=list)
    cancelled: bool = False

    async def ask(self, prompt: ApprovalPrompt) -> InBandAnswer | None:
        self.asked.append(prompt)
        try:
            await asyncio.sleep(self.delay)
            if self.reply is None:
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return self.reply

    def defer(self, prompt: ApprovalPrompt, state: str) -> None:
        raise AssertionError("hold channels are not deferred")


class World:
    """One process: the services the runtime builds (one signer among them), a check for the
    current policy revision, and the approval service the admin API decides through."""

    def __init__(self, in_band: bool = True, wait: str = "2s", signer: bool = True):
        self.store = MemoryStore()
        config = ApprovalsConfig(poll_interval=0.01)
        self.services = Services(store=self.store, settings=Config(approvals=config),
                                 notifier=ApprovalNotifier(),
                                 signer=RequestStateSigner.from_config(config) if signer else None)
        self.check = self.reload(in_band, wait)
        self.service = ApprovalService(self.store, config, self.services.notifier)

    def reload(self, in_band: bool = True, wait: str = "2s") -> ApprovalCheck:
        """The check of a new policy revision, built with the same services (a hot reload)."""
        return ApprovalCheck(build_revision(doc(in_band, wait)), ToolRegistry(), self.services)

    def call(self, channel: Any = None, args: dict[str, Any] | None = None) -> ToolCall:
        c = make_call("delete", args or {"title": "x"}, principal="agent")
        c.run = RunContext("run-1", "agent")
        c.effect = Effect.DESTRUCTIVE
        c.in_band = channel
        return c


async def test_hold_accept_records_user_approver_and_releases() -> None:
    w = World()
    channel = HoldChannel(InBandAnswer(True, "fine"))
    call = w.call(channel)
    assert await w.check.decide(call) is None
    assert channel.asked[0].tool == "delete" and channel.asked[0].arguments == {"title": "x"}
    assert call.audit_extra["approver"] == "user:agent" and call.audit_extra["in_band"] is True
    assert call.spend_approval is not None and await call.spend_approval() is None
    (approval,) = await w.service.approvals()
    assert approval.state == "consumed" and approval.approver == "user:agent"


async def test_hold_decline_is_denied() -> None:
    w = World()
    call = w.call(HoldChannel(InBandAnswer(False, "declined by the user at the client", "decline")))
    d = await w.check.decide(call)
    assert d is not None and d.code is Code.APPROVAL_DENIED
    assert "user:agent" in d.reason and call.audit_extra["in_band"] is True


async def test_hold_no_answer_is_pending_and_the_question_withdrawn() -> None:
    w = World(wait="100ms")
    channel = HoldChannel(None)
    d = await w.check.decide(w.call(channel))
    assert d is not None and d.code is Code.APPROVAL_PENDING
    assert channel.cancelled


async def test_out_of_band_decision_first_wins() -> None:
    w = World()
    channel = HoldChannel(InBandAnswer(False, "too late"), delay=0.5)
    call = w.call(channel)
    task = asyncio.create_task(w.check.decide(call))
    for _ in range(100):  # until the check created its approval
        if await w.service.approvals("pending"):
            break
        await asyncio.sleep(0.01)
    (pending,) = await w.service.approvals("pending")
    await w.service.decide(pending.id, approver="alice", approve=True, reason="ok")
    assert await task is None
    assert call.audit_extra["approver"] == "alice" and "in_band" not in call.audit_extra
    assert channel.cancelled


async def test_policy_without_in_band_never_asks() -> None:
    w = World(in_band=False, wait="0s")
    channel = HoldChannel(InBandAnswer(True, "x"))
    d = await w.check.decide(w.call(channel))
    assert d is not None and d.code is Code.APPROVAL_PENDING and channel.asked == []


async def test_defer_round_trip_and_replay() -> None:
    w = World()
    first = DeferChannel()
    d = await w.check.decide(w.call(first))
    assert d is not None and d.code is Code.APPROVAL_PENDING
    assert first.minted is not None and first.prompt is not None
    assert d.audit is not None and d.audit["in_band"] == "input_required"
    retry = DeferChannel(answer=InBandAnswer(True, "ok"), state=first.minted)
    call = w.call(retry)
    assert await w.check.decide(call) is None
    assert call.audit_extra["approver"] == "user:agent" and call.audit_extra["in_band"] is True
    replay = await w.check.decide(w.call(DeferChannel(answer=InBandAnswer(True, "ok"),
                                                      state=first.minted)))
    assert replay is not None and replay.code is Code.APPROVAL_DENIED
    assert replay.audit is not None and replay.audit["in_band_refused"] == "replayed"


async def test_defer_state_minted_before_a_reload_opens_after_it() -> None:
    w = World()
    first = DeferChannel()
    d = await w.check.decide(w.call(first))
    assert d is not None and d.code is Code.APPROVAL_PENDING and first.minted is not None
    reloaded = w.reload()  # the next policy revision's check, same process
    assert reloaded is not w.check
    call = w.call(DeferChannel(answer=InBandAnswer(True, "ok"), state=first.minted))
    assert await reloaded.decide(call) is None
    assert call.audit_extra["approver"] == "user:agent" and call.audit_extra["in_band"] is True
    assert call.spend_approval is not None and await call.spend_approval() is None
    (approval,) = await w.service.approvals()
    assert approval.state == "consumed"


async def test_a_check_given_no_signer_signs_with_its_own() -> None:
    """Without the process's signer (policy tests, replay) a check still round-trips its own
    states; a second such check cannot open them: why the runtime shares one."""
    w = World(signer=False)
    first = DeferChannel()
    await w.check.decide(w.call(first))
    other = await w.reload().decide(w.call(DeferChannel(InBandAnswer(True, "ok"), first.minted)))
    assert other is not None and other.code is Code.APPROVAL_DENIED
    assert other.audit is not None and other.audit["in_band_refused"] == "bad signature"
    call = w.call(DeferChannel(answer=InBandAnswer(True, "ok"), state=first.minted))
    assert await w.check.decide(call) is None


async def test_defer_state_for_other_arguments_or_missing_is_refused() -> None:
    w = World()
    first = DeferChannel()
    await w.check.decide(w.call(first))
    other = await w.check.decide(w.call(DeferChannel(InBandAnswer(True, "ok"), first.minted),
                                        args={"title": "y"}))
    assert other is not None and other.code is Code.APPROVAL_DENIED
    missing = await w.check.decide(w.call(DeferChannel(InBandAnswer(True, "ok"), None)))
    assert missing is not None and missing.code is Code.APPROVAL_DENIED
    (approval,) = await w.service.approvals()
    assert approval.state == "pending"  # none of them decided anything


async def test_defer_decline_is_denied() -> None:
    w = World()
    first = DeferChannel()
    await w.check.decide(w.call(first))
    d = await w.check.decide(w.call(DeferChannel(InBandAnswer(False, "no", "decline"), first.minted)))
    assert d is not None and d.code is Code.APPROVAL_DENIED and "user:agent" in d.reason


# -- wire helpers -----------------------------------------------------------------------------


def test_elicitation_params_name_the_call_and_preview_bounded() -> None:
    prompt = ApprovalPrompt("apr-1", "notes", "delete_note", "sha256:abc", {"title": "t" * 1000}, 0)
    params = elicitation_params(prompt)
    assert params["mode"] == "form"
    assert "delete_note" in params["message"] and "notes" in params["message"]
    assert "sha256:abc" in params["message"] and len(params["message"]) < 600
    assert params["requestedSchema"]["properties"]["approve"]["type"] == "boolean"
    assert params["requestedSchema"]["required"] == ["approve"]


def test_elicitation_preview_shows_hidden_characters_escaped_and_says_where_it_is_cut() -> None:
    prompt = ApprovalPrompt("apr-1", "notes", "delete_note", "sha256:abc",
                            {"title": "keep\u202egpj.exe"}, 0)
    message = elicitation_params(prompt)["message"]
    assert "\u202e" not in message and '"keep\\u202egpj.exe"' in message
    assert "WARNING: hidden or look-alike characters, shown escaped, at /title" in message
    long = elicitation_params(ApprovalPrompt("apr-1", "notes", "delete_note", "sha256:abc",
                                             {"title": "t" * 1000}, 0))["message"]
    assert "(cut: 1,012 characters in all)" in long


def test_parse_answer() -> None:
    assert parse_answer({"action": "accept", "content": {"approve": True}}) == InBandAnswer(
        True, "approved by the user at the client", "accept")
    assert parse_answer({"action": "accept", "content": {"approve": "yes"}}).approve is False  # type: ignore[union-attr]
    assert parse_answer({"action": "decline"}).approve is False  # type: ignore[union-attr]
    assert parse_answer({"action": "cancel"}).action == "cancel"  # type: ignore[union-attr]
    assert parse_answer({"action": "??"}) is None and parse_answer(None) is None


def test_strip_stateless_keeps_foreign_input() -> None:
    params = {"name": "t", "arguments": {}, "requestState": STATE_PREFIX + "abc.def",
              "inputResponses": {INPUT_KEY: {"action": "decline"}, "theirs": {"action": "accept"}}}
    out, channel, changed = strip_stateless(params)
    assert changed and channel is not None
    assert out == {"name": "t", "arguments": {}, "inputResponses": {"theirs": {"action": "accept"}}}
    assert channel.state == STATE_PREFIX + "abc.def" and channel.answer is not None
    upstream_own = {"name": "t", "requestState": "opaque", "inputResponses": {"q": {}}}
    assert strip_stateless(upstream_own) == (upstream_own, None, False)


def test_stateless_capability_and_session_lru() -> None:
    meta = {"_meta": {"io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}}
    assert stateless_elicitation(meta)
    assert not stateless_elicitation({"_meta": {"io.modelcontextprotocol/clientCapabilities": {}}})
    sessions = SessionCapabilities(max_sessions=2)
    sessions.remember("u", "s1", "p", {"elicitation": {}})
    sessions.remember("u", "s2", "p", {})
    assert sessions.get("u", "s1") is not None  # s1 now most recently used
    sessions.remember("u", "s3", "p", {"elicitation": {"form": {}}})
    assert sessions.get("u", "s2") is None and len(sessions) == 2
    assert sessions.get("u", "s1").elicitation  # type: ignore[union-attr]
    sessions.forget("u", "s1")
    assert sessions.get("u", "s1") is None


def test_a_long_preview_is_read_only_as_far_as_it_is_shown_and_says_so() -> None:
    """Past REVEAL_CHARS the arguments are not searched for hidden characters on the event loop
    (Python work per character): the preview escapes what it shows and says the rest is
    unchecked, never that nothing is hidden."""
    body = "a" * REVEAL_CHARS + "report\u202efdp.exe"
    params = elicitation_params(ApprovalPrompt("apr-1", "notes", "write_note", "sha256:abc",
                                               {"title": "x\u202ey", "body": body}, 0))
    message = params["message"]
    assert '"title":"x\\u202ey"' in message and "\u202e" not in message
    assert "too long to be checked here for hidden or look-alike characters" in message
    short = elicitation_params(ApprovalPrompt("apr-1", "notes", "write_note", "sha256:abc",
                                              {"title": "plain"}, 0))["message"]
    assert "WARNING" not in short and '{"title":"plain"}' in short
