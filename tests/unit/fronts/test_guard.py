"""The guard of the MCP and HTTP routes with an `Expect` header: checked once, answered as HTTP
says (unit: aiohttp's test server; `tests/e2e/test_listener_wire.py` has the same on the wire)."""

from __future__ import annotations

from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.envelope.pipeline import Envelope
from proxy.expect import UNSUPPORTED
from proxy.fronts.guard import Guard, GuardSettings
from proxy.observability.metrics import Metrics


class CountingGuard(Guard):
    checks = 0

    def check(self, request: web.Request) -> web.Response | None:
        self.checks += 1
        return super().check(request)


def _app(guard: Guard, served: list[str]) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        served.append(await request.text())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("POST", "/mcp", guard.wrap(handler), expect_handler=guard.expect_handler())
    return app


async def test_a_request_with_an_expectation_is_guarded_once_and_answered() -> None:
    settings = GuardSettings(max_body_bytes=1 << 20, allowed_hosts=frozenset({"*"}), allowed_origins=frozenset())
    guard = CountingGuard(settings, cast(Envelope, None), Metrics())
    served: list[str] = []
    client: TestClient[Any, Any]
    async with TestClient(TestServer(_app(guard, served))) as client:
        reply = await client.post("/mcp", data=b'{"a":1}', expect100=True)
        assert reply.status == 200 and served == ['{"a":1}']
        assert guard.checks == 1  # the expect handler's check stands for the route's
        reply = await client.post("/mcp", data=b"{}")
        assert reply.status == 200 and guard.checks == 2
        reply = await client.post("/mcp", data=b"{}", headers={"Expect": "teapot"})
        assert reply.status == 417 and (await reply.json())["error"]["message"] == UNSUPPORTED
        assert len(served) == 2 and guard.checks == 3
