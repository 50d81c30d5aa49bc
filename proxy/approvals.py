"""Approvals: a person's decision bound to one exact tool call, and grants that pre-approve a
narrow family of later calls.

An approval is bound to the call's principal, run, upstream, tool and argument digest
(`CallBinding`): approving one call never approves another. Its life:

    pending --approve--> approved --consume (cas, once)--> consumed
       |                    |
       +--deny--> denied    +-- past expires_at --> expired (pending too)

State lives in the `Store` (namespaces `approval`: id -> record, `approval_by_call`: binding
key -> id, `grant`: id -> grant), so every replica sees every decision; transitions are
compare-and-set on the record's bytes. The store's own expiry only garbage-collects: records
stay listed for `approvals.retention` after they expire, and "expired" is computed from
`expires_at`, so it needs no writer.

`ApprovalNotifier` is process-local: it wakes calls waiting in this process when this process
decides (others poll the store), and POSTs a webhook for every new approval in a tracked
background task, retried with exponential backoff.

Every method that touches the store raises `proxy.errors.StoreError` when the store cannot
answer: callers fail closed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import orjson

from proxy.config import ApprovalsConfig, ApprovalWebhookConfig
from proxy.errors import EnvelopeError
from proxy.policy.model import parse_duration
from proxy.store.base import Store

log = logging.getLogger("envelope.approvals")

NS_APPROVAL = "approval"
NS_BY_CALL = "approval_by_call"
NS_GRANT = "grant"

State = Literal["pending", "approved", "denied", "expired", "consumed"]
STATES: tuple[State, ...] = ("pending", "approved", "denied", "expired", "consumed")
GrantScope = Literal["tool", "run"]

_OPT = orjson.OPT_SORT_KEYS
_CAS_ATTEMPTS = 8


class ApprovalError(EnvelopeError):
    """An approver's request cannot be carried out (maps to a 4xx answer)."""

    status = 400


class ApprovalNotFound(ApprovalError):
    """No approval (or grant) has this id."""

    status = 404


class ApprovalConflict(ApprovalError):
    """The approval is no longer pending (decided, consumed or expired)."""

    status = 409


class SelfApproval(ApprovalError):
    """An approver tried to decide a call made by themselves."""

    status = 403


class InvalidGrant(ApprovalError):
    """The grant in an approve request is malformed or too long."""

    status = 400


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=_OPT)


@dataclass(frozen=True, slots=True)
class CallBinding:
    """What an approval is bound to: exactly one call."""

    principal: str
    run: str
    upstream: str
    tool: str
    args_digest: str

    @property
    def key(self) -> str:
        """A fixed-length store key (ids and names may hold any character)."""
        raw = orjson.dumps([self.principal, self.run, self.upstream, self.tool, self.args_digest])
        return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True, slots=True)
