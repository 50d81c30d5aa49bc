"""Runtime configuration: listeners, state, identity, limits, upstream URL overrides.

Sources, later ones winning: built-in defaults, the YAML file (`--config` or
`ENVELOPE_CONFIG`), `ENVELOPE_*` environment variables, command-line flags. Policy (what may be
called) lives in the policy directory, not here; this file is how the platform team runs it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy.errors import ConfigError
from proxy.identity import IdentityConfig, names_problem
from proxy.policy.vocab import Duration


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_hostport(value: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """`host:port`, `:port` or `port` -> (host, port); `[::1]:8080` for IPv6."""
    value = value.strip()
    host, _, port = value.rpartition(":")
    if not _:
        host, port = "", value
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"not host:port: {value!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, number


class UpstreamOverride(_Model):
    """Runtime override of a policy upstream's location (the policy decides, the platform
    routes): exactly one of `url` or `command`; the whole entry replaces the policy's `url`,
    `command`, `env`, `cwd`, `max_processes`, `max_processes_per_principal` and `idle_timeout`
    (see policy `Upstream`)."""

    url: str | None = None
    command: list[str] | None = None
    # stdio: added to the child's minimal environment (PATH, HOME, LANG). Absent: nothing.
    env: dict[str, str] = Field(default_factory=dict)
    # stdio: the child's working directory. Absent: the proxy's.
    cwd: str | None = None
    # stdio: most child processes at once. Absent: 16.
    max_processes: int = Field(default=16, ge=1, le=1024)
    # stdio: most session children of one principal at once. Absent: half of max_processes.
    max_processes_per_principal: int | None = Field(default=None, ge=1, le=1024)
    # stdio: an idle child is stopped after this long. Absent: 5 minutes.
    idle_timeout: Duration = 300.0

    @model_validator(mode="after")
    def _one_kind(self) -> UpstreamOverride:
        if (self.url is None) == (self.command is None):
            raise ValueError("an upstream has exactly one of 'url' or 'command'")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError("upstream command must name a program: [program, arg, ...]")
        return self


class AuditConfig(_Model):
    # Absent: <state_dir>/audit.
    directory: Path | None = None
    # fsync every record: survives power loss, costs a disk flush per call. Absent: false
    # (records are flushed to the OS before the reply is sent).
    fsync: bool = False
    # Rotate the file past this size; the hash chain continues into the next file.
    max_bytes: int = 100 * 2**20
    # Also start a new file at every interval (e.g. 24h: one file per UTC day; intervals are
    # aligned to the Unix epoch), before the first record written in it; the chain continues.
    # Absent: no time rotation.
    rotate_interval: Duration | None = Field(default=None, gt=0)
    # Log the chain head (`audit head {...}`, INFO, to the process log a log shipper carries
    # off the machine) this often when it moved, and once more at shutdown: the anchors
    # `audit verify --anchors` checks. 0: never logged (still served at /v1/audit/head).
    # Absent: 60 s.
    anchor_interval: Duration = 60.0


class StoreConfig(_Model):
    """Where approvals, idempotency records, shadow records and run flags live."""

    # sqlite: a file in the state directory, no server (the embedded default); redis: shared
    # by several replicas; memory: this process only (tests, trials).
    kind: Literal["sqlite", "redis", "memory"] = "sqlite"
    # sqlite: the database file. Absent: <state_dir>/state.db.
    path: Path | None = None
    # redis: the server URL, e.g. redis://127.0.0.1:6379/0.
    url: str | None = None
    # redis: key prefix, so several deployments can share one server.
    prefix: str = "envelope:"
    # Seconds any single store operation may take before it counts as unavailable.
    timeout: float = 2.0


class ApproverConfig(_Model):
    """One person who may approve or deny gated calls, identified by a bearer token."""

    # SHA-256 (hex) of the approver's token: the token itself never sits in the config.
    token_sha256: str | None = None
    # Name of an environment variable holding the token (a mounted secret). Either or both.
    token_env: str | None = None
    # Which calls this approver may approve or deny: `<upstream>.<tool>` patterns (`*` and `?`
    # as in shell globs: `github.*`, `*.delete_*`). Absent: every call; `[]`: none (a reviewer
    # who reads approvals and decisions but decides nothing). A scoped approver cannot set a
    # run's intent either: an intent endorses values for every tool of the run.
    scope: list[str] | None = None

    @field_validator("token_sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", v):
            raise ValueError("token_sha256 must be 64 hex digits (sha256 of the token)")
        return v.lower() if v else v

    @field_validator("scope")
    @classmethod
    def _patterns(cls, v: list[str] | None) -> list[str] | None:
        for pattern in v or ():
            if not re.fullmatch(r"[^.\s]+\.[^\s]+", pattern):
                raise ValueError(f"scope pattern {pattern!r} must be <upstream>.<tool> (globs allowed: "
                                 "github.*, *.delete_*)")
        return v

    @model_validator(mode="after")
    def _some_token(self) -> ApproverConfig:
        if self.token_sha256 is None and self.token_env is None:
            raise ValueError("an approver needs token_sha256 or token_env")
        return self


class ApprovalWebhookConfig(_Model):
    """Where a JSON notification is POSTed when an approval is created."""

    url: str
    # Seconds one delivery attempt may take.
    timeout: Duration = 5.0
    # Delivery attempts before giving up (each failure is counted).
    attempts: int = Field(default=5, ge=1)
    # Seconds before the second attempt; doubled after each failure.
    backoff: Duration = 0.5
    # Headers added to every notification (a shared secret for the receiver, for example).
    headers: dict[str, str] = Field(default_factory=dict)


class ApprovalsConfig(_Model):
    """The approval gate: gated effects wait for a person's decision bound to the exact call."""

    # false: no approval gate; tools with gated effects are refused as misconfigured.
    enabled: bool = True
    # How long an approval may be decided and used. Absent: 1 h (a tool's approval.ttl wins).
    ttl: Duration = 3600.0
    # Seconds between store polls while a call waits (a decision in this process wakes it at once).
    poll_interval: Duration = 0.2
    # How long decided, consumed and expired approvals stay listed after they expire.
    retention: Duration = 86400.0
    # Longest grant an approver may give. Absent: 24 h.
    max_grant_duration: Duration = 86400.0
    # Approver name -> token. Absent: nobody can approve through the admin API. A name is a
    # principal id (`proxy.identity.name_problem`): the self-approval rule compares it with the
    # calls' principals as a reader would (`proxy.approvals.approvers.same_person`).
    approvers: dict[str, ApproverConfig] = Field(default_factory=dict)
    # Notification on every new approval. Absent: none (approvers poll the admin API).
    webhook: ApprovalWebhookConfig | None = None
    # Base URL of the admin API as approvers reach it, for review links in notifications.
    # Absent: http://<admin listen address>.
    review_url: str | None = None
    # In-band approval over 2026-07-28 (input_required): the environment variable holding the
    # secret that signs the `requestState` the proxy hands to clients. Replicas behind one
    # load balancer need the same secret. Absent: a random per-process secret (a retry that
    # reaches another replica, or this one after a restart, is refused and asks again).
    in_band_secret_env: str | None = None
    # How long a client may take to answer an in-band approval request (2026-07-28).
    in_band_state_ttl: Duration = 600.0
    # How a held call gets approved in this deployment, appended to every `approval_pending`
    # reason ("{id}" is replaced by the approval id). Absent: nothing appended (`envelope-proxy
    # stdio` sets one naming what the person at the client can do).
    pending_hint: str | None = None

    @field_validator("approvers")
    @classmethod
    def _names(cls, v: dict[str, ApproverConfig]) -> dict[str, ApproverConfig]:
        # Approvers' names are shown in every decision record and on the review page, and
        # compared with calls' principals: `alice\u200b` or `alice ` reads as alice and is
        # another name. Held to the rule of the principals they are compared with.
        problem = names_problem("approver name", v)
        if problem is not None:
            raise ValueError(problem)
        return v


