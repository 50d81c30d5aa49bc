"""Output guardrails: scan what an upstream sends before it reaches the client.

A guardrail rule is either a built-in secret detector or a policy regular expression, with an
action:

- `redact`: every match is replaced by `[REDACTED:<detector or rule id>]`;
- `block`: the whole result is replaced by a `guardrail_blocked` refusal;
- `warn`: nothing changes, the match is audited and counted.

Scanned (by `proxy.envelope.inspect`, the one inspection seam): every string and object key
of every message an upstream sends toward the client: tool results (`content`,
`structuredContent`, `_meta`), JSON-RPC error replies, task results and status, resource
contents, prompt messages, and server-to-client requests and notifications in a stream. Each
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

import functools
import logging
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from proxy.envelope.invisible import visible
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


def _redact(text: str, rule: Rule) -> tuple[str, int]:
    pieces: list[str] = []
    last = 0
    count = 0
    for m in rule.regex.finditer(text):
        start, end = m.span(rule.group)
        if start < 0:  # the group did not take part: replace the whole match
            start, end = m.span()
        if end <= start:
            continue
        pieces.append(text[last:start])
        pieces.append(rule.marker)
        last = end
        count += 1
    if not count:
        return text, 0
    pieces.append(text[last:])
    return "".join(pieces), count


def _count(text: str, rule: Rule) -> int:
    return sum(1 for _ in rule.regex.finditer(text))


def skeleton(text: str) -> str:
    """`text` as a reader sees it: NFKC-folded, invisible characters removed (linear time)."""
    return visible(unicodedata.normalize("NFKC", text))


class _Scan:
    def __init__(self, rules: tuple[Rule, ...]):
        self.rules = rules
        self.matches = [0] * len(rules)
        self.changed = False

    def _apply(self, text: str) -> tuple[str, list[int]]:
        out = text
        counts = []
        for rule in self.rules:
            if rule.action == "redact":
                out, n = _redact(out, rule)
            else:  # block and warn judge what the upstream sent, before any redaction
                n = _count(text, rule)
            counts.append(n)
        return out, counts

    def text(self, text: str) -> str:
        """Count every rule on `text` (or on its `skeleton` when that matches more); return it
        with the redactions applied."""
        out, counts = self._apply(text)
        if not text.isascii():
            plain = skeleton(text)
            if plain != text:
                plain_out, plain_counts = self._apply(plain)
                hidden = [b > a for a, b in zip(counts, plain_counts, strict=True)]
                if any(hidden):
                    counts = plain_counts
                    # a hidden secret a rule redacts: deliver the reader's view, redacted
                    if any(h and r.action == "redact" for h, r in zip(hidden, self.rules, strict=True)):
                        out = plain_out
        for i, n in enumerate(counts):
            self.matches[i] += n
        if out is not text:
            self.changed = True
        return out


def scan_payload(payload: dict[str, Any] | list[Any], rules: tuple[Rule, ...]) -> Guarded:
    """Apply `rules` in place to every string of `payload` (values and object keys, at any
    depth, iteratively: no recursion limit): redactions rewrite it, block and warn only count.

    What an upstream sends is scanned whole, not only the fields a client usually shows: a
    secret in `_meta`, in an error's `data` or in an object key reaches the client all the same.
    """
    scan = _Scan(rules)
    stack: list[Any] = [payload]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            renamed: list[tuple[str, str]] = []
            for key, value in node.items():
                if isinstance(value, str):
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


def failed(exc: Exception) -> Decision:
    """The refusal when the guardrails could not run (fail closed: the content is withheld)."""
    return Decision(Verdict.ERROR, Code.INTERNAL_ERROR, CHECK_ID,
                    f"the guardrails check failed ({type(exc).__name__}); the content was withheld")
