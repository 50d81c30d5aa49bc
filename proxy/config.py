"""Runtime configuration: listeners, state, identity, limits, upstream URL overrides.

Sources, later ones winning: built-in defaults, the YAML file (`--config` or
`ENVELOPE_CONFIG`), `ENVELOPE_*` environment variables, command-line flags. Policy (what may be
called) lives in the policy directory, not here; this file is how the platform team runs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from proxy.errors import ConfigError
from proxy.identity import IdentityConfig


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
    """Runtime override of a policy upstream's URL (the policy decides, the platform routes)."""

    url: str


class AuditConfig(_Model):
    # Absent: <state_dir>/audit.
    directory: Path | None = None
    # fsync every record: survives power loss, costs a disk flush per call. Absent: false
    # (records are flushed to the OS before the reply is sent).
    fsync: bool = False
    # Rotate the file past this size; the hash chain continues into the next file.
    max_bytes: int = 100 * 2**20


class Limits(_Model):
    # Largest request body accepted on the MCP listener (413 beyond).
    max_body_bytes: int = 4 * 2**20
    # Deepest JSON nesting accepted in a request (400 beyond).
    max_json_depth: int = 64


class AggregateConfig(_Model):
    """The aggregated endpoint `/mcp`: several upstreams presented as one MCP server."""

    # Absent or false: no `/mcp` route (only `/mcp/<upstream>`).
    enabled: bool = False
    # Upstreams merged, in this order. Absent or empty: every upstream of the policy. Names the
    # policy does not declare are skipped with a warning.
    upstreams: list[str] = Field(default_factory=list)
    # Client sessions kept at once (legacy revisions); the least recently used one beyond is
    # dropped (its client gets 404 and re-initializes).
    max_sessions: int = Field(default=1000, ge=1)


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
    # Origin values accepted besides loopback origins. Requests without Origin are accepted.
    allowed_origins: list[str] = Field(default_factory=list)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    limits: Limits = Field(default_factory=Limits)
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
    aggregate: AggregateConfig = Field(default_factory=AggregateConfig)

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
    for key, value in (overrides or {}).items():
        if value is not None:
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
