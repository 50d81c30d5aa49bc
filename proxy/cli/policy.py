"""`check`, `test`, `replay`: offline commands over a policy directory."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from proxy.errors import ConfigError, PolicyError


def add_check_parser(sub: Any) -> None:
    check = sub.add_parser("check", help="validate a policy directory",
                           description="Load a policy directory as the proxy would. Prints every problem as "
                                       "file:line:column: message and exits 1 if there is any. Then lists the "
                                       "tools that can never run (misconfigured) and why: the registry layer "
                                       "from the policy alone, the envelope layer assuming the default runtime "
                                       "(sqlite store, approvals enabled); --strict makes them fail the check. Last, "
                                       "the weak spots: policy choices that run but let a class of attack through "
                                       "unasked (destructive effects no person confirms, sinks open to untrusted "
                                       "text, critical values too short to match, escalation without a required "
                                       "intent, gates the intent waives, arguments no check judges); reported, "
                                       "never failing.")
    check.add_argument("directory", type=Path)
    check.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], default=None,
                       help="CEL engine (env ENVELOPE_CEL_ENGINE; default auto)")
    check.add_argument("--strict", action="store_true",
                       help="also exit 1 when a tool is misconfigured (it can never run) or a principal's "
                            "rule_of_two holds all three properties")
    check.set_defaults(handler=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from proxy.config import cel_engine_setting
    from proxy.envelope.checks.catalogue import (
        dead_rules,
        misconfigurations,
        spec_problems,
        spec_registry,
        weak_spots,
    )
    from proxy.envelope.misconfig import Dependencies
    from proxy.policy.loader import load_policy

    try:
        revision = load_policy(args.directory, engine=cel_engine_setting(args.cel_engine))
    except PolicyError as exc:
        for problem in exc.problems:
            print(problem)
        n = len(exc.problems)
        print(f"{n} problem{'s' if n != 1 else ''} in {args.directory}", file=sys.stderr)
        return 1
    # HTTP upstreams: what their OpenAPI documents hold that cannot be supported, and tool keys
    # that name no operation, are errors like the policy's own.
    spec_errors = spec_problems(revision)
    if spec_errors:
        for error in spec_errors:
            print(error)
        n = len(spec_errors)
        print(f"{n} problem{'s' if n != 1 else ''} in {args.directory}", file=sys.stderr)
        return 1
    print(f"ok: {args.directory}: revision {revision.revision}, {len(revision.tools)} tools, "
          f"{len(revision.principals)} principals, {len(revision.files)} files ({revision.engine})")
    # No runtime here: the MCP upstreams' tools/list are unknown (so tools an upstream does not
    # offer and upstream tools with no policy are not reported for them; an HTTP upstream's
    # catalogue is its OpenAPI document, known), and the envelope layer is judged against the
    # default runtime.
    deps = Dependencies.default_runtime()
    registry = spec_registry(revision)
    problems = misconfigurations(revision, registry, deps)
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
    # Rules that can never decide a call: a mistake to point at, never failing the check.
    for subject, why in dead_rules(revision):
        print(f"warning: {subject} {why}")
    # Weak spots: allowed choices that let a class of attack through unasked; reported, never
    # failing the check (an operator may mean them).
    spots = weak_spots(revision, registry)
    for spot in spots:
        print(f"weak spot: {spot.subject} [{spot.kind}]: {spot.reason}")
    return 1 if (problems or dangerous) and args.strict else 0


def add_test_parser(sub: Any) -> None:
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
    test.add_argument("--format", choices=["text", "json"], default="text",
                      help="text (default) or one JSON document (cases, failures, problems, coverage)")
    test.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], default=None,
                      help="CEL engine (env ENVELOPE_CEL_ENGINE; default auto)")
    test.set_defaults(handler=cmd_test)


def cmd_test(args: argparse.Namespace) -> int:
    """`test DIR`: 0 when every case passes (and coverage meets --threshold), else 1."""
    from proxy.config import cel_engine_setting
    from proxy.tools.policy_tests import render_json, render_text, run_tests

    report = run_tests(args.directory, engine=cel_engine_setting(args.cel_engine),
                       coverage=args.coverage, threshold=args.threshold)
    out = render_json(report) if args.format == "json" else render_text(report, args.verbose)
    sys.stdout.write(out)
    return 0 if report.ok else 1


def add_replay_parser(sub: Any) -> None:
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
    replay.add_argument("--format", choices=["text", "json"], default="text",
                        help="text (default) or one JSON document (changes, summary, revisions)")
    replay.add_argument("--fail-on-change", action="store_true",
                        help="exit 1 when any decision changes")
    replay.add_argument("--config", type=Path, metavar="FILE", default=None,
                        help="runtime config whose approvals/idempotency settings apply (optional)")
    replay.add_argument("--cel-engine", choices=["auto", "cel-cpp", "cel-python"], default=None,
                        help="CEL engine (env ENVELOPE_CEL_ENGINE, else the --config file's "
                             "cel_engine; default auto)")
    replay.set_defaults(handler=cmd_replay)


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
        # The precedence `serve` gives it: the flag, the environment, the config file.
        engine = args.cel_engine or os.environ.get("ENVELOPE_CEL_ENGINE") or config.cel_engine
        revision = load_policy(args.policies, engine=engine)
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
