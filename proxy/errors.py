"""One exception hierarchy for the proxy. Library exceptions are mapped at the boundary."""

from __future__ import annotations

from dataclasses import dataclass


class EnvelopeError(Exception):
    """Base of every error the proxy raises on purpose."""


class ConfigError(EnvelopeError):
    """The runtime configuration (file, flags, environment) is invalid."""


class ListenError(ConfigError):
    """A listener's address cannot be bound (in use, not permitted); the message names the setting."""


@dataclass(frozen=True)
class PolicyProblem:
    """One problem found while loading a policy directory, with its place."""

    file: str
    line: int
    column: int
    message: str
    code: str = "policy_invalid"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


class PolicyError(EnvelopeError):
    """A policy directory cannot be loaded; carries every problem found, not just the first."""

    def __init__(self, problems: list[PolicyProblem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems) or "invalid policy")


class CelCompileError(EnvelopeError):
    """A CEL expression does not parse or type-check. `offset` is 0-based in the expression."""

    def __init__(self, message: str, offset: int = 0):
        self.offset = offset
        super().__init__(message)


class CelEvalError(EnvelopeError):
    """A CEL expression failed at run time (missing key, bad type, non-bool result)."""


class AuditError(EnvelopeError):
    """The audit log cannot be written: calls are refused until it can."""


class UpstreamError(EnvelopeError):
    """The upstream could not be reached or answered garbage."""

    # How many times the request was written to the upstream (so may have been performed), set
    # by `Forwarder.open` on every error it raises: 0 for `cannot connect to upstream ...`, 2
    # after a resend. None on errors raised elsewhere (while reading a response's body).
    attempts: int | None = None


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer within its timeout."""


class ReplyTooLarge(UpstreamError):
    """The upstream sent more than a configured cap (an SSE event or a JSON reply): not read on."""

    def __init__(self, limit: int, setting: str):
        self.limit = limit
        self.setting = setting
        super().__init__(f"reply exceeds {limit} bytes ({setting})")


class UpstreamBusy(UpstreamError):
    """The upstream's budget of long-lived stream connections is spent: refused, never queued."""


class LimitExceeded(EnvelopeError):
    """A configured cap on what a client may hold (concurrent streams) is reached: refused."""


class IdentityError(EnvelopeError):
    """The caller's identity could not be verified (missing, expired, wrong audience...)."""


class StoreError(EnvelopeError):
    """The state store cannot be read or written: gated calls are refused until it can."""


class AdminApiError(EnvelopeError):
    """The admin API could not be reached or read (`status` None), or refused a request
    (`status`: the HTTP status; `message`: the server's own error message)."""

    def __init__(self, base_url: str, url: str, message: str, status: int | None = None):
        self.base_url = base_url
        self.url = url
        # One line: a server message or an OS error never breaks the CLI's one-line report.
        self.message = " ".join(message.split())
        self.status = status
        if status is None:
            super().__init__(f"cannot reach the admin API at {base_url}: {self.message}")
        else:
            super().__init__(f"{url}: HTTP {status}: {self.message}")
