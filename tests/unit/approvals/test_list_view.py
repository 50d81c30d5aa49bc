"""`Approval.view` with a bound (the list answer): large arguments become a flagged preview of at
most `LIST_ARGUMENTS_BYTES` bytes, hidden characters still escaped; read whole, nothing is cut."""

from __future__ import annotations

import json
from dataclasses import replace
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


def test_arguments_stored_apart_the_head_lists_their_preview_and_encodes_as_the_whole() -> None:
    arguments = {"title": "y" * 2**20, "note": "\u202e"}
    size, preview = Approval.cut(arguments)
    whole = replace(_approval(arguments), arguments_bytes=size, arguments_preview=preview)
    stored = whole.encode()
    assert len(stored) < 2 * LIST_ARGUMENTS_BYTES and b"yyyy" * 2048 not in stored
    head = Approval.decode(stored)
    assert head.encode() == stored  # compare-and-set on a head matches the stored record
    # The head's list view is the one the whole approval gives (computed from its arguments).
    assert head.view(1.0, LIST_ARGUMENTS_BYTES) == _approval(arguments).view(1.0, LIST_ARGUMENTS_BYTES) \
        | {"arguments_bytes": size}
    # Read by id without its arguments, a head still shows the preview, never `{}`.
    assert head.view(1.0)["arguments_truncated"] is True and head.view(1.0)["arguments"] is None
    assert head.with_arguments(arguments).view(1.0)["arguments"] == arguments
