"""Catalogue check: the tool is known to policy and its policy can ever let it run.

Refuses `unknown_tool` (no `tools:` entry while `defaults.unknown_tools` is deny) and
`misconfigured` (a tool no call could ever pass, see `TOOL_RULES`). Sets `call.effect` for every
later check.

The rules are one ordered table shared by the check, the `tools/list` filter (`visible`) and the
misconfiguration report (`misconfigurations`), so what is refused and what is reported never
disagree. A misconfigured tool stays advertised in `tools/list` (its refusal says why); only an
upstream tool with no policy under `unknown_tools: deny` is hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from proxy.envelope.dataflow.fingerprint import MIN_TOKEN
from proxy.envelope.misconfig import EVERY_TOOL, Dependencies, Layer, Misconfiguration
from proxy.envelope.tools import ToolRegistry, effective_effect
from proxy.envelope.types import Code, Decision, Services, ToolCall, ToolInfo, deny
from proxy.policy.compiled import CompiledTool, PolicyRevision
from proxy.policy.model import MIN_PHRASE_CHARS, DataflowPolicy
from proxy.policy.vocab import Effect


def _upstream_of(key: str) -> str:
    return key.split(".", 1)[0]


def _trusts(revision: PolicyRevision, upstream: str) -> bool:
    declared = revision.document.upstreams.get(upstream)
    return bool(declared is not None and declared.trust_annotations)


def _shadow(policy: Any) -> bool:
    # `mode` may not exist in the policy model yet (the shadow check adds it).
    return getattr(policy, "mode", None) == "shadow"


@dataclass(frozen=True, slots=True)
class ToolFacts:
    """What the rules look at for one tool: its policy, effect, upstream and the runtime."""

    revision: PolicyRevision
    key: str
    compiled: CompiledTool | None
    effect: Effect
    # Whether the upstream's tools/list has this tool; None until that upstream's list is learned.
    offered: bool | None
    deps: Dependencies

    @property
    def upstream(self) -> str:
        return _upstream_of(self.key)

    @property
    def gated(self) -> bool:
        """A tool with an `approval` block is gated exactly when `approval.required` is true;
        otherwise when its effect is in `defaults.gated_effects`."""
        approval = self.compiled.policy.approval if self.compiled is not None else None
        if approval is not None:
            return bool(approval.required)
        return self.effect in self.revision.document.defaults.gated_effects


# The `principal` of a report entry about every principal the policy does not list.
UNLISTED_PRINCIPALS = "*"


# -- the rules: each returns why the tool can never run, or None ------------------------------


def _undeclared_upstream(t: ToolFacts) -> str | None:
    if t.upstream in t.revision.document.upstreams:
        return None
    return f"tool '{t.key}' names upstream '{t.upstream}', which is not declared under upstreams"


def _not_offered(t: ToolFacts) -> str | None:
    if t.offered is not False:
        return None
    return f"tool '{t.key}' is in the policy but upstream '{t.upstream}' does not offer it in tools/list"


def _fallback_deny_without_allow(t: ToolFacts) -> str | None:
    c = t.compiled
    if c is None or c.fallback != "deny" or any(rule.kind == "allow" for rule in c.rules):
        return None
    return f"tool '{t.key}' has fallback deny and no allow rule, so no call can ever run"


def _no_approval_gate(t: ToolFacts) -> str | None:
    if not t.gated:
        return None
    d = t.deps
    if d.store is None:
        why = "no state store is configured"
    elif not d.approvals_enabled:
        why = "approvals are disabled"
    elif not d.approval_check:
        why = "this proxy has no approval check"
    else:
        return None
    return f"tool '{t.key}' needs approval (effect {t.effect.value}) but no approval gate is configured ({why})"


def _no_idempotency_store(t: ToolFacts) -> str | None:
    if not t.gated or t.deps.store is not None:
        return None
    return (f"tool '{t.key}' has a gated effect ({t.effect.value}), which needs an idempotency store, "
            "but no state store is configured")


def _no_shadow_recorder(t: ToolFacts) -> str | None:
    if t.compiled is None or not _shadow(t.compiled.policy) or t.effect is Effect.READ:
        return None
    if t.deps.store is not None:
        return None
    return (f"tool '{t.key}' is in shadow mode (its calls are recorded, not performed) "
            "but no state store is configured to record them")


def _no_rate_store(t: ToolFacts) -> str | None:
    if t.compiled is None or t.compiled.policy.rate is None or t.deps.store is not None:
        return None
    return (f"tool '{t.key}' has a rate limit ({t.compiled.policy.rate}), which needs a state store "
            "to count its calls, but no state store is configured")


@dataclass(frozen=True, slots=True)
class Rule:
    """One way a tool can never run: a stable id (the report's `kind`), its layer, its test."""

    id: str
    layer: Layer
    test: Callable[[ToolFacts], str | None]


# Registry layer first (the catalogue and the policy disagree), then the envelope layer (a
# dependency is missing). A call is refused with the first problem found.
TOOL_RULES: tuple[Rule, ...] = (
    Rule("undeclared_upstream", "registry", _undeclared_upstream),
    Rule("not_offered", "registry", _not_offered),
    Rule("fallback_deny", "registry", _fallback_deny_without_allow),
    Rule("no_approval_gate", "envelope", _no_approval_gate),
    Rule("no_idempotency_store", "envelope", _no_idempotency_store),
    Rule("no_shadow_recorder", "envelope", _no_shadow_recorder),
    Rule("no_rate_store", "envelope", _no_rate_store),
)


_RULE_ORDER = {rule.id: index for index, rule in enumerate(TOOL_RULES)}


def tool_problems(facts: ToolFacts) -> list[Misconfiguration]:
    """Every reason the tool of `facts` can never run, in rule order; [] when a call can."""
    problems = []
    for rule in TOOL_RULES:
        reason = rule.test(facts)
        if reason is not None:
            problems.append(Misconfiguration(facts.key, rule.layer, rule.id, reason))
    return problems


def principal_problem(revision: PolicyRevision, principal_id: str, deps: Dependencies) -> Misconfiguration | None:
    """Why no writer call of this principal can run (shadow mode with no recorder), or None."""
    principal = revision.principals.get(principal_id)
    if principal is None or not _shadow(principal.policy) or deps.store is not None:
        return None
    return Misconfiguration(
        EVERY_TOOL, "envelope", "no_shadow_recorder",
        f"principal '{principal_id}' is in shadow mode (its writer calls are recorded, not performed) "
        "but no state store is configured to record them",
        principal=principal_id,
    )


def _limits(policy: Any) -> list[str]:
    """The names of the rate limits `policy` (a principal's or the defaults) sets."""
    return [name for name in ("rate", "max_calls_per_run", "max_concurrent_per_run")
            if getattr(policy, name, None) is not None]


def _rate_limits_without_store(revision: PolicyRevision, deps: Dependencies) -> list[Misconfiguration]:
    """Principals (listed, or every other one through `defaults`) whose calls are rate-limited
    while no state store counts them: the rate-limit check refuses every such call
    `misconfigured`. Report only (the refusal is the rate-limit check's)."""
    if deps.store is not None:
        return []
    report = []
    defaults = _limits(revision.document.defaults)
    for pid, principal in sorted(revision.principals.items()):
        own = _limits(principal.policy)
        if own or defaults:
            where = f"principals.{pid}" if own else "defaults"
            report.append(Misconfiguration(
                EVERY_TOOL, "envelope", "no_rate_store",
                f"principal '{pid}' is rate-limited ({', '.join(own or defaults)} in {where}), which "
                "needs a state store to count its calls, but no state store is configured",
                principal=pid))
    if defaults:
        report.append(Misconfiguration(
            EVERY_TOOL, "envelope", "no_rate_store",
            f"defaults set {', '.join(defaults)} for every principal not listed, which needs a "
            "state store to count their calls, but no state store is configured",
            principal=UNLISTED_PRINCIPALS))
    return report


def _offered(registry: ToolRegistry, upstream: str, tool: str) -> bool | None:
    if registry.get(upstream, tool) is not None:
        return True
    return False if upstream in registry.upstreams() else None


def _effect_of(
    revision: PolicyRevision, registry: ToolRegistry, upstream: str, tool: str
) -> Effect:
    compiled = revision.tools.get(f"{upstream}.{tool}")
    policy_effect = compiled.policy.effect if compiled is not None else None
    return effective_effect(
        policy_effect, registry.get(upstream, tool), _trusts(revision, upstream)
    )


def _facts(revision: PolicyRevision, registry: ToolRegistry, deps: Dependencies, key: str) -> ToolFacts:
    upstream, _, tool = key.partition(".")
    return ToolFacts(
        revision, key, revision.tools.get(key), _effect_of(revision, registry, upstream, tool),
        _offered(registry, upstream, tool), deps,
    )


def misconfiguration(
    revision: PolicyRevision, key: str, effect: Effect, deps: Dependencies | None = None,
    offered: bool | None = None,
) -> str | None:
    """Why no call of tool `key` (with its effective `effect`) can ever run; None when one can.

    `deps` absent: no store (every envelope-layer dependency missing).
    """
    facts = ToolFacts(revision, key, revision.tools.get(key), effect, offered,
                      deps or Dependencies(store=None))
    problems = tool_problems(facts)
    return problems[0].reason if problems else None


def misconfigurations(
    revision: PolicyRevision, registry: ToolRegistry, deps: Dependencies
) -> list[Misconfiguration]:
    """The report: every problem of every policy tool, of every learned tool (with no policy:
    `unknown_tool` under deny, else the rules as for a policy tool) and of every shadow principal.
    Sorted by tool, then in rule order (the first problem of a tool is the one its calls get)."""
    report: list[Misconfiguration] = []
    for key in revision.tools:
        report.extend(tool_problems(_facts(revision, registry, deps, key)))
    deny_unknown = revision.document.defaults.unknown_tools == "deny"
    for upstream in registry.upstreams():
        for info in registry.tools(upstream):
            key = f"{upstream}.{info.name}"
            if key in revision.tools:
                continue
            if deny_unknown:
                report.append(Misconfiguration(
                    key, "registry", "unknown_tool",
                    f"upstream '{upstream}' offers tool '{key}', which has no policy while "
                    "defaults.unknown_tools is deny (hidden from tools/list, refused as unknown_tool)",
                ))
            else:
                report.extend(tool_problems(_facts(revision, registry, deps, key)))
    for principal_id in revision.principals:
        problem = principal_problem(revision, principal_id, deps)
        if problem is not None:
            report.append(problem)
    report.extend(_rate_limits_without_store(revision, deps))
    return sorted(report, key=lambda p: (p.tool, p.principal or "", _RULE_ORDER.get(p.kind, -1)))


def misconfigured_tools(
    revision: PolicyRevision, registry: ToolRegistry, deps: Dependencies | None = None
) -> dict[str, str]:
    """Misconfigured tool key -> its first reason (tools that are refused as misconfigured)."""
    report: dict[str, str] = {}
    for p in misconfigurations(revision, registry, deps or Dependencies(store=None)):
        if p.kind != "unknown_tool" and p.principal is None:
            report.setdefault(p.tool, p.reason)
    return report


def _read_only(revision: PolicyRevision, principal_id: str) -> bool:
    # The capability check's own rule (capability, defaults, Rule-of-Two read-only floor).
    from proxy.envelope.checks.capability import principal_read_only_rule

    return principal_read_only_rule(revision, principal_id) is not None


def visible(
    revision: PolicyRevision, registry: ToolRegistry, principal_id: str, upstream: str, tool: str
) -> bool:
    """Whether `tools/list` shows this tool to this principal.

    Hidden when it has no policy under `unknown_tools: deny`, or when the principal is read-only
    and the tool's effect is not read. A misconfigured tool stays listed: a call gets a refusal
    that says why. CEL conditions (authz, rules) do not hide a tool: they depend on arguments.
    """
    key = f"{upstream}.{tool}"
    if key not in revision.tools and revision.document.defaults.unknown_tools == "deny":
        return False
    effect = _effect_of(revision, registry, upstream, tool)
    return not (effect is not Effect.READ and _read_only(revision, principal_id))


class CatalogueCheck:
    """First check: resolve the tool's policy and effective effect, refuse what can never run."""

    id: ClassVar[str] = "catalogue"

    def __init__(
        self, revision: PolicyRevision, registry: ToolRegistry, services: Services | None = None
    ):
        self._revision = revision
        self._registry = registry
        self._deps = Dependencies.of(services)
        self._tools = revision.tools
        self._deny_unknown = revision.document.defaults.unknown_tools == "deny"
        # HTTP upstreams: their OpenAPI document is the whole catalogue, so a tool it does not
        # describe can never run, whatever `unknown_tools` says (there is no request to send).
        self._specs = revision.specs
        self._trusted = frozenset(
            name for name, up in revision.document.upstreams.items() if up.trust_annotations
        )
        # (key, effect, offered) -> first problem or None. Keys are bounded by the policy
        # catalogue (tools with no policy are not cached).
        self._misconfigured: dict[tuple[str, Effect, bool | None], Misconfiguration | None] = {}
        self._shadow_principals = {
            pid: p for pid in revision.principals
            if (p := principal_problem(revision, pid, self._deps)) is not None
        }

    def _problem(self, key: str, compiled: CompiledTool | None, effect: Effect,
                 call: ToolCall) -> Misconfiguration | None:
        offered = (True if call.upstream_tool is not None
                   else _offered(self._registry, call.upstream, call.tool))
        cache_key = (key, effect, offered)
        try:
            return self._misconfigured[cache_key]
        except KeyError:
            pass
        problems = tool_problems(ToolFacts(self._revision, key, compiled, effect, offered, self._deps))
        problem = problems[0] if problems else None
        if compiled is not None:
            self._misconfigured[cache_key] = problem
        return problem

    def decide(self, call: ToolCall) -> Decision | None:
        """Refuse unknown or misconfigured tools; otherwise set `call.effect` and continue."""
        key = call.qualified_name
        spec = self._specs.get(call.upstream)
        if spec is not None and call.tool not in spec.operations:
            return deny(
                Code.UNKNOWN_TOOL,
                self.id,
                f"tool '{key}' is not an operation of upstream '{call.upstream}' (its OpenAPI document)",
                f"upstreams.{call.upstream}.openapi",
            )
        compiled = self._tools.get(key)
        if compiled is None and self._deny_unknown:
            return deny(
                Code.UNKNOWN_TOOL,
                self.id,
                f"tool '{key}' is not in the policy catalogue",
                "defaults.unknown_tools",
            )
        effect = effective_effect(
            compiled.policy.effect if compiled is not None else None,
            call.upstream_tool,
            call.upstream in self._trusted,
        )
        call.effect = effect
        problem = self._problem(key, compiled, effect, call)
        if problem is None and effect is not Effect.READ and self._shadow_principals:
            problem = self._shadow_principals.get(call.principal.id)
        if problem is not None:
            return deny(Code.MISCONFIGURED, self.id, problem.reason, problem.rule)
        return None


@dataclass(frozen=True, slots=True)
class WeakSpot:
    """A policy choice that lets a class of attack through unasked (not an error: a tool with a
    weak spot still runs). `subject` is the policy path to change."""

    subject: str
    kind: str
    reason: str


def _constant(source: str) -> bool | None:
    """The value of a CEL expression that is the literal `true` or `false` (in parentheses or
    not), else None: the only constants read here (no guess at what an expression could be)."""
    text = source.strip()
    while text.startswith("(") and text.endswith(")"):
        text = text[1:-1].strip()
    return {"true": True, "false": False}.get(text)


def dead_rules(revision: PolicyRevision) -> list[tuple[str, str]]:
    """(place, why) of each argument rule that can never decide a call: one whose expression is
    the literal `false` (it never matches), and each allow rule after an allow rule that is
    the literal `true` (the first allow rule that matches allows, so later ones are never
    reached). Forbid rules are never shadowed: every one is evaluated. `check` warns about
    these, never failing: a rule that does nothing is a mistake, not a danger by itself."""
    out: list[tuple[str, str]] = []
    for key, tool in sorted(revision.tools.items()):
        always: str | None = None  # the id of an earlier allow rule that is always true
        for rule in tool.rules:
            place = f"{rule.location}: " if rule.location is not None else ""
            subject = f"{place}tools.{key} rule '{rule.id}'"
            value = _constant(rule.program.source)
            if rule.kind == "allow" and always is not None:
                out.append((subject, f"never decides: allow rule '{always}' before it is always "
                                     "true, and the first allow rule that matches allows"))
            elif value is False:
                out.append((subject, f"never matches: its {rule.kind} expression is false"))
            if rule.kind == "allow" and value is True and always is None:
                always = rule.id
    return out


def weak_spots(revision: PolicyRevision, registry: ToolRegistry) -> list[WeakSpot]:
    """What `check` reports beside misconfigurations: destructive effects no person confirms
    (the only stop for an injected "delete item 12": no text of it is copied from anywhere),
    sinks whose every argument accepts untrusted text (the flow check sees only tokens there),
    and the data-flow choices of `_dataflow_spots` (short critical values, escalation without a
    required intent, arguments no check judges, gates the intent waives)."""
    doc = revision.document
    spots: list[WeakSpot] = []
    if Effect.DESTRUCTIVE not in doc.defaults.gated_effects:
        spots.append(WeakSpot(
            "defaults.gated_effects", "ungated_destructive",
            "destructive is not in defaults.gated_effects: destructive tools without an approval "
            "block run without a person's approval"))
    for pid, principal in sorted(revision.principals.items()):
        effects = principal.policy.gated_effects
        if effects is not None and Effect.DESTRUCTIVE not in effects:
            spots.append(WeakSpot(
                f"principals.{pid}.gated_effects", "ungated_destructive",
                f"principal '{pid}' sets gated_effects without destructive: its calls of "
                "destructive tools without an approval block run without a person's approval"))
    for key, compiled in sorted(revision.tools.items()):
        approval = compiled.policy.approval
        if approval is not None and not approval.required and \
                _effect_of(revision, registry, *key.split(".", 1)) is Effect.DESTRUCTIVE:
            spots.append(WeakSpot(
                f"tools.{key}.approval", "ungated_destructive",
                f"tool '{key}' is destructive and its approval block sets required: false: "
                "no person confirms its calls"))
    spots += _spec_weak_spots(revision, registry)
    declassified = doc.dataflow.declassify if doc.dataflow is not None else {}
    for key, arguments in sorted(declassified.items()):
        if arguments is True:
            spots.append(WeakSpot(
                f"dataflow.declassify.{key}", "all_declassified",
                f"every argument of sink '{key}' is declassified: untrusted text reaches it "
                "unflagged (only distinctive tokens still flag)"))
            continue
        sink = revision.tools.get(key)
        schema = sink.policy.input_schema if sink is not None else None
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if isinstance(arguments, list) and isinstance(properties, dict) and properties and \
                set(properties) <= set(arguments):
            spots.append(WeakSpot(
                f"dataflow.declassify.{key}", "all_declassified",
                f"every argument of sink '{key}' in its policy schema is declassified: untrusted "
                "text reaches it unflagged (only distinctive tokens still flag)"))
    if doc.dataflow is not None:
        spots += _dataflow_spots(revision, registry, doc.dataflow)
    return spots


def _shortest_seen(schema: Any) -> tuple[int, str] | None:
    """The shortest length a string argument's policy schema says its values may have, and how
    it says so: its `maxLength` (every value is at most that long), or its shortest `examples`,
    `default` or `const` value. None when the schema says nothing of lengths (a `pattern` is not
    analysed) or constrains the value so that it is never matched (enum, a format, a maxLength
    under 8: the flow check skips it and only tainted-run escalation can judge it)."""
    if not isinstance(schema, dict) or "enum" in schema or "$ref" in schema:
        return None
    if schema.get("type") not in (None, "string") or "format" in schema:
        return None
    seen: list[tuple[int, str]] = []
    max_len = schema.get("maxLength")
    if isinstance(max_len, int):
        if max_len < MIN_TOKEN:
            return None
        seen.append((max_len, "maxLength"))
    examples = schema.get("examples")
    for value in [*(examples if isinstance(examples, list) else []), schema.get("default"), schema.get("const")]:
        if isinstance(value, str) and value.strip():
            seen.append((len(value.strip()), f"example {value.strip()[:40]!r}"))
    return min(seen) if seen else None


def _dataflow_spots(revision: PolicyRevision, registry: ToolRegistry, flow: DataflowPolicy) -> list[WeakSpot]:
    spots: list[WeakSpot] = []
    if flow.mode == "off":
        return spots
    # Critical values shorter than min_match are never matched verbatim; with min_value on,
    # a whole value of min_value characters still is.
    reach = flow.min_value or flow.min_match
    for key, compiled in sorted(revision.tools.items()):
        schema = compiled.policy.input_schema
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict) or \
                _effect_of(revision, registry, *key.split(".", 1)) is Effect.READ:
            continue
        entry = flow.declassify.get(key, [])
        if entry is True:
            continue
        declassified = entry if isinstance(entry, list) else []
        names = flow.critical.get(key) or [n for n in properties if n not in declassified]
        for name in names:
            found = _shortest_seen(properties.get(name))
            if found is not None and found[0] < reach:
                length, how = found
                lever = (f"set min_value to at most {length} or " if length >= MIN_PHRASE_CHARS else "")
                spots.append(WeakSpot(
                    f"dataflow.critical.{key}.{name}", "short_critical_values",
                    f"argument '{name}' of sink '{key}' may be {length} characters long ({how}), "
                    f"shorter than {'min_value' if flow.min_value else 'min_match'} ({reach}): "
                    f"copied whole from untrusted content it is not matched; {lever}escalate "
                    "tainted runs (on_tainted)"))
    if any(action != "allow" for action in flow.on_tainted.values()) and flow.intent != "required":
        spots.append(WeakSpot(
            "dataflow.intent", "intent_not_required",
            "on_tainted escalates sinks of tainted runs but dataflow.intent is not required: "
            "whether the agent framework sends the user's words is not known offline, and "
            "without them every critical value a trusted output does not hold escalates; "
            "set intent: required once the framework sends X-Envelope-Intent for every run"))
    spots += _unchecked_spots(revision, registry, flow)
    for key, waive in sorted(flow.waive_gate.items()):
        if waive == "intent":
            which = "every gated sink" if key == "default" else f"sink '{key}'"
            spots.append(WeakSpot(
                f"dataflow.waive_gate.{key}", "gate_waived_by_intent",
                f"the approval gate of {which} is waived when the run's intent writes its action "
                "and names every critical argument: no person confirms those calls, so the intent "
                "must be the user's own words (X-Envelope-Intent from the agent framework or the "
                "admin API), never text the model wrote"))
    return spots


