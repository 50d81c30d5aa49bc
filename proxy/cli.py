"""The `envelope-proxy` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.errors import ConfigError, PolicyError

DESCRIPTION = """\
envelope-proxy: a policy-enforcement sidecar for AI-agent tool calls.

Point an MCP client at http://<listen>/mcp/<upstream> instead of the tool server; every
tools/call passes the envelope of checks (catalogue, capability, schema, authorization,
argument rules) before it is forwarded, and every decision is audited and counted."""

EPILOG = """common serve flags (see `envelope-proxy serve --help`):
  --config FILE  --policies DIR  --listen HOST:PORT  --admin HOST:PORT  --state-dir DIR
  each also as an ENVELOPE_* environment variable (ENVELOPE_POLICIES, ENVELOPE_LISTEN, ...)

examples:
  envelope-proxy demo                          run the demo (bundled notes server + ./policies)
  envelope-proxy serve --config config.yaml    run for real
  envelope-proxy check policies/               validate a policy directory (file:line:column errors)
  envelope-proxy audit verify state/audit      prove the audit log untouched"""


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", metavar="DIR", help="policy directory (env ENVELOPE_POLICIES; default ./policies)")
    p.add_argument("--listen", metavar="HOST:PORT", help="MCP listener (env ENVELOPE_LISTEN; default 127.0.0.1:8080)")
    p.add_argument("--admin", metavar="HOST:PORT", help="admin listener: /healthz /readyz /metrics /v1/policy (env ENVELOPE_ADMIN; default 127.0.0.1:9090)")
    p.add_argument("--state-dir", metavar="DIR", help="state and audit log directory (env ENVELOPE_STATE_DIR; default ./.envelope-state)")
    p.add_argument("--workers", type=int, metavar="N", help="worker processes sharing the listener (env ENVELOPE_WORKERS; default 1)")
    p.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], help="CEL engine (env ENVELOPE_CEL_ENGINE; default auto)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="env ENVELOPE_LOG_LEVEL; default info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="envelope-proxy", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the proxy", description="Run the proxy until SIGTERM/SIGINT. SIGHUP reloads the policy.")
    serve.add_argument("--config", type=Path, metavar="FILE", help="runtime config YAML (env ENVELOPE_CONFIG); flags and ENVELOPE_* env override it")
    _add_serve_flags(serve)

    demo = sub.add_parser("demo", help="run the demo: the bundled notes server behind the proxy",
                          description="Start the bundled example MCP server and the proxy in front of it, "
                                      "with the policy pack in ./policies and state in ./.envelope-state.")
    _add_serve_flags(demo)
    demo.add_argument("--upstream-port", type=int, default=0, metavar="PORT", help="port for the demo server (default: a free one)")

    check = sub.add_parser("check", help="validate a policy directory",
                           description="Load a policy directory as the proxy would. Prints every problem as "
                                       "file:line:column: message and exits 1 if there is any.")
    check.add_argument("directory", type=Path)
    check.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], default=None)

    audit = sub.add_parser("audit", help="audit log tools")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True, metavar="SUBCOMMAND")
    verify = audit_sub.add_parser("verify", help="prove an audit log untouched",
                                  description="Check the hash chain of an audit file or directory. Exit 0 when intact; "
                                              "exit 1 naming the first bad record otherwise.")
    verify.add_argument("path", type=Path)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "policies": args.policies, "listen": args.listen, "admin": args.admin,
        "state_dir": args.state_dir, "workers": args.workers, "cel_engine": args.cel_engine,
        "log_level": args.log_level,
    }


def cmd_check(args: argparse.Namespace) -> int:
    from proxy.policy.loader import load_policy

    try:
        revision = load_policy(args.directory, engine=args.cel_engine)
    except PolicyError as exc:
        for problem in exc.problems:
            print(problem)
        n = len(exc.problems)
        print(f"{n} problem{'s' if n != 1 else ''} in {args.directory}", file=sys.stderr)
        return 1
    print(f"ok: {args.directory}: revision {revision.revision}, {len(revision.tools)} tools, "
          f"{len(revision.principals)} principals, {len(revision.files)} files ({revision.engine})")
    return 0


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from proxy.audit.verify import verify

    result = verify(args.path)
    if result.ok:
        print(f"ok: {result.records} records in {len(result.files)} file(s), hash chain intact")
        return 0
    where = f"{result.file}:{result.line}" if result.file and result.line else str(args.path)
    print(f"TAMPERED: {where}: {result.problem}")
    return 1


def _serve_worker(config_json: str, worker: int) -> None:
    from proxy.config import Config
    from proxy.server import serve

    config = Config.model_validate_json(config_json)
    _setup_logging(config.log_level)
    sys.exit(_run(serve(config, worker)))


def cmd_serve(args: argparse.Namespace) -> int:
    from proxy.config import load_config
    from proxy.server import serve

    try:
        config = load_config(getattr(args, "config", None), _overrides(args))
    except ConfigError as exc:
        print(f"envelope-proxy: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    if config.workers == 1:
        return int(_run(serve(config)))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_serve_worker, args=(config.model_dump_json(), i)) for i in range(config.workers)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:
            p.join()
    return max((p.exitcode or 0) for p in procs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    from proxy.config import UpstreamOverride, load_config
    from proxy.identity import IdentityConfig
    from proxy.server import serve

    policies = Path(args.policies or os.environ.get("ENVELOPE_POLICIES") or "policies")
    if not policies.is_dir():
        print(f"envelope-proxy demo: no policy directory at {policies} (run it from the repository root "
              "or pass --policies)", file=sys.stderr)
        return 2
    port = args.upstream_port or _free_port()
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
        config = config.model_copy(update={
            "upstreams": {"demo": UpstreamOverride(url=f"http://127.0.0.1:{port}/mcp")},
            "workers": 1,
            # The demo's agent is one static workload identity, as in a one-agent sidecar.
            "identity": IdentityConfig(mode="static", principal="demo-agent"),
        })
        _setup_logging(config.log_level)
        print(f"demo notes server (MCP) on http://127.0.0.1:{port}/mcp; the agent is principal 'demo-agent'. Ctrl-C stops.",
              flush=True)
        return int(_run(serve(config)))
    finally:
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        return cmd_check(args)
    if args.command == "audit":
        return cmd_audit_verify(args)
    if args.command == "demo":
        return cmd_demo(args)
    return cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
