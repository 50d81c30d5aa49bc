"""YAML with positions: parse a policy file into nodes that remember where they came from.

The loader needs a 1-based line and column for every problem, including problems found long
after parsing (pydantic errors, CEL errors inside a scalar). So a file is *composed* (ruamel's
node graph: every key, value and item carries its start mark) and converted to plain Python
values separately; the node tree is kept to map a path back to a place.

Composing with ruamel's pure-Python parser costs ~14 s for a 1,000-tool policy (1.9 MB), so a
file is composed by libyaml (PyYAML's C parser, ~10x faster) into the same ruamel nodes, with
ruamel's YAML 1.2 tag resolution: the loader sees exactly what the pure parser gives. Anything
libyaml rejects, and any file with a `%YAML` directive or a byte-order mark, is composed by the pure parser, which
words every syntax error as before.
"""

from __future__ import annotations

import bisect
import datetime
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import (
    MappingEndEvent,
    MappingStartEvent,
    SequenceEndEvent,
    SequenceStartEvent,
)
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.resolver import VersionedResolver
from ruamel.yaml.tag import Tag

try:
    import yaml as _pyyaml
    from yaml.cyaml import CParser as _CParser
except ImportError:  # pragma: no cover - PyYAML without libyaml: the pure parser does it all
    _CParser = None

from proxy.errors import PolicyProblem

_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_IMMUTABLE = (str, int, float, bytes, type(None), datetime.date)  # bool is an int


@dataclass(frozen=True, slots=True)
class YamlFile:
    """One parsed policy file: its display name, source text and root node (None when empty)."""

    name: str
    text: str
    root: Node | None
    # What the loader derived from this file's nodes (validated entries, compiled tools), by
    # node: a file unchanged since the last load is parsed, validated and compiled once.
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    # What composing with libyaml noted on the way (`_Facts`), sparing the walks of
    # `has_alias` and `duplicate_keys` over every node; None: the pure parser composed it.
    facts: _Facts | None = field(default=None, compare=False, repr=False)


def _count(obj: object) -> int:
    return sys.getrefcount(obj)


def _held_once() -> int:
    held = object()
    return _count(held)


# What `_count` reads for an object one local name holds, on this interpreter (the number
# differs between Python versions; what matters is the same reading through the same path).
_ONE_HOLDER = _held_once()


def release_parsed(value: tuple[YamlFile | None, Any]) -> None:
    """Free an evicted parse (`(file, problems)`, handed over by its cache as its only holder)
    in small pieces rather than in one cascade.

    Dropping the last reference to a 1,000-tool file's node tree frees ~600,000 objects in one
    uninterruptible C cascade: 60-175 ms holding the interpreter lock in the reload thread,
    which the event loop (every call in flight) waits out. Taken apart node by node in Python
    instead, the same work yields the lock every switch interval. Only what nothing else holds
    is taken apart: a file, node or child list something else still references (a revision's
    entry, a memo) is left whole and only this reference is dropped."""
    file = value[0]
    if file is None:
        return
    nodes: list[Any] = [file.root]
    # Frees the file (its text, memo, facts) unless something else holds it; then its root is
    # not ours alone and `release_nodes` leaves the tree whole.
    del value, file
    release_nodes(nodes)


def release_nodes(nodes: list[Any]) -> int:
    """Empty `nodes` (a stack of node trees, each held only by it), freeing every node that
    nothing else holds one at a time; the number taken apart that way."""
    taken = 0
    while nodes:
        node = nodes.pop()
        if isinstance(node, _BRANCHES) and _count(node) == _ONE_HOLDER:
            children = node.value
            node.value = []
            if isinstance(children, list) and _count(children) == _ONE_HOLDER:
                item = None
                for item in children:  # a mapping's (key, value) pairs, a sequence's nodes
                    if isinstance(item, tuple):
                        nodes.extend(item)
                    else:
                        nodes.append(item)
                del item  # it would hold the last pair, and so its nodes, past the next pop
            del children  # the list and its pairs; each child is held by `nodes` alone now
            taken += 1
        del node
    return taken


