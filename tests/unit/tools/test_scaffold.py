"""The scaffold's decisions: effects, gating and outputs from annotations, minimal arguments that
satisfy the input schema, and YAML that reads back as what was meant."""

from __future__ import annotations

from typing import Any

import pytest
from ruamel.yaml import YAML

from proxy.policy.schemas import VALIDATED_FORMATS, compile_schema
from proxy.tools.scaffold import (
    FORMAT_EXAMPLES,
    derive,
    example_value,
    render_policy,
    render_tests,
    valid_tools,
)


@pytest.mark.parametrize(("annotations", "effect", "gated", "output"), [
    ({"readOnlyHint": True}, "read", False, "untrusted"),
    ({"readOnlyHint": True, "openWorldHint": False}, "read", False, "trusted"),
    # readOnlyHint wins over a destructiveHint (MCP: the other hints only apply to writers).
    ({"readOnlyHint": True, "destructiveHint": True}, "read", False, "untrusted"),
    ({"destructiveHint": False, "openWorldHint": False}, "write", False, "trusted"),
    ({"destructiveHint": False}, "external", True, "untrusted"),
    ({"destructiveHint": False, "openWorldHint": True}, "external", True, "untrusted"),
    ({"destructiveHint": True, "openWorldHint": False}, "destructive", True, "trusted"),
    ({}, "destructive", True, "untrusted"),
    (None, "destructive", True, "untrusted"),
    # Only a JSON true counts as read-only: a string is not a hint.
    ({"readOnlyHint": "true"}, "destructive", True, "untrusted"),
])
def test_effect_gating_and_output_from_annotations(annotations: Any, effect: str, gated: bool,
                                                   output: str) -> None:
    tool = derive({"name": "t", "inputSchema": {"type": "object"}, "annotations": annotations})
    assert (tool.effect.value, tool.gated, tool.output) == (effect, gated, output)
    assert tool.derivation.startswith("derived from annotations: ")


def test_derivation_names_the_hints_it_used() -> None:
    tool = derive({"name": "t", "annotations": {"readOnlyHint": False, "destructiveHint": False}})
    assert tool.derivation == "derived from annotations: readOnlyHint: false, destructiveHint: false"
    assert derive({"name": "t"}).derivation == "derived from annotations: none (MCP defaults)"


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"mode": {"enum": ["fast", "exact"]}}, "required": ["mode"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 9}},
     "required": ["n"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 7}}, "required": ["n"]},
    {"type": "object", "properties": {"n": {"type": "number", "maximum": -3}}, "required": ["n"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 4, "maxLength": 4}},
     "required": ["s"]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date-time"},
                                      "e": {"type": "string", "format": "email"}}, "required": ["d", "e"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "boolean"}, "minItems": 2}},
     "required": ["xs"]},
    {"type": "object", "properties": {"maybe": {"anyOf": [{"type": "null"}, {"type": "integer"}]}},
     "required": ["maybe"]},
    {"type": "object", "required": ["k"], "properties": {"k": {"const": "fixed"}}},
    # Nested models as pydantic writes them: $defs and $ref.
    {"type": "object", "$defs": {"Address": {"type": "object", "properties": {
        "street": {"type": "string"}, "zip": {"type": "integer", "minimum": 1000}},
        "required": ["street", "zip"], "additionalProperties": False}},
     "properties": {"address": {"$ref": "#/$defs/Address"}, "note": {"type": "string"}},
     "required": ["address"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_example_arguments_satisfy_the_schema(schema: dict[str, Any]) -> None:
    value = example_value(schema, schema)
    assert compile_schema(schema).is_valid(value), value


def test_example_arguments_are_minimal() -> None:
    schema = SCHEMAS[-1]
    assert example_value(schema, schema) == {"address": {"street": "x", "zip": 1000}}
    assert example_value(SCHEMAS[0], SCHEMAS[0]) == {"mode": "fast"}
    assert example_value(SCHEMAS[2], SCHEMAS[2]) == {"n": 8}


def _load(text: str) -> Any:
    return YAML(typ="safe").load(text)


def test_names_and_values_that_look_like_other_types_stay_strings() -> None:
    tool = derive({"name": "0", "annotations": {"readOnlyHint": True},
                   "inputSchema": {"type": "object", "properties": {"a": {"enum": ["yes", "null", "1e3"]}},
                                   "required": ["a"]}})
    policy = _load(render_policy("1", [tool], url="http://127.0.0.1:9/mcp"))
    assert list(policy["tools"]) == ["1.0"]
    assert policy["upstreams"] == {"1": {"url": "http://127.0.0.1:9/mcp"}}
    cases = _load(render_tests("1", [tool]))["cases"]
    assert cases[0]["call"] == {"tool": "1.0", "arguments": {"a": "yes"}}


def test_a_command_line_cannot_break_out_of_its_comment_or_its_list() -> None:
    tool = derive({"name": "t", "annotations": {"readOnlyHint": True}})
    text = render_policy("s", [tool], command=["serve", "x\ntools: {evil: 1}"])
    assert _load(text)["tools"] == {"s.t": {"effect": "read", "output": "untrusted"}}
    assert _load(text)["upstreams"]["s"] == {"command": ["serve", "x\ntools: {evil: 1}"]}
    assert "with only PATH, HOME and LANG" in text


def test_tools_no_policy_key_can_name_are_skipped() -> None:
    tools = [derive({"name": "ok.name-1"}), derive({"name": "has space"})]
    kept, skipped = valid_tools("s", tools)
    assert [t.name for t in kept] == ["ok.name-1"]
    assert skipped == ["has space"]


@pytest.mark.parametrize("fmt", sorted(FORMAT_EXAMPLES))
def test_every_format_example_passes_the_format_assertion(fmt: str) -> None:
    schema = {"type": "string", "format": fmt}
    assert compile_schema(schema).is_valid(example_value(schema, schema))
    assert fmt in VALIDATED_FORMATS
