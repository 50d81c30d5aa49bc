"""The review page and the decisions API on the admin listener.

    GET /review                    the page (static HTML; its script asks for an approver token)
    GET /review/static/<file>      its script and stylesheet (no build step, no CDN)
    GET /v1/decisions?principal=&run=&upstream=&tool=&verdict=&code=&since=&until=&limit=&order=
                                   {"decisions": [...], "count": n}: audit records, newest first
                                   (order=oldest for oldest first); limit 1..1000, default 100;
                                   since/until: RFC 3339 or relative (15m, 2d)
    GET /v1/decisions/<decision id>  one audit record (404 when unknown)
    GET /v1/decision-stats?window=1h&principal=&run=&upstream=&tool=&verdict=&code=
                                   the picture above the table: calls per minute by verdict
                                   (no `<approval>`/`<intent>`/`<idempotency>` records) over the window (1m..24h, default 1h; wider than 3h: buckets
                                   of whole minutes, at most 180) and the top refused (deny,
                                   error) tools and codes; computed here, reading at most
                                   `proxy.audit.stats.MAX_SCAN` records of the window (newest
                                   first), `truncated` and `complete_from` when the bound is hit
    GET /v1/approvals/<id>/recent?limit=
                                   the last `limit` (1..100, default 10) decisions of the
                                   approval's run and principal, newest first, reading at most
                                   MAX_SCAN records (`truncated` when the bound is hit)

Audit records and shadow records carry call arguments (`args` with `log_args`; shadow records
always), so `/v1/decisions*` and `/v1/shadow` need `Authorization: Bearer <approver token>` like
the approvals API (401 otherwise); so do `/v1/policy` and `/v1/upstreams` (they name the
upstreams and where they are, and show their health) and `/v1/audit/head`.
`/v1/misconfigurations` (tools, principals and reasons) stays open. The page itself embeds no data and no secret: everything it shows comes from
these APIs with the token the person typed, kept in the tab's sessionStorage.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from proxy.admin import approver
from proxy.admin.approver import unauthorized
from proxy.admin.protect import expect
from proxy.audit.query import iter_records, matcher, parse_time, query_records
from proxy.audit.stats import MAX_SCAN, window_stats
from proxy.errors import StoreError

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_LIMIT = 1000
FILTERS = ("principal", "run", "upstream", "tool", "verdict", "code")
DEFAULT_WINDOW = "1h"
MAX_WINDOW = _dt.timedelta(hours=24)
MIN_WINDOW = _dt.timedelta(minutes=1)
RECENT_DEFAULT, RECENT_MAX = 10, 100
_DURATION = re.compile(r"\d+(?:\.\d+)?[smhdw]")

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
# Routes outside this module that need an approver token too: argument-bearing (shadow),
# those that describe the upstreams (policy status, upstream health), and the audit chain head.
PROTECTED_PREFIXES = ("/v1/shadow", "/v1/policy", "/v1/upstreams", "/v1/audit")


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store", **(headers or {})})


def authenticate(status: Any, request: web.Request) -> str | None:
    """The approver's name for the request's bearer token, or None (no approvers: nobody)."""
    return approver.authenticate(getattr(status, "approvers", None), request)


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

    async def stats(request: web.Request) -> web.Response:
        if authenticate(status, request) is None:
            return unauthorized(request)
        directory = _audit_dir(status)
        if directory is None:
            return _json({"error": "this proxy has no audit log to query"}, 503)
        q = request.query
        now = _dt.datetime.now(_dt.UTC)
        window = q.get("window") or DEFAULT_WINDOW
        # A duration back from now only: the picture always ends at the present.
        try:
            since = parse_time(window, now) if _DURATION.fullmatch(window) else None
        except ValueError:  # a duration past datetime's range (`99999999999999d`)
            since = None
        if since is None or not MIN_WINDOW <= now - since <= MAX_WINDOW:
            return _json({"error": "window must be a duration from 1m to 24h (15m, 1h, 6h, 24h)"},
                         400)
        start: _dt.datetime = since
        filters: dict[str, Any] = {name: q[name] for name in FILTERS if q.get(name)}

        def compute() -> dict[str, Any]:
            if not directory.is_dir():
                return window_stats((), since=start, until=now, match=matcher())
            return window_stats(iter_records(directory, newest_first=True, since=start),
                                since=start, until=now, match=matcher(**filters))

        try:
            data = await asyncio.to_thread(compute)
        except OSError as exc:
            return _json({"error": f"the audit log cannot be read: {exc}"}, 503)
        return _json({**data, "window": window, "filters": filters})

    app.router.add_get("/review", page, expect_handler=expect)
    app.router.add_get("/review/", page, expect_handler=expect)
    app.router.add_get("/review/static/{name}", asset, expect_handler=expect)
    app.router.add_get("/v1/decisions", decisions, expect_handler=expect)
    app.router.add_get("/v1/decisions/{id}", decision, expect_handler=expect)
    app.router.add_get("/v1/decision-stats", stats, expect_handler=expect)
    approvals = getattr(status, "approvals", None)
    if approvals is not None:
        _add_recent_route(app, status, approvals)


def _recent(directory: Path, principal: str, run: str, limit: int) -> dict[str, Any]:
    """The last `limit` decisions of one principal's run, newest first, reading at most
    MAX_SCAN records (a run that went quiet long ago is not searched for to the log's start)."""
    if not directory.is_dir():
        return {"decisions": [], "count": 0, "scanned": 0, "truncated": False}
    match = matcher(principal=principal, run=run)
    found: list[dict[str, Any]] = []
    scanned = 0
    truncated = False
    for rec in iter_records(directory, newest_first=True):
        if scanned >= MAX_SCAN:
            truncated = True
            break
        scanned += 1
        if match(rec):
            found.append(rec)
            if len(found) >= limit:
                break
    return {"decisions": found, "count": len(found), "scanned": scanned, "truncated": truncated}


def _add_recent_route(app: web.Application, status: Any, approvals: Any) -> None:
    """`GET /v1/approvals/{id}/recent`: the context an approver decides with. The run and the
    principal come from the approval record, never from the request, so one approval shows
    only its own run's calls."""

    async def recent(request: web.Request) -> web.Response:
        if authenticate(status, request) is None:
            return unauthorized(request)
        try:
            limit = int(request.query.get("limit", str(RECENT_DEFAULT)))
        except ValueError:
            return _json({"error": "limit must be an integer"}, 400)
        if not 1 <= limit <= RECENT_MAX:
            return _json({"error": f"limit must be between 1 and {RECENT_MAX}"}, 400)
        approval_id = request.match_info["id"]
        try:
            approval = await approvals.head(approval_id)
        except StoreError as exc:
            return _json({"error": f"the state store is unavailable: {exc}"}, 503)
        if approval is None:
            return _json({"error": f"no approval {approval_id}"}, 404)
        directory = _audit_dir(status)
        if directory is None:
            return _json({"error": "this proxy has no audit log to query"}, 503)
        try:
            found = await asyncio.to_thread(_recent, directory, approval.principal, approval.run,
                                            limit)
        except OSError as exc:
            return _json({"error": f"the audit log cannot be read: {exc}"}, 503)
        return _json({"approval": approval.id, "principal": approval.principal,
                      "run": approval.run, **found})

    app.router.add_get("/v1/approvals/{id}/recent", recent, expect_handler=expect)
