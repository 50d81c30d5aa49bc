"""Compiled artefacts are kept across revisions: same text, same object; changed text, recompiled;
and a revision built from the caches decides exactly as a cold one."""

from __future__ import annotations

import gc
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.envelope.checks.arg_rules import ArgRulesCheck
from proxy.envelope.checks.authz import AuthzCheck
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Principal, RequestInfo, RunContext, ToolCall
from proxy.errors import CelCompileError, PolicyError
from proxy.policy import cel, loader, schemas
from proxy.policy.cache import LruCache
from proxy.policy.compiled import PolicyRevision
from proxy.policy.loader import load_policy
from proxy.policy.schemas import compile_schema


def test_lru_returns_the_built_value_until_evicted() -> None:
    cache: LruCache[str, object] = LruCache(2)
    a = cache.get_or_build("a", object)
    assert cache.get_or_build("a", object) is a
    cache.get_or_build("b", object)
    cache.get_or_build("a", object)  # a is now the most recent
    cache.get_or_build("c", object)  # evicts b, the least recent
    assert len(cache) == 2
    assert cache.get_or_build("a", object) is a
    assert (cache.hits, cache.misses) == (3, 3)
    cache.get_or_build("b", object)
    assert cache.misses == 4


def test_lru_weighs_entries_and_caches_no_failure() -> None:
    cache: LruCache[str, str] = LruCache(10, weigh=lambda key, value: len(value))
    cache.get_or_build("a", lambda: "x" * 6)
    cache.get_or_build("b", lambda: "y" * 6)  # 12 > 10: a goes
    assert cache.get_or_build("a", lambda: "new") == "new"

    def fail() -> str:
        raise ValueError("bad")

    for _ in range(2):
        with pytest.raises(ValueError):
            cache.get_or_build("f", fail)
    assert cache.misses == 5


def test_engine_compiles_a_text_once(engine: str) -> None:
    eng = cel.get_engine(engine)
    first = eng.compile('args.repo.startsWith("corp/")')
    assert eng.compile('args.repo.startsWith("corp/")') is first
    changed = eng.compile('args.repo.startsWith("corp/x")')
    assert changed is not first and changed.source == 'args.repo.startsWith("corp/x")'
    group = eng.compile_any(["args.a == 1", "args.b == 2"])
    assert eng.compile_any(["args.a == 1", "args.b == 2"]) is group
    assert eng.compile_any(["args.b == 2", "args.a == 1"]) is not group
    # A text that does not compile is reported every time, never remembered as a program.
    for _ in range(2):
        with pytest.raises(CelCompileError):
            eng.compile("args.a ==")


def test_engines_keep_their_own_programs() -> None:
    if "cel-cpp" not in cel.available_engines():
        pytest.skip("cel-cpp is not installed")
    one, two = cel.get_engine("cel-cpp"), cel.get_engine("cel-cpp")
    assert one.compile("args.a == 1") is not two.compile("args.a == 1")


def test_lint_results_are_the_callers_own() -> None:
    found = cel.lint("principal.grups == 1")
    assert found == cel.lint("principal.grups == 1")
    found.clear()
    assert cel.lint("principal.grups == 1") != []


def test_schema_validator_is_reused_for_the_same_json() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}}
    first = compile_schema(schema)
    assert compile_schema({"type": "object", "properties": {"n": {"type": "integer"}}}) is first
    changed = compile_schema({"type": "object", "properties": {"n": {"type": "string"}}})
    assert changed is not first
    assert changed.is_valid({"n": "x"}) and not first.is_valid({"n": "x"})
    # Same content, another key order: compiled on its own (order can decide the first error).
    assert compile_schema({"properties": {"n": {"type": "integer"}}, "type": "object"}) is not first


