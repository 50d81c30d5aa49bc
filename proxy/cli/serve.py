"""`serve` and `demo`: run the proxy (the demo with its bundled notes server in front)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.errors import ConfigError, ListenError

if TYPE_CHECKING:
    from proxy.config import Config

log = logging.getLogger(__name__)


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _setup_logging(level: str, worker: int | None = None) -> None:
    from proxy.observability import logs

    logs.setup(level, worker)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", metavar="DIR", help="policy directory (env ENVELOPE_POLICIES; default ./policies)")
    p.add_argument("--listen", metavar="HOST:PORT", help="MCP listener (env ENVELOPE_LISTEN; default 127.0.0.1:8080)")
    p.add_argument("--admin", metavar="HOST:PORT", help="admin listener: /healthz /readyz /metrics /v1/policy (env ENVELOPE_ADMIN; default 127.0.0.1:9090)")
    p.add_argument("--state-dir", metavar="DIR", help="state and audit log directory (env ENVELOPE_STATE_DIR; default ./.envelope-state)")
    p.add_argument("--workers", type=int, metavar="N", help="worker processes sharing the listener (env ENVELOPE_WORKERS; default 1)")
    p.add_argument("--listener", choices=["fast", "aiohttp"], help="the MCP listener's HTTP server: fast (asyncio + httptools), or aiohttp (aiohttp's server); the same routes (env ENVELOPE_LISTENER; default fast)")
    p.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], help="CEL engine (env ENVELOPE_CEL_ENGINE; default auto)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="env ENVELOPE_LOG_LEVEL; default info")


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the proxy", description="Run the proxy until SIGTERM/SIGINT. SIGHUP reloads the policy.")
    serve.add_argument("--config", type=Path, metavar="FILE", help="runtime config YAML (env ENVELOPE_CONFIG); flags and ENVELOPE_* env override it")
    add_serve_flags(serve)
    serve.add_argument("--record", type=Path, metavar="FILE",
                       help="append one JSON line per tools/call decision to FILE, for "
                            "`envelope-proxy replay` (full arguments and JWT claims: protect it)")
    serve.set_defaults(handler=cmd_serve)


def add_demo_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="run the demo: the bundled notes server behind the proxy",
                          description="Start the bundled example MCP server and the proxy in front of it, "
                                      "with the policy pack in ./policies and state in ./.envelope-state.")
    add_serve_flags(demo)
    demo.add_argument("--upstream-port", type=int, default=0, metavar="PORT", help="port for the demo server (default: a free one)")
    demo.set_defaults(handler=cmd_demo)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "policies": args.policies, "listen": args.listen, "admin": args.admin,
        "state_dir": args.state_dir, "workers": args.workers, "cel_engine": args.cel_engine,
        "log_level": args.log_level, "listener": args.listener,
        "record": {"path": str(args.record)} if getattr(args, "record", None) else None,
    }


def _die_with_parent(parent: int) -> None:
    """Ask Linux to send this worker SIGTERM (its graceful shutdown) when the supervisor dies, even
    by SIGKILL: a worker must not serve on, orphaned and unsupervised. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def _serve_worker(config_json: str, worker: int, parent: int, in_band_secret: bytes,
                  stdio_socket: socket.socket, stdio_ports: frozenset[int]) -> None:
    from proxy.app.runtime import serve
    from proxy.config import Config

    _die_with_parent(parent)
    config = Config.model_validate_json(config_json)
    _setup_logging(config.log_level, worker)
    sys.exit(_run(serve(config, worker, in_band_secret=in_band_secret,
                        stdio_endpoint=(stdio_socket, stdio_ports))))


