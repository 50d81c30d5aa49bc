"""The CEL variables of one call, converted once and shared by every CEL-based check.

Variables: `principal` (id, groups, claims: verified identity only, policy groups are not merged
in), `tool` (name, upstream, effect, annotations with MCP defaults filled in), `args`, `run`,
`request`, `now` (UTC). See `proxy.policy.cel.VARIABLES`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from proxy.envelope.tools import ANNOTATION_DEFAULTS
from proxy.envelope.types import ToolCall
from proxy.errors import CelEvalError
from proxy.policy.cel import Engine
from proxy.policy.vocab import Effect


def variables(call: ToolCall) -> dict[str, Any]:
    """The plain (JSON-typed) CEL variables of `call`. A missing effect is the safe default."""
    info = call.upstream_tool
    annotations = dict(ANNOTATION_DEFAULTS)
    if info is not None:
        annotations.update(info.annotations)
    return {
        "principal": call.principal.as_cel(),
        "tool": {
            "name": call.tool,
            "upstream": call.upstream,
            "effect": (call.effect or Effect.DESTRUCTIVE).value,
            "annotations": annotations,
        },
        "args": call.arguments,
        "run": call.run.as_cel(),
        "request": call.request.as_cel(),
        "now": datetime.now(UTC),
    }


def activation(call: ToolCall, engine: Engine) -> Any:
    """The engine's activation for `call`, built on first use and cached on `call.activation`.

    Raises `CelEvalError` when the variables cannot be converted; callers treat it like an
    evaluation error (a forbid matches, an allow does not).
    """
    act = call.activation
    if act is None:
        try:
            act = engine.activation(variables(call))
        except CelEvalError:
            raise
        except Exception as exc:
            raise CelEvalError(f"cannot convert the call's variables for CEL: {exc}") from exc
        call.activation = act
    return act
