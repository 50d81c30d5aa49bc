"""Incremental Server-Sent Events parsing for relaying: events come out with their raw bytes.

The relay forwards each event's bytes unchanged and only looks inside the ones it must read
(a `tools/call` response, a `tools/list` result). Parsing follows the WHATWG rules: lines end
in CRLF, LF or CR; an empty line ends an event; `:` starts a comment; multi-line `data:` joins
with LF; a missing `data` still yields an event (the 2025-11-25 priming event: id, empty data);
bytes after the last blank line when the stream ends are no event (WHATWG: "if the file ends in
the middle of an event, before the final empty line, the incomplete event is not dispatched"):
the upstream never finished it, and a client reading the relayed stream would drop it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.errors import ReplyTooLarge

# An event ends at the first blank line: two line terminators in a row.
_EVENT_END = re.compile(rb"(\r\n|\r(?!\n)|\n)(\r\n|\r(?!\n)|\n)")
_LINE = re.compile(rb"\r\n|\r|\n")


@dataclass(slots=True)
class SSEEvent:
    raw: bytes  # the event's bytes including its terminating blank line
    event: str = "message"
    data: str = ""
    id: str | None = None
    retry: int | None = None
    has_data: bool = False
    # A field's value was not UTF-8: it was read with U+FFFD in place of the bad bytes, so the
    # raw bytes say something else than what was inspected (`verbatim`).
    lossy: bool = False


def parse_event(raw: bytes) -> SSEEvent:
    """Parse one event block (as produced by `SSEParser`)."""
    ev = SSEEvent(raw=raw)
    data: list[str] = []
    for line in _LINE.split(raw):
        if not line or line.startswith(b":"):
            continue
        name, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = value.decode("utf-8", "replace")
            ev.lossy = True
        if name == b"data":
            data.append(text)
        elif name == b"event":
            ev.event = text or "message"
        elif name == b"id":
            if "\0" not in text:
                ev.id = text
        elif name == b"retry" and text.isdigit():
            ev.retry = int(text)
    ev.has_data = bool(data)
    ev.data = "\n".join(data)
    return ev


class SSEParser:
    """Feed bytes as they arrive; get complete events back in order.

    An event larger than `max_event_bytes` (complete, or still arriving) raises `ReplyTooLarge`
    naming `setting`: the parser never holds more than the cap plus one chunk.
    """

    def __init__(self, max_event_bytes: int = 256 * 2**20,
                 setting: str = "limits.max_upstream_event_bytes"):
        self._buf = bytearray()
        self._max = max_event_bytes
        self._setting = setting
        # Where the next search for an event end starts: bytes before it were already searched
        # (minus a 3-byte overlap for a terminator split across chunks), so a large event
        # arriving in many chunks is scanned once, not once per chunk.
        self._scan = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        events: list[SSEEvent] = []
        start = 0
        while True:
            m = _EVENT_END.search(self._buf, max(start, self._scan))
            if m is None:
                self._scan = max(start, len(self._buf) - 3)
                break
            # A CR at the very end may be the first half of CRLF: wait for more bytes.
            if m.end() == len(self._buf) and self._buf.endswith(b"\r"):
                self._scan = max(start, m.start())
                break
            if m.end() - start > self._max:
                raise ReplyTooLarge(self._max, self._setting)
            events.append(parse_event(bytes(self._buf[start : m.end()])))
            start = m.end()
            self._scan = start
        if start:
            del self._buf[:start]
            self._scan -= start
        if len(self._buf) > self._max:
            raise ReplyTooLarge(self._max, self._setting)
        return events

    @property
    def pending(self) -> int:
        return len(self._buf)


def format_event(data: bytes, event: str | None = "message", id: str | None = None) -> bytes:
    """Serialize one SSE event carrying a single-line JSON `data` payload."""
    out = bytearray()
    if event:
        out += b"event: " + event.encode() + b"\n"
    if id is not None:
        out += b"id: " + id.encode() + b"\n"
    for line in data.split(b"\n"):
        out += b"data: " + line + b"\n"
    out += b"\n"
    return bytes(out)


KEEP_ALIVE = b": keep-alive\n\n"


def has_comment(raw: bytes) -> bool:
    """Whether an event's bytes hold a comment line (after any of the three line ends): such an
    event is rebuilt from its fields, so no upstream text passes unread."""
    return raw.startswith(b":") or b"\n:" in raw or b"\r:" in raw


def verbatim(event: SSEEvent) -> bool:
    """Whether an event's own bytes may reach the client (when nothing inspected changed it):
    not when they hold a comment (`has_comment`) or bytes that are not UTF-8 (`lossy`: the
    envelope read U+FFFD there, and a client decoding the bytes another way, latin-1 or
    dropping the bad bytes, would read text nobody inspected). Such an event is rebuilt from
    what was read. The JSON inside is judged apart (`jsonrpc.relayable`)."""
    return not event.lossy and not has_comment(event.raw)


def format_fields(event: SSEEvent) -> bytes:
    """An event without data rebuilt from the fields a client acts on (`event`, `id`,
    `retry`): a 2025-11-25 priming event keeps its id and retry; comments (text no client
    reads, but a lenient one could) become a bare keep-alive."""
    out = bytearray()
    if event.id is not None:
        out += b"id: " + event.id.encode() + b"\n"
    if event.retry is not None:
        out += b"retry: " + str(event.retry).encode() + b"\n"
    if not out:
        return KEEP_ALIVE
    if event.has_data:
        out += b"data: \n"  # a priming event's empty data (2025-11-25), as the upstream sent it
    return bytes(out) + b"\n"
