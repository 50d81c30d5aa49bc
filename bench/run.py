"""Reproducible benchmark: direct vs nginx vs bare aiohttp passthrough vs the full envelope.

    python bench/run.py            # full matrix, 10 s per cell, writes bench/RESULTS.md
    python bench/run.py --quick    # 3 s per cell
    python bench/run.py --profile 10   # also take a py-spy profile of the envelope under load
    python bench/run.py --mix --quick  # the realistic mix and the Python peers (bench/mix.py)

Every cell drives one path with `wrk` (a fixed stateless-revision MCP `tools/call`) and reads
the proxy processes' CPU time from /proc before and after. Before each cell one request through
the path must return HTTP 200 and, for the envelope, a result that is not a refusal; after it,
wrk must report no non-2xx responses or socket errors and the envelope's metrics must show only
allowed decisions. Any failure aborts the run: a benchmark of refusals would be a lie.
See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
POLICY_DIR = BENCH / "policy"
TOOL = "search_issues"
UPSTREAM_NAME = "bench"
PROTOCOL = "2026-07-28"
ARGUMENTS = {
    "repo": "corp/api-gateway",
    "query": "flaky test in checkout service",
    "state": "open",
    "limit": 20,
    "labels": ["bug", "ci"],
}
BODY = json.dumps({
    "jsonrpc": "2.0", "id": 1, "method": "tools/call",
    "params": {
        "name": TOOL, "arguments": ARGUMENTS,
        "_meta": {"io.modelcontextprotocol/protocolVersion": PROTOCOL},
    },
}, separators=(",", ":"))
HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": PROTOCOL,
    "Mcp-Method": "tools/call",
    "Mcp-Name": TOOL,
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
CONFIGS = ("direct", "nginx", "passthrough", "noflow", "baseline", "envelope", "envelope-fast")
# configs served by envelope-proxy; `envelope-fast` is `envelope` with `listener: fast`
ENVELOPES = ("noflow", "baseline", "envelope", "envelope-fast")
# `--baseline REV`: the envelope config served by the code of git revision REV (a worktree in
# the run's temporary directory), so a change's cost is measured against its base in one run.
BASELINE: dict[str, str] = {}
TARGET_THROUGHPUT = 0.9
TARGET_P50_MS = 0.3
ALLOWED = "allow/ok"
DISCONNECTED = "error/client_disconnected"
TRANSPORT: str | None = None  # --envelope-transport; None: the runtime config default
LISTENER: str | None = None  # --listener: the envelope configs' MCP listener; None: the default
# `dataflow:` settings every envelope config's policy adds to the bench policy (mix.py
# --ledger-cap); empty: the bench policy as it is.
DATAFLOW: dict[str, object] = {}


class BenchError(RuntimeError):
    """The benchmark cannot produce an honest number."""


# ---- processes ---------------------------------------------------------------------------


def free_port(count: int = 1) -> int:
    """A port p such that p .. p+count-1 are free now (racy, good enough on a quiet machine)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + count > 65535:
            continue
        ok = True
        for extra in range(1, count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + extra))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise BenchError("no free port")