@dataclass(slots=True)
class _Facts:
    """Noted while converting libyaml's nodes: whether a node is reached twice (an alias), the
    repeated keys (first, repeat) of every mapping, and the empty values of mappings."""

    aliased: bool = False
    duplicates: list[tuple[Node, Node]] = field(default_factory=list)
    empties: list[Node] = field(default_factory=list)
    flow_empty: bool = False  # an empty value in a flow mapping: `{a: , b: 1}`


def file_has_alias(file: YamlFile) -> bool:
    """`has_alias` of the file's root, from what composing noted when it can."""
    if file.root is None:
        return False
    return file.facts.aliased if file.facts is not None else has_alias(file.root)


def file_duplicate_keys(file: YamlFile) -> list[PolicyProblem]:
    """`duplicate_keys` of the file's root (the same problems, in document order), from what
    composing noted when it can."""
    if file.root is None:
        return []
    if file.facts is None:
        return duplicate_keys(file.name, file.root)
    repeats = sorted(file.facts.duplicates, key=lambda pair: pair[1].start_mark.index)
    return [_duplicate(file.name, first, key) for first, key in repeats]


def _duplicate(file: str, first: Node, key: Node) -> PolicyProblem:
    line, col = position(first)
    return problem(file, key, f"duplicate key '{key.value}' (first at {file}:{line}:{col})")


def position(node: Node) -> tuple[int, int]:
    """The 1-based (line, column) where `node` starts."""
    return node.start_mark.line + 1, node.start_mark.column + 1


