"""Shared types of the envelope: the call, its context, the decision and the check protocol.

This module holds no logic beyond small conveniences; fronts build `ToolCall`s, checks
return `Decision`s, the pipeline runs `Check`s. Nothing here imports a front or a check.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable
from urllib.parse import quote

from proxy.audit.record import canonical_args, digest_of
from proxy.policy.vocab import Effect

if TYPE_CHECKING:
    from proxy.approvals.notifier import ApprovalNotifier
    from proxy.approvals.service import ApprovalService
    from proxy.approvals.signer import RequestStateSigner
    from proxy.config import Config
    from proxy.envelope.dataflow.ledger import RecentWrites
    from proxy.observability.metrics import Metrics
    from proxy.store.base import Store


class Verdict(enum.StrEnum):
    """The outcome class of one decision, as counted and audited."""

    ALLOW = "allow"  # forwarded (the upstream may still fail: see code)
    DENY = "deny"  # refused by policy
    ERROR = "error"  # refused because something failed (fail closed) or the upstream failed


class Code(enum.StrEnum):
    """Stable reason codes. Values appear unchanged on the wire, in audit records and metrics."""

    OK = "ok"
    UNKNOWN_TOOL = "unknown_tool"
    MISCONFIGURED = "misconfigured"
    CAPABILITY_BLOCKED = "capability_blocked"
    SCHEMA_INVALID = "schema_invalid"
    UNAUTHORIZED = "unauthorized"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    INTERNAL_ERROR = "internal_error"
    AUDIT_UNAVAILABLE = "audit_unavailable"
    CLIENT_DISCONNECTED = "client_disconnected"
    SHUTDOWN = "shutdown"  # the proxy stopped before the upstream answered (grace ran out)
    APPROVAL_PENDING = "approval_pending"
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_EXPIRED = "approval_expired"
    STORE_UNAVAILABLE = "store_unavailable"
    # dataflow (enforce): untrusted content flowing into a sink, or the lethal trifecta.
    DATAFLOW_POLICY_BLOCKED = "dataflow_policy_blocked"
    # idempotency: the same call is being performed right now and did not finish in time.
    IDEMPOTENCY_IN_FLIGHT = "idempotency_in_flight"
    # idempotency: the client reused an idempotency key for a call with other arguments.
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    # Not refusals: the client receives a result the proxy holds instead of a forwarded one.
    REPLAYED = "replayed"  # idempotency: the stored first result of this call
    SHADOWED = "shadowed"  # shadow run: recorded, not performed; a synthetic result
    # output guardrails: the result matched a `block` rule and was withheld (it was performed).
    GUARDRAIL_BLOCKED = "guardrail_blocked"
    # delegation: the run is deeper than max_depth below its root run (the proxy's own lineage).
    DEPTH_EXCEEDED = "depth_exceeded"
    # delegation: the child agent (X-Envelope-Agent) is not on its parent holder's roster.
    NOT_ON_ROSTER = "not_on_roster"
    # rate limit: a token bucket (principal, tool) is empty, the run spent its call budget or
    # it has max_concurrent_per_run calls in flight (all replicas together).
    RATE_LIMITED = "rate_limited"
    # guard: the request was refused before any check (a header value that is not a valid
    # HTTP field value); the request is audited, never forwarded. dataflow: an
    # X-Envelope-Intent that is malformed or over `max_intent_chars`.
    INVALID_REQUEST = "invalid_request"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: verified identity only (static config or a verified JWT)."""

    id: str
    groups: tuple[str, ...] = ()
    claims: Mapping[str, Any] = field(default_factory=dict)
    # How the identity was established: "static" or "jwt".
    source: str = "static"

    def as_cel(self) -> dict[str, Any]:
        return {"id": self.id, "groups": list(self.groups), "claims": dict(self.claims)}


# A run id a client names (`X-Envelope-Run`, `X-Envelope-Parent-Run`, the admin API's
# `/v1/runs/<run>/`): what a header value carries once the guard has checked it (visible ASCII
# and spaces; aiohttp strips the spaces at either end), bounded: a run id is kept in every audit
# record and store key.
MAX_RUN_ID_CHARS = 256
RUN_ID_RULE = (f"a run id is 1 to {MAX_RUN_ID_CHARS} characters of printable ASCII "
               "(U+0020 to U+007E, no space at either end)")


