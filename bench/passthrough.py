"""The baseline the envelope is compared against: a bare aiohttp reverse proxy, no checks.

One aiohttp server and one aiohttp ClientSession with a keep-alive pool. Each request's body is
read in full, forwarded with the client's headers (minus hop-by-hop ones) and the upstream's
status, body, content type and `Mcp-Session-Id` are returned. With `--reuse-port` several processes can share
the port (SO_REUSEPORT), as `envelope-proxy serve --workers N` does.

    python bench/passthrough.py --port 9200 --upstream http://127.0.0.1:9100/mcp
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "content-length", "host",
    "accept-encoding",
})
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


def build_app(upstream: str) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        session = request.app[SESSION]
        async with session.post(upstream, data=body, headers=headers, allow_redirects=False) as resp:
            data = await resp.read()
            out = {"Content-Type": resp.headers.get("Content-Type", "application/octet-stream")}
            # A session client (bench/mix.py) needs the id `initialize` answered.
            session_id = resp.headers.get("Mcp-Session-Id")
            if session_id is not None:
                out["Mcp-Session-Id"] = session_id
            return web.Response(status=resp.status, body=data, headers=out)

    async def session_ctx(app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=256, keepalive_timeout=30)
        app[SESSION] = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=30),
        )
        yield
        await app[SESSION].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def main(host: str, port: int, upstream: str, reuse_port: bool) -> None:
    runner = web.AppRunner(build_app(upstream), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=1024).start()
    print(f"passthrough on http://{host}:{port} -> {upstream}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9200)
    parser.add_argument("--upstream", required=True, help="upstream URL, e.g. http://127.0.0.1:9100/mcp")
    parser.add_argument("--reuse-port", action="store_true", help="set SO_REUSEPORT (several processes, one port)")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(main(args.host, args.port, args.upstream, args.reuse_port))
    except ImportError:
        asyncio.run(main(args.host, args.port, args.upstream, args.reuse_port))
    except KeyboardInterrupt:
        pass
