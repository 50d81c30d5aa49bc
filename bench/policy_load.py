"""Policy load and hot reload at scale: time `load_policy` cold and after a one-tool change.

Generates a policy directory of N tools x R rules (each tool with its own JSON schema, CEL `allow`,
R forbid/allow rules with literals unique to the tool, `matches` patterns and a guardrail pattern),
then times, in one process with one engine (as the runtime keeps it):

- cold: the first `load_policy` of the directory, plus building the check chain from it;
- reload: `load_policy` again after one tool's rules changed, plus the chain (what a hot reload pays).

    python bench/policy_load.py --tools 10,100,1000 --rules 15
    python bench/policy_load.py --tools 1000 --files 1,20         # one file, or one per 50 tools
    python bench/policy_load.py --tools 1000 --profile 25        # cProfile top functions

It prints a Markdown table; bench/RESULTS.md ("Policy load at scale") quotes it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

RULES = [
    ('forbid', 'args.repo.startsWith("corp/secret-{i}")'),
    ('forbid', 'args.repo.contains("vault{i}")'),
    ('forbid', 'args.query.matches("(?i)(password{i}|api[_-]?key|secret)\\\\s*[:=]")'),
    ('forbid', 'args.query.contains("ghp_{i}")'),
    ('forbid', 'size(args.query) > {n}'),
    ('forbid', 'has(args.labels) && "embargoed-{i}" in args.labels'),
    ('forbid', 'has(args.labels) && size(args.labels) > {m}'),
    ('forbid', 'has(args.limit) && args.limit > {n}'),
    ('forbid', 'args.repo.endsWith("-archive-{i}")'),
    ('forbid', 'args.repo in ["corp/hr-{i}", "corp/payroll", "corp/legal"]'),
    ('forbid', 'args.query.matches("[A-Za-z0-9._%+-]+@{i}[A-Za-z0-9.-]+\\\\.[a-z]{{2,}}")'),
    ('allow', 'args.repo.startsWith("corp/docs-{i}")'),
    ('allow', 'args.repo.startsWith("oss/") && size(args.query) < {n}'),
    ('allow', 'args.repo.matches("^design{i}/[a-z]+$")'),
    ('allow', 'args.repo.startsWith("corp/") && principal.id != "blocked-{i}"'),
]


def tool_yaml(i: int, rules: int, variant: int = 0) -> str:
    """One `tools:` entry; `variant` changes its rules' literals (a one-tool edit)."""
    n = 100 + i % 50 + variant
    lines = [
        f"  bench.tool_{i}:",
        "    effect: read",
        "    output: untrusted",
        "    schema:",
        "      type: object",
        "      properties:",
        f'        repo: {{type: string, pattern: "^[a-z0-9-]+/[a-z0-9._-]+{i}$", maxLength: {n}}}',
        f"        query: {{type: string, minLength: 1, maxLength: {n}}}",
        "        labels: {type: array, items: {type: string, maxLength: 50}, maxItems: 10}",
        "        limit: {type: integer, minimum: 1, maximum: 100}",
        "      required: [repo, query]",
        "      additionalProperties: false",
        "    allow:",
        f"      - 'principal.id == \"bench-agent\" || \"team-{i}\" in principal.groups'",
        "    guardrails:",
        f'      - {{id: ticket-{i}, pattern: "TICKET-{i}-[0-9]+"}}',
        "    rules:",
    ]
    for r in range(rules):
        kind, expr = RULES[r % len(RULES)]
        text = expr.format(i=f"{i}x{variant}x{r // len(RULES)}", n=n + r // len(RULES), m=8)
        lines.append(f"      - id: r{r}")
        lines.append(f"        {kind}: '{text}'")
    lines.append("    fallback: deny")
    return "\n".join(lines) + "\n"


def write_policy(
    directory: Path, tools: int, rules: int, changed: int | None = None, files: int = 1
) -> None:
    """The policy in `files` files (the tools dealt out in order; the first file holds the rest),
    each rewritten only when its text changes (as a git pull leaves untouched files alone)."""
    head = (
        "version: 1\nupstreams:\n  bench:\n    url: \"http://127.0.0.1:9100/mcp\"\n"
        "defaults:\n  unknown_tools: deny\nprincipals:\n  bench-agent:\n    capability: read-write\n"
    )
    per = -(-tools // files)
    for f in range(files):
        body = "".join(tool_yaml(i, rules, 1 if i == changed else 0)
                       for i in range(f * per, min(tools, (f + 1) * per)))
        text = (head if f == 0 else "") + ("tools:\n" + body if body else "")
        path = directory / f"policy-{f:03d}.yaml"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")


def build_chain(revision: Any) -> None:
    """What the runtime builds from a revision besides loading it (the checks compile CEL too)."""
    from proxy.envelope.checks.arg_rules import ArgRulesCheck
    from proxy.envelope.checks.authz import AuthzCheck
    from proxy.envelope.tools import ToolRegistry

    registry = ToolRegistry()
    ArgRulesCheck(revision, registry)
    AuthzCheck(revision, registry)


def timed(directory: Path, engine: Any) -> tuple[float, float, Any]:
    from proxy.policy.loader import load_policy

    t0 = time.perf_counter()
    revision = load_policy(directory, engine=engine)
    t1 = time.perf_counter()
    build_chain(revision)
    return t1 - t0, time.perf_counter() - t1, revision


def measure(tools: int, rules: int, engine_name: str, profile: int,
            sort: str = "cumulative", files: int = 1) -> dict[str, float]:
    from proxy.policy import cel, loader, schemas

    # Cold means cold: nothing compiled by an earlier row of this run is reused.
    for cache in (cel._lint, cel._parse, cel._re2_compile):
        cache.cache_clear()
    schemas._VALIDATORS.clear()
    loader._PARSED.clear()
    engine = cel.get_engine(engine_name)
    tmp = Path(tempfile.mkdtemp(prefix="policy-load-"))
    try:
        write_policy(tmp, tools, rules, files=files)
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        cold_load, cold_chain, _ = timed(tmp, engine)
        write_policy(tmp, tools, rules, changed=tools // 2, files=files)
        reload_load, reload_chain, _ = timed(tmp, engine)
        if prof:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(profile)
            print(out.getvalue())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "cold_load": cold_load, "cold_chain": cold_chain,
        "reload_load": reload_load, "reload_chain": reload_chain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tools", default="10,100,1000", help="comma-separated tool counts")
    parser.add_argument("--rules", type=int, default=15, help="rules per tool")
    parser.add_argument("--files", default="1",
                        help="comma-separated file counts to spread the tools over")
    parser.add_argument("--engine", default="auto", help="CEL engine: auto, cel-cpp, cel-python")
    parser.add_argument("--profile", type=int, default=0, help="print the top N functions (cProfile)")
    args = parser.parse_args()
    counts = [int(n) for n in args.tools.split(",")]
    print("| tools x rules | files | cold load | cold chain | reload (1 tool changed) | reload chain |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        for files in [int(f) for f in args.files.split(",")]:
            r = measure(n, args.rules, args.engine, args.profile, files=files)
            print(f"| {n} x {args.rules} | {files} | {r['cold_load']:.2f} s | "
                  f"{r['cold_chain']:.2f} s | {r['reload_load']:.2f} s | "
                  f"{r['reload_chain']:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
