"""JSON that could read differently to the proxy and to an upstream is refused before anything
reads it: a member named twice (the proxy reads the last, an upstream may read the first), a
number the proxy reads rounded (two of them could share one approval's digest)."""

from __future__ import annotations

import pytest

from proxy.fronts.jsonrpc import INVALID_REQUEST, BadMessage, ambiguity, parse_message


@pytest.mark.parametrize(("body", "why"), [
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"ping"}', "names a member twice"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","\\u006dethod":"ping"}', "names a member twice"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"a":1,"a":2}}}',
     "names a member twice"),
    (b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"l":[{"k":1},{"k":1,"k":1}]}}', "names a member twice"),
    (b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"n":18446744073709551616}}', "beyond 64 bits"),
    (b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"n":-9223372036854775809}}', "beyond 64 bits"),
    (b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"n":1.00000000000000000001}}', "significant digits"),
    (b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"n":12345678901234567890e-3}}', "significant digits"),
])
def test_ambiguous_json_is_refused(body: bytes, why: str) -> None:
    assert why in (ambiguity(body) or "")
    with pytest.raises(BadMessage) as exc:
        parse_message(body, 64)
    assert exc.value.code == INVALID_REQUEST and why in exc.value.message


def test_what_every_serializer_writes_is_fine() -> None:
    body = (b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"a":{"a":1},"l":[{"k":1},{"k":2}],'
            b'"big":18446744073709551615,"low":-9223372036854775808,"f":0.30000000000000004,'
            b'"e":1.7976931348623157e308,"z":0.000,"t":1E-7}}')
    assert ambiguity(body) is None
    assert parse_message(body, 64).method == "x"
