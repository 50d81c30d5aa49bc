"""Output labels: which parts of a tool result are untrusted or secret (the data-flow ledger's input).

A tool's output is labelled by its policy (`output: trusted | untrusted`, `sensitivity:
public | secret`); when the policy says nothing about `output`, the output is untrusted unless
the tool's annotations say `openWorldHint: false` and the upstream's annotations are trusted
(an upstream's own hints never make its output trusted otherwise). `labels` refine parts of
`structuredContent` by JSON pointer (the most specific pointer covering a value wins).

`pieces` walks a result and yields every string an agent can read, with its labels: `content`
text, resource text and URIs, resource links, and `structuredContent` strings. A text item that
is just the JSON serialisation of `structuredContent` (what servers send for compatibility) is
covered by the structured walk, so path labels are not undone by the copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.envelope.tools import annotation
from proxy.envelope.types import ToolCall, ToolInfo
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import PathLabel, ToolPolicy

# Walk no deeper than this into structuredContent (the front already caps JSON depth).
MAX_DEPTH = 64


@dataclass(frozen=True, slots=True)
class Label:
    """Labels of one piece of output."""

    untrusted: bool
    secret: bool

    @property
    def tracked(self) -> bool:
        """Whether the ledger records it."""
        return self.untrusted or self.secret


@dataclass(frozen=True, slots=True)
class Piece:
    """One string of a tool result with its labels; `where` is a short locator for evidence."""

    text: str
    label: Label
    where: str


@dataclass(frozen=True, slots=True)
class OutputLabels:
    """The labels of one tool's output, built once per policy revision and tool."""

    base: Label
    # (pointer segments, PathLabel) most specific first.
    paths: tuple[tuple[tuple[str, ...], PathLabel], ...] = ()

    @property
    def tracked(self) -> bool:
        """Whether any part of the output can be untrusted or secret."""
        return self.base.tracked or any(
            p.output == "untrusted" or p.sensitivity == "secret" for _, p in self.paths
        )

    @property
    def widest(self) -> Label:
        """The strictest label any part of the output has (untrusted if any part is, secret
        if any part is)."""
        return Label(
            self.base.untrusted or any(p.output == "untrusted" for _, p in self.paths),
            self.base.secret or any(p.sensitivity == "secret" for _, p in self.paths),
        )

    def at(self, path: tuple[str, ...]) -> Label:
        """The label of the structuredContent value at `path`."""
        for pattern, label in self.paths:
            if len(pattern) <= len(path) and all(
                seg == "*" or seg == got for seg, got in zip(pattern, path, strict=False)
            ):
                return Label(
                    self.base.untrusted if label.output is None else label.output == "untrusted",
                    self.base.secret if label.sensitivity is None else label.sensitivity == "secret",
                )
        return self.base


def _pointer(path: str) -> tuple[str, ...]:
    if not path.startswith("/"):
        return (path,)
    return tuple(s.replace("~1", "/").replace("~0", "~") for s in path[1:].split("/"))


def output_labels(policy: ToolPolicy | None, info: ToolInfo | None, trust_annotations: bool) -> OutputLabels:
    """A tool's output labels from its policy, else (trusted) annotations, else untrusted."""
    if policy is not None and policy.output is not None:
        untrusted = policy.output == "untrusted"
    else:
        untrusted = not (trust_annotations and info is not None
                         and not annotation(info, "openWorldHint"))
    secret = policy is not None and policy.sensitivity == "secret"
    paths: list[tuple[tuple[str, ...], PathLabel]] = []
    if policy is not None:
        paths = [(_pointer(p), label) for p, label in policy.labels.items()]
        # Most specific first: longer pointers, then fewer wildcards.
        paths.sort(key=lambda pl: (-len(pl[0]), sum(s == "*" for s in pl[0])))
    return OutputLabels(Label(untrusted, secret), tuple(paths))


