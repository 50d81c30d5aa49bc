"""The realistic mix: what users pay, against the Python proxies they would pick instead.

    python bench/mix.py --quick              # a few seconds per cell (noisy: see the report)
    python bench/mix.py                      # 10 s per cell
    python bench/mix.py --quick --profile 10 # plus py-spy of the full envelope under wrk -c16
    python bench/mix.py --quick --sizes 5000 --configs passthrough,noflow --concurrency 1 --workers 1 \
        --profile 15 --profile-config noflow --profile-concurrency 1   # py-spy another part, at c=1
    python bench/run.py --mix --quick        # the same, from run.py

The cells: tool outputs of 200 B, 5 KB and 50 KB of untrusted text (bench/mix_upstream.py, a
different window of prose on every call; the envelope's policy marks the tool `output:
untrusted`, so the full envelope fingerprints every output into the run's ledger before it is
delivered); a stateless client (2026-07-28, no session) and a session client (2025-11-25,
`initialize` then `Mcp-Session-Id`, one session shared by every wrk connection); c=1 and c=32;
1 and 2 workers for the passthrough and the envelope. Paths: direct, the bare aiohttp
passthrough (bench/passthrough.py), the full envelope (bench/policy/bench.yaml), fastmcp's
proxy with a shared upstream session (bench/peer_fastmcp.py) and mcp-proxy (the PyPI package:
its HTTP server in front of its own stdio-to-HTTP client, the way it reaches a remote server).
The peers are one process each (no workers option), so they appear in the 1-worker rows only.

The peers run from the bench's own venvs, created on first run and gitignored: fastmcp (which
pulls mcp 2.x) in bench/.venv-peers, and mcp-proxy, whose current release imports a name mcp 2.x
removed, in bench/.venv-mcp-proxy with `mcp<2`. A peer cell that fails (a verification call or
wrk errors) is reported with the reply, not measured; a failing envelope or passthrough cell
aborts the run.

Honesty checks as in run.py: before and after each cell one call must be HTTP 200, `isError:
false` and carry the full output; wrk must see no non-2xx or socket errors; the envelope's
metrics must show one `allow` per request. The section it writes replaces the one between
`<!-- mix:begin -->` and `<!-- mix:end -->` in bench/RESULTS.md (appended when absent).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench/ is not a package: run.py, its sibling, is imported from the path set above.
import run as R

BENCH = R.BENCH
SIZES = (200, 5000, 50000)
CLIENTS = ("stateless", "session")
CONFIGS = ("direct", "passthrough", "envelope", "fastmcp", "mcp-proxy")
# Opt-in (`--configs`): the full envelope taken apart, for "where the envelope's CPU goes".
# `noflow`: the same policy with `dataflow: {mode: off}`; `envelope-memory`: the full envelope
# with the ledger in process memory (`store: {kind: memory}`) instead of the SQLite file.
PARTS = ("noflow", "envelope-memory")
ENVELOPES = ("envelope", *PARTS)
PEERS = ("fastmcp", "mcp-proxy")
STATELESS = "2026-07-28"
SESSION = "2025-11-25"
PEERS_VENV = BENCH / ".venv-peers"
MCP_PROXY_VENV = BENCH / ".venv-mcp-proxy"
VENVS = {PEERS_VENV: ["fastmcp", "py-spy", "uvloop"], MCP_PROXY_VENV: ["mcp-proxy", "mcp<2", "uvloop"]}
BEGIN, END = "<!-- mix:begin -->", "<!-- mix:end -->"
# The targets (issue 15), checked in the report.
TARGET_PER_CPU_VS_FASTMCP = 20.0
TARGET_ADDED_P50_MS = {5000: 1.0, 50000: 5.0}
TARGET_CPU_US = 150.0
# A cell's proxy CPU is read in clock ticks: below this many ticks the per-call figure is noisy.
MIN_TICKS = 20


# ---- the two client modes ----------------------------------------------------------------


def call_body(client: str) -> str:
    params: dict[str, object] = {"name": R.TOOL, "arguments": R.ARGUMENTS}
    if client == "stateless":
        # The stateless revision's per-request envelope keys (the official SDK refuses a call
        # without clientCapabilities; the envelope does not need them).
        params["_meta"] = {
            "io.modelcontextprotocol/protocolVersion": STATELESS,
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "bench-mix", "version": "1"},
        }
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}, separators=(",", ":"))


def base_headers(client: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": STATELESS if client == "stateless" else SESSION}
    if client == "stateless":
        headers.update({"Mcp-Method": "tools/call", "Mcp-Name": R.TOOL})
    return headers


def decode(raw: bytes) -> dict[str, object]:
    """A JSON-RPC message from a JSON body or the last `data:` line of an SSE body."""
    text = raw.decode(errors="replace").strip()
    if text.startswith("{"):
        return dict(json.loads(text))
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
    if not data:
        raise ValueError(f"no JSON-RPC message in {text[:200]!r}")
    return dict(json.loads(data[-1]))


def post(url: str, body: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def open_session(url: str) -> str:
    """`initialize` + `notifications/initialized` through the path; the session id it answered."""
    init = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": SESSION, "capabilities": {}, "clientInfo": {"name": "bench-mix", "version": "1"}}})
    status, headers, raw = post(url, init, base_headers("session"))
    session = next((v for k, v in headers.items() if k.lower() == "mcp-session-id"), None)
    if status != 200 or not session:
        raise R.BenchError(f"initialize through {url}: HTTP {status}, no session id: {raw[:300]!r}")
    note = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
    status, _, raw = post(url, note, {**base_headers("session"), "Mcp-Session-Id": session})
    if status not in (200, 202):
        raise R.BenchError(f"notifications/initialized through {url}: HTTP {status}: {raw[:300]!r}")
    return session


@dataclass(frozen=True)
class Client:
    mode: str
    url: str
    body: str
    headers: dict[str, str]

    def script(self, tmp: Path, name: str) -> Path:
        headers = "\n".join(f"wrk.headers[{R.lua_string(k)}] = {R.lua_string(v)}" for k, v in self.headers.items())
        path = tmp / f"{name}.lua"
        path.write_text(R.WRK_LUA.format(body=R.lua_string(self.body), headers=headers))
        return path


def make_client(mode: str, url: str) -> Client:
    headers = base_headers(mode)
    if mode == "session":
        headers["Mcp-Session-Id"] = open_session(url)
    return Client(mode, url, call_body(mode), headers)


def check_call(client: Client, size: int) -> None:
    """One call must be HTTP 200, not an error, and deliver the whole output."""
    status, _, raw = post(client.url, client.body, client.headers)
    try:
        reply = decode(raw)
    except ValueError as exc:
        raise R.BenchError(f"{client.url} ({client.mode}): HTTP {status}: {exc}") from exc
    result = reply.get("result")
    text = ""
    if isinstance(result, dict) and isinstance(result.get("content"), list) and result["content"]:
        text = str(result["content"][0].get("text", ""))
    if status != 200 or not isinstance(result, dict) or result.get("isError") is not False or len(text) != size:
        raise R.BenchError(f"{client.url} ({client.mode}): not an allowed {size}-byte result: HTTP {status} "
                           f"{raw[:400]!r}")


# ---- paths -------------------------------------------------------------------------------


def ensure_venvs() -> None:
    """The peers' venvs (created once; never the project's venv)."""
    for venv, packages in VENVS.items():
        if (venv / "bin" / "python").exists():
            continue
        print(f"creating {venv.relative_to(R.ROOT)} ({', '.join(packages)})", flush=True)
        base = shutil.which("python3.11") or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *packages], check=True)


def start_upstream(tmp: Path, size: int) -> tuple[R.Service, str]:
    port = R.free_port()
    svc = R.Service(f"upstream ({size} B)")
    svc.start([sys.executable, str(BENCH / "mix_upstream.py"), "--port", str(port), "--size", str(size)],
              tmp / f"upstream-{size}.log")
    R.wait_port(port, svc)
    return svc, f"http://127.0.0.1:{port}/mcp"


def start_peer(config: str, tmp: Path, upstream_url: str) -> R.Route:
    port = R.free_port()
    svc = R.Service(config)
    if config == "fastmcp":
        argv = [str(PEERS_VENV / "bin" / "python"), str(BENCH / "peer_fastmcp.py"), "--port", str(port),
                "--upstream", upstream_url]
    else:
        mcp_proxy = str(MCP_PROXY_VENV / "bin" / "mcp-proxy")
        argv = [mcp_proxy, "--port", str(port), "--host", "127.0.0.1", "--",
                mcp_proxy, "--transport", "streamablehttp", upstream_url]
    svc.start(argv, tmp / f"{config}.log")
    R.wait_port(port, svc)
    return R.Route(config, 1, f"http://127.0.0.1:{port}/mcp", svc)


def fresh_state(tmp: Path, workers: int, name: str = "envelope") -> None:
    """An empty state directory (the data-flow ledger, audit) for each envelope start: a size's
    cells must not pay for the ledger an earlier size filled."""
    shutil.rmtree(tmp / f"{name}-state-w{workers}", ignore_errors=True)


def dataflow_settings(args: argparse.Namespace) -> dict[str, object]:
    """The `dataflow:` section the envelope configs' policy adds (none: the bench policy as is).
    A section with no `mode` means enforce, so the bench policy's mode (no section: shadow) is
    spelled out beside the cap: only the cap moves."""
    return {} if args.ledger_cap is None else {"mode": "shadow", "ledger_cap": args.ledger_cap}


def start_path(config: str, workers: int, tmp: Path, upstream_url: str) -> R.Route:
    if config == "direct":
        return R.Route("direct", 1, upstream_url, None)
    if config == "passthrough":
        return R.start_passthrough(tmp, upstream_url, workers)
    if config in ENVELOPES:
        fresh_state(tmp, workers, config)
        return R.start_envelope(tmp, upstream_url, workers, config)
    return start_peer(config, tmp, upstream_url)


# ---- cells -------------------------------------------------------------------------------


@dataclass
class Cell:
    size: int
    client: str
    config: str
    workers: int
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    proxy_cpu_us: float | None
    ticks: float  # proxy CPU clock ticks the cell measured (its resolution)


def timed_cell(path: R.Route, url: str, script: Path, concurrency: int, seconds: float,
               label: str) -> tuple[R.WrkResult, float]:
    """One wrk cell through `path` and the CPU seconds its processes spent. Refused (BenchError)
    unless every request was answered 2xx and, for an envelope, allowed (at most one
    `client_disconnected` per connection wrk drops when its time is up)."""
    envelope = path.config in ENVELOPES
    before = R.envelope_decisions(path) if envelope else {}
    roots = path.service.pids if path.service else []
    p0 = R.tree_cpu(roots)
    result = R.run_wrk(url, concurrency, seconds, script)
    p1 = R.tree_cpu(roots)
    if result.non_2xx or result.socket_errors or result.requests == 0:
        raise R.BenchError(f"{label}: {result.requests} requests, {result.non_2xx} non-2xx, "
                           f"{result.socket_errors} socket errors:\n{result.output}")
    if envelope:
        after = R.envelope_decisions(path)
        delta = {v: after.get(v, 0.0) - before.get(v, 0.0) for v in after}
        disconnected = delta.pop(R.DISCONNECTED, 0.0)
        refused = {v: n for v, n in delta.items() if v != R.ALLOWED and n}
        if refused or disconnected > concurrency or delta.get(R.ALLOWED, 0.0) < result.requests:
            raise R.BenchError(f"{label}: decisions {delta} for {result.requests} requests")
    return result, R.cpu_delta(p0, p1)


def measure(path: R.Route, client: Client, size: int, concurrency: int, args: argparse.Namespace,
            tmp: Path) -> Cell:
    script = client.script(tmp, f"{path.config}-{client.mode}")
    check_call(client, size)
    if args.warmup > 0:
        R.run_wrk(client.url, concurrency, args.warmup, script)
    label = f"{size:>5} B {client.mode:9} {path.config} w={path.workers} c={concurrency}"
    result, cpu = timed_cell(path, client.url, script, concurrency, args.duration, label)
    check_call(client, size)
    cell = Cell(size, client.mode, path.config, path.workers, concurrency, result.rps, result.p50_ms,
                result.p99_ms, result.requests, cpu / result.requests * 1e6 if path.service else None,
                cpu * R.CLK_TCK)
    shown = f"{cell.proxy_cpu_us:8.1f} us/call" if cell.proxy_cpu_us is not None else "-"
    print(f"  {label:44} {cell.rps:8.0f} req/s  p50 {cell.p50_ms:7.3f}  p99 {cell.p99_ms:7.3f} ms  CPU {shown}",
          flush=True)
    return cell


@contextlib.contextmanager
def running(path: R.Route) -> Iterator[R.Route]:
    try:
        yield path
    finally:
        if path.service is not None:
            path.service.stop()


def run_mix(args: argparse.Namespace, tmp: Path) -> tuple[list[Cell], dict[str, str]]:
    cells: list[Cell] = []
    unsupported: dict[str, str] = {}
    for size in args.sizes:
        upstream, upstream_url = start_upstream(tmp, size)
        try:
            for config in args.configs:
                for workers in ([1] if config in PEERS or config == "direct" else args.workers):
                    print(f"{size} B: {config} (workers {workers})", flush=True)
                    with running(start_path(config, workers, tmp, upstream_url)) as path:
                        if path.workers > 1:
                            time.sleep(0.3)
                        for mode in args.clients:
                            for conc in args.concurrency:
                                # A fresh session per cell: one cell's failure does not carry over.
                                try:
                                    client = make_client(mode, path.url)
                                    cells.append(measure(path, client, size, conc, args, tmp))
                                except R.BenchError as exc:
                                    if config not in PEERS or not path.service or not path.service.alive():
                                        raise
                                    # A peer that cannot serve this cell: said in the report, not hidden.
                                    key = f"{config} / {mode} / {size} B / c={conc}"
                                    unsupported[key] = str(exc).splitlines()[0][:300]
                                    print(f"  {key}: FAILED: {unsupported[key]}", flush=True)
        finally:
            upstream.stop()
    return cells, unsupported


# ---- profile -----------------------------------------------------------------------------


def profile(args: argparse.Namespace, tmp: Path) -> str:
    """py-spy one envelope configuration (`--profile-config`, default the full envelope; 1 worker)
    under wrk -c`--profile-concurrency` (default 16), stateless client, --profile-size outputs."""
    pyspy = shutil.which("py-spy") or str(PEERS_VENV / "bin" / "py-spy")
    if not Path(pyspy).exists():
        raise R.BenchError("--profile needs py-spy (bench/.venv-peers has it after the first run)")
    name, conc = args.profile_config, args.profile_concurrency
    out = BENCH / "out" / f"profile-mix-{name}.speedscope.json"
    out.parent.mkdir(exist_ok=True)
    upstream, upstream_url = start_upstream(tmp, args.profile_size)
    try:
        fresh_state(tmp, 1, name)
        with running(R.start_envelope(tmp, upstream_url, 1, name)) as path:
            client = make_client("stateless", path.url)
            check_call(client, args.profile_size)
            script = client.script(tmp, "profile")
            R.run_wrk(path.url, conc, 1, script)
            assert path.service is not None
            load = subprocess.Popen(R.wrk_argv(path.url, conc, args.profile + 4, script),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                time.sleep(1)
                spy = subprocess.run([pyspy, "record", "--format", "speedscope", "--rate", "250", "--nonblocking",
                                      "--duration", str(args.profile), "--pid", str(path.service.pids[0]),
                                      "-o", str(out)], capture_output=True, text=True, check=False)
            finally:
                load.wait(args.profile + 30)
            if spy.returncode != 0 or not out.exists():
                raise R.BenchError(f"py-spy failed:\n{spy.stdout}\n{spy.stderr}")
    finally:
        upstream.stop()
    command = (f"py-spy record --format speedscope --rate 250 --nonblocking --duration {args.profile} "
               f"--pid <{name} pid>  # under wrk -t1 -c{conc}, stateless client, {args.profile_size} B untrusted "
               "output, 1 worker")
    return f"Command (run by `--profile`): `{command}`\n\n" + R.summarize_speedscope(out, top=15)


# ---- report ------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 1, sign: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+,.{digits}f}" if sign else f"{x:,.{digits}f}"


def report(cells: list[Cell], unsupported: dict[str, str], args: argparse.Namespace, prof: str | None) -> str:
    by = {(c.size, c.client, c.config, c.workers, c.concurrency): c for c in cells}
    noisy = [c for c in cells if c.proxy_cpu_us is not None and c.ticks < MIN_TICKS]
    lines = [
        BEGIN,
        "## Realistic mix and the Python peers (issue 15)",
        "",
        f"Date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}. Command (repository root, venv active):",
        "",
        "```",
        shlex.join(["python", *sys.argv]),
        "```",
        "",
        f"Cells: `wrk -t1 -c<c> -d{max(1, round(args.duration))}s` after {args.warmup:g} s of warm-up. Tool "
        "outputs of 200 B / 5 KB / 50 KB of untrusted prose (bench/mix_upstream.py, a different window on "
        "every call; the envelope fingerprints each into the run's ledger, shadow mode, before delivery). "
        f"Clients: `stateless` ({STATELESS}, no session) and `session` ({SESSION}, one `Mcp-Session-Id` "
        "shared by every connection). Peers (one process, 1-worker rows only): fastmcp's `create_proxy` "
        "over a connected `Client` (one shared upstream session), and mcp-proxy (its HTTP server over "
        "its stdio-to-streamable-HTTP client). Added latency is over `direct` in the same cell; "
        "CPU = utime+stime of the proxy's process tree per call; `x pass` = CPU over the passthrough's "
        "in the same cell. Each size starts the envelope on an empty state directory; within a size "
        "the run's ledger grows from cell to cell (stateless calls share the principal's run; the session "
        "cells share one run too: the bench's upstream hands every `initialize` the same session id), "
        "as a real agent's run does; "
        + ("a 5 KB output adds ~2,000 fingerprints, so the run reaches `ledger_cap` (65,536) after ~32 "
           "calls and overflows (coarse) for the rest of the size: an overflowed run writes its flags, "
           "not its outputs' fingerprints (`--ledger-cap` measures the writes of a run that fits)."
           if args.ledger_cap is None else
           f"`ledger_cap` is raised to {args.ledger_cap:,} (`--ledger-cap`), so a run that stays under "
           "it writes every output's fingerprints (~16 KB for a 5 KB output)."),
        "",
        "**Noise.** The machine has 2 cores shared by wrk, the upstream, the proxy (and other engineers' "
        "jobs): compare ratios within this run, not absolute numbers across runs. 2-worker rows compete "
        "with wrk for cores. CPU is read in clock ticks "
        f"(1/{R.CLK_TCK} s): the {len(noisy)} cells marked `~` measured fewer than {MIN_TICKS} ticks, "
        "so their CPU per call is +-5% or worse; p99 at c=1 in a short cell is a handful of samples.",
    ]
    for size in args.sizes:
        lines += ["", f"### {size:,} B untrusted output", "",
                  "| client | config | workers | c | req/s | x direct req/s | p50 ms | +p50 ms | p99 ms | +p99 ms "
                  "| proxy CPU µs/call | x pass |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for client in args.clients:
            for config in args.configs:
                for workers in args.workers:
                    for conc in args.concurrency:
                        c = by.get((size, client, config, workers, conc))
                        if c is None:
                            continue
                        d = by.get((size, client, "direct", 1, conc))
                        p = by.get((size, client, "passthrough", workers, conc))
                        xd = f"{c.rps / d.rps:.2f}" if d else "-"
                        xp = (f"{c.proxy_cpu_us / p.proxy_cpu_us:.2f}" if p and p.proxy_cpu_us and c.proxy_cpu_us
                              else "-")
                        mark = "~" if c.proxy_cpu_us is not None and c.ticks < MIN_TICKS else ""
                        lines.append(
                            f"| {client} | {config} | {workers} | {conc} | {fmt(c.rps, 0)} | {xd} | {fmt(c.p50_ms, 3)} "
                            f"| {fmt(c.p50_ms - d.p50_ms if d else None, 3, True)} | {fmt(c.p99_ms, 3)} "
                            f"| {fmt(c.p99_ms - d.p99_ms if d else None, 3, True)} | {mark}{fmt(c.proxy_cpu_us)} | {xp} |")
    if unsupported:
        lines += ["", "Peer cells not measured (a verification call or wrk failed; the reason as seen):", ""]
        lines += [f"- {k}: `{v}`" for k, v in sorted(unsupported.items())]
    lines += ["", "### Against the issue's targets", "",
              f"Throughput per CPU, envelope over fastmcp (1 worker; = fastmcp CPU/call over envelope CPU/call; "
              f"target >= {TARGET_PER_CPU_VS_FASTMCP:g}x):", "",
              "| size | client | c | envelope / fastmcp per CPU | envelope / fastmcp req/s | envelope / mcp-proxy per CPU "
              "| result |", "|---:|---|---:|---:|---:|---:|---|"]
    for size in args.sizes:
        for client in args.clients:
            for conc in args.concurrency:
                env, fm = by.get((size, client, "envelope", 1, conc)), by.get((size, client, "fastmcp", 1, conc))
                mp = by.get((size, client, "mcp-proxy", 1, conc))
                if not (env and fm and env.proxy_cpu_us and fm.proxy_cpu_us):
                    continue
                ratio = fm.proxy_cpu_us / env.proxy_cpu_us
                vs_mp = f"{mp.proxy_cpu_us / env.proxy_cpu_us:.1f}x" if mp and mp.proxy_cpu_us else "-"
                lines.append(f"| {size:,} | {client} | {conc} | {ratio:.1f}x | {env.rps / fm.rps:.2f} | {vs_mp} "
                             f"| {R.verdict(ratio >= TARGET_PER_CPU_VS_FASTMCP)} |")
    lines += ["", "Untrusted output, added p50 at c=1, 1 worker (envelope p50 - passthrough p50; the issue's "
              "target is over the passthrough; over direct in brackets):", "",
              "| size | client | envelope - passthrough p50 | (envelope - direct) | target | result |",
              "|---:|---|---:|---:|---:|---|"]
    for size in args.sizes:
        for client in args.clients:
            env, base = by.get((size, client, "envelope", 1, 1)), by.get((size, client, "passthrough", 1, 1))
            d = by.get((size, client, "direct", 1, 1))
            if not (env and base):
                continue
            diff = env.p50_ms - base.p50_ms
            target = TARGET_ADDED_P50_MS.get(size)
            lines.append(f"| {size:,} | {client} | {diff:+.3f} ms | ({fmt(env.p50_ms - d.p50_ms if d else None, 3, True)} ms) "
                         f"| {f'<= {target:g} ms' if target else '-'} | {R.verdict(diff <= target) if target else '-'} |")
    lines += ["", f"Full envelope CPU per call at c=32, 1 worker (target <= {TARGET_CPU_US:g} µs on a small result):", "",
              "| size | client | envelope CPU µs/call | passthrough CPU µs/call | result |", "|---:|---|---:|---:|---|"]
    for size in args.sizes:
        for client in args.clients:
            env, base = by.get((size, client, "envelope", 1, 32)), by.get((size, client, "passthrough", 1, 32))
            if not (env and env.proxy_cpu_us):
                continue
            ok = R.verdict(env.proxy_cpu_us <= TARGET_CPU_US) if size == min(args.sizes) else "-"
            lines.append(f"| {size:,} | {client} | {fmt(env.proxy_cpu_us)} | "
                         f"{fmt(base.proxy_cpu_us if base else None)} | {ok} |")
    lines += parts_table(by, args)
    if prof:
        lines += ["", f"### Where the {args.profile_config} configuration's time goes (py-spy, "
                      f"c={args.profile_concurrency})", "", prof]
    lines.append(END)
    return "\n".join(lines) + "\n"


def parts_table(by: dict[tuple[int, str, str, int, int], Cell], args: argparse.Namespace) -> list[str]:
    """The full envelope's CPU per call taken apart (1 worker), where the run measured `noflow` and
    `envelope-memory` beside it: each step over the passthrough's CPU in the same cell."""
    rows = []
    for size in args.sizes:
        for client in args.clients:
            for conc in args.concurrency:
                cpu = [getattr(by.get((size, client, c, 1, conc)), "proxy_cpu_us", None)
                       for c in ("passthrough", "noflow", "envelope-memory", "envelope")]
                base, noflow, memory, full = cpu
                if not (base and noflow and memory and full):
                    continue
                rows.append(f"| {size:,} | {client} | {conc} | {fmt(base)} | {noflow / base:.2f} "
                            f"| {(memory - noflow) / base:+.2f} | {(full - memory) / base:+.2f} | {full / base:.2f} |")
    if not rows:
        return []
    return ["", "Where the full envelope's CPU goes (1 worker; each part over the passthrough's CPU per call in "
            "the same cell: `noflow` is the request path without data flow; + ledger is fingerprinting and "
            "recording each output in process memory (`envelope-memory` - `noflow`); + SQLite is the same "
            "ledger in the default SQLite file instead (`envelope` - `envelope-memory`)):", "",
            "| size | client | c | passthrough CPU µs/call | noflow x pass | + ledger (memory) | + SQLite store "
            "| envelope x pass |", "|---:|---|---:|---:|---:|---:|---:|---:|", *rows]