POLICY = """
version: 1
upstreams:
  demo: {url: "http://127.0.0.1:9/mcp"}
principals:
  agent: {capability: read-write}
tools:
  demo.search:
    effect: read
    schema:
      type: object
      properties: {repo: {type: string, maxLength: 40}, n: {type: integer}}
    allow: ['principal.id == "agent"']
    rules:
      - {id: no-vault, forbid: 'args.repo.contains("vault")'}
      - {id: no-secret, forbid: 'args.repo.matches("^corp/secret-[a-z]+$")'}
      - {id: corp, allow: 'args.repo.startsWith("corp/")'}
    fallback: deny
  demo.write:
    effect: write
    rules:
      - {id: small, forbid: 'has(args.n) && args.n > LIMIT'}
"""


def write_policy(directory: Path, limit: int = 10) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = textwrap.dedent(POLICY).replace("LIMIT", str(limit))
    (directory / "demo.yaml").write_text(text, encoding="utf-8")


def decisions(revision: PolicyRevision) -> list[str]:
    """What the authz and argument-rules checks decide for a fixed set of calls."""
    registry = ToolRegistry()
    checks: list[Any] = [AuthzCheck(revision, registry), ArgRulesCheck(revision, registry)]
    calls = [
        ("search", "agent", {"repo": "corp/docs"}),
        ("search", "agent", {"repo": "corp/vault"}),
        ("search", "agent", {"repo": "corp/secret-plans"}),
        ("search", "agent", {"repo": "oss/x"}),
        ("search", "mallory", {"repo": "corp/docs"}),
        ("write", "agent", {"n": 5}),
        ("write", "agent", {"n": 50}),
    ]
    out = []
    for tool, principal, args in calls:
        call = ToolCall(
            decision_id="d-1", upstream="demo", tool=tool, arguments=args,
            principal=Principal(principal), run=RunContext("run-1", principal),
            request=RequestInfo("tools/call"),
        )
        verdict = "allow"
        for check in checks:
            decision = check.decide(call)
            if decision is not None:
                verdict = f"{decision.code} {decision.rule}"
                break
        out.append(verdict)
    return out


def cold_load(directory: Path, engine: str) -> PolicyRevision:
    for cache in (cel._lint, cel._lint_parsed, cel._shape, cel._parse, cel._parsed_sites,
                  cel._re2_compile):
        cache.cache_clear()
    schemas._VALIDATORS.clear()
    loader._PARSED.clear()
    return load_policy(directory, engine=cel.get_engine(engine))


def test_a_reload_reuses_what_did_not_change(tmp_path: Path, engine: str) -> None:
    directory = tmp_path / "policy"
    write_policy(directory)
    eng = cel.get_engine(engine)
    first = load_policy(directory, engine=eng)
    again = load_policy(directory, engine=eng)
    assert again.tools["demo.search"] is first.tools["demo.search"]
    write_policy(directory, limit=20)
    changed = load_policy(directory, engine=eng)
    # One file changed: a tool whose text and place did not change is kept whole; the changed
    # rule is a new program.
    search, old_search = changed.tools["demo.search"], first.tools["demo.search"]
    assert search is old_search
    assert all(new.program is old.program
               for new, old in zip(search.rules, old_search.rules, strict=True))
    assert search.schema_validator is old_search.schema_validator
    new_rule, old_rule = changed.tools["demo.write"].rules[0], first.tools["demo.write"].rules[0]
    assert new_rule.program is not old_rule.program
    assert new_rule.program.source == "has(args.n) && args.n > 20"


def test_a_cached_revision_decides_as_a_cold_one(tmp_path: Path, engine: str) -> None:
    directory = tmp_path / "policy"
    write_policy(directory, limit=20)
    cold = decisions(cold_load(directory, engine))
    eng = cel.get_engine(engine)
    write_policy(directory, limit=10)
    load_policy(directory, engine=eng)  # fills the caches with another revision
    write_policy(directory, limit=20)
    warm = decisions(load_policy(directory, engine=eng))
    assert warm == cold
    assert cold == [
        "allow", "capability_blocked no-vault", "capability_blocked no-secret",
        "capability_blocked demo.search#fallback", "unauthorized tools.demo.search.allow",
        "allow", "capability_blocked small",
    ]


