"""JSON that could read differently to the proxy and to an upstream is refused before anything
reads it: a member named twice (the proxy reads the last, an upstream may read the first), a
number the proxy reads rounded (two of them could share one approval's digest)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.fronts.jsonrpc import INVALID_REQUEST, BadMessage, ambiguity, long_number, parse_message


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


async def test_a_large_body_is_read_twice_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past INLINE_REREAD_BYTES the second reading (~10x orjson's cost) runs in a worker
    thread, and still refuses: a 4 MiB body of small objects must not stall the loop."""
    import threading

    from proxy.fronts import jsonrpc
    seen: list[bool] = []
    real = jsonrpc.ambiguity

    def spy(body: bytes) -> str | None:
        seen.append(threading.current_thread() is threading.main_thread())
        return real(body)
    monkeypatch.setattr(jsonrpc, "ambiguity", spy)
    pad = ",".join(f'{{"k":{i}}}' for i in range(800))
    big = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":'
           b'{"l":[' + pad.encode() + b'],"a":1,"a":2}}}')
    assert len(big) > jsonrpc.INLINE_REREAD_BYTES
    with pytest.raises(BadMessage) as exc:
        await jsonrpc.parse_post(big, 64, None)
    assert "names a member twice" in exc.value.message and exc.value.id == 1
    assert seen == [False]
    fine = big.replace(b',"a":2', b"")
    assert (await jsonrpc.parse_post(fine, 64, None)).method == "tools/call"
    small = b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"a":1,"a":2}}'
    with pytest.raises(BadMessage):
        await jsonrpc.parse_post(small, 64, None)
    assert seen == [False, False, True]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(
    st.sampled_from([b"0", b"9", b".", b"5.", b"-", b"e", b"x", b'"', b" ", b"\xc3\xa9", b"\x00", b"/"]),
    st.builds(bytes.__mul__, st.sampled_from([b"7", b".", b"1."]), st.integers(7, 10))), max_size=40))
def test_long_numbers_are_found_as_the_class_search_finds_them(pieces: list[bytes]) -> None:
    """`long_number` (two C passes over a translated copy) finds exactly what `[0-9.]{18}`
    finds: a body with such a run takes the number hooks, one without skips them."""
    body = b"".join(pieces)
    assert long_number(body) == (re.search(rb"[0-9.]{18}", body) is not None)


def test_a_compact_body_is_not_read_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that is byte for byte what orjson writes for its value (what most clients send)
    skips the second reading; the same message with spaces, or naming a member twice, does not."""
    from proxy.fronts import jsonrpc
    seen: list[bytes] = []
    real = jsonrpc.ambiguity

    def spy(body: bytes) -> str | None:
        seen.append(body)
        return real(body)
    monkeypatch.setattr(jsonrpc, "ambiguity", spy)
    compact = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"a":1}}}'
    assert parse_message(compact, 64).method == "tools/call"
    assert seen == []
    spaced = compact.replace(b'"a":1', b'"a": 1')
    assert parse_message(spaced, 64).method == "tools/call"
    assert seen == [spaced]
    twice = compact.replace(b'"a":1', b'"a":1,"a":2')
    with pytest.raises(BadMessage, match="names a member twice"):
        parse_message(twice, 64)
    assert seen == [spaced, twice]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=500, deadline=None)
@given(_JSON)
def test_what_orjson_writes_reads_one_way(value: object) -> None:
    """What `parse_message`'s shortcut relies on: bytes orjson wrote never read two ways."""
    import orjson
    try:
        body = orjson.dumps(value)
    except orjson.JSONEncodeError:  # a lone surrogate: no bytes, no shortcut
        return
    assert ambiguity(body) is None


# ---- an upstream's answer: relayed as its bytes only when they read one way ----------------

_ANSWER = b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"ok"}]}}'


@pytest.mark.parametrize(("data", "relayable"), [
    (_ANSWER, True),  # what orjson writes: no second reading
    (_ANSWER.replace(b'"id":1', b'"id": 1'), True),  # spaced, read again: one member each
    (_ANSWER.replace(b'"ok"', b'"\\u00e9"'), True),  # escaped, read again
    (_ANSWER.replace(b'{"content"', b'{"content":[],"content"'), False),
    (_ANSWER.replace(b'{"content"', b'{"\\u0063ontent":[],"content"'), False),  # escapes decoded
    (_ANSWER.replace(b'"result"', b'"result":{},"result"'), False),
    (_ANSWER.replace(b'"type":"text"', b'"type":"text","text":"x"'), False),  # deep inside
    # Numbers the proxy reads rounded (past 64 bits, more than 17 significant digits): a client
    # reading them exactly would get digits nobody inspected.
    (_ANSWER.replace(b"}]}}", b'}],"n":18446744073709551616}}'), False),
    (_ANSWER.replace(b"}]}}", b'}],"n":-9223372036854775809}}'), False),
    (_ANSWER.replace(b"}]}}", b'}],"n":0.123456789012345678}}'), False),
    (_ANSWER.replace(b"}]}}", b'}],"n": 18446744073709551615}}'), True),  # the largest exact one
    (_ANSWER.replace(b"}]}}", b'}],"n": 0.12345678901234567}}'), True),  # 17 digits
])
async def test_an_answer_is_relayable_unless_it_reads_two_ways(data: bytes, relayable: bool) -> None:
    import orjson

    from proxy.fronts.jsonrpc import relayable as relayable_
    assert await relayable_(data, orjson.loads(data)) is relayable
    assert await relayable_(data.decode(), orjson.loads(data)) is relayable  # an SSE event's data


async def test_a_large_answer_is_read_again_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import orjson

    from proxy.fronts import jsonrpc
    seen: list[bool] = []
    real = jsonrpc.ambiguity

    def spy(body: bytes) -> str | None:
        seen.append(threading.current_thread() is threading.main_thread())
        return real(body)
    monkeypatch.setattr(jsonrpc, "ambiguity", spy)
    text = "x" * 2 * jsonrpc.INLINE_REREAD_BYTES
    big = _ANSWER.replace(b'{"content"', b'{"content":[],"content"').replace(b'"ok"', f'"{text}"'.encode())
    assert await jsonrpc.relayable(big, orjson.loads(big)) is False
    canonical = orjson.dumps(orjson.loads(big))
    assert await jsonrpc.relayable(canonical, orjson.loads(canonical)) is True
    assert seen == [False]
