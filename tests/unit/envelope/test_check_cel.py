"""CEL-based checks (authz, arg_rules) and the CEL variables, on every available engine."""

from __future__ import annotations

from typing import Any

from envelope_helpers import UPSTREAMS, build_revision, make_call

from proxy.envelope.celvars import activation, referenced, variables
from proxy.envelope.checks.arg_rules import ArgRulesCheck
from proxy.envelope.checks.authz import AuthzCheck
from proxy.envelope.checks.catalogue import CatalogueCheck
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Code, Decision, Principal, ToolCall, ToolInfo
from proxy.policy.cel import get_engine
from proxy.policy.vocab import Effect


def rev(engine: str, tools: dict[str, Any], principals: dict[str, Any] | None = None) -> Any:
    return build_revision(
        {
            "upstreams": UPSTREAMS,
            "defaults": {"gated_effects": []},
            "tools": tools,
            "principals": principals or {},
        },
        engine,
    )


def run(check_cls: Any, revision: Any, call: ToolCall) -> Decision | None:
    registry = ToolRegistry()
    assert CatalogueCheck(revision, registry).decide(call) is None
    return check_cls(revision, registry).decide(call)


# -- authz -------------------------------------------------------------------------------

ADMIN = Principal("alice", ("admins",), {"tenant": "t1"}, "jwt")
USER = Principal("bob", ("users",), {"tenant": "t2"}, "jwt")


def test_tool_level_allow_on_groups(engine: str) -> None:
    r = rev(engine, {"demo.t": {"effect": "write", "allow": '"admins" in principal.groups'}})
    assert run(AuthzCheck, r, make_call("t", principal=ADMIN)) is None
    d = run(AuthzCheck, r, make_call("t", principal=USER))
    assert d is not None and d.code is Code.UNAUTHORIZED and d.check == "authz"
    assert d.rule == "tools.demo.t.allow"
    assert d.reason == "principal 'bob' is not authorized to call 'demo.t'"


def test_claims_against_args(engine: str) -> None:
    r = rev(
        engine, {"demo.t": {"effect": "write", "allow": "principal.claims.tenant == args.tenant"}}
    )
    assert run(AuthzCheck, r, make_call("t", {"tenant": "t1"}, principal=ADMIN)) is None
    assert run(AuthzCheck, r, make_call("t", {"tenant": "t1"}, principal=USER)) is not None


def test_any_true_authorizes_and_errors_count_false(engine: str) -> None:
    r = rev(
        engine,
        {"demo.t": {"effect": "write", "allow": ["args.missing == 1", 'principal.id == "bob"']}},
    )
    assert run(AuthzCheck, r, make_call("t", principal=USER)) is None
    d = run(AuthzCheck, r, make_call("t", principal=ADMIN))
    assert d is not None and d.code is Code.UNAUTHORIZED


def test_principal_level_allow(engine: str) -> None:
    r = rev(
        engine,
        {"demo.t": {"effect": "write"}, "demo.r": {"effect": "read"}},
        {"bob": {"allow": 'tool.effect == "read"'}},
    )
    assert run(AuthzCheck, r, make_call("r", principal=USER)) is None
    d = run(AuthzCheck, r, make_call("t", principal=USER))
    assert d is not None and d.code is Code.UNAUTHORIZED
    assert d.rule == "principals.bob.allow"
    assert d.reason == "principal 'bob' is not authorized to call 'demo.t'"
    # Other principals have no principal-level condition.
    assert run(AuthzCheck, r, make_call("t", principal=ADMIN)) is None


def test_both_levels_must_pass(engine: str) -> None:
    r = rev(
        engine,
        {"demo.t": {"effect": "write", "allow": "args.n < 10"}},
        {"bob": {"allow": "args.n > 0"}},
    )
    assert run(AuthzCheck, r, make_call("t", {"n": 5}, principal=USER)) is None
    d = run(AuthzCheck, r, make_call("t", {"n": 50}, principal=USER))
    assert d is not None and d.rule == "tools.demo.t.allow"
    d = run(AuthzCheck, r, make_call("t", {"n": -1}, principal=USER))
    assert d is not None and d.rule == "principals.bob.allow"


def test_no_conditions_continue(engine: str) -> None:
    r = rev(engine, {"demo.t": {"effect": "write"}})
    assert run(AuthzCheck, r, make_call("t", principal=USER)) is None


def test_tool_and_run_variables(engine: str) -> None:
    upstreams = {"demo": {"url": "http://127.0.0.1:9/mcp", "trust_annotations": True}}
    r = build_revision(
        {
            "upstreams": upstreams,
            "defaults": {"gated_effects": []},
            "tools": {
                "demo.t": {
                    "allow": 'tool.name == "t" && tool.upstream == "demo" && tool.effect == "write"'
                    " && tool.annotations.openWorldHint == false && run.depth == 0"
                    ' && request.method == "tools/call" && now > timestamp("2020-01-01T00:00:00Z")'
                }
            },
        },
        engine,
    )
    ann = {"destructiveHint": False, "openWorldHint": False}
    call = make_call("t", principal=USER, info=ToolInfo("t", None, ann))
    assert run(AuthzCheck, r, call) is None
    assert call.effect is Effect.WRITE


def test_activation_is_cached_on_the_call(engine: str) -> None:
    eng = get_engine(engine)
    call = make_call("t", {"a": 1})
    call.effect = Effect.READ
    first = activation(call, eng)
    assert activation(call, eng) is first
    assert call.activation is first
    v = variables(call)
    assert v["tool"]["effect"] == "read" and v["args"] == {"a": 1}
    assert v["tool"]["annotations"]["destructiveHint"] is True  # MCP default filled in


