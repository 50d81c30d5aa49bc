"""Fingerprints of text: normalising, gram hashes, winnowing and distinctive tokens."""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import re
import unicodedata
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

from proxy.envelope.invisible import ASCII_INVISIBLE, plain, visible
from proxy.policy.model import DEFAULT_WINNOW, MIN_PHRASE_CHARS

MIN_TOKEN = 8  # shortest distinctive token

if TYPE_CHECKING:
    import numpy as np
else:
    class _NumpyOnUse:
        """Stands for numpy (~0.2 s of import) until `load_numpy` binds the module itself."""

        def __getattr__(self, name: str) -> Any:
            return getattr(load_numpy(), name)

    np = _NumpyOnUse()


def load_numpy() -> ModuleType:
    """Import numpy and bind it as this module's `np` (later lookups find the module itself).

    Called by a chain whose revision records or checks data flow (policy load: no call pays
    the import) and by the first use otherwise (the CLI, tools). An ImportError propagates: a
    start-up error at policy load, a failed check (refused) on a call."""
    import numpy

    globals()["np"] = numpy
    return numpy

# -- normalisation and fingerprints ------------------------------------------------------------

# Window hashes are polynomial hashes mod 2**64 (numpy's wrapping uint64 arithmetic), computed
# for every window at once from prefix sums: hash(i) = sum(c[i+k] * B**k), stable across
# processes and replicas. A collision can only make a benign argument match (never hide a copy).
_B = 0x100000001B3  # odd, so invertible mod 2**64
_B_INV = pow(_B, -1, 1 << 64)
_SEGMENT = 1 << 15
_powers: tuple[np.ndarray, np.ndarray] | None = None  # built by the first hash


def _power_tables(length: int) -> tuple[np.ndarray, np.ndarray]:
    """B**i and B**-i mod 2**64 for i < length (grown by doubling, shared by every call).
    Thread-safe: worker threads hash concurrently, and each uses the tables it read or built
    (a racing thread may install smaller ones; both are right)."""
    global _powers
    tables = _powers
    if tables is None or len(tables[0]) < length:
        size = 1 << max(12, (length - 1).bit_length())
        one = np.ones(1, np.uint64)
        with np.errstate(over="ignore"):
            tables = (np.cumprod(np.concatenate((one, np.full(size - 1, _B, np.uint64))), dtype=np.uint64),
                      np.cumprod(np.concatenate((one, np.full(size - 1, _B_INV, np.uint64))), dtype=np.uint64))
        if _powers is None or len(_powers[0]) < size:
            _powers = tables
    return tables


# Letters of other scripts drawn like a Latin letter (one letter for one, as Unicode's
# confusables map them, in lower case: what case folding leaves of either case, and IDNA writes
# domains in lower case), and the ideographic full stop, which IDNA reads as a dot: an address
# written with a Cyrillic a (U+0430) must still be the address it imitates. Each group's
# letters, then the Latin ones they look like.
_LOOKALIKES: Final = str.maketrans(
    # Cyrillic
    "\u0430\u0432\u0435\u04bb\u043d\u0456\u0458\u043a\u04cf\u043c\u043e"
    "\u0440\u051b\u0455\u0442\u0441\u0443\u04af\u0445\u051d\u0501\u044c"
    # Greek
    "\u03b1\u03b2\u03b5\u03b6\u03b7\u03b9\u03ba\u03bc\u03bd\u03bf\u03c1\u03c4\u03c5\u03c7\u03b3"
    # Armenian
    "\u0585\u057d\u0570\u0578\u0566\u0581"
    # Latin letters drawn like other Latin ones
    "\u0131\u0237\u0251\u0261\u0269\u026a\u029f\u0274"
    "\u0280\ua731\u1d04\u1d0f\u1d1c\u1d20\u1d21\u1d22"
    # the ideographic full stop
    "\u3002",
    "abehhijklmopqstcyyxwdb"
    "abeznikuvoptuxy"
    "ouhnqg"
    "ijagiilnrscouvwz"
    ".",
)
# The combining diacritical marks (U+0300-036F, their extensions and supplement, the marks for
# symbols and the half marks): marks strewn over Latin letters, or that make another domain
# ("h\u00e9l\u00e8ne.fr" is not "helene.fr": `disguised` keeps them apart for endorsing). The marks
# scripts write vowels with (Devanagari, Arabic...) are not among them: those words stay whole.
_MARK_RANGES = ((0x0300, 0x036F), (0x1AB0, 0x1AFF), (0x1DC0, 0x1DFF), (0x20D0, 0x20FF), (0xFE20, 0xFE2F))


@functools.cache
def _skeleton_table() -> dict[int, str | None]:
    """What `fold` maps in a decomposed text: marks removed, look-alike letters made Latin,
    every script's decimal digits made ASCII (U+0663 is 3: an account number written in
    Arabic-Indic digits is the same number). Built on the first text that needs it (~20 ms)."""
    table: dict[int, str | None] = {k: chr(v) for k, v in _LOOKALIKES.items()}
    for first, last in _MARK_RANGES:
        table.update(dict.fromkeys(range(first, last + 1)))
    for zero in range(0x80, 0x1FC00):
        if unicodedata.decimal(chr(zero), -1) == 0:
            table.update({zero + d: str(d) for d in range(10) if unicodedata.decimal(chr(zero + d), -1) == d})
    return table


_ASCII_LOWER = bytes.maketrans(bytes(range(0x41, 0x5B)), bytes(range(0x61, 0x7B)))


