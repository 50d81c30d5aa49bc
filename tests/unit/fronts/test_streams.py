"""The GET streams' budget: per principal over every upstream, per upstream over every
principal, all or nothing, and every slot given back exactly once."""

from __future__ import annotations

import pytest

from proxy.errors import LimitExceeded
from proxy.fronts.streams import StreamBudget


def test_a_principal_past_its_cap_is_refused_naming_the_limit() -> None:
    budget = StreamBudget(per_principal=2, per_upstream=10)
    slots = [budget.take("alice", ["a"]), budget.take("alice", ["b"])]
    with pytest.raises(LimitExceeded, match=r"principal 'alice' holds 2 of 2 \(limits\.max_streams_per_principal\)"):
        budget.take("alice", ["a"])
    budget.take("bob", ["a"])  # another principal is not affected
    slots[0].release()
    budget.take("alice", ["a"])  # a slot given back is free again


def test_an_upstream_past_its_cap_is_refused_for_everyone() -> None:
    budget = StreamBudget(per_principal=10, per_upstream=2)
    budget.take("alice", ["a"])
    budget.take("bob", ["a"])
    with pytest.raises(LimitExceeded, match=r"upstream 'a' has 2 of 2 open \(limits\.max_streams_per_upstream\)"):
        budget.take("carol", ["a"])
    budget.take("carol", ["b"])


def test_an_aggregated_stream_takes_one_slot_per_upstream_or_none() -> None:
    budget = StreamBudget(per_principal=3, per_upstream=1)
    budget.take("bob", ["b"])
    with pytest.raises(LimitExceeded, match="upstream 'b'"):
        budget.take("alice", ["a", "b"])
    assert budget.held(principal="alice") == 0 and budget.held(upstream="a") == 0  # none taken
    slot = budget.take("alice", ["a", "c"])
    assert budget.held(principal="alice") == 2
    with pytest.raises(LimitExceeded, match="principal 'alice' holds 2 of 3"):
        budget.take("alice", ["d", "e"])
    slot.release()
    slot.release()  # twice: nothing more
    assert budget.held(principal="alice") == 0 and budget.held(upstream="a") == 0
    assert budget.held(upstream="b") == 1
