"""Schema check: the arguments match the tool's input schema.

The policy's `schema` (compiled by the loader into `CompiledTool.schema_validator`) replaces the
upstream's `inputSchema`. Upstream schemas are compiled on first use and cached per tool; a new
`tools/list` answer yields new schema objects, so the identity check misses and the content digest
decides whether to recompile. When no schema is known at all (no policy schema, the upstream never
listed the tool or listed it without `inputSchema`) the call continues: catalogue and policy
decide whether such a tool may run, and the upstream validates its own input.

Both kinds of schema are compiled by `proxy.policy.schemas.compile_schema`, which asserts `format`:
the data-flow check trusts validated formats (`dataflow.skip_formats`) to hold no free text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import jsonschema_rs

from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Services, ToolCall, deny
from proxy.policy.compiled import PolicyRevision
from proxy.policy.schemas import compile_schema

# Reasons reach the model and the audit log; a schema message can quote a huge argument.
MAX_MESSAGE = 300


def pointer(path: Any) -> str:
    """RFC 6901 JSON pointer of an instance path: "/a/0/b", "/" for the root."""
    if not path:
        return "/"
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _digest(schema: Mapping[str, Any]) -> str:
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):
        text = repr(schema)
    return hashlib.sha256(text.encode()).hexdigest()


def _clip(text: str) -> str:
    text = text.split("\n", 1)[0]
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


class _Compiled:
    """One compiled upstream schema: the object it came from, its digest, validator or error."""

    __slots__ = ("digest", "error", "schema", "validator")

    def __init__(self, schema: Mapping[str, Any], digest: str, validator: Any, error: str | None):
        self.schema = schema  # held so its id() cannot be reused while cached
        self.digest = digest
        self.validator = validator
        self.error = error


class SchemaCheck:
    """Refuses `schema_invalid` when the arguments fail the schema, or the upstream's schema does
    not compile (fail closed: the arguments cannot be checked)."""

    id: ClassVar[str] = "schema"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._overrides = {
            key: (tool.schema_validator, f"tools.{key}.schema")
            for key, tool in revision.tools.items()
            if tool.schema_validator is not None
        }
        # (upstream, tool) -> compiled upstream schema. Bounded by the tools the registry knows.
        self._cache: dict[tuple[str, str], _Compiled] = {}

    def _upstream_validator(self, call: ToolCall, schema: Mapping[str, Any]) -> _Compiled:
        key = (call.upstream, call.tool)
        entry = self._cache.get(key)
        if entry is not None and entry.schema is schema:
            return entry
        digest = _digest(schema)
        if entry is not None and entry.digest == digest:
            entry.schema = schema
            return entry
        try:
            validator = compile_schema(schema)
            error = None
        except Exception as exc:  # jsonschema_rs raises ValidationError/ValueError on bad schemas
            validator, error = None, _clip(str(exc))
        entry = self._cache[key] = _Compiled(schema, digest, validator, error)
        return entry

    def decide(self, call: ToolCall) -> Decision | None:
        """Validate `call.arguments`; refuse with the JSON pointer of the first failing argument."""
        key = call.qualified_name
        override = self._overrides.get(key)
        if override is not None:
            validator, rule = override
        else:
            info = call.upstream_tool
            schema = info.input_schema if info is not None else None
            if schema is None:
                return None
            entry = self._upstream_validator(call, schema)
            if entry.validator is None:
                return deny(
                    Code.SCHEMA_INVALID,
                    self.id,
                    f"the upstream's input schema for tool '{key}' is invalid: {entry.error}",
                    "upstream.inputSchema",
                )
            validator = entry.validator
            rule = "upstream.inputSchema"
        try:
            validator.validate(call.arguments)
        except jsonschema_rs.ValidationError as exc:
            return deny(
                Code.SCHEMA_INVALID,
                self.id,
                f"argument {pointer(exc.instance_path)}: {_clip(exc.message)}",
                rule,
            )
        return None