def fold(text: str) -> str:
    """NFKC, invisible characters removed, case-folded, then its skeleton: combining marks
    removed, letters of other scripts drawn like Latin ones made Latin, decimal digits made
    ASCII (what tokens are scanned in and grams hashed from: a disguise must not hide a copy)."""
    if text.isascii():
        # NFKC leaves ASCII as it is, its only invisible characters are the controls
        # ASCII_INVISIBLE, it case-folds to lower case and holds no mark, look-alike or other
        # digit: the same result in one C pass over bytes (~1.5 µs/KB; the passes ~10 µs/KB).
        return text.encode("ascii").translate(_ASCII_LOWER, ASCII_INVISIBLE).decode("ascii")
    return skeleton(visible(unicodedata.normalize("NFKC", text)).casefold())


@functools.lru_cache(maxsize=8192)
def _char_skeleton(char: str) -> str:
    """One character's skeleton: decomposed, its marks removed, look-alike letters and digits
    mapped (`_skeleton_table`), composed again (Hangul, letters whose marks stay)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", char).translate(_skeleton_table()))


# Code points below this are looked up in `_skeleton_codes` (every mark, look-alike, digit and
# decomposable letter the skeleton changes is below it); the rest stay as they are.
_SKELETON_PLANES = 0x20000
_REMOVED = 0xFFFFFFFF  # not a code point
_NOT_ASCII = re.compile(r"[^\x00-\x7f]")


@functools.cache
def _skeleton_codes() -> np.ndarray:
    """Each code point's skeleton as one code point (_REMOVED: none), for every code point below
    _SKELETON_PLANES: the characters `_skeleton_table` names and the letters with a canonical
    decomposition (all below U+2000 once NFKC has composed a text), each by `_char_skeleton`;
    one whose skeleton is not one character stays itself. ~30 ms, once per process."""
    codes = np.arange(_SKELETON_PLANES, dtype=np.uint32)
    changed = set(_skeleton_table())
    changed.update(c for c in range(0x80, 0x2000)
                   if (d := unicodedata.decomposition(chr(c))) and not d.startswith("<"))
    for code in changed:
        if code < _SKELETON_PLANES:
            mapped = _char_skeleton(chr(code))
            if len(mapped) <= 1:
                codes[code] = ord(mapped) if mapped else _REMOVED
    return codes


def skeleton(low: str) -> str:
    """A case-folded NFKC text with combining marks removed, look-alike letters made Latin and
    decimal digits made ASCII, character by character (the last step of `fold`)."""
    if low.isascii():
        return low
    if len(low.encode("utf-8", "surrogatepass")) - len(low) < 24:
        # A few characters that are not ASCII (quotes, dashes, a name): each on its own.
        return _NOT_ASCII.sub(_char_of, low)
    # Many: one table lookup per character, in numpy (a str.translate with a dict costs
    # ~80-300 ns per character; this ~2).
    codes = np.frombuffer(low.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    mapped = np.take(_skeleton_codes(), codes, mode="clip")
    if codes.max() >= _SKELETON_PLANES:  # past the table: as they are
        mapped = np.where(codes < _SKELETON_PLANES, mapped, codes)
    if np.array_equal(mapped, codes):
        return low
    return mapped[mapped != _REMOVED].tobytes().decode("utf-32-le", "surrogatepass")


def _char_of(found: re.Match[str]) -> str:
    return _char_skeleton(found.group())


def disguised(text: str) -> bool:
    """Whether a value is written to pass for another: it holds an invisible character, a
    compatibility form (fullwidth letters, ligatures, the Kelvin sign) or a letter that case
    folding turns into others ("ß" -> "ss", Greek final sigma -> sigma), or a word mixes Latin
    letters with look-alike letters of another script ("p\\u0430ypal" with a Cyrillic a), or is made
    of look-alike letters only ("\\u0440\\u0430\\u0443\\u0440\\u04301"). Such a value is equal, folded, to one the upstream
    treats as another ("hans@faß.de" and "hans@fass.de" are two domains; "repor\u200bt.pdf" is
    not "report.pdf"): folding serves matching a copy (an attacker's disguise must not hide
    it), never endorsing one (`endorse`: a disguised value is endorsed only by the same
    characters). Canonically equivalent forms (NFC/NFD) are one. Letters with their marks
    ("Zürich", "José") and another script's own words ("Ольга") are no disguise: they are how
    people write, and trusted data and the user's words endorse them by their folded form."""
    if plain(text):
        return False
    nfc = unicodedata.normalize("NFC", text)
    if visible(unicodedata.normalize("NFKC", text)).casefold() != nfc.lower():
        return True
    if "\u3002" in nfc:  # the ideographic full stop, which IDNA reads as "."
        return True
    return any(_look_alike_word(word) for word in _WORD_RUN.findall(nfc) if not word.isascii())


_WORD_RUN = re.compile(r"[^\W\d_]+")


def _look_alike_word(word: str) -> bool:
    """A word with a letter of another script drawn like a Latin one, beside Latin letters or
    with nothing but such letters."""
    foreign = latin = 0
    for char in word:
        if char.isascii() or unicodedata.name(char, "").startswith("LATIN"):
            latin += 1
        elif _char_skeleton(char).isascii():
            foreign += 1
        else:
            return False  # a letter of its own script that passes for no Latin one: a real word
    return foreign > 0