def cmd_serve(args: argparse.Namespace) -> int:
    from proxy.app.runtime import serve
    from proxy.config import load_config

    try:
        config = load_config(getattr(args, "config", None), _overrides(args))
    except ConfigError as exc:
        print(f"envelope-proxy: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    if config.workers == 1:
        return int(_run(serve(config)))
    try:
        config = _one_port(config)
        claim = _claim_listen(*config.listen_addr)
    except ListenError as exc:
        print(f"envelope-proxy: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        return _serve_workers(config)
    finally:
        if claim is not None:
            claim.close()


def _serve_workers(config: Config) -> int:
    ctx = multiprocessing.get_context("spawn")
    # One in-band approval secret for every worker (unless configured): a 2026-07-28 client's
    # retry carrying its answer lands on any worker, which must open the state another signed.
    # Handed over as an argument (a pipe), never in the environment or on a command line.
    secret = secrets.token_bytes(32)
    # Each worker's stdio endpoint (where its stdio upstreams' children are served): bound here
    # and held until the serve ends, so the port a stdio session id names is always a worker's
    # (a worker hands another the requests of the sessions that worker holds, with their secret).
    endpoints = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(config.workers)]
    for endpoint in endpoints:
        endpoint.bind(("127.0.0.1", 0))
    ports = frozenset(int(e.getsockname()[1]) for e in endpoints)
    procs = [ctx.Process(target=_serve_worker, args=(config.model_dump_json(), i, os.getpid(), secret,
                                                     endpoints[i], ports))
             for i in range(config.workers)]

    def forward(signum: int, _frame: Any) -> None:
        # SIGTERM (an orchestrator's stop) or SIGINT reaches the supervisor: every worker gets
        # it and drains; the supervisor exits when they have. SIGHUP (reload) would otherwise
        # kill the supervisor, and with it every worker. Without this the supervisor died
        # at once and left its workers serving, orphaned (a worker counts a signal that reaches
        # it both from here and from its process group as one: `Runtime.run_until_signalled`).
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: each worker reloads
        signal.signal(sig, forward)
    try:
        for p in procs:
            p.start()
        failed = _supervise(procs)
        return failed or max(_exit_status(p.exitcode) for p in procs)
    finally:
        for endpoint in endpoints:
            endpoint.close()


def _one_port(config: Config) -> Config:
    """`config` with its MCP port chosen once when it says 0: each worker would otherwise bind a
    free port of its own, and every worker but the first, on a port nobody was told, would serve
    nothing. ListenError when the address cannot be bound at all."""
    from proxy.app.runtime import MCP_LISTEN_SETTING, listen_error

    host, port = config.listen_addr
    if port != 0:
        return config
    try:
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
    except OSError as exc:
        raise listen_error(f"the MCP listener cannot listen on {host}:0", exc, MCP_LISTEN_SETTING) from exc
    shown = f"[{host}]" if ":" in host else host
    return config.model_copy(update={"listen": f"{shown}:{port}"})


def _claim_listen(host: str, port: int) -> socket.socket | None:
    """Make sure no other process serves `host:port` before the workers bind it; the claim
    returned (None where there is nothing to hold) is kept while they run. ListenError, the
    message a single process gives for a taken address, otherwise.

    Workers share the MCP listener with SO_REUSEPORT, and the kernel lets any process of the
    same user join such a port: a second `serve --workers N` on the same `listen` (a stale
    instance, a copy-pasted unit) bound without an error and the kernel split the connections
    between two proxies with their own policy, store and audit log. So the supervisor binds the
    address once without SO_REUSEPORT (refused while anything listens there), and holds a
    Linux abstract socket named after the address (per network namespace, as the port is, and
    freed when the process dies however it dies) so that a second supervisor starting while
    this one's workers load their policy is refused too. Port 0 claims nothing (`_one_port`
    chooses a port first)."""
    from proxy.app.runtime import MCP_LISTEN_SETTING, listen_error

    if port == 0:
        return None
    what = f"the MCP listener cannot listen on {host}:{port}"
    claim: socket.socket | None = None
    if sys.platform.startswith("linux"):
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0envelope-proxy listen {host}:{port}")
        except OSError as exc:  # EADDRINUSE: another supervisor holds it
            claim.close()
            raise listen_error(what, exc, MCP_LISTEN_SETTING) from exc
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the workers
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except OSError as exc:
        if claim is not None:
            claim.close()
        raise listen_error(what, exc, MCP_LISTEN_SETTING) from exc
    return claim


def _exit_status(code: int | None) -> int:
    """A worker's exit code as a shell would report it: killed by signal N is 128 + N."""
    return 0 if code is None else (128 - code if code < 0 else code)


def _supervise(procs: list[Any]) -> int:
    """Wait for the workers; when one fails (a non-zero exit: its address taken, its policy
    unloadable, a crash or a kill), stop the others and return its exit status, so the process
    exits with it and its orchestrator sees it, instead of serving on fewer workers than
    configured while looking healthy. 0 when every worker ended cleanly."""
    running = list(procs)
    while running:
        mp_connection.wait([p.sentinel for p in running])
        for p in [p for p in running if p.exitcode is not None]:
            running.remove(p)
            if p.exitcode != 0:
                log.error("worker %d exited with %s; stopping the other workers", procs.index(p), p.exitcode)
                for other in running:
                    other.terminate()  # SIGTERM: the worker's graceful shutdown
                for other in running:
                    other.join()
                return _exit_status(p.exitcode)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def cmd_demo(args: argparse.Namespace) -> int:
    from proxy.app.runtime import serve
    from proxy.config import ApproverConfig, UpstreamOverride, load_config
    from proxy.identity import IdentityConfig

    policies = Path(args.policies or os.environ.get("ENVELOPE_POLICIES") or "policies")
    if not policies.is_dir():
        print(f"envelope-proxy demo: no policy directory at {policies} (run it from the repository root "
              "or pass --policies)", file=sys.stderr)
        return 2
    port = args.upstream_port or _free_port()
    if args.upstream_port and not _port_free(port):
        print(f"envelope-proxy demo: the demo server cannot listen on 127.0.0.1:{port}: address already "
              "in use; choose another port with --upstream-port", file=sys.stderr)
        return 2
    server = subprocess.Popen([sys.executable, "-m", "proxy.examples.demo_server", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not _wait_port(port, server):
            print(f"envelope-proxy demo: the demo server did not start on port {port}", file=sys.stderr)
            return 1
        overrides = _overrides(args) | {"policies": policies}
        try:
            config = load_config(None, overrides)
        except ConfigError as exc:
            print(f"envelope-proxy: {exc}", file=sys.stderr)
            return 2
        approver_token = secrets.token_urlsafe(24)
        config = config.model_copy(update={
            "upstreams": {"demo": UpstreamOverride(url=f"http://127.0.0.1:{port}/mcp")},
            "workers": 1,
            # The pack's other upstreams are placeholders nobody runs here: probing them would
            # only log that they are down.
            "health_upstreams": ["demo"],
            # The demo's agent is one static workload identity, as in a one-agent sidecar.
            "identity": IdentityConfig(mode="static", principal="demo-agent"),
            # One approver with a token minted for this run, so gated calls can be approved.
            "approvals": config.approvals.model_copy(update={"approvers": {
                "demo-approver": ApproverConfig(token_sha256=hashlib.sha256(approver_token.encode()).hexdigest()),
            }}),
        })
        _setup_logging(config.log_level)
        # Printed by serve() once the proxy listens, so a failed start shows no URL at all.
        banner = [
            f"demo notes server (MCP) on http://127.0.0.1:{port}/mcp; the agent is principal 'demo-agent'. Ctrl-C stops.",
            f"approver 'demo-approver' token (for the approvals API and CLI): {approver_token}",
        ]
        return int(_run(serve(config, banner=banner)))
    finally:
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