def test_only_the_variables_the_revision_names_are_built(engine: str) -> None:
    r = rev(
        engine,
        {
            "demo.t": {
                "effect": "write",
                "allow": 'principal.id == "bob"',
                "rules": [{"forbid": 'args.runner == "x" || args.note == "tool"'},
                          {"allow": 'now > timestamp("2020-01-01T00:00:00Z")'}],
                "fallback": "deny",
            }
        },
        {"bob": {"allow": 'request.method == "tools/call"'}},
    )
    # `runner` is not `run`; a literal naming a variable counts (a superset is enough).
    assert referenced(r) == {"principal", "args", "now", "request", "tool"}
    call = make_call("t", {"runner": "y", "note": "n"}, principal=USER)
    assert run(AuthzCheck, r, call) is None  # the principal's level reads `request`
    assert run(ArgRulesCheck, r, call) is None  # the allow rule reads `now`
    assert set(variables(call, referenced(r))) == {"principal", "args", "now", "request", "tool"}
    assert set(variables(call, frozenset({"args"}))) == {"args"}



def test_referenced_is_per_revision_though_each_source_is_scanned_once(engine: str) -> None:
    # A source's names are kept by its text across revisions: the next revision, without the
    # rule that read `now`, does not build it; a name at a source's very start or end counts.
    tools: dict[str, Any] = {"demo.t": {"effect": "read", "allow": "run.tainted == false",
                                        "rules": [{"forbid": 'args.x == "a" && now > now'}]}}
    assert referenced(rev(engine, tools)) == {"run", "args", "now"}
    tools["demo.t"]["rules"] = [{"forbid": 'args.x == "a"'}]
    assert referenced(rev(engine, tools)) == {"run", "args"}


# -- arg_rules ---------------------------------------------------------------------------

RULES = {
    "effect": "write",
    "rules": [
        {"allow": 'args.repo.startsWith("corp/")', "id": "corp-only"},
        {
            "forbid": 'args.repo.startsWith("corp/secret-")',
            "id": "no-secret",
            "reason": "no issues in secret repositories",
        },
    ],
    "fallback": "deny",
}


def test_forbid_beats_allow(engine: str) -> None:
    r = rev(engine, {"demo.t": RULES})
    d = run(ArgRulesCheck, r, make_call("t", {"repo": "corp/secret-x"}))
    assert d is not None and d.code is Code.CAPABILITY_BLOCKED and d.check == "arg_rules"
    assert d.rule == "no-secret"
    assert d.reason == "no issues in secret repositories"
    assert run(ArgRulesCheck, r, make_call("t", {"repo": "corp/app"})) is None


def test_fallback_deny(engine: str) -> None:
    r = rev(engine, {"demo.t": RULES})
    d = run(ArgRulesCheck, r, make_call("t", {"repo": "other/app"}))
    assert d is not None and d.code is Code.CAPABILITY_BLOCKED
    assert d.rule == "demo.t#fallback"
    assert d.reason == "no rule allows this call"
    r = rev(engine, {"demo.t": {**RULES, "fallback_reason": "only corp repositories"}})
    d = run(ArgRulesCheck, r, make_call("t", {"repo": "other/app"}))
    assert d is not None and d.reason == "only corp repositories"


def test_implicit_fallback_deny_with_allow_rules(engine: str) -> None:
    r = rev(engine, {"demo.t": {"effect": "write", "rules": [{"allow": "args.n == 1"}]}})
    assert run(ArgRulesCheck, r, make_call("t", {"n": 1})) is None
    d = run(ArgRulesCheck, r, make_call("t", {"n": 2}))
    assert d is not None and d.rule == "demo.t#fallback"


def test_fallback_allow(engine: str) -> None:
    r = rev(
        engine,
        {"demo.t": {"effect": "write", "rules": [{"forbid": "args.n > 3"}], "fallback": "allow"}},
    )
    assert run(ArgRulesCheck, r, make_call("t", {"n": 1})) is None
    d = run(ArgRulesCheck, r, make_call("t", {"n": 4}))
    assert d is not None and d.rule == "demo.t#0"


def test_erroring_forbid_refuses(engine: str) -> None:
    r = rev(
        engine,
        {
            "demo.t": {
                "effect": "write",
                "rules": [{"forbid": "args.limit > 100", "id": "cap", "reason": "limit too high"}],
            }
        },
    )
    d = run(ArgRulesCheck, r, make_call("t", {}))
    assert d is not None and d.code is Code.CAPABILITY_BLOCKED and d.rule == "cap"
    assert d.reason.startswith("limit too high (rule error: ")
    assert run(ArgRulesCheck, r, make_call("t", {"limit": 5})) is None


def test_erroring_allow_does_not_match(engine: str) -> None:
    r = rev(
        engine,
        {
            "demo.t": {
                "effect": "write",
                "rules": [{"allow": "args.missing == 1"}, {"allow": "args.n == 1"}],
            }
        },
    )
    assert run(ArgRulesCheck, r, make_call("t", {"n": 1})) is None  # second allow still runs
    d = run(ArgRulesCheck, r, make_call("t", {"n": 2}))
    assert d is not None and d.rule == "demo.t#fallback"


def test_no_rules_continue(engine: str) -> None:
    r = rev(engine, {"demo.t": {"effect": "write"}})
    assert run(ArgRulesCheck, r, make_call("t", {"n": 1})) is None
