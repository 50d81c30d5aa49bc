"""The CEL seam's fast paths must not change a single verdict: `compile_any` (one `||` program
per rule group) and, under cel-cpp, literal `matches` patterns precompiled with RE2."""

from __future__ import annotations

import datetime as dt

import pytest

from proxy.errors import CelCompileError, CelEvalError
from proxy.policy.cel import _apply_sites, _matches_sites, available_engines, get_engine

ENGINES = available_engines()
NOW = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)


def act(engine_name: str, **args: object) -> object:
    engine = get_engine(engine_name)
    return engine.activation({"principal": {"id": "p", "groups": [], "claims": {}}, "tool": {},
                              "args": args, "run": {}, "request": {}, "now": NOW})


def outcome(program: object, activation: object) -> object:
    try:
        return program.evaluate(activation)  # type: ignore[attr-defined]
    except CelEvalError:
        return "error"


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        (["args.a == 1", "args.b == 2"], True),  # second true
        (["args.a == 9", "args.b == 9"], False),  # none true, no error
        (["args.missing == 1", "args.b == 2"], True),  # an error does not hide a true one
        (["args.b == 2", "args.missing == 1"], True),
        (["args.missing == 1", "args.a == 9"], "error"),  # nothing true and an error: error
        (["args.a == 9", "args.missing.x"], "error"),
    ],
)
def test_compile_any_has_cel_or_semantics(engine_name: str, sources: list[str], expected: object) -> None:
    engine = get_engine(engine_name)
    program = engine.compile_any(sources)
    assert outcome(program, act(engine_name, a=1, b=2)) == expected


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize(
    ("expr", "body", "expected"),
    [
        ('args.body.matches("(?i)(password|api[_-]?key)\\\\s*[:=]")', "my PASSWORD = 3", True),
        ('args.body.matches("(?i)(password|api[_-]?key)\\\\s*[:=]")', "hello world", False),
        ('args.body.matches("^abc$")', "abc", True),
        ('args.body.matches("b")', "abc", True),  # partial match, like RE2
        ("matches(args.body, r'\\d{3}-\\d{4}')", "call 555-1234", True),
        ('(args.body + "x").matches("cx$")', "abc", True),
        ('args.body.matches(args.pat)', "abc", True),  # non-literal patterns are not rewritten
        ('args.n.matches("1")', None, "error"),  # wrong type stays an error
    ],
)
def test_matches_gives_the_same_verdict_on_every_path(engine_name: str, expr: str, body: object, expected: object) -> None:
    program = get_engine(engine_name).compile(expr)
    activation = act(engine_name, body=body, pat="b", n=1)
    assert outcome(program, activation) == expected


@pytest.mark.skipif("cel-cpp" not in ENGINES, reason="cel-cpp not installed")
def test_literal_patterns_are_rewritten_and_bad_ones_fail_at_load() -> None:
    src = 'args.t.matches("a") && (args.u.matches("b") ? "p" : "q").matches(r"c+")'
    assert _apply_sites(src, _matches_sites(src)) == (
        'envelope_re_search(args.t, "a") && '
        'envelope_re_search((envelope_re_search(args.u, "b") ? "p" : "q"), r"c+")'
    )
    with pytest.raises(CelCompileError) as err:
        get_engine("cel-cpp").compile('args.body.matches("(unclosed")')
    assert "invalid regular expression" in str(err.value)
    assert err.value.offset == len("args.body.matches(")


@pytest.mark.parametrize(
    "pattern",
    [r"^[a-z]+/[a-z-]+$", r"secret", r"", r"^$", r"(?i)ÉTÉ", r"\bx\b", r"é.$", r"^\d{3,}", r"a|"],
)
@pytest.mark.parametrize("text", ["", "corp/some-repo", "Corp/Repo", "été", "ÉTÉ 2026", "x y", "123é", "a\nb"])
def test_the_native_re2_search_answers_as_search_does(pattern: str, text: str) -> None:
    re2 = pytest.importorskip("re2")
    from proxy.policy.cel import _re2_searcher

    assert _re2_searcher(re2, pattern)(text) is (re2.compile(pattern).search(text) is not None)


def test_the_native_re2_search_refuses_what_search_refuses() -> None:
    re2 = pytest.importorskip("re2")
    from proxy.policy.cel import _re2_searcher

    with pytest.raises(UnicodeEncodeError):
        re2.compile("a").search("a\udcff")
    with pytest.raises(UnicodeEncodeError):
        _re2_searcher(re2, "a")("a\udcff")


@pytest.mark.skipif("cel-cpp" not in ENGINES, reason="cel-cpp not installed")
@pytest.mark.parametrize(
    ("expr", "message"),
    [
        # What was reported before a literal pattern compiles with one call: the expression's
        # own problem first, then a bad pattern.
        ('args.t.matches("(") ? 1 : 2', "expression must be a bool, it is int"),
        ('args.t.matches("(") && nope(args.t)', "undeclared reference to 'nope'"),
        ('1.matches("a")', "found no matching overload for 'matches'"),
        ('args.t.matches("\\q")', "Syntax error: token recognition error"),
        ('args.t.matches(b"a")', "found no matching overload for 'matches'"),
        ('args.t.matches("(")', "invalid regular expression"),
        ('args.t.matches("a") ? 1 : 2', "expression must be a bool, it is int"),
    ],
)
def test_a_rewritten_expression_reports_what_its_original_did(expr: str, message: str) -> None:
    with pytest.raises(CelCompileError) as err:
        get_engine("cel-cpp").compile(expr)
    assert message in str(err.value)
