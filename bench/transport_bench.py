"""CPU cost per proxied request of the two upstream transports, client side only.

Starts the raw-asyncio HTTP/1.1 upstream of bench/upstream.py in a separate process, then sends N sequential
keep-alive POSTs (an MCP-sized JSON-RPC body, reading the whole answer) through
`proxy.upstream.forwarder.Forwarder` (aiohttp) and `proxy.upstream.transport.FastForwarder`, and reports the CPU
time (time.process_time) this process spent per request, and the ratio.

    python bench/transport_bench.py [-n 5000] [--loop uvloop|asyncio] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from upstream import Upstream, answer  # noqa: E402  (bench/upstream.py: the raw-asyncio upstream)

from proxy.upstream.forwarder import Forwarder  # noqa: E402
from proxy.upstream.transport import FastForwarder  # noqa: E402

BODY = (b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"search_notes",'
        b'"arguments":{"query":"welcome","limit":5}}}')
HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "Mcp-Session-Id": "3f1c2b9a8d7e4f60a1b2c3d4e5f60718",
    "MCP-Protocol-Version": "2025-06-18",
    "X-Upstream-Credential": "proxy-own-secret",
}
def serve(port: int) -> None:
    runner: Any = asyncio.run
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Upstream, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    runner(main())


async def measure(fwd: Forwarder, url: str, n: int) -> float:
    """CPU µs per request over n sequential requests (after a warm-up)."""
    await fwd.start()
    try:
        async def one() -> None:
            resp = await fwd.open("POST", url, HEADERS, BODY, connect_timeout=5, read_timeout=30)
            async with resp:
                data = await resp.read()
            assert resp.status == 200 and data == answer(BODY), (resp.status, data)

        for _ in range(500):
            await one()
        cpu = time.process_time()
        for _ in range(n):
            await one()
        return (time.process_time() - cpu) / n * 1e6
    finally:
        await fwd.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise SystemExit(f"upstream did not listen on {port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5000, help="requests per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="measurements per transport (best kept)")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return

    port = free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        wait_port(port)
        url = f"http://127.0.0.1:{port}/mcp"
        run: Any = asyncio.run
        if args.loop == "uvloop":
            import uvloop
            run = uvloop.run
        results: dict[str, list[float]] = {"aiohttp Forwarder": [], "FastForwarder": []}
        for _ in range(args.rounds):
            results["aiohttp Forwarder"].append(run(measure(Forwarder(), url, args.n)))
            results["FastForwarder"].append(run(measure(FastForwarder(), url, args.n)))
        print(f"{args.n} sequential keep-alive POSTs, {args.loop} loop, best of {args.rounds}:")
        for name, values in results.items():
            shown = ", ".join(f"{v:.1f}" for v in values)
            print(f"  {name:<18} {min(values):7.1f} µs CPU/request   (rounds: {shown})")
        slow, fast = min(results["aiohttp Forwarder"]), min(results["FastForwarder"])
        print(f"  ratio aiohttp/fast  {slow / fast:7.2f}x")
    finally:
        upstream.terminate()
        upstream.wait(5)


if __name__ == "__main__":
    main()
