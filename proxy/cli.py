"""The `envelope-proxy` command."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import multiprocessing
import os
import secrets
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
  envelope-proxy test policies/ --coverage     run the policy tests kept beside the policies
  envelope-proxy audit verify state/audit      prove the audit log untouched
  envelope-proxy audit query state/audit --since 1h --verdict deny    recent refusals
  envelope-proxy audit tail -f state/audit     follow decisions as they are made
  envelope-proxy approvals list                pending approvals (token: ENVELOPE_APPROVER_TOKEN)"""


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
    serve.add_argument("--record", type=Path, metavar="FILE",
                       help="append one JSON line per tools/call decision to FILE, for "
                            "`envelope-proxy replay` (full arguments and JWT claims: protect it)")

    demo = sub.add_parser("demo", help="run the demo: the bundled notes server behind the proxy",
                          description="Start the bundled example MCP server and the proxy in front of it, "
                                      "with the policy pack in ./policies and state in ./.envelope-state.")
    _add_serve_flags(demo)
    demo.add_argument("--upstream-port", type=int, default=0, metavar="PORT", help="port for the demo server (default: a free one)")

    check = sub.add_parser("check", help="validate a policy directory",
                           description="Load a policy directory as the proxy would. Prints every problem as "
                                       "file:line:column: message and exits 1 if there is any. Then lists the "
                                       "tools that can never run (misconfigured) and why: the registry layer "
                                       "from the policy alone, the envelope layer assuming the default runtime "
                                       "(sqlite store, approvals enabled); --strict makes them fail the check.")
    check.add_argument("directory", type=Path)
    check.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], default=None)
    check.add_argument("--strict", action="store_true",
                       help="also exit 1 when a tool is misconfigured (it can never run) or a principal's "
                            "rule_of_two holds all three properties")

    audit = sub.add_parser("audit", help="audit log tools")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True, metavar="SUBCOMMAND")
    verify = audit_sub.add_parser("verify", help="prove an audit log untouched",
                                  description="Check the hash chain of an audit file or directory. Exit 0 when intact; "
                                              "exit 1 naming the first bad record otherwise.")
    verify.add_argument("path", type=Path)
    _add_audit_read_parsers(audit_sub)

    _add_approvals_parser(sub)
    _add_shadow_parser(sub)
    _add_replay_parser(sub)
    _add_test_parser(sub)
    return parser


def _add_test_parser(sub: Any) -> None:
    test = sub.add_parser(
        "test", help="run the policy tests kept beside a policy directory",
        description="Run the YAML policy test cases under DIR/tests/ and DIR/**/*.test.yaml on the "
                    "proxy's own chain of checks (an in-memory store; gated calls are not held: "
                    "approval_pending at once). Exits 1 when a case fails, the policy or a case "
                    "file has a problem (file:line:column: message), or coverage is below --threshold.")
    test.add_argument("directory", type=Path)
    test.add_argument("-v", "--verbose", action="store_true",
                      help="show every case with the check and rule that decided it, and why")
    test.add_argument("--coverage", action="store_true",
                      help="report the tools, rules, allow expressions and fallbacks no case exercised")
    test.add_argument("--threshold", type=float, default=None, metavar="PCT",
                      help="fail when coverage is below PCT percent (implies --coverage)")
    test.add_argument("--format", choices=["text", "json"], default="text")
    test.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], default=None,
                      help="CEL engine (env ENVELOPE_CEL_ENGINE; default auto)")


def cmd_test(args: argparse.Namespace) -> int:
    """`test DIR`: 0 when every case passes (and coverage meets --threshold), else 1."""
    from proxy.tools.policy_tests import render_json, render_text, run_tests

    report = run_tests(args.directory, engine=args.cel_engine, coverage=args.coverage,
                       threshold=args.threshold)
    out = render_json(report) if args.format == "json" else render_text(report, args.verbose)
    sys.stdout.write(out)
    return 0 if report.ok else 1


