"""A rule group proven by one joined compile (`Engine.compile_group`) must change nothing a user
sees: every source it accepts compiles alone, a broken policy is reported exactly as when each
rule compiled alone, a call is decided exactly as with eager programs, and a single program
that cannot compile when first needed refuses the call."""

from __future__ import annotations

import datetime as dt
import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.envelope.checks.arg_rules import ArgRulesCheck
from proxy.envelope.checks.authz import AuthzCheck
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Principal, RequestInfo, RunContext, ToolCall
from proxy.errors import CelCompileError, CelEvalError, PolicyError
from proxy.policy import cel
from proxy.policy.compiled import PolicyRevision
from proxy.policy.loader import load_policy

ROOT = Path(__file__).resolve().parents[3]
NOW = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)

pytestmark = pytest.mark.skipif(
    "cel-cpp" not in cel.available_engines(), reason="cel-cpp is not installed"
)


def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every source compiled alone, as before groups were proven."""
    monkeypatch.setattr(cel.CppEngine, "compile_group", lambda self, sources: None)


# --- Soundness: what a group accepts compiles alone ---------------------------------------------

# Pieces of CEL, well- and ill-formed, that glue into sources whose tokens may run into a
# neighbour's: open brackets, unclosed and triple-quoted literals, raw and bytes prefixes,
# comments, quotes right after names.
FRAGMENTS = [
    "args.a", "args.b", " == ", " || ", " && ", "1", "2u", "true", "(", ")", "[", "]", "{", "}",
    '"x"', "'y'", '"', "'", '"""', "'''", 'r"\\"', "r'", 'b"z"', "br'", "//c", "\n", ",", ":",
    " in ", "size(", 'args.a.matches("^a+$")', "matches(args.a, '[')", "!", "x", "\\", "`",
    'envelope_re_search(args.a, "a")', "has(args.a)", ".startsWith(", "r", "b",
]
sources = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=8).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(sources, min_size=2, max_size=3))
@example(["true) || (false", "true"])
@example(["args.a == 1", "true) || (false"])
@example(['"""a', 'b""" == "c"'])
@example(["args.a == 1 // (", "true"])
@example(['envelope_re_search(args.a, "a")', "true"])
@example(['r"\\" == "a"', "true"])
def test_a_group_accepts_only_sources_that_compile_alone(group: list[str]) -> None:
    engine = cel.get_engine("cel-cpp")
    programs = engine.compile_group(group)
    if programs is None:
        return
    for src, program in zip(group, programs, strict=True):
        assert program.source == src
        engine.compile(src)  # raises CelCompileError if the group was wrong


def test_well_formed_groups_are_proven_and_crossings_are_not() -> None:
    engine = cel.get_engine("cel-cpp")
    assert engine.compile_group(['args.a == "x)"', "[1, 2][0] == 1", 'r"a\\d" == "b" // (']) is not None
    for group in (["true) || (false", "true"], ['"""a', 'b""" == "c"'], ["args.a == (1", "2)"],
                  ["args.a ==", "true"], ['args.a.matches("[")', "true"], ["1", "true"]):
        assert engine.compile_group(group) is None, group


# --- `matches` literals read without cel-cpp ----------------------------------------------------

literal_bodies = st.lists(
    st.sampled_from([*"ab.*+?()[]{}^$|-_ \t'\"`", "\\\\", "\\n", "\\t", "\\x41", "\\101",
                     "\\u00e9", "\\U0001F600", "\\xff", "\\?", "\\`", "é", "\\"]),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(['"', "'", '"""', "'''", 'r"', "r'", 'R"""', "b'"]), literal_bodies)
@example('"', "(?i)(password|api[_-]?key)\\\\s*[:=]")
def test_literals_read_as_cel_cpp_reads_them(opening: str, body: str) -> None:
    quote = opening.lstrip("rRbB")
    literal = opening + body + quote
    engine = cel.get_engine("cel-cpp")
    try:
        expected: Any = engine._env.compile(literal).eval().value()  # type: ignore[attr-defined]
    except Exception:
        expected = "invalid"
    value = cel._string_value(literal)
    if value is not None:  # None: left to cel-cpp
        assert value == expected


