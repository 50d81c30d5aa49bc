"""The stdio bridge's listener credential: only this process's bridge reaches the route, and
the credential never reaches the route's handler (so never an upstream)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.fronts.stdio import BRIDGE_HEADER, credential_middleware

SECRET = "s3cret-credential"


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async def echo_headers(request: web.Request) -> web.Response:
        return web.json_response({"headers": sorted(k.lower() for k in request.headers),
                                  "upstream": request.match_info["upstream"]})

    app = web.Application(middlewares=[credential_middleware(SECRET)])
    app.router.add_route("*", "/mcp/{upstream}", echo_headers)
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.mark.parametrize("given", [None, "", "wrong", SECRET + "x", SECRET[:-1]])
async def test_without_the_credential_is_403(client: TestClient[Any, Any], given: str | None) -> None:
    headers = {BRIDGE_HEADER: given} if given is not None else {}
    resp = await client.post("/mcp/notes", data=b"{}", headers=headers)
    assert resp.status == 403
    body = await resp.json()
    assert body["error"]["message"] == "Forbidden: this listener serves its stdio bridge only"


async def test_with_the_credential_the_route_sees_no_credential(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/mcp/notes", data=b"{}", headers={BRIDGE_HEADER: SECRET, "X-Other": "1"})
    assert resp.status == 200
    body = await resp.json()
    assert body["upstream"] == "notes"
    assert "x-other" in body["headers"] and BRIDGE_HEADER.lower() not in body["headers"]