def _unchecked_spots(revision: PolicyRevision, registry: ToolRegistry, flow: DataflowPolicy) -> list[WeakSpot]:
    """Sinks whose explicit `critical` list leaves arguments out while tainted runs escalate or
    the intent waives their gate: those arguments are judged by neither (an injected meeting
    time, a quantity, a folder), only a copied run of untrusted text in them still flags. An
    operator may mean it; `check` says which arguments it leaves to the attacker's choice."""
    spots: list[WeakSpot] = []
    for key, critical in sorted(flow.critical.items()):
        escalates = (flow.on_tainted.get(key) or flow.on_tainted.get("default", "allow")) != "allow"
        waives = (flow.waive_gate.get(key) or flow.waive_gate.get("default", "never")) == "intent"
        if not (escalates or waives):
            continue
        upstream, _, tool = key.partition(".")
        compiled = revision.tools.get(key)
        schema = compiled.policy.input_schema if compiled is not None else None
        if schema is None:
            info = registry.get(upstream, tool)
            schema = info.input_schema if info is not None else None
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        if not isinstance(properties, Mapping):
            continue
        entry = flow.declassify.get(key, [])
        if entry is True:
            continue
        declassified = set(entry) if isinstance(entry, list) else set()
        # Booleans never count as critical values (`critical`); nothing to name there.
        left = [name for name, spec in properties.items()
                if name not in critical and name not in declassified
                and not (isinstance(spec, Mapping) and spec.get("type") == "boolean")]
        if not left:
            continue
        which = " and ".join(w for w, on in (("tainted runs escalate it", escalates),
                                             ("the intent waives its gate", waives)) if on)
        names = ", ".join(f"'{name}'" for name in left)
        spots.append(WeakSpot(
            f"dataflow.critical.{key}", "unchecked_arguments",
            f"{which}, but argument{'s' if len(left) > 1 else ''} {names} of sink '{key}' "
            f"{'are' if len(left) > 1 else 'is'} neither critical nor declassified: an injected "
            "value there is not escalated (only a copied run of untrusted text flags); name "
            "every argument that steers the effect in dataflow.critical"))
    return spots


