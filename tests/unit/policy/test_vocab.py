"""The shared vocabulary: the one `Duration` type (here and in every policy duration field),
effects and RE2 patterns."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from proxy.errors import PolicyError
from proxy.policy.loader import load_policy
from proxy.policy.model import PolicyDocument
from proxy.policy.vocab import (
    BUILTIN_PATTERNS,
    DETECTOR_GROUPS,
    DETECTORS,
    Duration,
    Effect,
    PatternError,
    compile_pattern,
    did_you_mean,
    parse_duration,
)
from tests.duration_fields import duration_fields

Write = Callable[[str, str], Path]


class _Timed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    every: Duration = 1.0
    until: Duration | None = None


@pytest.mark.parametrize(("value", "seconds"), [
    (1.5, 1.5), (0, 0.0), (3, 3.0), ("250ms", 0.25), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
    ("1.5s", 1.5), (" 30s ", 30.0),
])
def test_duration_accepts(value: Any, seconds: float) -> None:
    assert parse_duration(value) == seconds
    parsed = _Timed.model_validate({"every": value, "until": value})
    assert (parsed.every, parsed.until) == (seconds, seconds)
    assert type(parsed.every) is float


@pytest.mark.parametrize(("value", "message"), [
    ("soon", "not a duration: 'soon' (use e.g. 250ms, 30s, 5m)"),
    ("30", "not a duration: '30'"),  # a unit-less string is not a duration
    ("-5s", "not a duration: '-5s'"),
    ("5d", "not a duration: '5d'"),
    (-1, "duration must not be negative"),
    (-0.5, "duration must not be negative"),
    (True, "not a duration: True"),
    ([1], "not a duration: [1]"),
])
def test_duration_refuses(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_duration(value)
    with pytest.raises(ValidationError) as info:
        _Timed.model_validate({"every": value})
    [error] = info.value.errors()
    assert error["loc"] == ("every",)
    assert message in error["msg"]


def test_optional_duration_keeps_none_and_defaults_are_untouched() -> None:
    assert _Timed.model_validate({"until": None}) == _Timed()
    assert (_Timed().every, _Timed().until) == (1.0, None)
    with pytest.raises(ValidationError):
        _Timed.model_validate({"every": None})


# -- every duration field of the policy ------------------------------------------------------

# The walk below must find exactly these; "*" is a dict key (an upstream or a tool).
POLICY_DURATIONS = [
    ("upstreams", "*", "timeout"),
    ("upstreams", "*", "connect_timeout"),
    ("upstreams", "*", "idle_timeout"),
    ("tools", "*", "approval", "wait"),
    ("tools", "*", "approval", "ttl"),
    ("dataflow", "ledger_ttl"),
]
KEYS = {"upstreams": "demo", "tools": "demo.t"}


def test_every_policy_duration_field_is_listed() -> None:
    assert sorted(duration_fields(PolicyDocument)) == sorted(POLICY_DURATIONS)


def _concrete(path: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(KEYS[path[i - 1]] if part == "*" else part for i, part in enumerate(path))


def _policy(write: Write, path: tuple[str, ...], value: Any) -> Path:
    """A policy file with `value` at `path`, beside a valid upstream and tool."""
    doc: dict[str, Any] = {
        "version": 1,
        "upstreams": {"demo": {"url": "http://127.0.0.1:9/mcp"}},
        "tools": {"demo.t": {"effect": "read", "approval": {"required": True}}},
    }
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return write("policy.yaml", json.dumps(doc, indent=2))  # JSON is YAML


def _read(document: PolicyDocument, path: tuple[str, ...]) -> Any:
    node: Any = document
    for key in path:
        node = node[key] if isinstance(node, dict) else getattr(node, key)
    return node


@pytest.mark.parametrize("path", POLICY_DURATIONS, ids=".".join)
@pytest.mark.parametrize(("value", "seconds"), [("250ms", 0.25), ("30s", 30.0), (2, 2.0),
                                                (1.5, 1.5)])
def test_policy_duration_accepts(write: Write, path: tuple[str, ...], value: Any,
                                 seconds: float) -> None:
    file = _policy(write, _concrete(path), value)
    revision = load_policy(file.parent)
    assert _read(revision.document, _concrete(path)) == seconds


@pytest.mark.parametrize("path", POLICY_DURATIONS, ids=".".join)
@pytest.mark.parametrize(("value", "message"), [
    ("soon", "not a duration: 'soon' (use e.g. 250ms, 30s, 5m)"),
    (-1, "duration must not be negative"),
])
def test_policy_duration_refuses_at_its_place(write: Write, path: tuple[str, ...], value: Any,
                                              message: str) -> None:
    concrete = _concrete(path)
    file = _policy(write, concrete, value)
    with pytest.raises(PolicyError) as info:
        load_policy(file.parent)
    [problem] = info.value.problems
    line = next(n for n, text in enumerate(file.read_text().splitlines(), 1)
                if text.strip().startswith(f'"{concrete[-1]}"'))
    assert (problem.file, problem.line) == (str(file), line)
    assert problem.message == f"{'.'.join(concrete)}: {message}"


def test_policy_duration_defaults() -> None:
    doc = PolicyDocument.model_validate({
        "upstreams": {"demo": {"url": "http://127.0.0.1:9/mcp"}},
        "tools": {"demo.t": {"approval": {}}}, "dataflow": {},
    })
    up, approval = doc.upstreams["demo"], doc.tools["demo.t"].approval
    assert (up.timeout, up.connect_timeout) == (30.0, 5.0)
    assert approval is not None and (approval.wait, approval.ttl) == (30.0, None)
    assert doc.dataflow is not None and doc.dataflow.ledger_ttl == 86400.0


# -- effects and patterns --------------------------------------------------------------------


def test_effects_in_order_of_consequence() -> None:
    assert [e.value for e in Effect] == ["read", "write", "external", "destructive"]


def test_detectors_name_every_builtin_and_group() -> None:
    assert DETECTORS == (*BUILTIN_PATTERNS, *DETECTOR_GROUPS)
    assert DETECTOR_GROUPS["secrets"] == tuple(BUILTIN_PATTERNS)
    for pattern in BUILTIN_PATTERNS.values():
        assert type(compile_pattern(pattern)).__module__.split(".")[0] == "re2"


@pytest.mark.parametrize(("pattern", "message"), [
    ("(?<=a)b", "not a valid RE2 pattern"),  # look-behind
    (r"(a)\1", "not a valid RE2 pattern"),  # back-reference
    ("a*", "the pattern matches the empty string"),
])
def test_compile_pattern_refuses(pattern: str, message: str) -> None:
    with pytest.raises(PatternError, match=message):
        compile_pattern(pattern)


def test_did_you_mean_names_a_near_miss_and_nothing_else() -> None:
    fields = ("effect", "rules", "fallback", "log_args", "guardrails")
    assert did_you_mean("efect", fields) == " (did you mean 'effect'?)"
    assert did_you_mean("Effect", fields) == " (did you mean 'effect'?)"
    assert did_you_mean("log-args", fields) == " (did you mean 'log_args'?)"
    assert did_you_mean("gaurdrails", fields) == " (did you mean 'guardrails'?)"
    assert did_you_mean("colour", fields) == ""
    assert did_you_mean("rules", fields) == ""  # a known name is not a miss
