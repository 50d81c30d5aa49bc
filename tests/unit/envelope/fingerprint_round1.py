"""A frozen copy of `proxy.envelope.dataflow.fingerprint` as of 2a0bd1f (before the anchored
token scans and the ASCII fast paths of issue 15, round 2): the reference that
`test_dataflow_fingerprint_round2.py` holds the current code to (same fingerprints). Not
imported by the proxy; do not edit."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterator

import numpy as np

from proxy.policy.model import DEFAULT_WINNOW, MIN_PHRASE_CHARS

MIN_TOKEN = 8  # shortest distinctive token

# -- normalisation and fingerprints ------------------------------------------------------------

# Window hashes are polynomial hashes mod 2**64 (numpy's wrapping uint64 arithmetic), computed
# for every window at once from prefix sums: hash(i) = sum(c[i+k] * B**k), stable across
# processes and replicas. A collision can only make a benign argument match (never hide a copy).
_B = 0x100000001B3  # odd, so invertible mod 2**64
_B_INV = pow(_B, -1, 1 << 64)
_SEGMENT = 1 << 15
_powers: tuple[np.ndarray, np.ndarray] = (np.ones(1, np.uint64), np.ones(1, np.uint64))


def _power_tables(length: int) -> tuple[np.ndarray, np.ndarray]:
    """B**i and B**-i mod 2**64 for i < length (grown by doubling, shared by every call).
    Thread-safe: worker threads hash concurrently, and each uses the tables it read or built
    (a racing thread may install smaller ones; both are right)."""
    global _powers
    tables = _powers
    if len(tables[0]) < length:
        size = 1 << max(12, (length - 1).bit_length())
        one = np.ones(1, np.uint64)
        with np.errstate(over="ignore"):
            tables = (np.cumprod(np.concatenate((one, np.full(size - 1, _B, np.uint64))), dtype=np.uint64),
                      np.cumprod(np.concatenate((one, np.full(size - 1, _B_INV, np.uint64))), dtype=np.uint64))
        if len(_powers[0]) < size:
            _powers = tables
    return tables


# Invisible format characters (zero-width spaces and joiners, soft hyphen, bidi controls, BOM):
# a model told to slip them into a copied address must not break the match.
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e\u200b-\u200f"
                        "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]")


def _fold(text: str) -> str:
    """NFKC, invisible characters removed, case-folded."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text)).casefold()


def normalise(text: str) -> str:
    """Case-folded, NFKC, invisible characters removed, whitespace runs collapsed to one space,
    stripped."""
    # str.split() splits on runs of what `\s` matches (str.isspace): 5x faster than re.sub.
    return " ".join(_fold(text).split())


def _window_hashes(norm: str, k: int) -> np.ndarray:
    """The hash of every k-character window of a normalised string, in order (computed in
    segments of `_SEGMENT` windows, so the power tables stay small for huge texts)."""
    length = len(norm)
    if length < k:
        return np.empty(0, np.uint64)
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


def _as_fields(hashes: np.ndarray) -> list[bytes]:
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
    return _as_fields(_window_hashes(norm, gram_length(n, window)))


def winnowed(norm: str, n: int, window: int = DEFAULT_WINNOW) -> list[bytes]:
    """The fingerprints an output keeps (Schleimer, Wilkerson and Aiken's winnowing): in every
    run of `window` consecutive grams, the smallest hash (the rightmost on ties). Any text of
    at least n characters shared with the output contains `window` whole grams, so one of its
    grams is kept; about 2/(window+1) of the grams are stored. `window` 1 keeps every gram."""
    if len(norm) < gram_length(n, window):
        return []  # shorter than one gram (most short outputs): no numpy round trip
    hashes = _window_hashes(norm, gram_length(n, window))
    if window <= 1:
        return _as_fields(np.unique(hashes))
    if len(hashes) < window:
        return _as_fields(hashes[[int(hashes.argmin())]])
    # The minimum of every window, then where it is (the rightmost on ties: a later offset
    # overwrites), as whole-array operations over the `window` offsets.
    count = len(hashes) - window + 1
    smallest = hashes[:count].copy()
    for j in range(1, window):
        np.minimum(smallest, hashes[j: j + count], out=smallest)
    at = np.zeros(count, np.intp)
    for j in range(1, window):
        at[hashes[j: j + count] == smallest] = j
    at += np.arange(count)
    # Sliding right never moves the rightmost minimum left: the kept positions are sorted, so
    # dropping repeats is a comparison with the previous one.
    keep = at[np.concatenate(([True], at[1:] != at[:-1]))]
    return _as_fields(hashes[keep])


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