def run_id_problem(run: str) -> str | None:
    """Why `run` is not a run id a client may name, the rule and what breaks it; None when it
    is one. The one check of `X-Envelope-Run` and `X-Envelope-Parent-Run` (`proxy.fronts.guard`)
    and of the admin API's run (`proxy.admin.intent_api`)."""
    if not run:
        return f"{RUN_ID_RULE}: it is empty"
    if len(run) > MAX_RUN_ID_CHARS:
        return f"{RUN_ID_RULE}: it has {len(run)}"
    if run.isascii() and run.isprintable() and run[0] != " " and run[-1] != " ":
        return None
    at, bad = next((i, c) for i, c in enumerate(run)
                   if not (c.isascii() and c.isprintable()) or (c == " " and i in (0, len(run) - 1)))
    return f"{RUN_ID_RULE}: U+{ord(bad):04X} at position {at}"


@functools.lru_cache(maxsize=8192)
def run_key(principal: str, run_id: str) -> str:
    """The store key of a principal's run: `<principal, percent-encoded>/<run id>`.

    Runs are named by clients (`X-Envelope-Run`, a session id), so a name alone is no
    ownership: every store key that reads or writes run state is scoped to the principal, and
    another principal naming the same run id gets a run of its own. The principal is encoded
    without `/` (surrogates kept), so the key is injective: no two (principal, run) pairs share
    one, whatever either contains.
    """
    return f"{quote(principal, safe='', errors='surrogatepass')}/{run_id}"


@dataclass(frozen=True, slots=True)
class RunContext:
    """The run (unit of agent work) a call belongs to, and the principal it belongs to.

    `id` is the run as the client named it (what audit records and CEL show); `key` is where its
    state lives (see `run_key`): checks and stores use `key`, never `id`.
    """

    id: str
    # The id of the principal whose run this is (the call's verified principal).
    principal: str
    parent: str | None = None
    depth: int = 0
    shadow: bool = False
    tainted: bool = False
    secret: bool = False
    session: str | None = None
    # The child agent's name (X-Envelope-Agent), checked against the parent holder's roster.
    agent: str | None = None
    # Filled by the delegation check from the proxy's own lineage records (never the client's).
    # Until then `parent` is what the client named (X-Envelope-Parent-Run) and `depth` is 0.
    lineage_known: bool = False
    # Set by the delegation check for child runs: the store keys (`run_key`) of the ancestor
    # runs whose ledgers this run's untrusted or secret output widens (nearest first, already
    # cut at `propagate_taint: false`). None: not computed (the inspection then widens the
    # direct parent only, as a run of the same principal).
    taint_targets: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        """Where this run's state lives in the store: principal-scoped (see `run_key`)."""
        return run_key(self.principal, self.id)

    def as_cel(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "parent": self.parent or "",
            "depth": self.depth,
            "shadow": self.shadow,
            "tainted": self.tainted,
            "secret": self.secret,
        }


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the front saw of the request that carried the call (selected, bounded)."""

    method: str  # JSON-RPC method, e.g. "tools/call"
    protocol_version: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)  # only headers policy selected

    def as_cel(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "protocol_version": self.protocol_version,
            "headers": dict(self.headers),
        }


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """What the upstream told us of a tool in `tools/list` (untrusted hints)."""

    name: str
    input_schema: Mapping[str, Any] | None = None
    annotations: Mapping[str, Any] = field(default_factory=dict)
    # The effect the operator's own description declares (an OpenAPI operation's method), not
    # an upstream's hint: it applies when the policy says nothing, trusted or not.
    effect: Effect | None = None


@dataclass(frozen=True, slots=True)
class ApprovalPrompt:
    """What the person at the client is asked to approve (in-band approval)."""

    approval_id: str
    upstream: str
    tool: str
    args_digest: str
    arguments: Mapping[str, Any]
    expires_at: float


@dataclass(frozen=True, slots=True)
class InBandAnswer:
    """The person's answer to an in-band approval request."""

    approve: bool
    reason: str
    action: str = "accept"  # accept | decline | cancel (the elicitation's action)


