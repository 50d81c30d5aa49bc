"""The process log's formatter: a record's arguments cannot start a line (proxy/observability/logs.py)."""

from __future__ import annotations

import logging

import numpy as np

from proxy.observability.logs import FORMAT, OneLineFormatter, multiline


def _format(msg: str, *args: object, exc: BaseException | None = None) -> str:
    record = logging.LogRecord("envelope", logging.INFO, __file__, 1, msg, args,
                               (type(exc), exc, exc.__traceback__) if exc else None)
    return OneLineFormatter(FORMAT).format(record)


def test_control_characters_in_arguments_are_escaped() -> None:
    out = _format("request %s dropped (%r)", "a\nb\r\x1b[31m\u2028c", "x\ny")
    assert "\n" not in out and "\r" not in out and "\x1b" not in out and "\u2028" not in out
    assert out.endswith("request a\\nb\\r\\x1b[31m\\u2028c dropped ('x\\ny')")


def test_bidi_and_zero_width_characters_in_arguments_are_escaped() -> None:
    # A right-to-left override showed the rest of the line (the proxy's own words) reversed in
    # a viewer that honours it; other letters outside ASCII stay as they are.
    out = _format("approval requested: %s calls %s", "al\u202eice\u2066\u200b\ufeff", "café")
    assert not any(ch in out for ch in "\u202e\u2066\u200b\ufeff")
    assert out.endswith("approval requested: al\\u202eice\\u2066\\u200b\\ufeff calls café")
    assert str(multiline("a\u202eb\nc")) == "a\u202eb\nc" and \
        _format("%s", multiline("a\u202eb\nc")).endswith("a\\u202eb\nc")


def test_numbers_format_as_before_and_mappings_are_escaped() -> None:
    assert _format("%d calls in %.2fs, %x, %d", 3, 0.5, 255, np.int64(7)).endswith("3 calls in 0.50s, ff, 7")
    assert _format("%(who)s left", {"who": "eve\nERROR"}).endswith("eve\\nERROR left")


def test_exceptions_as_arguments_are_escaped_and_tracebacks_kept() -> None:
    try:
        raise ValueError("bad\nline")
    except ValueError as exc:
        out = _format("upstream failed: %s", exc, exc=exc)
    first, *rest = out.splitlines()
    assert first.endswith("upstream failed: bad\\nline")
    assert rest[0] == "Traceback (most recent call last):"  # the proxy's own, multi-line


def test_multiline_keeps_its_newlines_only() -> None:
    out = _format("rejected:\n  %s", multiline("a.yaml:1:1: x\n  b.yaml:2:2: y\x1b"))
    assert out.endswith("rejected:\n  a.yaml:1:1: x\n  b.yaml:2:2: y\\x1b")


def test_other_handlers_see_the_record_unchanged() -> None:
    record = logging.LogRecord("envelope", logging.INFO, __file__, 1, "%s", ("a\nb",), None)
    OneLineFormatter(FORMAT).format(record)
    assert record.getMessage() == "a\nb"
