"""libyaml composes policy files into exactly the nodes ruamel's pure parser gives: same tags
(YAML 1.2), values, styles and marks, so every problem points at the same file:line:col."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML
from ruamel.yaml.nodes import Node, ScalarNode, SequenceNode

from proxy.policy import yamlload
from proxy.policy.cache import LruCache
from proxy.policy.yamlload import parse_file

ROOT = Path(__file__).resolve().parents[3]


def shape(node: Node | None) -> Any:
    """Everything the loader reads from a node: tag, value, style and marks."""
    if node is None:
        return None
    marks = (node.start_mark.line, node.start_mark.column, node.start_mark.index,
             node.end_mark.index)
    if isinstance(node, ScalarNode):
        return (node.tag, node.value, node.style, marks)
    if isinstance(node, SequenceNode):
        return (node.tag, node.flow_style, marks, [shape(x) for x in node.value])
    return (node.tag, node.flow_style, marks, [(shape(k), shape(v)) for k, v in node.value])


def pure(text: str) -> list[Any]:
    return [shape(d) for d in YAML(typ="safe", pure=True).compose_all(text)]


CASES = {
    "empty values": "a:\n  b:\nc: 1\nd:   # comment\n\n  # more\ne:\n",
    "empty at the end": "a:\n  # c\n  \n  b: 1\nz:",
    "sequences": "a:\n- \n-\n- x\nb: {p: 1, q: [ ]}\nc: [x, {}]\n",
    "YAML 1.2 scalars": "a: yes\nb: on\nc: 0o17\nd: 017\ne: ~\nf: 1_000\ng: 1.5e3\nh: .inf\ni: 2026-01-01\n",
    "anchors and merges": "x: &a\n  k: 1\ny: *a\nm:\n  <<: *a\n  n: 2\n",
    "quoting and unicode": "a: \"é€\\u00e9x\"\nb: 'it''s'\nc: plain é\nd:\n",
    "block scalars": "a: |\n  x\n  y\nb: >-\n  z\n  w\nc: |+\n  k\n\n",
    "CRLF": "a: 1\r\nb:\r\nc: 2\r\n",
    "explicit document": "---\na:\n...\n",
    "tags": "a: !!str 1\nb: !custom x\nc: !!int '7'\n",
}


@pytest.mark.parametrize("text", CASES.values(), ids=CASES.keys())
def test_fast_composer_matches_the_pure_parser(text: str) -> None:
    fast = yamlload._compose_fast(text)
    assert fast is not None
    assert [shape(d) for d in fast] == pure(text)


def test_every_policy_file_in_the_repository_composes_the_same() -> None:
    files = sorted((ROOT / "policies").rglob("*.yaml")) + sorted((ROOT / "bench").rglob("*.yaml"))
    assert files
    for path in files:
        text = path.read_text(encoding="utf-8")
        fast = yamlload._compose_fast(text)
        assert fast is not None, path
        assert [shape(d) for d in fast] == pure(text), path


@pytest.mark.parametrize("text", ["\ufeffa: 1\n", "%YAML 1.1\n---\na: yes\n", "a: [ , ]\n",
                                  "b: {p: , q: 1}\n",
                                  "a: 'open\n", "a: 1\n b: 2\n"])
def test_what_libyaml_does_not_compose_like_ruamel_goes_to_the_pure_parser(text: str) -> None:
    assert yamlload._compose_fast(text) is None


def test_syntax_errors_keep_the_pure_parsers_words_and_place() -> None:
    parsed, problems = parse_file("p.yaml", "a: 1\nb: [x, y\nc: 2\n")
    assert parsed is None
    assert [(p.line, p.column) for p in problems] == [(3, 2)]
    assert problems[0].message.startswith("YAML syntax error: while parsing a flow sequence")


def test_a_syntax_error_names_where_the_unclosed_collection_was_opened() -> None:
    # The parser notices an unclosed `{` lines later; on main only that later place was named.
    _, problems = parse_file("p.yaml", "a: 1\nb: {x: 1\nc: 2\n")
    assert [str(p) for p in problems] == [
        "p.yaml:3:2: YAML syntax error: while parsing a flow mapping opened at 2:4, expected ',' "
        "or '}', but got ':'"]
    _, problems = parse_file("p.yaml", "a: 1\nb: \"open\n")
    assert problems[0].message == ("YAML syntax error: while scanning a quoted scalar opened at "
                                   "2:4, found unexpected end of stream")


FACTS = {
    **CASES,
    "duplicates": "a: 1\nb:\n  x: 1\n  x: 2\na: 3\nc: [{k: 1, k: 2}]\n",
    "duplicates under an alias": "base: &b\n  x: 1\n  x: 2\nuse: *b\nm:\n  <<: *b\n  <<: *b\n  y: 1\n",
    "no alias": "a: {b: [1, 2], c: {d: e}}\n",
    "merge keys are not duplicates": "a: &a {x: 1}\nb:\n  <<: *a\n  <<: *a\n",
}


@pytest.mark.parametrize("text", FACTS.values(), ids=FACTS.keys())
def test_what_composing_notes_is_what_the_walks_find(text: str) -> None:
    parsed, problems = parse_file("p.yaml", text)
    assert parsed is not None and not problems and parsed.root is not None
    assert parsed.facts is not None  # composed by libyaml
    assert yamlload.file_has_alias(parsed) == yamlload.has_alias(parsed.root)
    assert yamlload.file_duplicate_keys(parsed) == yamlload.duplicate_keys("p.yaml", parsed.root)


def test_the_repository_policies_note_the_same_as_the_walks() -> None:
    files = sorted((ROOT / "policies").rglob("*.yaml")) + sorted((ROOT / "tests").rglob("*.yaml"))
    checked = 0
    for path in files:
        parsed, _ = parse_file(str(path), path.read_text(encoding="utf-8"))
        if parsed is None or parsed.root is None or parsed.facts is None:
            continue
        checked += 1
        assert yamlload.file_has_alias(parsed) == yamlload.has_alias(parsed.root), path
        assert (yamlload.file_duplicate_keys(parsed)
                == yamlload.duplicate_keys(str(path), parsed.root)), path
    assert checked > 10


def test_duplicate_keys_are_reported_in_document_order_with_both_places() -> None:
    parsed, _ = parse_file("p.yaml", FACTS["duplicates"])
    assert parsed is not None
    assert [str(p) for p in yamlload.file_duplicate_keys(parsed)] == [
        "p.yaml:4:3: duplicate key 'x' (first at p.yaml:3:3)",
        "p.yaml:5:1: duplicate key 'a' (first at p.yaml:1:1)",
        "p.yaml:6:12: duplicate key 'k' (first at p.yaml:6:6)",
    ]


# -- freeing a parse in pieces (a 1,000-tool file's tree freed in one cascade stalled calls) --

_TREE = "tools:\n" + "".join(
    f"  demo.t{i}:\n    effect: read\n    rules:\n      - {{id: r{i}, when: 'true'}}\n" for i in range(50)
)


def _branches(node: Any) -> int:
    if isinstance(node, ScalarNode):
        return 0
    items = [x for pair in node.value for x in pair] if isinstance(node.value[0], tuple) else node.value
    return 1 + sum(_branches(x) for x in items)


def test_a_tree_nothing_else_holds_is_taken_apart_node_by_node() -> None:
    parsed, problems = parse_file("p.yaml", _TREE)
    assert parsed is not None and not problems and parsed.root is not None
    expected = _branches(parsed.root)
    nodes = [parsed.root]
    del parsed
    assert yamlload.release_nodes(nodes) == expected and nodes == []


def test_a_subtree_held_elsewhere_is_left_whole() -> None:
    # A revision's entry may still hold a node of an evicted parse: it must stay intact.
    parsed, _ = parse_file("p.yaml", _TREE)
    assert parsed is not None and parsed.root is not None
    [(_, tools)] = parsed.root.value
    kept_key, kept = tools.value[7]
    before = [(k.value, type(v).__name__) for k, v in kept.value]
    total = _branches(parsed.root)
    nodes = [parsed.root]
    del parsed, tools
    taken = yamlload.release_nodes(nodes)
    assert taken == total - _branches(kept)
    assert [(k.value, type(v).__name__) for k, v in kept.value] == before
    assert kept_key.value == "demo.t7" and kept.value[1][1].value[0].value[0][1].value == "r7"


def test_an_evicted_parse_is_released_only_when_its_cache_held_it_alone() -> None:
    released: list[int] = []

    def release(value: tuple[yamlload.YamlFile | None, Any]) -> None:
        file = value[0]
        assert file is not None and file.root is not None
        released.append(len(file.root.value))
        yamlload.release_parsed(value)

    cache: LruCache[str, tuple[yamlload.YamlFile | None, Any]] = LruCache(1, release=release)
    first, _ = parse_file("p.yaml", _TREE)
    assert first is not None
    cache.put("a", (first, ()))
    cache.put("b", (parse_file("q.yaml", "tools: {}\n")[0], ()))  # evicts "a"
    assert released == [1]
    # `first` is still held here: release_parsed left it whole.
    assert first.root is not None and len(first.root.value[0][1].value) == 50


@pytest.mark.parametrize("prefix", ["", "\ufeff"], ids=["libyaml", "pure"])
@pytest.mark.parametrize("depth", [129, 600, 50_000])
def test_nesting_past_the_limit_is_a_problem_at_its_place(prefix: str, depth: int) -> None:
    # Past the limit (and past Python's stack, 600 and 50,000) a problem at the first
    # collection too deep, never a RecursionError; libyaml and the pure parser alike.
    text = prefix + "a:\n  b: " + "[" * (depth - 2) + "]" * (depth - 2) + "\n"
    parsed, problems = parse_file("deep.yaml", text)
    assert parsed is None
    assert [(p.line, p.column, p.message) for p in problems] == [
        (2, len("  b: ") + 127, "nested deeper than 128 levels (mappings and lists inside each other)")]


def test_nesting_at_the_limit_parses() -> None:
    parsed, problems = parse_file("deep.yaml", "a:\n  b: " + "[" * 126 + "]" * 126 + "\n")
    assert problems == [] and parsed is not None


def test_block_nesting_past_the_limit_is_a_problem_at_its_place() -> None:
    text = "".join("  " * i + "k:\n" for i in range(600))
    _, problems = parse_file("deep.yaml", text)
    assert [(p.line, p.column) for p in problems] == [(129, 257)]


@pytest.mark.parametrize("prefix", ["", "\ufeff"], ids=["libyaml", "pure"])
def test_nesting_an_alias_brings_along_counts_where_it_is_used(prefix: str) -> None:
    # A 100-deep anchor (within the bound where it is written) used 61 collections deep: 161
    # once expanded, where composing saw 61 and the anchor's 101. Refused at the collection 129
    # deep on that path: the anchor's 68th list (depth 62 is its first).
    text = (prefix + "a:\n  b: &deep " + "[" * 100 + "]" * 100 + "\n"
            + "c: " + "[" * 60 + "*deep" + "]" * 60 + "\n")
    parsed, problems = parse_file("alias.yaml", text)
    assert parsed is None
    assert [(p.line, p.column, p.message) for p in problems] == [
        (2, len("  b: &deep ") + 68, "nested deeper than 128 levels once its aliases are expanded "
                                     "(mappings and lists inside each other)")]


def test_an_alias_nesting_within_the_limit_parses() -> None:
    # 127 deep once expanded: within the limit.
    fits = "a: &deep " + "[" * 63 + "]" * 63 + "\nc: " + "[" * 63 + "*deep" + "]" * 63 + "\n"
    assert parse_file("fits.yaml", fits)[1] == []


def test_the_nesting_of_aliases_is_measured_once_per_node_not_per_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 18 anchors, each used twice by the next: 2**18 paths through 40 nodes (1.5 million values
    # once expanded, within that bound). Each node's children are read twice (on the way down
    # and up), whatever the number of paths through it.
    chain = "".join(f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]\n" for i in range(1, 19))
    parsed, problems = parse_file("wide.yaml", "l0: &l0 [x]\n" + chain)
    assert problems == [] and parsed is not None and parsed.root is not None
    nodes: set[int] = set()
    stack = [parsed.root]
    while stack:
        node = stack.pop()
        if id(node) not in nodes:
            nodes.add(id(node))
            stack += yamlload._children(node)
    reads: list[int] = []
    children = yamlload._children

    def counted(node: Any) -> list[Any]:
        reads.append(id(node))
        return children(node)

    monkeypatch.setattr(yamlload, "_children", counted)
    heights: dict[int, int] = {}
    assert yamlload.expansion_past(parsed.root, yamlload.MAX_EXPANDED_VALUES, heights) is None
    assert yamlload.nesting_past(parsed.root, yamlload.MAX_NESTING, heights) is None
    assert heights[id(parsed.root)] == 20  # the root mapping, 18 lists of lists, the first list
    assert len(reads) == 2 * len(nodes) == 2 * 40