def faithful(text: str) -> str:
    """A value as `disguised` compares it: canonical composition, lower case, whitespace runs
    collapsed; invisible characters and compatibility forms kept."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


# The ASCII characters str.isspace() accepts (what str.split() splits on), each made a space.
_ASCII_SPACES = bytes.maketrans(b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f", b" " * 9)
_SPACE_RUN = re.compile(b"  +")


def collapse(low: str) -> str:
    """A folded text with its whitespace runs collapsed to one space, stripped."""
    if low.isascii():
        # The same as the split and join below, in a few C passes over bytes instead of one
        # Python object per word (~4x faster on prose). Not for other text: decoding UTF-8
        # back costs what the split saves (measured).
        squeezed = low.encode("ascii").translate(_ASCII_SPACES)
        if b"  " in squeezed:
            squeezed = _SPACE_RUN.sub(b" ", squeezed)
        return squeezed.strip(b" ").decode("ascii")
    # str.split() splits on runs of what `\s` matches (str.isspace): 5x faster than re.sub.
    return " ".join(low.split())


def normalise(text: str) -> str:
    """Case-folded, NFKC, invisible characters removed, whitespace runs collapsed to one space,
    stripped (`collapse(fold(text))`)."""
    return collapse(fold(text))


def _numpy_window_hashes(norm: str, k: int) -> np.ndarray:
    """The hash of every k-character window of a normalised string, in order (computed in
    segments of `_SEGMENT` windows, so the power tables stay small for huge texts)."""
    length = len(norm)
    if length < k:
        return np.empty(0, np.uint64)
    if norm.isascii():
        # The same code points from one byte per character (~10x cheaper than UTF-32 here).
        codes = np.frombuffer(norm.encode("ascii"), dtype=np.uint8).astype(np.uint64)
    else:
        codes = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    parts = []
    for start in range(0, length - k + 1, _SEGMENT):
        seg = codes[start: start + _SEGMENT + k - 1]
        size = len(seg)
        up, down = _power_tables(size)
        prefix = np.zeros(size + 1, np.uint64)
        with np.errstate(over="ignore"):
            np.cumsum(seg * up[:size], out=prefix[1:])
            parts.append((prefix[k:] - prefix[:-k]) * down[: size - k + 1])
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def as_fields(hashes: np.ndarray) -> list[bytes]:
    """Each hash as its 8 little-endian bytes (numpy builds the bytes objects: ~4x faster
    than slicing them out in Python)."""
    fields: list[bytes] = hashes.astype("<u8").view("V8").tolist()
    return fields


def gram_length(n: int, window: int) -> int:
    """The length k of the hashed grams: winnowing with `window` guarantees that every shared
    run of k + window - 1 = n characters shares a kept fingerprint."""
    return n - window + 1


def gram_hashes(norm: str, n: int, window: int = DEFAULT_WINNOW) -> list[bytes]:
    """The 8-byte fingerprint of every gram of a normalised string, in order (what an
    argument is looked up by)."""
    return as_fields(_window_hashes(norm, gram_length(n, window)))


def winnowed(norm: str, n: int, window: int = DEFAULT_WINNOW) -> list[bytes]:
    """The fingerprints an output keeps (Schleimer, Wilkerson and Aiken's winnowing): in every
    run of `window` consecutive grams, the smallest hash (the rightmost on ties). Any text of
    at least n characters shared with the output contains `window` whole grams, so one of its
    grams is kept; about 2/(window+1) of the grams are stored. `window` 1 keeps every gram."""
    return as_fields(winnowed_hashes(norm, n, window))


def _numpy_winnowed_hashes(norm: str, n: int, window: int = DEFAULT_WINNOW) -> np.ndarray:
    """`winnowed` as one uint64 array, in the same order (no Python object per fingerprint:
    the ledger packs them as they are, `packed`)."""
    if len(norm) < gram_length(n, window):
        return np.empty(0, np.uint64)  # shorter than one gram (most short outputs)
    hashes = _numpy_window_hashes(norm, gram_length(n, window))
    if window <= 1:
        return np.unique(hashes)
    if len(hashes) < window:
        return hashes[[int(hashes.argmin())]]
    # The minimum of every window, then where it is (the rightmost on ties: a later offset
    # overwrites), as whole-array operations over the `window` offsets.
    count = len(hashes) - window + 1
    smallest = hashes[:count].copy()
    for j in range(1, window):
        np.minimum(smallest, hashes[j: j + count], out=smallest)
    # The offset of the rightmost minimum: the largest j whose gram equals it, as a branch-free
    # maximum of (equal * j) in a small integer type (a boolean-masked assignment per offset
    # cost 5x more: its store branches on every element). The policy bounds `window` to 16.
    offset = np.zeros(count, np.int16)
    for j in range(1, window):
        equal = hashes[j: j + count] == smallest
        np.maximum(offset, equal.view(np.int8) * np.int16(j), out=offset)
    at = np.arange(count, dtype=np.intp) + offset
    # Sliding right never moves the rightmost minimum left: the kept positions are sorted, so
    # dropping repeats is a comparison with the previous one.
    first = np.empty(count, np.bool_)
    first[0] = True
    np.not_equal(at[1:], at[:-1], out=first[1:])
    return hashes[np.compress(first, at)]


def _numpy_winnowed_packed(norm: str, n: int, window: int = DEFAULT_WINNOW) -> bytes:
    """`packed(winnowed_hashes(norm, n, window))`, cheaper: a packed set holds values, not
    positions, and what winnowing keeps of a window is its minimum (the tie rule only picks
    which of equal values' positions), so the kept values are the distinct window minima: no
    offsets to find, and the minima by doubling spans (two passes for the default window)."""
    if len(norm) < gram_length(n, window):
        return b""
    minima = _numpy_window_hashes(norm, gram_length(n, window))
    if window > 1 and len(minima) >= window:
        count = len(minima) - window + 1
        span = 1  # minima[i]: the least of hashes[i: i + span]
        while span * 2 <= window:
            minima = np.minimum(minima[:-span], minima[span:])
            span *= 2
        if span < window:  # two overlapping spans cover a window
            minima = np.minimum(minima[:count], minima[window - span: window - span + count])
        # A window's minimum is usually its neighbour's: drop repeats before sorting.
        changed = np.empty(len(minima), np.bool_)
        changed[0] = True
        np.not_equal(minima[1:], minima[:-1], out=changed[1:])
        minima = np.compress(changed, minima)
    elif window > 1:
        minima = minima[[int(minima.argmin())]]
    return packed(minima)


def packed(hashes: np.ndarray) -> bytes:
    """Distinct fingerprints of a hash array, sorted, as one `bytes` of 8-byte little-endian
    values (each 8-byte slice is what `winnowed` gives for it). A sort and a comparison with
    the previous value: `np.unique` cost 10x more here. Kept elements are taken with
    `np.compress` here and in winnowing: the same elements as a boolean index, ~4x cheaper on
    these masks (measured: 12 against 45 µs for 10,000 values)."""
    if not len(hashes):
        return b""
    ordered = np.sort(hashes)
    distinct = np.empty(len(ordered), np.bool_)
    distinct[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=distinct[1:])
    return bytes(np.compress(distinct, ordered).astype("<u8").data)


# -- the native functions -------------------------------------------------------------------------
#
# proxy/envelope/dataflow/_winnow.c computes the same hashes, bit for bit, in one pass over the
# str's own buffer: on a 200-character output the numpy functions above are mostly per-call
# overhead on tiny arrays (bench/RESULTS.md, "Native winnowing"). proxy/envelope/dataflow/_tokens.c
# finds the same distinctive tokens as the Python scans below (`folded_tokens`). Both extensions
# are optional (built by `pip install` when a C compiler is there); without one, or with
# ENVELOPE_NATIVE=0 (both off), the numpy functions and the Python scans serve. Both give the
# same fingerprints, so replicas of mixed builds share ledgers
# (tests/unit/envelope/test_dataflow_native*.py check it).


def _native_module(name: str) -> Any:
    """The native module `name` of this package, or None when it is not built or
    ENVELOPE_NATIVE=0 turns the native code off."""
    if os.environ.get("ENVELOPE_NATIVE") == "0":
        return None
    try:
        return importlib.import_module(f"proxy.envelope.dataflow.{name}")
    except ImportError:
        return None


_native = _native_module("_winnow")
# Which functions hash and winnow in this process ("native" or "numpy"), for the start-up log.
WINNOW_IMPL: Final = "numpy" if _native is None else "native"


def _native_window_hashes(norm: str, k: int) -> np.ndarray:
    """`_numpy_window_hashes`, natively."""
    return np.frombuffer(_native.window_hashes(norm, k), np.uint64)


def _native_winnowed_hashes(norm: str, n: int, window: int = DEFAULT_WINNOW) -> np.ndarray:
    """`_numpy_winnowed_hashes`, natively."""
    return np.frombuffer(_native.winnowed_hashes(norm, gram_length(n, window), window), np.uint64)


def _native_winnowed_packed(norm: str, n: int, window: int = DEFAULT_WINNOW) -> bytes:
    """`_numpy_winnowed_packed`, natively."""
    packed_hashes: bytes = _native.winnowed_packed(norm, gram_length(n, window), window)
    return packed_hashes


if _native is None:
    _window_hashes = _numpy_window_hashes
    winnowed_hashes = _numpy_winnowed_hashes
    winnowed_packed = _numpy_winnowed_packed
else:
    _window_hashes = _native_window_hashes
    winnowed_hashes = _native_winnowed_hashes
    winnowed_packed = _native_winnowed_packed


def unpacked(fingerprints: bytes) -> list[bytes]:
    """The 8-byte fingerprints of a `packed` value, in order."""
    fields: list[bytes] = np.frombuffer(fingerprints, "V8").tolist()
    return fields


# -- distinctive tokens ---------------------------------------------------------------------------
#
# Token scanning costs time linear in the text, whatever the text: a fetched page or a sink
# argument is the attacker's, and `[a-z0-9._%+-]+@...` searched from every position of a long
# run of `a` is quadratic (60 KB held the event loop for 25 s). Python's `re` backtracks, so
# every pattern here is written so that each character is examined a bounded number of times:
# a match may only start where a look-behind admits it (the start of a run of the characters
# it begins with), and from one start it backtracks at most over that run. The matches are
# exactly those of the plain patterns (leftmost, greedy, non-overlapping); the linear-time
# unit tests time each pattern on long runs of its own characters.

# E-mail addresses: [a-z0-9._%+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)*\.[a-z]{2,24}. Every start inside a
# run of local-part characters reaches the same "@" (or none), so only the run's first one is
# tried; a run the previous address ended inside is tried once where it ended (`_emails`).
_EMAIL = re.compile(r"[a-z0-9._%+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)*\.[a-z]{2,24}")
_EMAIL_AT_RUN = re.compile(r"(?<![a-z0-9._%+-])" + _EMAIL.pattern)
# URLs: (?:[a-z][a-z0-9+.-]*://|www\.)[^\s<>"'`()\[\]{}|\\^]+. A scheme starts at the first
# letter of a run of scheme characters (every later start reaches the same "://"), so the run's
# leading non-letters are matched outside the `url` group; "www." is a literal. A URL ends
# where no scheme character follows, so the next match never starts inside a run.
_URL_BODY = r"[^\s<>\"'`()\[\]{}|\\^]+"
_URL = re.compile(rf"(?<![a-z0-9+.-])[0-9+.-]*+(?P<url>[a-z][a-z0-9+.-]*+://{_URL_BODY})"
                  rf"|(?P<www>www\.{_URL_BODY})")
# Bare domains are linear as written: a match can only start where a run of [@\w.-] starts,
# and from there its labels are split by "." one way only. So are digit runs: a match starts at
# a digit after a non-word character and extends greedily to the end of its chain of digits
# and separators; only a start with fewer than 8 digits before the chain's last possible end
# fails, so at most 9 starts of one chain scan it.
_DOMAIN = re.compile(
    r"(?<![@\w.-])(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.)+[a-z]{2,24}(?![\w-])(?:/[^\s<>\"'`()\[\]{}]*)?"
)
# The digit and IBAN patterns begin with a digit and put their look-behind after it: `re` skips
# to the next digit with its fast charset scan instead of testing the look-behind at every
# position (3x faster on prose). `\d(?<!\w\d)` is `(?<!\w)\d`: same matches.
_DIGITS = re.compile(r"\d(?<!\w\d)(?:[ .\-/()]{0,2}\d){7,}(?![\w])")
# IBANs (\b[a-z]{2}\d{2}(?: ?[a-z0-9]{4}){2,7}(?: ?[a-z0-9]{1,4})?\b) are at most 44 characters
# long: bounded work per position. Matched from their first digit, the two letters before it
# checked by the look-behind (the match starts 2 characters after the IBAN does: `tokens`).
# Non-overlapping as before: an IBAN ends at a word boundary, so the next one's letters cannot
# start inside it.
_IBAN_DIGITS = re.compile(r"\d(?<=\b[a-z]{2}\d)\d(?: ?[a-z0-9]{4}){2,7}(?: ?[a-z0-9]{1,4})?\b")
_DATE = re.compile(r"^\d{4}[-./]\d{1,2}[-./]\d{1,2}$|^\d{1,2}[-./]\d{1,2}[-./]\d{4}$")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://")
_NOT_DIGIT = re.compile(r"\D")
# Bare "domains" that are file names, not hosts.
_FILE_TLDS = frozenset(
    "txt md pdf doc docx xls xlsx csv json yaml yml py js ts html htm png jpg jpeg gif svg zip "
    "gz tar log ini cfg toml xml sh rs go java c h cpp rb php css".split()
)
_TRAIL = ".,;:!?'\")]}>*"


# Anchored scans. A pattern searched from every position costs ~5-10 ns per character even
# where it cannot match (the look-behind or first character is tested at each one): 30-45 µs/KB
# of prose for the e-mail and URL scans. Every match holds a literal anchor ("@", "://", "www.")
# or starts at a character class that a bytes translation finds, so on a text with few anchors
# the pattern is tried only at the one start each anchor admits (C finds, one match per anchor).
# On a text dense with anchors (one per ANCHOR_SPACING characters or more: the hostile runs of
# `test_dataflow_cost`) the plain scans are cheaper and are used instead; both find the same
# matches, so the choice never changes a fingerprint, and each is linear.
ANCHOR_SPACING = 64

_LOCAL_RUN = re.compile(r"[a-z0-9._%+-]*")  # e-mail local-part characters, read backwards
_SCHEME_RUN = re.compile(r"[a-z0-9+.-]*")  # URL scheme characters, read backwards


def _run_start(low: str, backwards: str, run: re.Pattern[str], end: int, floor: int) -> int:
    """Where the run of `run`'s characters that ends just before `end` starts (not before
    `floor`), read from the reversed text `backwards` in one C match that stops at `floor` (so
    each character is read back over at most once by callers that move `floor` forward)."""
    found = run.match(backwards, len(low) - end, len(low) - floor)
    start = end - (found.end() - found.start()) if found is not None else end
    return max(start, floor)


def _emails(low: str, backwards: str | None = None) -> Iterator[str]:
    """E-mail addresses of a folded text, in order, not overlapping (`backwards`: the text
    reversed, when the caller has it)."""
    if low.count("@") * ANCHOR_SPACING > len(low):
        yield from _emails_scanned(low)
        return
    # A match's local part is the whole run of local-part characters before its "@" (none is
    # an "@"), from the run's start or from where the previous address ended inside it: the
    # one start `_emails_scanned` tries for that "@".
    if backwards is None:
        backwards = low[::-1]
    pos = 0
    while (at := low.find("@", pos)) >= 0:
        start = _run_start(low, backwards, _LOCAL_RUN, at, pos)
        found = _EMAIL.match(low, start) if start < at else None
        if found is None:
            pos = at + 1
            continue
        yield found.group()
        pos = found.end()


def _emails_scanned(low: str) -> Iterator[str]:
    """`_emails` by a scan of the whole text (linear, cheaper when "@" is frequent)."""
    pos = 0
    while True:
        # Where the previous address ended inside a run of local-part characters, the run's
        # rest is tried once (the look-behind would skip it); then the next run's start.
        found = _EMAIL.match(low, pos) if pos else None
        if found is None:
            found = _EMAIL_AT_RUN.search(low, pos)
            if found is None:
                return
        yield found.group()
        pos = found.end()


# What `[@\w.-]` matches (`re`'s \w on str is str.isalnum() or "_"), and the rest of such a run.
_RUN_CHARS = "@_.-"
_RUN_REST = re.compile(r"[@\w.-]*")
# A dot a label follows, in a text's `_DOTS` classes: `re` scans for the rare "." in C (a
# `bytes.find` of b".a" tests every "a", most of the text, one by one).
_DOT_LABEL = re.compile(rb"\.a")
_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")  # where a host label starts


# The classes of a text's ASCII view (a character that is not ASCII shows as "?": neither) that
# `_domains` looks for: "." a dot, "a" what starts a label.
_DOTS = bytes.maketrans(
    bytes(range(128)),
    bytes(ord(".") if c == ord(".") else ord("a") if chr(c) in _LABEL_CHARS else ord(" ")
          for c in range(128)))


def _domains(low: str, dots: bytes | None = None,
             backwards: str | None = None) -> Iterator[re.Match[str]]:
    """The matches of `_DOMAIN.finditer(low)`, found from the dots of the text: a match starts
    only where a run of [@\\w.-] starts and its host holds a dot of that run, so only the runs
    with a dot are tried, each at its start (on prose, 2-3x faster than testing the look-behind at
    every word). Each character is scanned back over at most once: linear time. `dots`: the
    text's `_DOTS` classes, to find only the dots a label follows in C; `backwards`: the text
    reversed, when the caller has it."""
    # Few dots (a memchr count): the next is found by `re`'s scan for the rare "."; many: a
    # `bytes.find` each, cheaper per call.
    dense = dots is not None and dots.count(b".") * ANCHOR_SPACING > len(low)
    if dots is None or dense:
        backwards = None
    elif backwards is None:
        backwards = low[::-1]
    pos = 0
    while True:
        # A dot no label follows is never a match's first (see below), so `dots` skips it and
        # leaves its run to the next dot a label follows: from that one, the scan back reaches
        # the same start, whose first label ends at a skipped dot (no match), and the run is
        # skipped as it would have been (same matches, each character scanned back once).
        if dots is None:
            dot = low.find(".", pos)
        elif dense:
            dot = dots.find(b".a", pos)
        else:
            at = _DOT_LABEL.search(dots, pos)
            dot = -1 if at is None else at.start()
        if dot < 0:
            return
        after = low[dot + 1: dot + 2]
        found: re.Match[str] | None = None
        # The match's first label ends at this dot (the first of the run from its start), and
        # a label or the top-level domain follows it: at the end of a sentence (". ") there is
        # no match, and no run to scan back over (most dots of prose).
        if after and after in _LABEL_CHARS:
            if backwards is None:  # many dots, short runs: a step back per character
                start = dot
                while start > pos and (low[start - 1].isalnum() or low[start - 1] in _RUN_CHARS):
                    start -= 1
            else:  # few dots: one C match back over the run, up to `pos`
                start = _run_start(low, backwards, _RUN_REST, dot, pos)
            # A run that began before `pos` (inside the previous match) has no start to try.
            began_before = start == pos > 0 and (low[pos - 1].isalnum() or low[pos - 1] in _RUN_CHARS)
            found = None if began_before else _DOMAIN.match(low, start)
        if found is None:
            # No other start in this run: go past it (`*` always matches, from the dot on).
            if not (after and (after.isalnum() or after in _RUN_CHARS)):
                pos = dot + 1  # the run ends at this dot
                continue
            rest = _RUN_REST.match(low, dot)
            pos = rest.end() if rest is not None else dot + 1
            continue
        yield found
        pos = found.end()


def _urls(low: str, backwards: str | None = None, anchors: int | None = None) -> Iterator[str]:
    """URLs (with a scheme, or starting www.) of a folded text, in order, not overlapping
    (`backwards`: the text reversed, `anchors`: its count of "://" and "www.", when the caller
    has them)."""
    if anchors is None:
        anchors = low.count("://") + low.count("www.")
    if anchors * ANCHOR_SPACING > len(low):
        for scanned in _URL.finditer(low):
            yield scanned.group("url") or scanned.group("www")
        return
    # `_URL` can match only at the start of the run of scheme characters before a "://" (its
    # look-behind) or at a "www.": trying it there, in order, finds what `finditer` finds. A
    # URL ends where no scheme character follows, so no run starts inside the previous one.
    if backwards is None:
        backwards = low[::-1]
    pos = 0
    scheme = low.find("://")
    www = low.find("www.")
    while scheme >= 0 or www >= 0:
        if scheme >= 0:
            start = _run_start(low, backwards, _SCHEME_RUN, scheme, pos)
            if www < 0 or start <= www:
                scheme = low.find("://", scheme + 1)
            else:
                start = www
                www = low.find("www.", www + 1)
        else:
            start = www
            www = low.find("www.", www + 1)
        if start < pos:
            continue
        found = _URL.match(low, start)
        if found is not None:
            yield found.group("url") or found.group("www")
            pos = found.end()
            # Anchors inside the match are skipped (found again from `pos`).
            if 0 <= scheme < pos:
                scheme = low.find("://", pos)
            if 0 <= www < pos:
                www = low.find("www.", pos)


def _url_tokens(raw: str, seen: set[str] | None = None) -> list[tuple[str, str]]:
    """The host and url tokens of a URL or bare domain match. `seen`: the stripped values
    already read in this text (a URL's domain match strips to the URL's value: read once)."""
    value = raw.rstrip(_TRAIL)
    if "://" in value:  # what `_SCHEME` removes holds one (the regex only where it can match)
        value = _SCHEME.sub("", value)
    value = value.removeprefix("www.").rstrip("/")
    if seen is not None:
        if value in seen:
            return []
        seen.add(value)
    host, _, rest = value.partition("/")
    host = host.rpartition("@")[2].partition(":")[0]
    if "." not in host or host.rpartition(".")[2] in _FILE_TLDS:
        return []
    found = [("host", host)] if len(host) >= MIN_TOKEN else []
    if rest and len(host) + len(rest) >= MIN_TOKEN - 1:
        found.append(("url", f"{host}/{rest}"))
    return found


# Character classes of a text, one byte per character, that the digit and IBAN patterns read
# in place of the text: "0" an ASCII digit, "a" a letter a-z, "w" any other word character
# (`\w`: str.isalnum() or "_"), " " a space, "." another separator of a digit run (".-/()"),
# "#" anything else. Every atom of those patterns is a union of classes (`\d` is "0" once no
# character is a decimal digit outside ASCII, `[a-z0-9]` is "a" or "0", `\w` and `\b` are the
# bytes' own: "0", "a" and "w" are word bytes, " ", "." and "#" are not), so each pattern,
# rewritten over the classes, matches exactly the spans it matches in the text: one `re` scan in
# C for the whole text instead of a Python step per possible start. Made from the text's ASCII
# view, where a character that is not ASCII shows as "?" (class "u" until `_classes` resolves
# it).
def _ascii_class(c: int) -> int:
    ch = chr(c)
    if ch == "?":
        return ord("u")
    if "0" <= ch <= "9":
        return ord("0")
    if "a" <= ch <= "z":
        return ord("a")
    if ch.isalnum() or ch == "_":
        return ord("w")
    return ord(" ") if ch == " " else ord(".") if ch in ".-/()" else ord("#")


_CLASSES = bytes.maketrans(bytes(range(128)), bytes(_ascii_class(c) for c in range(128)))


def _classes(low: str, ascii_view: bytes) -> bytes | None:
    """The character classes of a text (`ascii_view`: its ASCII view), or None when a character
    that is not ASCII is a decimal digit (`\\d` would no longer be one class) or more than one
    character in ANCHOR_SPACING is not ASCII (each is resolved in Python: the plain scans are
    cheaper then)."""
    classes = ascii_view.translate(_CLASSES)
    unknown = classes.count(b"u")
    if not unknown:
        return classes
    if unknown * ANCHOR_SPACING > len(low):
        return None
    exact = bytearray(classes)
    at = exact.find(b"u")
    while at >= 0:
        ch = low[at]  # not ASCII, or "?" itself
        if ch.isdecimal():
            return None
        exact[at] = ord("w") if ch.isalnum() else ord("#")
        at = exact.find(b"u", at + 1)
    return bytes(exact)


# `_DIGITS` and `_IBAN_DIGITS` over the classes (same spans). Each begins with the literal "0",
# which `re` finds by a fast scan, and tests its look-behind only there; linear for the reasons
# the text patterns are (see above).
_DIGITS_CLASSES = re.compile(rb"0(?<!\w0)(?:[ .]{0,2}0){7,}(?!\w)")
_IBAN_CLASSES = re.compile(rb"0(?<=\baa0)0(?: ?[a0]{4}){2,7}(?: ?[a0]{1,4})?\b")


def _python_folded_tokens(low: str) -> set[tuple[str, str]]:
    """`folded_tokens` in Python: the reference the native scan (`_tokens.c`) reproduces."""
    found: set[tuple[str, str]] = set()
    emails = "@" in low
    # Counted once here for `_urls` (a ":" is looked for first: a C memchr, where "://" is a
    # slower substring search of the whole text).
    anchors = (low.count("://") if ":" in low else 0) + low.count("www.")
    backwards = low[::-1] if emails or anchors else None
    # A match shorter than MIN_TOKEN yields no token (every value is a part of the match), so
    # it costs nothing more; matches are iterated, not collected, so the thread that runs this
    # for a large output lets others take the GIL between them. Every token is at least
    # MIN_TOKEN long when it is added (an IBAN always is: 12 characters or more).
    if emails:
        for e in _emails(low, backwards):
            if len(e) >= MIN_TOKEN:
                found.add(("email", e))
                host = e.rsplit("@", 1)[1]
                if len(host) >= MIN_TOKEN:
                    found.add(("host", host))
    read: set[str] = set()  # values `_url_tokens` read
    if anchors:
        for m in _urls(low, backwards, anchors):
            if len(m) >= MIN_TOKEN:
                found.update(_url_tokens(m, read))
    # One byte per character (a character that is not ASCII as "?"), for the C finds of the
    # domain scan and the classes the digit and IBAN patterns scan.
    ascii_view = low.encode("ascii", "replace")
    for match in _domains(low, ascii_view.translate(_DOTS), backwards):
        if match.end() - match.start() >= MIN_TOKEN:
            found.update(_url_tokens(match.group(), read))
    classes = _classes(low, ascii_view)
    # Only the spans are read (the text's, or the same ones of its classes).
    digit_runs: Iterator[re.Match[str]] | Iterator[re.Match[bytes]]
    ibans: Iterator[re.Match[str]] | Iterator[re.Match[bytes]]
    if classes is None:
        digit_runs = _DIGITS.finditer(low)
        ibans = _IBAN_DIGITS.finditer(low)
    elif b"0" in classes:  # the same spans from the classes (one C scan each)
        digit_runs = _DIGITS_CLASSES.finditer(classes)
        ibans = _IBAN_CLASSES.finditer(classes)
    else:
        return found  # no digit: no number, no IBAN
    # A digit run starts at a digit after a non-word character (or at the text's start).
    for run in digit_runs:
        m = low[run.start(): run.end()]
        if _DATE.match(m):
            continue
        digits = _NOT_DIGIT.sub("", m)
        if len(digits) >= MIN_TOKEN:
            found.add(("number", digits))
    # An IBAN's match starts at its first digit, after two letters after a non-word character.
    for iban in ibans:
        compact = low[iban.start() - 2: iban.end()].replace(" ", "")
        if any(ch.isdigit() for ch in compact[4:]):
            found.add(("number", compact))
    return found


_native_tokens = _native_module("_tokens")
# Which scan finds the distinctive tokens in this process ("native" or "python"), for the
# start-up log. The native one costs about a tenth (bench/RESULTS.md, "Native token scan").
TOKENS_IMPL: Final = "python" if _native_tokens is None else "native"

# folded_tokens(low): `tokens` of a text already folded (`fold(text)`: the caller that also
# normalises it folds it once). The same set from either scan, for any str.
if _native_tokens is None:
    folded_tokens = _python_folded_tokens
else:
    folded_tokens = _native_tokens.folded_tokens


def tokens(text: str) -> set[tuple[str, str]]:
    """Distinctive tokens of a text, normalised: (kind, value), values of at least 8 chars.
    Time linear in the text, whatever the text."""
    return folded_tokens(fold(text))


# -- other canonical forms of a token -------------------------------------------------------------
#
# The same account or host written another way than the scan's normal form: an IBAN's account
# digits written without its country and check digits, or in groups the IBAN pattern does not
# take ("DE89-3704-..."), are a digit run; a domain in punycode ("xn--...") is the Unicode one it
# encodes; an address at a subdomain of a lifted domain is at that domain. `variants` adds them
# to a text's tokens, on both sides for the first two (an output and a sink argument each record
# or ask for both forms), and the parents of a host only for what is asked for (`parents`: a sink
# argument, and the intent that endorses it): an output naming "mx.corp.example" does not make
# "corp.example" untrusted.


def _unpunycoded(value: str) -> str:
    """A host (or address, or URL) with its punycode labels decoded and folded, or `value`."""
    def label(part: str) -> str:
        if not part.startswith("xn--"):
            return part
        try:
            return fold(part[4:].encode("ascii").decode("punycode"))
        except (UnicodeError, ValueError):
            return part
    return re.sub(r"xn--[a-z0-9-]+", lambda m: label(m.group()), value)


def variants(found: set[tuple[str, str]], parents: bool = False) -> set[tuple[str, str]]:
    """`found` (folded tokens) with the other canonical forms of each (see above); with
    `parents`, also every parent domain of a host that is still MIN_TOKEN long and has two
    labels or more."""
    out = set(found)
    for kind, value in found:
        if kind == "number" and value[:2].isalpha():
            # An IBAN: its account digits, the run of its BBAN (after the country and check
            # digits) after its last letter.
            bban = value[4:]
            digits = bban[len(bban.rstrip("0123456789")):]
            if len(digits) >= MIN_TOKEN:
                out.add(("number", digits))
        elif "xn--" in value:
            decoded = _unpunycoded(value)
            if decoded != value:
                out.add((kind, decoded))
        if parents and kind == "host":
            labels = value.split(".")
            for i in range(1, len(labels) - 1):
                parent = ".".join(labels[i:])
                if len(parent) < MIN_TOKEN:
                    break
                out.add(("host", parent))
    return out


# Hashers with their parameters set, copied per value: a copy costs about a third less than a new
# `blake2b(..., digest_size=8)`, which parses its keyword arguments and sets up its state each
# time (same digests). Never updated themselves, so threads copy them concurrently.
_TOKEN_HASHER = hashlib.blake2b(digest_size=8)
_PHRASE_HASHER = hashlib.blake2b(digest_size=8, person=b"value")


def token_hash(kind: str, value: str) -> bytes:
    """The 8-byte fingerprint of a distinctive token."""
    hasher = _TOKEN_HASHER.copy()
    hasher.update(f"{kind}:{value}".encode())
    return hasher.digest()



# -- whole values: short word-bounded phrases ----------------------------------------------------
#
# A short value copied whole (a password, a venue or product name, a short code) is shorter than
# a gram. Outputs record the hash of every phrase of 1 to MAX_PHRASE_WORDS words (split on
# whitespace, edge punctuation stripped) of MIN_PHRASE_CHARS characters or more and shorter than
# min_match (a longer whole value is caught by its grams); a sink argument is looked up by the
# hash of its whole value, stripped the same way. Only whole words take part, so "cat" never
# matches inside "catalog".

MAX_PHRASE_WORDS = 4
# Stripped from both ends of a phrase and of a value: "pay Acme Ltd." holds "acme ltd".
_EDGE = "\"'`.,;:!?()[]{}<>*_~-\u2010\u2011\u2012\u2013\u2014\u2026\u00ab\u00bb\u2018\u2019\u201c\u201d"


def phrase_key(norm: str, n: int) -> str | None:
    """The whole-value key of a normalised text (edge punctuation stripped), or None when it
    cannot be a recorded phrase: more than MAX_PHRASE_WORDS words, shorter than
    MIN_PHRASE_CHARS or not shorter than `n` (min_match) characters."""
    key = norm.strip(_EDGE).strip()
    if not MIN_PHRASE_CHARS <= len(key) < n or key.count(" ") >= MAX_PHRASE_WORDS:
        return None
    return key


def phrase_hash(key: str) -> bytes:
    """The 8-byte fingerprint of a whole-value key (its own namespace: `person` differs from
    every token hash's, whose kind is part of the hashed text)."""
    hasher = _PHRASE_HASHER.copy()
    hasher.update(key.encode())
    return hasher.digest()


def phrases(norm: str, n: int, limit: int | None = None) -> set[str]:
    """Every whole-value key of a normalised text: its phrases of 1 to MAX_PHRASE_WORDS
    consecutive words, edge punctuation stripped, of MIN_PHRASE_CHARS to n - 1 characters.
    At most `limit` of them (bounded work; the caller marks the rest as overflow)."""
    words = norm.split(" ")
    found: set[str] = set()
    add = found.add
    count = len(words)
    for i, phrase in enumerate(words):
        # Grown one word at a time (no slicing and joining per phrase: this loop is the cost).
        for j in range(i + 1, min(i + MAX_PHRASE_WORDS, count) + 1):
            if j > i + 1:
                phrase = f"{phrase} {words[j - 1]}"
            key = phrase.strip(_EDGE).strip()
            if len(key) >= n:
                break  # longer phrases from i only grow
            if len(key) >= MIN_PHRASE_CHARS:
                add(key)
        if limit is not None and len(found) >= limit:
            break
    return found