class IdempotencyConfig(_Model):
    """How long performed calls are remembered, and how long a duplicate waits for the first."""

    # Seconds (or "24h") a performed call's result is kept for replay. Absent: 24 hours.
    ttl: Duration = 24 * 3600.0
    # Seconds a duplicate of a call still in flight waits for its result before it is refused
    # (idempotency_in_flight). Absent: 30 s.
    wait: Duration = 30.0


class RetryConfig(_Model):
    """Bounded retry of transient upstream failures (connect errors, 429, 502, 503, 504).

    Only read-only calls and tools the policy declares `idempotent: true` are retried, only before
    any byte reached the client, and always within the upstream's timeout.
    """

    # Attempts in all (1 disables retries). Absent: 3.
    attempts: int = Field(default=3, ge=1, le=10)
    # First backoff in seconds, doubled per retry. Absent: 0.2 s.
    backoff: Duration = 0.2
    # Longest single wait, also the cap on a Retry-After header. Absent: 5 s.
    max_backoff: Duration = 5.0


class Limits(_Model):
    # Largest request body accepted on the MCP listener (413 beyond).
    max_body_bytes: int = 4 * 2**20
    # Deepest JSON nesting accepted in a request (400 beyond).
    max_json_depth: int = 64
    # Largest SSE event an upstream may send (a call is refused `upstream_error`, "reply exceeds
    # N bytes", and cancelled; a relayed stream is ended). Absent: 32 MiB: a 10 MB tool result
    # arrives as ~21 MB (SDK servers send its text twice, in `content` and
    # `structuredContent`), and an oversized reply in flight costs at most the cap plus a read.
    max_upstream_event_bytes: int = Field(default=32 * 2**20, ge=1024)
    # Largest JSON reply body an upstream may send (refused like an oversized event; a relayed
    # reply answers 502). Absent: 32 MiB, like events.
    max_upstream_reply_bytes: int = Field(default=32 * 2**20, ge=1024)
    # Pooled connections per upstream host:port for calls (waiting for one is bounded by the
    # upstream's connect_timeout). Absent: 256.
    max_upstream_connections: int = Field(default=256, ge=1)
    # Connections per upstream host:port for long-lived GET streams, a budget of their own so
    # streams never take a call's connection; past it a GET is refused at once (503). Absent: 128.
    max_upstream_streams: int = Field(default=128, ge=1)
    # Concurrent GET streams one principal may hold, over every upstream (an aggregated `/mcp`
    # GET holds one per upstream); past it 503. Absent: 32.
    max_streams_per_principal: int = Field(default=32, ge=1)
    # Concurrent GET streams to one upstream, over every principal; past it 503. Absent: 128.
    max_streams_per_upstream: int = Field(default=128, ge=1)
    # How long the output guardrails may take over one message an upstream sent (a large one is
    # scanned in a worker thread): past it the message is withheld, the call refused
    # `internal_error` (check `guardrails`; fail closed). Linear in the text: 10 MB of the
    # costliest text took 2-13 s alone and 29-40 s sharing the interpreter with hundreds of other
    # calls on an overloaded 2-core machine. Absent: 60 s.
    guardrail_scan_timeout: Duration = Field(default=60.0, gt=0)


