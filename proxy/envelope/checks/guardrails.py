"""Output guardrails: scan what an upstream sends before it reaches the client.

A guardrail rule is either a built-in secret detector or a policy regular expression, with an
action:

- `redact`: every match is replaced by `[REDACTED:<detector or rule id>]`;
- `block`: the whole result is replaced by a `guardrail_blocked` refusal;
- `warn`: nothing changes, the match is audited and counted.

Scanned (by `proxy.envelope.inspect`, the one inspection seam): every string and object key
of every message an upstream sends toward the client: tool results (`content`,
`structuredContent`, `_meta`), JSON-RPC error replies, task results and status, resource
contents, prompt messages, and server-to-client requests and notifications in a stream. The
text blocks of a result's `content` are also read as one text, in order (a secret cut across
blocks is one secret), and base64 bytes that are text (`blob`, an image's or audio's `data`)
are decoded and scanned; binary bytes are not. Each
rule that fires is recorded in the audit record (`guardrails`: rule id, detector, action,
number of matches; never the matched text) and counted in
`envelope_guardrail_actions_total{tool,action}`.

A string with characters outside ASCII is also scanned as a reader sees it: compatibility
forms folded (NFKC: the fullwidth letter U+FF21 is `A`) and invisible format characters removed
(zero-width spaces and joiners, bidi controls, soft hyphens, tag characters, variation
selectors). When that view holds more matches than the string, the view is what is judged, and
for a redaction what is delivered (redacted): a secret cannot hide behind characters a model or
a person reads through.

Every pattern, built-in or from policy, is compiled with google-re2: matching is linear in the
text (no backtracking), so no policy regex can hang the proxy. Patterns RE2 cannot express
(look-around, back-references) or that match the empty string are policy load errors.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import codecs
import functools
import itertools
import logging
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from proxy.envelope.invisible import CHUNK, plain, visible
from proxy.envelope.types import Code, Decision, Verdict
from proxy.policy.vocab import BUILTIN_PATTERNS, DETECTOR_GROUPS, compile_pattern

log = logging.getLogger("envelope.guardrails")

CHECK_ID = "guardrails"
Action = Literal["redact", "block", "warn"]
ACTIONS: tuple[Action, ...] = ("redact", "block", "warn")

def engine_of(compiled: Any) -> str:
    """The module of a compiled pattern's type (`re2` for every guardrail program)."""
    return type(compiled).__module__.split(".", 1)[0]


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled guardrail rule (a `detector: secrets` entry expands to one per detector)."""

    id: str
    detector: str  # built-in detector name, or "pattern"
    action: Action
    regex: Any  # re2 program
    group: int  # the capture group replaced on redaction (0: the whole match)
    marker: str
    reason: str | None = None


def _rule(rule_id: str, detector: str, action: Action, pattern: str, label: str,
          reason: str | None) -> Rule:
    regex = compile_pattern(pattern)
    group = regex.groupindex.get("secret", 0)
    return Rule(rule_id, detector, action, regex, group, f"[REDACTED:{label}]", reason)


@functools.lru_cache(maxsize=1024)
def expand(spec: Any) -> tuple[Rule, ...]:
    """The compiled rules of one policy entry (`proxy.policy.model.Guardrail`, hashable)."""
    action: Action = spec.action
    if spec.pattern is not None:
        rule_id = spec.id or "pattern"
        return (_rule(rule_id, "pattern", action, spec.pattern, rule_id, spec.reason),)
    names = DETECTOR_GROUPS.get(spec.detector, (spec.detector,))
    return tuple(
        _rule(spec.id or name, name, action, BUILTIN_PATTERNS[name], name, spec.reason)
        for name in names
    )


def compiled(*specs: Iterable[Any]) -> tuple[Rule, ...]:
    """The compiled rules of policy entries (`proxy.policy.model.Guardrail`), in order (each
    entry compiled once: cached)."""
    return tuple(rule for group in specs for spec in group for rule in expand(spec))


def rules_for(revision: Any, qualified_name: str) -> tuple[Rule, ...]:
    """`defaults.guardrails` then the tool's own `guardrails`, compiled (cached per entry)."""
    tool = revision.tools.get(qualified_name)
    return compiled(revision.document.defaults.guardrails, tool.policy.guardrails if tool else ())


# -- scanning ------------------------------------------------------------------------------


