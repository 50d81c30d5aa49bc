"""The policy test runner (`proxy.tools.policy_tests`): running, expectations, coverage, reporting."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.tools.policy_tests import render_json, render_text, run_tests

POLICY = """
version: 1
upstreams:
  up: {url: "http://127.0.0.1:1/mcp", trust_annotations: true}
defaults:
  request_headers: [x-tenant]
tools:
  up.read:
    effect: read
  up.annotated: {}
  up.write:
    effect: write
    allow: '"writers" in principal.groups'
    rules:
      - id: no-secret
        forbid: 'args.path.startsWith("secret/")'
        reason: "no secrets"
      - id: tenant-dir
        allow: '"x-tenant" in request.headers && args.path.startsWith(request.headers["x-tenant"] + "/")'
    fallback: deny
    fallback_reason: "only the tenant's directory"
  up.nuke:
    effect: destructive
principals:
  reader:
    capability: read-only
  boxed:
    allow: 'tool.name != "nuke"'
"""

CASES = """
cases:
  - name: read is allowed
    principal: {id: reader}
    call: {tool: up.read, arguments: {}}
    expect: {verdict: allow, code: ok, check: envelope}
  - name: forbid rule
    principal: {id: w, groups: [writers]}
    call: {tool: up.write, arguments: {path: secret/x}}
    expect: {verdict: deny, code: capability_blocked, check: arg_rules, rule: no-secret}
  - name: tenant allow rule
    principal: {id: w, groups: [writers]}
    request: {headers: {X-Tenant: acme}}
    run: {id: r1, parent: r0, history: [{tool: up.read, output: untrusted, sensitivity: secret}]}
    call: {tool: up.write, arguments: {path: acme/x}}
    expect: {verdict: allow}
  - name: unauthorized
    principal: {id: w, groups: []}
    call: {tool: up.write, arguments: {path: acme/x}}
    expect: {verdict: deny, code: unauthorized, check: authz, rule: tools.up.write.allow}
  - name: gated call is pending at once
    principal: {id: w}
    call: {tool: up.nuke, arguments: {}}
    expect: {verdict: deny, code: approval_pending, check: approval, rule: defaults.gated_effects}
  - name: effect from trusted annotations
    principal: {id: reader}
    call: {tool: up.annotated, arguments: {}}
    annotations: {readOnlyHint: true}
    expect: {verdict: allow}
"""


@pytest.fixture
def pack(write: Callable[[str, str], Path]) -> Path:
    write("policy.yaml", POLICY)
    return write("tests/cases.yaml", CASES).parent.parent


def test_all_pass_on_every_engine(pack: Path, engine: str) -> None:
    report = run_tests(pack, engine=engine)
    assert report.ok, render_text(report, verbose=True)
    assert report.engine == engine
    assert len(report.results) == 6


def test_run_history_is_recorded(pack: Path) -> None:
    report = run_tests(pack)
    case = next(r.case.case for r in report.results if r.case.case.name == "tenant allow rule")
    assert case.run.parent == "r0"
    assert case.run.history[0].sensitivity == "secret"


TAINT_POLICY = """
version: 1
upstreams:
  up: {url: "http://127.0.0.1:1/mcp"}
dataflow: {mode: shadow}
tools:
  up.fetch: {effect: read}
  up.vault: {effect: read, output: trusted, sensitivity: secret}
  up.post:
    effect: write
    rules:
      - {id: clean-runs-only, forbid: 'run.tainted', reason: "the run has read untrusted content"}
      - {id: no-secrets-out, forbid: 'run["secret"]', reason: "the run has read secrets"}
"""

TAINT_CASES = """
cases:
  - name: a clean run may post
    principal: {id: a}
    call: {tool: up.post, arguments: {}}
    expect: {verdict: allow}
  - name: an untrusted read taints the run
    principal: {id: a}
    run: {history: [{tool: up.fetch, output: untrusted}]}
    call: {tool: up.post, arguments: {}}
    expect: {verdict: deny, code: capability_blocked, check: arg_rules, rule: clean-runs-only}
  - name: a secret read marks the run secret
    principal: {id: a}
    run: {history: [{tool: up.vault, output: trusted, sensitivity: secret}]}
    call: {tool: up.post, arguments: {}}
    expect: {verdict: deny, code: capability_blocked, check: arg_rules, rule: no-secrets-out}
