"""Output guardrails: scan a forwarded call's result before it reaches the agent (check 13).

A guardrail rule is either a built-in secret detector or a policy regular expression, with an
action:

- `redact`: every match is replaced by `[REDACTED:<detector or rule id>]`;
- `block`: the whole result is replaced by a `guardrail_blocked` refusal;
- `warn`: nothing changes, the match is audited and counted.

Scanned: `content[].text`, the `text` of embedded resources (`content[].resource.text`) and
every string of `structuredContent`, at any depth. Each rule that fires is recorded in the
call's audit record (`guardrails`: rule id, detector, action, number of matches; never the
matched text) and counted in `envelope_guardrail_actions_total{tool,action}`.

Every pattern, built-in or from policy, is compiled with google-re2: matching is linear in the
text (no backtracking), so no policy regex can hang the proxy. Patterns RE2 cannot express
(look-around, back-references) or that match the empty string are policy load errors.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

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


def rules_for(revision: Any, qualified_name: str) -> tuple[Rule, ...]:
    """`defaults.guardrails` then the tool's own `guardrails`, compiled (cached per entry)."""
    document = getattr(revision, "document", None)
    defaults = getattr(getattr(document, "defaults", None), "guardrails", None) or ()
    tool = revision.tools.get(qualified_name) if revision is not None else None
    own = getattr(getattr(tool, "policy", None), "guardrails", None) or ()
    if not defaults and not own:
        return ()
    out: list[Rule] = []
    for spec in (*defaults, *own):
        out.extend(expand(spec))
    return tuple(out)


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


def _strings(container: Any, scan: _Scan) -> None:
    """Scan every string value under `container` in place (iteratively: no recursion limit)."""
    stack: list[Any] = [container]
    while stack:
        node = stack.pop()
        items: Iterable[tuple[Any, Any]] = (
            node.items() if isinstance(node, dict) else enumerate(node)
        )
        for key, value in list(items):
            if isinstance(value, str):
                new = scan.text(value)
                if new is not value:
                    node[key] = new
            elif isinstance(value, dict | list):
                stack.append(value)


def scan_result(result: dict[str, Any], rules: tuple[Rule, ...]) -> tuple[list[int], bool]:
    """Apply `rules` to a tool result in place: per-rule match counts and whether it changed.

    Scanned: `content[].text`, `content[].resource.text`, every string of `structuredContent`.
    """
    scan = _Scan(rules)
    content = result.get("content")
    if isinstance(content, list):
        for item in content:
            if not isinstance(item, dict):
                continue
            text = item.get("text")
            if isinstance(text, str):
                new = scan.text(text)
                if new is not text:
                    item["text"] = new
            resource = item.get("resource")
            if isinstance(resource, dict) and isinstance(resource.get("text"), str):
                new = scan.text(resource["text"])
                if new is not resource["text"]:
                    resource["text"] = new
    structured = result.get("structuredContent")
    if isinstance(structured, str):
        new = scan.text(structured)
        if new is not structured:
            result["structuredContent"] = new
    elif isinstance(structured, dict | list):
        _strings(structured, scan)
    return scan.matches, scan.changed


@dataclass(frozen=True, slots=True)
class Guarded:
    """What the guardrails did to one reply."""

    changed: bool  # the reply was rewritten in place (redactions)
    decision: Decision | None = None  # a refusal replacing the result (block, or an error)


UNCHANGED = Guarded(False)


def guard_reply(pending: Any, reply: Mapping[str, Any], metrics: Any = None) -> Guarded:
    """Run the call's guardrails on the upstream's JSON-RPC `reply` (its `result` is rewritten
    in place when redacted). A `block` match, or a failure (fail closed), returns the decision
    that replaces the result. The actions go into `call.audit_extra["guardrails"]` and metrics.
    """
    chain = getattr(pending, "chain", None)
    result = reply.get("result") if isinstance(reply, Mapping) else None
    if chain is None or not isinstance(result, dict):
        return UNCHANGED
    call = pending.call
    try:
        rules = rules_for(chain.revision, call.qualified_name)
        if not rules:
            return UNCHANGED
        matches, changed = scan_result(result, rules)
    except Exception as exc:  # fail closed: a result that could not be checked is withheld
        log.error("guardrails failed on %s (decision %s)", call.qualified_name, call.decision_id,
                  exc_info=exc)
        if metrics is not None:
            metrics.check_error(CHECK_ID)
        return Guarded(False, Decision(
            Verdict.ERROR, Code.INTERNAL_ERROR, CHECK_ID,
            f"the guardrails check failed ({type(exc).__name__}); the result was withheld"))
    fired = [(rule, n) for rule, n in zip(rules, matches, strict=True) if n]
    if not fired:
        return UNCHANGED
    call.audit_extra["guardrails"] = [
        {"id": rule.id, "detector": rule.detector, "action": rule.action, "matches": n}
        for rule, n in fired
    ]
    blocking = next((rule for rule, _ in fired if rule.action == "block"), None)
    if metrics is not None:
        tool = chain.tool_label(call)
        for rule, _ in fired:
            if blocking is None or rule.action != "redact":  # a blocked result redacts nothing
                metrics.guardrail_action(tool, rule.action)
    if blocking is not None:
        what = "a secret" if blocking.detector != "pattern" else "a forbidden pattern"
        reason = blocking.reason or (
            f"the tool's result contains {what} (guardrail {blocking.id}); it was withheld")
        return Guarded(False, Decision(Verdict.DENY, Code.GUARDRAIL_BLOCKED, CHECK_ID, reason,
                                       rule=blocking.id))
    return Guarded(changed)