def _spans(text: str, rule: Rule) -> Iterator[tuple[int, int]]:
    """The (start, end) of each non-empty part of `text` that `rule` replaces."""
    for m in rule.regex.finditer(text):
        start, end = m.span(rule.group)
        if start < 0:  # the group did not take part: replace the whole match
            start, end = m.span()
        if end > start:
            yield start, end


def _crossing(text: str, parts: list[str], rule: Rule) -> list[tuple[int, int]]:
    """The spans of `rule` in `text` (`parts` joined) that run from one part into another and
    overlap no match inside a single part (a secret whole in one block, whose match the next
    block's first letters would only lengthen, was found there)."""
    ends = list(itertools.accumulate(map(len, parts)))
    spans = [(start, end) for start, end in _spans(text, rule)
             if bisect.bisect_right(ends, start) != bisect.bisect_left(ends, end)]
    if not spans:
        return spans
    inside: list[tuple[int, int]] = []  # in order, not overlapping: their ends are sorted too
    for base, part in zip((0, *ends[:-1]), parts, strict=True):
        inside += ((base + start, base + end) for start, end in _spans(part, rule))
    stops = [end for _, end in inside]
    kept = []
    for start, end in spans:
        i = bisect.bisect_right(stops, start)  # the first match inside a part ending after `start`
        if i == len(inside) or inside[i][0] >= end:
            kept.append((start, end))
    return kept


def _redact(parts: list[str], rule: Rule, crossing: bool = False) -> tuple[list[str], int]:
    """`parts` read as one text (joined), each match of `rule` replaced (with `crossing`, only
    those that run from one part into another): the marker goes where a match starts, and what
    it covers of the following parts is removed. The parts come back as they came (the same
    objects) when nothing was replaced."""
    text = parts[0] if len(parts) == 1 else "".join(parts)
    spans = _crossing(text, parts, rule) if crossing else list(_spans(text, rule))
    if not spans:
        return parts, 0
    out: list[str] = []
    base = k = 0
    for part in parts:
        end = base + len(part)
        pieces: list[str] = []
        pos = base
        while k < len(spans) and spans[k][0] < end:
            start, stop = spans[k]
            if start >= base:  # the match starts in this part: its marker goes here
                pieces += (text[pos:start], rule.marker)
            pos = max(pos, min(stop, end))
            if stop > end:  # it goes on in the next part
                break
            k += 1
        pieces.append(text[pos:end])
        out.append("".join(pieces))
        base = end
    return out, len(spans)


def _count(text: str, rule: Rule) -> int:
    return sum(1 for _ in rule.regex.finditer(text))


# Folding takes one C call per this many characters (as `invisible.visible` removes invisible
# characters): each holds the GIL, so a scan in a worker thread hands the event loop back between
# them (10 MB of CJK text: NFKC ~40 ms in one call).
SKELETON_CHUNK = CHUNK


_ASCII = re.compile("[\x00-\x7f]")


def _nfkc(text: str) -> str:
    """`unicodedata.normalize("NFKC", text)`, a chunk of about SKELETON_CHUNK characters at a
    time, each cut just before an ASCII character: no character composes with an ASCII
    character that follows it, and an ASCII character starts its own sequence, so the chunks
    fold as the whole would (a text with no ASCII character past a cut is folded in one call)."""
    if len(text) <= SKELETON_CHUNK:
        return unicodedata.normalize("NFKC", text)
    folded: list[str] = []
    start = 0
    while start < len(text):
        cut = _ASCII.search(text, start + SKELETON_CHUNK)
        end = len(text) if cut is None else cut.start()
        folded.append(unicodedata.normalize("NFKC", text[start:end]))
        start = end
    return "".join(folded)


def skeleton(text: str) -> str:
    """`text` as a reader sees it: NFKC-folded, invisible characters removed (linear time, in
    chunks that each release the GIL)."""
    return visible(_nfkc(text))


