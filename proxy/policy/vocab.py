"""The vocabulary the policy language shares with the envelope: effects, durations, patterns.

Both sides import these names from here, so the policy package never imports the envelope
(the envelope depends on policy, not the other way round). `compile_pattern` memoizes by
pattern text (bounded); that saves recompilation and changes no result.
"""

from __future__ import annotations

import difflib
import enum
import functools
import re
from collections.abc import Iterable
from typing import Annotated, Any

import re2
from pydantic import BeforeValidator

# -- effects -------------------------------------------------------------------------------


class Effect(enum.StrEnum):
    """What a tool does to the world, from least to most consequential."""

    READ = "read"
    WRITE = "write"
    EXTERNAL = "external"
    DESTRUCTIVE = "destructive"


# -- durations -----------------------------------------------------------------------------

DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | float | int) -> float:
    """Seconds from `1.5`, `250ms`, `30s`, `5m`, `1h`; ValueError otherwise (negative numbers,
    booleans, unit-less strings and anything else)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("duration must not be negative")
        return float(value)
    if isinstance(value, str):
        m = DURATION.match(value.strip())
        if m:
            return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    raise ValueError(f"not a duration: {value!r} (use e.g. 250ms, 30s, 5m)")


def _duration(value: Any) -> float:
    # Runs before pydantic's float parsing, so a unit-less string ("30") stays an error as it
    # always was: YAML and JSON numbers arrive as numbers.
    return parse_duration(value)


# A duration field of the config or the policy, in seconds (the error names the field).
# `Duration | None` keeps None as None.
Duration = Annotated[float, BeforeValidator(_duration)]


# -- patterns (RE2) ------------------------------------------------------------------------

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


def re2_options() -> Any:
    """RE2's default options, except that a pattern it rejects is not also logged to stderr:
    the error is reported as a policy problem (file:line:column), and in `serve` a plain-text
    line would sit among the JSON log lines."""
    options = re2.Options()
    options.log_errors = False
    return options


def re2_reason(exc: Exception) -> str:
    """RE2's message for a pattern it rejected (google-re2 gives it as bytes)."""
    detail = exc.args[0] if len(exc.args) == 1 else str(exc)
    return detail.decode("utf-8", "replace") if isinstance(detail, bytes) else str(detail)


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> Any:
    """The RE2 program of `pattern` (cached). Raises PatternError when RE2 rejects it (look-
    around, back-references, bad syntax) or when it matches the empty string (it would fire on
    every string and redact nothing)."""
    try:
        compiled = re2.compile(pattern, re2_options())
    except re2.error as exc:
        raise PatternError(f"not a valid RE2 pattern: {re2_reason(exc)}") from None
    if compiled.search("") is not None:
        raise PatternError("the pattern matches the empty string")
    return compiled


# -- names -----------------------------------------------------------------------------------


def near_miss(word: str, choices: Iterable[str]) -> str | None:
    """The one of `choices` that `word` is a near miss of (a typo, another case, a swapped pair
    of letters), else None; never `word` itself."""
    folded = {c.lower(): c for c in choices}
    near = folded.get(word.lower())
    if near is None:
        matches = difflib.get_close_matches(word.lower(), list(folded), n=1, cutoff=0.75)
        near = folded[matches[0]] if matches else None
    return near if near != word else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` when one of `choices` is a near miss of `word`, else "": appended
    to a problem naming an unknown key, field or variable."""
    near = near_miss(word, choices)
    return f" (did you mean '{near}'?)" if near is not None else ""
