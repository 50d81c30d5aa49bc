"""OpenAPI documents as tool catalogues: loading, schemas, matching and both translations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.policy.schemas import compile_schema
from proxy.policy.vocab import Effect
from proxy.upstream.openapi import (
    Spec,
    SpecError,
    arguments_from,
    load_spec,
    parse_spec,
    request_for,
    result_from,
)

BILLING = Path(__file__).resolve().parents[2] / "fixtures" / "openapi" / "billing.yaml"

# OpenAPI 3.0 in JSON: nullable, boolean exclusiveMinimum, a recursive schema, a $ref'd request
# body, unsupported parameters (an optional cookie: left out; a required one: op skipped).
SPEC_30 = {
    "openapi": "3.0.3",
    "info": {"title": "t", "version": "1"},
    "paths": {
        "/trees": {
            "post": {
                "operationId": "plantTree",
                "requestBody": {"$ref": "#/components/requestBodies/Tree"},
                "parameters": [{"name": "session", "in": "cookie", "schema": {"type": "string"}}],
            },
        },
        "/trees/{id}": {
            "get": {
                "parameters": [
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "age", "in": "query",
                     "schema": {"type": "number", "minimum": 0, "exclusiveMinimum": True}},
                ],
            },
            "patch": {
                "operationId": "prune",
                "parameters": [
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "sid", "in": "cookie", "required": True, "schema": {"type": "string"}},
                ],
            },
        },
    },
    "components": {
        "requestBodies": {"Tree": {"required": True, "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Node"}}}}},
        "schemas": {"Node": {
            "type": "object", "required": ["name"],
            "properties": {
                "name": {"type": "string", "nullable": True},
                "children": {"type": "array", "items": {"$ref": "#/components/schemas/Node"}},
            },
        }},
    },
}


def billing():
    return load_spec(BILLING.name, BILLING.parent)


def test_loads_a_31_yaml_spec_relative_to_its_directory():
    spec = billing()
    assert spec.source == str(BILLING)
    assert spec.problems == ()
    assert list(spec.operations)[:3] == ["listInvoices", "createInvoice", "getInvoice"]
    get = spec.operations["getInvoice"]
    assert (get.method, get.path, get.effect, get.line) == ("GET", "/invoices/{invoiceId}", Effect.READ, 33)
    # The path-level $ref'd parameter is resolved and merged with the operation's own.
    assert get.input_schema["required"] == ["invoiceId"]
    assert get.input_schema["properties"]["invoiceId"] == {"type": "integer", "minimum": 1}
    assert get.input_schema["additionalProperties"] is False
    assert spec.operations["deleteInvoice"].effect is Effect.DESTRUCTIVE
    assert spec.operations["createInvoice"].effect is Effect.WRITE
    # No operationId: named from method and path.
    assert "get_health" in spec.operations


def test_json_body_object_is_merged_and_other_bodies_are_the_body_argument():
    spec = billing()
    create = spec.operations["createInvoice"]
    assert create.body_merged and create.body_required
    assert create.input_schema["required"] == ["customer", "amount"]
    tags = spec.operations["setTags"]
    assert not tags.body_merged
    assert tags.input_schema["properties"]["body"] == {"type": "array", "items": {"type": "string"}}
    assert tags.input_schema["required"] == ["invoiceId", "body"]


def test_tool_definition_carries_schema_and_annotations_from_the_method():
    tool = billing().operations["deleteInvoice"].tool_definition()
    assert tool["name"] == "deleteInvoice"
    assert tool["description"] == "Delete an invoice"
    assert tool["inputSchema"]["required"] == ["invoiceId"]
    assert tool["annotations"]["readOnlyHint"] is False
    assert tool["annotations"]["destructiveHint"] is True
    assert tool["annotations"]["idempotentHint"] is True


def test_loads_a_30_json_spec_rewriting_its_dialect_and_keeping_recursion():
    spec = parse_spec(json.dumps(SPEC_30, indent=1), "trees.json")
    assert list(spec.operations) == ["plantTree", "get_trees_id"]
    plant = spec.operations["plantTree"]
    schema = plant.input_schema
    assert schema["properties"]["name"] == {"type": ["string", "null"]}
    assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Node"}
    assert schema["$defs"]["Node"]["properties"]["children"]["items"] == {"$ref": "#/$defs/Node"}
    validator = compile_schema(schema)
    assert validator.is_valid({"name": "a", "children": [{"name": None, "children": []}]})
    assert not validator.is_valid({"name": "a", "children": [{"children": []}]})
    age = spec.operations["get_trees_id"].input_schema["properties"]["age"]
    assert age == {"type": "number", "exclusiveMinimum": 0}
    # The optional cookie is left out, the operation needing one is skipped: both reported with
    # their line in the JSON text.
    assert len(spec.problems) == 2
    assert spec.problems[0].startswith("trees.json:") and "'cookie'" in spec.problems[0]
    assert "parameter left out" in spec.problems[0]
    assert "operation skipped" in spec.problems[1]
    lines = json.dumps(SPEC_30, indent=1).splitlines()
    line = next(i for i, t in enumerate(lines) if '"name": "sid"' in t)  # its "{" is the line before
    assert spec.problems[1].startswith(f"trees.json:{line}:")


@pytest.mark.parametrize(("text", "message"), [
    ("openapi: 2.0\npaths: {}\n", "spec.yaml:1:10: not an OpenAPI 3.0 or 3.1"),
    ("swagger: '2.0'\n", "spec.yaml:1:1: not an OpenAPI 3.0 or 3.1"),
    ("openapi: 3.1.0\npaths: [1]\n", "spec.yaml:2:8: `paths` must be a mapping"),
    ("- a\n", "spec.yaml:1:1: an OpenAPI document is a mapping"),
    ("openapi: 3.1.0\npaths: {/a: {get: {parameters: [{$ref: 'http://x/y'}]}}}\n",
     "only local $refs"),
])
def test_unusable_documents_raise_spec_error_with_a_place(text, message):
    with pytest.raises(SpecError) as err:
        spec = parse_spec(text, "spec.yaml")
        # A bad $ref inside one operation skips that operation instead.
        raise SpecError(spec.problems[0])
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)


def test_a_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.yaml:1:1: cannot read"):
        load_spec("nope.yaml", tmp_path)


def test_a_file_past_the_size_bound_is_a_spec_error_read_no_further(tmp_path, monkeypatch):
    """A document file (beside the policy or anywhere else) is read up to MAX_SPEC_BYTES, like
    one fetched from a URL: a huge file, or a device that never ends, costs no more."""
    monkeypatch.setattr("proxy.upstream.openapi.MAX_SPEC_BYTES", 64)
    (tmp_path / "big.yaml").write_text("openapi: 3.0.0\npaths: {}\n" + "#" * 100 + "\n")
    with pytest.raises(SpecError, match=r"big\.yaml:1:1: OpenAPI document exceeds 64 bytes"):
        load_spec("big.yaml", tmp_path)


def test_match_prefers_literal_segments_and_decodes_path_parameters():
    spec = parse_spec(
        "openapi: 3.0.0\npaths:\n"
        "  /pets/{id}: {get: {operationId: getPet, parameters: [{name: id, in: path, required: true}]}}\n"
        "  /pets/mine: {get: {operationId: minePets}}\n",
        "p.yaml",
    )
    found = spec.match("get", "/pets/a%2Fb")
    assert found is not None and found[0].tool == "getPet" and found[1] == {"id": "a/b"}
    mine = spec.match("GET", "/pets/mine")
    assert mine is not None and mine[0].tool == "minePets"
    assert spec.match("POST", "/pets/mine") is None
    assert spec.match("GET", "/pets/a/b") is None
    assert spec.match("GET", "/pets") is None
    # A Spec built from operations alone (a test's, another loader's) routes the same way.
    rebuilt = Spec("p.yaml", dict(reversed(list(spec.operations.items()))))
    again = rebuilt.match("GET", "/pets/mine")
    assert again is not None and again[0].tool == "minePets"


def test_request_for_encodes_path_query_header_and_body():
    spec = billing()
    call = request_for(spec.operations["getInvoice"],
                       {"invoiceId": 7, "expand": True, "fields": ["a", "b c/d"]})
    assert (call.method, call.path, call.body) == ("GET", "/invoices/7?expand=true&fields=a&fields=b%20c%2Fd", None)
    call = request_for(spec.operations["listInvoices"], {"limit": 2, "X-Request-Tag": "t1"})
    assert call.path == "/invoices?limit=2" and call.headers == {"X-Request-Tag": "t1"}
    call = request_for(spec.operations["createInvoice"], {"customer": "acme", "amount": 5})
    assert call.headers == {"Content-Type": "application/json"}
    assert json.loads(call.body or b"") == {"customer": "acme", "amount": 5}
    call = request_for(spec.operations["setTags"], {"invoiceId": 1, "body": ["x"]})
    assert call.path == "/invoices/1/tags" and call.body == b'["x"]'
    with pytest.raises(ValueError, match="invoiceId"):
        request_for(spec.operations["getInvoice"], {})


def test_arguments_from_is_the_inverse_of_request_for():
    spec = billing()
    get = spec.operations["getInvoice"]
    args = arguments_from(get, {"invoiceId": "7"}, {"expand": ["true"], "fields": ["a", "b"]}, {}, None)
    assert args == {"invoiceId": 7, "expand": True, "fields": ["a", "b"]}
    lst = spec.operations["listInvoices"]
    assert arguments_from(lst, {}, {"limit": ["3"]}, {"x-request-tag": "t"}, None) == {
        "limit": 3, "X-Request-Tag": "t"}
    create = spec.operations["createInvoice"]
    assert arguments_from(create, {}, {}, {}, {"customer": "c", "amount": 1}) == {"customer": "c", "amount": 1}
    assert arguments_from(spec.operations["setTags"], {"invoiceId": "2"}, {}, {}, ["t"]) == {
        "invoiceId": 2, "body": ["t"]}
    slow = spec.operations["slowReport"]
    assert arguments_from(slow, {}, {"seconds": ["0.5"]}, {}, None) == {"seconds": 0.5}


@pytest.mark.parametrize(("tool", "path", "query", "body", "message"), [
    ("getInvoice", {"invoiceId": "seven"}, {}, None, "'invoiceId': 'seven' is not an integer"),
    ("getInvoice", {"invoiceId": "1"}, {"expand": ["yes"]}, None, "'expand': 'yes' is not true or false"),
    ("listInvoices", {}, {"limit": ["1", "2"]}, None, "'limit' is given 2 times"),
    ("slowReport", {}, {"seconds": ["nan"]}, None, "'seconds': 'nan' is not a finite number"),
    ("createInvoice", {}, {}, ["x"], "must be a JSON object"),
    ("getInvoice", {"invoiceId": "1"}, {}, {"a": 1}, "takes no request body"),
])
def test_arguments_from_names_the_parameter_that_does_not_fit(tool, path, query, body, message):
    with pytest.raises(ValueError, match=message):
        arguments_from(billing().operations[tool], path, query, {}, body)


@pytest.mark.parametrize("ctype, body", [
    ("application/json", json.dumps({"a": "AKIAIOSFODNN7EXAMPLE"}).encode("utf-16-le")),  # RFC 4627 detects it
    ("application/json", json.dumps({"a": 1}).encode("utf-32")),
    ("text/plain", "AKIAIOSFODNN7EXAMPLE".encode("utf-16")),  # a BOM
    ("", "AKIAIOSFODNN7EXAMPLE".encode("utf-16-be")),
    ("text/plain; charset=utf-16", "key".encode("utf-16-le")),
    ("text/plain; charset=latin-1", "caf\u00e9".encode()),  # reads "cafÃ©" there
    ("text/plain; charset=x-unknown", b"plain"),  # a reader may know it
    ("application/octet-stream; charset=base64", b"plain"),  # not a text encoding
    ("application/json", b'{"a": "AKIA\xffIOSFODNN7EXAMPLE"}'),  # dropped, the \xff joins the key
    ("text/plain", b"caf\xe9"),
    ("", b"\x80"),
])
def test_result_from_refuses_a_body_another_reader_reads_otherwise(ctype, body):
    with pytest.raises(ValueError, match="only UTF-8 is read"):
        result_from(200, ctype, body)


def test_result_from_keeps_bodies_every_reader_reads_alike():
    assert result_from(200, "text/plain; charset=ISO-8859-1", b"plain")["content"][0]["text"] == "plain"
    assert result_from(200, 'text/plain; charset="UTF-8"', "caf\u00e9".encode())["content"][0]["text"] == "caf\u00e9"
    assert result_from(200, "application/json", b'\xef\xbb\xbf{"a": 1}')["content"][0]["text"] == '\ufeff{"a": 1}'
    assert result_from(200, "text/plain", "\ufffd".encode())["content"][0]["text"] == "\ufffd"  # sent as such
    assert "\ufffd" in result_from(200, "image/png", b"\x89PNG\r\n")["content"][0]["text"]
    video = b"\x00\x00\x00\x18ftypmp42"  # binary media are not read as text by anyone
    assert result_from(200, "video/mp4", video)["content"][0]["text"].startswith("\x00")


def test_result_from_json_text_and_errors():
    obj = result_from(200, "application/json; charset=utf-8", b'{"a": 1}')
    assert obj["structuredContent"] == {"a": 1}
    assert json.loads(obj["content"][0]["text"]) == {"a": 1}
    assert "isError" not in obj
    arr = result_from(200, "application/problem+json", b"[1, 2]")
    assert arr["structuredContent"] == {"result": [1, 2]}
    text = result_from(200, "text/plain", b"hello")
    assert text == {"content": [{"type": "text", "text": "hello"}]}
    broken_json = result_from(200, "application/json", b"{nope")
    assert broken_json == {"content": [{"type": "text", "text": "{nope"}]}
    assert result_from(204, "", b"") == {"content": []}
    moved = result_from(302, "text/html", b'<a href="http://evil.example/steal">moved</a>')
    assert moved["isError"] is True and "evil.example" not in str(moved)
    assert moved["content"][0]["text"].startswith("HTTP 302: ")
    assert result_from(304, "", b"") == {"content": []}  # not modified: no redirect
    err = result_from(500, "text/plain", b"x" * 600)
    assert err["isError"] is True
    assert err["content"][0]["text"] == "HTTP 500: " + "x" * 500
