"""What the proxy knows of tools: learned from upstream `tools/list`, merged with policy.

The `ToolRegistry` is runtime state that outlives policy revisions (a reload does not forget
what the upstreams said). `effective_effect` is the single place that decides a tool's effect:
policy first, then annotations when the upstream is trusted, then the safe default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from proxy.envelope.types import ToolInfo
from proxy.policy.vocab import Effect

# MCP annotation defaults when absent: a destructive, open-world writer.
ANNOTATION_DEFAULTS: Mapping[str, bool] = {
    "readOnlyHint": False,
    "destructiveHint": True,
    "idempotentHint": False,
    "openWorldHint": True,
}


class ToolRegistry:
    """Tools each upstream announced, by upstream then tool name. Updated by `tools/list`."""

    def __init__(self) -> None:
        self._tools: dict[str, dict[str, ToolInfo]] = {}
        # Counts changes, each counted once it is complete: what was read from the registry
        # while the count stayed the same is still what it holds (`Chain.misconfigured`).
        self.generation = 0

    def learn(self, upstream: str, tools: Iterable[Mapping[str, Any]]) -> list[ToolInfo]:
        """Record the tools of one `tools/list` page. Malformed entries are skipped."""
        learned: list[ToolInfo] = []
        known = self._tools.setdefault(upstream, {})
        for raw in tools:
            name = raw.get("name") if isinstance(raw, Mapping) else None
            if not isinstance(name, str) or not name:
                continue
            schema = raw.get("inputSchema")
            ann = raw.get("annotations")
            info = ToolInfo(
                name=name,
                input_schema=schema if isinstance(schema, Mapping) else None,
                annotations=dict(ann) if isinstance(ann, Mapping) else {},
            )
            known[name] = info
            learned.append(info)
        self.generation += 1
        return learned

    def replace(self, upstream: str, tools: Iterable[ToolInfo]) -> None:
        """Make `tools` the whole catalogue of `upstream` (an HTTP upstream's spec, per revision)."""
        self._tools[upstream] = {t.name: t for t in tools}
        self.generation += 1

    def forget(self, upstream: str) -> None:
        """Drop what is known of `upstream` (it is no longer an HTTP upstream)."""
        self._tools.pop(upstream, None)
        self.generation += 1

    def get(self, upstream: str, tool: str) -> ToolInfo | None:
        return self._tools.get(upstream, {}).get(tool)

    def tools(self, upstream: str) -> list[ToolInfo]:
        return list(self._tools.get(upstream, {}).values())

    def upstreams(self) -> list[str]:
        return list(self._tools)


def annotation(info: ToolInfo | None, name: str) -> bool:
    """An annotation's value with MCP's default when absent or not a boolean."""
    if info is not None:
        value = info.annotations.get(name)
        if isinstance(value, bool):
            return value
    return ANNOTATION_DEFAULTS[name]


def effective_effect(
    policy_effect: Effect | None, info: ToolInfo | None, trust_annotations: bool
) -> Effect:
    """The tool's effect: policy, else the operator's spec, else trusted annotations, else
    destructive."""
    if policy_effect is not None:
        return policy_effect
    if info is not None and info.effect is not None:
        return info.effect
    if trust_annotations and info is not None:
        if annotation(info, "readOnlyHint"):
            return Effect.READ
        if not annotation(info, "destructiveHint"):
            return Effect.EXTERNAL if annotation(info, "openWorldHint") else Effect.WRITE
    return Effect.DESTRUCTIVE