class ListenerConfig(_Model):
    """The MCP listener's server, and the connection timeouts of the MCP and admin listeners.

    Written as a mapping, or as the bare server name (`listener: fast`), which is the mapping
    `{kind: fast}` with the default timeouts."""

    # The MCP listener's HTTP server: `aiohttp` (aiohttp's own), or `fast` (an asyncio protocol
    # with httptools serving the same application, proxy/app/fast_listener.py). The admin
    # listener is always aiohttp. Absent: fast (the whole test suite and the conformance suite
    # pass through both; `aiohttp` stays selectable).
    kind: Literal["fast", "aiohttp"] = "fast"
    # A connection that has not sent a whole request head (request line and headers) this long
    # after it opened, or after the first byte of a later request, is closed. It bounds the body
    # too: a request body (MCP, `/http/...` and admin routes) that has not arrived whole this
    # long after its head is answered 408 (and closed), counted `body_timeout`. Absent: 10 s.
    header_timeout: Duration = Field(default=10.0, gt=0)
    # An idle keep-alive connection (no request in progress) is closed after this long.
    # Absent: 75 s.
    keepalive_timeout: Duration = Field(default=75.0, gt=0)
    # MCP listener: a request header whose name holds `_` (`X_Envelope_Run`, which CGI/WSGI and
    # other frameworks read as `X-Envelope-Run`): `drop` (not forwarded to upstreams, counted in
    # `envelope_headers_dropped_total`), `reject` (400, audited) or `allow` (forwarded, except a
    # spelling of a header the proxy strips or sets). Absent: drop (nginx's default).
    underscore_headers: Literal["drop", "reject", "allow"] = "drop"

    @model_validator(mode="before")
    @classmethod
    def _bare_kind(cls, value: Any) -> Any:
        # `listener: fast` (the spelling) next to the mapping form kept for the timeouts.
        return {"kind": value} if isinstance(value, str) else value