def test_problems_are_reported_on_every_load(
    tmp_path: Path, engine: str, write: Callable[[str, str], Path]
) -> None:
    write("a.yaml", """
        version: 1
        upstreams:
          demo: {url: "http://127.0.0.1:9/mcp"}
        tools:
          demo.t:
            rules:
              - {forbid: 'args.a =='}
        """)
    eng = cel.get_engine(engine)
    with pytest.raises(PolicyError) as exc:
        load_policy(tmp_path / "policy", engine=eng)
    first = [str(p) for p in exc.value.problems]
    with pytest.raises(PolicyError) as exc:
        load_policy(tmp_path / "policy", engine=eng)
    second = [str(p) for p in exc.value.problems]
    assert first == second and first


def test_the_chain_finds_the_joined_programs_the_load_compiled(tmp_path: Path, engine: str) -> None:
    # The load (a reload's worker thread) compiles each rule group and allow list as one
    # program; building the checks (on the event loop) compiles nothing.
    directory = tmp_path / "policy"
    write_policy(directory)
    eng = cel.get_engine(engine)
    revision = load_policy(directory, engine=eng)
    caches = (eng._joined, eng._programs)  # type: ignore[attr-defined]
    misses = [c.misses for c in caches]
    hits = caches[0].hits
    registry = ToolRegistry()
    AuthzCheck(revision, registry), ArgRulesCheck(revision, registry)
    assert [c.misses for c in caches] == misses
    assert caches[0].hits > hits  # demo.search's forbid group at least


def test_a_proven_rule_is_compiled_once_when_first_needed(tmp_path: Path) -> None:
    # Under cel-cpp the load compiles demo.search's two forbid rules only as their joined
    # group; naming the rule that matched compiles that rule, once, on the first call needing it.
    if "cel-cpp" not in cel.available_engines():
        pytest.skip("cel-cpp is not installed")
    directory = tmp_path / "policy"
    write_policy(directory)
    eng = cel.get_engine("cel-cpp")
    revision = load_policy(directory, engine=eng)
    single = eng._programs  # type: ignore[attr-defined]
    rules = {r.id: r.program for r in revision.tools["demo.search"].rules}
    assert single.get(rules["no-vault"].source) is None
    assert single.get(rules["no-secret"].source) is None
    assert single.get(rules["corp"].source) is not None  # a group of one is its own program
    verdicts = decisions(revision)
    assert verdicts[1:3] == ["capability_blocked no-vault", "capability_blocked no-secret"]
    # Naming no-secret evaluated no-vault first: both are compiled now.
    assert single.get(rules["no-vault"].source) is not None
    assert single.get(rules["no-secret"].source) is not None
    misses = single.misses
    assert decisions(revision) == verdicts
    assert single.misses == misses  # compiled once: the second round compiles nothing


def test_a_load_pauses_the_cyclic_collector_and_gives_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "policy"
    write_policy(directory)
    during: list[bool] = []
    join = loader.join_groups
    monkeypatch.setattr(loader, "join_groups", lambda rev: (during.append(gc.isenabled()), join(rev)))
    assert gc.isenabled()
    load_policy(directory)
    assert during == [False] and gc.isenabled()
    (directory / "demo.yaml").write_text("version: 1\ntools: [\n", encoding="utf-8")
    with pytest.raises(PolicyError):
        load_policy(directory)
    assert gc.isenabled()
    gc.disable()  # a process that turned it off keeps it off
    try:
        write_policy(directory)
        load_policy(directory)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert during == [False, False]