def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants, from /proc/<pid>/task/<tid>/children."""
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def tree_cpu(roots: list[int]) -> dict[int, float]:
    return {p: cpu_seconds(p) for root in roots for p in tree_pids(root)}


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(t - before.get(p, 0.0) for p, t in after.items())


@dataclass
class Service:
    """Processes started for one path; stopped by process group (they run in their own session)."""

    name: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start(self, argv: list[str], log: Path, **kw: object) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            kw.setdefault("cwd", ROOT)
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    **kw)  # type: ignore[call-overload]
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def log_tail(self) -> str:
        return "\n".join(f"--- {log} ---\n" + log.read_text(errors="replace")[-3000:] for log in self.logs if log.exists())

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs.clear()


def wait_port(port: int, service: Service, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive():
            raise BenchError(f"{service.name} exited during startup:\n{service.log_tail()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise BenchError(f"{service.name} did not listen on port {port} within {timeout:g}s:\n{service.log_tail()}")


# ---- the paths ---------------------------------------------------------------------------


@dataclass
class Route:
    config: str
    workers: int
    url: str
    service: Service | None  # None: direct (no proxy process)
    admin_ports: list[int] = field(default_factory=list)


def start_upstream(tmp: Path) -> tuple[Service, str]:
    port = free_port()
    svc = Service("upstream")
    svc.start([sys.executable, str(BENCH / "upstream.py"), "--port", str(port)], tmp / "upstream.log")
    wait_port(port, svc)
    return svc, f"http://127.0.0.1:{port}/mcp"


NGINX_CONF = """\
{user}worker_processes {workers};
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream mcp_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port}{reuseport};
        location / {{
            proxy_pass http://mcp_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(tmp: Path, upstream_url: str, workers: int) -> Route:
    port = free_port()
    ntmp = tmp / f"nginx-w{workers}"
    ntmp.mkdir()
    conf = ntmp / "nginx.conf"
    upstream_port = int(upstream_url.split(":")[2].split("/")[0])
    conf.write_text(NGINX_CONF.format(
        user="user root;\n" if os.geteuid() == 0 else "", workers=workers, tmp=ntmp, port=port,
        upstream_port=upstream_port, reuseport=" reuseport" if workers > 1 else "",
    ))
    svc = Service(f"nginx (workers {workers})")
    svc.start([shutil.which("nginx") or "nginx", "-p", str(ntmp), "-e", str(ntmp / "nginx-error.log"),
               "-c", str(conf), "-g", "daemon off;"], ntmp / "nginx.log")
    wait_port(port, svc)
    return Route("nginx", workers, f"http://127.0.0.1:{port}/mcp", svc)


def start_passthrough(tmp: Path, upstream_url: str, workers: int) -> Route:
    port = free_port()
    svc = Service(f"passthrough (workers {workers})")
    for i in range(workers):
        argv = [sys.executable, str(BENCH / "passthrough.py"), "--port", str(port), "--upstream", upstream_url]
        if workers > 1:
            argv.append("--reuse-port")
        svc.start(argv, tmp / f"passthrough-w{workers}-{i}.log")
    wait_port(port, svc)
    time.sleep(0.3 if workers > 1 else 0)  # let every process bind before the first request
    return Route("passthrough", workers, f"http://127.0.0.1:{port}/mcp", svc)


def noflow_policy(tmp: Path) -> Path:
    """The bench policy plus `dataflow: {mode: off}`: the envelope without data-flow tracking
    (the default, with no `dataflow:` section, is shadow: every call's untrusted output is
    fingerprinted into the run's ledger; all calls share one run, the static principal)."""
    return policy_with(tmp, "noflow", {**DATAFLOW, "mode": "off"})


def policy_with(tmp: Path, name: str, dataflow: dict[str, object]) -> Path:
    """A copy of the bench policy plus a file holding the `dataflow:` section (the bench policy
    has none: one file only may)."""
    directory = tmp / f"policy-{name}"
    directory.mkdir(exist_ok=True)
    for f in POLICY_DIR.glob("*.yaml"):
        (directory / f.name).write_text(f.read_text())
    (directory / f"zz-{name}.yaml").write_text(json.dumps({"version": 1, "dataflow": dataflow}))
    return directory


def envelope_policy(tmp: Path, name: str) -> Path:
    """The policy directory an envelope config `name` serves."""
    if name == "noflow":
        return noflow_policy(tmp)
    return policy_with(tmp, "dataflow", DATAFLOW) if DATAFLOW else POLICY_DIR


def envelope_config(tmp: Path, upstream_url: str, workers: int, name: str = "envelope") -> tuple[Path, int, int]:
    port, admin = free_port(), free_port(workers)
    state = tmp / f"{name}-state-w{workers}"
    config = {
        "listen": f"127.0.0.1:{port}",
        "admin": f"127.0.0.1:{admin}",
        "policies": str(envelope_policy(tmp, name)),
        "state_dir": str(state),
        "identity": {"mode": "static", "principal": "bench-agent", "groups": ["engineering"]},
        "upstreams": {UPSTREAM_NAME: {"url": upstream_url}},
        "reload_interval": 0,
        "workers": workers,
        "log_level": "warning",
    }
    if TRANSPORT:
        config["transport"] = TRANSPORT
    if name == "envelope-fast":
        config["listener"] = "fast"
    elif name == "envelope-memory":  # the same envelope with the ledger in process memory
        config["store"] = {"kind": "memory"}
    elif LISTENER:
        config["listener"] = LISTENER
    path = tmp / f"{name}-w{workers}.json"
    path.write_text(json.dumps(config, indent=2))
    return path, port, admin


def start_envelope(tmp: Path, upstream_url: str, workers: int, name: str = "envelope") -> Route:
    config, port, admin = envelope_config(tmp, upstream_url, workers, name)
    svc = Service(f"{name} (workers {workers})")
    baseline = {"env": {**os.environ, "PYTHONPATH": BASELINE["tree"]}, "cwd": BASELINE["tree"]} \
        if name == "baseline" else {}
    svc.start([sys.executable, "-m", "proxy", "serve", "--config", str(config)], tmp / f"{name}-w{workers}.log",
              **baseline)
    wait_port(port, svc)
    admins = [admin + i for i in range(workers)]
    for a in admins:
        wait_port(a, svc)
    return Route(name, workers, f"http://127.0.0.1:{port}/mcp/{UPSTREAM_NAME}", svc, admins)


def start_noflow(tmp: Path, upstream_url: str, workers: int) -> Route:
    return start_envelope(tmp, upstream_url, workers, "noflow")


def start_envelope_fast(tmp: Path, upstream_url: str, workers: int) -> Route:
    return start_envelope(tmp, upstream_url, workers, "envelope-fast")


def start_baseline(tmp: Path, upstream_url: str, workers: int) -> Route:
    return start_envelope(tmp, upstream_url, workers, "baseline")


def checkout_baseline(tmp: Path, rev: str) -> None:
    """A worktree of `rev` (removed with the run's temporary directory) for the baseline."""
    tree = tmp / "baseline-tree"
    done = subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], capture_output=True,
                          text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise BenchError(f"cannot check out baseline {rev}: {done.stderr.strip()}")
    head = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, cwd=ROOT,
                          check=False).stdout.strip()
    BASELINE.update(tree=str(tree), rev=head or rev)


