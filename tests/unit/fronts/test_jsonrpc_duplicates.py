"""A JSON object naming a member twice is refused before anything reads it: the proxy reads the
last, an upstream may read the first."""

from __future__ import annotations

import pytest

from proxy.fronts.jsonrpc import INVALID_REQUEST, BadMessage, has_duplicate_names, parse_message


@pytest.mark.parametrize("body", [
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"ping"}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","\\u006dethod":"ping"}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"a":1,"a":2}}}',
    b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"l":[{"k":1},{"k":1,"k":1}]}}',
])
def test_duplicate_member_names_are_refused(body: bytes) -> None:
    assert has_duplicate_names(body)
    with pytest.raises(BadMessage) as exc:
        parse_message(body, 64)
    assert exc.value.code == INVALID_REQUEST and "names a member twice" in exc.value.message


def test_same_names_in_different_objects_are_fine() -> None:
    body = b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"a":{"a":1},"l":[{"k":1},{"k":2}]}}'
    assert not has_duplicate_names(body)
    assert parse_message(body, 64).method == "x"
