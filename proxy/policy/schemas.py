"""JSON Schema compilation, one way for every input schema: `format` is asserted.

jsonschema-rs follows draft 2020-12, where `format` is only an annotation unless the validator is
asked to assert it. The data-flow check trusts some formats (`dataflow.skip_formats`: a valid
`date-time` cannot carry an attacker's sentence), so every schema a call is validated against (a
policy `schema`, compiled by the loader; an upstream's `inputSchema`, compiled by the schema
check) is compiled here, and only the formats listed in `VALIDATED_FORMATS` may be trusted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema_rs

from proxy.policy.cache import LruCache

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
    try:
        # The JSON text in the schema's own key order: the same schema in every revision and
        # from every upstream is one key, and a reordered one a new key (key order can decide
        # which error a validator reports first, so it is part of what was compiled).
        key = json.dumps(schema, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):  # not JSON (a YAML date, say): compile it, uncached
        return _compile(schema)
    return _VALIDATORS.get_or_build(key, lambda: _compile(schema))


# Validators by schema text: a reload and every upstream's `tools/list` refresh compile only
# schemas they have not seen (a validator is immutable and safe to share between threads).
_VALIDATORS: LruCache[str, Any] = LruCache(8192)


def _compile(schema: Mapping[str, Any]) -> Any:
    # offline: by default jsonschema-rs fetches a remote `$ref` while compiling, a blocking
    # request to wherever an upstream's `tools/list` answer points, made from the event loop.
    return jsonschema_rs.validator_for(
        dict(schema), validate_formats=True, ignore_unknown_formats=True, offline=True
    )