def read_text(path: Path, name: str) -> str | PolicyProblem:
    """The UTF-8 text of the file at `path` (newlines translated, as `Path.read_text`), or the
    problem that keeps it unread, named `name`: a file that cannot be read is one at 1:1, bytes
    that are not UTF-8 one at the line and column of the first such byte."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        pass
    except OSError as exc:
        return PolicyProblem(name, 1, 1, f"cannot read: {exc}")
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except OSError as exc:
        return PolicyProblem(name, 1, 1, f"cannot read: {exc}")
    except UnicodeDecodeError as exc:
        # Everything before the first bad byte decodes; count lines as read_text translates them.
        before = data[:exc.start].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        line = before.count("\n") + 1
        column = len(before) - before.rfind("\n")
        return PolicyProblem(name, line, column, f"not UTF-8: byte 0x{data[exc.start]:02x} "
                                                 f"({exc.reason}); save the file as UTF-8")
    return PolicyProblem(name, 1, 1, "cannot read: the file changed while it was read")


def problem(file: str, node: Node | None, message: str) -> PolicyProblem:
    """A problem at `node` (line 1, column 1 when there is no node)."""
    line, col = position(node) if node is not None else (1, 1)
    return PolicyProblem(file, line, col, message)


# Collections nested deeper than this are a problem at the first one past it: every stage after
# composing (conversion, validation, compiling) walks the tree recursively, and Python's stack
# ends near 500 levels (a RecursionError and a traceback instead of file:line:column).
MAX_NESTING = 128
# Values a file may become once its aliases are expanded (a shared node counts once per use).
MAX_EXPANDED_VALUES = 2_000_000


class _TooDeep(Exception):
    """A collection nested deeper than MAX_NESTING, at `mark` (0-based, as YAML marks are)."""

    def __init__(self, mark: Any) -> None:
        super().__init__()
        self.mark = mark


def _too_deep(name: str, mark: Any) -> PolicyProblem:
    line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
    return PolicyProblem(name, line, col, f"nested deeper than {MAX_NESTING} levels "
                                          "(mappings and lists inside each other)")


def _nesting_mark(text: str) -> Any:
    """Where the first collection deeper than MAX_NESTING starts, from the parser's events (no
    tree, no recursion); None when there is none (or the text does not parse that far)."""
    depth = 0
    try:
        for event in YAML(typ="safe", pure=True).parse(text):
            if isinstance(event, (MappingStartEvent, SequenceStartEvent)):
                depth += 1
                if depth > MAX_NESTING:
                    return event.start_mark
            elif isinstance(event, (MappingEndEvent, SequenceEndEvent)):
                depth -= 1
    except YAMLError:
        return None
    return None


def parse_file(name: str, text: str) -> tuple[YamlFile | None, list[PolicyProblem]]:
    """Compose `text`; a syntax error, more than one document or collections nested deeper than
    MAX_NESTING is a problem, not an exception."""
    try:
        composed = _compose_fast_noting(text)
    except _TooDeep as exc:
        return None, [_too_deep(name, exc.mark)]
    if composed is not None:
        return _one_document(name, text, *composed)
    # The pure parser composes recursively: the nesting is checked on its events first.
    if (mark := _nesting_mark(text)) is not None:
        return None, [_too_deep(name, mark)]
    yaml = YAML(typ="safe", pure=True)
    try:
        docs = list(yaml.compose_all(text))
    except RecursionError:  # nested within MAX_NESTING, yet too deep for the composer's stack
        return None, [_too_deep(name, None)]
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        context = exc.context
        opened = exc.context_mark
        if context and opened is not None and exc.problem_mark is not None and \
                (opened.line, opened.column) != (exc.problem_mark.line, exc.problem_mark.column):
            # "while parsing a flow mapping": where it was opened is where the fix usually is
            # (an unclosed `{`), found only lines later.
            context += f" opened at {opened.line + 1}:{opened.column + 1},"
        what = " ".join(x for x in (context, exc.problem) if x) or "invalid YAML"
        return None, [PolicyProblem(name, line, col, f"YAML syntax error: {what}")]
    except YAMLError as exc:
        return None, [PolicyProblem(name, 1, 1, f"YAML error: {exc}")]
    return _one_document(name, text, docs)


def _one_document(
    name: str, text: str, docs: list[Node | None], facts: _Facts | None = None
) -> tuple[YamlFile | None, list[PolicyProblem]]:
    docs = [d for d in docs if d is not None]
    if len(docs) > 1:
        return None, [problem(name, docs[1], "a policy file holds one YAML document, found more")]
    file = YamlFile(name, text, docs[0] if docs else None, facts=facts)
    if file.root is not None and file_has_alias(file):
        # Converting expands aliases: a few lines of anchors nine aliases wide ("billion
        # laughs") would take every byte of memory. Refused where the values multiply.
        heights: dict[int, int] = {}
        past = expansion_past(file.root, MAX_EXPANDED_VALUES, heights)
        if past is not None:
            return None, [problem(name, past, f"expands past {MAX_EXPANDED_VALUES} values once its "
                                              "aliases are expanded: not loaded")]
        # Composing counts the nesting an alias is written at, not what it brings along: a
        # deep anchor used deep inside another collection nests as deep as both together.
        deep = nesting_past(file.root, MAX_NESTING, heights)
        if deep is not None:
            return None, [problem(name, deep, f"nested deeper than {MAX_NESTING} levels once its "
                                              "aliases are expanded (mappings and lists inside "
                                              "each other)")]
    return file, []


_KINDS: dict[Any, type[Node]] = {}
# Nodes with children, of either parser (`release_nodes`).
_BRANCHES: tuple[type[Any], ...] = (MappingNode, SequenceNode)
if _CParser is not None:
    _BRANCHES += (_pyyaml.MappingNode, _pyyaml.SequenceNode)
    _KINDS = {
        _pyyaml.ScalarNode: ScalarNode,
        _pyyaml.SequenceNode: SequenceNode,
        _pyyaml.MappingNode: MappingNode,
    }


def _compose_fast(text: str) -> list[Node | None] | None:
    """Every document of `text` composed by libyaml as ruamel nodes; None to use the pure parser
    (no libyaml, a `%YAML` directive, a byte-order mark (libyaml counts marks from after it),
    or anything libyaml rejects)."""
    composed = _compose_fast_noting(text)
    return composed[0] if composed is not None else None


def _compose_fast_noting(text: str) -> tuple[list[Node | None], _Facts] | None:
    """`_compose_fast`, and what converting the nodes noted on the way (the facts apply to
    every document: a policy file holds one)."""
    if _CParser is None or "%YAML" in text or text.startswith("\ufeff"):
        return None
    parser = _FastParser(text)
    try:
        docs = []
        while parser.check_node():
            docs.append(parser.get_node())
    except Exception:  # the pure parser reports it, in its own words and place
        return None
    finally:
        parser.dispose()
    converted: dict[int, Node] = {}
    facts = _Facts()
    nodes = [_ruamel_node(d, converted, facts, 1) if d is not None else None for d in docs]
    # libyaml's tree is garbage now: freed in pieces, not in one cascade when this returns
    # (50-150 ms holding the interpreter lock for a 1,000-tool file: see `release_parsed`).
    release_nodes(docs)
    if facts.flow_empty:
        return None  # `{a: , b: 1}`: libyaml and ruamel place the empty value differently
    if facts.empties:
        _place_empty(text, facts.empties)
    return nodes, facts


def _empty_scalar(node: Node) -> bool:
    return (isinstance(node, ScalarNode) and node.value == "" and node.style is None
            and node.start_mark.index == node.end_mark.index)


def _place_empty(text: str, nodes: list[Node]) -> None:
    """Give the empty values of block mappings (`key:` and nothing) ruamel's marks: the end of
    the next token (a key or a block end, both zero-width; or a `:`), where libyaml puts them
    right after the indicator. Problems about an empty value then point at the same place with
    either parser. (Elsewhere both parsers put an empty scalar after its indicator.)"""
    starts = [0]
    starts += [i + 1 for i, c in enumerate(text) if c == "\n"]
    for node in nodes:
        index = node.start_mark.index
        while index < len(text):
            c = text[index]
            if c in " \t\r\n":
                index += 1
            elif c == "#":
                newline = text.find("\n", index)
                index = len(text) if newline < 0 else newline
            else:
                break
        if text.startswith(":", index) and text[index + 1:index + 2] in ("", " ", "\t", "\r", "\n"):
            index += 1  # a value indicator (an empty key follows): its end
        line = bisect.bisect_right(starts, index) - 1
        mark = _pyyaml.error.Mark(node.start_mark.name, index, line, index - starts[line],
                                  None, None)
        node.start_mark = node.end_mark = mark


if _CParser is not None:

    class _FastParser(_CParser):
        """libyaml's composer resolving implicit tags as ruamel's pure parser does (YAML 1.2:
        `yes`/`on` stay strings, `0o17` is octal), memoised per file: values repeat a lot."""

        def __init__(self, text: str) -> None:
            super().__init__(text)
            self._resolver = VersionedResolver()
            self._tags: dict[tuple[Any, str, Any], Tag] = {}

        def descend_resolver(self, *args: Any) -> None:
            """Path-based resolvers: ruamel's safe loader registers none."""

        def ascend_resolver(self, *args: Any) -> None:
            """Path-based resolvers: ruamel's safe loader registers none."""

        def resolve(self, kind: Any, value: Any, implicit: Any) -> Tag:
            key = (kind, value if kind is _pyyaml.ScalarNode else "", implicit)
            tag = self._tags.get(key)
            if tag is None:
                tag = self._tags[key] = self._resolver.resolve(_KINDS[kind], value, implicit)
            return tag


