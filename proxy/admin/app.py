"""The admin listener: health, readiness, metrics and policy status.

Served on its own port, never on the proxy listener. Readiness fails closed: a provider
that raises makes the proxy unready, with the error as the reason. Every route sits behind
one Host check (`proxy.admin.protect.host_guard`: 421 for a name that is not loopback, the
listen address or configured); `/healthz`, `/readyz`, `/metrics` and the review page's files
are open, every `/v1/` route but `/v1/misconfigurations` needs an approver token (see
`proxy.admin.review`), and upstream URLs are shown without credentials (the provider strips
them with `proxy.upstream.urls.strip_credentials`). `/v1/audit/head` serves this process's
audit chain head (`proxy.audit.anchor`; 503 while the log is not writable): with several
workers each worker's admin listener serves its own chain.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import orjson
from aiohttp import web

from proxy.admin.protect import (
    BODY_TIMEOUT,
    DEFAULT_BODY_TIMEOUT,
    LOOPBACK_HOSTS,
    expect,
    host_guard,
    routing_refusal,
)
from proxy.errors import AuditError
from proxy.observability.metrics import Metrics

_JSON = "application/json"
_NO_STORE = {"Cache-Control": "no-store"}


class StatusProvider(Protocol):
    """What the admin API asks the running proxy."""

    def readiness(self) -> list[str]:
        """Reasons the proxy is not ready (e.g. "audit log not writable: ..."); [] if ready."""
        ...

    def policy_status(self) -> dict[str, Any]:
        """The served policy: revision, load time, misconfiguration report (JSON types)."""
        ...


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type=_JSON, headers=_NO_STORE
    )


def build_admin_app(status: StatusProvider, metrics: Metrics,
                    allowed_hosts: frozenset[str] = LOOPBACK_HOSTS,
                    body_timeout: float = DEFAULT_BODY_TIMEOUT) -> web.Application:
    """The admin `web.Application`: GET /healthz, /readyz, /metrics, /v1/policy (+ /v1/upstreams,
    /v1/misconfigurations, /v1/audit/head when the provider has them), answering only requests
    whose Host is in `allowed_hosts` (see `proxy.admin.protect.admin_hosts`); a POST's body must
    arrive within `body_timeout` seconds (`listener.header_timeout`; 408 otherwise)."""

    async def healthz(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        try:
            reasons = list(status.readiness())
        except Exception as e:  # fail closed: an unknown state is not ready
            reasons = [f"readiness check failed: {type(e).__name__}: {e}"]
        # Upstream health is shown, never a reason: one down upstream leaves the others serving,
        # and restarting the proxy would not bring it back.
        body: dict[str, Any] = {"ready": not reasons}
        if reasons:
            body["reasons"] = reasons
        summary = getattr(status, "upstream_summary", None)
        if summary is not None:
            try:
                body["upstreams"] = summary()
            except Exception as e:
                body["upstreams_error"] = f"{type(e).__name__}: {e}"
        return _json(body, status=503 if reasons else 200)

    async def metrics_handler(request: web.Request) -> web.Response:
        # Rendering many series takes milliseconds: keep it off the proxy's event loop.
        body, content_type = await asyncio.to_thread(metrics.render)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def policy(request: web.Request) -> web.Response:
        try:
            data = status.policy_status()
        except Exception as e:
            return _json({"error": f"{type(e).__name__}: {e}"}, status=500)
        return _json(data)

    @web.middleware
    async def count_refusals(request: web.Request, handler: Any) -> web.StreamResponse:
        # Every 421 (Host) and 401 (approver token) of every route, whichever guard answered:
        # a token being guessed, or a rebound name, shows in the metrics. aiohttp's own 404
        # (no such route) and 405 (no such method) are answered in the admin API's JSON and
        # counted too: routes being probed show as well.
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPException as exc:
            refused = routing_refusal(request, exc)
            if refused is None:
                raise
            metrics.admin_rejected("not_found" if refused.status == 404 else "method_not_allowed")
            return refused
        if response.status == 421:
            metrics.admin_rejected("bad_host")
        elif response.status == 401:
            metrics.admin_rejected("unauthenticated")
        elif response.status == 408:  # only `protect.read_body` answers it
            metrics.admin_rejected("body_timeout")
        return response

    # The Host check runs first, for every route (the review page's token guard comes after).
    app = web.Application(middlewares=[count_refusals, host_guard(allowed_hosts)])
    app[BODY_TIMEOUT] = body_timeout
    app.router.add_get("/healthz", healthz, expect_handler=expect)
    app.router.add_get("/readyz", readyz, expect_handler=expect)
    app.router.add_get("/metrics", metrics_handler, expect_handler=expect)
    app.router.add_get("/v1/policy", policy, expect_handler=expect)
    misconfigurations = getattr(status, "misconfigurations", None)
    if misconfigurations is not None:
        async def misconfigured(request: web.Request) -> web.Response:
            # The same objects the log lines, the gauge and `envelope-proxy check` show.
            try:
                return _json(misconfigurations())
            except Exception as e:
                return _json({"error": f"{type(e).__name__}: {e}"}, status=500)

        app.router.add_get("/v1/misconfigurations", misconfigured, expect_handler=expect)
    upstream_status = getattr(status, "upstream_status", None)
    if upstream_status is not None:
        async def upstreams(request: web.Request) -> web.Response:
            return _json({"upstreams": upstream_status()})

        app.router.add_get("/v1/upstreams", upstreams, expect_handler=expect)
    audit = getattr(status, "audit", None)
    if audit is not None:
        async def audit_head(request: web.Request) -> web.Response:
            # The writer's own head (never re-read from the file, which is what an anchor
            # guards); none while the log is not writable (`AuditLog.head`).
            try:
                return _json(audit.head())
            except AuditError as e:
                return _json({"error": str(e)}, status=503)

        app.router.add_get("/v1/audit/head", audit_head, expect_handler=expect)
    # The approvals API, when the provider runs an approval gate (see approvals_api).
    approvals = getattr(status, "approvals", None)
    if approvals is not None:
        from proxy.admin import approvals_api

        approvals_api.add_routes(app, approvals, status.approvers,  # type: ignore[attr-defined]
                                 getattr(status, "envelope", None))
    # Shadow records (GET /v1/shadow), read from the provider's state store.
    from proxy.admin.shadow_api import add_shadow_routes

    add_shadow_routes(app, status)
    # A run's intent (POST /v1/runs/{run}/intent), for the data-flow check's endorsement.
    from proxy.admin.intent_api import add_intent_routes

    add_intent_routes(app, status)
    # Releasing an idempotency key whose outcome is unknown (POST /v1/idempotency/{id}/release).
    from proxy.admin.idempotency_api import add_idempotency_routes

    add_idempotency_routes(app, status, metrics)
    # The review page, the decisions API and the approver-token guard of /v1/shadow (review).
    from proxy.admin.review import add_review_routes

    add_review_routes(app, status)
    return app