# ---- verification ------------------------------------------------------------------------


def one_call(url: str, timeout: float = 10) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, data=BODY.encode(), headers=HEADERS, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"body": exc.read().decode(errors="replace")}


def verify_path(path: Route) -> None:
    """One request (several for multi-process paths) must be HTTP 200 and not a refusal."""
    for _ in range(2 * path.workers + 1):
        status, reply = one_call(path.url)
        result = reply.get("result")
        if status != 200 or not isinstance(result, dict) or result.get("isError") is not False:
            raise BenchError(f"{path.config} (workers {path.workers}) did not return an allowed result: "
                             f"HTTP {status} {json.dumps(reply)[:800]}")


_SAMPLE = re.compile(r'^envelope_decisions_total\{([^}]*)\}\s+([0-9.e+]+)$', re.M)


def envelope_decisions(path: Route) -> dict[str, float]:
    """"verdict/code" -> count, summed over every worker's admin /metrics."""
    totals: dict[str, float] = {}
    for port in path.admin_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for labels, value in _SAMPLE.findall(text):
            label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            key = f"{label.get('verdict', '?')}/{label.get('code', '?')}"
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


# ---- wrk -----------------------------------------------------------------------------------


WRK_LUA = """\
wrk.method = "POST"
wrk.body = {body}
{headers}
"""