class Approval:
    """One approval request and its decision (a store record)."""

    id: str
    state: State
    principal: str
    run: str
    upstream: str
    tool: str
    args_digest: str
    arguments: dict[str, Any]  # shown to approvers: they decide on what the call does
    effect: str
    reason: str  # why the call is gated
    created_at: float
    expires_at: float
    decision_id: str | None = None  # the call that asked for it
    approver: str | None = None
    decision_reason: str | None = None
    decided_at: float | None = None
    consumed_at: float | None = None
    grant_id: str | None = None  # a grant the approver gave with the approval

    @property
    def binding(self) -> CallBinding:
        return CallBinding(self.principal, self.run, self.upstream, self.tool, self.args_digest)

    def effective_state(self, now: float) -> State:
        """The state as of `now`: pending or approved past `expires_at` is expired."""
        if self.state in ("pending", "approved") and now >= self.expires_at:
            return "expired"
        return self.state

    def encode(self) -> bytes:
        return _canonical(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Approval:
        return cls(**orjson.loads(raw))

    def view(self, now: float) -> dict[str, Any]:
        """The JSON shape of the admin API (state as of `now`)."""
        return {**asdict(self), "state": self.effective_state(now)}


@dataclass(frozen=True, slots=True)
class Grant:
    """A standing approval: later calls of one principal to one tool (optionally in one run)
    whose arguments hold the given exact values go ahead without waiting."""

    id: str
    scope: GrantScope
    principal: str
    upstream: str
    tool: str
    run: str | None
    args: dict[str, Any]
    approver: str
    reason: str
    approval_id: str
    created_at: float
    expires_at: float

    def matches(self, binding: CallBinding, arguments: Mapping[str, Any], now: float) -> bool:
        if now >= self.expires_at:
            return False
        if (binding.principal, binding.upstream, binding.tool) != (self.principal, self.upstream, self.tool):
            return False
        if self.scope == "run" and binding.run != self.run:
            return False
        # Exact JSON equality: canonical bytes, so 1 != true and key order does not matter.
        return all(k in arguments and _canonical(arguments[k]) == _canonical(v) for k, v in self.args.items())

    def encode(self) -> bytes:
        return _canonical(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Grant:
        return cls(**orjson.loads(raw))

    def view(self, now: float) -> dict[str, Any]:
        return {**asdict(self), "active": now < self.expires_at}


@dataclass(frozen=True, slots=True)
class GrantRequest:
    """The `grant` of an approve request, validated."""

    scope: GrantScope
    args: dict[str, Any]
    duration: float

    @classmethod
    def parse(cls, data: Any, max_duration: float) -> GrantRequest:
        """Validate `{"scope": "tool"|"run", "args": {...}, "duration": "30m"}`; InvalidGrant otherwise."""
        if not isinstance(data, dict):
            raise InvalidGrant("grant must be an object {scope, args, duration}")
        unknown = set(data) - {"scope", "args", "duration"}
        if unknown:
            raise InvalidGrant(f"unknown grant field(s): {', '.join(sorted(unknown))}")
        scope = data.get("scope")
        if scope not in ("tool", "run"):
            raise InvalidGrant('grant scope must be "tool" or "run"')
        args = data.get("args", {})
        if not isinstance(args, dict):
            raise InvalidGrant("grant args must be an object of exact argument values")
        try:
            duration = parse_duration(data.get("duration", "1h"))
        except ValueError as exc:
            raise InvalidGrant(f"grant duration: {exc}") from None
        if not 0 < duration <= max_duration:
            raise InvalidGrant(f"grant duration must be more than 0 and at most {max_duration:g}s")
        return cls(scope, args, duration)


# -- approvers -------------------------------------------------------------------------------


class Approvers:
    """Approver tokens from the runtime config, checked by SHA-256 digest in constant time."""

    def __init__(self, config: ApprovalsConfig, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        self._digests: list[tuple[str, bytes]] = []
        for name, approver in config.approvers.items():
            if approver.token_sha256:
                self._digests.append((name, bytes.fromhex(approver.token_sha256)))
            if approver.token_env:
                token = environ.get(approver.token_env)
                if token:
                    self._digests.append((name, hashlib.sha256(token.encode()).digest()))
                else:
                    log.warning("approver %s: environment variable %s is not set; that token "
                                "cannot authenticate", name, approver.token_env)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def authenticate(self, token: str | None) -> str | None:
        """The approver's name for this token, or None. Every digest is compared."""
        if not token:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        found: str | None = None
        for name, want in self._digests:
            if hmac.compare_digest(digest, want) and found is None:
                found = name
        return found


# -- notifier --------------------------------------------------------------------------------


class ApprovalNotifier:
    """Process-local signals: wake waiters on a decision here; POST a webhook per new approval.

    Webhook deliveries run in tracked background tasks (`close` cancels them); each failed
    attempt is counted in `envelope_approval_webhook_failures_total`.
    """

    def __init__(self, webhook: ApprovalWebhookConfig | None = None, metrics: Any = None,
                 review_url: str | None = None):
        self.webhook = webhook
        self.metrics = metrics
        self.review_url = (review_url or "").rstrip("/")
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: Any = None

    # waking
    async def wait(self, approval_id: str, seconds: float) -> None:
        """Return after `seconds` or as soon as this process decides `approval_id`.

        The event lives only while someone waits: a decision between two waits is seen by the
        waiter's next store read (`decided` is called after the store write)."""
        event = self._events.setdefault(approval_id, asyncio.Event())
        self._waiters[approval_id] = self._waiters.get(approval_id, 0) + 1
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await event.wait()
        finally:
            left = self._waiters.pop(approval_id) - 1
            if left:
                self._waiters[approval_id] = left
            elif self._events.get(approval_id) is event:
                del self._events[approval_id]

    def decided(self, approval_id: str) -> None:
        event = self._events.pop(approval_id, None)
        if event is not None:
            event.set()

    # webhook
    def payload(self, approval: Approval) -> dict[str, Any]:
        return {
            "type": "approval.created",
            "id": approval.id,
            "principal": approval.principal,
            "run": approval.run,
            "upstream": approval.upstream,
            "tool": approval.tool,
            "args_digest": approval.args_digest,
            "effect": approval.effect,
            "reason": approval.reason,
            "created_at": approval.created_at,
            "expires_at": approval.expires_at,
            "review_url": f"{self.review_url}/v1/approvals/{approval.id}",
        }

    def created(self, approval: Approval) -> None:
        """Schedule the webhook notification for a new approval (no-op without a webhook)."""
        if self.webhook is None:
            return
        task = asyncio.get_running_loop().create_task(self._deliver(self.payload(approval)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, payload: dict[str, Any]) -> None:
        import aiohttp

        hook = self.webhook
        assert hook is not None
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = orjson.dumps(payload)
        headers = {"Content-Type": "application/json", **hook.headers}
        for attempt in range(hook.attempts):
            problem: str
            try:
                async with self._session.post(
                    hook.url, data=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=hook.timeout),
                ) as resp:
                    await resp.read()
                    if 200 <= resp.status < 300:
                        return
                    problem = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if self.metrics is not None:
                self.metrics.approval_webhook_failure()
            if attempt + 1 < hook.attempts:
                delay = hook.backoff * 2**attempt
                log.warning("approval webhook for %s failed (%s); retry %d/%d in %gs", payload["id"],
                            problem, attempt + 1, hook.attempts - 1, delay)
                await asyncio.sleep(delay)
            else:
                log.error("approval webhook for %s failed %d times (%s); giving up", payload["id"],
                          hook.attempts, problem)

    async def close(self) -> None:
        """Cancel deliveries in flight and close the HTTP session."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None


# -- the service -----------------------------------------------------------------------------


@dataclass
class ApprovalService:
    """Create, find, decide and consume approvals and grants on the store.

    Stateless besides the store and the notifier: the check builds one per policy revision and
    the admin API its own; they agree through the store.
    """

    store: Store
    config: ApprovalsConfig = field(default_factory=ApprovalsConfig)
    notifier: ApprovalNotifier | None = None
    metrics: Any = None
    clock: Callable[[], float] = time.time

    # -- reading ----------------------------------------------------------------------------

    async def get(self, approval_id: str) -> Approval | None:
        raw = await self.store.get(NS_APPROVAL, approval_id)
        return None if raw is None else Approval.decode(raw)

    async def for_call(self, binding: CallBinding) -> Approval | None:
        """The approval bound to this call, if one was requested and is still kept."""
        approval_id = await self.store.get(NS_BY_CALL, binding.key)
        if approval_id is None:
            return None
        approval = await self.get(approval_id.decode())
        if approval is None or approval.binding != binding:  # gone, or a (never seen) collision
            return None
        return approval

    async def approvals(self, state: State | None = None, limit: int = 1000) -> list[Approval]:
        """Approvals (in their state as of now), oldest first."""
        now = self.clock()
        found = [Approval.decode(raw) for _, raw in await self.store.items(NS_APPROVAL, limit)]
        if state is not None:
            found = [a for a in found if a.effective_state(now) == state]
        return sorted(found, key=lambda a: (a.created_at, a.id))

    async def grants(self, limit: int = 1000) -> list[Grant]:
        found = [Grant.decode(raw) for _, raw in await self.store.items(NS_GRANT, limit)]
        return sorted(found, key=lambda g: (g.created_at, g.id))

    async def find_grant(self, binding: CallBinding, arguments: Mapping[str, Any]) -> Grant | None:
        """The oldest active grant that covers this call, if any."""
        now = self.clock()
        for grant in await self.grants():
            if grant.matches(binding, arguments, now):
                return grant
        return None

    async def refresh_pending(self) -> int:
        """Count pending approvals into `envelope_approvals_pending`; returns the count."""
        count = len(await self.approvals("pending"))
        if self.metrics is not None:
            self.metrics.set_approvals_pending(count)
        return count

    # -- writing ----------------------------------------------------------------------------

    def _store_ttl(self, approval: Approval) -> float:
        return max(1.0, approval.expires_at + self.config.retention - self.clock())

    async def request(
        self, binding: CallBinding, *, arguments: dict[str, Any], effect: str, reason: str,
        ttl: float, decision_id: str | None = None,
    ) -> tuple[Approval, bool]:
        """The approval for this call: the existing one, or a new pending one (then notified).

        Returns (approval, created). Concurrent identical calls share one approval: the binding
        is claimed with `add`, and the loser reads the winner's.
        """
        now = self.clock()
        approval = Approval(
            id=f"apr-{secrets.token_hex(8)}", state="pending", principal=binding.principal,
            run=binding.run, upstream=binding.upstream, tool=binding.tool,
            args_digest=binding.args_digest, arguments=dict(arguments), effect=effect,
            reason=reason, created_at=now, expires_at=now + ttl, decision_id=decision_id,
        )
        ttl_store = self._store_ttl(approval)
        await self.store.put(NS_APPROVAL, approval.id, approval.encode(), ttl=ttl_store)
        if not await self.store.add(NS_BY_CALL, binding.key, approval.id.encode(), ttl=ttl_store):
            await self.store.delete(NS_APPROVAL, approval.id)
            existing = await self.for_call(binding)
            if existing is not None:
                return existing, False
            # The winner's binding vanished in between (forgotten): ours takes its place.
            await self.store.put(NS_APPROVAL, approval.id, approval.encode(), ttl=ttl_store)
            await self.store.put(NS_BY_CALL, binding.key, approval.id.encode(), ttl=ttl_store)
        log.info("approval %s requested: %s calls %s.%s (%s)", approval.id, binding.principal,
                 binding.upstream, binding.tool, reason)
        if self.notifier is not None:
            self.notifier.created(approval)
        await self.refresh_gauge()
        return approval, True

    async def forget(self, approval: Approval) -> None:
        """Unbind a spent approval (expired, or denied past its TTL) so the same call can ask
        again. The record itself stays listed until the store expires it."""
        key = approval.binding.key
        await self.store.cas(NS_BY_CALL, key, approval.id.encode(), b"", ttl=1.0)
        if approval.state in ("pending", "approved"):
            await self._transition(approval.id, lambda a: replace(a, state="expired")
                                   if a.state in ("pending", "approved") else a)

    async def _transition(self, approval_id: str, change: Callable[[Approval], Approval]) -> Approval:
        """Apply `change` to the stored record with compare-and-set; returns the record as
        stored afterwards. `change` may raise ApprovalError, or return its argument unchanged."""
        for _ in range(_CAS_ATTEMPTS):
            raw = await self.store.get(NS_APPROVAL, approval_id)
            if raw is None:
                raise ApprovalNotFound(f"no approval {approval_id}")
            current = Approval.decode(raw)
            updated = change(current)
            if updated == current:
                return current
            if await self.store.cas(NS_APPROVAL, approval_id, raw, updated.encode(),
                                    ttl=self._store_ttl(updated)):
                return updated
        raise ApprovalConflict(f"approval {approval_id} is changing under heavy contention; try again")

    async def decide(
        self, approval_id: str, *, approver: str, approve: bool, reason: str,
        grant: GrantRequest | None = None,
    ) -> tuple[Approval, Grant | None]:
        """Approve or deny a pending approval (with an optional grant when approving).

        Raises ApprovalNotFound, SelfApproval (the approver made the call), ApprovalConflict
        (no longer pending: decided, consumed or expired), StoreError.
        """
        now = self.clock()
        grant_obj: Grant | None = None

        def change(current: Approval) -> Approval:
            nonlocal grant_obj
            if current.principal == approver:
                raise SelfApproval(f"{approver} cannot decide a call made by {approver}")
            state = current.effective_state(now)
            if state != "pending":
                raise ApprovalConflict(f"approval {approval_id} is {state}, not pending")
            if approve and grant is not None:
                grant_obj = Grant(
                    id=f"grt-{secrets.token_hex(8)}", scope=grant.scope, principal=current.principal,
                    upstream=current.upstream, tool=current.tool,
                    run=current.run if grant.scope == "run" else None, args=dict(grant.args),
                    approver=approver, reason=reason, approval_id=current.id,
                    created_at=now, expires_at=now + grant.duration,
                )
            return replace(
                current, state="approved" if approve else "denied", approver=approver,
                decision_reason=reason, decided_at=now,
                grant_id=grant_obj.id if grant_obj is not None else None,
            )

        decided = await self._transition(approval_id, change)
        if grant_obj is not None:
            await self.store.put(NS_GRANT, grant_obj.id, grant_obj.encode(), ttl=grant_obj.expires_at - now)
        log.info("approval %s %s by %s: %s%s", approval_id, decided.state, approver, reason,
                 f" (grant {grant_obj.id}, scope {grant_obj.scope})" if grant_obj else "")
        if self.notifier is not None:
            self.notifier.decided(approval_id)
        await self.refresh_gauge()
        return decided, grant_obj

    async def consume(self, approval: Approval) -> bool:
        """Spend an approved approval: approved -> consumed, atomically. True for exactly one
        caller; False when another caller consumed it first (or it changed meanwhile)."""
        if approval.effective_state(self.clock()) != "approved":
            return False
        consumed = replace(approval, state="consumed", consumed_at=self.clock())
        ok = await self.store.cas(NS_APPROVAL, approval.id, approval.encode(), consumed.encode(),
                                  ttl=self._store_ttl(consumed))
        return ok

    async def refresh_gauge(self) -> None:
        """`refresh_pending`, never raising (a gauge never fails a decision)."""
        if self.metrics is None:
            return
        try:
            await self.refresh_pending()
        except Exception as exc:  # a gauge never fails a decision
            log.debug("could not refresh the pending approvals gauge: %s", exc)


# -- in-band approval state (2026-07-28 input_required) ----------------------------------------


class InvalidRequestState(ApprovalError):
    """A `requestState` the proxy did not mint, for another call or approval, or expired."""

    status = 400


STATE_PREFIX = "envelope1."
_PROCESS_SECRET = secrets.token_bytes(32)


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
    (`approvals.in_band_secret_env`) or a random one for this process.
    """

    def __init__(self, secret: bytes | None = None, ttl: float = 600.0,
                 clock: Callable[[], float] = time.time):
        self._secret = secret or _PROCESS_SECRET
        self.ttl = ttl
        self.clock = clock

    @classmethod
    def from_config(cls, config: ApprovalsConfig) -> RequestStateSigner:
        secret: bytes | None = None
        if config.in_band_secret_env:
            value = os.environ.get(config.in_band_secret_env, "")
            if value:
                secret = value.encode()
            else:
                log.warning("approvals.in_band_secret_env: environment variable %s is not set; "
                            "in-band approval state is signed with a per-process secret",
                            config.in_band_secret_env)
        return cls(secret, config.in_band_state_ttl)

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
