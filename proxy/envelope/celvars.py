"""The CEL variables of one call, converted once and shared by every CEL-based check.

Variables: `principal` (id, groups, claims: verified identity only, policy groups are not merged
in), `tool` (name, upstream, effect, annotations with MCP defaults filled in), `args`, `run`,
`request`, `now` (UTC). See `proxy.policy.cel.VARIABLES`.

Only the variables some expression of the revision can read are built (`referenced`): a CEL
expression names every variable it reads in its text, so a variable whose name appears nowhere
in the revision's sources is never looked up, and building it (a dict copy or a clock read, and
a value provider in the engine's activation) is waste on every call.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from typing import Any

from proxy.envelope.tools import ANNOTATION_DEFAULTS
from proxy.envelope.types import ToolCall
from proxy.errors import CelEvalError
from proxy.policy.cel import VARIABLES, Engine
from proxy.policy.compiled import PolicyRevision
from proxy.policy.vocab import Effect

# A variable's name as a whole word: in an identifier, a field or a string literal alike (a
# superset of the references, which is all `referenced` needs).
_NAMES = {name: re.compile(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])") for name in VARIABLES}


def referenced(revision: PolicyRevision) -> frozenset[str]:
    """The variables an expression of `revision` may read (tools' and principals' `allow`,
    tools' rules): each whose name appears as a word in some source. Computed once per
    revision by the checks that build activations, from each source's names kept by text: a
    reload changes a few sources, and scanning all 16,000 of a 1,000-tool revision again cost
    ~0.1 s a check, one regex search over a megabyte holding the GIL all along."""
    found: set[str] = set()
    for source in _sources(revision):
        found |= _names_in(source)
    return frozenset(found)


def _sources(revision: PolicyRevision) -> Iterator[str]:
    for tool in revision.tools.values():
        yield from (p.source for p in tool.allow)
        yield from (r.program.source for r in tool.rules)
    for principal in revision.principals.values():
        yield from (p.source for p in principal.allow)


@functools.lru_cache(maxsize=1 << 16)
def _names_in(source: str) -> frozenset[str]:
    # The same words as one search of the sources joined by newlines found: a newline is not a
    # name character, so no match spans two sources.
    return frozenset(name for name, word in _NAMES.items() if word.search(source))


def variables(call: ToolCall, names: Collection[str] = VARIABLES) -> dict[str, Any]:
    """The plain (JSON-typed) CEL variables of `call` named in `names` (default: all). A
    missing effect is the safe default."""
    out: dict[str, Any] = {}
    if "principal" in names:
        out["principal"] = call.principal.as_cel()
    if "tool" in names:
        info = call.upstream_tool
        annotations = dict(ANNOTATION_DEFAULTS)
        if info is not None:
            annotations.update(info.annotations)
        out["tool"] = {
            "name": call.tool,
            "upstream": call.upstream,
            "effect": (call.effect or Effect.DESTRUCTIVE).value,
            "annotations": annotations,
        }
    if "args" in names:
        out["args"] = call.arguments
    if "run" in names:
        out["run"] = call.run.as_cel()
    if "request" in names:
        out["request"] = call.request.as_cel()
    if "now" in names:
        out["now"] = datetime.now(UTC)
    return out


def activation(call: ToolCall, engine: Engine, names: Collection[str] = VARIABLES) -> Any:
    """The engine's activation for `call` (the variables in `names`, see `referenced`), built
    on first use and cached on `call.activation`: every caller in one chain passes the same
    `names` (its revision's).

    Raises `CelEvalError` when the variables cannot be converted; callers treat it like an
    evaluation error (a forbid matches, an allow does not).
    """
    act = call.activation
    if act is None:
        try:
            act = engine.activation(variables(call, names))
        except CelEvalError:
            raise
        except Exception as exc:
            raise CelEvalError(f"cannot convert the call's variables for CEL: {exc}") from exc
        call.activation = act
    return act
