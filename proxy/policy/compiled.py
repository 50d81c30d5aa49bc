"""The compiled form of one policy revision: built once per load, immutable, shared by checks.

`proxy.policy.loader.load_policy(dir)` produces a `PolicyRevision`; checks read it and never
re-parse YAML or recompile CEL on the request path.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from proxy.policy.cel import Engine
    from proxy.upstream.openapi import Spec


@dataclass(frozen=True, slots=True)
class Location:
    """A place in a policy file (1-based line and column)."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class Program(Protocol):
    """A compiled CEL boolean expression (see `proxy.policy.cel`)."""

    source: str

    def evaluate(self, activation: Any) -> bool:
        """True/False; raises `proxy.errors.CelEvalError` on a runtime error or non-bool."""
        ...


@dataclass(frozen=True, slots=True)
class CompiledRule:
    id: str
    kind: Literal["forbid", "allow"]
    program: Program
    reason: str
    location: Location | None = None


@dataclass(frozen=True, slots=True)
class CompiledTool:
    """One `tools:` entry, compiled. `key` is `<upstream>.<tool>`."""

    key: str
    upstream: str
    name: str
    policy: Any  # proxy.policy.model.ToolPolicy
    allow: tuple[Program, ...] = ()  # authorization (any true authorizes); empty: no condition
    rules: tuple[CompiledRule, ...] = ()  # forbid rules first, then allow rules, in file order
    fallback: Literal["allow", "deny"] = "allow"
    # Compiled input schema override (jsonschema_rs validator), None when the policy has none.
    schema_validator: Any = None
    location: Location | None = None


@dataclass(frozen=True, slots=True)
class CompiledPrincipal:
    id: str
    policy: Any  # proxy.policy.model.PrincipalPolicy
    allow: tuple[Program, ...] = ()
    location: Location | None = None


# CEL that reads the run's taint (`run.tainted`, `run.secret`, or the `run["..."]` forms).
_RUN_TAINT = re.compile(r"""\brun\s*(?:\.\s*(?:tainted|secret)\b|\[\s*["'](?:tainted|secret)["']\s*\])""")


@functools.lru_cache(maxsize=1 << 16)
def reads_run_taint(source: str) -> bool:
    """Whether a CEL expression reads `run.tainted` or `run.secret`. Kept by text: every chain
    build asks it of each of a revision's expressions, and a reload changes few of them."""
    return _RUN_TAINT.search(source) is not None


@dataclass(frozen=True, slots=True)
class PolicyRevision:
    """One loaded, validated, compiled policy directory."""

    revision: str  # git commit (+ "-dirty") or "sha256:<12 hex>" content hash
    directory: Path
    files: tuple[Path, ...]
    document: Any  # proxy.policy.model.PolicyDocument
    tools: Mapping[str, CompiledTool]
    principals: Mapping[str, CompiledPrincipal]
    engine: str  # CEL engine name: "cel-cpp" or "cel-python"
    # The engine that compiled the programs: checks compile and evaluate with this one, and a
    # reload compiles the next revision with it.
    cel: Engine
    loaded_at: float = 0.0
    # Where each tool key / principal id / upstream was declared, for error messages.
    locations: Mapping[str, Location] = field(default_factory=dict)
    # The OpenAPI document of each HTTP upstream (`openapi:`), loaded with this revision.
    specs: Mapping[str, Spec] = field(default_factory=dict)

    def run_taint_readers(self) -> list[tuple[str, Location | None]]:
        """(what, where) of every CEL expression that reads `run.tainted` / `run.secret`."""
        return taint_readers(self.tools.values(), self.principals.values())


def taint_readers(tools: Any, principals: Any) -> list[tuple[str, Location | None]]:
    """(what, where) of the CEL expressions of compiled tools and principals that read the
    run's taint."""
    found: list[tuple[str, Location | None]] = []
    for tool in tools:
        found += [(f"tools.{tool.key}.allow", tool.location) for p in tool.allow if reads_run_taint(p.source)]
        found += [(f"tools.{tool.key} rule {r.id}", r.location or tool.location)
                  for r in tool.rules if reads_run_taint(r.program.source)]
    for principal in principals:
        found += [(f"principals.{principal.id}.allow", principal.location)
                  for p in principal.allow if reads_run_taint(p.source)]
    return found