def lua_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_wrk_script(tmp: Path) -> Path:
    headers = "\n".join(f"wrk.headers[{lua_string(k)}] = {lua_string(v)}" for k, v in HEADERS.items())
    script = tmp / "tools_call.lua"
    script.write_text(WRK_LUA.format(body=lua_string(BODY), headers=headers))
    return script


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def to_ms(value: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(us|ms|s|m|h)", value)
    if not m:
        raise BenchError(f"cannot parse wrk latency {value!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class WrkResult:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    output: str


def parse_wrk(out: str) -> WrkResult:
    rps = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    total = re.search(r"(\d+) requests in ([0-9.]+)(us|ms|s|m)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    if not (rps and total and p50 and p99):
        raise BenchError(f"cannot parse wrk output:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return WrkResult(
        requests=int(total.group(1)),
        seconds=to_ms(total.group(2) + total.group(3)) / 1e3,
        rps=float(rps.group(1)),
        p50_ms=to_ms(p50.group(1)),
        p99_ms=to_ms(p99.group(1)),
        non_2xx=int(non2xx.group(1)) if non2xx else 0,
        socket_errors=sum(int(x) for x in sock.groups()) if sock else 0,
        output=out,
    )


def wrk_argv(url: str, concurrency: int, seconds: float, script: Path) -> list[str]:
    return ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--latency",
            "--timeout", "10s", "-s", str(script), url]


def run_wrk(url: str, concurrency: int, seconds: float, script: Path) -> WrkResult:
    proc = subprocess.run(wrk_argv(url, concurrency, seconds, script), capture_output=True, text=True,
                          timeout=seconds + 60, check=False)
    if proc.returncode != 0:
        raise BenchError(f"wrk failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return parse_wrk(proc.stdout)


# ---- cells ---------------------------------------------------------------------------------


@dataclass
class Cell:
    config: str
    workers: int
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    proxy_cpu_us: float | None
    upstream_cpu_us: float
    wrk_cmd: str


def measure(path: Route, upstream: Service, concurrency: int, args: argparse.Namespace, script: Path) -> Cell:
    verify_path(path)
    if args.warmup > 0:
        run_wrk(path.url, concurrency, args.warmup, script)
    before_decisions = envelope_decisions(path) if path.config in ENVELOPES else {}
    proxy_roots = path.service.pids if path.service else []
    p0, u0 = tree_cpu(proxy_roots), tree_cpu(upstream.pids)
    result = run_wrk(path.url, concurrency, args.duration, script)
    p1, u1 = tree_cpu(proxy_roots), tree_cpu(upstream.pids)
    label = f"{path.config} workers={path.workers} c={concurrency}"
    if result.non_2xx or result.socket_errors:
        raise BenchError(f"{label}: wrk saw {result.non_2xx} non-2xx responses and {result.socket_errors} "
                         f"socket errors:\n{result.output}")
    if result.requests == 0:
        raise BenchError(f"{label}: no requests completed:\n{result.output}")
    if path.config in ENVELOPES:
        after = envelope_decisions(path)
        delta = {v: after.get(v, 0.0) - before_decisions.get(v, 0.0) for v in after}
        # wrk closes its connections with calls in flight when the time is up: at most one
        # `client_disconnected` per connection (audited, never a refusal of a call it counted).
        disconnected = delta.pop(DISCONNECTED, 0.0)
        refused = {v: n for v, n in delta.items() if v != ALLOWED and n}
        if refused or disconnected > concurrency:
            raise BenchError(f"{label}: the envelope made non-allow decisions during the cell: "
                             f"{refused or {DISCONNECTED: disconnected}}")
        if delta.get(ALLOWED, 0.0) < result.requests:
            raise BenchError(f"{label}: {delta.get(ALLOWED, 0.0):.0f} allow decisions for {result.requests} requests")
    verify_path(path)
    cell = Cell(
        config=path.config, workers=path.workers, concurrency=concurrency, rps=result.rps,
        p50_ms=result.p50_ms, p99_ms=result.p99_ms, requests=result.requests,
        proxy_cpu_us=cpu_delta(p0, p1) / result.requests * 1e6 if path.service else None,
        upstream_cpu_us=cpu_delta(u0, u1) / result.requests * 1e6,
        wrk_cmd=shlex.join(wrk_argv(path.url, concurrency, args.duration, Path("tools_call.lua"))),
    )
    cpu = f"{cell.proxy_cpu_us:8.1f} us/call" if cell.proxy_cpu_us is not None else "       -        "
    print(f"  {label:34} {cell.rps:9.0f} req/s  p50 {cell.p50_ms:7.3f} ms  p99 {cell.p99_ms:7.3f} ms  "
          f"proxy CPU {cpu}", flush=True)
    return cell


@contextlib.contextmanager
def running(path: Route) -> Iterator[Route]:
    try:
        yield path
    finally:
        if path.service is not None:
            path.service.stop()


def run_matrix(args: argparse.Namespace, tmp: Path, upstream: Service, upstream_url: str,
               script: Path) -> list[Cell]:
    cells: list[Cell] = []
    starters = {"nginx": start_nginx, "passthrough": start_passthrough, "envelope": start_envelope,
                "noflow": start_noflow, "baseline": start_baseline,
                "envelope-fast": start_envelope_fast}
    if "direct" in args.configs:
        print("direct (workers: n/a)", flush=True)
        direct = Route("direct", 1, upstream_url, None)
        cells.extend(measure(direct, upstream, c, args, script) for c in args.concurrency)
    for workers in args.workers:
        for config in args.configs:
            if config == "direct":
                continue
            print(f"{config} (workers {workers})", flush=True)
            with running(starters[config](tmp, upstream_url, workers)) as path:
                cells.extend(measure(path, upstream, c, args, script) for c in args.concurrency)
    return cells


# ---- profile -------------------------------------------------------------------------------


def profile_envelope(args: argparse.Namespace, tmp: Path, upstream_url: str, script: Path) -> str:
    """py-spy the envelope (1 worker) under wrk -c32; the top frames by self time as markdown."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        raise BenchError("--profile needs py-spy: pip install py-spy")
    out = BENCH / "out" / "profile-envelope.speedscope.json"
    out.parent.mkdir(exist_ok=True)
    concurrency = max(args.concurrency)
    with running(start_envelope(tmp, upstream_url, 1)) as path:
        verify_path(path)
        run_wrk(path.url, concurrency, 1, script)
        assert path.service is not None
        pid = path.service.pids[0]
        load = subprocess.Popen(wrk_argv(path.url, concurrency, args.profile + 4, script),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1)
            spy = subprocess.run([pyspy, "record", "--format", "speedscope", "--rate", "250", "--nonblocking",
                                  "--duration", str(args.profile), "--pid", str(pid), "-o", str(out)],
                                 capture_output=True, text=True, check=False)
        finally:
            load.wait(args.profile + 30)
        if spy.returncode != 0 or not out.exists():
            raise BenchError(f"py-spy failed:\n{spy.stdout}\n{spy.stderr}")
    return summarize_speedscope(out, top=15)


def summarize_speedscope(path: Path, top: int = 15) -> str:
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    self_w: dict[int, float] = {}
    total_w: dict[tuple[str, str], float] = {}

    def func(i: int) -> tuple[str, str]:
        return str(frames[i]["name"]), str(frames[i].get("file", ""))

    total = 0.0
    for prof in data["profiles"]:
        for stack, weight in zip(prof["samples"], prof["weights"], strict=True):
            if not stack:
                continue
            total += weight
            self_w[stack[-1]] = self_w.get(stack[-1], 0.0) + weight
            for fn in {func(f) for f in stack}:
                total_w[fn] = total_w.get(fn, 0.0) + weight

    def short(file: str) -> str:
        return re.sub(r".*/(site-packages|lib/python3\.\d+)/", "", file.replace(str(ROOT) + "/", ""))

    def name(i: int) -> str:
        line = frames[i].get("line")
        return f"`{frames[i]['name']}` ({short(str(frames[i].get('file', '')))}{':' + str(line) if line else ''})"

    samples = sum(len(p["samples"]) for p in data["profiles"])
    lines = [f"Samples: {samples} (py-spy, 250 Hz, `--nonblocking`); file: `{path.name}` "
             "(open in https://www.speedscope.app).", "",
             f"Top {top} frames by self time:", "", "| self % | frame |", "|---:|---|"]
    for i, w in sorted(self_w.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {100 * w / total:.1f} | {name(i)} |")
    lines += ["", f"Top {top} project functions (`proxy/`) by inclusive time:", "", "| incl % | frame |", "|---:|---|"]
    # The process's own entry frames (always 100%): the command's dispatch and `serve`.
    entry = ("/proxy/cli/__init__.py", "/proxy/cli/serve.py", "/proxy/__main__.py")
    ours = [(fn, w) for fn, w in total_w.items() if "/proxy/" in fn[1] and not fn[1].endswith(entry)]
    for (fname, file), w in sorted(ours, key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {100 * w / total:.1f} | `{fname}` ({short(file)}) |")
    return "\n".join(lines)


# ---- report --------------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import aiohttp

    try:
        import uvloop

        loop = f"uvloop {uvloop.__version__}"
    except ImportError:
        loop = "asyncio"
    check = subprocess.run([sys.executable, "-m", "proxy", "check", str(POLICY_DIR)], capture_output=True,
                           text=True, cwd=ROOT, check=False)
    if check.returncode != 0:
        raise BenchError(f"the bench policy does not load:\n{check.stdout}{check.stderr}")
    # The first line ends with the engine: "ok: <dir>: revision ..., N files (cel-cpp)".
    first = check.stdout.strip().splitlines()[0] if check.stdout.strip() else ""
    engine = re.search(r"\(([^()]*)\)\s*$", first)
    nginx = subprocess.run(["nginx", "-v"], capture_output=True, text=True, check=False)
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    return {
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "event loop": loop,
        "cel engine": engine.group(1) if engine else "unknown",
        "envelope transport": TRANSPORT or envelope_transport(),
        "envelope code": code_fingerprint(),
        "nginx": (nginx.stderr or nginx.stdout).strip().split(":", 1)[-1].strip(),
        "wrk": (wrk.stdout or wrk.stderr).strip().splitlines()[0].split(" [")[0] if (wrk.stdout or wrk.stderr) else "?",
    }


def code_fingerprint() -> str:
    """git HEAD plus a digest of every proxy/*.py as it is on disk now (the tree may be dirty)."""
    digest = hashlib.sha256()
    for file in sorted((ROOT / "proxy").rglob("*.py")):
        digest.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes() + b"\0")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=False).stdout.strip() or "?"
    return f"git {head}, proxy/ sha256 {digest.hexdigest()[:12]}"


def envelope_transport() -> str:
    from proxy.config import Config

    return str(getattr(Config(), "transport", "aiohttp"))


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def verdict(ok: bool) -> str:
    return "**MET**" if ok else "**NOT MET**"


def report(cells: list[Cell], args: argparse.Namespace, info: dict[str, str], profile: str | None) -> str:
    by = {(c.config, c.workers, c.concurrency): c for c in cells}
    direct = {c.concurrency: c for c in cells if c.config == "direct"}
    lines = [
        "# envelope-proxy benchmark results",
        "",
        f"Date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "Command (from the repository root, venv active):",
        "",
        "```",
        shlex.join(["python", *sys.argv]),
        "```",
        "",
        "Machine: " + ", ".join(f"{k}: {v}" for k, v in info.items()),
        "",
        f"Each cell: `wrk -t1 -c<concurrency> -d{max(1, round(args.duration))}s --latency` "
        f"after a {args.warmup:g} s warm-up, POSTing one fixed stateless-revision (`{PROTOCOL}`) "
        f"`tools/call` of `{TOOL}` to a raw-asyncio fake MCP upstream (bench/upstream.py). "
        "Proxy CPU = utime+stime of every proxy process (nginx master+workers, every passthrough "
        "process, envelope-proxy parent+workers) from /proc, divided by the requests of the cell; "
        "upstream CPU likewise for the fake upstream. Load generator, upstream and proxy share the "
        f"machine's {info['nproc']} CPUs, so multi-worker rows compete with wrk and the upstream for cores.",
        "",
        "Envelope: bench/policy/bench.yaml (policy schema with 5 typed properties, one CEL `allow`, "
        "15 forbid rules that do not match and 5 allow rules of which the last matches), static "
        "identity, audit log on (one hash-chained JSONL file per worker), Prometheus metrics, "
        "data-flow tracking in its default shadow mode (`noflow`: the same with `dataflow: {mode: off}`), "
        "policy reload polling off. Every cell was verified: HTTP 200 and `isError: false` before "
        "and after, no non-2xx or socket errors in wrk, and only `allow` decisions in the envelope's metrics "
        "(besides at most one `client_disconnected` per connection wrk drops mid-call when its time is up).",
    ]
    for workers in args.workers:
        lines += ["", f"## workers = {workers}", "",
                  "| config | concurrency | req/s | p50 ms | p99 ms | proxy CPU µs/call | upstream CPU µs/call |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for config in args.configs:
            for conc in args.concurrency:
                c = direct.get(conc) if config == "direct" else by.get((config, workers, conc))
                if c is None:
                    continue
                name = ("direct (no proxy)" if config == "direct"
                        else f"baseline (git {BASELINE.get('rev', '?')})" if config == "baseline" else config)
                lines.append(f"| {name} | {conc} | {fmt(c.rps, 0)} | {fmt(c.p50_ms, 3)} | {fmt(c.p99_ms, 3)} "
                             f"| {fmt(c.proxy_cpu_us)} | {fmt(c.upstream_cpu_us)} |")
        if "direct" in args.configs and workers != args.workers[0]:
            lines += ["", "(direct has no workers dimension: the same measurement in every table.)"]
    lines += ["", "## Targets", ""]
    if {"envelope", "passthrough"} <= set(args.configs):
        lines += ["| workers | concurrency | envelope / passthrough req/s (target >= 0.9) | result |", "|---:|---:|---:|---|"]
        for workers in args.workers:
            for conc in args.concurrency:
                env, base = by.get(("envelope", workers, conc)), by.get(("passthrough", workers, conc))
                if env and base:
                    ratio = env.rps / base.rps
                    lines.append(f"| {workers} | {conc} | {ratio:.2f} | {verdict(ratio >= TARGET_THROUGHPUT)} |")
        lines += ["", "| workers | envelope p50 - passthrough p50 at concurrency 1 (target <= 0.3 ms) | result |",
                  "|---:|---:|---|"]
        for workers in args.workers:
            env, base = by.get(("envelope", workers, 1)), by.get(("passthrough", workers, 1))
            if env and base:
                diff = env.p50_ms - base.p50_ms
                lines.append(f"| {workers} | {diff:+.3f} ms | {verdict(diff <= TARGET_P50_MS)} |")
    if {"envelope", "nginx"} <= set(args.configs):
        lines += ["", "| workers | concurrency | nginx CPU µs/call | passthrough CPU µs/call | envelope CPU µs/call "
                  "| envelope / nginx | envelope - passthrough (the envelope's own cost) |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for workers in args.workers:
            for conc in args.concurrency:
                ng, env = by.get(("nginx", workers, conc)), by.get(("envelope", workers, conc))
                base = by.get(("passthrough", workers, conc))
                if ng and env and ng.proxy_cpu_us and env.proxy_cpu_us:
                    own = f"{env.proxy_cpu_us - base.proxy_cpu_us:+.1f} µs" if base and base.proxy_cpu_us else "-"
                    lines.append(f"| {workers} | {conc} | {fmt(ng.proxy_cpu_us)} | "
                                 f"{fmt(base.proxy_cpu_us if base else None)} | {fmt(env.proxy_cpu_us)} | "
                                 f"{env.proxy_cpu_us / ng.proxy_cpu_us:.1f}x | {own} |")
    if {"envelope", "baseline"} <= set(args.configs):
        lines += ["", f"Against the baseline (the same envelope config served by git {BASELINE.get('rev', '?')}, "
                  "in the same run):", "",
                  "| workers | concurrency | envelope / baseline req/s | envelope - baseline CPU µs/call | CPU within 5% |",
                  "|---:|---:|---:|---:|---|"]
        for workers in args.workers:
            for conc in args.concurrency:
                env, old = by.get(("envelope", workers, conc)), by.get(("baseline", workers, conc))
                if env and old and env.proxy_cpu_us and old.proxy_cpu_us:
                    ok = env.proxy_cpu_us <= old.proxy_cpu_us * 1.05
                    lines.append(f"| {workers} | {conc} | {env.rps / old.rps:.2f} | "
                                 f"{env.proxy_cpu_us - old.proxy_cpu_us:+.1f} µs | {verdict(ok)} |")
    if {"envelope", "noflow"} <= set(args.configs):
        lines += ["", "Data-flow tracking (`envelope` is the default, shadow: every call's untrusted output "
                  "is fingerprinted into the run's ledger in the sqlite store before it is delivered; "
                  "`noflow` is the same policy with `dataflow: {mode: off}`; all calls share one run):", "",
                  "| workers | concurrency | envelope / noflow req/s | envelope - noflow CPU µs/call |",
                  "|---:|---:|---:|---:|"]
        for workers in args.workers:
            for conc in args.concurrency:
                flow, off = by.get(("envelope", workers, conc)), by.get(("noflow", workers, conc))
                if flow and off:
                    cpu = (f"{flow.proxy_cpu_us - off.proxy_cpu_us:+.1f} µs"
                           if flow.proxy_cpu_us and off.proxy_cpu_us else "-")
                    lines.append(f"| {workers} | {conc} | {flow.rps / off.rps:.2f} | {cpu} |")
    if {"envelope", "envelope-fast"} <= set(args.configs):
        lines += ["", "The MCP listener (`envelope-fast` is `envelope` served by `listener: fast`, "
                  "`envelope` by the listener the --listener option or the default picks):", "",
                  "| workers | concurrency | fast / envelope req/s | fast CPU µs/call | envelope CPU µs/call | "
                  "fast / envelope CPU |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for workers in args.workers:
            for conc in args.concurrency:
                fast, env = by.get(("envelope-fast", workers, conc)), by.get(("envelope", workers, conc))
                if fast and env and fast.proxy_cpu_us and env.proxy_cpu_us:
                    lines.append(f"| {workers} | {conc} | {fast.rps / env.rps:.2f} | {fmt(fast.proxy_cpu_us)} | "
                                 f"{fmt(env.proxy_cpu_us)} | {fast.proxy_cpu_us / env.proxy_cpu_us:.2f} |")
    if profile:
        lines += ["", "## Where the envelope's time goes", "", profile]
    return "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per cell (default 10)")
    p.add_argument("--quick", action="store_true", help="3 s per cell, 0.5 s warm-up")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell (default 2; --quick 1)")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    p.add_argument("--concurrency", default="1,32", help="comma-separated connection counts (default 1,32)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                   help="after the matrix, py-spy the envelope (1 worker) under load for SECONDS")
    p.add_argument("--envelope-transport", choices=["fast", "aiohttp"], default=None,
                   help="the envelope's upstream transport (default: the runtime config's default)")
    p.add_argument("--listener", choices=["fast", "aiohttp"], default=None,
                   help="the MCP listener of the envelope, noflow and baseline configs (default: the "
                        "runtime config's default); `envelope-fast` is always fast")
    p.add_argument("--output", type=Path, default=BENCH / "RESULTS.md", help="report file (default bench/RESULTS.md)")
    p.add_argument("--baseline", metavar="REV", default=None,
                   help="also serve the envelope config from git revision REV (config `baseline`), in the same run")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 3.0
    if args.warmup is None:
        args.warmup = 1.0 if args.quick else 2.0
    args.workers = [int(x) for x in args.workers.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.configs = [x.strip() for x in args.configs.split(",")]
    if args.baseline is None:
        args.configs = [c for c in args.configs if c != "baseline"]
    elif "baseline" not in args.configs:
        args.configs.insert(args.configs.index("envelope") if "envelope" in args.configs else len(args.configs),
                            "baseline")
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    global TRANSPORT, LISTENER
    argv = sys.argv[1:] if argv is None else argv
    if "--mix" in argv:  # the realistic mix and the Python peers: bench/mix.py, its own options
        import mix

        return mix.main([a for a in argv if a != "--mix"])
    args = parse_args(argv)
    TRANSPORT = args.envelope_transport
    LISTENER = args.listener
    missing = [tool for tool in ("wrk", "nginx") if shutil.which(tool) is None]
    if missing:
        print(f"bench: {' and '.join(missing)} not found on PATH. Install them: apt-get install nginx wrk",
              file=sys.stderr)
        return 2
    try:
        info = machine_info()
        with tempfile.TemporaryDirectory(prefix="envelope-bench-") as tmpdir:
            tmp = Path(tmpdir)
            if args.baseline is not None:
                checkout_baseline(tmp, args.baseline)
            script = write_wrk_script(tmp)
            upstream, upstream_url = start_upstream(tmp)
            try:
                cells = run_matrix(args, tmp, upstream, upstream_url, script)
                profile = profile_envelope(args, tmp, upstream_url, script) if args.profile else None
            finally:
                upstream.stop()
    except BenchError as exc:
        print(f"bench: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if BASELINE:
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=False, capture_output=True)
    text = report(cells, args, info, profile)
    if code_fingerprint() != info["envelope code"]:
        warning = ("proxy/ changed on disk while the benchmark ran: the envelope rows may mix code versions; "
                   "run it again on a quiet tree")
        print(f"bench: WARNING: {warning}", file=sys.stderr)
        text = text.replace("\n## workers", f"\n**WARNING: {warning}.**\n\n## workers", 1)
    args.output.write_text(text)
    print(f"\nwrote {args.output}\n")
    print(text[text.index("## Targets"):])
    return 0


if __name__ == "__main__":
    sys.exit(main())
