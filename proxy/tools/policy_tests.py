"""Policy tests: YAML cases kept beside the policies, run on the proxy's own chain.

Modelled on `opa test`: `discover`/`load_cases` read the case files (every problem as
`file:line:column: message`, collected before failing), `run_tests` decides every case on the real
`proxy.envelope.pipeline.Chain` and returns a `TestReport`, and `render_text` / `render_json`
only report. Nothing here prints.

A case file (under `<dir>/tests/`, or `*.test.yaml` anywhere in the directory; the policy loader
skips both) holds `cases:`, a list of:

    - name: writes outside the workspace are refused
      principal: {id: ops-agent, groups: [ops], claims: {}}
      run: {id: r1, parent: r0, history: [{tool: fetch.fetch, output: untrusted}]}   # optional
      request: {headers: {x-tenant: acme}}                                             # optional
      call: {tool: filesystem.write_file, arguments: {path: /etc/passwd}}
      annotations: {readOnlyHint: false}                                               # optional
      expect: {verdict: deny, code: capability_blocked, check: arg_rules, rule: in-workspace}

Each case runs with a fresh in-memory store and the default runtime config, so stateful checks
(shadow, approval, idempotency) behave as in `envelope-proxy serve`, except that a gated call is
not held: the approval check answers `approval_pending` at once instead of waiting
`approval.wait` for a person (`Services(hold_calls=False)`).

The run `history` labels are written into the run's data-flow ledger before the case runs, as
the proxy would have after those results: `run.tainted` / `run.secret` in CEL, the data-flow
trifecta and the rest behave as on the wire (labels only: no texts, so no verbatim matches).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ruamel.yaml.nodes import MappingNode, Node, SequenceNode

from proxy.envelope import pipeline
from proxy.envelope.celvars import activation
from proxy.envelope.dataflow import ledger
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    Code,
    Decision,
    Principal,
    RequestInfo,
    RunContext,
    Services,
    ToolCall,
)
from proxy.errors import CelEvalError, PolicyError, PolicyProblem
from proxy.policy.compiled import Location, PolicyRevision
from proxy.policy.loader import allowed_fields, load_policy
from proxy.policy.model import TOOL_KEY, DataflowPolicy
from proxy.policy.vocab import did_you_mean
from proxy.policy.yamlload import (
    Converter,
    YamlFile,
    duplicate_keys,
    locate,
    mapping_items,
    parse_file,
    problem,
    read_text,
)

# Check ids a case may name in `expect.check`: the chain's checks, plus "envelope" (allowed by
# every check).
CHECK_IDS: tuple[str, ...] = (*(cls.id for cls in pipeline.CHECKS), "envelope")
CODES: tuple[str, ...] = tuple(c.value for c in Code)


# -- the case model ------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrincipalSpec(_Model):
    """The verified principal of the call (as identity would establish it)."""

    id: str = Field(min_length=1)
    groups: list[str] = Field(default_factory=list)
    claims: dict[str, Any] = Field(default_factory=dict)


class ResultLabel(_Model):
    """An earlier tool result of the run and its labels (written into the run's ledger before
    the case runs)."""

    tool: str
    output: Literal["trusted", "untrusted"] = "untrusted"
    sensitivity: Literal["public", "secret"] = "public"


class RunSpec(_Model):
    """The run the call belongs to. Absent `id`: `test:<case name>`; absent `parent`: a root run."""

    id: str | None = None
    parent: str | None = None
    history: list[ResultLabel] = Field(default_factory=list)


class RequestSpec(_Model):
    """Request headers. Only `defaults.request_headers` reach CEL (as on the wire);
    `x-envelope-run`, `x-envelope-shadow`, `x-envelope-capability`, `idempotency-key` and
    `mcp-protocol-version` act as they do on the wire."""

    headers: dict[str, str] = Field(default_factory=dict)


class CallSpec(_Model):
    tool: str  # `<upstream>.<tool>`
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("tool")
    @classmethod
    def _key(cls, v: str) -> str:
        if not TOOL_KEY.match(v):
            raise ValueError(f"tool {v!r} must be '<upstream>.<tool>'")
        return v


class Expect(_Model):
    """What the chain must decide. Every field but `verdict` is optional (absent: not checked)."""

    verdict: Literal["allow", "deny", "error"]
    code: str | None = None
    check: str | None = None
    rule: str | None = None

    @field_validator("code")
    @classmethod
    def _code(cls, v: str | None) -> str | None:
        if v is not None and v not in CODES:
            raise ValueError(f"unknown reason code {v!r}{did_you_mean(v, CODES)} (known: {', '.join(CODES)})")
        return v

    @field_validator("check")
    @classmethod
    def _check(cls, v: str | None) -> str | None:
        if v is not None and v not in CHECK_IDS:
            raise ValueError(f"unknown check {v!r}{did_you_mean(v, CHECK_IDS)} (known: {', '.join(CHECK_IDS)})")
        return v


class Case(_Model):
    name: str = Field(min_length=1)
    principal: PrincipalSpec
    run: RunSpec = Field(default_factory=RunSpec)
    request: RequestSpec = Field(default_factory=RequestSpec)
    call: CallSpec
    # What the upstream announces for the called tool in tools/list (MCP annotations), to
    # exercise effects from annotations. Absent: the upstream's list is not known.
    annotations: dict[str, Any] | None = None
    expect: Expect


class CaseFile(_Model):
    cases: list[Case]


@dataclass(frozen=True, slots=True)
class LoadedCase:
    case: Case
    location: Location
    # Where the case's `call.tool` is written (None: not known).
    tool_at: Location | None = None

    @property
    def title(self) -> str:
        return f"{self.location.file}: {self.case.name}"


# -- discovery and loading -----------------------------------------------------------------------


def discover(directory: Path) -> list[Path]:
    """Case files: every `*.yaml`/`*.yml` under a `tests/` directory, and `*.test.yaml`/`*.test.yml`
    anywhere below `directory` (hidden paths skipped), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel = Path(dirpath).relative_to(directory).parts
        in_tests = "tests" in rel
        for name in filenames:
            if name.startswith(".") or not name.endswith((".yaml", ".yml")):
                continue
            if in_tests or name.endswith((".test.yaml", ".test.yml")):
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def load_cases(paths: Iterable[Path]) -> tuple[list[LoadedCase], list[PolicyProblem]]:
    """Every case of every file, and every problem (YAML syntax, duplicate keys, unknown fields,
    wrong types, duplicate case names) with its file, line and column."""
    cases: list[LoadedCase] = []
    problems: list[PolicyProblem] = []
    convert = Converter()
    for path in paths:
        name = str(path)
        text = read_text(path, name)
        if isinstance(text, PolicyProblem):
            problems.append(text)
            continue
        parsed, found = parse_file(name, text)
        problems += found
        if parsed is None or parsed.root is None:
            if parsed is not None:
                problems.append(PolicyProblem(name, 1, 1, "empty test file (expected 'cases:')"))
            continue
        problems += duplicate_keys(name, parsed.root)
        loaded, found = _file_cases(parsed, convert)
        cases += loaded
        problems += found
    return cases, problems


