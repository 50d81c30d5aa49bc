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

Every pattern, built-in or from policy, is compiled with google-re2: matching is linear in the
text (no backtracking), so no policy regex can hang the proxy. Patterns RE2 cannot express
(look-around, back-references) or that match the empty string are policy load errors.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import re2

from proxy.envelope.types import Code, Decision, Verdict

log = logging.getLogger("envelope.guardrails")

CHECK_ID = "guardrails"
Action = Literal["redact", "block", "warn"]
ACTIONS: tuple[Action, ...] = ("redact", "block", "warn")

# Built-in detectors: name -> RE2 pattern. When the pattern has a group named `secret`, only
# that group is replaced on redaction (the context that found it, "api_key=", stays readable).
BUILTIN_PATTERNS: dict[str, str] = {
    # AWS access key ids: AKIA (long-term), ASIA (temporary), plus the rarer prefixes.
    "aws_access_key_id": r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b",
    # AWS secret access keys, found by their context (40 base64 characters after a name like
    # aws_secret_access_key, SecretAccessKey, "secret key").
    "aws_secret_access_key": (
        r"(?i)(?:aws[_ .-]?)?secret[_ .-]?(?:access[_ .-]?)?key(?:[_ .-]?id)?[\"']?\s*(?:[:=]|is)\s*[\"']?"
        r"(?P<secret>[A-Za-z0-9/+]{40})(?:[^A-Za-z0-9/+]|$)"
    ),
    # PEM private keys (RSA, EC, OPENSSH, ENCRYPTED, PGP...): the whole block, or up to the end
    # of the text when it was cut off.
    "private_key": (
        r"-----BEGIN[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"(?:-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----|\z)"
    ),
    # JSON Web Tokens (header.payload.signature, both JSON parts base64url of "{...").
    "jwt": r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*",
    # Bearer tokens in an Authorization header or prose ("Bearer abc...").
    "bearer_token": r"(?i)\bbearer\s+(?P<secret>[A-Za-z0-9._~+/-]{16,}=*)",
    # GitHub tokens: classic (ghp_, gho_, ghu_, ghs_, ghr_) and fine-grained (github_pat_).
    "github_token": r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b",
    # Slack tokens: bot, app, user, refresh.
    "slack_token": r"\bxox[abpr]-[A-Za-z0-9-]{10,}",
    # Generic credentials in key=value / "key": "value" form.
    "generic_api_key": (
        r"(?i)\b(?:api[_-]?key|apikey|api[_-]?secret|api[_-]?token|access[_-]?token|auth[_-]?token"
        r"|client[_-]?secret)[\"']?\s*[:=]\s*[\"']?(?P<secret>[A-Za-z0-9_\-./+=]{8,})"
    ),
}
# Names that stand for several detectors in policy (`detector: secrets`).
DETECTOR_GROUPS: dict[str, tuple[str, ...]] = {"secrets": tuple(BUILTIN_PATTERNS)}
DETECTORS: tuple[str, ...] = (*BUILTIN_PATTERNS, *DETECTOR_GROUPS)


class PatternError(ValueError):
    """A guardrail pattern RE2 rejects (or that matches the empty string)."""


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # the error is reported as a policy problem, not on stderr
    return options


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> Any:
    """The RE2 program of `pattern` (cached). Raises PatternError when RE2 rejects it (look-
    around, back-references, bad syntax) or when it matches the empty string (it would fire on
    every string and redact nothing)."""
    try:
        compiled = re2.compile(pattern, _options())
    except re2.error as exc:
        detail = exc.args[0] if exc.args else exc
        if isinstance(detail, bytes):
            detail = detail.decode("utf-8", "replace")
        raise PatternError(f"not a valid RE2 pattern: {detail}") from None
    if compiled.search("") is not None:
        raise PatternError("the pattern matches the empty string")
    return compiled


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


class _Scan:
    def __init__(self, rules: tuple[Rule, ...]):
        self.rules = rules
        self.matches = [0] * len(rules)
        self.changed = False

    def text(self, text: str) -> str:
        """Count every rule on `text`; return it with the redactions applied."""
        out = text
        for i, rule in enumerate(self.rules):
            if rule.action == "redact":
                out, n = _redact(out, rule)
            else:  # block and warn judge what the upstream sent, before any redaction
                n = _count(text, rule)
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
