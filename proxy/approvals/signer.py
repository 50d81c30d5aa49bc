"""In-band approval state (2026-07-28 `input_required`): the signed `requestState`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from proxy.approvals.records import (
    CallBinding,
    InvalidRequestState,
    _canonical,
)
from proxy.config import ApprovalsConfig

log = logging.getLogger("envelope.approvals")

STATE_PREFIX = "envelope1."


@dataclass(frozen=True, slots=True)
class SealedState:
    """What a verified `requestState` says: the approval it asks about, for which call."""

    approval_id: str
    binding_key: str
    nonce: str
    expires_at: float


class RequestStateSigner:
    """Mint and verify the opaque `requestState` of an in-band approval request.

    `envelope1.<base64url(json payload)>.<base64url(HMAC-SHA256(secret, "envelope1." + payload))>`;
    the payload binds the approval id and the call (`CallBinding.key`: principal, run, upstream,
    tool, argument digest), carries a random nonce (the approval check spends it once in the
    store, so a replayed state is refused) and an expiry. The secret is the configured one
    (`approvals.in_band_secret_env`) or a random one drawn by this signer: the runtime builds
    one signer per process and hands it to every policy revision through `Services.signer`; the
    workers of one `serve` (`workers: N`) share the random one their supervisor drew, as a retry
    may land on any of them.
    """

    def __init__(self, secret: bytes | None = None, ttl: float = 600.0,
                 clock: Callable[[], float] = time.time):
        self._secret = secret or secrets.token_bytes(32)
        self.ttl = ttl
        self.clock = clock

    @classmethod
    def from_config(cls, config: ApprovalsConfig, drawn: bytes | None = None) -> RequestStateSigner:
        """The configured secret's signer; else one signing with `drawn` (the workers' shared
        secret), else with a random secret of its own."""
        secret: bytes | None = drawn
        if config.in_band_secret_env:
            value = os.environ.get(config.in_band_secret_env, "")
            if value:
                secret = value.encode()
            else:
                log.warning("approvals.in_band_secret_env: environment variable %s is not set; "
                            "in-band approval state is signed with a random secret (shared by this serve's "
                            "workers only)",
                            config.in_band_secret_env)
        return cls(secret, config.in_band_state_ttl)

    def derive(self, purpose: bytes) -> bytes:
        """A 32-byte key for `purpose`, from this signer's secret: shared wherever the secret is
        (every worker of a serve; replicas configured with one `in_band_secret_env`), and
        unrelated to the key of any other purpose."""
        return hmac.new(self._secret, b"envelope-proxy derive " + purpose, hashlib.sha256).digest()

    def _mac(self, signed: bytes) -> str:
        return _b64(hmac.new(self._secret, signed, hashlib.sha256).digest())

    def seal(self, approval_id: str, binding: CallBinding, expires_at: float | None = None) -> str:
        exp = self.clock() + self.ttl if expires_at is None else expires_at
        payload = _b64(_canonical({"a": approval_id, "b": binding.key, "n": secrets.token_hex(16),
                                   "e": round(exp, 3)}))
        signed = f"{STATE_PREFIX}{payload}"
        return f"{signed}.{self._mac(signed.encode())}"

    def open(self, token: str, binding: CallBinding) -> SealedState:
        """Verify a state for this call; raises InvalidRequestState (no detail to the client)."""
        if not isinstance(token, str) or not token.startswith(STATE_PREFIX) or len(token) > 2048:
            raise InvalidRequestState("not a requestState minted by this proxy")
        signed, dot, mac = token.rpartition(".")
        if not dot or not hmac.compare_digest(mac.encode(), self._mac(signed.encode()).encode()):
            raise InvalidRequestState("bad signature")
        try:
            data = orjson.loads(_unb64(signed[len(STATE_PREFIX):]))
            state = SealedState(str(data["a"]), str(data["b"]), str(data["n"]), float(data["e"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestState("malformed") from exc
        if not hmac.compare_digest(state.binding_key, binding.key):
            raise InvalidRequestState("bound to another call")
        if self.clock() >= state.expires_at:
            raise InvalidRequestState("expired")
        return state


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