_TAGS: dict[str, Tag] = {}


def _tag(tag: Tag | str) -> Tag:
    """One shared ruamel `Tag` per tag: it computes its string once (`node.tag` is hot).
    Resolved tags come as the resolver's (memoised, so shared) `Tag`s; explicit ones as text."""
    if isinstance(tag, Tag):
        return tag
    found = _TAGS.get(tag)
    if found is None:
        found = Tag(suffix=tag)
        if len(_TAGS) < 1024:  # explicit tags are the policy author's: do not grow for them
            _TAGS[tag] = found
    return found


def _ruamel_node(node: Any, converted: dict[int, Node], facts: _Facts, depth: int) -> Node:
    """`node` (PyYAML's) as the ruamel node the pure parser builds; an alias stays one shared
    node. The marks are libyaml's: `line`, `column` and `index` (in characters) as ruamel's.
    Notes in `facts` what `has_alias`, `duplicate_keys` and the empty values' placing would
    otherwise walk every node again to find."""
    done = converted.get(id(node))
    if done is not None:
        facts.aliased = True
        return done
    out: Node
    if depth > MAX_NESTING and not isinstance(node, _pyyaml.ScalarNode):
        raise _TooDeep(node.start_mark)
    if isinstance(node, _pyyaml.ScalarNode):
        out = ScalarNode(_tag(node.tag), node.value, node.start_mark, node.end_mark,
                         style=node.style or None)  # libyaml says "" for plain, ruamel None
    elif isinstance(node, _pyyaml.SequenceNode):
        out = SequenceNode(_tag(node.tag), [], node.start_mark, node.end_mark,
                           flow_style=node.flow_style)
        converted[id(node)] = out
        out.value = [_ruamel_node(item, converted, facts, depth + 1) for item in node.value]
    else:
        out = MappingNode(_tag(node.tag), [], node.start_mark, node.end_mark,
                          flow_style=node.flow_style)
        converted[id(node)] = out
        out.value = [(_ruamel_node(k, converted, facts, depth + 1),
                      _ruamel_node(v, converted, facts, depth + 1))
                     for k, v in node.value]
        first: dict[Any, Node] = {}
        for key, value in out.value:
            if isinstance(key, ScalarNode) and key.tag != _MERGE_TAG:  # as `duplicate_keys`
                if key.value in first:
                    facts.duplicates.append((first[key.value], key))
                else:
                    first[key.value] = key
            if _empty_scalar(value):
                facts.empties.append(value)
                facts.flow_empty = facts.flow_empty or bool(out.flow_style)
    converted[id(node)] = out
    return out


