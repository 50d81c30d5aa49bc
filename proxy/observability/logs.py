"""The process log: one record is one line, whatever its arguments hold.

Log arguments carry text from outside the proxy (a client's JSON-RPC id, an upstream's error
message, an approver's reason, a stdio child's stderr). A newline in one of them would start a
line of the attacker's choosing in the process log: a fake `ERROR`, or a fake `audit head {...}`
line that a log shipper keeps as an anchor (`proxy.audit.anchor`), so `audit verify --anchors`
reports a cut log that was never cut. `OneLineFormatter` escapes control characters in every
argument (`\\n`, `\\r`, `\\t`, `\\xNN`, `\\uNNNN`), and the bidi and zero-width characters
that make a line read other than it says, before the message is built; the template, the
level and the traceback of `exc_info` are the proxy's own and stay as they are. Text the proxy
means to show on several lines (a rejected policy's problems) goes in as `multiline(...)`: its
newlines stay, its other control characters are escaped.

Numbers and None pass unchanged, so `%d` and `%g` format as before; anything else is formatted
by `str` or `repr` as usual, then escaped. Cost: only on records that are emitted.
"""

from __future__ import annotations

import copy
import logging
import numbers
import re
import sys
from collections.abc import Mapping
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# C0 controls, DEL, C1 controls, the Unicode line and paragraph separators (which some log
# viewers break lines on), and the characters that make a line read other than it says: bidi
# controls (marks, embeddings, overrides, isolates), which make a viewer that honours them (a
# log shipper's browser UI, a bidi-aware terminal) show the rest of the line reordered, and
# zero-width ones, which hide where an argument ends.
_HIDDEN = "\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff"
_CONTROL = re.compile(f"[\x00-\x1f\x7f-\x9f\u2028\u2029{_HIDDEN}]")
_CONTROL_KEEP_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029{_HIDDEN}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_one(match: re.Match[str]) -> str:
    ch = match.group()
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape(text: str) -> str:
    """`text` with every control character written as an escape: one line, always."""
    return _CONTROL.sub(_escape_one, text)


class multiline(str):  # lower case: used like a function, as `str` is
    """Text the proxy means to log on several lines: its newlines are kept, its other control
    characters escaped."""

    __slots__ = ()


class _Escaped:
    """An argument formatted as the original would be (`%s`, `%r`), then escaped."""

    __slots__ = ("_value",)

    def __init__(self, value: Any) -> None:
        self._value = value

    def __str__(self) -> str:
        value = self._value
        if isinstance(value, multiline):
            return _CONTROL_KEEP_NEWLINE.sub(_escape_one, str.__str__(value))
        return escape(str(value))

    def __repr__(self) -> str:
        return escape(repr(self._value))


def _safe(value: Any) -> Any:
    if value is None or isinstance(value, numbers.Number):  # %d, %g and %x still apply
        return value
    return _Escaped(value)


def safe_args(args: Any) -> Any:
    """`record.args` with every non-number wrapped so that it formats escaped."""
    if isinstance(args, Mapping):
        return {key: _safe(value) for key, value in args.items()}
    if isinstance(args, tuple):
        return tuple(_safe(value) for value in args)
    return args


class OneLineFormatter(logging.Formatter):
    """`logging.Formatter` whose records' arguments cannot start a new line (module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.args:
            record = copy.copy(record)  # other handlers see the record as it was
            record.args = safe_args(record.args)
        elif not isinstance(record.msg, str):  # log.info(obj): the object is the message
            record = copy.copy(record)
            record.msg = escape(str(record.msg))
        return super().format(record)


def setup(level: str, worker: int | None = None) -> None:
    """Log to stderr at `level` (a name: debug, info, warning, error) through
    `OneLineFormatter`; `worker` (of `serve --workers N`) tags every line `[worker N]`, so the
    workers' lines, interleaved in one container log, say whose they are."""
    handler = logging.StreamHandler(sys.stderr)
    tagged = FORMAT if worker is None else FORMAT.replace("%(name)s:", f"%(name)s [worker {worker}]:")
    handler.setFormatter(OneLineFormatter(tagged))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
