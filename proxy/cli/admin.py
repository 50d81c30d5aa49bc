"""`approvals`, `idempotency` and `shadow`: commands that talk to a running proxy's admin API."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from proxy.approvals.reveal import visible
from proxy.cli.admin_client import AdminClient, default_admin_url
from proxy.errors import AdminApiError

_ADMIN_HELP = "admin listener URL (env ENVELOPE_ADMIN_URL; default http://127.0.0.1:9090)"


def _admin_flags(parser: argparse.ArgumentParser, default: Any, token_help: str) -> None:
    """`--admin URL` and `--token`, on a command or (with `default=argparse.SUPPRESS`, so the
    command's own value stands unless given again) after its subcommand."""
    parser.add_argument("--admin", metavar="URL",
                        default=default_admin_url() if default is None else default,
                        help=_ADMIN_HELP)
    parser.add_argument("--token", default=default, help=token_help)


def _asked(command: str, ask: Callable[[], Any]) -> Any | None:
    """The admin API's answer to `ask()`, or None once its failure is printed as one line on
    stderr (`envelope-proxy COMMAND: ...`: the API's status and message, or why it cannot be
    reached)."""
    try:
        return ask()
    except AdminApiError as exc:
        said = str(exc) if exc.status is None else f"{exc.status}: {exc.message}"
        print(f"envelope-proxy {command}: {said}", file=sys.stderr)
        return None


def add_shadow_parser(sub: Any) -> None:
    shadow = sub.add_parser(
        "shadow", help="review the writes shadow runs recorded instead of performing",
        description="Read a running proxy's shadow records (GET /v1/shadow on the admin listener).")
    common = argparse.ArgumentParser(add_help=False)
    _admin_flags(common, None, "approver token: shadow records hold arguments "
                               "(default: env ENVELOPE_APPROVER_TOKEN)")
    common.add_argument("--run", default=None, help="only the records of this run id")
    common.add_argument("--limit", type=int, default=100, help="the most recent N records (default 100)")
    ssub = shadow.add_subparsers(dest="shadow_command", required=True, metavar="SUBCOMMAND")
    ssub.add_parser("list", help="one line per recorded write, oldest first", parents=[common])
    ssub.add_parser("export", help="the records as JSON lines (full arguments)", parents=[common])
    shadow.set_defaults(handler=cmd_shadow)


def cmd_shadow(args: argparse.Namespace) -> int:
    """`shadow list|export`: exit 0 with the records, 1 when the admin API refuses or is down."""
    client = AdminClient.from_flags(args.admin, args.token)
    data = _asked("shadow", lambda: client.get("/v1/shadow", {"run": args.run, "limit": args.limit}))
    if data is None:
        return 1
    records = data.get("records", []) if isinstance(data, dict) else []
    if args.shadow_command == "export":
        for record in records:
            print(json.dumps(record, sort_keys=True, separators=(",", ":")))
        return 0
    for r in records:
        gate = " (would need approval)" if r.get("would_need_approval") else ""
        # Run ids and principals come from the callers: no escape sequence of theirs reaches
        # the terminal, no hidden character reorders the line.
        print(visible(f"{r.get('time', '?')}  run={r.get('run')}  {r.get('principal')} -> "
                      f"{r.get('upstream')}.{r.get('tool')} [{r.get('effect')}]{gate}  "
                      f"decision={r.get('decision_id')}  "
                      f"args={json.dumps(r.get('arguments'), sort_keys=True)}"))
    print(f"{len(records)} shadow record(s)", file=sys.stderr)
    return 0


def add_approvals_parser(sub: Any) -> None:
    approvals = sub.add_parser(
        "approvals", help="list, show, approve and deny gated calls (through the admin API)",
        description="Talk to a running proxy's approvals API. The approver is whoever holds the "
                    "token (--token or ENVELOPE_APPROVER_TOKEN; names and token digests are in the "
                    "runtime config under approvals.approvers). Nobody can approve their own call.")
    _admin_flags(approvals, None, "approver token (default: env ENVELOPE_APPROVER_TOKEN)")
    approvals.add_argument("--json", action="store_true", help="print the API's JSON answers")
    # The same flags after the subcommand too (`approvals approve ID --admin URL`).
    common = argparse.ArgumentParser(add_help=False)
    # Shown in each subcommand's help: the README's tour passes --admin after `list`/`approve`.
    _admin_flags(common, argparse.SUPPRESS, "approver token (default: env ENVELOPE_APPROVER_TOKEN)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the API's JSON answers")
    asub = approvals.add_subparsers(dest="approvals_command", required=True, metavar="SUBCOMMAND")
    ls = asub.add_parser("list", help="list approvals (default: pending ones)", parents=[common])
    ls.add_argument("--state", default="pending",
                    choices=["pending", "approved", "denied", "expired", "consumed", "all"],
                    help="the approvals in this state (default pending)")
    show = asub.add_parser("show", help="show one approval, with the call's arguments", parents=[common])
    show.add_argument("id")
    approve = asub.add_parser("approve", help="approve one call (optionally granting similar calls)", parents=[common])
    approve.add_argument("id")
    approve.add_argument("--reason", required=True, help="why (recorded with the decision)")
    approve.add_argument("--grant", choices=["tool", "run"], default=None,
                         help="also grant later calls of the same principal and tool (and run, for run)")
    approve.add_argument("--grant-args", default=None, metavar="JSON",
                         help='exact argument values the granted calls must hold, e.g. \'{"title": "x"}\'')
    approve.add_argument("--grant-duration", default="1h", metavar="DURATION",
                         help="how long the grant lasts (e.g. 30m; default 1h)")
    deny = asub.add_parser("deny", help="deny one call", parents=[common])
    deny.add_argument("id")
    deny.add_argument("--reason", required=True,
                      help="why (recorded, and told to the agent in the refusal)")
    asub.add_parser("grants", help="list active grants", parents=[common])
    approvals.set_defaults(handler=cmd_approvals)


def _approval_line(a: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a["expires_at"]))
    who = f" by {visible(str(a['approver']))}" if a.get("approver") else ""
    # Run ids (a client's name, for stateless calls) and principals come from the callers:
    # nothing in them reaches the terminal as an escape sequence or hides text.
    return (f"{a['id']}  {a['state']:<8}  {visible(str(a['principal']))} -> "
            f"{visible(str(a['upstream']))}.{visible(str(a['tool']))}  "
            f"run {visible(str(a['run']))}  {a['args_digest'][:19]}  expires {when}{who}")


