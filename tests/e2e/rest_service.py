"""A real REST service for the HTTP-upstream tests: the billing API of
`tests/fixtures/openapi/billing.yaml`, which it also serves at `/openapi.yaml`.

    python tests/e2e/rest_service.py --port 9020        # prints "ready <port>" once listening

Endpoints (see the spec): path, query, header and JSON-body parameters (`getInvoice`,
`listInvoices`, `createInvoice`, `setTags`), a text endpoint (`getInvoiceText`), a DELETE
(`deleteInvoice`), a slow report (`/reports/slow?seconds=`), one answering 500
(`/reports/broken`) and customer notes (`getNote`) whose JSON a test sets beforehand, to carry
attacker text or a secret. Outside the spec, for the tests only:

- `PUT /_notes/{noteId}` with a JSON body: what `GET /notes/{noteId}` answers from then on;
- `GET /_stats`: how often each operation ran (`{"runs": {"createInvoice": 1, ...},
  "requests": [{"method", "path", "query", "headers", "body"}, ...]}`), so a test proves a
  writer ran at most once, or never, and what reached the service.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

SPEC = Path(__file__).resolve().parents[1] / "fixtures" / "openapi" / "billing.yaml"
NOTES: dict[str, Any] = {
    "welcome": {"id": "welcome", "author": "support", "text": "Thanks for choosing us."},
}


def build_app() -> web.Application:
    runs: Counter[str] = Counter()
    requests: list[dict[str, Any]] = []
    notes = dict(NOTES)
    invoices: dict[int, dict[str, Any]] = {
        1: {"id": 1, "customer": "acme", "amount": 120, "status": "open"},
        2: {"id": 2, "customer": "globex", "amount": 75, "status": "paid"},
    }

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/_") and request.path != "/openapi.yaml":
            raw = await request.read()
            requests.append({
                "method": request.method, "path": request.path,
                "query": {k: request.query.getall(k) for k in request.query},
                "headers": dict(request.headers),
                "body": raw.decode("utf-8", errors="replace") if raw else None,
            })
        return await handler(request)

    def ran(name: str) -> None:
        runs[name] += 1

    async def spec(_: web.Request) -> web.Response:
        return web.Response(text=SPEC.read_text(), content_type="application/yaml")

    async def list_invoices(request: web.Request) -> web.Response:
        ran("listInvoices")
        items = list(invoices.values())
        if "status" in request.query:
            items = [i for i in items if i["status"] == request.query["status"]]
        limit = int(request.query.get("limit", "100"))
        return web.json_response(items[:limit])

    async def create_invoice(request: web.Request) -> web.Response:
        ran("createInvoice")
        data = await request.json()
        new_id = max(invoices) + 1
        invoices[new_id] = {"id": new_id, "status": "open", **data}
        # Where the new invoice lives, as a REST service says it: a path on its own origin.
        return web.json_response(invoices[new_id], status=201,
                                 headers={"Location": f"/invoices/{new_id}", "Set-Cookie": "sid=backend"})

    async def get_invoice(request: web.Request) -> web.Response:
        ran("getInvoice")
        invoice = invoices.get(int(request.match_info["invoiceId"]))
        if invoice is None:
            return web.json_response({"error": "no such invoice"}, status=404)
        # A field its own `Connection` names is hop-by-hop (RFC 9110 7.6.1): meant for the next
        # hop only, never relayed further (`Cache-Control` here); `ETag` is an end-to-end field.
        return web.json_response({
            **invoice,
            "expand": request.query.get("expand"),
            "fields": request.query.getall("fields", []),
        }, headers={"ETag": f'"invoice-{invoice["id"]}"', "Cache-Control": "private, max-age=60",
                    "Connection": "keep-alive, Cache-Control"})

    async def delete_invoice(request: web.Request) -> web.Response:
        ran("deleteInvoice")
        invoices.pop(int(request.match_info["invoiceId"]), None)
        return web.Response(status=204)

    async def invoice_text(request: web.Request) -> web.Response:
        ran("getInvoiceText")
        invoice = invoices.get(int(request.match_info["invoiceId"]), {})
        return web.Response(text=f"Invoice {request.match_info['invoiceId']} for "
                                 f"{invoice.get('customer', '?')}: {invoice.get('amount', 0)} EUR")

    async def set_tags(request: web.Request) -> web.Response:
        ran("setTags")
        return web.json_response({"tags": await request.json()})

    async def get_note(request: web.Request) -> web.Response:
        ran("getNote")
        note = notes.get(request.match_info["noteId"])
        if note is None:
            return web.json_response({"error": "no such note"}, status=404)
        return web.json_response(note)

    async def slow(request: web.Request) -> web.Response:
        ran("slowReport")
        await asyncio.sleep(float(request.query.get("seconds", "5")))
        return web.json_response({"report": "done"})

    async def broken(_: web.Request) -> web.Response:
        ran("brokenReport")
        return web.Response(status=500, text="database on fire")

    async def health(_: web.Request) -> web.Response:
        ran("get_health")
        return web.json_response({"ok": True})

    async def set_note(request: web.Request) -> web.Response:
        notes[request.match_info["noteId"]] = await request.json()
        return web.json_response({"ok": True})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"runs": dict(runs), "requests": requests})

    app = web.Application(middlewares=[record])
    app.router.add_get("/openapi.yaml", spec)
    app.router.add_get("/invoices", list_invoices)
    app.router.add_post("/invoices", create_invoice)
    app.router.add_get("/invoices/{invoiceId}", get_invoice)
    app.router.add_delete("/invoices/{invoiceId}", delete_invoice)
    app.router.add_get("/invoices/{invoiceId}/text", invoice_text)
    app.router.add_put("/invoices/{invoiceId}/tags", set_tags)
    app.router.add_get("/notes/{noteId}", get_note)
    app.router.add_get("/reports/slow", slow)
    app.router.add_get("/reports/broken", broken)
    app.router.add_get("/health", health)
    app.router.add_put("/_notes/{noteId}", set_note)
    app.router.add_get("/_stats", stats)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9020)
    args = parser.parse_args()
    web.run_app(build_app(), host="127.0.0.1", port=args.port,
                print=lambda _: print(f"ready {args.port}", flush=True))


if __name__ == "__main__":
    main()
