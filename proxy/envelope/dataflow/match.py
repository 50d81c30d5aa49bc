"""Which sink arguments can carry an attacker's text, and what they copy from the ledger."""

from __future__ import annotations

import base64
import html
import re
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.envelope.dataflow.fingerprint import (
    MIN_TOKEN,
    collapse,
    disguised,
    faithful,
    fold,
    folded_tokens,
    gram_hashes,
    gram_length,
    phrase_hash,
    phrase_key,
    token_hash,
    variants,
)
from proxy.envelope.dataflow.ledger import (
    Ledger,
)
from proxy.envelope.dataflow.shape import instruction_shaped, sentences
from proxy.policy.model import DEFAULT_MAX_ARGUMENT_CHARS, DEFAULT_WINNOW
from proxy.policy.schemas import VALIDATED_FORMATS

SNIPPET = 80  # evidence snippets are truncated to this many characters
MAX_DEPTH = 32

# -- arguments ------------------------------------------------------------------------------------


def _constrained(schema: Any, value: Any, skip_formats: frozenset[str]) -> bool:
    """Whether a schema the call was validated against leaves no room for an attacker's text in
    `value` (enum, const, boolean, bounded number, a short maxLength, a trusted format).

    `format` and `maxLength` constrain strings only (anything else passes them), and a format is
    trusted only when the schema check asserts it (`VALIDATED_FORMATS`). A schema with `$ref`
    is never trusted: in drafts before 2019-09 its other keywords are ignored by the validator.
    """
    if not isinstance(schema, Mapping) or "$ref" in schema:
        return False
    if "enum" in schema or "const" in schema:
        return True
    kind = schema.get("type")
    if kind == "boolean":
        return True
    if kind in ("number", "integer"):
        return (("minimum" in schema or "exclusiveMinimum" in schema)
                and ("maximum" in schema or "exclusiveMaximum" in schema))
    if not isinstance(value, str):
        return False
    fmt = schema.get("format")
    if fmt in skip_formats and fmt in VALIDATED_FORMATS:
        return True
    max_len = schema.get("maxLength")
    return isinstance(max_len, int) and max_len < MIN_TOKEN


def _escape(seg: str) -> str:
    return seg.replace("~", "~0").replace("/", "~1")


def free_text(value: Any, schema: Any, skip_formats: frozenset[str], ptr: str = "",
              depth: int = 0) -> Iterator[tuple[str, str]]:
    """(JSON pointer, text) of every argument value that can carry an attacker's text.

    `schema` is the one the schema check validated the arguments against; a value is skipped
    only when the subschema that validated it constrains it (`_constrained`).
    """
    if depth > MAX_DEPTH or _constrained(schema, value, skip_formats):
        return
    sch = schema if isinstance(schema, Mapping) else {}
    if isinstance(value, str):
        yield ptr, value
    elif isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 10 ** (MIN_TOKEN - 1):
            yield ptr, str(value)
    elif isinstance(value, Mapping):
        found = sch.get("properties")
        props: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        # additionalProperties does not apply to a key patternProperties matches: with pattern
        # properties, keys outside `properties` are walked without a schema.
        extra = None if "patternProperties" in sch else sch.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k, extra if isinstance(extra, Mapping) else None)
            yield from free_text(v, sub, skip_formats, f"{ptr}/{_escape(str(k))}", depth + 1)
    elif isinstance(value, list):
        # 2020-12: `prefixItems` validate the first elements, `items` only those after them.
        prefix = sch.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = sch.get("items")
        for i, v in enumerate(value):
            sub = prefix[i] if i < len(prefix) else items
            yield from free_text(v, sub, skip_formats, f"{ptr}/{i}", depth + 1)


def _snippet(text: str) -> str:
    return text if len(text) <= SNIPPET else text[: SNIPPET - 1] + "…"


@dataclass(frozen=True, slots=True)
class Finding:
    """One piece of evidence: which argument, what matched, from which tool."""

    kind: str  # verbatim | value | token | instruction | declassified_copy | trifecta | coarse
    argument: str | None
    source: str
    snippet: str

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "argument": self.argument, "source": self.source,
                "snippet": self.snippet}

    def describe(self) -> str:
        arg = f"argument '{self.argument}'" if self.argument else "the call"
        if self.kind == "verbatim":
            return f"{arg} copies untrusted text from {self.source} verbatim: {self.snippet!r}"
        if self.kind == "value":
            return (f"{arg} is {self.snippet!r}, a value found whole in untrusted output of "
                    f"{self.source}")
        if self.kind == "token":
            return f"{arg} carries {self.snippet!r}, lifted from untrusted output of {self.source}"
        if self.kind == "instruction":
            return (f"{arg} (declassified) repeats an instruction-shaped sentence from untrusted "
                    f"output of {self.source}: {self.snippet!r}")
        if self.kind == "declassified_copy":
            return (f"{arg} (declassified) copies a long run of untrusted text from {self.source}: "
                    f"{self.snippet!r}")
        if self.kind == "coarse":
            return f"{arg} may carry untrusted content: {self.snippet}"
        return (f"the run holds untrusted content and secret content (from {self.source}); a "
                "sink may not fire (lethal trifecta)")


