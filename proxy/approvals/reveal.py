"""Arguments as an approver must see them: no character that hides or reorders what will run.

A string can hold characters a screen does not show (zero-width spaces and joiners, soft
hyphens, the byte-order mark, variation selectors, fillers), shows as something else (a
no-break space as a space) or that reorder the text around them (bidi overrides and isolates): `{"path": "/tmp/x\u202e/fdsa"}` reads
as another path than the one the upstream gets. The approval is bound to the exact arguments,
so the person approving must see them exactly: `revealed_json` writes every such character as a
JSON escape (`\\u202e`; still JSON, equal to the arguments), and `hidden_characters` lists where
they are so the page can say so before anyone clicks.

Look-alike letters count too: `"p\\u0430ypal.com"` with a Cyrillic "a" (U+0430) reads as the Latin
address and is another one. Within a run of text without spaces or quotes (an address, a path,
a word) whose letters come from more than one of the scripts that share letter shapes (Latin,
Cyrillic, Greek, Armenian, Cherokee, Coptic, and the fullwidth and mathematical forms of their
letters, each a script of its own), the letters of every script but the run's most
common one are escaped and listed. A word written in one script is left alone whatever the
scripts around it ("Мария" in a Latin sentence, Japanese mixing kana and kanji); a whole word
spelled in look-alike Cyrillic ("раурал") is not found: no script is mixed in it.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections import Counter
from typing import Any

# Format, control, private-use, unassigned, surrogate, line and paragraph separators.
_HIDDEN_CATEGORIES = frozenset({"Cf", "Cc", "Co", "Cn", "Cs", "Zl", "Zp"})
# Characters a screen shows as nothing that no category above holds: Unicode's default-ignorable
# marks and fillers (combining grapheme joiner, Hangul and Khmer fillers, Mongolian and other
# variation selectors), and the blank Braille pattern.
_BLANK = re.compile("[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180d\u180f\u2800\u3164"
                    "\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]")
# Scripts with letters shaped like each other's (Unicode's confusables are mostly among these).
_LOOKALIKE_SCRIPTS = frozenset({"LATIN", "CYRILLIC", "GREEK", "ARMENIAN", "CHEROKEE", "COPTIC"})
# A run a look-alike letter hides in: no space (JSON's quotes end a string's run too).
_RUN = re.compile(r'[^\s"]+')


# What may need an escape: anything but printable ASCII (a C-speed search; the rest of a text
# is never looked at character by character).
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]")


@functools.lru_cache(maxsize=8192)
def _lookalike_script(char: str) -> str | None:
    if char.isascii():
        return "LATIN" if char.isalpha() else None
    if not char.isalpha():
        return None
    script = unicodedata.name(char, "").partition(" ")[0]
    if script in _LOOKALIKE_SCRIPTS:
        return script
    # A compatibility form of such a letter (fullwidth "\uff41", mathematical "\U0001d5ba") is a
    # script of its own here: it looks like the letter it folds to and is another character.
    folded = unicodedata.normalize("NFKC", char)
    return script if folded != char and len(folded) == 1 and _lookalike_script(folded) else None


def disguised(text: str) -> set[int]:
    """Where `text` holds look-alike letters: in each run without spaces or quotes whose letters
    come from more than one look-alike script, the positions of the letters not of the run's most
    common script (the first met wins a tie)."""
    if text.isascii():
        return set()
    found: set[int] = set()
    for run in _RUN.finditer(text):
        word = run.group()
        if word.isascii() or len({_lookalike_script(c) for c in set(word)} - {None}) < 2:
            continue  # one script (the common case: judged on the run's distinct characters)
        scripts = [_lookalike_script(c) for c in word]
        counts = Counter(script for script in scripts if script is not None)
        if len(counts) > 1:
            main = counts.most_common(1)[0][0]
            start = run.start()
            found.update(start + i for i, script in enumerate(scripts) if script not in (None, main))
    return found


@functools.lru_cache(maxsize=8192)
def is_hidden(char: str) -> bool:
    """Whether `char` is invisible, reorders text, or looks like another character (a space
    other than U+0020). Below U+0020 nothing is: JSON writes those as escapes already."""
    if char < " ":
        return False
    category = unicodedata.category(char)
    return (category in _HIDDEN_CATEGORIES or (category == "Zs" and char != " ")
            or _BLANK.match(char) is not None)


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a surrogate pair, as JSON writes characters past the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _escaped_at(text: str, controls: bool = False) -> list[int]:
    """Where `text` holds a character to escape (hidden, a look-alike letter, and with
    `controls` a control character), in order."""
    marked = disguised(text)
    # Judged once per distinct character, then found where they are (C-speed searches).
    wanted = [c for c in set(_NOT_PLAIN.findall(text)) if (controls and c < " ") or is_hidden(c)]
    if wanted:
        marked.update(found.start() for found in re.finditer("|".join(map(re.escape, wanted)), text))
    return sorted(marked)


def _escaping(text: str, positions: list[int]) -> str:
    """`text` with the characters at `positions` written as `\\uXXXX` escapes."""
    if not positions:
        return text
    out: list[str] = []
    last = 0
    for at in positions:
        out += (text[last:at], _escape(text[at]))
        last = at + 1
    out.append(text[last:])
    return "".join(out)


def visible(text: str) -> str:
    """`text` for a terminal or a page: control characters (which a terminal obeys: colours,
    cursor moves, window titles), hidden ones and look-alike letters written as `\\uXXXX`
    escapes."""
    return _escaping(text, _escaped_at(text, controls=True))


def revealed(text: str) -> str:
    """`text` (JSON, or a piece of it) with every hidden character and look-alike letter escaped."""
    return _escaping(text, _escaped_at(text))


def revealed_json(value: Any, indent: int | None = 2) -> str:
    """`value` as JSON (keys in their order; `indent` None: on one line) with every hidden
    character and look-alike letter escaped."""
    return revealed(json.dumps(value, indent=indent, ensure_ascii=False,
                               separators=None if indent is not None else (",", ":")))


def hidden_characters(value: Any, path: str = "") -> list[dict[str, Any]]:
    """Each string (value or key) holding hidden characters or look-alike letters: `{"path":
    <JSON pointer>, "characters": ["U+202E", ...]}` (distinct, in order of appearance)."""
    found: list[dict[str, Any]] = []

    def note(where: str, text: str) -> None:
        chars = list(dict.fromkeys(f"U+{ord(text[i]):04X}" for i in _escaped_at(text)))
        if chars:
            found.append({"path": where or "/", "characters": chars})

    if isinstance(value, str):
        note(path, value)
    elif isinstance(value, dict):
        for key, item in value.items():
            # The pointer shows the key's hidden characters and look-alike letters escaped too.
            shown = _escaping(str(key), _escaped_at(str(key)))
            where = f"{path}/{shown.replace('~', '~0').replace('/', '~1')}"
            note(where + " (key)", str(key))
            found.extend(hidden_characters(item, where))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found.extend(hidden_characters(item, f"{path}/{i}"))
    return found
