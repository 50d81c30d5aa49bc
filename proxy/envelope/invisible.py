"""The characters a reader does not see, defined once for every check that reads text as a
reader would: the guardrails' view of a string (`guardrails.skeleton`) and the data-flow
ledger's fold (`fingerprint.fold`, `fingerprint.disguised`). A copy laced with any of them must
still be the text it copies, to both.

They are Unicode's format characters (category Cf: the soft hyphen U+00AD, zero-width spaces
and joiners U+200B..U+200D, bidi controls U+200E..U+200F, U+202A..U+202E, U+2066..U+2069, word
joiner and invisible operators U+2060..U+2064, the BOM U+FEFF, the tags U+E0001 and
U+E0020..U+E007F, ...) and the other characters drawn as nothing (`_DRAWN_AS_NOTHING`). None lies
outside the planes read here (0, 1, 14).
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
        if cp not in _DRAWN_AS_NOTHING and unicodedata.category(chr(cp)) != "Cf":
            continue
        if runs and runs[-1][1] == cp - 1:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp])
    return re.compile("[" + "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                                    for a, b in runs) + "]")


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
