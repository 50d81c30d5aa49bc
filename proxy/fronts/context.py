"""What both MCP fronts share: the envelope, the executor, identity, upstream targets, and the
catalogue's view of `tools/list`. Built once by the runtime; `/mcp/<upstream>`
(`proxy.fronts.per_upstream`) and the aggregated `/mcp` (`proxy.fronts.aggregate`) each hold it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from proxy.config import Limits, RetryConfig
from proxy.envelope.inspect import strip_envelope_meta
from proxy.envelope.pipeline import Envelope
from proxy.envelope.types import Principal
from proxy.errors import IdentityError, LimitExceeded
from proxy.fronts import jsonrpc
from proxy.fronts.forwarded import Executor, UpstreamTarget
from proxy.fronts.headers import UnderscoreAction
from proxy.fronts.streams import StreamBudget, StreamSlot
from proxy.observability.metrics import Metrics, UpstreamOutcome
from proxy.store.base import Store
from proxy.upstream.forwarder import Forwarder
from proxy.upstream.openapi import Spec

log = logging.getLogger("envelope.mcp")

# Seconds a client refused a GET stream is asked to wait (`Retry-After`) before it tries again.
STREAM_RETRY_AFTER = 5


class Identity(Protocol):
    """Resolves the verified principal of a request (see `proxy.identity`)."""

    def resolve(self, headers: Mapping[str, str]) -> Principal: ...


@dataclass(frozen=True, slots=True)
class FrontSettings:
    max_body_bytes: int
    max_json_depth: int
    request_headers: Callable[[], tuple[str, ...]]  # policy-selected headers visible to CEL
    # Seconds a request body has to arrive whole once its head has (`listener.header_timeout`:
    # 408 and the connection closed otherwise; `proxy.fronts.guard.read_body`).
    body_timeout: float = 10.0
    # What an upstream may send, and the GET streams a client may hold (see `config.Limits`).
    max_upstream_event_bytes: int = Limits().max_upstream_event_bytes
    max_upstream_reply_bytes: int = Limits().max_upstream_reply_bytes
    max_streams_per_principal: int = Limits().max_streams_per_principal
    max_streams_per_upstream: int = Limits().max_streams_per_upstream
    # Request headers whose name holds `_`: not forwarded (`drop`), or forwarded (`allow`);
    # `reject` is the guard's (`proxy.fronts.headers`).
    underscore_headers: UnderscoreAction = "drop"


@dataclass(slots=True)
class FrontContext:
    """The pieces every MCP route uses (see the module docstring)."""

    envelope: Envelope
    forwarder: Forwarder
    identity: Identity
    targets: Callable[[str], UpstreamTarget | None]
    settings: FrontSettings
    retry: RetryConfig = field(default_factory=RetryConfig)
    # The state store (None: none configured): sessions' owners are kept there for every worker
    # and replica (`proxy.fronts.sessions.SharedOwners`).
    store: Store | None = None
    # Told every upstream request outcome (proxy.upstream.health.UpstreamHealth.record).
    on_upstream: Callable[[str, UpstreamOutcome, str | None], None] | None = None
    # Fire-and-forget upstream requests (cancellations, session ends), tracked for shutdown.
    background: set[asyncio.Task[None]] = field(default_factory=set)
    shutting_down: bool = False
    executor: Executor = field(init=False)
    # The GET streams open on every route, per principal and upstream.
    streams: StreamBudget = field(init=False)

    def __post_init__(self) -> None:
        settings = self.settings
        self.executor = Executor(self.envelope, self.forwarder, self.observe, self.retry,
                                 self.spawn, lambda: self.shutting_down,
                                 max_event_bytes=settings.max_upstream_event_bytes,
                                 max_reply_bytes=settings.max_upstream_reply_bytes)
        self.streams = StreamBudget(settings.max_streams_per_principal,
                                    settings.max_streams_per_upstream)

    @property
    def metrics(self) -> Metrics:
        return self.envelope.metrics

    def observe(self, upstream: str, seconds: float, outcome: UpstreamOutcome,
                error: str | None = None) -> None:
        """Count one upstream request and tell the health tracker (if any) its outcome."""
        self.metrics.observe_upstream(upstream, seconds, outcome)
        if self.on_upstream is not None:
            self.on_upstream(upstream, outcome, error)

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run `coro` in the background, tracked so shutdown waits for it."""
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self, grace: float = 2.0) -> None:
        """Let completions and background notifications finish (bounded), then drop them."""
        await self.envelope.drain(grace)
        if self.background:
            await asyncio.wait(set(self.background), timeout=grace)
        for task in self.background:
            task.cancel()

    def authenticate(self, request: web.Request) -> Principal | web.Response:
        """The verified principal, or the 401 to send (identity headers are never trusted)."""
        try:
            return self.identity.resolve(request.headers)
        except IdentityError as exc:
            self.metrics.rejected("unauthenticated")
            return web.Response(
                status=401, body=jsonrpc.error_body(None, jsonrpc.INVALID_REQUEST, f"Unauthorized: {exc}"),
                content_type="application/json", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )

    def take_streams(self, principal: Principal, upstreams: Sequence[str]) -> StreamSlot | web.Response:
        """Slots for a GET stream to each of `upstreams`, or the 503 to send (the limit named);
        the caller releases the slot in a `finally`."""
        try:
            return self.streams.take(principal.id, upstreams)
        except LimitExceeded as exc:
            return self.busy(str(exc))

    def busy(self, reason: str) -> web.Response:
        """The answer to a GET stream refused by a streams' budget (front or transport)."""
        self.metrics.rejected("too_many_streams")
        return web.Response(
            status=503, body=jsonrpc.error_body(None, jsonrpc.INTERNAL_ERROR, f"Service Unavailable: {reason}"),
            content_type="application/json", headers={"Retry-After": str(STREAM_RETRY_AFTER)},
        )

    def spec(self, upstream: str) -> Spec | None:
        """The OpenAPI document of an HTTP upstream in the current revision (None: MCP)."""
        chain = self.envelope.chain
        return chain.revision.specs.get(upstream) if chain is not None else None

    def filter_tools(self, result: Any, upstream: str, principal: Principal,
                     learn: bool = True) -> Any:
        """A `tools/list` result as this principal sees it: learned into the registry (schemas
        and annotations; not with `learn=False`, for a list the proxy built from the registry's
        own source, an OpenAPI document), forged `envelope/*` meta removed, tools it may never
        call hidden."""
        if not isinstance(result, dict) or not isinstance(result.get("tools"), list):
            return result
        strip_envelope_meta(result)
        envelope = self.envelope
        if learn:
            envelope.registry.learn(upstream, result["tools"])
            envelope.refresh_catalogue_metrics()
        chain = envelope.chain
        if chain is None:
            visible: list[Any] = []
        else:
            visible = [
                t for t in result["tools"]
                if isinstance(t, dict) and isinstance(t.get("name"), str)
                and chain.visible(principal, upstream, t["name"])
            ]
        return {**result, "tools": visible}
