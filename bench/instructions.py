"""Instructions per call of the envelope, counted by valgrind's callgrind: repeatable where wall
and CPU time are not (a shared 2-vCPU VM swings ±30% between runs; instruction counts repeat
to within a fraction of a percent).

The envelope (`bench/policy/bench.yaml`, one worker, the bench's fake upstream) runs under
`valgrind --tool=callgrind --instr-atstart=no`; after a warm-up, counting is switched on for N
sequential calls and off again; the total divided by N is the cost of one call in the proxy
process (parsing, checks, forwarding, inspection, audit, metrics; the event loop's own work
included). With `--baseline REV` the same is measured for git revision REV, in the same run.

    python bench/instructions.py                      # this tree, 300 calls
    python bench/instructions.py --baseline c1950ec   # and the tree at c1950ec
    python bench/instructions.py --config noflow      # the bench policy with dataflow: {mode: off}
    python bench/instructions.py --config envelope-fast   # the envelope served by `listener: fast`
    python bench/instructions.py --otel               # traces on (OTLP/HTTP to a local sink)
    python bench/instructions.py --size 50000         # tool outputs of 50 KB prose (mix_upstream.py)

Needs valgrind (apt-get install valgrind); slow (about a minute per tree).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import run as bench  # noqa: E402  (bench/run.py: the upstream, configs and one call)


def start_upstream(tmp: Path, size: int | None) -> tuple[bench.Service, str]:
    """The bench's upstream (a two-byte result), or with `size` the realistic mix's one
    (`mix_upstream.py`: `size` bytes of prose, a different window every call)."""
    if size is None:
        return bench.start_upstream(tmp)
    port = bench.free_port()
    svc = bench.Service("upstream")
    svc.start([sys.executable, str(BENCH / "mix_upstream.py"), "--port", str(port), "--size", str(size)],
              tmp / "upstream.log")
    bench.wait_port(port, svc)
    return svc, f"http://127.0.0.1:{port}/mcp"


def count(tree: Path, tmp: Path, config: str, calls: int, keep: Path | None = None,
          size: int | None = None) -> float:
    """Thousands of instructions per call of the envelope served from `tree`; with `keep`, the
    callgrind dumps are copied there (for `callgrind_annotate --inclusive=yes`)."""
    upstream, url = start_upstream(tmp, size)
    try:
        path, port, _ = bench.envelope_config(tmp, url, 1, config)
        out = tmp / f"callgrind-{tree.name}.out"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        log = open(tmp / f"envelope-{tree.name}.log", "wb")
        proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                 f"--callgrind-out-file={out}", sys.executable, "-m", "proxy", "serve",
                                 "--config", str(path)], cwd=tree, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            target = f"http://127.0.0.1:{port}/mcp/{bench.UPSTREAM_NAME}"
            deadline = time.monotonic() + 600
            while True:
                try:
                    bench.one_call(target)
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the envelope from {tree} did not start: see {log.name}") from None
                    time.sleep(1)
            for _ in range(30):
                bench.one_call(target)
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
            for _ in range(calls):
                # Under callgrind on a busy machine a call with a large output takes seconds.
                status, result = bench.one_call(target, timeout=300)
                if status != 200 or result.get("isError"):
                    raise SystemExit(f"a call was not allowed ({status}, {result})")
            subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True, check=True)
            time.sleep(2)
        finally:
            proc.terminate()
            proc.wait(60)
            log.close()
        total = 0
        for dump in tmp.glob(f"{out.name}*"):
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(dump, keep / f"{dump.name}-{tree.name}")
            for line in dump.read_text(errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
        return total / calls / 1e3
    finally:
        upstream.stop()


@contextlib.contextmanager
def otlp_sink() -> Iterator[dict[str, str]]:
    """An OTLP/HTTP endpoint on loopback that takes every export (200, empty body): the
    environment that turns the envelope's traces on, every span exported (the cost of
    building and serialising them is in the count; the sink's is not: it is this process)."""

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # Batching as deployed (OTEL_BSP_* unset: a batch every 5 s, up to 512 spans).
        yield {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}"}
    finally:
        server.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300, help="calls counted per tree (default 300)")
    p.add_argument("--baseline", metavar="REV", help="also count git revision REV (a temporary worktree)")
    p.add_argument("--config", choices=["envelope", "noflow", "envelope-fast"], default="envelope",
                   help="envelope-fast: the envelope config with `listener: fast`")
    p.add_argument("--otel", action="store_true", help="traces on: every call's spans exported "
                   "over OTLP/HTTP to a local sink (needs the otel extra)")
    p.add_argument("--keep", metavar="DIR", type=Path, help="copy the callgrind dumps into DIR "
                   "(rank functions with callgrind_annotate --inclusive=yes)")
    p.add_argument("--size", type=int, default=None, metavar="BYTES",
                   help="tool outputs of BYTES of untrusted prose (bench/mix_upstream.py) instead of 'ok'")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions: valgrind not found; apt-get install valgrind", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="envelope-instr-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        if args.otel:
            os.environ.update(stack.enter_context(otlp_sink()))
        trees = [("this tree", ROOT)]
        if args.baseline:
            base = tmp / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT,
                           check=True, capture_output=True)
            trees.append((f"git {args.baseline}", base))
        try:
            results = [(name, count(tree, tmp, args.config, args.calls, args.keep, args.size)) for name, tree in trees]
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "baseline")], cwd=ROOT,
                               capture_output=True, check=False)
    traces = (", traces on" if args.otel else "") + (f", {args.size} B outputs" if args.size else "")
    print(f"| tree | k instructions per call ({args.config}{traces}, {args.calls} calls) |")
    print("|---|---:|")
    for name, k in results:
        print(f"| {name} | {k:,.1f} |")
    if len(results) == 2:
        print(f"\nthis tree / baseline: {results[0][1] / results[1][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