def _file_cases(f: YamlFile, convert: Converter) -> tuple[list[LoadedCase], list[PolicyProblem]]:
    root = f.root
    assert root is not None
    if not isinstance(root, MappingNode):
        return [], [problem(f.name, root, "a test file must be a mapping with 'cases:'")]
    try:
        model = CaseFile.model_validate(convert.value(root))
    except ValidationError as exc:
        errors: list[PolicyProblem] = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            where = ".".join(str(p) for p in loc[:-1]) if err["type"] == "extra_forbidden" else ".".join(
                str(p) for p in loc)
            if err["type"] == "extra_forbidden":
                allowed = allowed_fields(CaseFile, loc[:-1])
                errors.append(problem(f.name, locate(root, loc, key=True),
                                   f"unknown field '{loc[-1]}'{did_you_mean(str(loc[-1]), allowed)} "
                                   f"in {where or 'the file'}"
                                   + (f" (allowed: {', '.join(allowed)})" if allowed else "")))
            elif err["type"] == "missing":
                errors.append(problem(f.name, locate(root, loc),
                                   f"missing required field '{loc[-1]}'"
                                   + (f" in {'.'.join(str(p) for p in loc[:-1])}" if loc[:-1] else "")))
            else:
                msg = str(err["msg"]).removeprefix("Value error, ")
                errors.append(problem(f.name, locate(root, loc), f"{where}: {msg}"))
        return [], errors
    seq = dict((k.value, v) for k, v in mapping_items(root)).get("cases")
    items: list[Node] = list(seq.value) if isinstance(seq, SequenceNode) else []
    loaded: list[LoadedCase] = []
    out: list[PolicyProblem] = []
    seen: dict[str, str] = {}
    for index, case in enumerate(model.cases):
        node = items[index] if index < len(items) else root
        name_node = locate(node, ("name",))
        line, col = name_node.start_mark.line + 1, name_node.start_mark.column + 1
        if case.name in seen:
            out.append(problem(f.name, name_node,
                               f"duplicate case name {case.name!r} (first at {seen[case.name]})"))
            continue
        at = Location(f.name, line, col)
        seen[case.name] = str(at)
        tool_node = locate(node, ("call", "tool"))
        tool_at = Location(f.name, tool_node.start_mark.line + 1, tool_node.start_mark.column + 1)
        loaded.append(LoadedCase(case, at, tool_at))
    return loaded, out


