"""`proxy.fronts.calls`: the decision id minted per call."""

from __future__ import annotations

import uuid

from proxy.fronts.calls import new_decision_id


def test_a_decision_id_is_a_version_4_uuid_in_hex() -> None:
    ids = {new_decision_id() for _ in range(2000)}
    assert len(ids) == 2000
    for value in ids:
        parsed = uuid.UUID(hex=value)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert parsed.hex == value  # 32 lowercase hex digits, as uuid4().hex gives
