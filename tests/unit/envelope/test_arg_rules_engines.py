"""The argument rules decide the same on cel-cpp and cel-python, whatever the rule text.

cel-cpp evaluates a rule group as one joined `||` program, cel-python rule by rule: a rule's
text (a trailing `// comment`, a string holding `//`, `)` or quotes, newlines) must never change
what another rule means. Random rule sets are decided on both engines and must agree on the
verdict and on the deciding rule.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from envelope_helpers import UPSTREAMS, build_revision, make_call
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.envelope.checks.arg_rules import ArgRulesCheck
from proxy.envelope.checks.catalogue import CatalogueCheck
from proxy.envelope.tools import ToolRegistry
from proxy.errors import CelCompileError
from proxy.policy.cel import available_engines
from proxy.tools.policy_tests import run_tests

ENGINES = ("cel-cpp", "cel-python")
PACK = Path(__file__).resolve().parents[3] / "policies"

pytestmark = pytest.mark.skipif(
    any(e not in available_engines() for e in ENGINES), reason="both CEL engines are needed"
)


def verdicts(
    engine: str, rules: list[dict[str, str]], fallback: str, calls: list[dict[str, Any]]
) -> list[str]:
    """Per call: `allow`, `<code> <rule id>`; or `compile error` for a rule set that does not load."""
    tool = {"effect": "write", "rules": rules, "fallback": fallback}
    try:
        revision = build_revision(
            {"upstreams": UPSTREAMS, "defaults": {"gated_effects": []}, "tools": {"demo.t": tool}},
            engine,
        )
    except CelCompileError:
        return ["compile error"]
    registry = ToolRegistry()
    catalogue, arg_rules = CatalogueCheck(revision, registry), ArgRulesCheck(revision, registry)
    out = []
    for args in calls:
        call = make_call("t", args)
        # The catalogue refuses a tool no call can pass (deny fallback, no allow rule) on both.
        decision = catalogue.decide(call) or arg_rules.decide(call)
        out.append("allow" if decision is None else f"{decision.code.value} {decision.rule}")
    return out


def verdict(engine: str, rules: list[dict[str, str]], fallback: str, args: dict[str, Any]) -> str:
    return verdicts(engine, rules, fallback, [args])[0]


# -- the attack of issue 12 --------------------------------------------------------------------

COMMENTED = [
    {"forbid": 'args.repo == "corp/legacy" // retired repository', "id": "legacy"},
    {
        "forbid": 'args.repo.startsWith("corp/secret-")\n|| args.repo.startsWith("corp/private-")',
        "id": "no-secret",
    },
]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_trailing_comment_does_not_swallow_the_next_forbid_rule(engine: str) -> None:
    args = {"repo": "corp/secret-plans"}
    assert verdict(engine, COMMENTED, "allow", args) == "capability_blocked no-secret"
    assert verdict(engine, COMMENTED, "allow", {"repo": "corp/private-x"}) == (
        "capability_blocked no-secret")
    assert verdict(engine, COMMENTED, "allow", {"repo": "corp/legacy"}) == (
        "capability_blocked legacy")
    assert verdict(engine, COMMENTED, "allow", {"repo": "corp/app"}) == "allow"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_trailing_comment_does_not_swallow_the_next_allow_rule(engine: str) -> None:
    rules = [
        {"allow": 'args.repo == "corp/legacy" // kept for the migration', "id": "legacy"},
        {"allow": 'args.repo == "corp/other"\n|| args.repo == "corp/app"', "id": "apps"},
    ]
    assert verdict(engine, rules, "deny", {"repo": "corp/other"}) == "allow"
    assert verdict(engine, rules, "deny", {"repo": "evil/x"}) == "capability_blocked demo.t#fallback"


# -- random rule sets ---------------------------------------------------------------------------

# Characters that can confuse a joined rule text once inside literals and comments.
_TRICKY = st.sampled_from(
    ["/", "//", ")", "(", '"', "'", "\\", "\n", "\r", "\t", " ", "|", "&", "!", "a", "b",
     "corp", "é", "日本", "\u2028", "😀", "#", "*/", "/*"]
)
TEXT = st.lists(_TRICKY, max_size=6).map("".join)


def cel_string(text: str) -> str:
    """`text` as a CEL double-quoted string literal (quotes, backslashes and newlines escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# Whitespace between tokens, newlines included: multi-line rules are ordinary YAML blocks.
SPACE = st.sampled_from([" ", " ", " ", "\n", "\n  "])
# A comment's text: anything but a newline (only `\n` ends a CEL comment; `\r` does not).
COMMENT_TEXT = TEXT.map(lambda t: t.replace("\n", " "))


# Mostly selective atoms (a group then decides by its one true rule more often than by chance);
# `{f}` a field (`missing` is absent: an error), `{lit}` a string literal, `{k}` a small number.
ATOMS = (
    "args.{f} == {lit}", "args.{f} == {lit}", "args.{f}.startsWith({lit})",
    "args.{f}.endsWith({lit})", "args.{f}.contains({lit})", "{lit} in args.tags",
    "args.{f} != {lit}", "size(args.{f}) == {k}", "args.n < {k}", "args.n == {k}", "args.f",
    "has(args.{f})",
)
FIELDS = ("s", "t") * 5 + ("missing",)
_ATOM = st.tuples(st.sampled_from(ATOMS), st.sampled_from(FIELDS), st.integers(-2, 3),
                  st.integers(0, 2))
_NODE = st.sampled_from(["atom", "atom", "&&", "||", "!", "()"])
_KIND = st.sampled_from(["forbid", "forbid", "allow"])
_ARGS = st.tuples(st.integers(0, 9), st.integers(-3, 4), st.integers(0, 9), st.booleans(),
                  st.integers(0, 9))


@st.composite
def expression(draw: st.DrawFn, literals: list[str], depth: int = 0) -> str:
    node = "atom" if depth >= 3 else draw(_NODE)
    if node == "atom":
        template, field, k, i = draw(_ATOM)
        return template.format(f=field, k=k, lit=cel_string(literals[i % len(literals)]))
    sp = draw(SPACE)
    if node == "!":
        return f"!({sp}{draw(expression(literals, depth + 1))}{sp})"
    if node == "()":
        return f"({draw(expression(literals, depth + 1))}{sp})"
    left = draw(expression(literals, depth + 1))
    right = draw(expression(literals, depth + 1))
    if draw(st.integers(0, 3)) == 0:
        return f"{left} // {draw(COMMENT_TEXT)}\n{node}{sp}{right}"
    return f"{left}{sp}{node}{draw(SPACE)}{right}"


@st.composite
def rule_set(draw: st.DrawFn) -> tuple[list[dict[str, str]], str, list[dict[str, Any]]]:
    literals = draw(st.lists(TEXT, min_size=1, max_size=3))
    rules = []
    for i in range(draw(st.integers(2, 5))):
        expr = draw(expression(literals))
        if draw(st.booleans()):
            expr += f" // {draw(COMMENT_TEXT)}"  # the trailing comment of issue 12
        if draw(st.booleans()):
            expr += "\n"  # a YAML `|` block ends with a newline
        if draw(st.integers(0, 3)) == 0:
            expr = draw(SPACE) + expr
        rules.append({draw(_KIND): expr, "id": f"r{i}"})
    # A deny fallback with no allow rule is refused by the catalogue before any rule runs.
    fallback = draw(st.sampled_from(["allow", "deny"])) if any("allow" in r for r in rules) else "allow"
    # Arguments built from the same literals, so that rules match as often as they miss; mostly
    # present, as an erroring forbid rule decides at once and hides the rules after it.
    value = st.one_of(st.sampled_from(literals), st.builds(
        lambda a, b: a + b, st.sampled_from(literals), st.sampled_from(literals)), TEXT)
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        args: dict[str, Any] = {"s": draw(value), "t": draw(value)}
        has_n, n, has_f, f, has_tags = draw(_ARGS)
        if has_n:
            args["n"] = n
        if has_f:
            args["f"] = f
        if has_tags:
            args["tags"] = draw(st.lists(value, max_size=3))
        calls.append(args)
    return rules, fallback, calls


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rule_set())
@example(([{"allow": 'args.s == ""', "id": "r0"}, {"forbid": '"" in args.tags // ', "id": "r1"},
           {"forbid": ' args.s == ""\n', "id": "r2"}], "allow", [{"tags": [], "s": ""}]))
def test_both_engines_decide_the_same(
    case: tuple[list[dict[str, str]], str, list[dict[str, Any]]],
) -> None:
    rules, fallback, calls = case
    cpp = verdicts("cel-cpp", rules, fallback, calls)
    py = verdicts("cel-python", rules, fallback, calls)
    assert cpp == py, f"cel-cpp: {cpp}\ncel-python: {py}\nrules: {rules!r}\ncalls: {calls!r}"


# -- the example policy pack ----------------------------------------------------------------------


def test_the_policy_pack_tests_decide_the_same_on_both_engines() -> None:
    reports = {engine: run_tests(PACK, engine=engine) for engine in ENGINES}
    for engine, report in reports.items():
        assert report.problems == [] and report.results, engine
    # Approval ids are random per run; everything else must be identical, reasons included.
    cpp, py = ([(r.case.title, r.verdict, r.code, r.check, r.rule,
                 re.sub(r"apr-[0-9a-f]+", "apr-*", r.reason)) for r in reports[e].results]
               for e in ENGINES)
    assert cpp == py
    assert reports["cel-cpp"].ok and reports["cel-python"].ok
