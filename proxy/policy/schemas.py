"""JSON Schema compilation, one way for every input schema: `format` is asserted.

jsonschema-rs follows draft 2020-12, where `format` is only an annotation unless the validator is
asked to assert it. The data-flow check trusts some formats (`dataflow.skip_formats`: a valid
`date-time` cannot carry an attacker's sentence), so every schema a call is validated against (a
policy `schema`, compiled by the loader; an upstream's `inputSchema`, compiled by the schema
check) is compiled here, and only the formats listed in `VALIDATED_FORMATS` may be trusted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema_rs

# The formats jsonschema-rs (0.61) rejects malformed strings for when `validate_formats` is on;
# tests/unit/policy/test_schemas.py holds a malformed value for each, so a jsonschema-rs that stops
# asserting one fails there. Any other format (`int32`, `password`, ...) is an annotation the
# validator ignores: it is never trusted.
VALIDATED_FORMATS: frozenset[str] = frozenset({
    "date", "date-time", "time", "duration",
    "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uri-template",
    "uuid", "json-pointer", "relative-json-pointer", "regex",
})


def compile_schema(schema: Mapping[str, Any]) -> Any:
    """A jsonschema-rs validator for `schema` asserting `format`, resolving no remote `$ref`.

    Raises what `jsonschema_rs.validator_for` raises for an invalid schema (ValidationError,
    ValueError), a remote `$ref` included; callers map it to their own error. Unknown formats
    are ignored, not errors: upstream schemas use OpenAPI's `int32`, `byte` and the like.
    """
    # offline: by default jsonschema-rs fetches a remote `$ref` while compiling, a blocking
    # request to wherever an upstream's `tools/list` answer points, made from the event loop.
    return jsonschema_rs.validator_for(
        dict(schema), validate_formats=True, ignore_unknown_formats=True, offline=True
    )