# -- running -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaseResult:
    case: LoadedCase
    verdict: str
    code: str
    check: str
    rule: str | None
    reason: str
    mismatches: tuple[str, ...]  # "code: expected x, got y"; empty when the case passed

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def as_json(self) -> dict[str, Any]:
        c = self.case
        return {
            "name": c.case.name, "file": c.location.file, "line": c.location.line,
            "column": c.location.column, "passed": self.passed,
            "expected": c.case.expect.model_dump(exclude_none=True),
            "got": {"verdict": self.verdict, "code": self.code, "check": self.check,
                    "rule": self.rule, "reason": self.reason},
            "mismatches": list(self.mismatches),
        }


@dataclass(frozen=True, slots=True)
class CoverageItem:
    """One thing a case can exercise: a tool, a rule, an `allow` expression or a fallback."""

    kind: Literal["tool", "rule", "tool_allow", "principal_allow", "fallback"]
    id: str
    location: Location | None

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id,
                "location": str(self.location) if self.location else None}


@dataclass(frozen=True, slots=True)
class Coverage:
    items: tuple[CoverageItem, ...]
    covered: frozenset[CoverageItem]

    @property
    def percent(self) -> float:
        return 100.0 if not self.items else 100.0 * len(self.covered) / len(self.items)

    @property
    def missed(self) -> list[CoverageItem]:
        return [i for i in self.items if i not in self.covered]

    def as_json(self) -> dict[str, Any]:
        return {"percent": round(self.percent, 2), "covered": len(self.covered),
                "total": len(self.items), "not_covered": [i.as_json() for i in self.missed]}


@dataclass(slots=True)
class TestReport:
    """Everything a run found: results, problems (policy or case files), coverage."""

    directory: Path
    engine: str = ""
    revision: str = ""
    results: list[CaseResult] = field(default_factory=list)
    problems: list[PolicyProblem] = field(default_factory=list)
    coverage: Coverage | None = None
    threshold: float | None = None

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    @property
    def below_threshold(self) -> bool:
        return (self.threshold is not None and self.coverage is not None
                and self.coverage.percent < self.threshold)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.failures and not self.below_threshold

    def as_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory), "engine": self.engine, "revision": self.revision,
            "ok": self.ok,
            "passed": len(self.results) - len(self.failures), "failed": len(self.failures),
            "problems": [str(p) for p in self.problems],
            "cases": [r.as_json() for r in self.results],
            "failures": [r.as_json() for r in self.failures],
            "coverage": None if self.coverage is None else {
                **self.coverage.as_json(), "threshold": self.threshold,
                "below_threshold": self.below_threshold},
        }


