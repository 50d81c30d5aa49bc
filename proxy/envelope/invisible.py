"""The characters a reader does not see, defined once for every check that reads text as a
reader would: the guardrails' view of a string (`guardrails.skeleton`) and the data-flow
ledger's fold (`fingerprint.fold`, `fingerprint.disguised`). A copy laced with any of them must
still be the text it copies, to both.

They are Unicode's format characters (category Cf: the soft hyphen U+00AD, zero-width spaces
and joiners U+200B..U+200D, bidi controls U+200E..U+200F, U+202A..U+202E, U+2066..U+2069, word
joiner and invisible operators U+2060..U+2064, the BOM U+FEFF, the tags U+E0001 and
U+E0020..U+E007F, ...), the controls that are not whitespace (category Cc: NUL, backspace,
escape, DEL and the C1 controls but NEL; a terminal, a browser or a model's input draws them as
nothing, so `A\x00K\x00I\x00A...` reads as the key it spells) and the other characters drawn as
nothing (`_DRAWN_AS_NOTHING`). None lies outside the planes read here (0, 1, 14). Whitespace
controls (tab, line breaks, the separators U+001C..U+001F, NEL) stay: they part words.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Final

# Drawn as nothing but not format characters: the combining grapheme joiner, Hangul fillers,
# Khmer inherent vowels, variation selectors (Unicode's Default_Ignorable_Code_Point).
_DRAWN_AS_NOTHING = frozenset((0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0,
                               *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)))


@functools.cache
def invisible_class() -> re.Pattern[str]:
    """One character class of every invisible character, as runs: matching cannot backtrack.
    Built once a process (135,000 code points categorised, ~40 ms), by the first policy revision
    that reads text as a reader would (guardrails, or a data-flow mode other than off:
    `proxy.envelope.inspect.Inspector`), not at import: start-up; otherwise at first use."""
    runs: list[list[int]] = []
    for cp in (*range(0x20000), *range(0xE0000, 0xE1000)):
        category = unicodedata.category(chr(cp))
        if (cp not in _DRAWN_AS_NOTHING and category != "Cf"
                and not (category == "Cc" and not chr(cp).isspace())):
            continue
        if runs and runs[-1][1] == cp - 1:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp])
    return re.compile("[" + "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                                    for a, b in runs) + "]")


# The ASCII characters of the class: the controls that are not whitespace.
ASCII_INVISIBLE: Final = bytes(c for c in range(0x80) if (c < 0x20 or c == 0x7F) and not chr(c).isspace())
_ASCII_SEEN = bytes(c for c in range(0x80) if c not in ASCII_INVISIBLE)


def plain(text: str) -> bool:
    """Whether `text` is ASCII without an invisible character (no control but whitespace): a
    text the folds may take as it is, without their Unicode passes (two C passes over bytes,
    ~1.3 µs per KB; a regular expression's class costs 5x that)."""
    return text.isascii() and not text.encode("ascii").translate(None, _ASCII_SEEN)


# Removing invisible characters takes one C call per this many characters: each holds the GIL, so
# a long text read in a worker thread (the guardrails' and the ledger's large texts) hands the
# event loop back between them (10 MB dense in zero-width spaces: ~1 s in one call, ~7 ms per
# chunk). Cutting anywhere is exact: the class matches single characters.
CHUNK: Final = 65536


def visible(text: str) -> str:
    """`text` without its invisible characters (`text` itself when it holds none)."""
    invisible = invisible_class()
    if not invisible.search(text):
        return text
    if len(text) <= CHUNK:
        return invisible.sub("", text)
    return "".join(invisible.sub("", text[i:i + CHUNK]) for i in range(0, len(text), CHUNK))
