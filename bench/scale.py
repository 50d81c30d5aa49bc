"""Does a call cost the same in a large policy and among many live runs? (issue 15: the cost flat,
±10%, from 10 to 1,000 tools in the policy and from 1 to 10,000 live runs)

Each cell runs the full envelope (1 worker, the default SQLite store, audit, metrics) through
the wire. The policy is bench/policy/bench.yaml's `bench.search_issues` (the tool called)
beside `--tools` - 1 generated tools, each with a schema, an allow, a guardrail and 15 argument
rules (bench/policy_load.py's `tool_yaml`). The tool answers 200 B of untrusted prose
(bench/mix_upstream.py), which the envelope fingerprints into the run's ledger before it is
delivered. The calls are spread over `--runs` live runs: the wrk script sends each request with
`X-Envelope-Run: r<k>` for a k drawn at random, and before a many-run cell every run has had one
call, so its ledger, flags and audit exist (a process's in-memory views of runs hold fewer than
10,000: most calls find theirs cold).

    python bench/scale.py                     # tools 10,1000 x runs 1,10000, c=1 and c=32, 5 s cells
    python bench/scale.py --duration 10 --tools 10,100,1000 --runs 1,100,10000

Reports req/s, p50, p99 and the proxy's CPU per call (utime+stime of its processes from /proc),
and each cell's CPU per call and p50 over the same concurrency's (fewest tools, one run) cell
of the same run: flat means those ratios stay within 0.9-1.1. Every cell is verified as
bench/mix.py's are (HTTP 200 with the whole output before and after, no non-2xx or socket
errors, one `allow` decision per request). The policy raises `ledger_cap` to its most
(4,000,000 fingerprints): at the default one run would overflow after about a thousand calls and
then record nothing more, which costs less and is not what is compared. Its `dataflow:` section
makes the data-flow check `enforce` (bench.yaml has none: shadow), the issue's mode: every output
is recorded before it is delivered either way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import mix as M  # noqa: E402  (the mix's upstream, clients and checks)
import run as R  # noqa: E402
from policy_load import tool_yaml  # noqa: E402

RULES_PER_TOOL = 15
SIZE = 200  # bytes of untrusted prose per output
LEDGER_CAP = 4_000_000  # the policy's most: ~60,000 calls of 200 B into one run

# The run of each request drawn at random (`RUNS` runs); the request built per call.
MEASURE_LUA = """\
wrk.method = "POST"
wrk.body = {body}
{headers}
math.randomseed(7)
request = function()
  wrk.headers["X-Envelope-Run"] = "r" .. math.random(0, {runs} - 1)
  return wrk.format(nil)
