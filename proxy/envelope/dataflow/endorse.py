"""Tainted-run escalation: which critical sink values the run's trusted sources endorse.

A run that has read untrusted content may be steered to a choice no untrusted text spells
("book the most expensive option", "reserve X" where X is a real entry of a trusted listing):
the argument carries nothing to match. `dataflow.on_tainted` sends such a sink to a person (or
refuses it) unless every value of its critical arguments (`dataflow.critical`, else every
argument that is not declassified) is **endorsed** by a trusted source of the same run:

- the run's **intent** (the user's words): a string whose whole normalised value (case, width,
  whitespace and invisible characters folded, edge punctuation stripped) occurs in the intent
  between word boundaries, a distinctive token (e-mail, URL, host, account number) equal to one
  of the intent's, or a number / amount whose canonical decimal the intent writes
  ("$1,200.50" = "1200.50" = 1200.5; "twelve hundred" is not a number);
- a **trusted output** read in the same run: a string equal, normalised, to a whole string of
  the output, to one of its fields (`segments`: "Grand Palace" of "2. Grand Palace - $1,240.50
  per night", a value after "name:"), or to one of its distinctive tokens;
  a number equal to one the output writes with 3 digits or more or with decimals (a price,
  an id; "2" of a numbered list endorses nothing: small integers only by the intent).

Trusted outputs record these as 8-byte hashes in their own namespace (`trusted_keys`: the
`trusted` label of the run's fingerprint hash), only when some sink's `on_tainted` is not
`allow`; at most `MAX_KEYS` per output (a value past them is simply not endorsed: more
escalation, never less). Booleans and null are never critical: they carry no chosen value.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.envelope.dataflow.fingerprint import normalise, tokens

MAX_PHRASE_CHARS = 64  # longest field of a trusted string recorded (characters)
MAX_WHOLE_CHARS = 256  # longest whole string of a trusted output recorded as one value
MAX_KEYS = 8192  # most keys one trusted output records
MAX_CRITICAL = 256  # most critical values one call is checked for; beyond: not endorsed
MAX_DEPTH = 32

# Stripped from both ends of a value and of a phrase: "pay Acme Ltd." names "acme ltd".
_EDGE = "\"'`.,;:!?()[]{}<>*_~-#\u2010\u2011\u2012\u2013\u2014\u2026\u00ab\u00bb\u2018\u2019\u201c\u201d"
# A number as people write it: optional currency sign, digits with optional thousands commas,
# optional decimals; not part of a word or of a longer number ("v2", "3.1.4" are not amounts).
_NUMBER = re.compile(r"(?<![\w.,])[$€£¥]?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w]|[.,]\d)")
# Where a field of a listing or record ends (a "." only before a space: "1,240.50" stays whole).
_SEPARATORS = re.compile(r"[\n\r\t|;,:()\[\]{}<>\u2022\u00b7]+|\s[-\u2013\u2014/]+\s|(?<=[.!?])\s+")
_ENUMERATOR = re.compile(r"^(?:\d{1,3}[.)]|[a-z][.)]|[-*#>])\s+")
_WHOLE_NUMBER = re.compile(r"^[$€£¥]?\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?\s?(?:[a-z]{3})?$")


# Copying a keyed hash state is cheaper than building one per key (recording a trusted output
# hashes hundreds of keys).
_BASE = hashlib.blake2b(digest_size=8, person=b"trusted")


def _hash(text: str) -> bytes:
    h = _BASE.copy()
    h.update(text.encode())
    return h.digest()


def _key(kind: str, value: str) -> bytes:
    """The 8-byte hash of an endorsing value (own namespace: never equal to a gram's, token's or
    phrase's hash of the untrusted ledger)."""
    return _hash(f"{kind}:{value}")


def canonical_number(whole: str, fraction: str | None) -> str:
    """'1,200' + '50' -> '1200.5'; '007' -> '7'; '12.00' -> '12'."""
    integer = whole.replace(",", "").lstrip("0") or "0"
    frac = (fraction or "").rstrip("0")
    return f"{integer}.{frac}" if frac else integer


def numbers(norm: str) -> set[str]:
    """The canonical decimals a normalised text writes."""
    return {canonical_number(m.group(1), m.group(2)) for m in _NUMBER.finditer(norm)}


def distinctive(number: str) -> bool:
    """Whether a trusted output writing this number endorses it: an amount with decimals or a
    number of 3 digits or more. Small integers (list positions, counts, days) occur in every
    listing: only the user's words endorse them."""
    return "." in number or len(number.lstrip("-")) >= 3


def _strip(norm: str) -> str:
    return norm.strip(_EDGE).strip()


def segments(text: str) -> Iterator[str]:
    """The fields of a trusted string, normalised: its parts between separators a listing or a
    record uses (line breaks, tabs, "|", ";", ",", ":", " - ", brackets, sentence ends), a
    leading enumerator ("2.", "b)", "-", "*") and edge punctuation stripped."""
    for part in _SEPARATORS.split(text):
        key = _strip(_ENUMERATOR.sub("", normalise(part)))
        if key and len(key) <= MAX_PHRASE_CHARS:
            yield key


def trusted_keys(text: str, limit: int = MAX_KEYS) -> set[bytes]:
    """The endorsing keys one string of a trusted output records: its whole value (up to
    MAX_WHOLE_CHARS), its fields (`segments`), its distinctive tokens and its distinctive
    numbers; at most `limit`."""
    found: set[str] = set()  # "<kind>:<value>", hashed once each at the end
    norm = normalise(text)
    whole = _strip(norm)
    if not whole:
        return set()
    if len(whole) <= MAX_WHOLE_CHARS:
        found.add(f"v:{whole}")
    if any(ch.isdigit() for ch in norm):
        found.update(f"n:{number}" for number in numbers(norm) if distinctive(number))
    found.update(f"t{kind}:{value}" for kind, value in tokens(text))
    for key in segments(text):
        if len(found) >= limit:
            break
        found.add(f"v:{key}")
    return {_hash(k) for k in list(found)[:limit]}


@dataclass(frozen=True, slots=True)
class Critical:
    """One critical value of a sink call: where it is, what it is, and the keys a trusted
    output would have recorded for it (any one of them endorses it)."""

    pointer: str
    value: str | int | float
    norm: str  # normalised, edge punctuation stripped ("" for numbers)
    number: str | None  # canonical decimal when the value is a number or an amount
    keys: tuple[bytes, ...]

    @classmethod
    def of(cls, pointer: str, value: str | int | float) -> Critical:
        if isinstance(value, int | float):
            number = _json_number(value)
            of_number = [_key("n", number)] if number is not None and distinctive(number) else []
            return cls(pointer, value, "", number, tuple(of_number))
        norm = _strip(normalise(value))
        keys: list[bytes] = []
        number = None
        m = _WHOLE_NUMBER.match(norm)
        if m is not None:
            # A number written as a string follows the rules of numbers (not of phrases: "2"
            # of "2. Grand Palace" does not endorse two nights).
            number = canonical_number(m.group(1), m.group(2))
            if distinctive(number):
                keys.append(_key("n", number))
        elif norm:
            keys.append(_key("v", norm))
        found = tokens(value)
        if found:
            # The value is (or wraps) an address, URL or account number: an equal token endorses
            # it. Only its longest token counts (an address's host alone endorses nothing).
            kind, token = max(found, key=lambda t: (len(t[1]), t))
            if len(token) * 2 >= len(norm):
                keys.append(_key(f"t{kind}", token))
        return cls(pointer, value, norm, number, tuple(keys))


def _json_number(value: int | float) -> str | None:
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        text = f"{value:.10f}" if abs(value) < 1e15 else f"{value:.0f}"
    else:
        text = str(value)
    sign = "-" if text.startswith("-") else ""
    whole, _, frac = text.lstrip("-").partition(".")
    return sign + canonical_number(whole, frac)


def _escape(seg: str) -> str:
    return seg.replace("~", "~0").replace("/", "~1")


def _scalars(value: Any, ptr: str, depth: int) -> Iterator[tuple[str, str | int | float]]:
    if depth > MAX_DEPTH:
        yield ptr, "<nested too deep>"  # never endorsed: fail closed
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, str):
        if value.strip():
            yield ptr, value
    elif isinstance(value, int | float):
        yield ptr, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _scalars(v, f"{ptr}/{_escape(str(k))}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _scalars(v, f"{ptr}/{i}", depth + 1)


def critical_values(arguments: Mapping[str, Any], names: Iterable[str]) -> tuple[list[Critical], bool]:
    """The critical values of the named top-level arguments (strings and numbers, nested ones
    included), and whether there were more than MAX_CRITICAL (the rest count as unendorsed)."""
    out: list[Critical] = []
    for name in names:
        if name not in arguments:
            continue
        for ptr, value in _scalars(arguments[name], f"/{_escape(name)}", 0):
            if len(out) >= MAX_CRITICAL:
                return out, True
            out.append(Critical.of(ptr, value))
    return out, False


@dataclass(frozen=True, slots=True)
class IntentWords:
    """What the run's intent endorses for critical values: its normalised texts, its tokens'
    keys and its numbers."""

    texts: tuple[str, ...]
    token_keys: frozenset[bytes]
    numbers: frozenset[str]

    @classmethod
    def of(cls, texts: Iterable[str]) -> IntentWords:
        norms = tuple(normalise(t) for t in texts)
        keys = frozenset(_key(f"t{kind}", value) for t in texts for kind, value in tokens(t))
        return cls(norms, keys, frozenset(n for norm in norms for n in numbers(norm)))

    def endorses(self, critical: Critical) -> bool:
        if critical.number is not None and critical.number in self.numbers:
            return True
        if critical.norm:
            pattern = re.compile(rf"(?<![\w@.\-]){re.escape(critical.norm)}(?![\w@\-]|\.\w)")
            if any(critical.norm in text and pattern.search(text) for text in self.texts):
                return True
        return any(k in self.token_keys for k in critical.keys)
