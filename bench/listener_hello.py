"""Server-side CPU per request of the MCP listener's HTTP server alone, side by side.

Three servers answer a POST with a fixed JSON-RPC body (no envelope): `aiohttp` (aiohttp's own
server, as `listener: aiohttp`), `fast` (the same `web.Application` served by
proxy/app/fast_listener.py, as `listener: fast`) and `raw` (an asyncio protocol with httptools
and no application: the floor). Each runs in its own uvloop process under `wrk -c32`; CPU per
request is the server's utime+stime from /proc/<pid>/stat divided by wrk's request count.

    python bench/listener_hello.py --duration 5 --rounds 3
    python bench/listener_hello.py --instructions 500   # instructions per request (callgrind)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BODY = b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"ok"}],"isError":false}}'
LUA = ('wrk.method="POST"; wrk.body=\'{"jsonrpc":"2.0","id":1,"method":"tools/call",'
       '"params":{"name":"x","arguments":{}}}\'; wrk.headers["Content-Type"]="application/json"\n')


def serve(kind: str, port: int) -> None:
    import uvloop
    from aiohttp import web

    async def hello(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=BODY, content_type="application/json")

    async def main() -> None:
        if kind == "raw":
            import httptools

            resp = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
                    b"\r\n\r\n%s" % (len(BODY), BODY))

            class Raw(asyncio.Protocol):
                def connection_made(self, transport: asyncio.BaseTransport) -> None:
                    self.t = transport
                    self.p = httptools.HttpRequestParser(self)

                def data_received(self, data: bytes) -> None:
                    self.p.feed_data(data)

                def on_message_complete(self) -> None:
                    self.t.write(resp)  # type: ignore[attr-defined]

            await asyncio.get_running_loop().create_server(Raw, "127.0.0.1", port)
        else:
            app = web.Application()
            app.router.add_route("*", "/mcp/{up}", hello)
            if kind == "fast":
                from proxy.app.fast_listener import FastListener

                listener = FastListener(app, header_timeout=10, keepalive_timeout=75,
                                        shutdown_timeout=1)
                await listener.setup()
                await listener.start("127.0.0.1", port)
            else:
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(kind: str, duration: int, lua: str) -> tuple[float, float, float]:
    """(µs of server CPU per request, of which user, requests per second) for one wrk -c32 run."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/mcp/x"
        subprocess.run(["wrk", "-t1", "-c32", "-d1s", "-s", lua, url], capture_output=True, check=True)
        before = cpu(proc.pid)
        out = subprocess.run(["wrk", "-t1", "-c32", f"-d{duration}s", "-s", lua, url],
                             capture_output=True, text=True, check=True).stdout
        after = cpu(proc.pid)
        user, system = after[0] - before[0], after[1] - before[1]
        match = re.search(r"(\d+) requests in", out)
        if match is None or "Non-2xx" in out or "Socket errors" in out:
            raise SystemExit(f"{kind}: wrk run not clean:\n{out}")
        requests = int(match.group(1))
        return (user + system) / requests * 1e6, user / requests * 1e6, requests / duration
    finally:
        proc.terminate()
        proc.wait()


def instructions(kind: str, calls: int) -> float:
    """Thousands of instructions the server executes per request (valgrind's callgrind, counting
    switched on for `calls` sequential keep-alive requests after a warm-up): repeatable where
    CPU time on a shared machine is not."""
    import http.client

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="listener-instr-") as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                 f"--callgrind-out-file={out}", sys.executable, __file__,
                                 "--serve", kind, "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{kind} did not start under valgrind") from None
                    time.sleep(0.5)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            body = LUA.split("wrk.body='")[1].split("'")[0].encode()

            def post() -> None:
                conn.request("POST", "/mcp/x", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                if response.status != 200 or response.read() != BODY:
                    raise SystemExit(f"{kind}: unexpected answer {response.status}")

            for _ in range(50):
                post()
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
            for _ in range(calls):
                post()
            subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True, check=True)
            time.sleep(1)
        finally:
            proc.terminate()
            proc.wait(60)
        total = 0
        for dump in Path(tmp).glob("callgrind.out*"):
            for line in dump.read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
        return total / calls / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instructions", type=int, default=0, metavar="CALLS",
                        help="count instructions per request with callgrind instead (needs valgrind)")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    if args.instructions:
        counts = {kind: instructions(kind, args.instructions) for kind in ("aiohttp", "fast", "raw")}
        print(f"| server | k instructions/request ({args.instructions} sequential requests) | "
              "ratio to aiohttp |")
        print("|---|---|---|")
        for kind, k in counts.items():
            print(f"| {kind} | {k:,.1f} | {k / counts['aiohttp']:.2f} |")
        return
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(LUA)
    results: dict[str, list[tuple[float, float, float]]] = {"aiohttp": [], "fast": [], "raw": []}
    for _ in range(args.rounds):  # interleaved: the machine's noise hits every server alike
        for kind in results:
            results[kind].append(measure(kind, args.duration, f.name))
    os.unlink(f.name)
    print("| server | µs CPU/request | of which user | req/s | CPU ratio to aiohttp |")
    print("|---|---|---|---|---|")
    base = statistics.median(r[0] for r in results["aiohttp"])
    for kind, rows in results.items():
        us, user, rps = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"| {kind} | {us:.1f} | {user:.1f} | {rps:.0f} | {us / base:.2f} |")
    print(f"(medians of {args.rounds} interleaved rounds of {args.duration} s, wrk -t1 -c32)")


if __name__ == "__main__":
    main()
