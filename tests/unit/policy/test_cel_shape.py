"""The lint and the `matches` rewrite read an expression's literal-free shape (`cel._shape`):
they must find exactly what a parse of the expression itself finds, at the same offsets."""

from __future__ import annotations

import ast
import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.policy import cel

ROOT = Path(__file__).resolve().parents[3]


def direct(expr: str) -> tuple[Any, ...]:
    """What the lint and the rewrite found before shapes: the parse of `expr` itself."""
    return (
        [cel._lint_parsed(expr, i, r) for i in (True, False) for r in (True, False)],
        cel._parsed_sites(expr),
    )


def shaped(expr: str) -> tuple[Any, ...]:
    return (
        [tuple(cel.lint(expr, identifiers=i, result_type=r)) for i in (True, False)
         for r in (True, False)],
        cel._matches_sites(expr),
    )


def _strings(value: Any) -> Iterator[str]:
    """Every string in a YAML document (each node once: the tests hold alias bombs)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        node = todo.pop()
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict | list) and id(node) not in seen:
            seen.add(id(node))
            todo.extend([*node.keys(), *node.values()] if isinstance(node, dict) else node)


def _yaml_strings(text: str) -> Iterator[str]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return
    for doc in docs:
        if isinstance(doc, dict | list):
            yield from _strings(doc)


@functools.cache
def corpus() -> list[str]:
    """Every string in the repository's policies, examples and tests (YAML files, and the
    Python string constants of the tests and the bench, with the YAML inside them): a superset
    of every CEL expression they hold."""
    found: set[str] = set()
    for folder in ("policies", "examples", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.y*ml")):
            if "node_modules" in path.parts:
                continue
            found.update(_yaml_strings(path.read_text(encoding="utf-8")))
    for folder in ("tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "node_modules" in path.parts:  # Node's own files, installed by CI beside the tests
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
                    if "\n" in node.value:
                        found.update(_yaml_strings(node.value))
                    if "{i}" in node.value:  # bench/policy_load.py's rule templates
                        with contextlib.suppress(KeyError, IndexError, ValueError):
                            found.add(node.value.format(i="7x0x0", n=120, m=8))
    return sorted(s for s in found if len(s) <= 400)


def test_the_corpus_holds_the_policies_expressions() -> None:
    strings = corpus()
    assert 'args.repo.matches("^design7x0x0/[a-z]+$")' in strings
    assert len(strings) > 1000


def test_shapes_find_what_a_parse_of_the_expression_finds_on_every_string_of_the_repo() -> None:
    mismatched = [s for s in corpus() if shaped(s) != direct(s)]
    assert mismatched == []


def test_expressions_that_differ_only_in_literals_share_one_parse() -> None:
    cel._lint_parsed.cache_clear()
    for i in range(1, 51):
        cel.lint(f'args.repo.startsWith("corp/team-{i}") && principal.grups == [\'x{i}\', {i}]')
    info = cel._lint_parsed.cache_info()
    assert (info.misses, info.hits) == (1, 49)


@pytest.mark.parametrize(
    "expr",
    [
        '"abc" + principal.grups',
        'r"a\\"b" == x && principal.grups',
        '"""a\n"b"\n""" == principal.grups',
        "b'\\x00' in principal.grups",
    ],
)
def test_offsets_after_literals_point_into_the_expression(expr: str) -> None:
    field = expr.index("grups")
    assert cel.lint(expr, identifiers=False, result_type=False) == [
        (field, "undefined field 'grups' (did you mean 'groups'?) on principal (known: id, groups, claims)")
    ]


def test_literals_that_touch_another_quote_are_parsed_as_written() -> None:
    # Emptied, `"a""b"` would read as one triple-quoted literal: a different expression.
    assert cel._shape('"a""b" == x') is None
    assert cel.lint('"a""b"') == cel.lint('"a" "b"') == []


def test_the_rewrite_still_maps_the_literal_it_rewrites() -> None:
    expr = 'args.a.contains("x\\"") && args.q.matches("(?i)pass[w]ord") || "y".matches("z")'
    assert cel._apply_sites(expr, cel._matches_sites(expr)) == (
        'args.a.contains("x\\"") && envelope_re_search(args.q, "(?i)pass[w]ord") || '
        'envelope_re_search("y", "z")'
    )


# Random CEL: mostly well-formed expressions (so the parse has something to find), with every
# kind of literal and the characters that end or escape one, then sometimes a piece spliced in
# anywhere (so broken and borderline texts are covered too).
_PREFIX = st.sampled_from(["", "", "", "r", "R", "b", "B", "br", "bR", "rb"])
_QUOTE = st.sampled_from(['"', "'", '"""', "'''"])
_CONTENT = st.text(alphabet=st.sampled_from(list("ab .$\"'\\/\nxu0{}()")), max_size=8)
_LITERAL = st.builds(lambda p, q, c: f"{p}{q}{c}{q}", _PREFIX, _QUOTE, _CONTENT)
_ATOMS = st.one_of(
    _LITERAL,
    st.sampled_from([
        "principal", "principal.grups", "principal.groups", "tool.nme", "tool.name", "args",
        "args.x", "run.tainted", "foo", "x", "r", "b", "1", "0x1b", "2.5", "3u", "true", "null",
        "int", "request.headers.h", "principal.claims.c", "123", "-45", "1e5", "07", "1.5",
        "99u", "0xFF", ".5", "x1", "x.0", "0", "00x1", "12x3",
    ]),
)


def _compound(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.builds("{} {} {}".format, inner, st.sampled_from(["&&", "||", "==", "in", "+", "<"]),
                  inner),
        st.builds("{}.matches({})".format, inner, _LITERAL),
        st.builds("matches({}, {})".format, inner, _LITERAL),
        st.builds("{}.{}({}, {})".format, inner, st.sampled_from(["all", "exists", "map"]),
                  st.sampled_from(["x", "v", "principal"]), inner),
        st.builds("{}.startsWith({})".format, inner, _LITERAL),
        st.builds("[{}, {}]".format, inner, inner),
        st.builds("{{{}: {}}}".format, _LITERAL, inner),
        st.builds("({})".format, inner),
        st.builds("!{}".format, inner),
        st.builds("{} // {}\n".format, inner, _CONTENT),
    )


_SPLICE = st.sampled_from(['"', "'", '"""', "r", "b", ")", ".", "//", "\\", "\n", " ", "x"])


@st.composite
def _expressions(draw: st.DrawFn) -> str:
    expr = draw(st.recursive(_ATOMS, _compound, max_leaves=6))
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(expr)))
        expr = expr[:at] + draw(_SPLICE) + expr[at:]
    return expr


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_expressions())
@example('args.x.matches("a\\\\"b") && "c\'d" in principal.grups')
@example("r'''a\n'''.matches(b\"x\") || matches(x, 'y')")
@example('x"a"')
@example("overview-1280x800 + 0x1F")
@example('true.matches("").matches("")')
@example('"abc')
@example("true == 1")  # a finding without an offset (two literals compared): nothing to map back
def test_random_expressions_lint_and_rewrite_the_same_through_shapes(expr: str) -> None:
    assert shaped(expr) == direct(expr)
