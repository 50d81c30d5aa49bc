"""Load a policy directory: parse, merge, validate, cross-check and compile, collecting every problem.

The loader is an ordered table of stages (files, parse, merge, validate, cross-check and compile);
each stage adds `PolicyProblem`s with file, line and column and the next stage works on what is
still sound, so one run reports everything wrong with a revision. `load_policy` raises
`PolicyError` with all of them, or returns an immutable `PolicyRevision`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import threading
import time
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from proxy.errors import CelCompileError, PolicyError, PolicyProblem
from proxy.identity import names_problem
from proxy.policy import cel
from proxy.policy.cache import LruCache
from proxy.policy.compiled import (
    CompiledPrincipal,
    CompiledRule,
    CompiledTool,
    Location,
    PolicyRevision,
    Program,
    taint_readers,
)
from proxy.policy.model import (
    PROMPT_KEY,
    RESOURCE_KEY,
    TOOL_KEY,
    UPSTREAM_NAME,
    ContentPolicy,
    DataflowPolicy,
    Defaults,
    PolicyDocument,
    PrincipalPolicy,
    ToolPolicy,
    Upstream,
)
from proxy.policy.revision import policy_revision
from proxy.policy.schemas import compile_schema
from proxy.policy.vocab import did_you_mean, near_miss
from proxy.policy.yamlload import (
    Converter,
    YamlFile,
    child,
    file_duplicate_keys,
    file_has_alias,
    locate,
    mapping_items,
    parse_file,
    position,
    problem,
    read_text,
    release_parsed,
    scalar_position,
)
from proxy.upstream.openapi import Spec, SpecError, SpecUnreadable, load_spec, placed

_SECTIONS: dict[str, type[BaseModel]] = {
    "upstreams": Upstream,
    "tools": ToolPolicy,
    "principals": PrincipalPolicy,
    "resources": ContentPolicy,
    "prompts": ContentPolicy,
}
# Sections keyed `<upstream>.<...>`: the key's pattern and how problems name it.
_UPSTREAM_KEYED = {
    "tools": (TOOL_KEY, "a tool key '<upstream>.<tool>'"),
    "resources": (RESOURCE_KEY, "a resource key '<upstream>.<URI prefix>'"),
    "prompts": (PROMPT_KEY, "a prompt key '<upstream>.<prompt name>'"),
}
_TOP_KEYS = tuple(PolicyDocument.model_fields)
# The `dataflow` fields keyed by sink (`<upstream>.<tool>`, or `default`).
_SINK_KEYED = ("declassify", "critical", "on_flag", "on_tainted", "waive_gate")
# A policy file larger than this is a problem, not read: composing costs about 5 s and 120 MB
# per MB of YAML (an 18 MB file: 86 s and 2.3 GB in `check`), so a 50 MB file dropped into the
# directory would hold a reload for minutes. The same bound as an OpenAPI document's.
MAX_POLICY_FILE_BYTES = 16 * 1024 * 1024

# Parsed files by (name, text), so a reload re-parses only the files that changed (a 1,000-tool
# policy is ~1.9 MB of YAML, ~2 s to compose). Bounded by source size: a parsed file holds ~27
# bytes of nodes per character, so 4 M characters is ~110 MB at most.
# An evicted parse is freed in pieces (`release_parsed`: one cascade stalled calls 60-175 ms).
_PARSED: LruCache[tuple[str, str], tuple[YamlFile | None, tuple[PolicyProblem, ...]]] = LruCache(
    4_000_000, weigh=lambda key, _: len(key[1]), release=release_parsed
)


# Validated entries and compiled tools by content, per engine, across files and revisions: a
# reload of a changed file rebuilds only the entries whose text or place changed (a one-tool
# edit of a 1,000-tool file: one tool instead of 1,000). Two entries a tool: 10,000 holds a
# 2,500-tool revision and the next (a bigger policy still loads, rebuilding every entry).
_ENTRIES: weakref.WeakKeyDictionary[Any, LruCache[tuple[Any, ...], Any]] = (
    weakref.WeakKeyDictionary()
)
_ENTRIES_LOCK = threading.Lock()


def _entries(engine: cel.Engine) -> LruCache[tuple[Any, ...], Any]:
    with _ENTRIES_LOCK:
        cache = _ENTRIES.get(engine)
        if cache is None:
            cache = _ENTRIES[engine] = LruCache(10_000)
        return cache


def _content_key(entry: _Entry) -> tuple[Any, ...] | None:
    """What an entry's validated and compiled forms depend on in its file: the file's name, where
    its key and value start (every location inside follows from there) and the value's text
    (a digest of it: the keys stay small).
    None when that text is not the whole story: an alias (`*x`, `<<: *x`) reads an anchor from
    elsewhere in the file, and a `%TAG` directive changes what an explicit tag means: files with
    either keep only the per-parse memo."""
    node = entry.value
    if node is None:
        return None
    file = entry.file
    whole = file.memo.get("text_is_whole")
    if whole is None:
        whole = file.memo["text_is_whole"] = not (
            file_has_alias(file)
            or re.search(r"^%TAG", file.text, re.M) is not None
        )
    if not whole:
        return None
    text = file.text[node.start_mark.index:node.end_mark.index]
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return (file.name, entry.key.start_mark.line, entry.key.start_mark.column,
            node.start_mark.line, node.start_mark.column, digest)


def _parse_cached(name: str, text: str) -> tuple[YamlFile | None, tuple[PolicyProblem, ...]]:
    def build() -> tuple[YamlFile | None, tuple[PolicyProblem, ...]]:
        parsed, problems = parse_file(name, text)
        if parsed is not None and parsed.root is not None:
            problems += file_duplicate_keys(parsed)
        return parsed, tuple(problems)

    return _PARSED.get_or_build((name, text), build)


def is_policy_name(name: str) -> bool:
    """Whether a file (or directory) named `name` is a policy file by its name: `*.yaml` or
    `*.yml`, not hidden, not a policy test (`*.test.yaml`, `*.test.yml`)."""
    return (name.endswith((".yaml", ".yml")) and not name.startswith(".")
            and not name.endswith((".test.yaml", ".test.yml")))


def policy_tree(directory: Path) -> Iterator[tuple[Path, str]]:
    """Every policy path below `directory`, following symlinks, with its kind: "file" (a
    `*.yaml`/`*.yml` that is not a directory, readable or not), "directory" (a directory named
    like a policy file) or "loop" (a directory link that leads back to a directory it is inside).
    Neither of the last two is entered: the load reports them (a policy file replaced by a
    directory is not a deleted one; a loop would list the tree again at every level).

    Skipped: any path component starting with ".", directories named `tests`, and policy test
    files (`*.test.yaml`, `*.test.yml`). Unordered.
    """
    def walk(path: str, inside: frozenset[str]) -> Iterator[tuple[Path, str]]:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return  # as os.walk: a directory that cannot be listed holds nothing
        for entry in entries:
            name = entry.name
            try:
                is_dir = entry.is_dir()  # follows a link; False when it cannot be followed
            except OSError:
                is_dir = False
            if not is_dir:
                if is_policy_name(name):
                    yield Path(entry.path), "file"
                continue
            if name.startswith(".") or name == "tests":
                continue
            if is_policy_name(name):
                yield Path(entry.path), "directory"
                continue
            real = os.path.realpath(entry.path)
            if real in inside:
                yield Path(entry.path), "loop"
                continue
            yield from walk(entry.path, inside | {real})

    yield from walk(str(directory), frozenset({os.path.realpath(directory)}))


def policy_files(directory: Path) -> list[Path]:
    """Every path of `policy_tree` below `directory`, sorted (a directory and a loop included:
    the parse stage reports them)."""
    found = [path for path, _ in policy_tree(directory)]
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


@dataclass(slots=True)
class _Entry:
    """One keyed entry of a section (`tools.github.create_issue`), with where it came from."""

    section: str
    name: str
    file: YamlFile
    key: Node  # the key node (for "declared here")
    value: Node | None  # None: the key has no value (`tool.key:` alone)

    @property
    def path(self) -> str:
        return self.section if self.name == self.section else f"{self.section}.{self.name}"

    def location(self) -> Location:
        line, col = position(self.key)
        return Location(self.file.name, line, col)


class _Loader:
    def __init__(self, directory: Path, engine: cel.Engine):
        self.directory = directory
        self.engine = engine
        self.problems: list[PolicyProblem] = []
        self.convert = Converter()
        self.files: list[YamlFile] = []
        self.entries: dict[str, dict[str, _Entry]] = {s: {} for s in _SECTIONS}
        self.defaults: _Entry | None = None
        self.dataflow: _Entry | None = None
        self.version: tuple[Any, YamlFile, Node] | None = None

    def add(self, file: YamlFile | str, node: Node | None, message: str) -> None:
        name = file if isinstance(file, str) else file.name
        self.problems.append(problem(name, node, message))

    # -- stage: parse ---------------------------------------------------------------------

    def parse(self, paths: list[Path]) -> None:
        for path in paths:
            name = str(path)
            if path.is_dir() and not is_policy_name(path.name):
                self.problems.append(PolicyProblem(
                    name, 1, 1, f"a directory link that leads back to {os.path.realpath(path)}, a "
                                "directory it is inside (a loop): not entered"))
                continue
            if path.is_dir():
                self.problems.append(PolicyProblem(
                    name, 1, 1, "a directory named like a policy file: not loaded (was a policy "
                                "file replaced by a directory?)"))
                continue
            try:
                size = path.stat().st_size
                if size > MAX_POLICY_FILE_BYTES:
                    self.problems.append(PolicyProblem(
                        name, 1, 1, f"the file is {size} bytes, more than a policy file may be "
                                    f"({MAX_POLICY_FILE_BYTES} bytes): not read"))
                    continue
            except OSError as exc:
                self.problems.append(PolicyProblem(name, 1, 1, f"cannot read: {exc}"))
                continue
            text = read_text(path, name)
            if isinstance(text, PolicyProblem):
                self.problems.append(text)
                continue
            parsed, problems = _parse_cached(name, text)
            self.problems += problems
            if parsed is None:
                continue
            self.files.append(parsed)

    # -- stage: merge ---------------------------------------------------------------------

    def merge(self) -> None:
        for f in self.files:
            if f.root is None:
                continue
            if not isinstance(f.root, MappingNode):
                self.add(f, f.root, "a policy file must be a mapping of sections")
                continue
            if _child(f.root, "openapi")[1] is not None:
                # An HTTP upstream's OpenAPI document kept beside the policy (`openapi:
                # specs/billing.yaml`): read by `load_specs`, not a policy file.
                continue
            for key, value in mapping_items(f.root):
                k = key.value
                if k not in _TOP_KEYS:
                    self.add(f, key, f"unknown top-level key '{k}'{did_you_mean(k, _TOP_KEYS)} "
                                     f"(allowed: {', '.join(_TOP_KEYS)})")
                elif k == "version":
                    self._merge_version(f, value)
                elif k == "defaults":
                    if self.defaults is not None:
                        first = self.defaults.location()
                        self.add(
                            f, key, f"'defaults' may appear in one file only (first at {first})"
                        )
                    else:
                        self.defaults = _Entry("defaults", "defaults", f, key, value)
                elif k == "dataflow":
                    if self.dataflow is not None:
                        first = self.dataflow.location()
                        self.add(
                            f, key, f"'dataflow' may appear in one file only (first at {first})"
                        )
                    else:
                        self.dataflow = _Entry("dataflow", "dataflow", f, key, value)
                else:
                    self._merge_section(f, k, value)

    def _merge_version(self, f: YamlFile, node: Node) -> None:
        value = self.convert.value(node)
        if value != 1 or isinstance(value, bool):
            self.add(f, node, f"unsupported policy version {value!r} (supported: 1)")
        if self.version is None:
            self.version = (value, f, node)
        elif self.version[0] != value:
            line, col = position(self.version[2])
            self.add(
                f,
                node,
                f"version {value!r} disagrees with version {self.version[0]!r} "
                f"at {self.version[1].name}:{line}:{col}",
            )

    def _merge_section(self, f: YamlFile, section: str, node: Node) -> None:
        if _is_null(node):
            return
        if not isinstance(node, MappingNode):
            self.add(f, node, f"'{section}' must be a mapping of names to entries")
            return
        merged = self.entries[section]
        for key, value in mapping_items(node):
            name = key.value
            if name in merged:
                first = merged[name].location()
                self.add(f, key, f"{section} '{name}' is declared twice (first at {first})")
                continue
            empty = _is_null(value)
            merged[name] = _Entry(section, name, f, key, None if empty else value)

    # -- stage: validate ------------------------------------------------------------------

    def validate(self, entry: _Entry, model: type[BaseModel]) -> Any:
        """The entry as `model`, or None after adding a problem per pydantic error.

        A valid entry is kept with its file (a model depends on nothing but the node's data).
        """
        memo_key = ("validated", id(entry.value), model)
        if entry.value is not None and memo_key in entry.file.memo:
            return entry.file.memo[memo_key]
        content = _content_key(entry)
        shared = _entries(self.engine) if content is not None else None
        if shared is not None:
            kept = shared.get(("validated", model, content))
            if kept is not None:
                entry.file.memo[memo_key] = kept
                return kept
        data = self.convert.value(entry.value) if entry.value is not None else {}
        if data is None:
            data = {}
        try:
            valid = model.model_validate(data)
        except ValidationError as exc:
            anchor = entry.value if entry.value is not None else entry.key
            for err in exc.errors():
                loc = tuple(err["loc"])
                where = _dotted(entry.path, loc[:-1] if err["type"] == "extra_forbidden" else loc)
                if err["type"] == "extra_forbidden":
                    node = locate(anchor, loc, key=True)
                    allowed = allowed_fields(model, loc[:-1])
                    message = (f"unknown field '{loc[-1]}'{did_you_mean(str(loc[-1]), allowed)} "
                               f"in {where}")
                    if allowed:
                        message += f" (allowed: {', '.join(allowed)})"
                elif err["type"] == "missing":
                    node = locate(anchor, loc)
                    message = (
                        f"missing required field '{loc[-1]}' in {_dotted(entry.path, loc[:-1])}"
                    )
                else:
                    node = locate(anchor, loc)
                    msg = str(err["msg"]).removeprefix("Value error, ")
                    message = f"{where}: {msg}"
                self.add(entry.file, node, message)
            return None
        if entry.value is not None:
            entry.file.memo[memo_key] = valid
        if shared is not None:
            shared.put(("validated", model, content), valid)
        return valid

    # -- stage: CEL -------------------------------------------------------------------------

    def compile_cel(self, file: YamlFile, node: Node) -> Program | None:
        """A compiled program for the scalar at `node`, or None after adding its problems."""
        expr = self.convert.value(node)
        if not isinstance(expr, str):
            self.add(file, node, "CEL: the expression must be a string")
            return None
        native_checks = self.engine.name == "cel-cpp"
        lint = cel.lint(expr, identifiers=True, result_type=not native_checks)
        undeclared = any(m.startswith("undeclared reference") for _, m in lint)
        problems = [(off, f"CEL: {m}") for off, m in lint]
        program: Program | None = None
        try:
            program = self.engine.compile(expr)
        except CelCompileError as exc:
            # Our own undeclared-variable problem points at the identifier; cel-cpp's at the
            # select after it. Report one, the same for both engines.
            if not (undeclared and str(exc).startswith("undeclared reference")):
                problems.insert(0, (exc.offset, f"CEL: {exc}"))
        for offset, message in problems:
            line, col = scalar_position(file, node, offset)
            self.problems.append(PolicyProblem(file.name, line, col, message))
        return program if not problems else None

    def compile_group(self, file: YamlFile, nodes: list[Node]) -> list[Program | None]:
        """`compile_cel` of each node, as one engine compile when the group proves them all.

        A group is what a check joins into one program (a tool's forbid rules, its allow
        rules, an `allow` list). When every expression is a string the lint passes and the
        engine proves the group (`Engine.compile_group`), each program is compiled on first
        use instead of now; otherwise each is compiled alone, reporting exactly what
        `compile_cel` reports.
        """
        if len(nodes) > 1:
            exprs = [self.convert.value(n) for n in nodes]
            native_checks = self.engine.name == "cel-cpp"
            if all(
                isinstance(e, str) and not cel.lint(e, identifiers=True, result_type=not native_checks)
                for e in exprs
            ):
                programs = self.engine.compile_group(exprs)
                if programs is not None:
                    return list(programs)
        return [self.compile_cel(file, n) for n in nodes]

    def compile_allow(self, entry: _Entry) -> tuple[tuple[Program, ...], bool]:
        """The entry's `allow` expressions compiled; the flag says all compiled."""
        assert entry.value is not None
        _, node = _child(entry.value, "allow")
        if node is None:
            return (), True
        nodes = node.value if isinstance(node, SequenceNode) else [node]
        programs = self.compile_group(entry.file, nodes)
        ok = all(p is not None for p in programs)
        return tuple(p for p in programs if p is not None), ok

    def compile_raw(self, entry: _Entry) -> None:
        """Compile the CEL of an entry that failed validation, so its CEL problems show too."""
        if entry.value is None:
            return
        _, allow = _child(entry.value, "allow")
        nodes = list(allow.value) if isinstance(allow, SequenceNode) else [allow]
        _, rules = _child(entry.value, "rules")
        for rule in rules.value if isinstance(rules, SequenceNode) else []:
            nodes += [_child(rule, kind)[1] for kind in ("forbid", "allow")]
        for node in nodes:
            if isinstance(node, ScalarNode) and isinstance(self.convert.value(node), str):
                self.compile_cel(entry.file, node)

    def load_specs(self, upstreams: dict[str, tuple[_Entry, Upstream]]) -> dict[str, Spec]:
        """The OpenAPI document of every HTTP upstream, read now (a URL is fetched at every
        load). A document that cannot be read is a problem at `openapi:`; one that is not
        usable OpenAPI, a problem at its own file, line and column."""
        specs: dict[str, Spec] = {}
        for name, (entry, upstream) in upstreams.items():
            if upstream.openapi is None:
                continue
            try:
                specs[name] = load_spec(upstream.openapi, Path(entry.file.name).parent)
            except SpecUnreadable as exc:
                node = _child(entry.value, "openapi")[1] if entry.value is not None else None
                self.add(entry.file, node or entry.key, f"upstream '{name}': {placed(exc)[3]}")
            except SpecError as exc:
                file, line, column, message = placed(exc)
                self.problems.append(PolicyProblem(
                    file or entry.file.name, line, column,
                    f"OpenAPI document of upstream '{name}': {message}"))
        return specs

    def _upstream_declared(self, entry: _Entry) -> bool:
        """Whether the upstream an `<upstream>.<...>` key names is declared (else a problem)."""
        upstream = entry.name.partition(".")[0]
        if upstream in self.entries["upstreams"]:
            return True
        declared = ", ".join(sorted(self.entries["upstreams"])) or "none"
        self.add(entry.file, entry.key, f"{entry.section} '{entry.name}': upstream '{upstream}' is "
                 f"not declared under upstreams (declared: {declared})")
        return False

    def sink_keys(self, entry: _Entry, dataflow: DataflowPolicy, defaults: Defaults) -> None:
        """A problem at each sink key of `dataflow` that names no tool a call can reach: its
        upstream is not declared, or (with `unknown_tools: deny`) the tool has no entry under
        `tools`. Such a key is a typo that changes nothing, silently: an `on_tainted: approve`
        meant for `mail.send_email` written for `mail.send_mail` escalates nothing."""
        assert entry.value is not None
        tools = self.entries["tools"]
        upstreams = self.entries["upstreams"]
        for field in _SINK_KEYED:
            for key in getattr(dataflow, field):
                if key == "default":
                    continue
                upstream = key.partition(".")[0]
                if upstream not in upstreams:
                    declared = ", ".join(sorted(upstreams)) or "none"
                    why = f"upstream '{upstream}' is not declared under upstreams (declared: {declared})"
                elif key not in tools and defaults.unknown_tools == "deny":
                    # A near miss among the same upstream's tools, by name ('gh.y' is no typo of 'gh.x').
                    name = key.partition(".")[2]
                    near = near_miss(name, (t.partition(".")[2] for t in tools
                                            if t.partition(".")[0] == upstream))
                    hint = f" (did you mean '{upstream}.{near}'?)" if near is not None else ""
                    why = (f"no tool '{key}' under tools{hint}, and with "
                           "defaults.unknown_tools: deny a tool without one is never called")
                else:
                    continue
                self.add(entry.file, locate(entry.value, (field, key), key=True),
                         f"dataflow.{field} '{key}': {why}")

    # -- stage: tools -----------------------------------------------------------------------

    def tool(self, entry: _Entry, policy: ToolPolicy) -> CompiledTool | None:
        """The compiled tool, or None after adding its problems. One compiled without problems is
        kept with its file: it depends on the node, the key, the engine and whether the upstream
        is declared, all in the key."""
        declared = entry.name.partition(".")[0] in self.entries["upstreams"]
        memo_key = ("tool", id(entry.value), entry.name, self.engine, declared)
        if memo_key in entry.file.memo:
            compiled: CompiledTool = entry.file.memo[memo_key]
            return compiled
        content = _content_key(entry)
        shared_key = ("tool", entry.name, declared, content)
        shared = _entries(self.engine) if content is not None else None
        if shared is not None:
            kept: CompiledTool | None = shared.get(shared_key)
            # The same text validates to an equal model: the kept tool is this entry's.
            if kept is not None and kept.policy == policy:
                entry.file.memo[memo_key] = kept
                return kept
        before = len(self.problems)
        result = self._tool(entry, policy)
        if result is not None and len(self.problems) == before:
            entry.file.memo[memo_key] = result
            if shared is not None:
                shared.put(shared_key, result)
        return result

    def _tool(self, entry: _Entry, policy: ToolPolicy) -> CompiledTool | None:
        ok = True
        upstream, _, name = entry.name.partition(".")
        if upstream not in self.entries["upstreams"]:
            declared = ", ".join(sorted(self.entries["upstreams"])) or "none"
            self.add(
                entry.file,
                entry.key,
                f"tool '{entry.name}': upstream '{upstream}' is not declared under upstreams "
                f"(declared: {declared})",
            )
            ok = False
        allow: tuple[Program, ...] = ()
        if policy.allow is not None:
            allow, allow_ok = self.compile_allow(entry)
            ok = ok and allow_ok
        validator = None
        if policy.input_schema is not None:
            validator = self.schema(entry, policy.input_schema)
            ok = ok and validator is not None
        forbid_rules: list[CompiledRule] = []
        allow_rules: list[CompiledRule] = []
        seen: dict[str, Node] = {}
        assert entry.value is not None or not policy.rules
        # (index, id, the rule's node, its expression's node) per rule, grouped by kind in file
        # order: each kind is compiled as the group `ArgRulesCheck` joins.
        groups: dict[str, list[tuple[int, str, Node, Node]]] = {"forbid": [], "allow": []}
        rules_node = _child(entry.value, "rules")[1] if entry.value is not None else None
        for index, rule in enumerate(policy.rules):
            assert entry.value is not None
            # The rule's node as `locate` walks to it from the entry, the walk done once.
            base: Node = entry.value
            path: tuple[str | int, ...] = ("rules", index)
            if isinstance(rules_node, SequenceNode) and index < len(rules_node.value):
                base, path = rules_node.value[index], ()
            rule_node = locate(base, path)
            rule_id = rule.id or f"{entry.name}#{index + 1}"
            id_node = locate(base, (*path, "id")) if rule.id else rule_node
            if rule_id in seen:
                line, col = position(seen[rule_id])
                self.add(
                    entry.file,
                    id_node,
                    f"duplicate rule id '{rule_id}' in {entry.path} "
                    f"(first at {entry.file.name}:{line}:{col})",
                )
                ok = False
            else:
                seen[rule_id] = id_node
            expr_node = locate(base, (*path, rule.kind))
            groups[rule.kind].append((index, rule_id, rule_node, expr_node))
        for kind, members in groups.items():
            programs = self.compile_group(entry.file, [m[3] for m in members])
            for (index, rule_id, rule_node, _), program in zip(members, programs, strict=True):
                if program is None:
                    ok = False
                    continue
                rule = policy.rules[index]
                verb = "forbidden" if kind == "forbid" else "allowed"
                line, col = position(rule_node)
                compiled = CompiledRule(
                    id=rule_id,
                    kind=rule.kind,
                    program=program,
                    reason=rule.reason or f"{verb} by rule {rule_id}",
                    location=Location(entry.file.name, line, col),
                )
                (forbid_rules if kind == "forbid" else allow_rules).append(compiled)
        if not ok:
            return None
        fallback = policy.fallback or ("deny" if allow_rules else "allow")
        return CompiledTool(
            key=entry.name,
            upstream=upstream,
            name=name,
            policy=policy,
            allow=allow,
            rules=(*forbid_rules, *allow_rules),
            fallback=fallback,
            schema_validator=validator,
            location=entry.location(),
        )

    def schema(self, entry: _Entry, schema: dict[str, object]) -> Any:
        assert entry.value is not None
        _, node = _child(entry.value, "schema")
        anchor = node if node is not None else entry.key
        if schema.get("type") != "object":
            self.add(
                entry.file, anchor, f'{entry.path}.schema: the root must have "type": "object"'
            )
            return None
        try:
            return compile_schema(schema)
        except Exception as exc:
            message = str(getattr(exc, "message", None) or exc).split("\n", 1)[0]
            path = [p for p in getattr(exc, "instance_path", []) or []]
            at = locate(anchor, path) if path else anchor
            where = "".join(f"/{p}" for p in path)
            self.add(entry.file, at, f"{entry.path}.schema{where}: invalid JSON Schema: {message}")
            return None

    # -- all stages ---------------------------------------------------------------------------

    def run(self) -> PolicyRevision:
        directory = self.directory
        if not directory.is_dir():
            what = ("a file, not a directory: a policy is the directory of its files"
                    if directory.exists() else "policy directory not found")
            raise PolicyError([PolicyProblem(str(directory), 1, 1, what)])
        paths = policy_files(directory)
        if not paths:
            raise PolicyError(
                [PolicyProblem(str(directory), 1, 1, f"no policy files in {directory}")]
            )
        self.parse(paths)
        self.merge()

        validated: dict[str, dict[str, tuple[_Entry, Any]]] = {s: {} for s in _SECTIONS}
        for section, model in _SECTIONS.items():
            pattern, what = (
                (UPSTREAM_NAME, "an upstream name")
                if section == "upstreams"
                else _UPSTREAM_KEYED.get(section, (None, ""))
            )
            for name, entry in self.entries[section].items():
                if pattern is not None and not pattern.match(name):
                    self.add(
                        entry.file,
                        entry.key,
                        f"'{name}' is not {what} (must match {pattern.pattern})",
                    )
                    continue
                if section == "principals" and (problem := names_problem("principal", [name])):
                    # An entry no verified identity can carry (`proxy.identity` refuses such
                    # ids) would be policy that silently never applies.
                    self.add(entry.file, entry.key, problem)
                    continue
                if section in ("resources", "prompts") and not self._upstream_declared(entry):
                    continue
                value = self.validate(entry, model)
                if value is not None:
                    validated[section][name] = (entry, value)
                elif section != "upstreams":
                    self.compile_raw(entry)
        defaults = Defaults()
        if self.defaults is not None:
            defaults = self.validate(self.defaults, Defaults) or defaults
        dataflow: DataflowPolicy | None = None
        if self.dataflow is not None:
            dataflow = self.validate(self.dataflow, DataflowPolicy)
            if dataflow is not None:
                self.sink_keys(self.dataflow, dataflow, defaults)

        # The tools' rule groups compile in worker processes (a cold load of many tools) while
        # this thread lints their expressions and compiles their schemas (cached by text: the
        # tools stage then finds them). A reload that changed little sends nothing: its tools
        # stage rebuilds only the changed entries, and warming all would be wasted.
        precompiling = self.engine.precompile(_groups(validated))
        try:
            if precompiling.started:
                _warm(validated, self.engine)
        finally:
            precompiling.finish()
        tools: dict[str, CompiledTool] = {}
        for name, (entry, policy) in validated["tools"].items():
            compiled_tool = self.tool(entry, policy)
            if compiled_tool is not None:
                tools[name] = compiled_tool
        principals: dict[str, CompiledPrincipal] = {}
        for name, (entry, ppolicy) in validated["principals"].items():
            allow: tuple[Program, ...] = ()
            ok = True
            if ppolicy.allow is not None:
                allow, ok = self.compile_allow(entry)
            if ok:
                principals[name] = CompiledPrincipal(name, ppolicy, allow, entry.location())

        specs = self.load_specs(validated["upstreams"])
        if dataflow is not None and dataflow.mode == "off":
            # No ledger is kept, so run.tainted / run.secret could never be true.
            for what, where in taint_readers(tools.values(), principals.values()):
                at = where or Location("<policy>", 1, 1)
                self.problems.append(PolicyProblem(
                    at.file, at.line, at.column,
                    f"{what} reads run.tainted / run.secret, but dataflow.mode is off: no run ledger "
                    "is kept, so they would always be false; use shadow or enforce"))
        if self.problems:
            self.problems.sort(key=lambda p: (p.file, p.line, p.column))
            raise PolicyError(self.problems)
        document = PolicyDocument(
            version=1,
            upstreams={n: v for n, (_, v) in validated["upstreams"].items()},
            defaults=defaults,
            tools={n: v for n, (_, v) in validated["tools"].items()},
            principals={n: v for n, (_, v) in validated["principals"].items()},
            dataflow=dataflow,
            resources={n: v for n, (_, v) in validated["resources"].items()},
            prompts={n: v for n, (_, v) in validated["prompts"].items()},
        )
        locations = {
            f"{section}.{name}": entry.location()
            for section, entries in self.entries.items()
            for name, entry in entries.items()
        }
        if self.defaults is not None:
            locations["defaults"] = self.defaults.location()
        if self.dataflow is not None:
            locations["dataflow"] = self.dataflow.location()
        return PolicyRevision(
            revision=policy_revision(directory, paths),
            directory=directory,
            files=tuple(paths),
            document=document,
            tools=types.MappingProxyType(tools),
            principals=types.MappingProxyType(principals),
            engine=self.engine.name,
            cel=self.engine,
            loaded_at=time.time(),
            locations=types.MappingProxyType(locations),
            specs=types.MappingProxyType(specs),
        )


def _groups(validated: dict[str, dict[str, tuple[_Entry, Any]]]) -> Iterator[list[str]]:
    """The CEL groups the tools stage will compile (`_Loader.compile_group`), in its order:
    each tool's `allow` list, forbid rules and allow rules, then each principal's `allow`."""
    for _, policy in validated["tools"].values():
        if policy.allow:
            yield list(policy.allow)
        for kind in ("forbid", "allow"):
            yield [rule.expr for rule in policy.rules if rule.kind == kind]
    for _, principal in validated["principals"].values():
        if principal.allow:
            yield list(principal.allow)


def _warm(validated: dict[str, dict[str, tuple[_Entry, Any]]], engine: cel.Engine) -> None:
    """Fill the caches the tools stage reads, ahead of it: the lint of every expression it
    compiles (`_Loader.compile_group`) and every tool's JSON Schema validator. Problems
    are left for that stage to find again and report."""
    result_type = engine.name != "cel-cpp"
    for group in _groups(validated):
        for expr in group:
            cel.lint(expr, identifiers=True, result_type=result_type)
    for _, policy in validated["tools"].values():
        schema = policy.input_schema
        if schema is not None and schema.get("type") == "object":
            with contextlib.suppress(Exception):
                compile_schema(schema)


def load_policy(
    directory: Path, engine: cel.Engine | str = "auto", *, freeze: bool = False
) -> PolicyRevision:
    """Load, validate and compile every policy file under `directory`.

    `engine` is the CEL engine to compile with (the runtime passes the one it keeps, so every
    revision shares it), or its name (`auto`, `cel-cpp`, `cel-python`: a new engine is built).
    `freeze`: for the load a process keeps for its whole life (the start-up revision, frozen
    before serving anyway): what the load allocated is moved out of the collector's sight
    (`gc.freeze()`) instead of traversed by a collection at the end (`collector_paused`).
    Raises `PolicyError` carrying every problem found, each with file, 1-based line and column
    (an unknown or missing engine is one at the directory); never returns a partial revision.
    """
    directory = Path(directory)
    if isinstance(engine, str):
        try:
            engine = cel.get_engine(engine)
        except CelCompileError as exc:
            raise PolicyError([PolicyProblem(str(directory), 1, 1, str(exc))]) from exc
    with collector_paused(freeze=freeze):
        revision = _Loader(directory, engine).run()
        join_groups(revision)
    return revision


def join_groups(revision: PolicyRevision) -> None:
    """Compile now, in the loading thread, the joined programs the checks build from `revision`
    (`ArgRulesCheck`: each tool's forbid rules and allow rules, `AuthzCheck`: each `allow`
    list, all in file order); the chain, built on the event loop, then finds every one in the
    engine's cache instead of compiling there (~2 s for 1,000 tools, cold)."""
    engine = revision.cel
    for tool in revision.tools.values():
        for kind in ("forbid", "allow"):
            group = [r.program.source for r in tool.rules if r.kind == kind]
            if group:
                engine.compile_any(group)
        if tool.allow:
            engine.compile_any([p.source for p in tool.allow])
    for principal in revision.principals.values():
        if principal.allow:
            engine.compile_any([p.source for p in principal.allow])


# Pauses in progress (loads in several threads at once), and whether to re-enable the cyclic
# collector when the last ends.
_PAUSE = threading.Lock()
_pauses = 0
_resume = False
_freeze = False


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """No cyclic garbage collection for the duration, process-wide.

    A 1,000-tool load allocates ~750,000 container objects that all stay alive, and the
    collector keeps answering with full collections over everything alive (the previous
    revision included): half the time of a cold load, and the event loop waits while each runs
    (bench/RESULTS.md "Policy load at scale"). Reference counting still frees everything
    acyclic. When the last concurrent load ends the collector comes back with one collection
    of the young generations, here in the loading thread: it costs what the load allocated (a
    reload of one small file, little; 0.7-1.3 s after 1,000 tools), and left to the
    thresholds it would run on the next allocation, often the event loop building the chain.
    Full collections stay with the thresholds, as without the pause.

    With `freeze` (any of the concurrent pauses asking, each ending without an exception), the
    last to end moves everything alive out of the collector's sight (`gc.freeze()`) instead:
    no traversal (0.2-0.35 s after a cold 1,000-tool load), and cyclic garbage made meanwhile
    is kept for good, so only for objects kept for life: the start-up revision, or a reloaded
    one under `reload.Collector` (which sweeps now and then). A pause that raises freezes
    nothing: its garbage goes to the young collection.
    """
    global _pauses, _resume, _freeze
    with _PAUSE:
        if _pauses == 0:
            _resume = gc.isenabled()
            _freeze = False
            gc.disable()
        _pauses += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        with _PAUSE:
            _freeze = _freeze or (freeze and ok)
            _pauses -= 1
            last = _pauses == 0
            frozen = last and _freeze
            if frozen:
                gc.freeze()  # before the collector can run again
            resume = last and _resume
            if resume:
                gc.enable()
        if resume and not frozen:
            gc.collect(1)


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and (node.tag or "").endswith(":null")


def _child(node: Node, key: str) -> tuple[Node | None, Node | None]:
    if not isinstance(node, MappingNode):
        return None, None
    return child(node, key)


def _dotted(base: str, loc: tuple[Any, ...]) -> str:
    out = base
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _unwrap(tp: Any) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        return _unwrap(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else tp
    return tp


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model at `loc` below `model` (through optionals, lists and dicts)."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = next((f for n, f in tp.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return None
            tp = field.annotation
        elif get_origin(tp) in (list, dict):
            tp = get_args(tp)[-1]
        else:
            return None
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def allowed_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names (aliases where a field has one) of the model at `loc` below `model`;
    [] when `loc` leads to no model."""
    target = _model_at(model, loc)
    if target is None:
        return []
    return [f.alias or n for n, f in target.model_fields.items()]
