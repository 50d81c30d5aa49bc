"""Policy file models (pydantic v2, frozen, `extra="forbid"`).

A policy directory is a set of YAML files merged into one `PolicyDocument`. Each field says
what happens when it is absent. CEL expressions are plain strings here; `proxy.policy.compile`
turns them into programs once per revision.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proxy.identity import names_problem
from proxy.policy.schemas import VALIDATED_FORMATS
from proxy.policy.vocab import (
    DETECTORS,
    Duration,
    Effect,
    PatternError,
    compile_pattern,
    did_you_mean,
)

# Deepest `max_depth` a policy may set: a taint seen in a run reaches every ancestor up to this
# many levels (`proxy.envelope.checks.delegation.taint_ancestors` walks no further), so no run
# allowed to call can sit deeper than its taint reaches.
MAX_DEPTH = 64

_NAME = r"[A-Za-z0-9_-]{1,64}"
UPSTREAM_NAME = re.compile(rf"^{_NAME}$")
# MCP tool names: 1-128 chars of [A-Za-z0-9_.-]; the policy key is `<upstream>.<tool>`.
TOOL_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}\.[A-Za-z0-9_.-]{1,128}$")
# `resources:` keys: `<upstream>.<URI prefix>` (`<upstream>.*`: every resource of the upstream).
RESOURCE_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}\.\S{1,1024}$")
# `prompts:` keys: `<upstream>.<prompt name>`.
PROMPT_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}\.\S{1,256}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


CelExpr = Annotated[str, Field(min_length=1)]
# An argument name, or a JSON pointer (RFC 6901) starting with "/" (`~0` is "~", `~1` is "/").
MaskPath = Annotated[str, Field(min_length=1, pattern=r"^(?:[^/].*|(?:/(?:[^~/]|~[01])*)+)$")]


# `<count>/<period>`: 100/min, 5/s, 1000/h (the long names too: 5/second, 100/minute, 1/hour).
RATE = re.compile(r"^\s*([1-9][0-9]{0,8})\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
_RATE_PERIODS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
                 "h": 3600.0, "hour": 3600.0}


def parse_rate(value: object) -> tuple[int, float]:
    """(count, period in seconds) of a rate like `100/min`; ValueError naming the shape otherwise."""
    m = RATE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"not a rate: {value!r} (use <count>/<s|min|h>, a whole count from 1, e.g. 100/min)")
    return int(m.group(1)), _RATE_PERIODS[m.group(2)]


class RateLimit(_Model):
    """A token bucket of the `rate_limit` check: calls at `limit` on average, at most `burst` in a
    row after a quiet spell. Written `rate: 100/min`, or `rate: {limit: 100/min, burst: 20}`."""

    # `<count>/<s|min|h>`: the bucket refills at `count` tokens per period; a call takes one.
    limit: str
    # The bucket's size: the most calls let through at once. Absent: the limit's count.
    burst: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: object) -> object:
        if isinstance(v, dict):
            return v
        parse_rate(v)  # the error names `rate` itself, not a `limit` the file does not have
        return {"limit": v}

    @field_validator("limit")
    @classmethod
    def _limit(cls, v: str) -> str:
        parse_rate(v)
        return v

    @property
    def capacity(self) -> int:
        return self.burst if self.burst is not None else parse_rate(self.limit)[0]

    @property
    def per_second(self) -> float:
        count, period = parse_rate(self.limit)
        return count / period

    def __str__(self) -> str:
        return self.limit.strip() + (f" (burst {self.burst})" if self.burst is not None else "")


class Upstream(_Model):
    """A tool backend: a Streamable HTTP server (`url`) or a stdio server the proxy launches
    (`command`); exactly one of the two. Absent `timeout`: 30 s per call."""

    url: str | None = None
    # A stdio server: the program and its arguments (no shell). The proxy starts it, speaks
    # newline-delimited JSON-RPC on its stdin/stdout and serves it at /mcp/<upstream> like an
    # HTTP upstream (proxy/upstream/stdio.py).
    command: list[str] | None = None
    # stdio: variables added to the child's environment, which otherwise inherits only PATH,
    # HOME and LANG from the proxy (never its credentials). Absent: nothing added.
    env: dict[str, str] = Field(default_factory=dict)
    # stdio: the child's working directory. Absent: the proxy's.
    cwd: str | None = None
    # stdio: most child processes at once for this upstream (one per session client, plus the
    # one shared by stateless clients); past it a new session is refused with HTTP 503.
    max_processes: int = Field(default=16, ge=1, le=1024)
    # stdio: most session children one principal holds at once (so one client cannot take every
    # slot from the others); past it its new session is refused with HTTP 503. Absent: half of
    # `max_processes`, rounded up.
    max_processes_per_principal: int | None = Field(default=None, ge=1, le=1024)
    # stdio: a child no request touched for this long is stopped (its session ends).
    idle_timeout: Duration = 300.0
    # Whole-call timeout for inspected requests (tools/call, tools/list). Streams have no timeout.
    timeout: Duration = 30.0
    # Connect timeout.
    connect_timeout: Duration = 5.0
    # Trust the server's tool annotations (readOnlyHint...) when the policy says nothing.
    # Absent: false, annotations are untrusted hints and the safe default applies.
    trust_annotations: bool = False
    # Headers the proxy adds to every upstream request (its own credential, for example).
    headers: dict[str, str] = Field(default_factory=dict)
    # Pass the client's Authorization header upstream. Absent: false (never leak agent tokens).
    forward_authorization: bool = False
    # An HTTP (REST) upstream: its OpenAPI document, a path relative to this policy file's
    # directory or an http(s) URL, loaded with every revision; each operation is a tool and the
    # proxy itself answers MCP for it (proxy/upstream/openapi.py). Absent: an MCP server.
    openapi: str | None = Field(default=None, min_length=1)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"upstream url must be http(s)://host[:port]/path, got {v!r}")
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0]):
            raise ValueError("upstream command must name a program: [program, arg, ...]")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> Upstream:
        if (self.url is None) == (self.command is None):
            raise ValueError("an upstream has exactly one of 'url' or 'command'")
        return self


class Rule(_Model):
    """One argument rule: exactly one of `forbid` / `allow`, a CEL boolean expression."""

    id: str | None = None  # absent: "<tool>#<index>"
    forbid: CelExpr | None = None
    allow: CelExpr | None = None
    reason: str | None = None  # absent: a generic reason naming the rule

    @model_validator(mode="after")
    def _one_kind(self) -> Rule:
        if (self.forbid is None) == (self.allow is None):
            raise ValueError("a rule has exactly one of 'forbid' or 'allow'")
        return self

    @property
    def kind(self) -> Literal["forbid", "allow"]:
        return "forbid" if self.forbid is not None else "allow"

    @property
    def expr(self) -> str:
        return self.forbid if self.forbid is not None else self.allow  # type: ignore[return-value]


class Approval(_Model):
    """Human approval for this tool (the `approval` check). A tool with an `approval` block is
    gated exactly when `required` is true; without one, when its effect is gated."""

    required: bool = False
    # How long a gated call is held waiting for a decision before it is refused as
    # approval_pending (the client retries the same call after approval). Absent: 30 s.
    wait: Duration = 30.0
    # How long an approval for this tool may be decided and used. Absent: approvals.ttl of the
    # runtime config (1 h by default).
    ttl: Duration | None = None
    # Also ask the person at the client (the caller's own user) when the client can be asked:
    # MCP elicitation (2025-06-18 / 2025-11-25 sessions) or input_required (2026-07-28); the
    # answer is recorded as decided by `user:<principal>`. Otherwise (and meanwhile) the
    # out-of-band approval applies. Absent: false.
    in_band: bool = False


class PathLabel(_Model):
    """Labels of one JSON path of a tool's `structuredContent`. Absent fields: the tool's."""

    output: Literal["trusted", "untrusted"] | None = None
    sensitivity: Literal["public", "secret"] | None = None


class Guardrail(_Model):
    """One output guardrail rule (`proxy.envelope.checks.guardrails`): exactly one of `detector` (a
    built-in secret detector, or `secrets` for all of them) or `pattern` (an RE2 regular
    expression, compiled at load: look-around and back-references are load errors)."""

    # Names the rule in audit records and metrics; a pattern's redaction marker is
    # `[REDACTED:<id>]`. Absent: the detector's name (required with `pattern`).
    id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    detector: str | None = None
    pattern: str | None = Field(default=None, min_length=1, max_length=4096)
    # redact: matches become [REDACTED:<detector or id>]; block: the result is replaced by a
    # guardrail_blocked refusal; warn: audited and counted only. Absent: redact.
    action: Literal["redact", "block", "warn"] = "redact"
    # The refusal's reason for `block` (never the matched text). Absent: a generic reason.
    reason: str | None = None

    @field_validator("detector")
    @classmethod
    def _detector(cls, v: str | None) -> str | None:
        if v is not None and v not in DETECTORS:
            raise ValueError(f"unknown detector {v!r}{did_you_mean(v, DETECTORS)} (built-in: {', '.join(DETECTORS)})")
        return v

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                compile_pattern(v)
            except PatternError as exc:
                raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> Guardrail:
        if (self.detector is None) == (self.pattern is None):
            raise ValueError("a guardrail has exactly one of 'detector' or 'pattern'")
        if self.pattern is not None and self.id is None:
            raise ValueError("a 'pattern' guardrail needs an 'id' (it names the rule in the "
                             "redaction marker and the audit)")
        return self


class ToolPolicy(_Model):
    """Policy for one tool, keyed `<upstream>.<tool>`."""

    # Absent: from trusted annotations, else the safe default (destructive).
    effect: Effect | None = None
    # Output label (used by the data-flow check). Absent: untrusted unless annotations say
    # openWorldHint false.
    output: Literal["trusted", "untrusted"] | None = None
    # Sensitivity of the output (data-flow check: a run holding untrusted and secret content
    # flags every sink). Absent: public.
    sensitivity: Literal["public", "secret"] | None = None
    # Labels of parts of `structuredContent`, by JSON pointer (`*` as a segment: every array
    # element or object member); the most specific pointer covering a value wins over the tool's
    # `output` / `sensitivity`. Absent: none (the whole output has the tool's labels).
    labels: dict[MaskPath, PathLabel] = Field(default_factory=dict)
    # JSON Schema that replaces the upstream's inputSchema. Absent: the upstream's.
    input_schema: dict[str, object] | None = Field(default=None, alias="schema")
    # CEL authorization: the call is authorized when any expression is true. Absent: no
    # tool-level condition.
    allow: list[CelExpr] | None = None
    # Argument rules: all forbid rules first (any match refuses), then allow rules (first match
    # allows), then `fallback`.
    rules: list[Rule] = Field(default_factory=list)
    # Absent: "allow" when the tool has no allow rules, else "deny".
    fallback: Literal["allow", "deny"] | None = None
    fallback_reason: str | None = None
    # Write the arguments themselves into the audit log. Absent: only their digest.
    log_args: bool = False
    # With log_args: argument values replaced by "***" in the recorded `args` (never in the call
    # itself; `args_digest` stays the digest of the real arguments). Each entry is an argument
    # name (masked at any depth, in nested objects and arrays too) or a JSON pointer like
    # `/card/number` (`*` as a segment: every array element or object member). Added to
    # defaults.mask. Absent: none.
    mask: list[MaskPath] = Field(default_factory=list)
    approval: Approval | None = None
    # Replay a retry of an identical call (same run, arguments) from the stored first result,
    # even when the effect is not gated. Absent: false (gated effects and calls carrying a
    # client idempotency key are deduplicated anyway).
    idempotent: bool = False
    # shadow: every call of this tool is a shadow call (writers recorded, not performed).
    # Absent: enforce.
    mode: Literal["enforce", "shadow"] = "enforce"
    # The text a client receives for a shadowed call. Absent: "Shadow run: this call was
    # recorded, not performed."
    shadow_result: str | None = None
    # Output guardrails run on this tool's results after defaults.guardrails. Absent: none.
    guardrails: list[Guardrail] = Field(default_factory=list)
    # Calls of this tool per principal (each principal has its own bucket, shared by all
    # replicas through the store); a call beyond it is refused rate_limited. Absent: none.
    rate: RateLimit | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("allow", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v


class ContentPolicy(_Model):
    """Labels and guardrails of content an upstream serves outside tool results: a resource
    (`resources:`, keyed `<upstream>.<URI prefix>`, the longest matching prefix wins) or a
    prompt (`prompts:`, keyed `<upstream>.<prompt name>`). Content with no entry is untrusted,
    public, and gets `defaults.guardrails` only."""

    # Data-flow label of the content the client receives. Absent: untrusted.
    output: Literal["trusted", "untrusted"] | None = None
    # Absent: public.
    sensitivity: Literal["public", "secret"] | None = None
    # Output guardrails run on this content after defaults.guardrails. Absent: none.
    guardrails: list[Guardrail] = Field(default_factory=list)


class RuleOfTwo(_Model):
    """Meta's "Agents Rule of Two": which of the three dangerous properties a principal's runs
    may combine. A property set to false is taken away: `external_side_effects: false` forces the
    read-only floor (every tool whose effect is not read is refused), `sensitive_data: false`
    refuses tools whose output sensitivity is `secret`, `untrusted_input: false` refuses tools
    whose output is untrusted. Absent properties: true (allowed). A profile holding all three is
    the dangerous configuration `envelope-proxy check` reports."""

    untrusted_input: bool = True
    sensitive_data: bool = True
    external_side_effects: bool = True

    @property
    def holds_all(self) -> bool:
        return self.untrusted_input and self.sensitive_data and self.external_side_effects


class PrincipalPolicy(_Model):
    """Policy for one principal id."""

    # read-only: writer tools are hidden from tools/list and refused. Absent: defaults.capability.
    capability: Literal["read-only", "read-write"] | None = None
    # Not supported: CEL's `principal.groups` is the verified identity's groups only (the JWT's
    # groups claim or the static identity), never merged with policy. The field is kept only to
    # refuse a non-empty list with a reason (it was accepted and silently did nothing).
    groups: list[str] = Field(default_factory=list)
    # CEL authorization for every call of this principal (any true authorizes). Absent: none.
    allow: list[CelExpr] | None = None
    # Effects that need approval for this principal's calls of tools without an `approval`
    # block. Absent: defaults.gated_effects.
    gated_effects: list[Effect] | None = None
    # shadow: every run of this principal is a shadow run (writers recorded, not performed).
    # Absent: enforce.
    mode: Literal["enforce", "shadow"] = "enforce"
    # Rule-of-Two profile (see RuleOfTwo). Absent: no profile (nothing taken away).
    rule_of_two: RuleOfTwo | None = None
    # Names of the child agents (X-Envelope-Agent) this principal's runs may spawn. A child run
    # whose agent is not listed is refused not_on_roster. Absent: any child agent.
    roster: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = None
    # Deepest run depth (root run 0, child 1, grandchild 2...) this principal may call at.
    # Absent: defaults.max_depth.
    max_depth: int | None = Field(default=None, ge=0, le=MAX_DEPTH)
    # Whether untrusted or secret content seen by a child run widens this principal's (parent)
    # run's ledger. false: children are trusted not to carry taint upwards. Absent: true.
    propagate_taint: bool = True
    # Other principals whose runs may be child runs of this principal's runs (name one of them
    # in X-Envelope-Parent-Run, and widen it with their taint). Runs are the principal's own: a
    # parent run id is otherwise looked up among the calling principal's runs only. Absent: none.
    delegates: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list)
    # Most calls of one run in flight at once (shared by all replicas through the store); a call
    # beyond it is refused rate_limited. Absent: defaults.max_concurrent_per_run.
    max_concurrent_per_run: int | None = Field(default=None, ge=1)
    # All calls of this principal, whatever the tool (one bucket shared by all replicas); a
    # call beyond it is refused rate_limited. Absent: defaults.rate.
    rate: RateLimit | None = None
    # Most calls one run may make in all (its budget: it stops a runaway agent loop). A run is
    # forgotten, and its count with it, after dataflow.ledger_ttl without a call. Absent:
    # defaults.max_calls_per_run.
    max_calls_per_run: int | None = Field(default=None, ge=1)

    @field_validator("allow", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v

    @field_validator("delegates")
    @classmethod
    def _delegate_ids(cls, v: list[str]) -> list[str]:
        problem = names_problem("delegate", v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("groups")
    @classmethod
    def _no_policy_groups(cls, v: list[str]) -> list[str]:
        if v:
            raise ValueError(
                "a policy cannot grant groups: principal.groups in CEL holds the verified "
                "identity's groups only (the JWT's groups claim or the static identity); grant "
                "the group there, or name the principal in the expression (principal.id == \"...\")")
        return v


class Defaults(_Model):
    """Policy-wide defaults."""

    # A tool with no entry under `tools`: deny -> refused as unknown_tool and hidden from
    # tools/list; allow -> treated with the safe default effect (destructive writer).
    unknown_tools: Literal["allow", "deny"] = "deny"
    # Capability of principals not listed under `principals`.
    capability: Literal["read-only", "read-write"] = "read-write"
    # Effects that need approval when the tool's policy does not say. With no approval gate
    # (approvals disabled or no state store) such a tool is reported misconfigured and refused.
    gated_effects: list[Effect] = Field(
        default_factory=lambda: [Effect.EXTERNAL, Effect.DESTRUCTIVE]
    )
    # Request headers visible to CEL as request.headers (lower-case names). Absent: none.
    request_headers: list[str] = Field(default_factory=list)
    log_args: bool = False
    # Masked in the recorded arguments of every tool (see ToolPolicy.mask). Absent: none.
    mask: list[MaskPath] = Field(default_factory=list)
    # Output guardrails run on every tool's results (before the tool's own). Absent: none.
    guardrails: list[Guardrail] = Field(default_factory=list)
    # Deepest run depth below a root run (0 root/session, 1 child, 2 grandchild). Absent: 2.
    max_depth: int = Field(default=2, ge=0, le=MAX_DEPTH)
    # Most calls of one run in flight at once for principals that do not set their own.
    # Absent: no bound.
    max_concurrent_per_run: int | None = Field(default=None, ge=1)
    # The rate of each principal that does not set its own (each has its own bucket). Absent:
    # no rate.
    rate: RateLimit | None = None
    # The call budget of each run of principals that do not set their own. Absent: no budget.
    max_calls_per_run: int | None = Field(default=None, ge=1)


OnFlag = Literal["block", "approve"]
OnTainted = Literal["allow", "approve", "block"]
WaiveGate = Literal["never", "intent"]


# The data-flow winnowing window (see DataflowPolicy.winnow).
DEFAULT_WINNOW = 4
# How much of one tool output, and of one sink argument, the data-flow check fingerprints (see
# DataflowPolicy.max_output_chars and max_argument_chars).
DEFAULT_MAX_OUTPUT_CHARS = 1 << 20
DEFAULT_MAX_ARGUMENT_CHARS = 1 << 16
DEFAULT_MAX_INTENT_CHARS = 1 << 14
MIN_PHRASE_CHARS = 6  # shortest phrase of an untrusted output recorded for whole-value matching


class DataflowPolicy(_Model):
    """The data-flow check (`dataflow:`): untrusted content flowing into sinks."""

    # off: no ledger, no check. shadow: flagged sinks are forwarded, audited and counted.
    # enforce: flagged sinks are refused (or escalated, see on_flag). Absent: enforce (the
    # section is present; with no `dataflow:` section at all the check runs in shadow).
    mode: Literal["off", "shadow", "enforce"] = "enforce"
    # Shortest verbatim run of untrusted characters (after normalising case and whitespace)
    # that flags an argument. Absent: 32 (measured: bench/RESULTS.md, "Data flow").
    min_match: int = Field(default=32, ge=8, le=1024)
    # Shortest whole argument value (normalised, at most 4 words, shorter than min_match) that
    # flags when an untrusted output holds it as a whole word-bounded phrase: a password, a
    # venue or product name, a short code copied from a page. Absent or 0: off, and nothing of
    # it runs (no phrases recorded, none looked up, the ledger scheme tag unchanged): recording
    # an output costs 3-4x more with it on, and it flags 3 of the 12 benign flows of
    # tests/dataflow/corpus.yaml (bench/RESULTS.md, "Short copied values"). When on, at least 6
    # (outputs record phrases of 6 characters and more); 10 is the value measured on
    # tests/dataflow/short_values*.yaml.
    min_value: int = 0
    # Winnowing window: an output keeps about 2/(winnow+1) of its gram fingerprints (the
    # smallest of every `winnow` consecutive grams of min_match - winnow + 1 characters), so
    # every copied run of min_match characters is still caught, and shorter runs down to
    # min_match - winnow + 1 sometimes are. 1 keeps every gram. Absent: 4 (measured:
    # bench/RESULTS.md, "Data flow").
    winnow: int = Field(default=DEFAULT_WINNOW, ge=1, le=16)
    # Sinks (`<upstream>.<tool>`: true) or single arguments of a sink (a list of argument
    # names) that may receive untrusted text. Distinctive tokens (addresses, URLs/domains,
    # account numbers) lifted from untrusted content are still flagged in them. Absent: none.
    declassify: dict[str, list[str] | bool] = Field(default_factory=dict)
    # What a flagged sink gets in enforce mode: block (refused) or approve (sent to the
    # approval gate with the evidence). `default` applies to sinks not listed. A plain string
    # sets the default. Absent: block.
    on_flag: dict[str, OnFlag] = Field(default_factory=lambda: {"default": "block"})  # type: ignore[arg-type]
    # Tainted-run escalation (issue 13, class 2: an attacker-chosen value that untrusted text
    # never spells, such as "book the most expensive option"). What a sink called in a run that
    # has read untrusted content (or whose ledger says an output may have reached it unrecorded)
    # gets when one of its critical arguments is not endorsed: allow (nothing happens), approve
    # (the approval gate, reason naming the unendorsed arguments; refused when no gate is
    # configured) or block (refused, `dataflow_policy_blocked`, rule `dataflow.tainted_run`).
    # A critical value is endorsed when the run's intent holds it whole (string: between word
    # boundaries after normalising case, width and whitespace, edge punctuation stripped;
    # number or amount: the same canonical decimal, "$1,200.50" = 1200.5) or when a trusted
    # output read in the same run holds it (its whole value, one of its fields between
    # listing separators, a distinctive token, or a number of 3+ digits or with decimals). Runs that never read untrusted content are
    # untouched; a sink the data-flow check already flags is decided by on_flag, not this;
    # shadow mode audits and counts, never acts. `default` applies to sinks not listed; a plain
    # string sets the default. Absent: allow (nothing escalates).
    on_tainted: dict[str, OnTainted] = Field(default_factory=lambda: {"default": "allow"})  # type: ignore[arg-type]
    # Gate waiver: intent (the approval gate of a sink, from gated_effects or its
    # approval.required, is waived when the run's intent writes the tool's action, not negated,
    # and names every critical argument itself: written whole, a number written as a
    # reference ("order 31"), or the one entry of a trusted listing its words or its criterion
    # pick; a flagged or escalated call never) or never. Audited `extra.gate_waived`, counted
    # `envelope_gates_waived_total`; the idempotency claim is kept. `default` applies to sinks
    # not listed; a plain string sets the default. Absent: never (`proxy.envelope.dataflow.waiver`).
    waive_gate: dict[str, WaiveGate] = Field(default_factory=lambda: {"default": "never"})  # type: ignore[arg-type]
    # The arguments of a sink (`<upstream>.<tool>`: [top-level argument names]) whose values
    # must be endorsed in a tainted run (every string and number inside them; booleans and
    # null never count). Absent for a sink: every argument that is not declassified.
    critical: dict[str, list[str]] = Field(default_factory=dict)
    # Whether the agent framework sends the run's intent (`X-Envelope-Intent` or the admin API):
    # optional (absent): it may; a run without intent only has trusted outputs to endorse its
    # sinks' critical values. required: the deployment promises it, and the proxy holds it
    # to it: a sink call (enforce mode) in a run with no intent on record is refused
    # (`invalid_request`, rule `dataflow.intent`). `envelope-proxy check` reports on_tainted
    # approve/block without `intent: required` as a weak spot (escalation would then ask a
    # person about every tainted sink call the user's words would have endorsed).
    intent: Literal["optional", "required"] = "optional"
    # Inside a declassified argument, a copied run of untrusted text at least this many
    # characters long still flags (finding `declassified_copy`), and so does a copied
    # instruction-shaped sentence (an imperative aimed at the assistant: finding
    # `instruction`), whatever its length. 0: long copies into declassified arguments never
    # flag (instruction-shaped ones still do). Absent: 200, the smallest value that flags no
    # benign flow of tests/dataflow/declassified.yaml and corpus.yaml (a quoted paragraph of
    # about 180 characters passes; bench/RESULTS.md, "Declassified copies"); at least
    # min_match when not 0.
    declassify_max_copy: int = Field(default=200, ge=0, le=1 << 20)
    # String arguments whose schema `format` is one of these are not matched (the schema check
    # has rejected any value that is not of that format). Only formats the schema check asserts
    # (`proxy.policy.schemas.VALIDATED_FORMATS`) are accepted. Absent: date-time, date, time.
    skip_formats: list[str] = Field(default_factory=lambda: ["date-time", "date", "time"])
    # Most fingerprints a run's ledger keeps; beyond it the run keeps a coarse "overflowed"
    # flag that flags every free-text sink argument (widens, never narrows). Absent: 65536.
    ledger_cap: int = Field(default=65536, ge=1024, le=4_000_000)
    # Seconds a run's ledger lives after its last update. Absent: 24h.
    ledger_ttl: Duration = 24 * 3600.0
    # Most characters of one tool output that are fingerprinted (its labelled pieces in
    # order); the rest is not hashed and the run's ledger is marked overflowed, as when it
    # reaches ledger_cap (every free-text sink argument then counts as matching: widens, never
    # narrows). Bounds the work one output costs. Absent: 1 MiB (1048576; measured:
    # bench/RESULTS.md, "Fingerprinting cost").
    max_output_chars: int = Field(default=DEFAULT_MAX_OUTPUT_CHARS, ge=4096, le=1 << 26)
    # Longest sink argument (in characters) that is matched against the ledger. A longer one,
    # declassified or not, is not hashed and counts as matching when the run has read
    # untrusted content (finding `coarse`, saying it exceeded this cap). Absent: 64 KiB (65536).
    max_argument_chars: int = Field(default=DEFAULT_MAX_ARGUMENT_CHARS, ge=1024, le=1 << 24)
    # Most characters of intent (`X-Envelope-Intent` and the admin API, all texts together) a
    # run holds; an intent that would take it past them is refused. Absent: 16 KiB (16384).
    max_intent_chars: int = Field(default=DEFAULT_MAX_INTENT_CHARS, ge=256, le=1 << 20)

    @model_validator(mode="after")
    def _gram_length(self) -> DataflowPolicy:
        if self.min_match - self.winnow + 1 < 8:
            raise ValueError(f"min_match - winnow + 1 must be at least 8 (grams shorter than 8 "
                             f"characters match common words); got {self.min_match} and {self.winnow}")
        return self

    @model_validator(mode="after")
    def _max_copy(self) -> DataflowPolicy:
        if self.declassify_max_copy and self.declassify_max_copy < self.min_match:
            raise ValueError(f"declassify_max_copy is 0 (off) or at least min_match ({self.min_match}): "
                             f"shorter copies are not matched; got {self.declassify_max_copy}")
        return self

    @field_validator("min_value")
    @classmethod
    def _min_value(cls, v: int) -> int:
        if v != 0 and not MIN_PHRASE_CHARS <= v <= 1024:
            raise ValueError(f"min_value is 0 (off) or from {MIN_PHRASE_CHARS} to 1024 (outputs record "
                             f"phrases of {MIN_PHRASE_CHARS} characters and more); got {v}")
        return v

    @field_validator("skip_formats")
    @classmethod
    def _validated_formats(cls, v: list[str]) -> list[str]:
        unchecked = [f for f in v if f not in VALIDATED_FORMATS]
        if unchecked:
            raise ValueError(
                f"{', '.join(map(repr, unchecked))}: the schema check does not validate this "
                f"format, so its values may hold any text (validated: "
                f"{', '.join(sorted(VALIDATED_FORMATS))})")
        return v

    @field_validator("on_flag", "on_tainted", "waive_gate", mode="before")
    @classmethod
    def _on_flag(cls, v: object) -> object:
        return {"default": v} if isinstance(v, str) else v

    @field_validator("declassify", "on_flag", "on_tainted", "critical", "waive_gate")
    @classmethod
    def _keys(cls, v: dict[str, object]) -> dict[str, object]:
        for key in v:
            if key != "default" and not TOOL_KEY.match(key):
                raise ValueError(f"sink key {key!r} must be '<upstream>.<tool>'")
        return v


def escalates(policy: DataflowPolicy) -> bool:
    """Whether some sink's `on_tainted` is not `allow` (and the data-flow check is on)."""
    return policy.mode != "off" and any(v != "allow" for v in policy.on_tainted.values())