class InBandChannel(Protocol):
    """The front's way to ask the person at the client (set on `ToolCall.in_band` only when the
    client can be asked: elicitation capability or input_required support).

    `mode` "hold": the front can ask while the call is held (`ask`, a session's SSE stream).
    `mode` "defer": the front answers the call with a request for input and the client retries
    (`defer` records what to ask; `answer`/`state` carry the retry's answer and the opaque
    state the proxy handed out, unverified: the approval check verifies them).
    """

    mode: Literal["hold", "defer"]
    answer: InBandAnswer | None
    state: str | None

    async def ask(self, prompt: ApprovalPrompt) -> InBandAnswer | None:
        """Ask and wait for the answer (None: no decision); the caller cancels it at its deadline."""
        ...

    def defer(self, prompt: ApprovalPrompt, state: str) -> None: ...


@dataclass(slots=True)
class ToolCall:
    """One `tools/call` on its way through the envelope.

    `arguments` are the client's arguments as parsed (JSON types). `decision_id` is minted by the
    front and is the id in the audit log, the wire `_meta` and the logs.
    """

    decision_id: str
    upstream: str
    tool: str
    arguments: dict[str, Any]
    principal: Principal
    run: RunContext
    request: RequestInfo
    # Filled by the pipeline before the first check: what the upstream said about the tool.
    upstream_tool: ToolInfo | None = None
    # The client's Idempotency-Key header or params._meta["envelope/idempotency_key"].
    idempotency_key: str | None = None
    # The client asked for a shadow run (X-Envelope-Shadow: 1); checks make it sticky per run.
    shadow_requested: bool = False
    # Awaited by the envelope with the final decision and the upstream's JSON-RPC reply (None
    # when nothing was forwarded or it failed), before the audit record is written.
    on_result: list[ResultHook] = field(default_factory=list)
    # Set by the approval check when an approved approval releases the call: spends it
    # (approved -> consumed) and returns None, or the refusal when it can no longer be spent.
    # The idempotency check calls it only once it holds the call's claim, so a duplicate that
    # finds the approval consumed also finds that claim (and waits for its result).
    spend_approval: Callable[[], Awaitable[Decision | None]] | None = None
    # Set by the approval check when an approval already consumed lets the call through (to be
    # answered from the first call's result): unbinds that approval, so that calling again asks
    # for a new one. The idempotency check calls it when nothing of that first call is left to
    # replay (it failed, or its result expired): the approval was spent, the call stays undone.
    forget_approval: Callable[[], Awaitable[None]] | None = None
    # Fields checks add to the call's audit record (approval id, grant id, idempotency key...).
    audit_extra: dict[str, Any] = field(default_factory=dict)
    # Set by the catalogue check: the tool's effective effect (policy, trusted annotations, default).
    effect: Effect | None = None
    # The CEL activation, built once per call on first use (see `proxy.envelope.celvars`).
    activation: Any = None
    # Set by the front when the person at the client can be asked for approval (in-band).
    in_band: InBandChannel | None = None
    # Set by a check that sends the call to the approval gate whatever its effect (dataflow
    # `on_flag: approve`): the evidence, shown to the approver. None: gated by effect only.
    escalation: str | None = None
    # Why it was escalated, from a closed set (`APPROVAL_REASONS`: dataflow_flag, tainted_run):
    # the approval's reason label in metrics and audit.
    escalation_reason: str | None = None
    # X-Envelope-Capability: the capability the caller asks for this call; it can only narrow
    # the principal's ("read-only" narrows read-write; anything else changes nothing).
    capability_requested: str | None = None
    # X-Envelope-Intent as sent (percent-encoded): the user's words, decoded and appended to the
    # run's intent by the data-flow check (`proxy.envelope.dataflow.intent`).
    intent: str | None = None
    # The deadline of the pending marker the data-flow check asks for (a session call whose
    # output it tracks), written once the answer turns out to be a stream the client may resume
    # elsewhere (`Envelope.stream_opens`); None: no marker wanted, or written already.
    ledger_due: float | None = None
    # The decision id of a pending marker in the run's ledger (an output is on its way), set
    # when it is written: whoever ends the call records the output, or clears the marker.
    ledger_pending: str | None = None
    # Set by the data-flow check on a read when some sink escalates tainted runs: the values
    # of its identifier arguments when the run was clean at the read (`read_handles`), and
    # whether the intent names one of its arguments (`read_pointed`). A successful answer
    # records them as endorsing keys (`proxy.envelope.dataflow.endorse`).
    read_handles: tuple[str, ...] = ()
    read_pointed: bool = False
    # Set by the data-flow check when the run's intent asks for this gated call itself
    # (`dataflow.waive_gate`: `proxy.envelope.dataflow.waiver`): the approval check lets it
    # through; the idempotency check still claims it.
    gate_waived: bool = False
    # Set by the executor (`proxy.fronts.forwarded`) when it starts writing the request upstream,
    # cleared when no byte of it was written (no connection): False means certainly not sent,
    # so certainly not performed. `upstream_status` is the HTTP status the upstream answered,
    # if any, set when the call ends (`Envelope.complete`, before the result hooks).
    maybe_sent: bool = False
    upstream_status: int | None = None
    # The canonical JSON of `arguments`, computed once (`args_json`).
    _args_json: bytes | None = field(default=None, repr=False)
    _key: str | None = field(default=None, repr=False)

    @property
    def qualified_name(self) -> str:
        """The policy key of the tool: `<upstream>.<tool>` (built once: read a dozen times)."""
        key = self._key
        if key is None or not key.endswith(self.tool):
            key = self._key = f"{self.upstream}.{self.tool}"
        return key

    def args_json(self) -> bytes:
        """The canonical JSON of the arguments (sorted keys): what the digest hashes and the
        audit record holds. Computed once per call."""
        if self._args_json is None:
            self._args_json = canonical_args(self.arguments)
        return self._args_json

    def args_digest(self) -> str:
        """"sha256:<hex>" of the canonical arguments: binds approvals and idempotency records."""
        return digest_of(self.args_json())