# -- HTTP upstreams (OpenAPI documents) ------------------------------------------------------


def spec_registry(revision: PolicyRevision) -> ToolRegistry:
    """A registry holding what each HTTP upstream's OpenAPI document offers, with the effects
    its methods give (what the runtime learns when it installs the revision): the offline
    `check` judges HTTP tools as the running proxy will."""
    registry = ToolRegistry()
    for upstream, spec in revision.specs.items():
        registry.replace(upstream, [
            ToolInfo(op.tool, op.input_schema, op.tool_definition()["annotations"], op.effect)
            for op in spec.operations.values()
        ])
    return registry


def spec_problems(revision: PolicyRevision) -> list[str]:
    """What `check` reports as errors about HTTP upstreams: what each OpenAPI document holds that
    the proxy cannot support (`file:line:column: ...`, skipped when loaded), and every `tools:`
    key of such an upstream that names no operation of its document (at the policy file's
    line: the tool could never be called)."""
    problems: list[str] = []
    for upstream, spec in sorted(revision.specs.items()):
        problems.extend(spec.problems)
        for key in revision.tools:
            name, _, tool = key.partition(".")
            if name != upstream or tool in spec.operations:
                continue
            where = revision.locations.get(f"tools.{key}")
            problems.append(
                f"{where if where is not None else revision.directory}: tool '{key}' names no "
                f"operation of upstream '{upstream}' (OpenAPI document {spec.source}); its "
                f"operations are: {', '.join(spec.operations) or 'none'}")
    return problems