class _Scan:
    def __init__(self, rules: tuple[Rule, ...]):
        self.rules = rules
        self.matches = [0] * len(rules)
        self.changed = False

    def _apply(self, parts: list[str], crossing: bool) -> tuple[list[str], list[int]]:
        out = parts
        counts = []
        for rule in self.rules:
            if rule.action == "redact":
                out, n = _redact(out, rule, crossing)
            elif crossing:  # block and warn judge what the upstream sent, before any redaction
                n = len(_crossing("".join(parts), parts, rule))
            else:
                n = _count(parts[0] if len(parts) == 1 else "".join(parts), rule)
            counts.append(n)
        return out, counts

    def text(self, text: str) -> str:
        """Count every rule on `text` (or on its `skeleton` when that matches more); return it
        with the redactions applied."""
        return self.joined([text])[0]

    def joined(self, parts: list[str], crossing: bool = False) -> list[str]:
        """`text` of `parts` read as one text (joined), with `crossing` only for the matches
        that run from one part into another (those inside one part were found by `text`): a
        redaction goes where the match starts and removes what it covers of the next parts."""
        out, counts = self._apply(parts, crossing)
        if not all(plain(part) for part in parts):
            seen = [skeleton(part) for part in parts]
            if any(a != b for a, b in zip(seen, parts, strict=True)):
                plain_out, plain_counts = self._apply(seen, crossing)
                hidden = [b > a for a, b in zip(counts, plain_counts, strict=True)]
                if any(hidden):
                    counts = plain_counts
                    # a hidden secret a rule redacts: deliver the reader's view, redacted
                    if any(h and r.action == "redact" for h, r in zip(hidden, self.rules, strict=True)):
                        out = plain_out
        for i, n in enumerate(counts):
            self.matches[i] += n
        if any(a is not b for a, b in zip(out, parts, strict=True)):
            self.changed = True
        return out


# The media types whose base64 bytes are text (decoded and scanned even when they are not valid
# UTF-8); bytes of any other type are scanned when they are valid UTF-8 (a binary image is not).
_TEXT_TYPES = re.compile(r"(?i)^\s*(?:text/|[\w.+-]+/(?:[\w.-]+\+)?(?:json|xml|yaml|x-yaml|javascript"
                         r"|ecmascript|x-sh|x-shellscript|toml|csv|x-www-form-urlencoded|sql|graphql"
                         r"|x-ndjson|jsonl|x-pem-file|x-httpd-php|x-python|x-sql)\b)")


def textual(mime: object) -> bool:
    """Whether a blob of media type `mime` is text (`text/*`, JSON, XML, YAML, scripts...)."""
    return isinstance(mime, str) and _TEXT_TYPES.match(mime) is not None


# Base64 characters decoded first to tell binary bytes from text: an image is not decoded whole
# to learn that it is not UTF-8 (64 KB of base64: ~0.25 ms saved).
SNIFF_CHARS = 4096


def _binary_head(value: str) -> bool:
    """Whether the first bytes of base64 `value` are not UTF-8 (a cut sequence at their end is
    not held against them); False when they cannot be decoded alone (the whole is tried)."""
    if len(value) <= SNIFF_CHARS:
        return False
    try:
        head = base64.b64decode(value[:SNIFF_CHARS], validate=True)
    except (binascii.Error, ValueError):
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return False


def _decoded(value: str, mime: object) -> str | None:
    """The text a base64 `value` carries, or None: not base64, or bytes that are not text (not
    of a `textual` type and not valid UTF-8). In bytes of a textual type that are not UTF-8 the
    invalid bytes read as U+FFFD (a redaction re-encodes them so)."""
    if not textual(mime) and _binary_head(value):
        return None
    try:
        data = base64.b64decode(value, validate=False)
    except (binascii.Error, ValueError):
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace") if textual(mime) else None


def _blob_key(node: dict[Any, Any]) -> str | None:
    """The member holding base64 bytes in a content block or resource contents: `data` of an
    image or audio block, `blob` of a resource."""
    if isinstance(node.get("blob"), str):
        return "blob"
    if node.get("type") in ("image", "audio") and isinstance(node.get("data"), str):
        return "data"
    return None


def _text_blocks(content: Any) -> list[dict[str, Any]]:
    """The text blocks of a result's `content`, in order."""
    if not isinstance(content, list):
        return []
    return [b for b in content
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)]