@dataclass(frozen=True, slots=True)
class Decision:
    """The end of a call's way through the checks: why it was refused (or allowed)."""

    verdict: Verdict
    code: Code
    check: str  # stable check id, e.g. "arg_rules"; "forward" for upstream outcomes
    reason: str
    rule: str | None = None  # the deciding rule id, when a rule decided
    # A tool result to answer with instead of forwarding (replay, shadow); None otherwise.
    result: Mapping[str, Any] | None = None
    # Extra audit fields (approval id, grant id, replayed...), merged under the record's extra.
    audit: Mapping[str, Any] | None = None
    # rate_limited by a token bucket: seconds until the call would pass (on the wire as
    # `retry_after`). None for every other decision, whose wire shape it leaves unchanged.
    retry_after: float | None = None

    @property
    def refused(self) -> bool:
        return self.verdict is not Verdict.ALLOW

    def as_meta(self, decision_id: str) -> dict[str, Any]:
        """The machine-readable decision carried in `_meta["envelope/decision"]`."""
        meta: dict[str, Any] = {
            "code": self.code.value,
            "check": self.check,
            "rule": self.rule,
            "reason": self.reason,
            "decision_id": decision_id,
        }
        if self.retry_after is not None:
            meta["retry_after"] = self.retry_after
        return meta


ALLOWED = Decision(Verdict.ALLOW, Code.OK, "envelope", "allowed by policy")


def deny(code: Code, check: str, reason: str, rule: str | None = None) -> Decision:
    """A policy refusal."""
    return Decision(Verdict.DENY, code, check, reason, rule)