def _children(node: Node) -> list[Node]:
    children: list[Node] = []
    if isinstance(node.value, list):
        for item in node.value:
            children.extend(item if isinstance(item, tuple) else (item,))
    return children


def _expanded_sizes(root: Node, bound: int,
                    heights: dict[int, int] | None = None) -> dict[int, int]:
    """Per node (by id) below `root`: how many values it becomes once aliases are expanded (a
    shared node counts once per use), capped at `bound + 1`; computed on the shared nodes
    (memoised, iterative). An alias inside its own anchor expands without end: `bound + 1`.
    Given `heights`, fills it on the same walk with how many collections deep each node nests
    once expanded (a scalar 0, a collection 1 + its deepest child's); incomplete for a cycle."""
    sizes: dict[int, int] = {}
    walking: set[int] = set()  # nodes whose children are being sized: met again, a cycle
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        if not done and id(node) in walking:
            sizes[id(root)] = bound + 1
            return sizes
        children = _children(node)
        if done:
            sizes[id(node)] = min(1 + sum(sizes.get(id(c), 1) for c in children), bound + 1)
            if heights is not None:
                heights[id(node)] = (0 if isinstance(node, ScalarNode)
                                     else 1 + max((heights[id(c)] for c in children), default=0))
            continue
        walking.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes


def expanded_size(root: Node, bound: int) -> int:
    """How many values `root` becomes once its aliases are expanded, at most `bound + 1`: a
    few lines of anchors must not expand into billions of values."""
    return _expanded_sizes(root, bound)[id(root)]


def expansion_past(root: Node, bound: int,
                   heights: dict[int, int] | None = None) -> Node | None:
    """The innermost node that expands past `bound` values (no child of it does on its own):
    where a file's anchors multiply; None when `root` stays within `bound`. Given `heights`,
    fills it for `nesting_past` on the same walk (complete when this returns None)."""
    sizes = _expanded_sizes(root, bound, heights)
    if sizes[id(root)] <= bound:
        return None
    node = root
    while True:
        over = [c for c in _children(node) if sizes.get(id(c), 0) > bound]
        if not over or over[0] is node:
            return node
        node = over[0]


