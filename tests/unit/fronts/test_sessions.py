"""Sessions bound to their principal: the bounded map both MCP routes keep."""

from __future__ import annotations

import pytest

from proxy.fronts.inband import SessionCapabilities
from proxy.fronts.sessions import OwnedLRU


def test_a_principal_past_its_bound_loses_its_own_oldest_never_anothers() -> None:
    lru: OwnedLRU[str, int] = OwnedLRU(max_items=1000, max_per_owner=3)
    assert lru.put("a1", "alice", 1) == []
    evicted = []
    for n in range(1000):
        evicted += lru.put(f"b{n}", "bob", n)
    assert lru.get("a1") == ("alice", 1)  # alice's session survived a thousand of bob's
    assert lru.owned("bob") == 3 and len(lru) == 4
    assert [k for k, _, _ in evicted] == [f"b{n}" for n in range(997)]  # oldest first
    assert {o for _, o, _ in evicted} == {"bob"}


def test_a_used_session_is_kept_over_an_idle_one() -> None:
    lru: OwnedLRU[str, str] = OwnedLRU(max_items=10, max_per_owner=2)
    lru.put("s1", "p", "one")
    lru.put("s2", "p", "two")
    assert lru.get("s1") == ("p", "one")  # s1 is now the most recently used
    assert lru.put("s3", "p", "three") == [("s2", "p", "two")]
    lru.get("s1", touch=False)  # a peek does not count as a use
    assert lru.put("s4", "p", "four") == [("s1", "p", "one")]


def test_when_full_the_biggest_holder_gives_one_up() -> None:
    lru: OwnedLRU[str, int] = OwnedLRU(max_items=4, max_per_owner=10)
    for key, owner in (("a1", "alice"), ("b1", "bob"), ("b2", "bob"), ("b3", "bob")):
        lru.put(key, owner, 0)
    assert lru.put("c1", "carol", 0) == [("b1", "bob", 0)]
    assert "a1" in lru and "c1" in lru and len(lru) == 4


def test_replacing_and_popping_keep_the_counts() -> None:
    lru: OwnedLRU[str, int] = OwnedLRU(max_items=4, max_per_owner=2)
    lru.put("k", "alice", 1)
    lru.put("k", "bob", 2)  # the same key again: one entry, now bob's
    assert (lru.owned("alice"), lru.owned("bob"), len(lru)) == (0, 1, 1)
    assert lru.pop("k") == 2 and lru.pop("k") is None
    assert (lru.owned("bob"), len(lru), list(lru.values())) == (0, 0, [])
    with pytest.raises(ValueError):
        OwnedLRU(0, 1)


def test_session_capabilities_know_who_created_a_session() -> None:
    sessions = SessionCapabilities(max_sessions=100, max_per_principal=2)
    sessions.remember("up", "sid-a", "alice", {"elicitation": {}})
    assert not sessions.foreign("up", "sid-a", "alice")
    assert sessions.foreign("up", "sid-a", "bob")
    assert not sessions.foreign("other-up", "sid-a", "bob")  # unknown there: not refused
    assert not sessions.foreign("up", "never-seen", "bob")
    info = sessions.get("up", "sid-a")
    assert info is not None and info.principal == "alice" and info.elicitation
    for n in range(50):  # bob's many sessions never push alice's out
        sessions.remember("up", f"sid-b{n}", "bob", None)
    assert sessions.foreign("up", "sid-a", "bob") and len(sessions) == 3
    sessions.forget("up", "sid-a")
    assert not sessions.foreign("up", "sid-a", "bob")


# ---- the aggregate's upstream sessions in the store ---------------------------------------

KEY = bytes(range(32))


async def test_an_upstream_session_is_stored_sealed_and_read_back() -> None:
    from proxy.fronts.sessions import UPSTREAM_NS, SharedUpstreamSessions
    from proxy.store.memory import MemoryStore

    store = MemoryStore()
    shared = SharedUpstreamSessions(store, KEY)
    sealed = shared.seal("aggregate", "client-1", "notes", "upstream-secret-id", "2025-11-25")
    assert await shared.claim("aggregate", "client-1", "notes", sealed, None) is True
    found = await shared.get("aggregate", "client-1", "notes")
    assert found is not None and (found.session_id, found.protocol) == ("upstream-secret-id", "2025-11-25")
    # The store holds neither the client's session id nor the upstream's in the clear.
    [(key, raw)] = await store.items(UPSTREAM_NS)
    assert "client-1" not in key and b"upstream-secret-id" not in raw
    assert await shared.get("aggregate", "client-2", "notes") is None


async def test_a_second_worker_does_not_overwrite_the_first_and_a_replacement_needs_the_old_value() -> None:
    from proxy.fronts.sessions import SharedUpstreamSessions
    from proxy.store.memory import MemoryStore

    shared = SharedUpstreamSessions(MemoryStore(), KEY)
    first = shared.seal("aggregate", "c", "notes", "u-1", "2025-11-25")
    second = shared.seal("aggregate", "c", "notes", "u-2", "2025-11-25")
    assert await shared.claim("aggregate", "c", "notes", first, None) is True
    assert await shared.claim("aggregate", "c", "notes", second, None) is False  # the first stays
    stale = shared.seal("aggregate", "c", "notes", "u-0", "2025-11-25")
    assert await shared.claim("aggregate", "c", "notes", second, stale) is False  # not what is stored
    assert await shared.claim("aggregate", "c", "notes", second, first) is True   # after the first's 404
    found = await shared.get("aggregate", "c", "notes")
    assert found is not None and found.session_id == "u-2"
    await shared.forget("aggregate", "c", ["notes", "other"])
    assert await shared.get("aggregate", "c", "notes") is None


async def test_a_sealed_session_opens_only_under_its_key_and_entry() -> None:
    from proxy.fronts.sessions import UPSTREAM_NS, SharedUpstreamSessions
    from proxy.store.memory import MemoryStore

    store = MemoryStore()
    shared = SharedUpstreamSessions(store, KEY)
    alice = shared.seal("aggregate", "alice-session", "notes", "alices-upstream-session", "2025-11-25")
    await shared.claim("aggregate", "alice-session", "notes", alice, None)
    # Moved to another client session's entry (a reader of the store who can write it): it does
    # not open there, so that client session never reaches alice's upstream session.
    await store.put(UPSTREAM_NS, SharedUpstreamSessions._key("aggregate", "mallory-session", "notes"), alice)
    moved = await shared.get("aggregate", "mallory-session", "notes")
    assert moved is not None and moved.session_id is None
    # Another serve's key (a replica without the shared secret) cannot open it either.
    other = SharedUpstreamSessions(store, bytes(32))
    found = await other.get("aggregate", "alice-session", "notes")
    assert found is not None and found.session_id is None and found.raw == alice
    # One flipped bit: not opened.
    bad = bytes([alice[0] ^ 1]) + alice[1:]
    await store.put(UPSTREAM_NS, SharedUpstreamSessions._key("aggregate", "alice-session", "notes"), bad)
    tampered = await shared.get("aggregate", "alice-session", "notes")
    assert tampered is not None and tampered.session_id is None


def test_a_signer_derives_one_key_per_purpose_from_its_secret() -> None:
    from proxy.approvals.signer import RequestStateSigner

    one, same, other = RequestStateSigner(b"s" * 32), RequestStateSigner(b"s" * 32), RequestStateSigner(b"t" * 32)
    assert one.derive(b"a") == same.derive(b"a") and len(one.derive(b"a")) == 32
    assert one.derive(b"a") != one.derive(b"b") and one.derive(b"a") != other.derive(b"a")