def _spec_weak_spots(revision: PolicyRevision, registry: ToolRegistry) -> list[WeakSpot]:
    """Weak spots only an HTTP upstream has: a DELETE whose policy effect takes it out of the
    approval gate, and a writer operation the policy does not name under `unknown_tools: allow`
    (it runs on the defaults alone: no allow expression, no rule)."""
    spots: list[WeakSpot] = []
    allow_unknown = revision.document.defaults.unknown_tools != "deny"
    deps = Dependencies.default_runtime()
    for upstream, spec in sorted(revision.specs.items()):
        for op in spec.operations.values():
            key = f"{upstream}.{op.tool}"
            facts = _facts(revision, registry, deps, key)
            if op.method == "DELETE" and facts.effect is not Effect.DESTRUCTIVE and not facts.gated:
                spots.append(WeakSpot(
                    f"tools.{key}.effect", "ungated_destructive",
                    f"tool '{key}' is DELETE {op.path}, but its policy effect "
                    f"{facts.effect.value} takes it out of the approval gate: no person confirms "
                    "its calls"))
            elif facts.compiled is None and allow_unknown and facts.effect is not Effect.READ:
                spots.append(WeakSpot(
                    f"tools.{key}", "writer_without_policy",
                    f"tool '{key}' ({op.method} {op.path}, effect {facts.effect.value}) has no "
                    "policy entry and defaults.unknown_tools is allow: it runs on the defaults "
                    "alone, with no allow expression and no rule"))
    return spots
