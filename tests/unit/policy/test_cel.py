"""The CEL seam's engine choice: explicit, made by the caller, no environment and no cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.errors import CelCompileError, PolicyError
from proxy.policy.cel import available_engines, get_engine
from proxy.policy.loader import load_policy

Write = Callable[[str, str], Path]

POLICY = """
version: 1
upstreams: {demo: {url: "http://127.0.0.1:9/mcp"}}
tools:
  demo.t: {effect: write, allow: 'principal.id == "ops"'}
"""


def test_get_engine_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVELOPE_CEL_ENGINE", "no-such-engine")
    assert get_engine().name == available_engines()[0]  # auto: cel-cpp where it is installed
    assert get_engine("auto").name == available_engines()[0]


def test_every_call_builds_a_new_engine(engine: str) -> None:
    first, second = get_engine(engine), get_engine(engine)
    assert first.name == second.name == engine
    assert first is not second  # nothing is kept between callers


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(CelCompileError, match="unknown CEL engine 'fast' "):
        get_engine("fast")


def test_a_revision_carries_the_engine_it_was_compiled_with(write: Write, engine: str) -> None:
    directory = write("policy.yaml", POLICY).parent
    kept = get_engine(engine)
    first, second = load_policy(directory, kept), load_policy(directory, kept)
    assert first.cel is kept and second.cel is kept and first.engine == engine
    by_name = load_policy(directory, engine)
    assert by_name.engine == engine and by_name.cel is not kept


def test_an_unknown_engine_name_is_a_policy_problem(write: Write) -> None:
    directory = write("policy.yaml", POLICY).parent
    with pytest.raises(PolicyError) as info:
        load_policy(directory, "fast")
    [problem] = info.value.problems
    assert (problem.file, problem.line) == (str(directory), 1)
    assert problem.message.startswith("unknown CEL engine 'fast'")
