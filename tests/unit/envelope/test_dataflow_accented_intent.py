"""The user's own words endorse a value they wrote with accents or another script's letters,
also where untrusted content holds the same characters (the benign class of issue 13: a value
the user typed that a page also shows). Disguised values are still endorsed only by the very
characters (`fingerprint.disguised`): the folded look-alike of what the user wrote is not."""

from __future__ import annotations

import unicodedata

import pytest
from envelope_helpers import RUN_KEY, build_revision, make_call

from proxy.config import Config
from proxy.envelope.checks.dataflow import DataflowCheck
from proxy.envelope.dataflow import intent as intents
from proxy.envelope.dataflow.ledger import LedgerDelta, record
from proxy.envelope.labels import Label, Piece
from proxy.envelope.types import Code, Decision, Services
from proxy.policy.vocab import Effect
from proxy.store.memory import MemoryStore


async def _send(on_page: str, said: str, sent: str) -> Decision | None:
    store = MemoryStore()
    check = DataflowCheck(build_revision({
        "upstreams": {"web": {"url": "http://127.0.0.1:9/mcp"}},
        "tools": {"web.fetch": {"effect": "read"},
                  "web.send": {"effect": "external", "approval": {"required": False}}},
        "dataflow": {"mode": "enforce", "on_flag": "block"},
    }), None, Services(store=store, metrics=None, settings=Config()))  # type: ignore[arg-type]
    page = f"Contacts for the quarterly report: please write to {on_page} with any question."
    await record(store, RUN_KEY, LedgerDelta.of("web.fetch", [Piece(page, Label(True, False), "t")], 32),
                 n=32, cap=65536, ttl=60)
    await intents.append(store, RUN_KEY, said, max_chars=16384, ttl=60)
    call = make_call("send", {"to": sent}, upstream="web")
    call.effect = Effect.EXTERNAL
    return await check.decide(call)


@pytest.mark.parametrize("address", ["josé@empresa.example", "müller@firma.example",
                                     "jose\u0301@empresa.example", "ολγα@εταιρεια.example"])
async def test_an_accented_value_the_user_wrote_is_endorsed_though_a_page_holds_it(address: str) -> None:
    written = unicodedata.normalize("NFC", address)
    assert await _send(written, f"mail the draft to {written}", address) is None


@pytest.mark.parametrize(("on_page", "said"), [
    ("hans@faß.example", "mail the draft to hans@fass.example"),            # folds to "ss"
    ("anna@corp.ex\u0430mple", "mail the draft to anna@corp.example"),     # a Cyrillic a
    ("josé@empresa.example", "mail the draft to josé@empresa.example.org"),  # part of a longer one
    ("josé@empresa.example", "do not mail josé@empresa.example"),          # negated
])
async def test_a_look_alike_of_what_the_user_wrote_is_still_refused(on_page: str, said: str) -> None:
    decision = await _send(on_page, said, on_page)
    assert decision is not None and decision.code is Code.DATAFLOW_POLICY_BLOCKED
