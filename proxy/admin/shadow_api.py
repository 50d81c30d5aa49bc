"""Admin API for shadow records: the writes shadow runs would have made, for review.

`GET /v1/shadow?run=<run id>&limit=<n>`: `{"records": [...]}` oldest first (the `limit` most
recent, default 100, at most 10000), each record as the shadow check wrote it plus its `id`.
503 when no store is configured or the store cannot answer; 400 for a bad `limit`.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.admin.protect import expect
from proxy.envelope.checks.shadow import list_records
from proxy.errors import StoreError

MAX_LIMIT = 10_000


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def add_shadow_routes(app: web.Application, status: Any) -> None:
    """Mount `GET /v1/shadow`; the store is `status.store` (None: no store configured)."""

    async def shadow_list(request: web.Request) -> web.Response:
        store = getattr(status, "store", None)
        if store is None:
            return _json({"error": "no state store is configured, so nothing is recorded"}, 503)
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            return _json({"error": "limit must be an integer"}, 400)
        if not 1 <= limit <= MAX_LIMIT:
            return _json({"error": f"limit must be between 1 and {MAX_LIMIT}"}, 400)
        run = request.query.get("run") or None
        try:
            records = await list_records(store, run=run, limit=limit)
        except StoreError as exc:
            return _json({"error": f"the state store cannot answer: {exc}"}, 503)
        return _json({"records": records, "count": len(records)})

    app.router.add_get("/v1/shadow", shadow_list, expect_handler=expect)
