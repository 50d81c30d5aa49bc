"""Policy load and hot reload at scale: time `load_policy` cold and after a one-tool change.

Generates a policy directory of N tools x R rules (each tool with its own JSON schema, CEL `allow`,
R forbid/allow rules with literals unique to the tool, `matches` patterns and a guardrail pattern),
then times, in one process with one engine (as the runtime keeps it):

- cold: the first `load_policy` of the directory, plus building the check chain from it;
- reload: `load_policy` again after one tool's rules changed, plus the chain (what a hot reload pays).

    python bench/policy_load.py --tools 10,100,1000 --rules 15
    python bench/policy_load.py --tools 1000 --files 1,20         # one file, or one per 50 tools
    python bench/policy_load.py --tools 1000 --profile 25        # cProfile top functions
    python bench/policy_load.py --tools 1000 --files 20 --traffic 20   # calls through the real proxy:
                                     # latency steady vs while the policy hot-reloads back to back,
                                     # and the proxy's event-loop lag (bench/lagprobe.py)

It prints a Markdown table; bench/RESULTS.md ("Policy load at scale") quotes it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import http.client
import io
import json
import multiprocessing
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent

RULES = [
    ('forbid', 'args.repo.startsWith("corp/secret-{i}")'),
    ('forbid', 'args.repo.contains("vault{i}")'),
    ('forbid', 'args.query.matches("(?i)(password{i}|api[_-]?key|secret)\\\\s*[:=]")'),
    ('forbid', 'args.query.contains("ghp_{i}")'),
    ('forbid', 'size(args.query) > {n}'),
    ('forbid', 'has(args.labels) && "embargoed-{i}" in args.labels'),
    ('forbid', 'has(args.labels) && size(args.labels) > {m}'),
    ('forbid', 'has(args.limit) && args.limit > {n}'),
    ('forbid', 'args.repo.endsWith("-archive-{i}")'),
    ('forbid', 'args.repo in ["corp/hr-{i}", "corp/payroll", "corp/legal"]'),
    ('forbid', 'args.query.matches("[A-Za-z0-9._%+-]+@{i}[A-Za-z0-9.-]+\\\\.[a-z]{{2,}}")'),
    ('allow', 'args.repo.startsWith("corp/docs-{i}")'),
    ('allow', 'args.repo.startsWith("oss/") && size(args.query) < {n}'),
    ('allow', 'args.repo.matches("^design{i}/[a-z]+$")'),
    ('allow', 'args.repo.startsWith("corp/") && principal.id != "blocked-{i}"'),
]


def tool_yaml(i: int, rules: int, variant: int = 0) -> str:
    """One `tools:` entry; `variant` changes its rules' literals (a one-tool edit)."""
    n = 100 + i % 50 + variant
    lines = [
        f"  bench.tool_{i}:",
        "    effect: read",
        "    output: untrusted",
        "    schema:",
        "      type: object",
        "      properties:",
        f'        repo: {{type: string, pattern: "^[a-z0-9-]+/[a-z0-9._-]+{i}$", maxLength: {n}}}',
        f"        query: {{type: string, minLength: 1, maxLength: {n}}}",
        "        labels: {type: array, items: {type: string, maxLength: 50}, maxItems: 10}",
        "        limit: {type: integer, minimum: 1, maximum: 100}",
        "      required: [repo, query]",
        "      additionalProperties: false",
        "    allow:",
        f"      - 'principal.id == \"bench-agent\" || \"team-{i}\" in principal.groups'",
        "    guardrails:",
        f'      - {{id: ticket-{i}, pattern: "TICKET-{i}-[0-9]+"}}',
        "    rules:",
    ]
    for r in range(rules):
        kind, expr = RULES[r % len(RULES)]
        text = expr.format(i=f"{i}x{variant}x{r // len(RULES)}", n=n + r // len(RULES), m=8)
        lines.append(f"      - id: r{r}")
        lines.append(f"        {kind}: '{text}'")
    lines.append("    fallback: deny")
    return "\n".join(lines) + "\n"


def write_policy(
    directory: Path, tools: int, rules: int, changed: int | None = None, files: int = 1,
    head: bool = True,
) -> None:
    """The policy in `files` files (the tools dealt out in order), each rewritten only when its
    text changes (as a git pull leaves untouched files alone). Without `head`, tools only (the
    traffic run adds them to bench/policy/bench.yaml, which declares the rest)."""
    head_text = (
        "version: 1\nupstreams:\n  bench:\n    url: \"http://127.0.0.1:9100/mcp\"\n"
        "defaults:\n  unknown_tools: deny\nprincipals:\n  bench-agent:\n    capability: read-write\n"
    ) if head else ""
    per = -(-tools // files)
    for f in range(files):
        body = "".join(tool_yaml(i, rules, 1 if i == changed else 0)
                       for i in range(f * per, min(tools, (f + 1) * per)))
        text = (head_text if f == 0 else "") + ("tools:\n" + body if body else "")
        path = directory / f"policy-{f:03d}.yaml"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")


def build_chain(revision: Any) -> None:
    """What the runtime builds from a revision besides loading it (the checks compile CEL too)."""
    from proxy.envelope.checks.arg_rules import ArgRulesCheck
    from proxy.envelope.checks.authz import AuthzCheck
    from proxy.envelope.tools import ToolRegistry

    registry = ToolRegistry()
    ArgRulesCheck(revision, registry)
    AuthzCheck(revision, registry)


def cpu() -> float:
    """CPU seconds of this process and of its finished children (the load's compile workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def timed(directory: Path, engine: Any) -> tuple[float, float, float, float, Any]:
    """(load, chain) wall-clock seconds, the CPU seconds of both (this process and the compile
    workers it ran: what other jobs on a shared machine do not inflate), the CPU seconds of
    this process alone (what the loading thread holds the interpreter for), and the revision."""
    from proxy.policy.loader import load_policy

    c0, h0, t0 = cpu(), time.process_time(), time.perf_counter()
    revision = load_policy(directory, engine=engine)
    t1 = time.perf_counter()
    build_chain(revision)
    return t1 - t0, time.perf_counter() - t1, cpu() - c0, time.process_time() - h0, revision


def measure(tools: int, rules: int, engine_name: str, profile: int,
            sort: str = "cumulative", files: int = 1) -> dict[str, float]:
    from proxy.policy import cel, loader, schemas

    # Cold means cold: nothing compiled by an earlier row of this run is reused. (getattr: the
    # same script times a base revision without these caches.)
    for name in ("_lint", "_lint_parsed", "_shape", "_parse", "_parsed_sites", "_re2_compile",
                 "_self_contained"):
        if hasattr(cel, name):
            getattr(cel, name).cache_clear()
    for cache in (getattr(schemas, "_VALIDATORS", None), getattr(loader, "_PARSED", None)):
        if cache is not None:
            cache.clear()
    engine = cel.get_engine(engine_name)
    tmp = Path(tempfile.mkdtemp(prefix="policy-load-"))
    try:
        write_policy(tmp, tools, rules, files=files)
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        cold_load, cold_chain, cold_cpu, cold_here, _ = timed(tmp, engine)
        write_policy(tmp, tools, rules, changed=tools // 2, files=files)
        reload_load, reload_chain, reload_cpu, _, _ = timed(tmp, engine)
        if prof:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(profile)
            print(out.getvalue())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "cold_load": cold_load, "cold_chain": cold_chain, "cold_cpu": cold_cpu,
        "cold_here": cold_here,
        "reload_load": reload_load, "reload_chain": reload_chain, "reload_cpu": reload_cpu,
    }


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"nothing listening on {port}")


def reloads(admin: int) -> float:
    """The proxy's count of successful reloads (its /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10).read().decode()
    m = re.search(r'^envelope_policy_reloads_total\{result="success"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def call_loop(port: int, ready: Any, stop: Any, out: Any) -> None:
    """Sequential `tools/call`s of the bench tool on one keep-alive connection, in a process of
    its own (a client thread in the bench's process would wait for the bench's interpreter while
    it writes the next edit: ~15 ms of policy text each time, counted as the proxy's latency);
    sends the latencies on `out` once `stop` is set."""
    sys.path.insert(0, str(BENCH))
    from run import BODY, HEADERS  # the same call bench/run.py measures

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    latencies = []
    ready.set()
    while not stop.is_set():
        t0 = time.perf_counter()
        conn.request("POST", "/mcp/bench", BODY, HEADERS)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200 or b'"isError":false' not in body:
            raise SystemExit(f"call refused or failed: {resp.status} {body[:200]!r}")
        latencies.append(time.perf_counter() - t0)
    conn.close()
    out.send(latencies)


def loop_lags(path: Path, start: float, end: float) -> list[float]:
    """The proxy's event-loop lags (seconds, those over 1 ms) between two wall-clock times, as
    bench/lagprobe.py recorded them."""
    if not path.exists():
        return []
    lags = []
    for line in path.read_text(encoding="utf-8").splitlines():
        at, _, lag = line.partition(" ")
        if start <= float(at) <= end:
            lags.append(float(lag))
    return lags


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] * 1000 if len(values) > 1 else 0.0


def run_traffic(tools: int, rules: int, files: int, seconds: float) -> None:
    """p50/p99 of calls through the real proxy, steady and while it reloads a `tools`-tool policy
    (one tool edited, the next edit as soon as the last reload is in)."""
    tmp = Path(tempfile.mkdtemp(prefix="policy-traffic-"))
    spawn = multiprocessing.get_context("spawn")
    procs: list[subprocess.Popen[bytes]] = []
    stack = contextlib.ExitStack()
    try:
        policy = tmp / "policy"
        policy.mkdir()
        shutil.copy(BENCH / "policy" / "bench.yaml", policy / "bench.yaml")
        write_policy(policy, tools, rules, files=files, head=False)
        up_port, port, admin = free_port(), free_port(), free_port()
        config = {
            "listen": f"127.0.0.1:{port}", "admin": f"127.0.0.1:{admin}",
            "policies": str(policy), "state_dir": str(tmp / "state"),
            "identity": {"mode": "static", "principal": "bench-agent", "groups": ["engineering"]},
            "upstreams": {"bench": {"url": f"http://127.0.0.1:{up_port}/mcp"}},
            "reload_interval": 0.2, "workers": 1, "log_level": "warning",
        }
        (tmp / "config.json").write_text(json.dumps(config))
        env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
        log = stack.enter_context((tmp / "proxy.log").open("wb"))
        procs.append(subprocess.Popen([sys.executable, str(BENCH / "upstream.py"), "--port",
                                       str(up_port)], stdout=log, stderr=log))
        started = time.perf_counter()
        lagfile = tmp / "lag.txt"
        procs.append(subprocess.Popen([sys.executable, str(BENCH / "lagprobe.py"), str(lagfile),
                                       "serve", "--config", str(tmp / "config.json")],
                                      stdout=log, stderr=log, env=env))
        wait_port(up_port, procs[0])
        wait_port(admin, procs[1])
        print(f"\nproxy up with {tools} tools in {files} file(s) after "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        results = {}
        for phase in ("steady", "reloading"):
            ready, stop = spawn.Event(), spawn.Event()
            receive, send = spawn.Pipe(duplex=False)
            client = spawn.Process(target=call_loop, args=(port, ready, stop, send))
            client.start()
            ready.wait(60)
            window = time.time()
            done, durations = 0, []
            t_end = time.perf_counter() + seconds
            variant = 0
            while time.perf_counter() < t_end:
                if phase == "steady":  # the proxy answers the same /metrics polls as below
                    reloads(admin)
                    time.sleep(0.05)
                    continue
                variant += 1
                before = reloads(admin)
                t0 = time.perf_counter()
                write_policy(policy, tools, rules, changed=variant % tools, files=files, head=False)
                while reloads(admin) == before:
                    time.sleep(0.05)
                durations.append(time.perf_counter() - t0)
                done += 1
            stop.set()
            lat = receive.recv()
            client.join()
            stalls = loop_lags(lagfile, window, time.time())
            results[phase] = lat
            extra = ""
            if durations:
                extra = (f", {done} reloads, edit to reload done: median "
                         f"{statistics.median(durations):.2f} s (includes the 0.2 s poll)")
            print(f"{phase}: {len(lat)} calls, p50 {p(lat, 0.5):.2f} ms, p99 {p(lat, 0.99):.2f} ms, "
                  f"max {max(lat) * 1000:.1f} ms{extra}", flush=True)
            rss = lagfile.with_suffix(".rss")
            resident = (f", resident set {int(rss.read_text()) * os.sysconf('SC_PAGE_SIZE') / 1e6:.0f} MB"
                        if rss.exists() else "")
            print(f"  loop lag: max {max(stalls, default=0) * 1000:.1f} ms, "
                  f"{sum(1 for x in stalls if x > 0.01)} stalls over 10 ms, "
                  f"{sum(1 for x in stalls if x > 0.05)} over 50 ms{resident}", flush=True)
        ratio = p(results["reloading"], 0.99) / max(p(results["steady"], 0.99), 1e-9)
        print(f"p99 during reloads / steady p99: {ratio:.2f}x", flush=True)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tools", default="10,100,1000", help="comma-separated tool counts")
    parser.add_argument("--rules", type=int, default=15, help="rules per tool")
    parser.add_argument("--files", default="1",
                        help="comma-separated file counts to spread the tools over")
    parser.add_argument("--traffic", type=float, default=0.0,
                        help="seconds of calls through the real proxy per phase (steady, reloading)")
    parser.add_argument("--traffic-only", action="store_true", help="skip the load table")
    parser.add_argument("--engine", default="auto", help="CEL engine: auto, cel-cpp, cel-python")
    parser.add_argument("--profile", type=int, default=0, help="print the top N functions (cProfile)")
    args = parser.parse_args()
    counts = [int(n) for n in args.tools.split(",")]
    print("| tools x rules | files | cold load | cold chain | cold CPU | cold CPU here "
          "| reload (1 tool changed) | reload chain | reload CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in counts if not args.traffic_only else []:
        for files in [int(f) for f in args.files.split(",")]:
            r = measure(n, args.rules, args.engine, args.profile, files=files)
            print(f"| {n} x {args.rules} | {files} | {r['cold_load']:.2f} s | "
                  f"{r['cold_chain']:.2f} s | {r['cold_cpu']:.2f} s | {r['cold_here']:.2f} s | "
                  f"{r['reload_load']:.2f} s | "
                  f"{r['reload_chain']:.2f} s | {r['reload_cpu']:.2f} s |", flush=True)
    for files in [int(f) for f in args.files.split(",")] if args.traffic else []:
        run_traffic(max(counts), args.rules, files, args.traffic)


if __name__ == "__main__":
    main()