class AggregateConfig(_Model):
    """The aggregated endpoint `/mcp`: several upstreams presented as one MCP server."""

    # Absent or false: no `/mcp` route (only `/mcp/<upstream>`).
    enabled: bool = False
    # Upstreams merged, in this order. Absent or empty: every upstream of the policy. Names the
    # policy does not declare are skipped with a warning.
    upstreams: list[str] = Field(default_factory=list)
    # Client sessions kept at once (legacy revisions); beyond it the least recently used session
    # of the principal holding the most is dropped (its client gets 404 and re-initializes; its
    # upstream sessions are closed).
    max_sessions: int = Field(default=1000, ge=1)
    # Client sessions one principal may hold; beyond it that principal's own least recently used
    # session is dropped (so one principal cannot push out another's).
    max_sessions_per_principal: int = Field(default=100, ge=1)


class RecordConfig(_Model):
    """Decision recording for `envelope-proxy replay` (`serve --record FILE`).

    Not the audit log: a line that cannot be written is logged and counted, and the call goes
    on. Lines hold full arguments and the principal's verified claims: protect the file.
    """

    # The JSONL file records are appended to (with several workers: `<stem>-w<n><suffix>` each).
    path: Path
    # fsync every line (like `audit.fsync`). Absent: false (flushed to the OS per line).
    fsync: bool = False
    # Record the principal's verified JWT claims (CEL may depend on them). false: omitted, and
    # rules over `principal.claims` re-decide as if there were none.
    claims: bool = True