"""


def test_run_history_feeds_run_tainted_and_run_secret(write: Callable[[str, str], Path], engine: str) -> None:
    """A case's `history` is written into the run's ledger first, so CEL's `run.tainted` and
    `run.secret` see it as they would on the wire."""
    write("policy.yaml", TAINT_POLICY)
    pack = write("tests/cases.yaml", TAINT_CASES).parent.parent
    report = run_tests(pack, engine=engine)
    assert report.ok, render_text(report, verbose=True)
    assert [r.code for r in report.results] == ["ok", "capability_blocked", "capability_blocked"]


def test_run_taint_with_dataflow_off_is_a_load_error(write: Callable[[str, str], Path]) -> None:
    path = write("policy.yaml", TAINT_POLICY.replace("mode: shadow", "mode: \"off\""))
    report = run_tests(path.parent)
    assert not report.ok
    text = "\n".join(str(p) for p in report.problems)
    assert "policy.yaml:11:9:" in text and "tools.up.post rule clean-runs-only reads run.tainted" in text
    assert "dataflow.mode is off" in text and "rule no-secrets-out" in text


@pytest.mark.parametrize("field,value,words", [
    ("verdict", "deny", "verdict: expected deny, got allow"),
    ("code", "unauthorized", "code: expected unauthorized, got ok"),
    ("check", "authz", "check: expected authz, got envelope"),
    ("rule", "some-rule", "rule: expected some-rule, got None"),
])
def test_each_expect_field_is_compared(write: Callable[[str, str], Path], field: str, value: str,
                                       words: str) -> None:
    write("policy.yaml", POLICY)
    expect = {"verdict": "allow", field: value}
    write("p.test.yaml", f"""
        cases:
          - name: one
            principal: {{id: reader}}
            call: {{tool: up.read}}
            expect: {json.dumps(expect)}
        """)
    report = run_tests(write("policy.yaml", POLICY).parent)
    assert not report.ok
    [failure] = report.failures
    assert failure.mismatches == (words,)
    text = render_text(report)
    assert "FAIL: one (" in text and words in text


def test_an_allowed_case_names_the_allow_rule_that_let_it_through(write: Callable[[str, str], Path]) -> None:
    # On main an allowed call had no rule: `expect: {verdict: allow, rule: tenant-dir}` failed
    # with "expected tenant-dir, got None", and -v did not say which rule allowed it.
    write("policy.yaml", POLICY.replace("fallback: deny", "fallback: allow"))
    write("p.test.yaml", """
        cases:
          - name: tenant
            principal: {id: w, groups: [writers]}
            request: {headers: {X-Tenant: acme}}
            call: {tool: up.write, arguments: {path: acme/x}}
            expect: {verdict: allow, rule: tenant-dir}
          - name: fallback
            principal: {id: w, groups: [writers]}
            call: {tool: up.write, arguments: {path: other/x}}
            expect: {verdict: allow, rule: up.write#fallback}
          - name: wrong rule
            principal: {id: w, groups: [writers]}
            call: {tool: up.write, arguments: {path: other/x}}
            expect: {verdict: allow, rule: tenant-dir}
          - name: no rules
            principal: {id: reader}
            call: {tool: up.read}
            expect: {verdict: allow}
        """)
    report = run_tests(write("policy.yaml", POLICY.replace("fallback: deny", "fallback: allow")).parent)
    assert [(r.case.case.name, r.rule, r.mismatches) for r in report.results] == [
        ("tenant", "tenant-dir", ()),
        ("fallback", "up.write#fallback", ()),
        ("wrong rule", "up.write#fallback", ("rule: expected tenant-dir, got up.write#fallback",)),
        ("no rules", None, ()),
    ]
    assert "decided: verdict=allow code=ok check=envelope rule=tenant-dir" in render_text(report, verbose=True)


def test_the_capability_header_narrows_as_on_the_wire(write: Callable[[str, str], Path]) -> None:
    # On main the case's X-Envelope-Capability was dropped: the write was allowed.
    write("policy.yaml", POLICY)
    write("p.test.yaml", """
        cases:
          - name: narrowed
            principal: {id: w, groups: [writers]}
            request: {headers: {X-Envelope-Capability: read-only, X-Tenant: acme}}
            call: {tool: up.write, arguments: {path: acme/x}}
            expect: {verdict: deny, code: capability_blocked, check: capability,
                     rule: "request:X-Envelope-Capability"}
          - name: never widened
            principal: {id: reader}
            request: {headers: {X-Envelope-Capability: read-write}}
            call: {tool: up.write, arguments: {path: acme/x}}
            expect: {verdict: deny, code: capability_blocked, rule: principals.reader.capability}
        """)
    report = run_tests(write("policy.yaml", POLICY).parent)
    assert [(r.case.case.name, r.mismatches) for r in report.results] == [("narrowed", ()), ("never widened", ())]


def test_verbose_shows_the_deciding_check_rule_and_reason(pack: Path) -> None:
    text = render_text(run_tests(pack), verbose=True)
    assert "PASS: forbid rule (" in text
    assert "decided: verdict=deny code=capability_blocked check=arg_rules rule=no-secret" in text
    assert "reason:  no secrets" in text
    quiet = render_text(run_tests(pack))
    assert "PASS: forbid rule" not in quiet and "6/6 cases passed" in quiet


def test_coverage_math_and_threshold(pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_tests(pack, coverage=True)
    cov = report.coverage
    assert cov is not None
    # tools 4, tool allow 1, rules 2, fallback 1 (up.write), principal allow 1 (boxed) = 9;
    # not exercised: the fallback of up.write and the boxed principal's allow.
    missed = {(i.kind, i.id) for i in cov.missed}
    assert missed == {("fallback", "up.write#fallback"), ("principal_allow", "principals.boxed.allow[0]")}
    assert len(cov.items) == 9 and cov.percent == pytest.approx(700 / 9)
    assert main(["test", str(pack), "--threshold", "77"]) == 0
    assert main(["test", str(pack), "--threshold", "78"]) == 1
    out = capsys.readouterr().out
    assert "coverage: 77.8%" in out and "below the threshold 78%" in out
    assert "not exercised: fallback up.write#fallback" in out


def test_json_format(pack: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", str(pack), "--format", "json", "--coverage"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["passed"] == 6 and data["failures"] == []
    assert {c["name"] for c in data["cases"]} >= {"forbid rule", "unauthorized"}
    assert data["coverage"]["total"] == 9 and data["coverage"]["covered"] == 7
    assert json.loads(render_json(run_tests(pack)))["coverage"] is None


def test_failing_case_exit_code(write: Callable[[str, str], Path]) -> None:
    write("policy.yaml", POLICY)
    path = write("tests/c.yaml", CASES.replace("rule: no-secret", "rule: tenant-dir"))
    assert main(["test", str(path.parent.parent)]) == 1


def test_bad_case_file_is_located(write: Callable[[str, str], Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    write("policy.yaml", POLICY)
    bad = write("tests/bad.yaml", """
        cases:
          - name: typo
            principal: {id: reader}
            call: {tool: up.read}
            expect: {verdict: allow, colour: red}
          - name: bad code
            principal: {id: reader}
            call: {tool: up.read}
            expect: {verdict: deny, code: nope}
          - name: near misses
            principal: {id: reader}
            call: {tool: up.read, argument: {}}
            expect: {verdict: deny, code: capabilty_blocked, check: argrules}
        """)
    report = run_tests(bad.parent.parent)
    assert [str(p) for p in report.problems] == [
        f"{bad}:5:30: unknown field 'colour' in cases.0.expect (allowed: verdict, code, check, rule)",
        f"{bad}:9:35: cases.1.expect.code: unknown reason code 'nope' " + report.problems[1].message.split("'nope' ", 1)[1],
        f"{bad}:12:27: unknown field 'argument' (did you mean 'arguments'?) in cases.2.call "
        "(allowed: tool, arguments)",
        f"{bad}:13:35: cases.2.expect.code: unknown reason code 'capabilty_blocked' (did you mean "
        "'capability_blocked'?) (known: " + report.problems[3].message.split("(known: ", 1)[1],
        f"{bad}:13:61: cases.2.expect.check: unknown check 'argrules' (did you mean 'arg_rules'?) "
        "(known: " + report.problems[4].message.split("(known: ", 1)[1],
    ]
    assert main(["test", str(bad.parent.parent)]) == 1
    assert f"{bad}:5:30: unknown field 'colour'" in capsys.readouterr().out


def test_a_case_file_that_is_not_utf8_is_located(write: Callable[[str, str], Path]) -> None:
    write("policy.yaml", POLICY)
    bad = write("x.test.yaml", "")
    bad.write_bytes(b"cases:\n  - name: caf\xe9\n")
    assert [str(p) for p in run_tests(bad.parent).problems] == [
        f"{bad}:2:14: not UTF-8: byte 0xe9 (invalid continuation byte); save the file as UTF-8"
    ]


def test_a_case_calling_an_undeclared_upstream_is_a_problem(write: Callable[[str, str], Path]) -> None:
    # On main it ran and passed: a call to an upstream no policy declares is refused whatever
    # the policy says, so `expect: {verdict: deny}` proved nothing about the tool meant.
    write("policy.yaml", POLICY)
    bad = write("p.test.yaml", """
        cases:
          - name: typo
            principal: {id: w, groups: [writers]}
            call: {tool: upp.write, arguments: {path: secret/x}}
            expect: {verdict: deny}
        """)
    assert [str(p) for p in run_tests(bad.parent).problems] == [
        f"{bad}:4:18: case 'typo' calls 'upp.write': upstream 'upp' (did you mean 'up'?) is not "
        "declared under upstreams (declared: up)"]


def test_bad_yaml_is_located(write: Callable[[str, str], Path]) -> None:
    write("policy.yaml", POLICY)
    bad = write("x.test.yaml", "cases:\n  - name: [unclosed\n")
    [problem] = run_tests(bad.parent).problems
    assert problem.file == str(bad) and problem.line >= 2 and "YAML syntax error" in problem.message


def test_policy_errors_are_reported(write: Callable[[str, str], Path]) -> None:
    path = write("policy.yaml", POLICY.replace("effect: read\n  up.annotated", "effect: reed\n  up.annotated", 1))
    write("tests/c.yaml", CASES)
    report = run_tests(path.parent)
    assert report.problems and str(report.problems[0]).startswith(f"{path}:8:")
    assert "no case was run" in render_text(report)


def test_no_cases_is_an_error(write: Callable[[str, str], Path]) -> None:
    path = write("policy.yaml", POLICY)
    assert "no policy test cases" in str(run_tests(path.parent).problems[0])
