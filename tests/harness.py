"""Real parts for integration and end-to-end tests: upstream MCP servers, the proxy process,
MCP SDK clients. Everything binds to free loopback ports and is stopped by the caller."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_POLICIES = ROOT / "tests" / "fixtures" / "policies"
JWT_SECRET = "envelope-test-secret-0123456789abcdef"
# The approver token `proxy_process` configures (unless the test brings its own `approvals`):
# what reads the admin listener's token-guarded routes (`ProxyProcess.admin_get`).
ADMIN_TOKEN = "envelope-test-operator-token"


# Ports this process handed out lately. Nothing holds a port between `free_port()` and the bind
# of whoever uses it (often a child process, seconds later), and the kernel may offer one port
# twice in a row (measured: about 1 in 10,000 pairs): a proxy's listen and admin ports, or a
# "nothing listens there" URL and the listener started next, would then be the same port.
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)


def free_port() -> int:
    """A loopback port nothing is bound to now and that no recent call here returned."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise RuntimeError("the kernel keeps offering ports this process already handed out")


def admin_ports(workers: int) -> int:
    """A free admin port P with P + 1 ... P + workers - 1 free too (worker i serves its admin
    listener on P + i; a taken one stops the whole process)."""
    for _ in range(100):
        base = free_port()
        others = [base + i for i in range(1, workers)]
        if any(port in _HANDED_OUT for port in others):
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in others:
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED_OUT.extend(others)
        return base
    raise RuntimeError(f"no {workers} consecutive free ports for the admin listeners")


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port} after {timeout}s")


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