def test_concurrent_pauses_end_with_the_last() -> None:
    with loader.collector_paused():
        with loader.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def _tool_yaml(i: int, limit: int = 10, extra_line: bool = False) -> str:
    comment = "    # a longer entry now\n" if extra_line else ""
    return (f"  demo.t{i}:\n{comment}    effect: read\n    rules:\n"
            f"      - {{id: r{i}, forbid: 'has(args.n) && args.n > {limit}'}}\n"
            f"      - {{id: s{i}, forbid: 'args.q.matches(\"^x*{i}$\")'}}\n")


def _write_tools(directory: Path, tools: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    head = "version: 1\nupstreams:\n  demo: {url: \"http://127.0.0.1:9/mcp\"}\ntools:\n"
    (directory / "tools.yaml").write_text(head + "".join(tools), encoding="utf-8")


def test_an_edited_file_rebuilds_only_the_entries_that_changed(tmp_path: Path, engine: str) -> None:
    directory = tmp_path / "policy"
    _write_tools(directory, [_tool_yaml(i) for i in range(4)])
    eng = cel.get_engine(engine)
    first = load_policy(directory, engine=eng)
    _write_tools(directory, [_tool_yaml(i, limit=20 if i == 1 else 10) for i in range(4)])
    edited = load_policy(directory, engine=eng)
    assert edited.tools["demo.t1"] is not first.tools["demo.t1"]
    assert edited.tools["demo.t1"].rules[0].program.source == "has(args.n) && args.n > 20"
    for key in ("demo.t0", "demo.t2", "demo.t3"):
        assert edited.tools[key] is first.tools[key]


def test_an_entry_that_moved_is_rebuilt_at_its_new_place(tmp_path: Path, engine: str) -> None:
    directory = tmp_path / "policy"
    _write_tools(directory, [_tool_yaml(i) for i in range(3)])
    eng = cel.get_engine(engine)
    first = load_policy(directory, engine=eng)
    _write_tools(directory, [_tool_yaml(i, extra_line=i == 0) for i in range(3)])
    moved = load_policy(directory, engine=eng)
    assert moved.tools["demo.t2"] is not first.tools["demo.t2"]
    # Exactly what a process that never saw the first text reports.
    fresh = cold_load(directory, engine)
    for key, tool in fresh.tools.items():
        assert moved.tools[key].location == tool.location
        assert [r.location for r in moved.tools[key].rules] == [r.location for r in tool.rules]
    assert moved.tools["demo.t2"].rules[0].location != first.tools["demo.t2"].rules[0].location
    # Rebuilt, but from the same text: the very same programs.
    assert moved.tools["demo.t2"].rules[0].program is first.tools["demo.t2"].rules[0].program


def test_an_alias_is_read_from_its_anchor_after_an_edit(tmp_path: Path, engine: str) -> None:
    # `demo.b`'s text is unchanged, but its rules come from `demo.a`'s anchor, which changed.
    directory = tmp_path / "policy"
    eng = cel.get_engine(engine)
    for limit in (10, 20):
        _write_tools(directory, [
            f"  demo.a:\n    rules: &shared\n      - {{forbid: 'args.n > {limit}'}}\n",
            "  demo.b:\n    rules: *shared\n",
        ])
        revision = load_policy(directory, engine=eng)
        assert revision.tools["demo.b"].rules[0].program.source == f"args.n > {limit}"


def test_a_load_asked_to_freeze_leaves_its_objects_out_of_the_collector(tmp_path: Path) -> None:
    directory = tmp_path / "policy"
    write_policy(directory)
    gc.collect()
    before = gc.get_freeze_count()
    try:
        revision = load_policy(directory, freeze=True)
        assert gc.isenabled()
        assert gc.get_freeze_count() > before
        alive = {id(o) for o in gc.get_objects()}  # every generation but the frozen one
        assert id(revision.tools) not in alive and id(revision.document) not in alive
        # Without it, the load ends with a collection: its revision is in a generation.
        other = load_policy(directory)
        assert id(other.document) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
