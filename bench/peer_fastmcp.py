"""fastmcp's proxy with one shared upstream session, as a user would run it (bench/mix.py peer).

Runs in the bench's own venv (bench/.venv-peers, created by bench/mix.py): fastmcp is not a
dependency of envelope-proxy. `create_proxy` given a *connected* `Client` reuses that client's
session for every request (fastmcp's cheapest proxy mode; a URL or a disconnected client opens a
fresh upstream session per request, which costs far more). JSON responses (no SSE framing), so
the comparison with the other paths is about the proxy, not the encoding.

    bench/.venv-peers/bin/python bench/peer_fastmcp.py --port 9300 --upstream http://127.0.0.1:9100/mcp
"""

from __future__ import annotations

import argparse
import asyncio

from fastmcp import Client
from fastmcp.server import create_proxy


async def main(host: str, port: int, upstream: str) -> None:
    client = Client(upstream)
    async with client:
        proxy = create_proxy(client, name="bench-fastmcp-proxy")
        await proxy.run_http_async(show_banner=False, host=host, port=port, path="/mcp", log_level="warning",
                                   json_response=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9300)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    asyncio.run(main(args.host, args.port, args.upstream))