def nesting_past(root: Node, bound: int, heights: dict[int, int]) -> Node | None:
    """The first collection nested deeper than `bound` (the root collection at depth 1) once
    aliases are expanded, on a deepest path: where an anchor's nesting adds up past the bound;
    None when `root` nests within it. `heights` are those `expansion_past` filled when it found
    nothing (measured once per shared node, however often an anchor is used)."""
    if heights[id(root)] <= bound:
        return None
    node, depth = root, 1
    while depth <= bound:
        # A child through which the nesting still goes past the bound.
        node = next(c for c in _children(node) if depth + heights[id(c)] > bound)
        depth += 1
    return node


def has_alias(node: Node) -> bool:
    """Whether some node below `node` is reached twice: an alias (`*x`, `<<: *x`) shares the
    node of its anchor, so the text at one place is not all that the node there holds."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            return True
        seen.add(id(current))
        if isinstance(current, MappingNode):
            for key, value in current.value:
                stack += (key, value)
        elif isinstance(current, SequenceNode):
            stack += current.value
    return False


def duplicate_keys(file: str, node: Node, _seen: set[int] | None = None) -> list[PolicyProblem]:
    """Every key repeated within one mapping, anywhere below `node`, naming both places."""
    seen = _seen if _seen is not None else set()
    if id(node) in seen:  # aliases share nodes
        return []
    seen.add(id(node))
    problems: list[PolicyProblem] = []
    if isinstance(node, MappingNode):
        first: dict[Any, Node] = {}
        for key, value in node.value:
            if isinstance(key, ScalarNode) and key.tag != _MERGE_TAG:
                k = key.value
                if k in first:
                    line, col = position(first[k])
                    problems.append(
                        problem(file, key, f"duplicate key '{k}' (first at {file}:{line}:{col})")
                    )
                else:
                    first[k] = key
            problems += duplicate_keys(file, value, seen)
    elif isinstance(node, SequenceNode):
        for item in node.value:
            problems += duplicate_keys(file, item, seen)
    return problems


class Converter:
    """Plain Python values (dict, list, str, int, float, bool, None) from composed nodes."""

    def __init__(self) -> None:
        self._yaml = YAML(typ="safe", pure=True)
        # Scalars by (tag, text): a policy repeats `string`, `read`, `100` thousands of times
        # and ruamel's constructor costs ~20 us a scalar. Only immutable results are kept.
        self._scalars: dict[tuple[str | None, str], Any] = {}
        # Tag texts by tag object: `node.tag` builds the text on every read (~1 us, 175,000
        # reads for 1,000 tools), and libyaml's nodes share one object per tag. The objects are
        # kept so that their ids stay theirs while this converter lives.
        self._tag_texts: dict[int, str | None] = {}
        self._tags: list[Any] = []

    def _tag(self, node: Node) -> str | None:
        ctag = node.ctag
        try:
            return self._tag_texts[id(ctag)]
        except KeyError:
            self._tags.append(ctag)
            text = self._tag_texts[id(ctag)] = node.tag
            return text

    def value(self, node: Node) -> Any:
        if isinstance(node, MappingNode):
            out: dict[Any, Any] = {}
            for key, val in node.value:
                if isinstance(key, ScalarNode) and self._tag(key) == _MERGE_TAG:
                    merged = self.value(val)
                    for m in merged if isinstance(merged, list) else [merged]:
                        if isinstance(m, dict):
                            for k, v in m.items():
                                out.setdefault(k, v)
                    continue
                k = self.value(key)
                if isinstance(k, list | dict):
                    k = str(k)
                out.setdefault(k, self.value(val))  # first wins; duplicates are reported
            return out
        if isinstance(node, SequenceNode):
            return [self.value(item) for item in node.value]
        tag = self._tag(node)
        if tag == _STR_TAG:
            return node.value
        key = (tag, node.value)
        if key in self._scalars:
            return self._scalars[key]
        try:
            value = self._yaml.constructor.construct_object(node, deep=True)
        except Exception:
            value = node.value
        if isinstance(value, _IMMUTABLE):
            self._scalars[key] = value
        return value


def mapping_items(node: Node) -> list[tuple[ScalarNode, Node]]:
    """(key node, value node) pairs of a mapping with scalar keys, first occurrence only."""
    if not isinstance(node, MappingNode):
        return []
    seen: set[str] = set()
    out = []
    for key, value in node.value:
        if isinstance(key, ScalarNode) and key.tag != _MERGE_TAG and key.value not in seen:
            seen.add(key.value)
            out.append((key, value))
    return out


def child(node: Node, part: str | int) -> tuple[Node | None, Node | None]:
    """(key node, value node) of `part` in a mapping, or (None, item) of a list index."""
    if isinstance(node, MappingNode):
        # The first non-merge scalar key spelled `part`: what `mapping_items` keeps, found
        # without building its list (`locate` runs this for every rule of every tool).
        want = str(part)
        for key, value in node.value:
            if isinstance(key, ScalarNode) and key.value == want and key.tag != _MERGE_TAG:
                return key, value
    elif isinstance(node, SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return None, node.value[part]
    return None, None


def locate(node: Node, loc: Sequence[str | int], *, key: bool = False) -> Node:
    """The node at path `loc` below `node`, or its closest existing ancestor.

    With `key=True` and a path that ends on a mapping key, the key node itself (the place to
    point at for an unknown field).
    """
    current = node
    for i, part in enumerate(loc):
        knode, vnode = child(current, part)
        if vnode is None:
            return current
        if key and i == len(loc) - 1 and knode is not None:
            return knode
        current = vnode
    return current


def scalar_position(file: YamlFile, node: Node, offset: int) -> tuple[int, int]:
    """The 1-based (line, column) of character `offset` of a scalar's value in the source.

    Exact for one-line plain and quoted scalars (escapes included) and literal blocks; folded
    and multi-line flow scalars are mapped as if each line break became one character.
    """
    line, col = position(node)
    style = getattr(node, "style", None)
    start, end = node.start_mark.index, node.end_mark.index
    raw = file.text[start:end]
    if style in ("|", ">"):
        body = raw.split("\n")[1:]
        indent = min((len(x) - len(x.lstrip(" ")) for x in body if x.strip()), default=0)
        remaining = offset
        for i, text in enumerate(body):
            content = text[indent:]
            if remaining <= len(content):
                return line + 1 + i, indent + 1 + remaining
            remaining -= len(content) + 1
        return line + 1, indent + 1
    lines = raw.split("\n")
    if len(lines) == 1:
        if style in ('"', "'"):
            return line, col + 1 + _unescaped_to_raw(raw[1:], style, offset)
        return line, col + offset
    # Multi-line flow scalar: continuation lines are stripped and joined by one space.
    remaining = offset
    for i, text in enumerate(lines):
        if i == 0:
            lead = 1 if style in ('"', "'") else 0
            content, base = text[lead:].rstrip(), col + lead
        else:
            lead = len(text) - len(text.lstrip())
            content, base = text.strip(), 1 + lead
        if remaining <= len(content):
            return line + i, base + remaining
        remaining -= len(content) + 1
    return line, col


def _unescaped_to_raw(raw: str, quote: str, offset: int) -> int:
    """Raw index in a quoted scalar body of character `offset` of its unescaped value."""
    i = 0
    for _ in range(offset):
        if i >= len(raw):
            break
        if quote == "'" and raw.startswith("''", i):
            i += 2
        elif quote == '"' and raw[i] == "\\" and i + 1 < len(raw):
            esc = raw[i + 1]
            i += {"x": 4, "u": 6, "U": 10}.get(esc, 2)
        else:
            i += 1
    return i