def _emails(low: str) -> Iterator[str]:
    """E-mail addresses of a folded text, in order, not overlapping."""
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


def _domains(low: str) -> Iterator[re.Match[str]]:
    """The matches of `_DOMAIN.finditer(low)`, found from the dots of the text: a match starts
    only where a run of [@\\w.-] starts and its host holds a dot of that run, so only the runs
    with a dot are tried, each at its start (on prose, 2-3x faster than testing the look-behind at
    every word). Each character is scanned back over at most once: linear time."""
    pos = 0
    while (dot := low.find(".", pos)) >= 0:
        start = dot
        while start > pos and (low[start - 1].isalnum() or low[start - 1] in _RUN_CHARS):
            start -= 1
        # A run that began before `pos` (inside the previous match) has no start to try.
        began_before = start == pos > 0 and (low[pos - 1].isalnum() or low[pos - 1] in _RUN_CHARS)
        found = None if began_before else _DOMAIN.match(low, start)
        if found is None:
            # No other start in this run: go past it (`*` always matches, from the dot on).
            rest = _RUN_REST.match(low, dot)
            pos = rest.end() if rest is not None else dot + 1
            continue
        yield found
        pos = found.end()


def _urls(low: str) -> Iterator[str]:
    """URLs (with a scheme, or starting www.) of a folded text, in order, not overlapping."""
    for found in _URL.finditer(low):
        yield found.group("url") or found.group("www")


def _url_tokens(raw: str) -> Iterator[tuple[str, str]]:
    value = raw.rstrip(_TRAIL)
    value = _SCHEME.sub("", value)
    value = value.removeprefix("www.")
    value = value.rstrip("/")
    host, _, rest = value.partition("/")
    host = host.split("@")[-1].split(":")[0]
    if "." not in host or host.rsplit(".", 1)[-1] in _FILE_TLDS:
        return
    if len(host) >= MIN_TOKEN:
        yield "host", host
    if rest:
        yield "url", f"{host}/{rest}"


def tokens(text: str) -> set[tuple[str, str]]:
    """Distinctive tokens of a text, normalised: (kind, value), values of at least 8 chars.
    Time linear in the text, whatever the text."""
    low = _fold(text)
    found: set[tuple[str, str]] = set()
    # A match shorter than MIN_TOKEN yields no token (every value is a part of the match), so
    # it costs nothing more; matches are iterated, not collected, so the thread that runs this
    # for a large output lets others take the GIL between them.
    if "@" in low:
        for e in _emails(low):
            if len(e) >= MIN_TOKEN:
                found.add(("email", e))
                host = e.rsplit("@", 1)[1]
                if len(host) >= MIN_TOKEN:
                    found.add(("host", host))
    if "://" in low or "www." in low:
        for m in _urls(low):
            if len(m) >= MIN_TOKEN:
                found.update(_url_tokens(m))
    for match in _domains(low):
        if match.end() - match.start() >= MIN_TOKEN:
            found.update(_url_tokens(match.group()))
    for match in _DIGITS.finditer(low):
        m = match.group()
        if _DATE.match(m):
            continue
        digits = _NOT_DIGIT.sub("", m)
        if len(digits) >= MIN_TOKEN:
            found.add(("number", digits))
    for match in _IBAN_DIGITS.finditer(low):
        compact = low[match.start() - 2: match.end()].replace(" ", "")
        if any(ch.isdigit() for ch in compact[4:]):
            found.add(("number", compact))
    return {(k, v) for k, v in found if len(v) >= MIN_TOKEN}


def token_hash(kind: str, value: str) -> bytes:
    """The 8-byte fingerprint of a distinctive token."""
    return hashlib.blake2b(f"{kind}:{value}".encode(), digest_size=8).digest()



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
    return hashlib.blake2b(key.encode(), digest_size=8, person=b"value").digest()


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