def coverage_items(revision: PolicyRevision) -> list[CoverageItem]:
    """What coverage counts: each tool, each argument rule (by id), each tool and principal
    `allow` expression, and the fallback of each tool with rules or a deny fallback."""
    items: list[CoverageItem] = []
    for key, tool in revision.tools.items():
        items.append(CoverageItem("tool", key, tool.location))
        for i, _ in enumerate(tool.allow):
            items.append(CoverageItem("tool_allow", f"tools.{key}.allow[{i}]", tool.location))
        for rule in tool.rules:
            items.append(CoverageItem("rule", f"{key}/{rule.id}", rule.location))
        if tool.rules or tool.fallback == "deny":
            items.append(CoverageItem("fallback", f"{key}#fallback", tool.location))
    for pid, principal in revision.principals.items():
        for i, _ in enumerate(principal.allow):
            items.append(CoverageItem("principal_allow", f"principals.{pid}.allow[{i}]",
                                      principal.location))
    return items


def _reached(decision: Decision, check_id: str) -> bool:
    """Whether the chain got past the start of check `check_id` for this decision."""
    order = list(CHECK_IDS)
    return order.index(decision.check) >= order.index(check_id) if decision.check in order else False


def _exercised(revision: PolicyRevision, call: ToolCall, decision: Decision) -> set[CoverageItem]:
    """The items this call exercised: the tool; each `allow` expression that was true; the
    argument rule or fallback that decided (re-evaluated singly, exactly as arg_rules orders them)."""
    key = call.qualified_name
    tool = revision.tools.get(key)
    hit: set[CoverageItem] = set()
    if tool is None:
        return hit
    hit.add(CoverageItem("tool", key, tool.location))
    if not _reached(decision, "authz") or call.effect is None:
        return hit
    try:
        act = activation(call, revision.cel)
    except CelEvalError:
        return hit

    def true(program: Any) -> bool:
        try:
            return bool(program.evaluate(act))
        except CelEvalError:
            return False

    for i, program in enumerate(tool.allow):
        if true(program):
            hit.add(CoverageItem("tool_allow", f"tools.{key}.allow[{i}]", tool.location))
    principal = revision.principals.get(call.principal.id)
    if principal is not None:
        for i, program in enumerate(principal.allow):
            if true(program):
                hit.add(CoverageItem("principal_allow", f"principals.{principal.id}.allow[{i}]",
                                     principal.location))
    if not _reached(decision, "arg_rules") or decision.check == "authz":
        return hit
    if not (tool.rules or tool.fallback == "deny"):
        return hit
    for rule in tool.rules:
        if rule.kind == "forbid":
            try:
                matched = rule.program.evaluate(act)
            except CelEvalError:
                matched = True  # a forbid rule that errors counts as matched
        else:
            matched = true(rule.program)
        if matched:
            hit.add(CoverageItem("rule", f"{key}/{rule.id}", rule.location))
            return hit
    hit.add(CoverageItem("fallback", f"{key}#fallback", tool.location))
    return hit


def _call(case: Case, revision: PolicyRevision) -> ToolCall:
    upstream, _, name = case.call.tool.partition(".")
    headers = {k.lower(): v for k, v in case.request.headers.items()}
    wanted = {h.lower() for h in revision.document.defaults.request_headers}
    run = case.run
    key = headers.get("idempotency-key")
    return ToolCall(
        decision_id=uuid.uuid4().hex,
        upstream=upstream,
        tool=name,
        arguments=dict(case.call.arguments),
        principal=Principal(case.principal.id, tuple(case.principal.groups),
                            dict(case.principal.claims)),
        run=RunContext(
            id=headers.get("x-envelope-run") or run.id or f"test:{case.name}",
            principal=case.principal.id,
            parent=run.parent,
            depth=1 if run.parent else 0,
        ),
        request=RequestInfo(method="tools/call",
                            protocol_version=headers.get("mcp-protocol-version", ""),
                            headers={h: v for h, v in headers.items() if h in wanted}),
        idempotency_key=key[:200] if key else None,
        shadow_requested=headers.get("x-envelope-shadow", "").strip().lower() in ("1", "true", "yes"),
        capability_requested=headers.get("x-envelope-capability"),
    )


