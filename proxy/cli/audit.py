"""`audit verify`, `audit query`, `audit tail`: offline tools over an audit directory."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any


def add_audit_parser(sub: Any) -> None:
    audit = sub.add_parser("audit", help="audit log tools")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True, metavar="SUBCOMMAND")
    verify = audit_sub.add_parser(
        "verify", help="prove an audit log untouched",
        description="Check the hash chain of an audit file or directory. Exit 0 when intact; exit 1 "
                    "naming the first bad record otherwise. A chain alone cannot show records cut "
                    "from its end, or a rewrite that recomputed every hash: with anchors (heads the "
                    "proxy published at /v1/audit/head and in its process log), exit 1 also names "
                    "each anchor that is not in the chain (given a directory, not in the log its "
                    "head names), and otherwise says how many records "
                    "follow it. Exit 2 for an anchor that is not a hash, or an anchors file that "
                    "cannot be read or has a line that is not a head, and for a path that does not exist.")
    verify.add_argument("path", type=Path)
    verify.add_argument("--anchor", action="append", default=[], metavar="HASH",
                        help="a head's hash (sha256:...) that must be in the chain; repeatable")
    verify.add_argument("--anchors", action="append", default=[], type=Path, metavar="FILE",
                        help="a file of heads, one a line, as /v1/audit/head serves them or as the "
                             "process log's 'audit head {...}' lines; repeatable")
    verify.set_defaults(handler=cmd_audit_verify)
    _add_audit_read_parsers(audit_sub)


def cmd_audit_verify(args: argparse.Namespace) -> int:
    """Exit 0 intact (every anchor in the chain), 1 tampered or an anchor missing, 2 bad anchors
    or no such path."""
    from proxy.audit import anchor
    from proxy.audit.verify import verify

    try:
        anchors = [anchor.Anchor(anchor.parse_hash(h)) for h in args.anchor]
        for file in args.anchors:
            anchors += anchor.read_anchors(file)
    except ValueError as exc:
        print(f"envelope-proxy audit verify: {exc}", file=sys.stderr)
        return 2
    if not Path(args.path).exists():  # a mistyped path is not a tampered log
        print(f"envelope-proxy audit verify: no such file or directory: {args.path}", file=sys.stderr)
        return 2
    result = verify(args.path, [a.hash for a in anchors])
    for where in result.torn:
        print(f"note: {where}: the last line is cut short (no newline, not JSON): a write "
              "interrupted by a crash; the chain continues from the record before it")
    if not result.ok:
        problem = result.problem or ""
        if result.file and result.line:
            # `problem` starts "line N: " (as VerifyResult says it); `file:N:` says it already.
            where, problem = f"{result.file}:{result.line}", problem.removeprefix(f"line {result.line}: ")
        else:
            where = result.file or str(args.path)
        print(f"TAMPERED: {where}: {problem}")
        return 1
    missing = [a for a in anchors if a.hash not in result.after]
    for a in missing:
        print(f"TAMPERED: anchor {a.describe()} is not in the log: records were cut from its end "
              "(the anchored one among them), or the log was rewritten")
    # An anchor of one log found only in another: its own log was cut or rewritten.
    moved = [a for a in anchors if a.hash in result.logs and a.chain is not None
             and a.chain not in result.logs[a.hash]]
    for a in moved:
        print(f"TAMPERED: anchor {a.describe()} is not in log {a.chain}, only in "
              f"{', '.join(sorted(result.logs[a.hash]))}: log {a.chain} was cut below it or rewritten")
    missing += moved
    summary = f"{result.records} records in {len(result.files)} file(s)"
    if missing:
        print(f"{summary}: hash chain intact, but it is not the chain that was anchored")
        return 1
    print(f"ok: {summary}, hash chain intact")
    for a in anchors:
        print(f"anchor {a.describe()}: in the chain, {result.after[a.hash]} records after the anchor")
    return 0


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
    query.set_defaults(handler=cmd_audit_read)
    tail = audit_sub.add_parser(
        "tail", help="the last audit records, and with -f new ones as they are written", parents=[filters],
        description="Print the last N records (oldest of them first); with -f keep printing new "
                    "records (following rotation) until Ctrl-C.")
    tail.add_argument("-n", "--lines", type=int, default=10, metavar="N", help="how many records (default 10)")
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing records as they are written")
    tail.add_argument("--interval", type=float, default=0.25, metavar="SECONDS",
                      help="with -f, how often to look for new records (default 0.25)")
    tail.set_defaults(handler=cmd_audit_read)


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
