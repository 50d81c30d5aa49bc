"""Test helpers for the envelope checks: build a compiled `PolicyRevision` like the loader."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from proxy.envelope.types import Principal, RequestInfo, RunContext, ToolCall, ToolInfo, run_key
from proxy.policy.cel import Engine, available_engines, get_engine
from proxy.policy.compiled import CompiledPrincipal, CompiledRule, CompiledTool, PolicyRevision
from proxy.policy.model import PolicyDocument
from proxy.policy.schemas import compile_schema

T = TypeVar("T")
R = TypeVar("R")

ENGINES = available_engines()


@functools.cache
def engine_named(name: str) -> Engine:
    """One engine per name for the whole test session, as one runtime keeps one (building a
    cel-python engine per revision would cost ~25 ms a test)."""
    return get_engine(name)


def build_revision(doc: dict[str, Any], engine: str = "cel-cpp") -> PolicyRevision:
    """Validate `doc` and compile it: CEL programs, rules (forbid first), fallback, schema."""
    eng = engine_named(engine)
    document = PolicyDocument.model_validate(doc)
    tools: dict[str, CompiledTool] = {}
    for key, policy in document.tools.items():
        upstream, name = key.split(".", 1)
        rules = [
            CompiledRule(
                id=rule.id or f"{key}#{index}",
                kind=rule.kind,
                program=eng.compile(rule.expr),
                reason=rule.reason or f"rule {rule.id or f'{key}#{index}'} ({rule.kind})",
            )
            for index, rule in enumerate(policy.rules)
        ]
        rules.sort(key=lambda r: r.kind != "forbid")
        has_allow = any(r.kind == "allow" for r in rules)
        tools[key] = CompiledTool(
            key=key,
            upstream=upstream,
            name=name,
            policy=policy,
            allow=tuple(eng.compile(e) for e in policy.allow or ()),
            rules=tuple(rules),
            fallback=policy.fallback or ("deny" if has_allow else "allow"),
            schema_validator=(
                compile_schema(policy.input_schema) if policy.input_schema else None
            ),
        )
    principals = {
        pid: CompiledPrincipal(id=pid, policy=p, allow=tuple(eng.compile(e) for e in p.allow or ()))
        for pid, p in document.principals.items()
    }
    return PolicyRevision(
        revision="test",
        directory=Path("."),
        files=(),
        document=document,
        tools=tools,
        principals=principals,
        engine=eng.name,
        cel=eng,
    )


UPSTREAMS = {"demo": {"url": "http://127.0.0.1:9/mcp"}}
# Where the state of `make_call`'s default run lives (principal "agent", run "run-1").
RUN_KEY = run_key("agent", "run-1")


def make_call(
    tool: str = "echo",
    args: dict[str, Any] | None = None,
    *,
    upstream: str = "demo",
    principal: str | Principal = "agent",
    info: ToolInfo | None = None,
) -> ToolCall:
    return ToolCall(
        decision_id="d-1",
        upstream=upstream,
        tool=tool,
        arguments=args if args is not None else {},
        principal=principal if isinstance(principal, Principal) else Principal(principal),
        run=RunContext("run-1", principal.id if isinstance(principal, Principal) else principal),
        request=RequestInfo("tools/call"),
        upstream_tool=info,
    )


# What each native data-flow module is, for the reason a test skips without it.
_NATIVE_NAMES = {"_winnow": "native winnowing extension", "_tokens": "native token scan"}


def native_or_skip(module: str) -> Any:
    """The native data-flow module `module` ("_winnow" or "_tokens") as fingerprint.py loaded
    it. The test skips when it is not built (a machine with no C compiler); under
    ENVELOPE_REQUIRE_NATIVE=1 (CI, `.ci/run`) it fails instead, so a broken build cannot pass
    silently."""
    from proxy.envelope.dataflow import fingerprint

    loaded = {"_winnow": fingerprint._native, "_tokens": fingerprint._native_tokens}[module]
    if loaded is not None:
        return loaded
    reason = f"the {_NATIVE_NAMES[module]} is not built (proxy.envelope.dataflow.{module})"
    if os.environ.get("ENVELOPE_REQUIRE_NATIVE") == "1":
        pytest.fail(f"ENVELOPE_REQUIRE_NATIVE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def each_in_a_thread(fn: Callable[[T], R], items: Sequence[T], rounds: int = 5) -> list[R]:
    """`fn` of every item, in one thread per item, all running at once (`rounds` times each: the
    native functions release the GIL on large inputs, so the threads overlap); the last results,
    in the items' order."""
    got: dict[int, R] = {}

    def work(i: int) -> None:
        for _ in range(rounds):
            got[i] = fn(items[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [got[i] for i in range(len(items))]