def _chain(revision: PolicyRevision, case: Case) -> pipeline.Chain:
    from proxy.config import Config
    from proxy.store.memory import MemoryStore

    registry = ToolRegistry()
    if case.annotations is not None:
        upstream, _, name = case.call.tool.partition(".")
        registry.learn(upstream, [{"name": name, "annotations": case.annotations}])
    services = Services(store=MemoryStore(), settings=Config(), hold_calls=False)
    return pipeline.Chain(revision, registry, None, services)


async def _seed_history(chain: pipeline.Chain, run_key: str, history: list[ResultLabel]) -> None:
    """Write the case's run history into the run's ledger, as the proxy would have after those
    results: untrusted and secret flags, so `run.tainted` / `run.secret`, the trifecta and a
    coarse-free ledger behave as on the wire (a history has labels, not texts: no fingerprints)."""
    policy = chain.revision.document.dataflow or DataflowPolicy()
    store = chain.services.store if chain.services is not None else None
    for item in history:
        delta = ledger.LedgerDelta(item.tool, untrusted=item.output == "untrusted",
                                     secret=item.sensitivity == "secret")
        if store is not None and not delta.empty:
            await ledger.record(store, run_key, delta, n=policy.min_match,
                                  cap=policy.ledger_cap, ttl=policy.ledger_ttl, window=policy.winnow,
                                  min_value=policy.min_value)


def _allowed_by(call: ToolCall, decision: Decision, exercised: set[CoverageItem]) -> str | None:
    """The rule that let an allowed call through the argument rules: the first allow rule that
    matched, or `<tool>#fallback` (fallback allow); None for a refusal or a tool without rules.
    The chain does not name it (it evaluates a tool's allow rules as one program), so it is
    read from what the case exercised, evaluated singly in the chain's order."""
    if decision.verdict.value != "allow":
        return None
    key = call.qualified_name
    for item in exercised:
        if item.kind == "rule" and item.id.startswith(f"{key}/"):
            return item.id[len(key) + 1:]
        if item.kind == "fallback" and item.id == f"{key}#fallback":
            return item.id
    return None


def _compare(expect: Expect, d: Decision, rule: str | None) -> tuple[str, ...]:
    out = []
    for fieldname, got in (("verdict", d.verdict.value), ("code", d.code.value),
                           ("check", d.check), ("rule", rule)):
        want = getattr(expect, fieldname)
        if want is not None and want != got:
            out.append(f"{fieldname}: expected {want}, got {got}")
    return tuple(out)


async def _run_cases(revision: PolicyRevision, cases: list[LoadedCase],
                     hits: set[CoverageItem]) -> list[CaseResult]:
    results = []
    for loaded in cases:
        case = loaded.case
        call = _call(case, revision)
        chain = _chain(revision, case)
        await _seed_history(chain, call.run.key, case.run.history)
        decision = await chain.run(call)
        exercised = _exercised(revision, call, decision)
        hits |= exercised
        rule = decision.rule or _allowed_by(call, decision, exercised)
        results.append(CaseResult(loaded, decision.verdict.value, decision.code.value,
                                  decision.check, rule, decision.reason,
                                  _compare(case.expect, decision, rule)))
    return results


