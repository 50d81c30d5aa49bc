"""cProfile of the envelope's hot path: the bench policy (one worker, the bench's fake upstream)
served under cProfile for N sequential `tools/call`s, then the functions called about once
per call or more, by their own time per call.

    python bench/hotpath_profile.py                 # 2000 calls, top 25
    python bench/hotpath_profile.py --calls 5000 --top 40
    python bench/hotpath_profile.py --config envelope-fast   # served by `listener: fast`

Profiling is switched on (SIGUSR1) after 30 warm-up calls, so startup stays out. Times are
inflated by the profiler (every Python call pays its hook): read them as ranks and shares, and
count cost in instructions with `bench/instructions.py`.
"""

from __future__ import annotations

import argparse
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import run as bench  # noqa: E402  (bench/run.py: the upstream, configs and one call)

# Runs the envelope in the child, profiled from SIGUSR1 on (the handler runs on the main thread,
# the event loop's), and writes the stats when it stops (SIGTERM ends `serve` cleanly).
_CHILD = """
import cProfile, runpy, signal, sys
out, config = sys.argv[1], sys.argv[2]
sys.argv = ["proxy", "serve", "--config", config]
profile = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
try:
    runpy.run_module("proxy", run_name="__main__")
finally:
    profile.disable()
    profile.dump_stats(out)
"""


def profile(tmp: Path, calls: int, config: str = "envelope") -> Path:
    upstream, url = bench.start_upstream(tmp)
    out = tmp / "envelope.prof"
    try:
        path, port, _ = bench.envelope_config(tmp, url, 1, config)
        log = open(tmp / "envelope.log", "wb")
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(out), str(path)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            target = f"http://127.0.0.1:{port}/mcp/{bench.UPSTREAM_NAME}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    bench.one_call(target)
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the envelope did not start: see envelope.log") from None
                    time.sleep(0.5)
            for _ in range(30):
                bench.one_call(target)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            for _ in range(calls):
                status, result = bench.one_call(target)
                if status != 200 or result.get("isError"):
                    raise SystemExit(f"a call was not allowed ({status}, {result})")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            log.close()
    finally:
        upstream.stop()
    return out


def top(stats_file: Path, calls: int, count: int) -> str:
    stats = pstats.Stats(str(stats_file)).stats  # type: ignore[attr-defined]
    rows = []
    for (file, line, name), (_, ncalls, own, cumulative, _) in stats.items():
        if ncalls >= 0.5 * calls:
            short = file.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
            rows.append((own / calls * 1e6, ncalls / calls, cumulative / calls * 1e6, f"{short}:{line}({name})"))
    rows.sort(reverse=True)
    lines = ["| own µs/call | calls/call | cumulative µs/call | function |", "|---:|---:|---:|---|"]
    lines += [f"| {o:,.1f} | {n:.1f} | {c:,.1f} | `{f}` |" for o, n, c, f in rows[:count]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--config", choices=["envelope", "envelope-fast"], default="envelope",
                   help="envelope-fast: the envelope config with `listener: fast`")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="envelope-prof-") as tmpdir:
        print(top(profile(Path(tmpdir), args.calls, args.config), args.calls, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