# --- A broken policy reads as before ------------------------------------------------------------

BROKEN = """
version: 1
upstreams:
  demo: {url: "http://127.0.0.1:9/mcp"}
tools:
  demo.ok:
    allow: ['principal.id == "a"', 'principal.id == "b"']
    rules:
      - {forbid: 'args.a == 1'}
      - {forbid: 'args.b.matches("^b+$")'}
  demo.crossing:
    rules:
      - {forbid: 'args.a == 1'}
      - {forbid: 'true) || (false'}
      - {forbid: 'args.b == 2'}
  demo.triple:
    rules:
      - forbid: |
          args.a == \"\"\"x
      - forbid: |
          y\"\"\" == args.b
  demo.typed:
    allow: ['principal.id == "a"', 'principal.id + 1']
    rules:
      - {allow: 'args.a == 1'}
      - {allow: 'size(args.a) + "x" == 2'}
      - {allow: 'args.a.matches("[")'}
      - {allow: 'principal.grups == 1'}
      - {allow: 'nope == 1'}
      - {allow: '1'}
"""


def problems(tmp_path: Path, engine: cel.Engine) -> list[str]:
    directory = tmp_path / "policy"
    directory.mkdir(exist_ok=True)
    (directory / "p.yaml").write_text(textwrap.dedent(BROKEN), encoding="utf-8")
    with pytest.raises(PolicyError) as exc:
        load_policy(directory, engine=engine)
    return [str(p) for p in exc.value.problems]


def test_broken_rules_are_reported_as_when_each_compiled_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grouped = problems(tmp_path, cel.get_engine("cel-cpp"))
    with monkeypatch.context() as m:
        eager(m)
        alone = problems(tmp_path, cel.get_engine("cel-cpp"))
    assert grouped == alone
    where = {p.split(": ", 1)[0].rsplit("/", 1)[-1] for p in grouped}
    # `true) || (false` at its `)`, and both rules of the open triple-quoted literal.
    assert {"p.yaml:14:23", "p.yaml:19:23", "p.yaml:21:12"} <= where
    assert len(grouped) == 9


def test_broken_rules_read_the_same_when_groups_compile_in_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The workers compile what they can; every group they cannot is compiled here, rule by
    # rule, and reported with its file:line:column exactly as without them.
    here = problems(tmp_path, cel.get_engine("cel-cpp"))
    kept = in_workers(monkeypatch)
    assert problems(tmp_path, cel.get_engine("cel-cpp")) == here
    assert kept == [2]  # demo.ok's allow list and forbid rules; the broken groups were not kept


SINGLES = """
version: 1
upstreams:
  demo: {url: "http://127.0.0.1:9/mcp"}
tools:
  demo.int:
    allow: ['size(args.a) + 1']
  demo.ok:
    allow: ['args.a == "x"']
    rules:
      - {forbid: 'args.b.matches("^b+$")'}
  demo.pattern:
    rules:
      - {forbid: 'args.b.matches("[")'}
"""


def test_single_expressions_compiled_in_workers_read_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "policy"
    directory.mkdir()
    (directory / "p.yaml").write_text(SINGLES, encoding="utf-8")

    def load() -> list[str]:
        with pytest.raises(PolicyError) as exc:
            load_policy(directory, engine=cel.get_engine("cel-cpp"))
        return [str(p).rsplit("/", 1)[-1] for p in exc.value.problems]

    here = load()
    kept = in_workers(monkeypatch)
    assert load() == here
    assert kept == [2]  # demo.ok's two; an int is not kept, a bad pattern never sent
    assert here == [
        "p.yaml:7:14: CEL: expression must be a bool, it is int",
        "p.yaml:14:34: CEL: invalid regular expression \"[\": missing ]: [",
    ]