def _undeclared_upstreams(revision: PolicyRevision, cases: list[LoadedCase]) -> list[PolicyProblem]:
    """A problem at each case calling a tool of an upstream the policy does not declare: such a
    call can only be refused, so a case expecting a refusal would pass whatever the policy says
    (a typo in the upstream's name)."""
    declared = revision.document.upstreams
    out = []
    for loaded in cases:
        upstream = loaded.case.call.tool.partition(".")[0]
        if upstream in declared:
            continue
        at = loaded.tool_at or loaded.location
        out.append(PolicyProblem(at.file, at.line, at.column,
                                 f"case {loaded.case.name!r} calls '{loaded.case.call.tool}': upstream "
                                 f"'{upstream}'{did_you_mean(upstream, declared)} is not declared "
                                 f"under upstreams (declared: {', '.join(sorted(declared)) or 'none'})"))
    return out


def run_tests(directory: Path, *, engine: str = "auto", coverage: bool = False,
              threshold: float | None = None) -> TestReport:
    """Load the policy and its cases under `directory` and decide every case, with the CEL
    engine named `engine` (`auto`, `cel-cpp`, `cel-python`).

    Never raises for a bad policy or case file: their problems are in the report (and no case
    runs). With `coverage` (implied by `threshold`), the report has the coverage of the policy's
    tools, rules, `allow` expressions and fallbacks.
    """
    directory = Path(directory)
    report = TestReport(directory, threshold=threshold)
    try:
        revision = load_policy(directory, engine=engine)
    except PolicyError as exc:
        report.problems = list(exc.problems)
        return report
    report.engine, report.revision = revision.engine, revision.revision
    cases, problems = load_cases(discover(directory))
    problems += _undeclared_upstreams(revision, cases)
    if not cases and not problems:
        problems.append(PolicyProblem(str(directory), 1, 1,
                                      "no policy test cases (tests/*.yaml or *.test.yaml)"))
    if problems:
        report.problems = sorted(problems, key=lambda p: (p.file, p.line, p.column))
        return report
    hits: set[CoverageItem] = set()
    report.results = asyncio.run(_run_cases(revision, cases, hits))
    if coverage or threshold is not None:
        items = tuple(coverage_items(revision))
        report.coverage = Coverage(items, frozenset(i for i in items if i in hits))
    return report


# -- reporting -----------------------------------------------------------------------------------


def _got(r: CaseResult) -> str:
    rule = f" rule={r.rule}" if r.rule else ""
    return f"verdict={r.verdict} code={r.code} check={r.check}{rule}"


def render_text(report: TestReport, verbose: bool = False) -> str:
    """The human report: problems, one line per case (failures with what differed; with
    `verbose`, which check and rule decided and why), a summary and the coverage."""
    lines: list[str] = [str(p) for p in report.problems]
    if report.problems:
        n = len(report.problems)
        lines.append(f"{n} problem{'s' if n != 1 else ''} in {report.directory}; no case was run")
        return "\n".join(lines) + "\n"
    for r in report.results:
        if r.passed and not verbose:
            continue
        lines.append(f"{'PASS' if r.passed else 'FAIL'}: {r.case.case.name} ({r.case.location})")
        for m in r.mismatches:
            lines.append(f"    {m}")
        if verbose or not r.passed:
            lines.append(f"    decided: {_got(r)}")
            lines.append(f"    reason:  {r.reason}")
    passed = len(report.results) - len(report.failures)
    lines.append(f"{'PASS' if not report.failures else 'FAIL'}: {passed}/{len(report.results)} "
                 f"cases passed ({report.engine})")
    cov = report.coverage
    if cov is not None:
        lines.append(f"coverage: {cov.percent:.1f}% ({len(cov.covered)}/{len(cov.items)} tools, rules, "
                     "allow expressions and fallbacks exercised)")
        for item in cov.missed:
            where = f" at {item.location}" if item.location else ""
            lines.append(f"  not exercised: {item.kind} {item.id}{where}")
        if report.below_threshold:
            lines.append(f"FAIL: coverage {cov.percent:.1f}% is below the threshold "
                         f"{report.threshold:g}%")
    return "\n".join(lines) + "\n"


def render_json(report: TestReport) -> str:
    """The machine-readable report: cases, failures, problems and coverage."""
    return json.dumps(report.as_json(), indent=2, sort_keys=True) + "\n"