@dataclass(slots=True)
class Probe:
    """One argument value, fingerprinted the way outputs are: what to ask the ledger for."""

    norm: str
    grams: list[bytes]  # every gram, in order (outputs keep only winnowed ones)
    tokens: list[tuple[str, str, bytes]]  # (kind, value, fingerprint)
    k: int = 0  # gram length
    oversized: int = 0  # the value's length when it is longer than the cap (then not hashed)
    # The whole value's phrase key and fingerprint, when it is short enough to be looked up
    # whole (at least `min_value` characters, at most 4 words, shorter than min_match).
    value: str | None = None
    value_hash: bytes | None = None
    # Folding changed more than its case (`fingerprint.disguised`): the intent's folded words
    # must not endorse it (matching it against untrusted content still folds).
    disguised: bool = False
    # A disguised value as written (`fingerprint.faithful`): only the intent writing these very
    # characters endorses it ("josé@empresa.example" the user typed, also on a page).
    faithful: str | None = None

    @classmethod
    def of(cls, text: str, n: int, window: int = DEFAULT_WINNOW,
           max_chars: int | None = DEFAULT_MAX_ARGUMENT_CHARS, min_value: int = 0) -> Probe:
        """The fingerprints of one argument value; none for a value longer than `max_chars`
        (`oversized`: the caller counts it as matching, bounded work per argument). With
        `min_value` (0: off), a short value is also looked up whole."""
        if max_chars is not None and len(text) > max_chars:
            return cls("", [], [], gram_length(n, window), oversized=len(text))
        low = fold(text)  # folded once, for the grams and the tokens
        norm = collapse(low)
        hidden = disguised(text)
        key = phrase_key(norm, n) if min_value else None
        if key is not None and len(key) < min_value:
            key = None
        return cls(norm, gram_hashes(norm, n, window),
                   [(k, v, token_hash(k, v)) for k, v in sorted(variants(folded_tokens(low), parents=True))], gram_length(n, window),
                   value=key, value_hash=None if key is None else phrase_hash(key), disguised=hidden,
                   faithful=faithful(text) if hidden else None)

    def fields(self) -> Iterator[bytes]:
        if self.value_hash is not None:
            yield self.value_hash
        for _, _, h in self.tokens:
            yield h
        yield from self.grams


# -- encodings an argument carries ----------------------------------------------------------------
#
# An agent told to "URL-encode", "base64" or "hex" the value it sends, or a tool argument that
# is a link or JSON with the value escaped in it, hides a copy from the grams and tokens of the
# text as written. Each argument is therefore also matched as it reads decoded: percent-encoding
# (and "+" for a space), HTML character references, JSON / C escapes (\uXXXX, \xXX, \n...), runs
# of base64 or hex that decode to text, and an address spelled out ("x at y dot example"). One
# layer of each, then all of them in turn (an encoded value inside a link is decoded by both).
# Every decoder is one linear pass (the patterns have no nested repeats, and a run is tried once
# where it starts); a reading is kept only when it differs from the text, so plain arguments
# cost one search per decoder.

MAX_READINGS = 6
_PERCENT = re.compile(r"%[0-9a-fA-F]{2}")
_ENTITY = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});?")
_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[nrtbf/\\\"'])")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"', "'": "'"}
# Runs of the base64 alphabets (standard and URL-safe) or of hex digits, long enough to carry a
# token: shorter runs are words.
_BASE64_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
_RUN_CLASSES = bytes.maketrans(bytes(range(256)), bytes(ord("a") if c in _BASE64_CHARS else ord(" ")
                                                         for c in range(256)))
