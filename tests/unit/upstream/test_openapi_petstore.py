"""The OpenAPI Initiative's petstore example (`tests/fixtures/openapi/petstore.yaml`) read as a
tool catalogue: three tools with the input schemas, effects and routes its document says."""

from __future__ import annotations

from pathlib import Path

from proxy.policy.vocab import Effect
from proxy.upstream.openapi import arguments_from, load_spec, request_for

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "openapi"


def test_petstore_operations_are_tools_with_input_schemas() -> None:
    spec = load_spec("petstore.yaml", FIXTURES)
    assert spec.problems == ()
    assert list(spec.operations) == ["listPets", "createPets", "showPetById"]
    listing, create, show = spec.operations.values()
    assert (listing.method, listing.path, listing.effect) == ("GET", "/pets", Effect.READ)
    assert (create.method, create.effect) == ("POST", Effect.WRITE)
    assert listing.input_schema["properties"]["limit"]["maximum"] == 100
    assert create.input_schema["required"] == ["id", "name"]  # the Pet body, merged ($ref resolved)
    assert set(create.input_schema["properties"]) == {"id", "name", "tag"}
    assert show.input_schema["required"] == ["petId"]
    tool = show.tool_definition()
    assert tool["name"] == "showPetById" and tool["description"] == "Info for a specific pet"
    assert tool["annotations"]["readOnlyHint"] is True


def test_petstore_routes_both_ways() -> None:
    spec = load_spec("petstore.yaml", FIXTURES)
    matched = spec.match("GET", "/pets/7")
    assert matched is not None
    op, params = matched
    assert (op.tool, params) == ("showPetById", {"petId": "7"})
    assert spec.match("DELETE", "/pets/7") is None
    assert spec.match("GET", "/pets/7/toys") is None
    listing = spec.operations["listPets"]
    args = arguments_from(listing, {}, {"limit": ["5"]}, {}, None)
    assert args == {"limit": 5}
    assert request_for(listing, args).path == "/pets?limit=5"
    create = spec.operations["createPets"]
    call = request_for(create, arguments_from(create, {}, {}, {}, {"id": 1, "name": "Rex"}))
    assert (call.method, call.path, call.body) == ("POST", "/pets", b'{"id":1,"name":"Rex"}')
