"""The running proxy: wires policy, envelope, audit, metrics, fronts and listeners together.

Lifecycle (uvicorn-style, logged): load policy (refuse to start on errors), open the audit log,
start listeners; on SIGHUP or a policy file change build a whole new chain and swap it; on
SIGTERM/SIGINT stop accepting, let in-flight calls finish within `shutdown_grace`, close the
upstream pool, flush and close the audit log. A second signal (a fifth of a second or more
later) exits at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from proxy.admin.app import build_admin_app
from proxy.admin.protect import admin_hosts
from proxy.app.fast_listener import FastListener
from proxy.app.listener import ListenerRunner
from proxy.approvals.approvers import Approvers
from proxy.approvals.notifier import ApprovalNotifier
from proxy.approvals.service import ApprovalService
from proxy.approvals.signer import RequestStateSigner
from proxy.audit.anchor import HeadPublisher
from proxy.audit.log import AuditLog
from proxy.config import Config
from proxy.envelope.dataflow import fingerprint
from proxy.envelope.pipeline import Chain, Envelope
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Services
from proxy.errors import AuditError, ConfigError, ListenError, PolicyError, StoreError
from proxy.fronts.aggregate import AggregateFront
from proxy.fronts.context import FrontContext, FrontSettings
from proxy.fronts.forwarded import UpstreamTarget
from proxy.fronts.guard import LOOPBACK_HOSTS, Guard, GuardSettings, missing_host
from proxy.fronts.http_front import HttpFront
from proxy.fronts.per_upstream import McpFront
from proxy.identity import Identity
from proxy.observability import logs, tracing
from proxy.observability.metrics import Metrics
from proxy.policy.cel import Engine
from proxy.policy.compiled import PolicyRevision
from proxy.policy.loader import load_policy
from proxy.policy.reload import (
    Collector,
    Fingerprint,
    PolicyWatcher,
    load_stable,
    load_stable_at,
    lower_priority,
    responsive_loop,
)
from proxy.store.base import Store
from proxy.store.factory import open_store
from proxy.tools.replay import open_recorder
from proxy.upstream.forwarder import Forwarder
from proxy.upstream.health import HealthProber, ProbeTarget, UpstreamHealth
from proxy.upstream.stdio import PRINCIPAL_HEADER, Siblings, StdioSpec, StdioUpstreams
from proxy.upstream.transport import FastForwarder
from proxy.upstream.urls import strip_credentials

log = logging.getLogger("envelope")
# A stop signal repeated within this many seconds is the same stop delivered twice, not an
# operator's second signal (which exits at once).
SIGNAL_ECHO_SECONDS = 0.2


class Runtime:
    """One process's proxy: state, listeners and lifecycle."""

    def __init__(self, config: Config, worker: int = 0, in_band_secret: bytes | None = None,
                 stdio_endpoint: tuple[socket.socket, frozenset[int]] | None = None):
        self.config = config
        self.worker = worker
        self.registry = ToolRegistry()
        self.metrics = Metrics()
        audit_name = "audit" if config.workers == 1 else f"audit-w{worker}"
        self.audit = AuditLog(config.audit_dir, name=audit_name, fsync=config.audit.fsync,
                              max_bytes=config.audit.max_bytes,
                              rotate_interval=config.audit.rotate_interval)
        self.heads = HeadPublisher(self.audit)
        self._head_publisher: asyncio.Task[None] | None = None
        self.store: Store | None = open_store(config)
        self.store_error: str | None = None  # last store ping failure (readiness)
        self._store_pinger: asyncio.Task[None] | None = None
        # The approval gate: a process-local notifier (webhook, early wake-up of held calls) for
        # the check, and the service the admin API decides through; they agree through the store.
        self.approval_notifier = ApprovalNotifier(config.approvals.webhook, self.metrics,
                                                  review_url=config.approvals.review_url)
        self.approvals: ApprovalService | None = (
            ApprovalService(self.store, config.approvals, self.approval_notifier, self.metrics)
            if self.store is not None and config.approvals.enabled else None
        )
        self.approvers = Approvers(config.approvals)
        self._approvals_gauge: asyncio.Task[None] | None = None
        # One in-band approval signer for the process: every policy revision's approval check
        # shares it, so a state handed to a client before a reload still opens after it; with
        # several workers, `in_band_secret` is the one their supervisor drew for all of them (the
        # client's retry lands on any worker).
        self.signer = RequestStateSigner.from_config(config.approvals, in_band_secret)
        # The stdio endpoints of the workers of one serve: each on the socket its supervisor
        # bound, sharing a secret (derived from the signer's, which they share), so each hands
        # the others the requests of sessions it holds (`StdioUpstreams._peer`).
        self._stdio_siblings = None if stdio_endpoint is None or in_band_secret is None else Siblings(
            self.signer.derive(b"stdio endpoint").hex(), *stdio_endpoint)
        self.services = Services(store=self.store, settings=config, metrics=self.metrics,
                                 notifier=self.approval_notifier, signer=self.signer,
                                 approvals=self.approvals)
        self.envelope = Envelope(self.audit, self.metrics, self.registry, self.services)
        self.envelope.recorder = open_recorder(config, worker, self.metrics.registry)
        self.identity = Identity(config.identity)
        limits = config.limits
        self.forwarder: Forwarder = (
            FastForwarder(limits.max_upstream_connections,
                          stream_limit_per_host=limits.max_upstream_streams)
            if config.transport == "fast" else
            Forwarder(limits.max_upstream_connections, limits.max_upstream_streams))
        self.revision: PolicyRevision | None = None
        # The CEL engine, resolved from `config.cel_engine` by the first load and kept: every
        # later revision is compiled with the same engine object.
        self.cel: Engine | None = None
        self._targets: dict[str, UpstreamTarget] = {}
        self.last_reload: dict[str, Any] = {}
        self._reload_lock = asyncio.Lock()
        # Reloads load and build in a thread of their own, at a lower CPU priority than the loop.
        self._reloader = ThreadPoolExecutor(1, "policy-reload", initializer=lower_priority)
        # Off by default; `serve` freezes the first revision and then each reloaded one.
        self.collector = Collector()
        self._runners: list[web.AppRunner | FastListener] = []
        self._watcher: PolicyWatcher | None = None
        # The files `load_policy` loaded: the watcher's baseline, so that an edit made while the
        # process was starting (after the load, before the watcher) is reloaded, not missed.
        self._loaded_from: Fingerprint | None = None
        self._stop = asyncio.Event()
        self.urls: dict[str, str] = {}
        self.mcp_port = 0  # the MCP listener's bound port, once started
        self.health = UpstreamHealth(down_after=config.health_down_after,
                                     on_change=self.metrics.set_upstreams_up)
        self._prober = HealthProber(
            self.health, self.forwarder,
            lambda: [ProbeTarget(n, t.url, http=self.revision is not None and n in self.revision.specs)
                     for n, t in self._targets.items() if self._probed(n)],
            interval=config.health_interval, timeout=config.health_timeout,
        )
        self.fronts: FrontContext | None = None
        # Command upstreams: made once the policy names one (it binds a loopback socket).
        self.stdio: StdioUpstreams | None = None
        self._stdio_started = False
        self._commands: dict[str, str] = {}  # stdio upstream -> its program, as shown

    def _probed(self, upstream: str) -> bool:
        # A stdio upstream's health is its children's (StdioUpstreams reports it), not a probe's.
        if upstream in self._commands:
            return False
        return self.config.health_upstreams is None or upstream in self.config.health_upstreams

    def _stdio_health(self, name: str, ok: bool, error: str | None) -> None:
        if ok:
            self.health.record(name, "ok", source="process")
        else:
            self.health.mark_down(name, error or "stdio child failed")

    async def _start_stdio(self) -> None:
        if self.stdio is not None and not self._stdio_started:
            self._stdio_started = True
            await self.stdio.start()

    def _shown_url(self, name: str) -> str | None:
        if name in self._commands:
            return f"stdio:{self._commands[name]}"
        return strip_credentials(self._targets[name].url) if name in self._targets else None

    # ---- policy ------------------------------------------------------------------------

    def load_policy(self, *, freeze: bool = False) -> PolicyRevision:
        """Load and install the policy; raises PolicyError (nothing changes then). `freeze`:
        the start-up load of a process that keeps it for life (`load_policy`'s `freeze`)."""
        engine = self._engine()
        revision, self._loaded_from = load_stable_at(
            self.config.policies, lambda d: load_policy(d, engine=engine, freeze=freeze))
        self.cel = revision.cel
        self._install(revision)
        self.metrics.loaded()
        return revision

    def _engine(self) -> Engine | str:
        """The engine to compile with: the one kept, else the configured name (first load)."""
        return self.cel if self.cel is not None else self.config.cel_engine

    def _install(self, revision: PolicyRevision, chain: Chain | None = None) -> None:
        targets: dict[str, UpstreamTarget] = {}
        specs: dict[str, StdioSpec] = {}
        for name, up in revision.document.upstreams.items():
            source = self.config.upstreams.get(name) or up  # the runtime config's entry wins
            url, headers = source.url, dict(up.headers)
            principal_header: str | None = None
            if source.command is not None:
                # Served by StdioUpstreams' loopback endpoint: an HTTP upstream like any other.
                share = source.max_processes_per_principal
                if share is None and self.config.identity.mode == "static":
                    share = source.max_processes  # one principal there is: its share is the pool
                specs[name] = StdioSpec(name, tuple(source.command), tuple(sorted(source.env.items())),
                                        source.cwd, source.max_processes, source.idle_timeout, share)
                if self.stdio is None:
                    self.stdio = StdioUpstreams(self.config.limits.max_upstream_event_bytes,
                                                on_health=self._stdio_health,
                                                on_processes=self.metrics.set_stdio_processes,
                                                siblings=self._stdio_siblings, forwarder=self.forwarder)
                url, headers = self.stdio.url(name), self.stdio.headers
                principal_header = PRINCIPAL_HEADER
            assert url is not None  # exactly one of url / command (model validators)
            targets[name] = UpstreamTarget(
                name=name, url=url, timeout=up.timeout,
                connect_timeout=up.connect_timeout, headers=headers,
                forward_authorization=up.forward_authorization, principal_header=principal_header,
            )
        self.envelope.install(revision, chain)
        if self.stdio is not None:
            self.stdio.configure(specs)
        self._commands = {n: s.command[0] for n, s in specs.items()}
        self._targets = targets  # swapped together with the chain
        for name, spec in revision.specs.items():  # operations an HTTP upstream cannot offer
            for skipped in spec.problems:
                log.warning("upstream %s: %s", name, skipped)
        self.health.sync(targets)
        self.revision = revision
        self.metrics.set_revision(revision.revision)

    def _prepare(self, engine: Engine | str) -> tuple[PolicyRevision, Chain]:
        """In the reload's worker thread: the new revision and its chain, built off the event
        loop (the loop then only swaps them in)."""
        with self.collector.loading():
            revision = load_stable(self.config.policies, lambda d: load_policy(d, engine=engine))
            return revision, self.envelope.build(revision)

    async def reload(self, trigger: str = "change") -> bool:
        """Build a whole new chain from the policy directory and swap it in; keep the old on error."""
        async with self._reload_lock:
            started = time.time()
            try:
                with responsive_loop():
                    revision, chain = await asyncio.get_running_loop().run_in_executor(
                        self._reloader, self._prepare, self._engine())
            except PolicyError as exc:
                errors = [str(p) for p in exc.problems]
                self.metrics.reload("failure")
                self.last_reload = {"result": "failure", "at": started, "trigger": trigger, "errors": errors}
                log.error("policy reload rejected (%s); still serving revision %s:\n  %s", trigger,
                          self.revision.revision if self.revision else "none", logs.multiline("\n  ".join(errors)))
                return False
            except Exception as exc:  # a bug in loading must never take the old policy down
                self.metrics.reload("failure")
                self.last_reload = {"result": "failure", "at": started, "trigger": trigger, "errors": [repr(exc)]}
                log.exception("policy reload failed unexpectedly")
                return False
            self.cel = revision.cel
            self._install(revision, chain)
            if self._runners:  # started: a command upstream new in this revision is served now
                await self._start_stdio()
            self.metrics.reload("success")
            self.last_reload = {"result": "success", "at": started, "trigger": trigger, "errors": []}
            log.info("policy revision %s loaded (%s, %d tools)", revision.revision, trigger, len(revision.tools))
            return True

    def target(self, name: str) -> UpstreamTarget | None:
        return self._targets.get(name)

    def request_headers(self) -> tuple[str, ...]:
        rev = self.revision
        return tuple(rev.document.defaults.request_headers) if rev else ()

    # ---- status for the admin listener ---------------------------------------------------

    async def _ping_store(self, interval: float = 2.0) -> None:
        """Keep `store_error` current for /readyz (readiness is read synchronously)."""
        assert self.store is not None
        while True:
            try:
                async with asyncio.timeout(self.config.store.timeout):
                    await self.store.ping()
            except (StoreError, TimeoutError) as exc:
                if self.store_error is None:
                    log.error("state store (%s) unavailable: %s", self.store.kind, exc or "timeout")
                self.store_error = str(exc) or "timed out"
            else:
                if self.store_error is not None:
                    log.info("state store (%s) available again", self.store.kind)
                self.store_error = None
            await asyncio.sleep(interval)

    async def _refresh_approvals_gauge(self, interval: float = 5.0) -> None:
        """Keep `envelope_approvals_pending` current as approvals expire (decisions refresh it
        at once)."""
        assert self.approvals is not None
        while True:
            try:
                await self.approvals.refresh_pending()
            except Exception as exc:  # the gauge is best effort; calls fail closed on their own
                log.debug("pending approvals gauge not refreshed: %s", exc)
            await asyncio.sleep(interval)

    def readiness(self) -> list[str]:
        reasons = []
        if self.revision is None:
            reasons.append("no policy loaded")
        if self.store_error is not None:
            reasons.append(f"state store ({self.config.store.kind}) unavailable: {self.store_error}")
        if not self.audit.check_writable():
            reasons.append(f"audit log not writable: {self.audit.last_error}")
        return reasons

    def upstream_summary(self) -> dict[str, dict[str, Any]]:
        """Per-upstream state and last error, for `/readyz` (never a readiness reason)."""
        return self.health.summary()

    def upstream_status(self) -> dict[str, dict[str, Any]]:
        """Per-upstream health in full, for `/v1/upstreams`."""
        return {name: {**state, "url": self._shown_url(name)}
                for name, state in self.health.snapshot().items()}

    def aggregate_upstreams(self) -> list[str]:
        """The upstreams behind `/mcp`: the configured list, else every policy upstream."""
        return list(self.config.aggregate.upstreams) or sorted(self._targets)

    def policy_status(self) -> dict[str, Any]:
        rev = self.revision
        if rev is None:
            return {"revision": None, "last_reload": self.last_reload}
        return {
            "revision": rev.revision,
            "directory": str(rev.directory),
            "files": [str(f) for f in rev.files],
            "engine": rev.engine,
            "loaded_at": rev.loaded_at,
            "tools": sorted(rev.tools),
            "upstreams": {n: self._shown_url(n) for n in self._targets},
            "misconfigured": self.envelope.misconfig.as_json(),
            "last_reload": self.last_reload,
        }

    def misconfigurations(self) -> list[dict[str, Any]]:
        """Every tool that can never run and why (`GET /v1/misconfigurations`)."""
        return self.envelope.misconfig.as_json()

    # ---- listeners -----------------------------------------------------------------------

    def _allowed_hosts(self) -> frozenset[str]:
        host, _ = self.config.listen_addr
        names = set(LOOPBACK_HOSTS) | {h.lower() for h in self.config.allowed_hosts}
        if host not in ("0.0.0.0", "::"):
            names.add(host.lower())
        return frozenset(names)

    def build_mcp_app(self) -> web.Application:
        limits = self.config.limits
        self.fronts = context = FrontContext(
            self.envelope, self.forwarder, self.identity, self.target,
            FrontSettings(max_body_bytes=limits.max_body_bytes, max_json_depth=limits.max_json_depth,
                          request_headers=self.request_headers,
                          body_timeout=self.config.listener.header_timeout,
                          max_upstream_event_bytes=limits.max_upstream_event_bytes,
                          max_upstream_reply_bytes=limits.max_upstream_reply_bytes,
                          max_streams_per_principal=limits.max_streams_per_principal,
                          max_streams_per_upstream=limits.max_streams_per_upstream,
                          underscore_headers=self.config.listener.underscore_headers),
            retry=self.config.retry, on_upstream=self.health.record, store=self.store,
        )
        guard = Guard(
            GuardSettings(max_body_bytes=limits.max_body_bytes, allowed_hosts=self._allowed_hosts(),
                          allowed_origins=frozenset(self.config.allowed_origins),
                          reject_underscores=self.config.listener.underscore_headers == "reject"),
            self.envelope, self.metrics)
        # aiohttp's own body cap is bypassed by the front's streaming reader, which enforces ours.
        app = web.Application(client_max_size=limits.max_body_bytes)
        app.add_routes(McpFront(context).routes(guard))
        # Plain HTTP for upstreams with an OpenAPI document, through the same guard and envelope.
        app.add_routes(HttpFront(context).routes(guard))
        if self.config.aggregate.enabled:
            aggregate = AggregateFront(context, self.aggregate_upstreams,
                                       max_sessions=self.config.aggregate.max_sessions,
                                       max_sessions_per_principal=self.config.aggregate.max_sessions_per_principal,
                                       seal_key=self.signer.derive(b"aggregate upstream sessions"))
            app.add_routes(aggregate.routes(guard))
            app.on_shutdown.append(aggregate.shutdown)
        return app

    async def start(self, admin: bool = True,
                    mcp_middlewares: Sequence[Any] = ()) -> None:
        """Start listeners (policy must be loaded). `admin` false: no admin listener (the stdio
        front's default); `mcp_middlewares` wrap the MCP app (the stdio front's credential)."""
        tracing.configure()  # per process: a worker's exporter thread is its own
        if self.store is not None:
            self._store_pinger = asyncio.get_running_loop().create_task(self._ping_store())
        if self.approvals is not None:
            self._approvals_gauge = asyncio.get_running_loop().create_task(
                self._refresh_approvals_gauge())
        if self.config.audit.anchor_interval > 0:
            self._head_publisher = asyncio.get_running_loop().create_task(
                self.heads.run(self.config.audit.anchor_interval))
        if not self.audit.healthy:
            log.error("audit log %s is not writable (%s): every call will be refused until it is",
                      self.audit.path, self.audit.last_error)
        await self.forwarder.start()
        await self._start_stdio()
        self._prober.start()
        reuse = self.config.workers > 1
        host, port = self.config.listen_addr
        listener = self.config.listener
        mcp_app = self.build_mcp_app()
        mcp_app.middlewares.extend(mcp_middlewares)
        def on_header_timeout() -> None:
            self.metrics.rejected("header_timeout")

        def on_bad_request() -> None:  # both listener kinds' parser refusals
            self.metrics.rejected("bad_request")

        where = f"the MCP listener cannot listen on {host}:{port}"
        setting = MCP_LISTEN_SETTING
        mcp_runner: web.AppRunner | FastListener
        if listener.kind == "fast":
            mcp_runner = fast = FastListener(mcp_app, header_timeout=listener.header_timeout,
                                             keepalive_timeout=listener.keepalive_timeout,
                                             on_header_timeout=on_header_timeout,
                                             on_bad_request=on_bad_request,
                                             shutdown_timeout=self.config.shutdown_grace)
            await fast.setup()
            self._runners.append(fast)  # before binding: a failed start still cleans it up
            await _bind(fast.start(host, port, reuse_port=reuse or None, backlog=1024),
                        where, setting)
        else:
            mcp_runner = aio = ListenerRunner(
                mcp_app, access_log=None, handler_cancellation=True,
                header_timeout=listener.header_timeout,
                keepalive_timeout=listener.keepalive_timeout, on_header_timeout=on_header_timeout,
                on_bad_request=on_bad_request,
                on_missing_host=functools.partial(missing_host, self.metrics),
                # aiohttp waits this long twice (for the handler, then again after cancelling
                # its body): half makes the whole grace.
                shutdown_timeout=self.config.shutdown_grace / 2)
            await aio.setup()
            self._runners.append(aio)  # before binding: a failed start still cleans it up
            await _bind(web.TCPSite(aio, host, port, reuse_port=reuse or None, backlog=1024).start(),
                        where, setting)
        port = _bound_port(mcp_runner, port)
        self.mcp_port = port
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.urls = {"mcp": f"http://{shown}:{port}/mcp/<upstream>"}
        if admin:
            await self._start_admin()
        if self.config.reload_interval > 0:
            async def on_change() -> None:
                await self.reload("change")

            self._watcher = PolicyWatcher(self.config.policies, on_change,
                                          interval=self.config.reload_interval)
            self._watcher.start(baseline=self._loaded_from)

    async def _start_admin(self) -> None:
        listener = self.config.listener
        ahost, aport = self.config.admin_addr
        admin_app = build_admin_app(self, self.metrics,
                                    admin_hosts(ahost, self.config.admin_allowed_hosts),
                                    body_timeout=listener.header_timeout)
        admin_runner = ListenerRunner(admin_app, access_log=None,
                                      header_timeout=listener.header_timeout,
                                      keepalive_timeout=listener.keepalive_timeout,
                                      on_bad_request=functools.partial(
                                          self.metrics.admin_rejected, "bad_request"))
        await admin_runner.setup()
        self._runners.append(admin_runner)
        aport = aport + self.worker if aport else 0
        await _bind(web.TCPSite(admin_runner, ahost, aport).start(),
                    f"the admin listener cannot listen on {ahost}:{aport}",
                    "--admin, ENVELOPE_ADMIN or `admin:` in the config file")
        aport = _bound_port(admin_runner, aport)
        if not self.approval_notifier.review_url:
            shown_admin = "127.0.0.1" if ahost in ("0.0.0.0", "::") else ahost
            self.approval_notifier.review_url = f"http://{shown_admin}:{aport}"
        ashown = "127.0.0.1" if ahost in ("0.0.0.0", "::") else ahost
        self.urls["admin"] = f"http://{ashown}:{aport}"
        self.urls["metrics"] = f"http://{ashown}:{aport}/metrics"

    async def stop(self, quiet: bool = False) -> None:
        """Ordered shutdown: stop accepting, drain, close upstream pool, close the audit log.

        `quiet`: after a failed start, where the one-line reason is all the operator needs."""
        if not quiet:
            log.info("shutting down: no new connections; draining in-flight calls (up to %gs)",
                     self.config.shutdown_grace)
        if self._watcher is not None:
            await self._watcher.stop()
        await self._prober.stop()
        self._reloader.shutdown(wait=False)  # a reload under way finishes, never installed
        if self.fronts is not None:
            self.fronts.shutting_down = True  # calls cut off from here on say so
        self.approval_notifier.stop_holding()  # held calls end now, refused pending, audited
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self.fronts is not None:
            await self.fronts.close()  # completions (their audit records), then notifications
        if self.stdio is not None:
            await self.stdio.close()  # every child: stdin closed, then SIGTERM, then SIGKILL
        await self.forwarder.close()
        if self._store_pinger is not None:
            self._store_pinger.cancel()
        if self._approvals_gauge is not None:
            self._approvals_gauge.cancel()
        await self.approval_notifier.close()
        if self.store is not None:
            await self.store.close()
        if self._head_publisher is not None:
            self._head_publisher.cancel()
            self.heads.publish()  # the final head: every record this process wrote
        self.audit.close()
        if self.envelope.recorder is not None:
            self.envelope.recorder.close()
        await asyncio.to_thread(tracing.shutdown)  # the last spans out (a bounded wait)
        if not quiet:
            log.info("shutdown complete: store closed, audit log flushed and closed")

    async def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then shut down gracefully; a second signal more than
        `SIGNAL_ECHO_SECONDS` after the first exits at once (one sooner is the same stop reaching
        this worker twice: from its process group and from `serve --workers`' supervisor)."""
        loop = asyncio.get_running_loop()
        first: float | None = None

        def on_term() -> None:
            nonlocal first
            now = time.monotonic()
            if first is None:
                first = now
            elif now - first > SIGNAL_ECHO_SECONDS:
                # The calls still with their upstreams get their record first: one each.
                abandoned = self.envelope.abandon("the proxy was stopped at once (a second signal) "
                                                  "before the upstream answered; the outcome is unknown")
                log.warning("second signal: exiting now (%d in-flight calls recorded as abandoned)", abandoned)
                os._exit(1)
            self._stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_term)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload("SIGHUP")))
        await self._stop.wait()
        await self.stop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    def request_stop(self) -> None:
        self._stop.set()