def cmd_approvals(args: argparse.Namespace) -> int:
    """`approvals ...`: 0 on success; 1 when the admin API refuses or cannot be reached; 2 on a
    bad --grant-args."""
    command = args.approvals_command
    client = AdminClient.from_flags(args.admin, args.token)
    query: dict[str, object] | None = None
    body: dict[str, Any] | None = None
    if command == "list":
        path = "/v1/approvals"
        query = None if args.state == "all" else {"state": args.state}
    elif command == "show":
        path = f"/v1/approvals/{args.id}"
    elif command == "grants":
        path = "/v1/grants"
    else:
        body = {"reason": args.reason}
        if command == "approve" and args.grant:
            try:
                grant_args = json.loads(args.grant_args) if args.grant_args else {}
            except ValueError as exc:
                print(f"envelope-proxy approvals: --grant-args is not JSON: {exc}", file=sys.stderr)
                return 2
            body["grant"] = {"scope": args.grant, "args": grant_args, "duration": args.grant_duration}
        path = f"/v1/approvals/{args.id}/{command}"
    data = _asked("approvals",
                  lambda: client.get(path, query) if body is None else client.post(path, body))
    if data is None:
        return 1
    if args.json or command == "show":
        print(json.dumps(data, indent=2, sort_keys=True))
        cut = [a["id"] for a in data.get("approvals", []) if a.get("arguments_truncated")]
        if command == "list" and cut:
            print(f"envelope-proxy approvals: the list cuts large arguments ({len(cut)} approvals: "
                  f"arguments_truncated); `show ID` prints them whole", file=sys.stderr)
    elif command == "list":
        for a in data["approvals"]:
            print(_approval_line(a))
        if not data["approvals"]:
            print(f"no {'' if args.state == 'all' else args.state + ' '}approvals")
        if data.get("truncated"):
            print("envelope-proxy approvals: the proxy holds more approvals than it lists; "
                  "`show ID` reads any one (the id is in the call's refusal and the webhook)",
                  file=sys.stderr)
    elif command == "grants":
        for g in data["grants"]:
            run = f" run {visible(str(g['run']))}" if g.get("run") else ""
            print(f"{g['id']}  {g['scope']:<4}  {visible(str(g['principal']))} -> "
                  f"{visible(str(g['upstream']))}.{visible(str(g['tool']))}{run}  "
                  f"args {json.dumps(g['args'], sort_keys=True)}  by {visible(str(g['approver']))}")
        if not data["grants"]:
            print("no active grants")
        if data.get("truncated"):
            print("envelope-proxy approvals: the proxy holds more grants than it lists (the first "
                  "1,000 it read); calls still find theirs", file=sys.stderr)
    else:
        grant = f"; grant {data['grant']['id']} ({data['grant']['scope']})" if data.get("grant") else ""
        print(f"{data['id']} {data['state']} by {data['approver']}: {data['decision_reason']}{grant}")
    return 0


def add_idempotency_parser(sub: Any) -> None:
    idem = sub.add_parser(
        "idempotency", help="release an idempotency key whose outcome is unknown (admin API)",
        description="A keyed or gated writer whose upstream outcome is unknown (HTTP 5xx, reset, "
                    "timeout, client left) refuses every retry with `idempotency_in_flight`, "
                    "naming its decision id. Once you know the call was not performed, release "
                    "its key: the next call with that key is performed. Needs an approver token "
                    "(--token or ENVELOPE_APPROVER_TOKEN); the release is audited.")
    isub = idem.add_subparsers(dest="idempotency_command", required=True, metavar="SUBCOMMAND")
    rel = isub.add_parser("release", help="release the key of a decision whose outcome is unknown")
    rel.add_argument("decision_id", help="the decision id the refusal names")
    rel.add_argument("--reason", required=True,
                     help="why you know the call was not performed (recorded with the release)")
    _admin_flags(rel, None, "approver token (default: env ENVELOPE_APPROVER_TOKEN)")
    rel.add_argument("--json", action="store_true", help="print the API's JSON answer")
    idem.set_defaults(handler=cmd_idempotency)


def cmd_idempotency(args: argparse.Namespace) -> int:
    """`idempotency release ID`: 0 when released; 1 when the admin API refuses (404 nothing to
    release, 409 the key holds another call now, ...) or cannot be reached."""
    client = AdminClient.from_flags(args.admin, args.token)
    data = _asked("idempotency", lambda: client.post(
        f"/v1/idempotency/{args.decision_id}/release", {"reason": args.reason}))
    if data is None:
        return 1
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(visible(f"released the idempotency key {data['idempotency_key']} of decision "
                      f"{data['decision_id']} ({data['principal']} -> {data['upstream']}."
                      f"{data['tool']}, run {data['run']}); audit record {data['record']}"))
    return 0