def scan_payload(payload: dict[str, Any] | list[Any], rules: tuple[Rule, ...]) -> Guarded:
    """Apply `rules` in place to every string of `payload` (values and object keys, at any
    depth, iteratively: no recursion limit): redactions rewrite it, block and warn only count.

    What an upstream sends is scanned whole, not only the fields a client usually shows: a
    secret in `_meta`, in an error's `data` or in an object key reaches the client all the same.
    The text blocks of a result's `content` are read as one text, in order (a model reads them
    so: a secret cut in two across blocks is one secret). Base64 bytes (`blob`, an image's or
    audio's `data`) that are text are also decoded and scanned; a redaction there re-encodes them.
    """
    scan = _Scan(rules)
    together: set[int] = set()  # the blocks whose `text` was scanned with the others
    if isinstance(payload, dict):
        blocks = _text_blocks(payload.get("content"))
        if len(blocks) > 1:
            texts = scan.joined([scan.text(block["text"]) for block in blocks], crossing=True)
            for block, text in zip(blocks, texts, strict=True):
                if text is not block["text"]:
                    block["text"] = text
            together = {id(block) for block in blocks}
    stack: list[Any] = [payload]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            renamed: list[tuple[str, str]] = []
            read = "text" if id(node) in together else None
            blob = _blob_key(node)
            if blob is not None:
                decoded = _decoded(node[blob], node.get("mimeType"))
                if decoded is not None:
                    clean = scan.text(decoded)
                    if clean is not decoded:
                        node[blob] = base64.b64encode(clean.encode()).decode("ascii")
            for key, value in node.items():
                if isinstance(value, str):
                    if key != read:
                        new = scan.text(value)
                        if new is not value:
                            node[key] = new
                elif isinstance(value, dict | list):
                    stack.append(value)
                if isinstance(key, str):
                    new_key = scan.text(key)
                    if new_key is not key:
                        renamed.append((key, new_key))
            for old, new in renamed:  # a redacted key keeps its value (the marker may repeat)
                node[new] = node.pop(old)
        else:
            for i, value in enumerate(node):
                if isinstance(value, str):
                    new = scan.text(value)
                    if new is not value:
                        node[i] = new
                elif isinstance(value, dict | list):
                    stack.append(value)
    fired = tuple(Fired(rule, n) for rule, n in zip(rules, scan.matches, strict=True) if n)
    blocking = next((f.rule for f in fired if f.rule.action == "block"), None)
    return Guarded(fired, scan.changed and blocking is None, blocking)


def payload_chars(payload: Any, bound: int) -> int:
    """The characters of every string and key of `payload` (a list or an object counts one),
    counted until past `bound`: a hostile reply's million strings are not walked on the event
    loop to learn they are many."""
    total = 0
    stack: list[Iterator[Any]] = [iter((payload,))]
    while stack and total <= bound:
        node = next(stack[-1], _END)
        if node is _END:
            stack.pop()
        elif isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            total += 1 + sum(len(k) for k in node if isinstance(k, str))
            stack.append(iter(node.values()))
        elif isinstance(node, list):
            total += 1
            stack.append(iter(node))
    return total


_END = object()


@dataclass(frozen=True, slots=True)
class Fired:
    """One rule that matched, and how often."""

    rule: Rule
    matches: int

    def as_audit(self) -> dict[str, Any]:
        """The audit record's view (never the matched text)."""
        return {"id": self.rule.id, "detector": self.rule.detector, "action": self.rule.action,
                "matches": self.matches}


@dataclass(frozen=True, slots=True)
class Guarded:
    """What the guardrails did to one payload: the rules that fired, whether it was rewritten
    (redactions; never when a rule blocks), and the first blocking rule (the payload is then
    withheld whole)."""

    fired: tuple[Fired, ...] = ()
    changed: bool = False
    blocking: Rule | None = None

    def refusal(self) -> Decision | None:
        """The `guardrail_blocked` decision that replaces the content, or None."""
        rule = self.blocking
        if rule is None:
            return None
        what = "a secret" if rule.detector != "pattern" else "a forbidden pattern"
        reason = rule.reason or f"the upstream's content contains {what} (guardrail {rule.id}); it was withheld"
        return Decision(Verdict.DENY, Code.GUARDRAIL_BLOCKED, CHECK_ID, reason, rule=rule.id)


UNCHANGED = Guarded()


class ScanTimeout(Exception):
    """A scan that did not end within its time (`limits.guardrail_scan_timeout`)."""


def failed(exc: Exception) -> Decision:
    """The refusal when the guardrails could not run (fail closed: the content is withheld)."""
    if isinstance(exc, ScanTimeout):
        return Decision(Verdict.ERROR, Code.INTERNAL_ERROR, CHECK_ID,
                        f"{exc}: the content could not be checked and was withheld")
    return Decision(Verdict.ERROR, Code.INTERNAL_ERROR, CHECK_ID,
                    f"the guardrails check failed ({type(exc).__name__}); the content was withheld")
