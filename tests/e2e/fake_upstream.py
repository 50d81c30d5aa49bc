"""A tiny JSON-RPC tool server (aiohttp, in a thread) that counts calls and fails on request.

Enough MCP for raw `tools/call` requests through the proxy: it answers `tools/call` with a JSON
body (`structuredContent.count` is the tool's call count), after first answering the statuses
queued in `fail[tool]` (e.g. [503, 503]; `RESET`: the body is read, then the connection is
dropped without an answer), and optionally sleeping `delay` seconds per call or
holding each call until the test sets `hold` (a call that must stay in flight while the test
looks, however slow the machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.harness import free_port

RESET = 0  # in `FakeUpstream.fail`: read the call, then drop the connection (no status line)


@dataclass
class FakeUpstream:
    port: int = 0
    calls: Counter[str] = field(default_factory=Counter)  # performed calls per tool
    attempts: Counter[str] = field(default_factory=Counter)  # requests per tool, failed ones too
    fail: dict[str, list[int]] = field(default_factory=dict)
    retry_after: str | None = None
    delay: float = 0.0
    hold: threading.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    async def handle(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        if body.get("method") != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": body.get("id"), "result": {}})
        name = body["params"]["name"]
        self.attempts[name] += 1
        queued = self.fail.get(name)
        if queued:
            status = queued.pop(0)
            if status == RESET:
                if request.transport is not None:
                    request.transport.abort()
                await asyncio.sleep(0)
                raise ConnectionResetError("connection dropped after reading the call")
            headers = {"Retry-After": self.retry_after} if self.retry_after else None
            return web.Response(status=status, text="try again", headers=headers)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.hold is not None:
            await asyncio.to_thread(self.hold.wait, 60)
        self.calls[name] += 1
        n = self.calls[name]
        result = {"content": [{"type": "text", "text": f"{name} #{n}"}],
                  "structuredContent": {"count": n}, "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": result})


@contextlib.contextmanager
def serving(handle: Any, port: int, what: str = "the fake upstream", **runner_options: Any) -> Iterator[None]:
    """Serve `handle` (an aiohttp handler) as `POST /mcp` on 127.0.0.1:`port` in a thread of its
    own; `runner_options` go to aiohttp's AppRunner (e.g. handler_cancellation, shutdown_timeout)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner: web.AppRunner | None = None

    async def start() -> None:
        nonlocal runner
        app = web.Application()
        app.router.add_post("/mcp", handle)
        runner = web.AppRunner(app, access_log=None, **runner_options)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10), f"{what} did not start"
    try:
        yield
    finally:
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextlib.contextmanager
def fake_upstream(**runner_options: Any) -> Iterator[FakeUpstream]:
    """Serve a FakeUpstream on a free port in a thread; `runner_options` go to aiohttp's
    AppRunner (e.g. handler_cancellation, shutdown_timeout)."""
    fake = FakeUpstream(port=free_port())
    with serving(fake.handle, fake.port, **runner_options):
        yield fake