def _add_shadow_parser(sub: Any) -> None:
    shadow = sub.add_parser(
        "shadow", help="review the writes shadow runs recorded instead of performing",
        description="Read a running proxy's shadow records (GET /v1/shadow on the admin listener).")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--admin", metavar="URL",
                        default=os.environ.get("ENVELOPE_ADMIN_URL", "http://127.0.0.1:9090"),
                        help="admin listener URL (env ENVELOPE_ADMIN_URL; default http://127.0.0.1:9090)")
    common.add_argument("--run", default=None, help="only the records of this run id")
    common.add_argument("--limit", type=int, default=100, help="the most recent N records (default 100)")
    common.add_argument("--token", default=None,
                        help="approver token: shadow records hold arguments "
                             "(default: env ENVELOPE_APPROVER_TOKEN)")
    ssub = shadow.add_subparsers(dest="shadow_command", required=True, metavar="SUBCOMMAND")
    ssub.add_parser("list", help="one line per recorded write, oldest first", parents=[common])
    ssub.add_parser("export", help="the records as JSON lines (full arguments)", parents=[common])


def cmd_shadow(args: argparse.Namespace) -> int:
    """`shadow list|export`: exit 0 with the records, 1 when the admin API refuses or is down."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    query = urllib.parse.urlencode({k: v for k, v in {"run": args.run, "limit": args.limit}.items()
                                    if v is not None})
    url = f"{args.admin.rstrip('/')}/v1/shadow?{query}"
    token = args.token or os.environ.get("ENVELOPE_APPROVER_TOKEN", "")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read()).get("error", exc.reason)
        except (ValueError, AttributeError):
            reason = exc.reason
        print(f"envelope-proxy shadow: {url}: HTTP {exc.code}: {reason}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"envelope-proxy shadow: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    records = data.get("records", [])
    if args.shadow_command == "export":
        for record in records:
            print(json.dumps(record, sort_keys=True, separators=(",", ":")))
        return 0
    for r in records:
        gate = " (would need approval)" if r.get("would_need_approval") else ""
        print(f"{r.get('time', '?')}  run={r.get('run')}  {r.get('principal')} -> "
              f"{r.get('upstream')}.{r.get('tool')} [{r.get('effect')}]{gate}  "
              f"decision={r.get('decision_id')}  args={json.dumps(r.get('arguments'), sort_keys=True)}")
    print(f"{len(records)} shadow record(s)", file=sys.stderr)
    return 0


def _add_approvals_parser(sub: Any) -> None:
    approvals = sub.add_parser(
        "approvals", help="list, show, approve and deny gated calls (through the admin API)",
        description="Talk to a running proxy's approvals API. The approver is whoever holds the "
                    "token (--token or ENVELOPE_APPROVER_TOKEN; names and token digests are in the "
                    "runtime config under approvals.approvers). Nobody can approve their own call.")
    approvals.add_argument("--admin", metavar="URL",
                           default=os.environ.get("ENVELOPE_ADMIN_URL", "http://127.0.0.1:9090"),
                           help="admin listener URL (env ENVELOPE_ADMIN_URL; default http://127.0.0.1:9090)")
    approvals.add_argument("--token", default=None,
                           help="approver token (default: env ENVELOPE_APPROVER_TOKEN)")
    approvals.add_argument("--json", action="store_true", help="print the API's JSON answers")
    # The same flags after the subcommand too (`approvals approve ID --admin URL`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--admin", metavar="URL", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--token", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    asub = approvals.add_subparsers(dest="approvals_command", required=True, metavar="SUBCOMMAND")
    ls = asub.add_parser("list", help="list approvals (default: pending ones)", parents=[common])
    ls.add_argument("--state", default="pending",
                    choices=["pending", "approved", "denied", "expired", "consumed", "all"])
    show = asub.add_parser("show", help="show one approval, with the call's arguments", parents=[common])
    show.add_argument("id")
    approve = asub.add_parser("approve", help="approve one call (optionally granting similar calls)", parents=[common])
    approve.add_argument("id")
    approve.add_argument("--reason", required=True)
    approve.add_argument("--grant", choices=["tool", "run"], default=None,
                         help="also grant later calls of the same principal and tool (and run, for run)")
    approve.add_argument("--grant-args", default=None, metavar="JSON",
                         help='exact argument values the granted calls must hold, e.g. \'{"title": "x"}\'')
    approve.add_argument("--grant-duration", default="1h", metavar="DURATION",
                         help="how long the grant lasts (e.g. 30m; default 1h)")
    deny = asub.add_parser("deny", help="deny one call", parents=[common])
    deny.add_argument("id")
    deny.add_argument("--reason", required=True)
    asub.add_parser("grants", help="list active grants", parents=[common])


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "policies": args.policies, "listen": args.listen, "admin": args.admin,
        "state_dir": args.state_dir, "workers": args.workers, "cel_engine": args.cel_engine,
        "log_level": args.log_level,
        "record": {"path": str(args.record)} if getattr(args, "record", None) else None,
    }


def cmd_check(args: argparse.Namespace) -> int:
    from proxy.envelope.checks.catalogue import misconfigurations
    from proxy.envelope.misconfig import Dependencies
    from proxy.envelope.tools import ToolRegistry
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
    # No runtime here: the upstreams' tools/list are unknown (so tools an upstream does not offer
    # and upstream tools with no policy are not reported), and the envelope layer is judged
    # against the default runtime.
    deps = Dependencies.default_runtime()
    problems = misconfigurations(revision, ToolRegistry(), deps)
    n = len(problems)
    print(f"{n} misconfiguration{'s' if n != 1 else ''} (tools that can never run; calls are refused) — "
          f"registry layer from the "
          f"policy alone (upstream tools/list not known without a running proxy); envelope layer assuming "
          f"the default runtime ({deps.describe()})")
    for p in problems:
        who = f" (principal {p.principal})" if p.principal is not None else ""
        print(f"  {p.tool}{who} [{p.layer}] {p.kind}: {p.reason}")
    # Rule of Two: a profile that holds all three properties is the dangerous configuration.
    dangerous = sorted(
        pid for pid, principal in revision.principals.items()
        if (profile := getattr(principal.policy, "rule_of_two", None)) is not None and profile.holds_all
    )
    level = "error" if args.strict else "warning"
    for pid in dangerous:
        print(f"{level}: principal '{pid}': rule_of_two holds all three of untrusted_input, sensitive_data "
              "and external_side_effects (the lethal trifecta); set one of them to false")
    return 1 if (problems or dangerous) and args.strict else 0


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from proxy.audit.verify import verify

    result = verify(args.path)
    if result.ok:
        print(f"ok: {result.records} records in {len(result.files)} file(s), hash chain intact")
        return 0
    where = f"{result.file}:{result.line}" if result.file and result.line else str(args.path)
    print(f"TAMPERED: {where}: {result.problem}")
    return 1


def _add_audit_read_parsers(audit_sub: Any) -> None:
    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument("directory", type=Path, help="the audit directory (rotated files are read too)")
    for flag in ("principal", "run", "upstream", "tool", "verdict", "code", "decision-id"):
        filters.add_argument(f"--{flag}", default=None, help=f"only records whose {flag.replace('-', '_')} is this")
    filters.add_argument("--format", choices=["table", "json"], default="table",
                         help="table (truncated columns) or json (one record per line, as written)")
    query = audit_sub.add_parser(
        "query", help="find audit records", parents=[filters],
        description="Filter the records of an audit directory (every log, rotated files too), newest "
                    "first. Times are RFC 3339 (2026-01-02T03:04:05Z; no offset: UTC) or relative "
                    "(90s, 15m, 1h, 2d, 1w: that long ago).")
    query.add_argument("--since", default=None, metavar="TIME", help="records at or after TIME")
    query.add_argument("--until", default=None, metavar="TIME", help="records before TIME")
    query.add_argument("--limit", type=int, default=100, metavar="N", help="at most N records (default 100; 0: all)")
    query.add_argument("--oldest-first", action="store_true", help="oldest records first")
    tail = audit_sub.add_parser(
        "tail", help="the last audit records, and with -f new ones as they are written", parents=[filters],
        description="Print the last N records (oldest of them first); with -f keep printing new "
                    "records (following rotation) until Ctrl-C.")
    tail.add_argument("-n", "--lines", type=int, default=10, metavar="N", help="how many records (default 10)")
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing records as they are written")
    tail.add_argument("--interval", type=float, default=0.25, help=argparse.SUPPRESS)


def cmd_audit_read(args: argparse.Namespace) -> int:
    """`audit query` / `audit tail`: exit 0 (also on Ctrl-C), 2 on a bad argument or directory."""
    import shutil
    import signal

    from proxy.audit import query as q

    if not args.directory.is_dir():
        print(f"envelope-proxy audit {args.audit_command}: not a directory: {args.directory}", file=sys.stderr)
        return 2
    fields = {"principal": args.principal, "run": args.run, "upstream": args.upstream, "tool": args.tool,
              "verdict": args.verdict, "code": args.code, "decision_id": args.decision_id}
    width = shutil.get_terminal_size((160, 24)).columns

    def emit(records: list[dict[str, Any]]) -> None:
        for rec in records:
            print(q.json_line(rec) if args.format == "json" else q.table_row(rec, width))
        sys.stdout.flush()

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        if args.format == "table":
            print(q.table_header(width))
        if args.audit_command == "query":
            try:
                since = q.parse_time(args.since) if args.since else None
                until = q.parse_time(args.until) if args.until else None
            except ValueError as exc:
                print(f"envelope-proxy audit query: {exc}", file=sys.stderr)
                return 2
            emit(q.query_records(args.directory, since=since, until=until, limit=args.limit,
                                 newest_first=not args.oldest_first, **fields))
            return 0
        # tail: open the follower first, so nothing written meanwhile is lost; skip what the
        # last-N query already printed.
        follower = q.Follower(args.directory) if args.follow else None
        last = q.query_records(args.directory, limit=args.lines, **fields) if args.lines > 0 else []
        last.reverse()
        emit(last)
        if follower is None:
            return 0
        shown = {r.get("hash") for r in last}
        match = q.matcher(**fields)
        with follower:
            while True:
                new = [r for r in follower.poll() if match(r) and r.get("hash") not in shown]
                shown.clear()  # only the first poll can repeat what was printed
                emit(new)
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `| head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _serve_worker(config_json: str, worker: int) -> None:
    from proxy.app.runtime import serve
    from proxy.config import Config

    config = Config.model_validate_json(config_json)
    _setup_logging(config.log_level)
    sys.exit(_run(serve(config, worker)))


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
    from proxy.app.runtime import serve
    from proxy.config import ApproverConfig, UpstreamOverride, load_config
    from proxy.identity import IdentityConfig

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
        approver_token = secrets.token_urlsafe(24)
        config = config.model_copy(update={
            "upstreams": {"demo": UpstreamOverride(url=f"http://127.0.0.1:{port}/mcp")},
            "workers": 1,
            # The demo's agent is one static workload identity, as in a one-agent sidecar.
            "identity": IdentityConfig(mode="static", principal="demo-agent"),
            # One approver with a token minted for this run, so gated calls can be approved.
            "approvals": config.approvals.model_copy(update={"approvers": {
                "demo-approver": ApproverConfig(token_sha256=hashlib.sha256(approver_token.encode()).hexdigest()),
            }}),
        })
        _setup_logging(config.log_level)
        print(f"demo notes server (MCP) on http://127.0.0.1:{port}/mcp; the agent is principal 'demo-agent'. Ctrl-C stops.",
              flush=True)
        print(f"approver 'demo-approver' token (for the approvals API and CLI): {approver_token}", flush=True)
        return int(_run(serve(config)))
    finally:
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()


def _admin_request(args: argparse.Namespace, method: str, path: str,
                   body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """One admin API request; (status, parsed JSON). Raises OSError when unreachable."""
    import json
    import urllib.error
    import urllib.request

    token = args.token or os.environ.get("ENVELOPE_APPROVER_TOKEN", "")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(args.admin.rstrip("/") + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json",
                                          "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw or b"null")
        except ValueError:
            return exc.code, {"error": raw.decode(errors="replace") or exc.reason}


def _approval_line(a: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a["expires_at"]))
    who = f" by {a['approver']}" if a.get("approver") else ""
    return (f"{a['id']}  {a['state']:<8}  {a['principal']} -> {a['upstream']}.{a['tool']}  "
            f"run {a['run']}  {a['args_digest'][:19]}  expires {when}{who}")


def cmd_approvals(args: argparse.Namespace) -> int:
    import json

    command = args.approvals_command
    if command == "list":
        path = "/v1/approvals" + ("" if args.state == "all" else f"?state={args.state}")
        method, body = "GET", None
    elif command == "show":
        path, method, body = f"/v1/approvals/{args.id}", "GET", None
    elif command == "grants":
        path, method, body = "/v1/grants", "GET", None
    else:
        body = {"reason": args.reason}
        if command == "approve" and args.grant:
            try:
                grant_args = json.loads(args.grant_args) if args.grant_args else {}
            except ValueError as exc:
                print(f"envelope-proxy approvals: --grant-args is not JSON: {exc}", file=sys.stderr)
                return 2
            body["grant"] = {"scope": args.grant, "args": grant_args, "duration": args.grant_duration}
        path, method = f"/v1/approvals/{args.id}/{command}", "POST"
    try:
        status, data = _admin_request(args, method, path, body)
    except OSError as exc:
        print(f"envelope-proxy approvals: cannot reach the admin API at {args.admin}: {exc}",
              file=sys.stderr)
        return 1
    if status >= 400:
        message = data.get("error") if isinstance(data, dict) else data
        print(f"envelope-proxy approvals: {status}: {message}", file=sys.stderr)
        return 1
    if args.json or command == "show":
        print(json.dumps(data, indent=2, sort_keys=True))
    elif command == "list":
        for a in data["approvals"]:
            print(_approval_line(a))
        if not data["approvals"]:
            print(f"no {'' if args.state == 'all' else args.state + ' '}approvals")
    elif command == "grants":
        for g in data["grants"]:
            run = f" run {g['run']}" if g.get("run") else ""
            print(f"{g['id']}  {g['scope']:<4}  {g['principal']} -> {g['upstream']}.{g['tool']}{run}  "
                  f"args {json.dumps(g['args'], sort_keys=True)}  by {g['approver']}")
        if not data["grants"]:
            print("no active grants")
    else:
        grant = f"; grant {data['grant']['id']} ({data['grant']['scope']})" if data.get("grant") else ""
        print(f"{data['id']} {data['state']} by {data['approver']}: {data['decision_reason']}{grant}")
    return 0


def _add_replay_parser(sub: Any) -> None:
    replay = sub.add_parser(
        "replay", help="re-decide recorded calls under another policy and show what changes",
        description="Re-decide every call recorded by `serve --record FILE` under the policy in "
                    "--policies, with the proxy's own engine and checks (approvals decided "
                    "statically: a gated call is `approval_pending`; idempotency and shadow on an "
                    "empty store), and print the calls newly refused, newly allowed or refused with "
                    "another code or rule. Exit 2 on policy or record file errors; 1 with "
                    "--fail-on-change when anything changed; else 0.")
    replay.add_argument("file", type=Path, help="the record file (JSON lines)")
    replay.add_argument("--policies", type=Path, required=True, metavar="DIR",
                        help="the policy directory to decide under")
    replay.add_argument("--format", choices=["text", "json"], default="text")
    replay.add_argument("--fail-on-change", action="store_true",
                        help="exit 1 when any decision changes")
    replay.add_argument("--config", type=Path, metavar="FILE", default=None,
                        help="runtime config whose approvals/idempotency settings apply (optional)")
    replay.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], default=None)


def cmd_replay(args: argparse.Namespace) -> int:
    """`replay`: 0 (or 1 with --fail-on-change when something changed); 2 on input errors."""
    from proxy.config import Config, load_config
    from proxy.policy.loader import load_policy
    from proxy.tools.replay import RecordError, format_report, load_records, replay

    try:
        config = load_config(args.config, environ={}) if args.config else Config()
    except ConfigError as exc:
        print(f"envelope-proxy replay: {exc}", file=sys.stderr)
        return 2
    try:
        revision = load_policy(args.policies, engine=args.cel_engine or config.cel_engine)
    except PolicyError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        print(f"envelope-proxy replay: {len(exc.problems)} problem(s) in {args.policies}",
              file=sys.stderr)
        return 2
    try:
        records = load_records(args.file)
    except RecordError as exc:
        print(f"envelope-proxy replay: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(replay(records, revision, config))
    print(format_report(report, args.format))
    return 1 if report.changes and args.fail_on_change else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        return cmd_check(args)
    if args.command == "approvals":
        return cmd_approvals(args)
    if args.command == "shadow":
        return cmd_shadow(args)
    if args.command == "audit" and args.audit_command in ("query", "tail"):
        return cmd_audit_read(args)
    if args.command == "audit":
        return cmd_audit_verify(args)
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "replay":
        return cmd_replay(args)
    if args.command == "test":
        return cmd_test(args)
    return cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