ResultHook = Callable[["ToolCall", Decision, "Mapping[str, Any] | None"], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Reply:
    """The upstream's JSON-RPC answer to a forwarded request, as it arrived.

    `message` is the parsed answer (the inspection may rewrite it in place); `raw` its bytes as
    they would be delivered (a JSON body, or a whole SSE event; delivered unchanged when nothing
    was rewritten; None when the front must rebuild it, as for JSON that names a member twice,
    `jsonrpc.relayable`); `status` the upstream's HTTP status;
    `sse` the event's (type, id) when the answer came as an SSE event.
    """

    message: dict[str, Any]
    raw: bytes | None = None
    status: int = 200
    sse: tuple[str, str | None] | None = None


FailureKind = Literal["error", "timeout", "disconnected", "shutdown", "detached", "session_lost"]


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a forwarded request ended without an answer to deliver, as the front saw it.

    `error`: the upstream failed or answered garbage; `timeout`: it exceeded its timeout;
    `disconnected`: the client went away (the upstream call was cancelled); `shutdown`: the
    proxy stopped first; `detached`: the client left a resumable stream, the call goes on
    upstream and its result may be fetched later; `session_lost`: the upstream does not know
    the client's session (HTTP 404: the client must initialize again). The envelope turns it
    into the decision.
    """

    kind: FailureKind
    reason: str
    status: int | None = None  # the upstream's HTTP status, when it answered one
    extra: Mapping[str, Any] | None = None


OutcomeKind = Literal["deliver", "refuse", "held", "none"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a call (or a content read) ended, as audited: what the front delivers.

    - `deliver`: the upstream's answer, inspected: `raw` (its bytes, unchanged) when not None,
      else `message` (rewritten: redacted, forged meta removed). `status` is the upstream's.
    - `refuse`: a refusal of `decision` (rendered as a tool result the model reads, or a
      JSON-RPC error for unknown tools).
    - `held`: a result the envelope holds instead of forwarding (`message` is the result: an
      idempotent replay or a shadow result).
    - `none`: nothing to deliver (the client is gone; a resumable call goes on).
    """

    kind: OutcomeKind
    decision: Decision
    decision_id: str
    message: Mapping[str, Any] | None = None
    raw: bytes | None = None
    status: int = 200
    sse: tuple[str, str | None] | None = None  # the answer's SSE (event type, id), as it came


def _default_config() -> Config:
    from proxy.config import Config

    return Config()


def _recent_writes() -> RecentWrites:
    from proxy.envelope.dataflow.ledger import RecentWrites

    return RecentWrites()


@dataclass(frozen=True, slots=True)
class Services:
    """What stateful checks and the completion of calls need besides the policy, built once
    per process by the runtime (tests and offline tools build their own).

    `store`: the state store (None when none is configured: stateful checks then refuse, fail
    closed). `settings`: the runtime config. `metrics`: the process metrics (None: not
    counted). `notifier`: the approval notifier (webhook, early wake-up of held calls).
    `recent`: what this process wrote to run ledgers moments ago (skips rewriting them).
    `hold_calls` False says nobody waits at the other end (policy tests, replay): a check that
    would hold a call for a person (approval) decides at once. `signer` signs in-band approval
    state: one per process, so a state minted under one policy revision still opens under the
    next (None: the approval check builds its own). `approvals` the process's approval
    service, shared with the admin API (None: the approval check builds its own on `store`).
    """

    store: Store | None = None
    settings: Config = field(default_factory=_default_config)
    metrics: Metrics | None = None
    notifier: ApprovalNotifier | None = None
    recent: RecentWrites = field(default_factory=_recent_writes)
    hold_calls: bool = True
    signer: RequestStateSigner | None = None
    approvals: ApprovalService | None = None


@runtime_checkable
class Check(Protocol):
    """One named check of the envelope.

    Built once per policy revision (immutable, no per-request state) as
    `cls(revision, registry, services)`. `decide` returns None to let the call continue, or a
    `Decision` that ends it. An exception raised here is turned by the pipeline into an
    `internal_error` refusal (fail closed).
    """

    id: ClassVar[str]

    def decide(self, call: ToolCall) -> Decision | None: ...


@runtime_checkable
class AsyncCheck(Protocol):
    """A check that waits (for a store, a person). `applies` is a cheap synchronous filter: the
    pipeline awaits `decide` only for calls it applies to, keeping the common path sync."""

    id: ClassVar[str]

    def applies(self, call: ToolCall) -> bool: ...

    async def decide(self, call: ToolCall) -> Decision | None: ...