class ToolLabels:
    """The output labels of each tool of one policy revision (cached per tool and annotation
    hint: they depend on nothing else)."""

    def __init__(self, revision: PolicyRevision):
        self._revision = revision
        self._trust = {name: up.trust_annotations for name, up in revision.document.upstreams.items()}
        self._cache: dict[tuple[str, bool, bool], OutputLabels] = {}

    def of(self, call: ToolCall) -> OutputLabels:
        trust = self._trust.get(call.upstream, False)
        info = call.upstream_tool
        key = (call.qualified_name, info is None,
               trust and info is not None and annotation(info, "openWorldHint"))
        found = self._cache.get(key)
        if found is None:
            compiled = self._revision.tools.get(call.qualified_name)
            found = output_labels(compiled.policy if compiled is not None else None, info, trust)
            if len(self._cache) < 10_000:
                self._cache[key] = found
        return found


def _strings(value: Any, path: tuple[str, ...], depth: int) -> Iterator[tuple[tuple[str, ...], str]]:
    if depth > MAX_DEPTH:
        return
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, (*path, str(k)), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, (*path, str(i)), depth + 1)
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000_000:
        yield path, str(value)  # an account number sent as a JSON number


def _copy(text: str, structured: Any) -> bool:
    """Whether `text` is `structured` as JSON, saying nothing more. Not when it is equal once
    parsed but says more, which an agent reading the text reads: an object member given twice
    (a parser keeps the last value), an integer past 64 bits (orjson's value is a float, which
    the structured walk does not read as digits). An HTTP upstream's result is its body as
    text and that body parsed as `structuredContent`, so a hostile body would hide a value from
    the structured walk that way."""
    if not text.lstrip().startswith(("{", "[")):
        return False
    try:
        if orjson.loads(text) != structured:
            return False
    except orjson.JSONDecodeError:
        return False
    return _exactly(text, structured)


class _Duplicate(Exception):
    pass


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Duplicate
    return out


def _exactly(text: str, structured: Any) -> bool:
    """Whether the JSON `text` (which orjson parsed) is `structured` read exactly: no object
    member given twice, every integer the same integer (Python's `json` keeps them whole).
    False when that cannot be told (nesting past the interpreter's stack)."""
    try:
        return bool(json.loads(text, object_pairs_hook=_unique_members) == structured)
    except (_Duplicate, RecursionError, ValueError):
        return False


def pieces(result: Mapping[str, Any], labels: OutputLabels, trusted: bool = False) -> Iterator[Piece]:
    """Every string of a tool result an agent can read, with its labels (tracked ones only;
    with `trusted`, the trusted ones too: what they endorse for tainted-run escalation)."""
    structured = result.get("structuredContent")
    content = result.get("content")
    # Content that is not `structuredContent`'s exact copy may hold any part of the output
    # (an HTTP body that did not parse as JSON is text alone; a server's summary quotes a
    # field): where parts are labelled by path, it has the strictest of their labels, not
    # the tool's alone (a trusted tool's untrusted comment is untrusted in its text too).
    loose = labels.widest if labels.paths else labels.base
    if isinstance(content, list):
        for i, item in enumerate(content):
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type")
            where = f"content[{i}]"
            texts: list[str] = []
            if kind == "text" and isinstance(item.get("text"), str):
                if structured is not None and labels.paths and _copy(item["text"], structured):
                    continue
                texts.append(item["text"])
            elif kind == "resource" and isinstance(item.get("resource"), Mapping):
                res = item["resource"]
                texts += [v for v in (res.get("text"), res.get("uri")) if isinstance(v, str)]
            elif kind == "resource_link":
                texts += [v for k in ("uri", "name", "title", "description")
                          if isinstance(v := item.get(k), str)]
            if loose.tracked or trusted:
                for text in texts:
                    yield Piece(text, loose, where)
    if structured is not None:
        for path, text in _strings(structured, (), 0):
            label = labels.at(path)
            if label.tracked or trusted:
                yield Piece(text, label, "structuredContent/" + "/".join(path))
