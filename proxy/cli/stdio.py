"""`stdio`: the proxy as the server command an MCP client launches (`mcpServers` style).

    envelope-proxy stdio --policies DIR [--config FILE] [--state-dir DIR] [--name NAME]
                         (--url URL | -- <server command ...>)

The client speaks newline-delimited JSON-RPC on this process's stdin and stdout; the proxy
fronts one upstream (NAME, default `server`: the policy's tools are `NAME.<tool>`) with the
whole envelope, audit and metrics. stdout carries nothing but protocol: before anything else
runs, the protocol's file descriptors are duplicated for the bridge, descriptor 1 is pointed at
stderr (a stray print, a library's warning, a child process inheriting it: all land in the log)
and descriptor 0 at /dev/null. Logs go to stderr.

The server command gets the environment this command was launched with (the MCP client's
`env` for its server), minus `ENVELOPE_*` variables, and this command's working directory.

Identity is the local user: a static principal, `identity.principal` of the config file when it
sets a static identity, else `local`; `--principal` overrides both. A config file with a JWT
identity is refused (a stdio client has no token to send). The admin listener (approvals API,
metrics, review page) is off unless the config file (or ENVELOPE_ADMIN) sets `admin:`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from proxy.errors import ConfigError

if TYPE_CHECKING:
    from proxy.config import Config

DESCRIPTION = """\
Run as the server command of an MCP client that launches its servers (Claude Desktop, IDEs,
agent frameworks' stdio transports): the proxy fronts one MCP server, a URL (--url) or a
command after `--` (started by the proxy), with the whole envelope of checks; every decision
is audited in the state directory. stdout carries only the protocol; logs go to stderr."""

EPILOG = """\
identity: the principal `local` (or identity.principal of a static identity in --config, or
--principal). Approvals: in-band when the client supports elicitation and the tool's policy sets
approval.in_band; out-of-band through the admin API when --config sets `admin:`.

examples:
  envelope-proxy stdio --policies ~/policies --name notes --url http://127.0.0.1:9001/mcp
  envelope-proxy stdio --policies ~/policies --name files -- npx -y @modelcontextprotocol/server-filesystem /data"""

DEFAULT_PRINCIPAL = "local"
# The idle timeout of the server a command line names: longer than any client runs (ten years).
CLIENT_LIFETIME = 10 * 365 * 86400.0
# Appended to an `approval_pending` reason (ApprovalsConfig.pending_hint): what the person at the
# client can do about a held call, with and without an admin listener.
OUT_OF_BAND = ("an approver decides it through the admin API (`envelope-proxy approvals approve {id} "
               "--admin URL --reason ...`)")
NO_APPROVER = ("to approve it, answer the client's approval question (a client with elicitation, a tool "
               "with approval.in_band: true), or set `admin:` and `approvals.approvers` in the "
               "--config file and run `envelope-proxy approvals approve {id}` (no admin listener runs now)")


def add_stdio_parser(sub: Any) -> None:
    p = sub.add_parser("stdio", help="run as an MCP client's stdio server command, fronting one server",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    # The command line after `--` is cut off by `proxy.cli.main` (TRAILING_COMMANDS).
    p.add_argument("command", nargs=argparse.SUPPRESS, default=[], metavar="-- COMMAND ...",
                   help="the stdio MCP server to start, after `--`")
    p.add_argument("--policies", metavar="DIR", help="policy directory (env ENVELOPE_POLICIES; default ./policies)")
    p.add_argument("--config", type=Path, metavar="FILE", help="runtime config YAML (env ENVELOPE_CONFIG)")
    p.add_argument("--state-dir", metavar="DIR", help="state and audit log directory (env ENVELOPE_STATE_DIR; default ./.envelope-state)")
    p.add_argument("--name", default="server", metavar="NAME",
                   help="the upstream's name in the policy (tools are NAME.<tool>; default: server)")
    p.add_argument("--url", metavar="URL", help="front a Streamable HTTP server at URL instead of a command")
    p.add_argument("--principal", metavar="ID", help=f"the local user's principal (default: {DEFAULT_PRINCIPAL})")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="env ENVELOPE_LOG_LEVEL; default info")
    p.set_defaults(handler=cmd_stdio)


def stdio_config(args: argparse.Namespace,
                 environ: Mapping[str, str] | None = None) -> tuple[Config, bool]:
    """The runtime config for `stdio` and whether the admin listener runs; ConfigError when the
    flags or the config file cannot serve a stdio client."""
    # Imported here, as in the other commands: `envelope-proxy --help` stays quick.
    from proxy.config import AggregateConfig, UpstreamOverride, load_config
    from proxy.identity import IdentityConfig, names_problem

    command = list(args.command or [])
    if args.url and command:
        raise ConfigError("give either --url URL or a server command after `--`, not both")
    config = load_config(args.config, {"policies": args.policies, "state_dir": args.state_dir,
                                       "log_level": args.log_level}, environ)
    identity = config.identity
    if "identity" not in config.model_fields_set:
        identity = IdentityConfig(mode="static", principal=DEFAULT_PRINCIPAL)
    if args.principal:
        problem = names_problem("--principal", [args.principal])
        if problem is not None:
            raise ConfigError(problem)
        groups = identity.groups if identity.mode == "static" else []
        identity = IdentityConfig(mode="static", principal=args.principal, groups=groups)
    if identity.mode != "static":
        raise ConfigError(f"identity mode {identity.mode} cannot serve a stdio client (it sends no "
                          "token): use a static identity, or --principal")
    admin = "admin" in config.model_fields_set
    approvals = config.approvals
    if approvals.pending_hint is None:
        approvals = approvals.model_copy(update={"pending_hint": OUT_OF_BAND if admin else NO_APPROVER})
    upstreams = dict(config.upstreams)
    if args.url:
        upstreams[args.name] = UpstreamOverride(url=args.url)
    elif command:
        # The server gets the environment the client launched this command with (an MCP
        # client's `env` for its server lands here), minus the proxy's own settings.
        environ = os.environ if environ is None else environ
        env = {k: v for k, v in environ.items() if not k.startswith("ENVELOPE_")}
        # One client, one session, one child for the client's lifetime (as when the client
        # launched the server itself): never reaped for idleness.
        upstreams[args.name] = UpstreamOverride(command=command, env=env, cwd=os.getcwd(),
                                                idle_timeout=CLIENT_LIFETIME)
    config = config.model_copy(update={
        # The bridge's own listener: loopback, an ephemeral port, one process.
        "listen": "127.0.0.1:0", "workers": 1, "identity": identity, "upstreams": upstreams,
        "aggregate": AggregateConfig(enabled=False), "approvals": approvals,
    })
    return config, admin


def _protocol_streams() -> tuple[BinaryIO, BinaryIO]:
    """The client's stdin and stdout for the bridge alone; descriptors 0 and 1 are pointed at
    /dev/null and stderr so nothing else can read the protocol or write into it."""
    stdin = os.fdopen(os.dup(0), "rb")
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return stdin, stdout


def cmd_stdio(args: argparse.Namespace) -> int:
    from proxy.app.stdio import serve_stdio
    from proxy.cli.serve import _run, _setup_logging

    stdin, stdout = _protocol_streams()
    try:
        config, admin = stdio_config(args)
    except ConfigError as exc:
        print(f"envelope-proxy stdio: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    return int(_run(serve_stdio(config, args.name, stdin, stdout, admin=admin)))
