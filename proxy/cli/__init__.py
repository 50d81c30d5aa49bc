"""The `envelope-proxy` command: the parser and the dispatch to one module per command group.

`serve.py` (serve, demo), `stdio.py` (stdio), `policy.py` (check, test, replay), `scaffold.py` (scaffold), `audit.py` (audit verify, query,
tail), `admin.py` (approvals, idempotency, shadow, through the one admin API client in `admin_client.py`).
Each command's parser names its handler (`handler`), which returns the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from proxy.cli.admin import add_approvals_parser, add_idempotency_parser, add_shadow_parser
from proxy.cli.audit import add_audit_parser
from proxy.cli.policy import add_check_parser, add_replay_parser, add_test_parser
from proxy.cli.scaffold import add_scaffold_parser
from proxy.cli.serve import add_demo_parser, add_serve_parser
from proxy.cli.stdio import add_stdio_parser

__all__ = ["build_parser", "main"]

DESCRIPTION = """\
envelope-proxy: a policy-enforcement sidecar for AI-agent tool calls.

Point an MCP client at http://<listen>/mcp/<upstream> instead of the tool server (an HTTP
or stdio MCP server, or a REST API described by OpenAPI), or a REST client at
http://<listen>/http/<upstream>/<path>; every tool call passes the envelope of checks
(catalogue, capability, schema, authorization, argument rules, data flow, approval) before it
is forwarded, and every decision is audited and counted. MCP clients that launch their servers
as commands use `envelope-proxy stdio`."""

EPILOG = """common serve flags (see `envelope-proxy serve --help`):
  --config FILE  --policies DIR  --listen HOST:PORT  --admin HOST:PORT  --state-dir DIR
  each also as an ENVELOPE_* environment variable (ENVELOPE_POLICIES, ENVELOPE_LISTEN, ...)

examples:
  envelope-proxy demo                          run the demo (bundled notes server + ./policies)
  envelope-proxy stdio --policies DIR --name files -- npx -y @modelcontextprotocol/server-filesystem /data
                                               an MCP client's stdio server command, through the envelope
  envelope-proxy serve --config config.yaml    run for real
  envelope-proxy check policies/               validate a policy directory (file:line:column errors)
  envelope-proxy test policies/ --coverage     run the policy tests kept beside the policies
  envelope-proxy scaffold notes --url http://127.0.0.1:9001/mcp    draft a policy from a live server
  envelope-proxy audit verify .envelope-state/audit   prove the audit log untouched
  envelope-proxy audit verify .envelope-state/audit --anchors heads.log
                                               ... and not cut or rewritten since those heads were published
  envelope-proxy audit query .envelope-state/audit --since 1h --verdict deny    recent refusals
  envelope-proxy audit tail -f .envelope-state/audit  follow decisions as they are made
  envelope-proxy approvals list                pending approvals (token: ENVELOPE_APPROVER_TOKEN)
  envelope-proxy idempotency release <decision-id> --reason "checked: not performed"
                                               free a key whose outcome is unknown for a retry"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="envelope-proxy", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In this order in `--help`.
    add_serve_parser(sub)
    add_demo_parser(sub)
    add_stdio_parser(sub)
    add_check_parser(sub)
    add_audit_parser(sub)
    add_approvals_parser(sub)
    add_idempotency_parser(sub)
    add_shadow_parser(sub)
    add_replay_parser(sub)
    add_test_parser(sub)
    add_scaffold_parser(sub)
    return parser


# Commands that take a server command line after `--` (`scaffold NAME -- python server.py -v`).
# argparse cannot give a positional list after another positional once options sit between them,
# so the tail is cut off here and handed over as `args.command`.
TRAILING_COMMANDS = frozenset({"scaffold", "stdio"})


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] | None = None
    if words and words[0] in TRAILING_COMMANDS and "--" in words:
        cut = words.index("--")
        words, tail = words[:cut], words[cut + 1:]
    args = build_parser().parse_args(words)
    if tail is not None:
        args.command = tail
    try:
        return int(args.handler(args))
    except BrokenPipeError:
        # Whoever read stdout went away (`check policies | head -1`): stop quietly, as other
        # command-line tools do. stdout now points at /dev/null, so the interpreter's own
        # flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
