"""SSE parsing for the relay: every split of the byte stream yields the same events, raw bytes
included, and a large event is scanned in linear time."""

from __future__ import annotations

import re

import pytest

from proxy.errors import ReplyTooLarge
from proxy.fronts import sse
from proxy.fronts.sse import SSEParser, format_event, parse_event

STREAM = (
    b": comment\r\n\r\n"
    b"id: 1\r\nretry: 500\r\ndata:\r\n\r\n"  # 2025-11-25 priming event: id, empty data
    b"event: message\ndata: {\"a\":\n"
    b"data: 1}\n\n"
    b"id: 3\rdata: cr-only\r\r"
    b"data: last\r\n\r\n"
)


def _all(parser: SSEParser, chunks: list[bytes]) -> list[tuple[bytes, str, str, str | None, int | None]]:
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return [(e.raw, e.event, e.data, e.id, e.retry) for e in events]


def test_every_two_way_split_gives_the_same_events() -> None:
    whole = _all(SSEParser(), [STREAM])
    assert [e[2] for e in whole] == ["", "", '{"a":\n1}', "cr-only", "last"]
    assert whole[1][3] == "1" and whole[1][4] == 500
    assert b"".join(e[0] for e in whole) == STREAM  # raw bytes relay unchanged
    for i in range(1, len(STREAM)):
        assert _all(SSEParser(), [STREAM[:i], STREAM[i:]]) == whole, i


def test_byte_by_byte_feeding() -> None:
    assert _all(SSEParser(), [bytes([b]) for b in STREAM]) == _all(SSEParser(), [STREAM])


def test_large_event_in_many_chunks_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    scanned = 0
    real = sse._EVENT_END

    class Counting:
        def search(self, buf: bytearray, pos: int = 0) -> re.Match[bytes] | None:
            nonlocal scanned
            scanned += len(buf) - pos
            return real.search(buf, pos)

    monkeypatch.setattr(sse, "_EVENT_END", Counting())
    data = b"data: " + b"x" * 2_000_000 + b"\n\n"
    parser = SSEParser()
    events = []
    for i in range(0, len(data), 4096):
        events += parser.feed(data[i : i + 4096])
    assert len(events) == 1 and len(events[0].data) == 2_000_000
    # Rescanning the buffer on every chunk would search ~500x the event's size.
    assert scanned < 2 * len(data)


def test_format_event_round_trips() -> None:
    raw = format_event(b'{"x":1}', "message", "7")
    ev = parse_event(raw)
    assert (ev.event, ev.data, ev.id) == ("message", '{"x":1}', "7")


def test_an_event_past_the_cap_raises_naming_the_setting() -> None:
    event = b"data: " + b"x" * 94 + b"\n\n"  # 102 bytes
    assert [e.data for e in SSEParser(max_event_bytes=102).feed(event)] == ["x" * 94]  # at the cap
    with pytest.raises(ReplyTooLarge, match=r"^reply exceeds 101 bytes \(limits\.max_upstream_event_bytes\)$"):
        SSEParser(max_event_bytes=101).feed(event)  # complete, in one chunk


def test_a_growing_event_is_refused_before_it_ends_and_never_held_past_the_cap() -> None:
    parser = SSEParser(max_event_bytes=1000, setting="x.cap")
    parser.feed(b"data: small\n\n")
    fed = 0
    with pytest.raises(ReplyTooLarge, match=r"x\.cap"):
        while True:
            parser.feed(b"data: " + b"y" * 94)  # one unterminated event, 100 bytes a chunk
            fed += 100
            assert parser.pending <= 1000
    assert fed == 1000  # refused at the first chunk past the cap


@pytest.mark.parametrize(("raw", "lossy", "verbatim_"), [
    (b'data: {"a": "caf\xc3\xa9"}\n\n', False, True),  # UTF-8
    (b'data: {"a": "caf\xe9"}\n\n', True, False),  # latin-1: read as U+FFFD
    (b"event: m\xff\ndata: {}\n\n", True, False),  # in any field
    (b"id: \xc3\ndata: {}\n\n", True, False),  # a sequence cut short
    (b": note\ndata: {}\n\n", False, False),  # a comment
])
def test_an_event_is_relayed_as_its_bytes_only_when_they_read_as_inspected(
        raw: bytes, lossy: bool, verbatim_: bool) -> None:
    event = parse_event(raw)
    assert event.lossy is lossy
    assert sse.verbatim(event) is verbatim_