class PolicyDocument(_Model):
    """The merged policy of one directory: one revision."""

    version: Literal[1] = 1
    upstreams: dict[str, Upstream] = Field(default_factory=dict)
    defaults: Defaults = Field(default_factory=Defaults)
    tools: dict[str, ToolPolicy] = Field(default_factory=dict)
    principals: dict[str, PrincipalPolicy] = Field(default_factory=dict)
    # The data-flow check. Absent: shadow mode with every other default (flows are counted
    # and audited, never refused, until a policy opts in with a `dataflow:` section).
    dataflow: DataflowPolicy | None = None
    # Resource contents (`resources/read`), keyed `<upstream>.<URI prefix>`. Absent: none
    # (every resource is untrusted, public, with defaults.guardrails).
    resources: dict[str, ContentPolicy] = Field(default_factory=dict)
    # Prompt messages (`prompts/get`), keyed `<upstream>.<prompt name>`. Absent: none.
    prompts: dict[str, ContentPolicy] = Field(default_factory=dict)

    @field_validator("upstreams")
    @classmethod
    def _upstream_names(cls, v: dict[str, Upstream]) -> dict[str, Upstream]:
        for name in v:
            if not UPSTREAM_NAME.match(name):
                raise ValueError(f"upstream name {name!r} must match {UPSTREAM_NAME.pattern}")
        return v

    @field_validator("tools")
    @classmethod
    def _tool_keys(cls, v: dict[str, ToolPolicy]) -> dict[str, ToolPolicy]:
        for key in v:
            if not TOOL_KEY.match(key):
                raise ValueError(f"tool key {key!r} must be '<upstream>.<tool>'")
        return v