def write_section(results: Path, section: str) -> None:
    """Replace the mix section of `results` (or append it): the rest of the file is kept."""
    text = results.read_text() if results.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    results.write_text(text)


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per cell (default 10)")
    p.add_argument("--quick", action="store_true", help="2 s per cell, 0.5 s warm-up")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell (default 2; --quick 0.5)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="output sizes in bytes (default 200,5000,50000)")
    p.add_argument("--clients", default=",".join(CLIENTS), help="stateless,session")
    p.add_argument("--workers", default="1,2", help="worker counts for passthrough and envelope (default 1,2)")
    p.add_argument("--concurrency", default="1,32", help="wrk connection counts (default 1,32)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"subset of {','.join(CONFIGS)}, plus the opt-in {','.join(PARTS)} (the envelope "
                        "taken apart: a table of where its CPU goes)")
    p.add_argument("--profile", type=int, default=0, metavar="SECONDS", help="py-spy the envelope under c=16")
    p.add_argument("--profile-config", default="envelope", choices=["envelope", *PARTS],
                   help="what --profile measures (default envelope)")
    p.add_argument("--profile-concurrency", type=int, default=16, help="wrk connections while profiling (default 16)")
    p.add_argument("--profile-size", type=int, default=5000, help="output size while profiling (default 5000)")
    p.add_argument("--ledger-cap", type=int, default=None, metavar="N",
                   help="the envelopes' dataflow.ledger_cap (default the policy's 65,536: a run of 5 KB "
                        "outputs overflows after ~32 calls and then records only its flags); up to "
                        "4,000,000 keeps every output's fingerprints written")
    p.add_argument("--results", type=Path, default=BENCH / "RESULTS.md",
                   help="file whose mix section is replaced (default bench/RESULTS.md)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 2.0
    if args.warmup is None:
        args.warmup = 0.5 if args.quick else 2.0
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.clients = [x.strip() for x in args.clients.split(",")]
    args.workers = [int(x) for x in args.workers.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.configs = [x.strip() for x in args.configs.split(",")]
    bad = (set(args.configs) - set(CONFIGS) - set(PARTS)) | (set(args.clients) - set(CLIENTS))
    if bad:
        p.error(f"unknown configs or clients: {', '.join(sorted(bad))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench: wrk not found on PATH. Install it: apt-get install wrk", file=sys.stderr)
        return 2
    try:
        if set(args.configs) & set(PEERS) or args.profile:
            ensure_venvs()
        with tempfile.TemporaryDirectory(prefix="envelope-mix-") as tmpdir:
            tmp = Path(tmpdir)
            R.DATAFLOW = dataflow_settings(args)
            cells, unsupported = run_mix(args, tmp)
            prof = profile(args, tmp) if args.profile else None
    except (R.BenchError, subprocess.CalledProcessError) as exc:
        print(f"bench: FAILED: {exc}", file=sys.stderr)
        return 1
    section = report(cells, unsupported, args, prof)
    write_section(args.results, section)
    print(f"\nwrote the mix section of {args.results}\n")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
