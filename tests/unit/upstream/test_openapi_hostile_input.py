"""OpenAPI translation under attack: values that would change the request, hostile answers
(encodings, bombs, deep JSON) and documents that expand without bound."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import urllib.parse
import zlib
from typing import Any

import pytest

from proxy.errors import ReplyTooLarge
from proxy.policy.schemas import compile_schema
from proxy.upstream.openapi import SpecError, decoded, parse_spec, request_for, result_from

SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "t", "version": "1"},
    "paths": {
        "/items/{id}": {"get": {"operationId": "getItem", "parameters": [
            {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
            {"name": "n", "in": "path", "required": True, "schema": {"type": "integer"}},
            {"name": "X-Tag", "in": "header", "schema": {"type": "string"}},
        ], "responses": {}}},
        "/items/mine": {"get": {"operationId": "getMine", "responses": {}}},
    },
}
# (`n` is declared but not templated: present only to show non-strings keep their schema.)


def _spec() -> Any:
    return parse_spec(json.dumps(SPEC), "t.json")


@pytest.mark.parametrize("value", ["..", ".", "", "a/..", "../x", "a\\..\\b", "x\x00", "tab\there"])
def test_a_path_value_that_is_not_one_segment_is_refused_by_schema_and_request(value: str) -> None:
    op = _spec().operations["getItem"]
    validator = compile_schema(dict(op.input_schema))
    assert not validator.is_valid({"id": value, "n": 1})
    with pytest.raises(ValueError, match="path parameter 'id'"):
        request_for(op, {"id": value, "n": 1})


@pytest.mark.parametrize("value", ["a%2e%2e", "...", "..a", "a/b", "caf\u00e9"])
def test_other_path_values_are_sent_percent_encoded_in_one_segment(value: str) -> None:
    op = _spec().operations["getItem"]
    assert compile_schema(dict(op.input_schema)).is_valid({"id": value, "n": 1})
    assert request_for(op, {"id": value, "n": 1}).path == "/items/" + urllib.parse.quote(value, safe="")


def test_an_integer_path_parameter_keeps_its_own_schema() -> None:
    assert _spec().operations["getItem"].input_schema["properties"]["n"] == {"type": "integer"}


@pytest.mark.parametrize("value", ["a\r\nX-Evil: 1", "a\nb", "caf\u00e9", "nul\x00"])
def test_a_header_value_outside_printable_ascii_is_refused(value: str) -> None:
    op = _spec().operations["getItem"]
    assert not compile_schema(dict(op.input_schema)).is_valid({"id": "1", "n": 1, "X-Tag": value})
    with pytest.raises(ValueError, match="header parameter 'X-Tag'"):
        request_for(op, {"id": "1", "n": 1, "X-Tag": value})


def test_a_request_another_operation_would_serve_is_refused() -> None:
    spec = _spec()
    op = spec.operations["getItem"]
    with pytest.raises(ValueError, match="served by getMine"):
        spec.request_for(op, {"id": "mine", "n": 1})
    assert spec.request_for(op, {"id": "yours", "n": 1}).path == "/items/yours"


def test_a_path_that_is_not_utf8_matches_nothing_but_raises() -> None:
    with pytest.raises(ValueError):
        _spec().match("GET", "/items/%ff")


# ---- answers --------------------------------------------------------------------------------

BODY = b'{"note": "key AKIAIOSFODNN7EXAMPLE"}'


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # what some servers send as `deflate`
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(("coding", "data"), [
    ("", BODY), ("identity", BODY), ("gzip", gzip.compress(BODY)), ("x-gzip", gzip.compress(BODY)),
    ("deflate", zlib.compress(BODY)), ("deflate", _raw_deflate(BODY)), ("gzip", b""), ("br", b""),
])
def test_encoded_bodies_are_decoded_before_inspection(coding: str, data: bytes) -> None:
    assert decoded(data, coding, 1000, "limits.max_upstream_reply_bytes") == (BODY if data else b"")


@pytest.mark.parametrize(("coding", "data"), [
    ("br", b"\x8b\x02\x80"), ("gzip, gzip", gzip.compress(gzip.compress(BODY))),
    ("gzip", b"not gzip"), ("gzip", gzip.compress(BODY)[:-12]),
])
def test_unsupported_or_broken_encodings_are_refused(coding: str, data: bytes) -> None:
    with pytest.raises(ValueError):
        decoded(data, coding, 1000, "limits.max_upstream_reply_bytes")


def test_a_compression_bomb_stops_at_the_limit() -> None:
    """50 MB of zeros gzipped: decoding stops past the 1 MB limit, so it never holds the whole
    (measured as the memory it allocated, not the time it took)."""
    bomb = gzip.compress(b"\0" * 50_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(ReplyTooLarge) as exc:
            decoded(bomb, "gzip", 1_000_000, "limits.max_upstream_reply_bytes")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exc.value.limit == 1_000_000
    assert peak < 4_000_000, peak


def test_json_too_deep_is_a_text_result() -> None:
    deep = b"[" * 5000 + b"]" * 5000  # json.loads raised RecursionError on 100000
    result = result_from(200, "application/json", deep)
    assert "structuredContent" not in result and result["content"][0]["text"] == deep.decode()
    shallow = result_from(200, "application/json", b'{"a": [[1]]}')
    assert shallow["structuredContent"] == {"a": [[1]]}


# ---- documents that expand without bound ------------------------------------------------------

def test_a_yaml_alias_bomb_is_refused_at_once() -> None:
    lines = ["openapi: 3.1.0", "info: {title: b, version: '1'}", "x-0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"x-{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    lines.append("paths: {}")
    with pytest.raises(SpecError, match="expands past"):  # (unbounded, it would not end)
        parse_spec("\n".join(lines), "bomb.yaml")


def test_a_ref_bomb_skips_the_operation_with_a_problem() -> None:
    schemas: dict[str, Any] = {"S0": {"type": "string"}}
    for i in range(1, 10):
        schemas[f"S{i}"] = {"type": "object", "properties": {
            f"p{j}": {"$ref": f"#/components/schemas/S{i - 1}"} for j in range(10)}}
    doc = {"openapi": "3.1.0", "info": {"title": "b", "version": "1"},
           "components": {"schemas": schemas},
           "paths": {"/x": {"post": {"operationId": "boom", "requestBody": {"content": {
               "application/json": {"schema": {"$ref": "#/components/schemas/S9"}}}}, "responses": {}}},
               "/y": {"get": {"operationId": "fine", "responses": {}}}}}
    spec = parse_spec(json.dumps(doc), "refs.json")  # (unbounded: 10**9 properties)
    assert list(spec.operations) == ["fine"]
    assert any("expands past" in p and "operation skipped" in p for p in spec.problems)


@pytest.mark.parametrize("ref", ["other.yaml#/components/schemas/S", "file:///etc/passwd",
                                 "http://127.0.0.1:9/s.json", "https://example.invalid/s.json#/S"])
def test_an_external_ref_is_reported_and_never_fetched(ref: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fetch(*_: Any, **__: Any) -> Any:
        raise AssertionError("fetched")

    monkeypatch.setattr("urllib.request.urlopen", no_fetch)
    monkeypatch.setattr("pathlib.Path.read_bytes", no_fetch)
    doc = {"openapi": "3.1.0", "info": {"title": "r", "version": "1"}, "paths": {
        "/a": {"get": {"operationId": "viaSchema", "parameters": [
            {"name": "q", "in": "query", "schema": {"$ref": ref}}], "responses": {}}},
        "/b": {"get": {"operationId": "viaParameter", "parameters": [{"$ref": ref}], "responses": {}}},
        "/c": {"$ref": ref},
        "/d": {"get": {"operationId": "fine", "responses": {}}}}}
    spec = parse_spec(json.dumps(doc), "refs.json")
    assert list(spec.operations) == ["fine"]
    assert sum("only local $refs" in p for p in spec.problems) == 3


def test_a_recursive_yaml_alias_is_refused_not_walked_forever() -> None:
    text = "openapi: 3.1.0\ninfo: {title: r, version: '1'}\nx-a: &a [x, *a]\npaths: {}\n"
    with pytest.raises(SpecError, match="expands past"):
        parse_spec(text, "rec.yaml")


def test_a_document_nested_past_the_stack_is_refused() -> None:
    text = "openapi: 3.1.0\ninfo: {title: d, version: '1'}\nx-deep: " + "[" * 3000 + "]" * 3000 + "\npaths: {}\n"
    with pytest.raises(SpecError, match=r"deep\.yaml:3:\d+: nested deeper than 128 levels"):
        parse_spec(text, "deep.yaml")