# --- Calls decide as with eager programs --------------------------------------------------------


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("policy_load", ROOT / "bench" / "policy_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLS = 6


def in_workers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every group `precompile` may send goes to worker processes, whatever the machine; the
    returned list receives the number of groups each load kept from them."""
    monkeypatch.setattr(cel, "PRECOMPILE_MIN_GROUPS", 1)
    monkeypatch.setattr(cel, "_spare_cores", lambda: 1)
    kept: list[int] = []
    finish = cel._Collect.finish

    def counted(self: Any) -> int:
        kept.append(finish(self))
        return kept[-1]

    monkeypatch.setattr(cel._Collect, "finish", counted)
    return kept


@pytest.fixture(scope="module")
def revisions(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[PolicyRevision, PolicyRevision, PolicyRevision]:
    """The bench generator's policy loaded with groups proven here, with every rule alone, and
    with the groups compiled in worker processes."""
    directory = tmp_path_factory.mktemp("bench-policy")
    _bench().write_policy(directory, TOOLS, 15)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cel, "PRECOMPILE_MIN_GROUPS", 10**9)
        grouped = load_policy(directory, engine=cel.get_engine("cel-cpp"))
    with pytest.MonkeyPatch.context() as m:
        eager(m)
        m.setattr(cel, "PRECOMPILE_MIN_GROUPS", 10**9)
        alone = load_policy(directory, engine=cel.get_engine("cel-cpp"))
    with pytest.MonkeyPatch.context() as m:
        kept = in_workers(m)
        precompiled = load_policy(directory, engine=cel.get_engine("cel-cpp"))
    assert kept == [3 * TOOLS]  # each tool's forbid and allow groups and its `allow` expression
    return grouped, alone, precompiled


def verdicts(revision: PolicyRevision, call: ToolCall) -> list[str]:
    registry = ToolRegistry()
    out = []
    for check in (AuthzCheck(revision, registry), ArgRulesCheck(revision, registry)):
        decision = check.decide(call)
        out.append("continue" if decision is None else f"{decision.code} {decision.rule} {decision.reason}")
    return out


words = st.sampled_from(["corp/secret-1", "corp/docs-2", "oss/x", "corp/vault3", "corp/hr-4",
                         "design5/abc", "x-archive-1", "password1 = 2", "api_key: x", "ghp_3",
                         "a@1b.io", "corp/payroll", "", "q"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(
    tool=st.integers(0, TOOLS - 1),
    principal=st.sampled_from(["bench-agent", "other", "blocked-2"]),
    repo=st.one_of(words, words.map(lambda w: w + "3")),
    query=st.one_of(words, st.text(max_size=130)),
    labels=st.one_of(st.none(), st.lists(st.sampled_from(["embargoed-1", "a", "embargoed-4"]),
                                         max_size=12)),
    limit=st.one_of(st.none(), st.integers(-5, 400)),
)
def test_calls_decide_as_with_every_rule_compiled_alone(
    revisions: tuple[PolicyRevision, PolicyRevision, PolicyRevision], tool: int, principal: str, repo: str,
    query: str, labels: list[str] | None, limit: int | None,
) -> None:
    args: dict[str, Any] = {"repo": repo, "query": query}
    if labels is not None:
        args["labels"] = labels
    if limit is not None:
        args["limit"] = limit
    call = ToolCall(
        decision_id="d-1", upstream="bench", tool=f"tool_{tool}", arguments=args,
        principal=Principal(principal), run=RunContext("run-1", principal),
        request=RequestInfo("tools/call"),
    )
    grouped, alone, precompiled = revisions
    assert verdicts(grouped, call) == verdicts(alone, call) == verdicts(precompiled, call)


# --- Fail closed --------------------------------------------------------------------------------


def test_a_single_program_that_cannot_compile_refuses_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Impossible once the group proved it; should it happen anyway, the forbid rule refuses.
    directory = tmp_path / "policy"
    directory.mkdir()
    (directory / "p.yaml").write_text(textwrap.dedent("""
        version: 1
        upstreams:
          demo: {url: "http://127.0.0.1:9/mcp"}
        tools:
          demo.t:
            rules:
              - {id: first, forbid: 'args.a == 1'}
              - {id: second, forbid: 'args.b == 2'}
        """), encoding="utf-8")
    revision = load_policy(directory, engine=cel.get_engine("cel-cpp"))

    def broken(self: Any, expr: str) -> Any:
        raise CelCompileError("simulated", 0)

    monkeypatch.setattr(cel.CppEngine, "compile", broken)
    program = revision.tools["demo.t"].rules[0].program
    with pytest.raises(CelEvalError, match="does not compile: simulated"):
        program.evaluate(revision.cel.activation({"args": {"a": 1}}))
    call = ToolCall(
        decision_id="d-1", upstream="demo", tool="t", arguments={"a": 0, "b": 2},
        principal=Principal("p"), run=RunContext("run-1", "p"), request=RequestInfo("tools/call"),
    )
    decision = ArgRulesCheck(revision, ToolRegistry()).decide(call)
    assert decision is not None and decision.code == "capability_blocked"
    assert decision.rule == "first" and "does not compile: simulated" in decision.reason


# --- Workers that fail change nothing but the time ------------------------------------------------

_COUNT_FRAMES = (
    "import sys\n"
    "d = sys.stdin.buffer.read(); n = i = 0\n"
    "while i < len(d):\n"
    "    i += 4 + int.from_bytes(d[i:i + 4], 'little'); n += 1\n"
)


@pytest.mark.parametrize("script", [
    "import sys; sys.stdin.buffer.read(); sys.exit(3)",  # dies
    "import sys; sys.stdin.buffer.read(); sys.stdout.buffer.write(b'\\x07\\0\\0\\0garbage')",
    _COUNT_FRAMES + "sys.stdout.buffer.write(b'\\x07\\0\\0\\0garbage' * n)",  # not programs
    _COUNT_FRAMES + "sys.stdout.buffer.write(b'\\0\\0\\0\\0' * n)",  # "does not compile"
    "import time; time.sleep(60)",  # hangs: stopped at PRECOMPILE_TIMEOUT
], ids=["exits", "short", "garbage", "empty", "hangs"])
def test_a_failing_worker_leaves_the_groups_to_compile_here(
    revisions: tuple[PolicyRevision, PolicyRevision, PolicyRevision], script: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = tmp_path / "policy"
    directory.mkdir()
    _bench().write_policy(directory, TOOLS, 15)
    kept = in_workers(monkeypatch)
    monkeypatch.setattr(cel, "_worker_command", lambda: [sys.executable, "-c", script])
    monkeypatch.setattr(cel, "PRECOMPILE_TIMEOUT", 1.0)
    revision = load_policy(directory, engine=cel.get_engine("cel-cpp"))
    assert kept == [0]
    grouped = revisions[0]
    for tool, repo, query in [(0, "corp/secret-0x0x0", "q"), (1, "corp/docs-1x0x0", "q"),
                              (2, "oss/a", "password2x0x0 = 1"), (3, "design3x0x0/abc", "q"),
                              (4, "corp/x", "q"), (5, "other/x", "")]:
        call = ToolCall(
            decision_id="d-1", upstream="bench", tool=f"tool_{tool}",
            arguments={"repo": repo, "query": query}, principal=Principal("bench-agent"),
            run=RunContext("run-1", "bench-agent"), request=RequestInfo("tools/call"),
        )
        assert verdicts(revision, call) == verdicts(grouped, call)


def test_workers_start_only_for_many_groups_and_with_a_core_to_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    groups = [[f"args.a == {i}", f"args.b == {i}"] for i in range(3)]
    engine = cel.get_engine("cel-cpp")
    assert cel.PRECOMPILE_MIN_GROUPS > len(groups)
    assert not engine.precompile(groups).started  # a reload that changed a few tools
    monkeypatch.setattr(cel, "PRECOMPILE_MIN_GROUPS", 1)
    monkeypatch.setattr(cel, "_spare_cores", lambda: 0)
    assert not engine.precompile(groups).started  # one core: nothing to share it with
    monkeypatch.setattr(cel, "_spare_cores", lambda: 1)
    job = engine.precompile(groups)
    assert job.started and job.finish() == 3
    assert not engine.precompile(groups).started  # compiled: nothing left to send
