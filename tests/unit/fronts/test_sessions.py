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