end
"""

@dataclass
class Cell:
    tools: int
    runs: int
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    cpu_us: float
    ticks: float


def policy_dir(tmp: Path, tools: int) -> Path:
    """bench.yaml and `tools` - 1 generated tools (in files of 100, as a policy repository would
    split them)."""
    directory = tmp / f"policy-{tools}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    shutil.copy(BENCH / "policy" / "bench.yaml", directory / "bench.yaml")
    # A run whose ledger overflowed records nothing more (cheaper, and not what is compared): the
    # cap raised so that the single run of a one-run cell never reaches it.
    (directory / "zz-scale.yaml").write_text(f"version: 1\ndataflow:\n  mode: enforce\n  ledger_cap: {LEDGER_CAP}\n")
    extra = tools - 1
    for f in range(0, extra, 100):
        body = "".join(tool_yaml(i, RULES_PER_TOOL) for i in range(f, min(extra, f + 100)))
        (directory / f"tools-{f // 100:03d}.yaml").write_text("tools:\n" + body, encoding="utf-8")
    return directory


def start_envelope(tmp: Path, upstream_url: str, tools: int) -> R.Route:
    port, admin = R.free_port(), R.free_port()
    state = tmp / f"state-{tools}"
    shutil.rmtree(state, ignore_errors=True)
    config = {
        "listen": f"127.0.0.1:{port}", "admin": f"127.0.0.1:{admin}",
        "policies": str(policy_dir(tmp, tools)), "state_dir": str(state),
        "identity": {"mode": "static", "principal": "bench-agent", "groups": ["engineering"]},
        "upstreams": {R.UPSTREAM_NAME: {"url": upstream_url}},
        "reload_interval": 0, "workers": 1, "log_level": "warning",
    }
    path = tmp / f"envelope-{tools}.json"
    path.write_text(json.dumps(config, indent=2))
    svc = R.Service(f"envelope ({tools} tools)")
    svc.start([sys.executable, "-m", "proxy", "serve", "--config", str(path)], tmp / f"envelope-{tools}.log")
    R.wait_port(port, svc, timeout=120)
    R.wait_port(admin, svc, timeout=120)
    return R.Route("envelope", 1, f"http://127.0.0.1:{port}/mcp/{R.UPSTREAM_NAME}", svc, [admin])


def script(client: M.Client, tmp: Path, runs: int) -> Path:
    headers = "\n".join(f"wrk.headers[{R.lua_string(k)}] = {R.lua_string(v)}" for k, v in client.headers.items())
    path = tmp / f"measure-{runs}.lua"
    path.write_text(MEASURE_LUA.format(body=R.lua_string(client.body), headers=headers, runs=runs))
    return path


def fill(client: M.Client, runs: int) -> None:
    """One call for each of `runs` runs, 16 at a time (each must be allowed)."""
    started = time.perf_counter()

    def one(k: int) -> int:
        status, _, _ = M.post(client.url, client.body, {**client.headers, "X-Envelope-Run": f"r{k}"})
        return status

    with ThreadPoolExecutor(16) as pool:
        failed = [k for k, status in enumerate(pool.map(one, range(runs))) if status != 200]
    if failed:
        raise R.BenchError(f"filling {runs} runs: {len(failed)} calls failed (run r{failed[0]} first)")
    print(f"  {runs} runs filled in {time.perf_counter() - started:.1f} s", flush=True)


def measure(path: R.Route, client: M.Client, tmp: Path, tools: int, runs: int, concurrency: int,
            args: argparse.Namespace) -> Cell:
    wrk_script = script(client, tmp, runs)
    M.check_call(client, SIZE)
    R.run_wrk(path.url, concurrency, args.warmup, wrk_script)
    label = f"{tools:>5} tools {runs:>6} runs c={concurrency}"
    result, cpu = M.timed_cell(path, path.url, wrk_script, concurrency, args.duration, label)
    M.check_call(client, SIZE)
    cell = Cell(tools, runs, concurrency, result.rps, result.p50_ms, result.p99_ms, result.requests,
                cpu / result.requests * 1e6, cpu * R.CLK_TCK)
    print(f"  {label:32} {cell.rps:8.0f} req/s  p50 {cell.p50_ms:7.3f}  p99 {cell.p99_ms:7.3f} ms  "
          f"CPU {cell.cpu_us:8.1f} us/call", flush=True)
    return cell


def profile(path: R.Route, client: M.Client, tmp: Path, tools: int, runs: int, concurrency: int,
            seconds: int) -> str:
    """py-spy the envelope for `seconds` under wrk over `runs` runs; the top frames."""
    pyspy = shutil.which("py-spy") or str(M.PEERS_VENV / "bin" / "py-spy")
    out = BENCH / "out" / f"profile-scale-{tools}-tools-{runs}-runs.speedscope.json"
    out.parent.mkdir(exist_ok=True)
    assert path.service is not None
    load = subprocess.Popen(R.wrk_argv(path.url, concurrency, seconds + 4, script(client, tmp, runs)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)
        spy = subprocess.run([pyspy, "record", "--format", "speedscope", "--rate", "250", "--nonblocking",
                              "--duration", str(seconds), "--pid", str(path.service.pids[0]), "-o", str(out)],
                             capture_output=True, text=True, check=False)
    finally:
        load.wait(seconds + 30)
    if spy.returncode != 0 or not out.exists():
        raise R.BenchError(f"py-spy failed:\n{spy.stdout}\n{spy.stderr}")
    return (f"py-spy, {tools} tools, {runs} runs, c={concurrency}:\n\n"
            + R.summarize_speedscope(out, top=20))


def report(cells: list[Cell], args: argparse.Namespace) -> str:
    base = {c.concurrency: c for c in cells if c.tools == min(args.tools) and c.runs == min(args.runs)}
    lines = [
        "| tools | live runs | c | req/s | p50 ms | p99 ms | proxy CPU µs/call | CPU / base | p50 / base |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for conc in args.concurrency:
        for c in (c for c in cells if c.concurrency == conc):
            b = base[conc]
            mark = "~" if c.ticks < M.MIN_TICKS else ""
            lines.append(f"| {c.tools:,} | {c.runs:,} | {conc} | {c.rps:,.0f} | {c.p50_ms:.3f} | {c.p99_ms:.3f} "
                         f"| {mark}{c.cpu_us:,.1f} | {c.cpu_us / b.cpu_us:.2f} | {c.p50_ms / b.p50_ms:.2f} |")
    lines += ["", f"(base: {min(args.tools)} tools, {min(args.runs)} run(s), same concurrency; `~`: fewer than "
              f"{M.MIN_TICKS} CPU clock ticks measured, +-5% or worse)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default="10,1000", help="policy sizes (default 10,1000)")
    p.add_argument("--runs", default="1,10000", help="live run counts, ascending (default 1,10000)")
    p.add_argument("--concurrency", default="1,32", help="wrk connections (default 1,32)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per cell (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per cell (default 1)")
    p.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                   help="after each policy size's cells, py-spy the envelope over the most runs")
    args = p.parse_args(argv)
    args.tools = sorted(int(x) for x in args.tools.split(","))
    args.runs = sorted(int(x) for x in args.runs.split(","))
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    if shutil.which("wrk") is None:
        print("bench: wrk not found on PATH. Install it: apt-get install wrk", file=sys.stderr)
        return 2
    cells: list[Cell] = []
    profiles: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="envelope-scale-") as tmpdir:
            tmp = Path(tmpdir)
            upstream, upstream_url = M.start_upstream(tmp, SIZE)
            try:
                for tools in args.tools:
                    print(f"{tools} tools", flush=True)
                    with M.running(start_envelope(tmp, upstream_url, tools)) as path:
                        client = M.make_client("stateless", path.url)
                        filled = 1
                        for runs in args.runs:
                            if runs > filled:
                                fill(client, runs)
                                filled = runs
                            for conc in args.concurrency:
                                cells.append(measure(path, client, tmp, tools, runs, conc, args))
                        if args.profile:
                            profiles.append(profile(path, client, tmp, tools, max(args.runs),
                                                    max(args.concurrency), args.profile))
            finally:
                upstream.stop()
    except (R.BenchError, OSError) as exc:
        print(f"bench: FAILED: {exc}", file=sys.stderr)
        return 1
    print()
    print(report(cells, args))
    for text in profiles:
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