class Config(_Model):
    """Everything `envelope-proxy serve` needs besides the policy."""

    listen: str = "127.0.0.1:8080"
    admin: str = "127.0.0.1:9090"
    policies: Path = Path("policies")
    state_dir: Path = Path(".envelope-state")
    identity: IdentityConfig = Field(default_factory=IdentityConfig)
    upstreams: dict[str, UpstreamOverride] = Field(default_factory=dict)
    # Host header values accepted besides loopback names and the listen address (DNS
    # rebinding protection). "*" accepts any (only behind a trusted ingress).
    allowed_hosts: list[str] = Field(default_factory=list)
    # Host header values the admin listener accepts besides loopback names and its listen
    # address (DNS rebinding protection; 421 otherwise). "*" accepts any.
    admin_allowed_hosts: list[str] = Field(default_factory=list)
    # Origin values accepted besides loopback origins. Requests without Origin are accepted.
    allowed_origins: list[str] = Field(default_factory=list)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    approvals: ApprovalsConfig = Field(default_factory=ApprovalsConfig)
    limits: Limits = Field(default_factory=Limits)
    listener: ListenerConfig = Field(default_factory=ListenerConfig)
    idempotency: IdempotencyConfig = Field(default_factory=IdempotencyConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    cel_engine: Literal["auto", "cel-cpp", "cel-python"] = "auto"
    # Upstream HTTP client: "fast" (asyncio + httptools, ~5x less CPU per call; https upstreams
    # go through aiohttp) or "aiohttp".
    transport: Literal["fast", "aiohttp"] = "fast"
    # Seconds between policy directory polls for hot reload; 0 disables polling (SIGHUP
    # still reloads).
    reload_interval: float = 1.0
    # Number of worker processes sharing the listener (SO_REUSEPORT); each has its own audit
    # file.
    workers: int = Field(default=1, ge=1, le=64)
    # Seconds in-flight calls get to finish on SIGTERM.
    shutdown_grace: float = 10.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Seconds between active health probes of every upstream (an HTTP request to its URL; any
    # HTTP status counts as up). 0 disables probing: health then comes from real traffic only.
    health_interval: float = Field(default=10.0, ge=0)
    # Seconds a probe may take (connect plus the status line) before it counts as a failure.
    health_timeout: float = Field(default=2.0, gt=0)
    # Consecutive failures (traffic or probe) after which an upstream is reported down.
    health_down_after: int = Field(default=1, ge=1)
    # Upstreams the probe visits. Absent: every one. The demo lists only the server it runs, so
    # the pack's placeholder upstreams are neither probed nor reported down.
    health_upstreams: list[str] | None = None
    aggregate: AggregateConfig = Field(default_factory=AggregateConfig)
    # Record every decision for `envelope-proxy replay`. Absent: not recorded.
    record: RecordConfig | None = None

    @field_validator("listen", "admin")
    @classmethod
    def _hostport(cls, v: str) -> str:
        parse_hostport(v)
        return v

    @property
    def listen_addr(self) -> tuple[str, int]:
        return parse_hostport(self.listen)

    @property
    def admin_addr(self) -> tuple[str, int]:
        return parse_hostport(self.admin)

    @property
    def audit_dir(self) -> Path:
        return self.audit.directory or self.state_dir / "audit"


# ENVELOPE_<NAME> -> top-level key; nested settings come from the file.
ENV_KEYS = {
    "ENVELOPE_LISTEN": "listen",
    "ENVELOPE_ADMIN": "admin",
    "ENVELOPE_POLICIES": "policies",
    "ENVELOPE_STATE_DIR": "state_dir",
    "ENVELOPE_CEL_ENGINE": "cel_engine",
    "ENVELOPE_LOG_LEVEL": "log_level",
    "ENVELOPE_WORKERS": "workers",
    "ENVELOPE_RELOAD_INTERVAL": "reload_interval",
    "ENVELOPE_TRANSPORT": "transport",
    "ENVELOPE_HEALTH_INTERVAL": "health_interval",
}


def cel_engine_setting(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The CEL engine name for commands that read no config file (`check`, `test`): the flag,
    else `ENVELOPE_CEL_ENGINE`, else auto; the precedence `load_config` gives `cel_engine`.
    Not validated here: an unknown name is reported by the policy loader."""
    environ = os.environ if environ is None else environ
    return flag or environ.get("ENVELOPE_CEL_ENGINE") or "auto"


def _set_listener_kind(data: dict[str, Any], kind: str) -> None:
    """Merge `kind` into the file's listener settings: the server changes, its timeouts stay."""
    listener = data.get("listener")
    if listener is None or isinstance(listener, str):
        data["listener"] = {"kind": kind}
    elif isinstance(listener, Mapping):  # anything else is left for validation to report
        data["listener"] = {**listener, "kind": kind}


def load_config(
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the config from file, environment and flag overrides; ConfigError on any problem."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    path = path or (Path(environ["ENVELOPE_CONFIG"]) if environ.get("ENVELOPE_CONFIG") else None)
    if path is not None:
        from ruamel.yaml import YAML
        from ruamel.yaml.error import YAMLError

        try:
            loaded = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
        except (OSError, YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: config must be a mapping")
        data.update(loaded or {})
    for env, key in ENV_KEYS.items():
        if environ.get(env):
            data[key] = environ[env]
    if environ.get("ENVELOPE_LISTENER"):
        _set_listener_kind(data, environ["ENVELOPE_LISTENER"])
    for key, value in (overrides or {}).items():
        if key == "listener" and isinstance(value, str):  # --listener: the kind only
            _set_listener_kind(data, value)
        elif value is not None:
            data[key] = value
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        where = f"{path}: " if path else ""
        lines = [
            f"{where}{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
            for err in exc.errors()
        ]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from exc
