"""A `FastListener` serving an aiohttp application on a free loopback port, for the listener's
unit tests (test_fast_listener.py, test_lean_request.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from proxy.app.fast_listener import FastListener


@asynccontextmanager
async def fast_served(app: web.Application) -> AsyncIterator[FastListener]:
    listener = FastListener(app, header_timeout=5, keepalive_timeout=5, shutdown_timeout=2)
    await listener.setup()
    await listener.start("127.0.0.1", 0)
    try:
        yield listener
    finally:
        await listener.cleanup()
