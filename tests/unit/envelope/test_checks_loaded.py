"""All five checks in pipeline order on a policy loaded from YAML by the real loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from envelope_helpers import make_call

from proxy.envelope.checks.arg_rules import ArgRulesCheck
from proxy.envelope.checks.authz import AuthzCheck
from proxy.envelope.checks.capability import CapabilityCheck
from proxy.envelope.checks.catalogue import CatalogueCheck, misconfigured_tools, visible
from proxy.envelope.checks.schema import SchemaCheck
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Principal, ToolCall, ToolInfo

loader = pytest.importorskip("proxy.policy.loader")

POLICY = """\
version: 1
upstreams:
  demo: {url: "http://127.0.0.1:9/mcp"}
tools:
  demo.search:
    effect: read
    schema:
      type: object
      properties: {limit: {type: integer, minimum: 1, maximum: 50}}
  demo.write:
    effect: write
    allow: 'principal.claims.tenant == args.tenant'
    rules:
      - id: no-secret
        forbid: 'args.path.startsWith("/secret")'
        reason: "secret paths are off limits"
      - allow: 'args.path.startsWith("/notes/")'
    fallback: deny
    fallback_reason: "notes only"
  demo.drop:
    effect: destructive
principals:
  reader: {capability: read-only}
  alice: {allow: '"staff" in principal.groups'}
"""

CHECKS = (CatalogueCheck, CapabilityCheck, SchemaCheck, AuthzCheck, ArgRulesCheck)


def decide(checks: list[Any], call: ToolCall) -> Decision | None:
    for check in checks:
        decision = check.decide(call)
        if decision is not None:
            return decision
    return None


@pytest.fixture
def setup(tmp_path: Path, engine: str) -> tuple[Any, ToolRegistry, list[Any]]:
    (tmp_path / "policy.yaml").write_text(POLICY)
    revision = loader.load_policy(tmp_path, engine)
    registry = ToolRegistry()
    registry.learn("demo", [{"name": "search", "inputSchema": {"type": "object"}},
                            {"name": "write"}, {"name": "drop"}])
    return revision, registry, [cls(revision, registry) for cls in CHECKS]


ALICE = Principal("alice", ("staff",), {"tenant": "t1"}, "jwt")


@pytest.mark.parametrize(
    ("tool", "args", "principal", "code", "check"),
    [
        ("search", {"limit": 5}, ALICE, None, None),
        ("search", {"limit": 500}, ALICE, Code.SCHEMA_INVALID, "schema"),
        ("nope", {}, ALICE, Code.UNKNOWN_TOOL, "catalogue"),
        ("drop", {}, ALICE, Code.MISCONFIGURED, "catalogue"),
        ("write", {"tenant": "t1", "path": "/notes/a"}, ALICE, None, None),
        ("write", {"tenant": "t2", "path": "/notes/a"}, ALICE, Code.UNAUTHORIZED, "authz"),
        ("write", {"tenant": "t1", "path": "/secret/a"}, ALICE, Code.CAPABILITY_BLOCKED, "arg_rules"),
        ("write", {"tenant": "t1", "path": "/tmp/a"}, ALICE, Code.CAPABILITY_BLOCKED, "arg_rules"),
        ("write", {"tenant": "t1", "path": "/notes/a"}, Principal("bob", (), {"tenant": "t1"}), None, None),
        ("write", {"tenant": "t1", "path": "/notes/a"}, Principal("alice", (), {"tenant": "t1"}), Code.UNAUTHORIZED, "authz"),
        ("write", {"tenant": "t1", "path": "/notes/a"}, Principal("reader", (), {"tenant": "t1"}), Code.CAPABILITY_BLOCKED, "capability"),
        ("search", {}, Principal("reader"), None, None),
    ],
)  # fmt: skip
def test_pipeline_order(
    setup: tuple[Any, ToolRegistry, list[Any]],
    tool: str,
    args: dict[str, Any],
    principal: Principal,
    code: Code | None,
    check: str | None,
) -> None:
    _, registry, checks = setup
    call = make_call(tool, args, principal=principal, info=registry.get("demo", tool))
    decision = decide(checks, call)
    if code is None:
        assert decision is None
    else:
        assert decision is not None and (decision.code, decision.check) == (code, check)


def test_rule_reasons(setup: tuple[Any, ToolRegistry, list[Any]]) -> None:
    _, _, checks = setup
    d = decide(checks, make_call("write", {"tenant": "t1", "path": "/secret/x"}, principal=ALICE))
    assert d is not None and (d.rule, d.reason) == ("no-secret", "secret paths are off limits")
    d = decide(checks, make_call("write", {"tenant": "t1", "path": "/x"}, principal=ALICE))
    assert d is not None and (d.rule, d.reason) == ("demo.write#fallback", "notes only")


def test_report_and_visibility(setup: tuple[Any, ToolRegistry, list[Any]]) -> None:
    revision, registry, _ = setup
    assert list(misconfigured_tools(revision, registry)) == ["demo.drop"]
    assert visible(revision, registry, "reader", "demo", "search")
    assert not visible(revision, registry, "reader", "demo", "write")
    assert visible(revision, registry, "alice", "demo", "write")
    assert visible(revision, registry, "alice", "demo", "drop")  # misconfigured stays listed
    assert isinstance(registry.get("demo", "search"), ToolInfo)
