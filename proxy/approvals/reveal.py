"""Arguments as an approver must see them: no character that hides or reorders what will run.

A string can hold characters a screen does not show (zero-width spaces and joiners, soft
hyphens, the byte-order mark), shows as something else (a no-break space as a space) or that
reorder the text around them (bidi overrides and isolates): `{"path": "/tmp/x\u202e/fdsa"}` reads
as another path than the one the upstream gets. The approval is bound to the exact arguments,
so the person approving must see them exactly: `revealed_json` writes every such character as a
JSON escape (`\\u202e`; still JSON, equal to the arguments), and `hidden_characters` lists where
they are so the page can say so before anyone clicks.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

# Format, control, private-use, unassigned, surrogate, line and paragraph separators.
_HIDDEN_CATEGORIES = frozenset({"Cf", "Cc", "Co", "Cn", "Cs", "Zl", "Zp"})


def is_hidden(char: str) -> bool:
    """Whether `char` is invisible, reorders text, or looks like another character (a space
    other than U+0020). Below U+0020 nothing is: JSON writes those as escapes already."""
    if char < " ":
        return False
    category = unicodedata.category(char)
    return category in _HIDDEN_CATEGORIES or (category == "Zs" and char != " ")


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a surrogate pair, as JSON writes characters past the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def visible(text: str) -> str:
    """`text` for a terminal or a page: control characters (which a terminal obeys: colours,
    cursor moves, window titles) and hidden ones written as `\\uXXXX` escapes."""
    return "".join(_escape(c) if c < " " or is_hidden(c) else c for c in text)


def revealed_json(value: Any, indent: int | None = 2) -> str:
    """`value` as JSON (keys in their order; `indent` None: on one line) with every hidden
    character escaped."""
    text = json.dumps(value, indent=indent, ensure_ascii=False,
                      separators=None if indent is not None else (",", ":"))
    return "".join(_escape(c) if is_hidden(c) else c for c in text)


def hidden_characters(value: Any, path: str = "") -> list[dict[str, Any]]:
    """Each string (value or key) holding hidden characters: `{"path": <JSON pointer>,
    "characters": ["U+202E", ...]}` (distinct, in order of appearance)."""
    found: list[dict[str, Any]] = []

    def note(where: str, text: str) -> None:
        chars = list(dict.fromkeys(f"U+{ord(c):04X}" for c in text if is_hidden(c)))
        if chars:
            found.append({"path": where or "/", "characters": chars})

    if isinstance(value, str):
        note(path, value)
    elif isinstance(value, dict):
        for key, item in value.items():
            # The pointer shows the key's hidden characters escaped too.
            shown = "".join(_escape(c) if is_hidden(c) else c for c in str(key))
            where = f"{path}/{shown.replace('~', '~0').replace('/', '~1')}"
            note(where + " (key)", str(key))
            found.extend(hidden_characters(item, where))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.extend(hidden_characters(item, f"{path}/{i}"))
    return found
