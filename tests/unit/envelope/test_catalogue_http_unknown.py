"""What is no operation of an HTTP upstream's OpenAPI document is `unknown_tool`, whatever
`defaults.unknown_tools` says: there is no request to build for it."""

from __future__ import annotations

import shutil
from pathlib import Path

from envelope_helpers import make_call

from proxy.envelope.checks.catalogue import CatalogueCheck, spec_registry
from proxy.envelope.types import Code
from proxy.policy.loader import load_policy

PETSTORE = Path(__file__).resolve().parents[2] / "fixtures" / "openapi" / "petstore.yaml"


def test_no_operation_is_unknown_even_when_unknown_tools_are_allowed(tmp_path: Path) -> None:
    shutil.copy(PETSTORE, tmp_path / "petstore.yaml")
    (tmp_path / "policy.yaml").write_text(
        "version: 1\ndefaults: {unknown_tools: allow}\n"
        "upstreams:\n  pets: {url: 'http://127.0.0.1:9', openapi: petstore.yaml}\n"
        "  notes: {url: 'http://127.0.0.1:9/mcp'}\n")
    revision = load_policy(tmp_path)
    registry = spec_registry(revision)  # what the runtime learns at install
    check = CatalogueCheck(revision, registry)
    decision = check.decide(make_call("DELETE /pets/7", upstream="pets"))
    assert decision is not None and decision.code is Code.UNKNOWN_TOOL
    assert decision.rule == "upstreams.pets.openapi"
    assert "tool 'pets.DELETE /pets/7' is not an operation of upstream 'pets'" in decision.reason
    assert check.decide(make_call("listPets", upstream="pets", info=registry.get("pets", "listPets"))) is None
    # An MCP upstream's unknown tools still follow unknown_tools (allow: not unknown; with no
    # store here, the undeclared destructive default cannot run).
    other = check.decide(make_call("anything", upstream="notes"))
    assert other is not None and other.code is Code.MISCONFIGURED
