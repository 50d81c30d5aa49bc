"""`Approval.view` with a bound (the list answer): large arguments become a flagged preview of at
most `LIST_ARGUMENTS_BYTES` bytes, hidden characters still escaped; read whole, nothing is cut."""

from __future__ import annotations

import json
from typing import Any

import orjson

from proxy.approvals.records import LIST_ARGUMENTS_BYTES, Approval


def _approval(arguments: dict[str, Any]) -> Approval:
    return Approval(id="apr-1", state="pending", principal="ops", run="r1", upstream="notes",
                    tool="delete_note", args_digest="sha256:x", arguments=arguments,
                    effect="destructive", reason="gated", created_at=0.0, expires_at=100.0)


def _of_size(size: int) -> dict[str, Any]:
    """Arguments whose compact JSON is exactly `size` bytes."""
    base = len(orjson.dumps({"title": ""}))
    return {"title": "x" * (size - base)}


def test_small_arguments_are_listed_whole() -> None:
    a = _approval(_of_size(LIST_ARGUMENTS_BYTES))
    listed, whole = a.view(1.0, LIST_ARGUMENTS_BYTES), a.view(1.0)
    assert listed == whole
    assert listed["arguments"] == a.arguments and listed["arguments_truncated"] is False
    assert listed["arguments_bytes"] == LIST_ARGUMENTS_BYTES
    assert json.loads(listed["arguments_text"]) == a.arguments


def test_large_arguments_are_listed_as_a_flagged_preview() -> None:
    a = _approval({"title": "y" * 2**20})
    listed = a.view(1.0, LIST_ARGUMENTS_BYTES)
    assert listed["arguments_truncated"] is True
    assert listed["arguments"] is None and listed["hidden_characters"] is None
    assert listed["arguments_bytes"] == len(orjson.dumps(a.arguments)) > 2**20
    assert listed["arguments_text"].startswith('{\n  "title": "yyy')
    assert len(listed["arguments_text"].encode()) <= LIST_ARGUMENTS_BYTES
    assert len(orjson.dumps(listed)) < 2 * LIST_ARGUMENTS_BYTES
    # One byte over the bound is cut too; the rest of the record is unchanged.
    over = _approval(_of_size(LIST_ARGUMENTS_BYTES + 1)).view(1.0, LIST_ARGUMENTS_BYTES)
    assert over["arguments_truncated"] is True
    assert {k: v for k, v in listed.items() if not k.startswith(("arguments", "hidden"))} == \
        {k: v for k, v in a.view(1.0).items() if not k.startswith(("arguments", "hidden"))}


def test_read_whole_large_arguments_are_not_cut() -> None:
    a = _approval({"title": "y" * 2**20})
    whole = a.view(1.0)
    assert whole["arguments_truncated"] is False and whole["arguments"] == a.arguments
    assert json.loads(whole["arguments_text"]) == a.arguments


def test_preview_escapes_hidden_characters_and_cuts_no_character_in_two() -> None:
    # A bidi override in the preview is written as an escape, as in the whole view.
    a = _approval({"path": "/tmp/x\u202e/fdsa", "body": "z" * 20000})
    preview = a.view(1.0, LIST_ARGUMENTS_BYTES)["arguments_text"]
    assert "\u202e" not in preview and "\\u202e" in preview
    # Three-byte characters across the cut: the preview ends on a whole one.
    b = _approval({"body": "\u4e2d" * 10000})
    text = b.view(1.0, LIST_ARGUMENTS_BYTES)["arguments_text"]
    assert text.endswith("\u4e2d") and "\ufffd" not in text
    assert len(text.encode()) <= LIST_ARGUMENTS_BYTES