# The settings that move each listener, named in the error of a listener that cannot bind.
MCP_LISTEN_SETTING = "--listen, ENVELOPE_LISTEN or `listen:` in the config file"


def listen_error(what: str, exc: OSError, setting: str) -> ListenError:
    """The one-line error of a listener that cannot bind: the address, the reason, the setting."""
    reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
    return ListenError(f"{what}: {reason}; choose another address with {setting}")


async def _bind(start: Awaitable[None], what: str, setting: str) -> None:
    """Await `start` (a listener binding); ListenError naming the address and the setting that
    changes it."""
    try:
        await start
    except OSError as exc:
        raise listen_error(what, exc, setting) from exc


def _bound_port(runner: web.AppRunner | FastListener, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback


async def serve(config: Config, worker: int = 0, announce: bool = True,
                banner: Sequence[str] = (), in_band_secret: bytes | None = None,
                stdio_endpoint: tuple[socket.socket, frozenset[int]] | None = None) -> int:
    """Run one proxy process until signalled. Returns the exit status: 2 when the policy is
    invalid, the runtime cannot be set up (an identity key file, the audit log) or a listener
    cannot bind (one line on stderr), 0 after a graceful shutdown.
    `banner`: lines printed after the URLs, once every listener is up; `in_band_secret`: the
    in-band approval secret the workers of one serve share (None: a random one of its own);
    `stdio_endpoint`: this worker's stdio endpoint socket and every worker's endpoint port (the
    supervisor bound them; None: one process, a port of its own)."""
    try:
        runtime = Runtime(config, worker, in_band_secret, stdio_endpoint)
    except (ConfigError, AuditError) as exc:
        # A key file not there, an audit log another proxy writes (a demo left running on the
        # same state directory): the operator's to fix, said in one line, not a traceback.
        print(f"envelope-proxy: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        revision = runtime.load_policy(freeze=True)
    except PolicyError as exc:
        for problem in exc.problems:
            log.error("%s", problem)
        log.error("policy directory %s is invalid: not starting", config.policies)
        return 2
    # Everything alive now (the compiled policy, its caches: ~700,000 objects for 1,000 tools)
    # lives for the process: out of the collector's sight, a full collection (which a reload's
    # allocations trigger, holding the GIL) takes milliseconds instead of ~0.5 s of stalled calls.
    # Each reloaded revision is frozen the same way (`Collector`). The start-up load froze what
    # it made itself, without traversing it; the collector only takes over from here.
    runtime.collector.freeze(collect=False)
    log.debug("data-flow winnowing: %s, token scan: %s", fingerprint.WINNOW_IMPL, fingerprint.TOKENS_IMPL)
    try:
        await runtime.start()
    except ListenError as exc:
        # Close what start() opened (upstream sessions, store, audit) without a traceback:
        # a busy port is an operator's everyday mistake, not a crash.
        await runtime.stop(quiet=True)
        print(f"envelope-proxy: {exc}", file=sys.stderr, flush=True)
        return 2
    if announce and worker == 0:
        print(f"envelope-proxy {revision.revision} ({revision.engine}) ready", flush=True)
        probed = sorted(n for n in runtime._targets if runtime._probed(n))
        stdio = sorted(runtime._commands)
        unprobed = sorted(n for n in runtime._targets if not runtime._probed(n) and n not in stdio)
        shown = ", ".join(probed + [f"{n} (stdio)" for n in stdio]) or "none"
        if unprobed:
            shown += f"; placeholders, not probed: {', '.join(unprobed)}"
        print(f"  MCP      {runtime.urls['mcp']}  (upstreams: {shown})", flush=True)
        print(f"  admin    {runtime.urls['admin']}", flush=True)
        print(f"  metrics  {runtime.urls['metrics']}", flush=True)
        for line in banner:
            print(line, flush=True)
    await runtime.run_until_signalled()
    return 0