@dataclass
class Upstream:
    url: str
    port: int
    mode: str
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def upstream_server(mode: str = "sse") -> Iterator[Upstream]:
    """The demo notes server (official SDK) in `sse`, `json` or `stateless` mode."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.examples.demo_server", "--port", str(port), "--mode", mode],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )
    try:
        wait_port(port, proc)
        yield Upstream(f"http://127.0.0.1:{port}/mcp", port, mode, proc)
    finally:
        stop(proc)


@dataclass
class ProxyProcess:
    port: int
    admin_port: int
    state_dir: Path
    policies: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    config_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def url(self, upstream: str) -> str:
        return f"{self.base}/mcp/{upstream}"

    @property
    def audit_dir(self) -> Path:
        return self.state_dir / "audit"

    def audit_records(self) -> list[dict[str, Any]]:
        path = self.audit_dir / "audit.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def worker_audit_records(self, workers: int = 2) -> list[list[dict[str, Any]]]:
        """Each worker's audit records (`audit-w<i>.jsonl`: with `workers > 1` each writes its own
        log; an absent one is empty), in worker order."""
        logs = (self.audit_dir / f"audit-w{w}.jsonl" for w in range(workers))
        return [[json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                if path.exists() else [] for path in logs]

    def metrics(self) -> str:
        return httpx.get(f"{self.admin}/metrics", timeout=5).text

    def admin_get(self, path: str, token: str = ADMIN_TOKEN) -> httpx.Response:
        """GET `path` on the admin listener with an approver token (`/v1/policy`, ...)."""
        return httpx.get(f"{self.admin}{path}", headers={"Authorization": f"Bearer {token}"},
                         timeout=5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if "{" in head:
            metric, _, rest = head.partition("{")
            pairs = dict(
                p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p
            )
            got = {k: v.strip('"') for k, v in pairs.items()}
        else:
            metric, got = head, {}
        if metric == name and all(got.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0


@contextlib.contextmanager
def proxy_process(
    tmp: Path,
    upstreams: dict[str, str],
    policies: Path = FIXTURE_POLICIES,
    identity: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    preexec_fn: Any = None,
) -> Iterator[ProxyProcess]:
    """Run `envelope-proxy serve` (the real console script) with a config file (and `args`,
    extra serve flags such as `--record FILE`; `preexec_fn` runs in the child before it starts,
    e.g. to set resource limits)."""
    port, admin_port = free_port(), admin_ports((config or {}).get("workers", 1))
    state = tmp / "state"
    cfg: dict[str, Any] = {
        "listen": f"127.0.0.1:{port}",
        "admin": f"127.0.0.1:{admin_port}",
        "policies": str(policies),
        "state_dir": str(state),
        "upstreams": {name: {"url": url} for name, url in upstreams.items()},
        "identity": identity or {"mode": "jwt", "algorithms": ["HS256"], "key": JWT_SECRET},
        "reload_interval": 0.2,
        "shutdown_grace": 3,
        "approvals": {"approvers": {
            "operator": {"token_sha256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()}}},
    }
    config = dict(config or {})
    if "approvals" in config and "approvers" not in config["approvals"]:
        config["approvals"] = {**config["approvals"], "approvers": cfg["approvals"]["approvers"]}
    cfg.update(config)
    config_path = tmp / f"config-{port}.yaml"
    config_path.write_text(json.dumps(cfg))  # JSON is YAML
    log_path = tmp / f"proxy-{port}.log"
    exe = Path(sys.executable).with_name("envelope-proxy")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "proxy"]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [*cmd, "serve", "--config", str(config_path), *(args or [])],
            stdout=logf, stderr=subprocess.STDOUT, cwd=tmp,
            env={**os.environ, **(env or {})}, preexec_fn=preexec_fn,
        )
    pp = ProxyProcess(port, admin_port, state, policies, proc, log_path, config_path)
    try:
        try:
            wait_port(admin_port, proc)
            wait_port(port, proc)
        except Exception as exc:
            raise RuntimeError(f"proxy did not start: {exc}\n{pp.log()}") from exc
        yield pp
    finally:
        stop(proc)


def token(sub: str, groups: list[str] | None = None, **claims: Any) -> str:
    payload = {"sub": sub, "groups": groups or [], "exp": int(time.time()) + 3600, **claims}
    return jwt.encode(payload, JWT_SECRET, algorithm="HS256")


@contextlib.asynccontextmanager
async def mcp_client(url: str, mode: str = "auto", bearer: str | None = None,
                     headers: dict[str, str] | None = None,
                     client_info: tuple[str, str] | None = None) -> AsyncIterator[Any]:
    """An official MCP SDK client (`mode` auto = 2026-07-28 stateless, legacy = sessions),
    optionally introducing itself as `client_info` (name, version)."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client
    from mcp.types import Implementation

    hdrs = dict(headers or {})
    if bearer:
        hdrs["Authorization"] = f"Bearer {bearer}"
    http = create_mcp_http_client(headers=hdrs)
    info = Implementation(name=client_info[0], version=client_info[1]) if client_info else None
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode, cache=None,
                            client_info=info) as client:
        yield client


def rpc(url: str, body: Any, bearer: str | None = None, headers: dict[str, str] | None = None,
        raw: bytes | None = None, timeout: float = 10) -> httpx.Response:
    """One raw JSON-RPC POST (what a misbehaving client sends)."""
    hdrs = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
            "MCP-Protocol-Version": "2026-07-28", **(headers or {})}
    if bearer:
        hdrs["Authorization"] = f"Bearer {bearer}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url, content=content, headers=hdrs, timeout=timeout)


# A ratio of CPU times that tells linear from quadratic work: eight times the input costs about
# eight times as long when linear, sixty-four when quadratic; the bound is their geometric middle.
LINEAR_8X = 23


def least_cpu(fn: Callable[[], object], runs: int = 5) -> float:
    """The least CPU time of this thread over `runs` runs of `fn`: unlike wall time, it does not
    count the time other processes of a busy machine held the core (best-of-5 wall ratios
    reached 27x under a CI run where this thread's CPU read 9x), nor worker threads."""
    best = float("inf")
    for _ in range(runs):
        started = time.thread_time()
        fn()
        best = min(best, time.thread_time() - started)
    return best

