"""The review page and the decisions API on the admin listener.

    GET /review                    the page (static HTML; its script asks for an approver token)
    GET /review/static/<file>      its script and stylesheet (no build step, no CDN)
    GET /v1/decisions?principal=&run=&upstream=&tool=&verdict=&code=&since=&until=&limit=&order=
                                   {"decisions": [...], "count": n}: audit records, newest first
                                   (order=oldest for oldest first); limit 1..1000, default 100;
                                   since/until: RFC 3339 or relative (15m, 2d)
    GET /v1/decisions/<decision id>  one audit record (404 when unknown)

Audit records and shadow records carry call arguments (`args` with `log_args`; shadow records
always), so `/v1/decisions*` and `/v1/shadow` need `Authorization: Bearer <approver token>` like
the approvals API (401 otherwise); so do `/v1/policy` and `/v1/upstreams` (they name the
upstreams and where they are, and show their health). `/v1/misconfigurations` (tools, principals
and reasons) stays open. The page itself embeds no data and no secret: everything it shows comes from
these APIs with the token the person typed, kept in the tab's sessionStorage.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from proxy.admin.approvals_api import unauthorized
from proxy.audit.query import parse_time, query_records

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_LIMIT = 1000
FILTERS = ("principal", "run", "upstream", "tool", "verdict", "code")

# The page loads only its own script and stylesheet and talks only to this listener.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
_STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# Routes outside this module that need an approver token too: argument-bearing (shadow), and
# those that describe the upstreams (policy status, upstream health).
PROTECTED_PREFIXES = ("/v1/shadow", "/v1/policy", "/v1/upstreams")


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store", **(headers or {})})


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def authenticate(status: Any, request: web.Request) -> str | None:
    """The approver's name for the request's bearer token, or None (no approvers: nobody)."""
    approvers = getattr(status, "approvers", None)
    if approvers is None:
        return None
    name: str | None = approvers.authenticate(_bearer(request))
    return name


def _parse_time(name: str, value: str | None) -> _dt.datetime | None:
    """RFC 3339 (naive: UTC) or a relative time back from now (`15m`, `2d`); None when absent."""
    if not value:
        return None
    try:
        return parse_time(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _audit_dir(status: Any) -> Path | None:
    config = getattr(status, "config", None)
    directory = getattr(config, "audit_dir", None)
    return Path(directory) if directory is not None else None


def add_review_routes(app: web.Application, status: Any) -> None:
    """Mount the page, its assets, the decisions API and the token guard of `/v1/shadow`."""

    @web.middleware
    async def guard(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.path.startswith(PROTECTED_PREFIXES) and authenticate(status, request) is None:
            return unauthorized(request)
        return await handler(request)

    app.middlewares.append(guard)

    async def page(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html",
                                headers={**PAGE_HEADERS, "Content-Type": _STATIC_TYPES[".html"]})

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        path = STATIC_DIR / name
        content_type = _STATIC_TYPES.get(path.suffix)
        # Only plain file names of known types from the static directory: no traversal.
        if ("/" in name or "\\" in name or name.startswith(".") or content_type is None
                or not path.is_file()):
            raise web.HTTPNotFound()
        return web.FileResponse(path, headers={**PAGE_HEADERS, "Content-Type": content_type})

    async def query(**filters: Any) -> list[dict[str, Any]] | web.Response:
        directory = _audit_dir(status)
        if directory is None:
            return _json({"error": "this proxy has no audit log to query"}, 503)
        try:
            return await asyncio.to_thread(query_records, directory, **filters)
        except ValueError as exc:
            return _json({"error": str(exc)}, 400)
        except OSError as exc:
            return _json({"error": f"the audit log cannot be read: {exc}"}, 503)

    async def decisions(request: web.Request) -> web.Response:
        if authenticate(status, request) is None:
            return unauthorized(request)
        q = request.query
        try:
            limit = int(q.get("limit", "100"))
        except ValueError:
            return _json({"error": "limit must be an integer"}, 400)
        if not 1 <= limit <= MAX_LIMIT:
            return _json({"error": f"limit must be between 1 and {MAX_LIMIT}"}, 400)
        order = q.get("order", "newest")
        if order not in ("newest", "oldest"):
            return _json({"error": "order must be newest or oldest"}, 400)
        try:
            since = _parse_time("since", q.get("since"))
            until = _parse_time("until", q.get("until"))
        except ValueError as exc:
            return _json({"error": str(exc)}, 400)
        filters = {name: q[name] for name in FILTERS if q.get(name)}
        found = await query(since=since, until=until, limit=limit,
                            newest_first=order == "newest", **filters)
        if isinstance(found, web.Response):
            return found
        return _json({"decisions": found, "count": len(found)})

    async def decision(request: web.Request) -> web.Response:
        if authenticate(status, request) is None:
            return unauthorized(request)
        decision_id = request.match_info["id"]
        found = await query(decision_id=decision_id, limit=1)
        if isinstance(found, web.Response):
            return found
        if not found:
            return _json({"error": f"no decision {decision_id}"}, 404)
        return _json(found[0])

    app.router.add_get("/review", page)
    app.router.add_get("/review/", page)
    app.router.add_get("/review/static/{name}", asset)
    app.router.add_get("/v1/decisions", decisions)
    app.router.add_get("/v1/decisions/{id}", decision)
