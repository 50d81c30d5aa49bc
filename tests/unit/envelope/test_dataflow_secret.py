"""The pick secret (`proxy.envelope.dataflow.secret`) and the keyed signatures of the listing
entries a word picks (`endorse.pick_signature_keys`): an attacker who writes an entry of a
second listing cannot make it pass for the user's entry, every client of one store signs alike,
and a store that cannot give the secret records no pick."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from envelope_helpers import RUN_KEY, build_revision, make_call

from proxy.config import Config
from proxy.envelope.checks.dataflow import DataflowCheck
from proxy.envelope.dataflow import intent as intents
from proxy.envelope.dataflow.endorse import (
    PICK_DIGITS,
    _hash,
    entry_forms,
    listing_entries,
    pick_signature_keys,
    pick_signature_probes,
    picks_one_entry,
)
from proxy.envelope.dataflow.ledger import LedgerDelta, record
from proxy.envelope.dataflow.secret import pick_secret
from proxy.envelope.labels import Label, Piece
from proxy.envelope.types import Services, ToolCall
from proxy.errors import StoreError
from proxy.policy.vocab import Effect
from proxy.store.base import Store
from proxy.store.memory import MemoryStore
from proxy.store.sqlite import SqliteStore

TRUSTED = Label(False, False)
INBOX = "m-1 Acme newsletter, Nov; m-2 invoice from Bolt"
SAID = "delete the Acme newsletter"


def _unkeyed(values: Any) -> int:
    """The signature before the fix: 8 bits of an unkeyed hash, which anyone can compute."""
    return int.from_bytes(_hash("|".join(sorted(set(values))))[:2], "big") & 0xFF


def _entry(text: str) -> str:
    return next(part for part in listing_entries(text) if "Acme" in part)


def _colliding_promotions() -> str:
    """The attacker's folder listing, its Acme newsletter's id ground offline (~256 tries) so
    that the unkeyed signature of its values (`entry_forms`) equals the inbox's. (Its fields
    need no grinding: the inbox's entries are not of one shape, so they record no names.)"""
    forms = _unkeyed(entry_forms(_entry(INBOX)))
    number = next(n for n in range(10, 100_000) if _unkeyed(entry_forms(f"m-{n} Acme newsletter")) == forms)
    return f"m-{number} Acme newsletter special; m-3 lunch with Dana"


def _revision() -> Any:
    return build_revision({
        "upstreams": {"drive": {"url": "http://127.0.0.1:9/mcp"}},
        "tools": {"drive.list_files": {"effect": "read", "output": "trusted"},
                  "drive.delete_file": {"effect": "destructive", "approval": {"required": True, "wait": "0s"}}},
        "dataflow": {"mode": "enforce", "waive_gate": "intent"},
    })


async def _delete(store: Store, value: str, listings: tuple[str, ...], secret: bytes | None) -> ToolCall:
    """A gated delete_file of `value` in a run that listed `listings` (recorded with `secret`)."""
    check = DataflowCheck(_revision(), None,  # type: ignore[arg-type]
                          Services(store=store, metrics=None, settings=Config(approvals={"enabled": True})))
    for text in listings:
        delta = LedgerDelta.of("drive.list_files", [Piece(text, TRUSTED, "t")], 32, trusted=True, pick_secret=secret)
        await record(store, RUN_KEY, delta, n=32, cap=65536, ttl=60)
    await intents.append(store, RUN_KEY, SAID, max_chars=16384, ttl=60)
    call = make_call("delete_file", {"file_id": value}, upstream="drive")
    call.effect = Effect.DESTRUCTIVE
    assert await check.decide(call) is None
    return call


async def test_an_entry_ground_to_collide_unkeyed_is_told_apart() -> None:
    """The attacker's m-N collides with the user's m-1 under the old unkeyed 8-bit signature
    (which waived the deletion of m-N with no person); keyed, "the Acme newsletter" picks one
    entry in each listing, so neither deletion is waived."""
    promotions = _colliding_promotions()
    attacker = promotions.split()[0]
    mine, theirs = _entry(INBOX), _entry(promotions)
    assert _unkeyed(entry_forms(mine)) == _unkeyed(entry_forms(theirs)) and mine != theirs
    for value in (attacker, "m-1"):
        store = MemoryStore()
        call = await _delete(store, value, (INBOX, promotions), await pick_secret(store))
        assert not call.gate_waived, call.audit_extra
        assert call.audit_extra["gate_waiver"]["unnamed"] == ["/file_id"]
    store = MemoryStore()  # the inbox alone: the user's own pick is waived as before
    assert (await _delete(store, "m-1", (INBOX,), await pick_secret(store))).gate_waived


def test_colliding_values_differ_in_a_digit_of_the_keyed_signature() -> None:
    """At the key level: the two value sets whose unkeyed signatures collide are recorded with
    different keyed signatures, and a word picking both picks no one entry."""
    mine, theirs = entry_forms(_entry(INBOX)), entry_forms(_entry(_colliding_promotions()))
    secret = bytes(range(32))
    recorded = set(pick_signature_keys("acme", mine, secret=secret))
    assert len(recorded) == PICK_DIGITS and recorded <= set(pick_signature_probes("acme"))
    assert picks_one_entry("acme", recorded.__contains__)
    recorded |= set(pick_signature_keys("acme", mine, secret=secret))  # the same entry listed twice
    assert picks_one_entry("acme", recorded.__contains__)
    recorded |= set(pick_signature_keys("acme", theirs, secret=secret))
    assert not picks_one_entry("acme", recorded.__contains__)


async def test_every_client_of_one_store_signs_alike(tmp_path: Path) -> None:
    """Two processes' views of one SQLite file (two stores, each its own connection) read one
    secret, so the same listing records the same keys whichever records or checks it; another
    store has another secret (it is drawn, not a constant)."""
    first, second = SqliteStore(tmp_path / "state.db", 5.0), SqliteStore(tmp_path / "state.db", 5.0)
    try:
        secret = await pick_secret(first)
        assert await pick_secret(second) == secret and await pick_secret(first) == secret
        other = await pick_secret(MemoryStore())
        assert other != secret
        keys = [LedgerDelta.of("drive.list_files", [Piece(INBOX, TRUSTED, "t")], 32, trusted=True,
                               pick_secret=s).trusted for s in (secret, await pick_secret(second), other)]
        assert keys[0] == keys[1] and keys[0] != keys[2]
    finally:
        await first.close()
        await second.close()


class _Unreachable(MemoryStore):
    """A store that cannot be reached until `up`."""

    def __init__(self) -> None:
        super().__init__()
        self.up = False

    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        if not self.up:
            raise StoreError("connection refused")
        return await super().add(ns, key, value, ttl)


async def test_an_unreachable_store_gives_no_secret_and_its_listings_pick_nothing() -> None:
    """No unkeyed fallback: `pick_secret` raises (and caches nothing, so the store serves once
    it is back); a listing recorded without the secret records no pick, so the user's own
    deletion goes to the gate (fail closed) where, signed, it was waived."""
    store = _Unreachable()
    with pytest.raises(StoreError):
        await pick_secret(store)
    store.up = True
    assert len(await pick_secret(store)) == 32
    call = await _delete(MemoryStore(), "m-1", (INBOX,), None)
    assert not call.gate_waived, call.audit_extra
    assert call.audit_extra["gate_waiver"]["unnamed"] == ["/file_id"]
