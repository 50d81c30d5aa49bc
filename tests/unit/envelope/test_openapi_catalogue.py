"""An HTTP upstream's catalogue is its OpenAPI spec: learned at install, replaced at every
reload, with the method's effect unless the policy overrides it."""

from __future__ import annotations

import shutil
from pathlib import Path

from envelope_helpers import make_call

from proxy.audit.log import AuditLog
from proxy.envelope.checks.catalogue import CatalogueCheck
from proxy.envelope.pipeline import Envelope
from proxy.envelope.tools import ToolRegistry
from proxy.observability.metrics import Metrics
from proxy.policy.loader import load_policy
from proxy.policy.vocab import Effect

BILLING = Path(__file__).resolve().parents[2] / "fixtures" / "openapi" / "billing.yaml"


def _policy(directory: Path, tools: str = "", openapi: bool = True) -> Path:
    directory.mkdir(exist_ok=True)
    shutil.copy(BILLING, directory / "billing.openapi.yaml")
    spec = ", openapi: billing.openapi.yaml" if openapi else ""
    (directory / "policy.yaml").write_text(
        "version: 1\ndefaults: {unknown_tools: allow}\n"
        f"upstreams:\n  billing: {{url: \"http://127.0.0.1:9/api\"{spec}}}\n"
        + (f"tools:\n{tools}" if tools else "")
    )
    return directory


def test_install_learns_the_spec_and_the_method_decides_the_effect(tmp_path: Path) -> None:
    registry = ToolRegistry()
    envelope = Envelope(AuditLog(tmp_path / "audit"), Metrics(), registry)
    revision = load_policy(_policy(tmp_path / "p", "  billing.getNote: {effect: write}\n"))
    envelope.install(revision)
    info = registry.get("billing", "deleteInvoice")
    assert info is not None and info.effect is Effect.DESTRUCTIVE
    assert info.input_schema == revision.specs["billing"].operations["deleteInvoice"].input_schema
    check = CatalogueCheck(revision, registry)
    effects = {}
    for tool in ("deleteInvoice", "getInvoice", "createInvoice", "getNote"):
        call = make_call(tool, upstream="billing", info=registry.get("billing", tool))
        decision = check.decide(call)
        # A destructive tool is gated: with no state store here it can never run.
        assert (decision is not None) == (tool == "deleteInvoice")
        effects[tool] = call.effect
    # No trust_annotations needed: the spec is the operator's. The policy still wins.
    assert effects == {"deleteInvoice": Effect.DESTRUCTIVE, "getInvoice": Effect.READ,
                       "createInvoice": Effect.WRITE, "getNote": Effect.WRITE}


def test_a_reload_replaces_or_forgets_the_spec_catalogue(tmp_path: Path) -> None:
    registry = ToolRegistry()
    envelope = Envelope(AuditLog(tmp_path / "audit"), Metrics(), registry)
    directory = _policy(tmp_path / "p")
    envelope.install(load_policy(directory))
    assert len(registry.tools("billing")) == 10
    spec = directory / "billing.openapi.yaml"
    spec.write_text(spec.read_text().replace("operationId: getNote", "operationId: readNote"))
    envelope.install(load_policy(directory))
    assert registry.get("billing", "getNote") is None
    assert registry.get("billing", "readNote") is not None
    envelope.install(load_policy(_policy(directory, openapi=False)))
    assert registry.tools("billing") == []
