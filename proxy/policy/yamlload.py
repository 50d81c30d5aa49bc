"""YAML with positions: parse a policy file into nodes that remember where they came from.

The loader needs a 1-based line and column for every problem, including problems found long
after parsing (pydantic errors, CEL errors inside a scalar). So a file is *composed* (ruamel's
node graph: every key, value and item carries its start mark) and converted to plain Python
values separately; the node tree is kept to map a path back to a place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from proxy.errors import PolicyProblem

_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass(frozen=True, slots=True)
class YamlFile:
    """One parsed policy file: its display name, source text and root node (None when empty)."""

    name: str
    text: str
    root: Node | None


def position(node: Node) -> tuple[int, int]:
    """The 1-based (line, column) where `node` starts."""
    return node.start_mark.line + 1, node.start_mark.column + 1


def problem(file: str, node: Node | None, message: str) -> PolicyProblem:
    """A problem at `node` (line 1, column 1 when there is no node)."""
    line, col = position(node) if node is not None else (1, 1)
    return PolicyProblem(file, line, col, message)


def parse_file(name: str, text: str) -> tuple[YamlFile | None, list[PolicyProblem]]:
    """Compose `text`; a syntax error or more than one document is a problem, not an exception."""
    yaml = YAML(typ="safe", pure=True)
    try:
        docs = list(yaml.compose_all(text))
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        what = " ".join(x for x in (exc.context, exc.problem) if x) or "invalid YAML"
        return None, [PolicyProblem(name, line, col, f"YAML syntax error: {what}")]
    except YAMLError as exc:
        return None, [PolicyProblem(name, 1, 1, f"YAML error: {exc}")]
    docs = [d for d in docs if d is not None]
    if len(docs) > 1:
        return None, [problem(name, docs[1], "a policy file holds one YAML document, found more")]
    return YamlFile(name, text, docs[0] if docs else None), []


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

    def value(self, node: Node) -> Any:
        if isinstance(node, MappingNode):
            out: dict[Any, Any] = {}
            for key, val in node.value:
                if isinstance(key, ScalarNode) and key.tag == _MERGE_TAG:
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
        try:
            return self._yaml.constructor.construct_object(node, deep=True)
        except Exception:
            return node.value


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
        for key, value in mapping_items(node):
            if key.value == str(part):
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