_MIN_RUN = b"a" * 12
_DIGIT_OR_UPPER = re.compile(r"[0-9A-Z]")
# (Each pattern starts with a literal, which `re` finds by a fast scan; one that starts with a
# class is tried at every position, ~20 ns a character.)
_PLUS_SPACE = re.compile(r"\+(?<=[A-Za-z]\+)[A-Za-z]")
_HEX_RUN = re.compile(r"(?:[0-9a-fA-F]{2}){8,}")
_TO_STANDARD = str.maketrans("-_", "+/")
# " at " / " dot " and their bracketed forms, as an address is spelled out to pass filters.
_BRACKETED_AT = re.compile(r"[\[({<] ?at ?[\])}>]", re.IGNORECASE)
_BRACKETED_DOT = re.compile(r"[\[({<] ?dot ?[\])}>]", re.IGNORECASE)


def _unescaped(found: re.Match[str]) -> str:
    code = found.group()[1:]
    if code[0] in "ux":
        return chr(int(code[1:], 16))
    return _SIMPLE_ESCAPES[code]


def _as_text(raw: bytes) -> str | None:
    """Decoded bytes as text, when they are UTF-8 and printable (whitespace allowed): random
    bytes (a hash, an id) almost never are."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text and all(c.isprintable() or c.isspace() for c in text) else None


def _decoded_run(run: str) -> str:
    """A run of the base64 alphabets decoded, when it is hex or base64 of text; else the run."""
    if _DIGIT_OR_UPPER.search(run) is None:
        return run  # lower-case words joined by "-" or "/" (base64 of text has both, hex digits)
    if _HEX_RUN.fullmatch(run):
        text = _as_text(bytes.fromhex(run))
        if text is not None:
            return text
    # A run that starts with "/" or "-" (a path, a flag) may start its base64 one later.
    for start in (run, run.lstrip("/+-_")):
        body = start.translate(_TO_STANDARD)
        if len(body) % 4 == 1 or len(body) < 12:
            continue
        try:
            raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
        except ValueError:
            continue
        text = _as_text(raw)
        if text is not None:
            return text if start is run else run[: len(run) - len(start)] + text
    return run


def _percent(text: str) -> str:
    if "%" in text and _PERCENT.search(text) is not None:
        return urllib.parse.unquote_plus(text)
    # Form-encoded words with nothing to escape ("ignore+previous+instructions"); a "+" of a
    # phone number or a sum stays.
    if "+" in text and _PLUS_SPACE.search(text) is not None:
        return text.replace("+", " ")
    return text


def _entities(text: str) -> str:
    return html.unescape(text) if "&" in text and _ENTITY.search(text) else text


def _escapes(text: str) -> str:
    if "\\" not in text:
        return text
    decoded = _ESCAPE.sub(_unescaped, text)
    # Escaped surrogate pairs (JSON writes characters past the BMP so) joined, lone ones replaced.
    return decoded.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _binary(text: str) -> str:
    # The runs are found in the text's classes, by C finds of MIN_RUN class bytes in a row and of
    # the space after them (a pattern tried at every position cost ~20 ns a character).
    classes = text.encode("ascii", "replace").translate(_RUN_CLASSES)
    at = classes.find(_MIN_RUN)
    if at < 0:
        return text
    parts: list[str] = []
    done = 0
    while at >= 0:
        end = classes.find(b" ", at)
        end = len(classes) if end < 0 else end
        run = text[at:end]
        decoded = _decoded_run(run)
        if decoded != run:
            parts += [text[done:at], decoded]
            done = end
        at = classes.find(_MIN_RUN, end)
    return "".join(parts) + text[done:] if parts else text


def _spelled(text: str) -> str:
    """An address spelled out ("exfil at attacker-mail dot example", "[at]", "(dot)") written."""
    if "dot" not in text and "DOT" not in text and "Dot" not in text:
        return text
    # The bracketed forms by patterns that start with a bracket (`re` scans for it in C), the
    # spaced ones by plain replacement: no pattern is tried at every space.
    written = _BRACKETED_DOT.sub(".", _BRACKETED_AT.sub("@", text))
    for at, dot in ((" at ", " dot "), (" AT ", " DOT "), (" At ", " Dot ")):
        written = written.replace(at, "@").replace(dot, ".")
    return written.replace(" @ ", "@").replace(" . ", ".")


_DECODERS = (_percent, _entities, _escapes, _binary, _spelled)


def readings(text: str) -> list[str]:
    """The other texts an argument value reads as, decoded (`_DECODERS`, one of each, then all
    in turn), each different from `text` and from each other; at most MAX_READINGS."""
    found: list[str] = []
    if len(text) < MIN_TOKEN:
        return found  # decoding shortens: shorter than any token, gram or whole value
    for decode in _DECODERS:
        one = decode(text)
        if one != text and one not in found:
            found.append(one)
    if not found:
        return found  # no decoder changes it: neither does the chain of them
    chained = text
    for decode in _DECODERS:
        chained = decode(chained)
    if chained != text and chained not in found:
        found.append(chained)
    return found[:MAX_READINGS]


def value_probes(text: str, n: int, window: int = DEFAULT_WINNOW,
                 max_chars: int | None = DEFAULT_MAX_ARGUMENT_CHARS, min_value: int = 0) -> list[Probe]:
    """The probes of one argument value: the value as written, then each of its `readings`
    (none for a value longer than `max_chars`: it is not hashed at all)."""
    probe = Probe.of(text, n, window, max_chars, min_value)
    if probe.oversized:
        return [probe]
    return [probe, *(Probe.of(reading, n, window, None, min_value) for reading in readings(text))]


def oversized(probe: Probe, max_chars: int) -> Finding:
    """The `coarse` finding of an argument too long to be matched (its pointer is filled in by
    the caller, which adds it when the run's ledger holds untrusted content or is coarse)."""
    return Finding("coarse", None, "this run",
                   f"it is {probe.oversized:,} characters long, more than the {max_chars:,} that are "
                   "matched (dataflow.max_argument_chars), so it counts as matching")


def copied_runs(ledger: Ledger, probe: Probe, n: int, window: int = DEFAULT_WINNOW,
                ) -> list[tuple[int, int, str]]:
    """(start, end, source) of each run of `probe.norm` copied from untrusted output: kept grams
    at most `window` grams apart are one run; it spans from its first hit gram to the end of
    its last (the copy may reach up to `window - 1` characters further on either side)."""
    k = probe.k or gram_length(n, window)
    runs: list[tuple[int, int, str]] = []
    held = ledger.fingerprints  # what `find` reads: only grams it holds are looked up (most hold none)
    if not held:
        return runs
    hits = [(i, found) for i, h in enumerate(probe.grams) if h in held and (found := ledger.find(h)) is not None]
    start = 0
    while start < len(hits):
        end = start
        while end + 1 < len(hits) and hits[end + 1][0] - hits[end][0] <= window:
            end += 1
        source = next((f for _, f in hits[start: end + 1] if f.startswith("untrusted|")), None)
        if source is not None:
            runs.append((hits[start][0], hits[end][0] + k, source.partition("|")[2]))
        start = end + 1
    return runs


def declassified_findings(ledger: Ledger, probe: Probe, n: int, window: int, max_copy: int,
                          ) -> list[Finding]:
    """What still flags in a declassified argument: a copied run of at least `max_copy`
    characters (0: never), and a sentence of it that is mostly copied from untrusted output
    (at least half of its characters, or `n` of them) and instruction-shaped (`shape`)."""
    found: list[Finding] = []
    runs = copied_runs(ledger, probe, n, window)
    if not runs:
        return found
    slack = window - 1
    for first, end, source in runs:
        if max_copy and end - first + slack >= max_copy:
            found.append(Finding("declassified_copy", None, source, _snippet(probe.norm[first:end])))
    for start, stop in sentences(probe.norm):
        for first, end, source in runs:
            overlap = min(stop, end + slack) - max(start, first - slack)
            if overlap > 0 and (overlap * 2 >= stop - start or overlap >= n):
                shape = instruction_shaped(probe.norm[start:stop])
                if shape is not None:
                    found.append(Finding("instruction", None, source, _snippet(probe.norm[start:stop])))
                break
    return found


def match_argument(ledger: Ledger, text: str | Probe, n: int, window: int = DEFAULT_WINNOW,
                   min_value: int = 0) -> tuple[list[Finding], list[Finding]]:
    """(untrusted verbatim findings, untrusted token findings) of one argument value (its
    pointer is filled in by the caller). Secret-only matches are not findings. Kept grams of a
    copied run lie at most `window` grams apart: hits that close are one run of evidence. A
    short value an untrusted output holds whole (a `value` finding) counts with the verbatim
    ones: a declassified argument may carry it."""
    probe = text if isinstance(text, Probe) else Probe.of(text, n, window, min_value=min_value)
    verbatim = [Finding("verbatim", None, source, _snippet(probe.norm[first:end]))
                for first, end, source in copied_runs(ledger, probe, n, window)]
    if not verbatim and probe.value_hash is not None:
        found = ledger.find(probe.value_hash)
        if found is not None and found.startswith("untrusted|"):
            verbatim.append(Finding("value", None, found.partition("|")[2], _snippet(probe.value or "")))
    toks: list[Finding] = []
    for _, value, h in probe.tokens:
        found = ledger.find(h)
        if found is not None and found.startswith("untrusted|"):
            toks.append(Finding("token", None, found.partition("|")[2], _snippet(value)))
    return verbatim, toks

