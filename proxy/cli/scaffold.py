"""`scaffold`: write a starting policy and its tests from a live MCP server's tools."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from proxy.errors import UpstreamError

DESCRIPTION = """\
Connect to a live MCP server (Streamable HTTP at --url, or a stdio server started from the
command after `--`), list its tools (all pages) and write DIR/NAME.yaml and DIR/tests/NAME.yaml.

The policy declares the upstream and every tool with an explicit effect derived from its MCP
annotations (readOnlyHint -> read; destructiveHint false -> write, or external when open-world;
else destructive; a comment says what it was derived from); external and destructive tools need
approval; outputs are untrusted unless the tool is annotated closed-world (openWorldHint false).
The tests hold one case per tool: allowed, or held for approval (approval_pending), with minimal
arguments for its input schema. `envelope-proxy check --strict DIR` and `envelope-proxy test
DIR` pass on the result; review it before use.

Exit 0 when both files are written; 1 when the server cannot be listed; 2 on usage errors or
when a file exists and --force is not given (nothing is written then)."""

EPILOG = """examples:
  envelope-proxy scaffold notes --url http://127.0.0.1:9001/mcp
  envelope-proxy scaffold files --out policies/ -- npx -y @modelcontextprotocol/server-filesystem /tmp"""


def add_scaffold_parser(sub: Any) -> None:
    scaffold = sub.add_parser("scaffold", help="write a starting policy and tests from a live MCP server",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    scaffold.add_argument("name", metavar="NAME", help="the upstream name (policy keys are NAME.<tool>)")
    # The command line after `--` is cut off by `proxy.cli.main` (TRAILING_COMMANDS).
    scaffold.add_argument("command", nargs=argparse.SUPPRESS, default=[], metavar="-- COMMAND ...",
                          help="a stdio server to start and list, after `--`")
    scaffold.add_argument("--url", help="the server's Streamable HTTP endpoint, e.g. http://127.0.0.1:9001/mcp")
    scaffold.add_argument("--out", type=Path, default=Path("policies"), metavar="DIR",
                          help="the policy directory to write into (default: policies)")
    scaffold.add_argument("--force", action="store_true", help="overwrite DIR/NAME.yaml and DIR/tests/NAME.yaml")
    scaffold.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                          help="give up listing the server after this long (default: 30)")
    scaffold.set_defaults(handler=cmd_scaffold)


def _usage(message: str) -> int:
    print(f"envelope-proxy scaffold: {message}", file=sys.stderr)
    return 2


def cmd_scaffold(args: argparse.Namespace) -> int:
    """`scaffold NAME`: 0 when both files are written; 1 when listing fails; 2 on usage errors
    and existing files without --force (nothing written)."""
    from pydantic import ValidationError

    from proxy.policy.model import UPSTREAM_NAME, Upstream
    from proxy.tools.scaffold import derive, list_tools, render_policy, render_tests, valid_tools

    if (args.url is None) == (not args.command):
        return _usage("give exactly one of --url URL or -- COMMAND ...")
    if not UPSTREAM_NAME.match(args.name):
        return _usage(f"NAME {args.name!r} must match {UPSTREAM_NAME.pattern}")
    if args.url is not None:
        try:
            Upstream(url=args.url)
        except ValidationError as exc:
            return _usage(str(exc.errors()[0]["msg"]))
    policy_path = args.out / f"{args.name}.yaml"
    tests_path = args.out / "tests" / f"{args.name}.yaml"
    if not args.force:
        for path in (policy_path, tests_path):
            if path.exists():
                return _usage(f"{path} exists (use --force to overwrite)")
    try:
        # The operator's environment: a stdio server may need its credentials and PATH.
        listed = asyncio.run(list_tools(args.url, args.command, seconds=args.timeout, env=os.environ))
    except UpstreamError as exc:
        source = args.url or " ".join(args.command)
        print(f"envelope-proxy scaffold: cannot list the tools of {source}: {exc}", file=sys.stderr)
        return 1
    tools, skipped = valid_tools(args.name, [derive(t) for t in listed])
    for name in skipped:
        print(f"envelope-proxy scaffold: skipped tool {name!r}: not a valid policy key "
              f"(tool names are 1-128 of [A-Za-z0-9_.-])", file=sys.stderr)
    policy = render_policy(args.name, tools, url=args.url, command=args.command, skipped=skipped)
    tests = render_tests(args.name, tools)
    tests_path.parent.mkdir(parents=True, exist_ok=True)
    policy_path.write_text(policy)
    tests_path.write_text(tests)
    gated = sum(t.gated for t in tools)
    print(f"wrote {policy_path} ({len(tools)} tools, {gated} gated) and {tests_path} ({len(tools)} cases)")
    return 0
