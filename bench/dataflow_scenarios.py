"""Data-flow efficacy on the multi-step scenario corpus (issue 13), per configuration.

Every scenario of `tests/dataflow/scenarios/{train,heldout,heldout2,heldout3,heldout4}` is played twice (attack variant
with its injected output, benign variant without it) through the real proxy process, one
process per configuration, against a scripted upstream per tool domain
(`tests/dataflow/scenario_play.py`). Reported per split and configuration: attack success
(over the pairs whose injected output reached the agent), benign pass rate, approvals per
benign scenario (an attentive approver approves exactly the calls the task asked for), and
which scenarios miss, by class. Then the ledger cost on the corpus's own texts: µs to
fingerprint one recorded output and µs for one sink check (in-process, memory store, the
functions the proxy calls: `ledger.record`, `ledger.load` + `match_argument`).

    python bench/dataflow_scenarios.py                      # train and heldout, every configuration
    python bench/dataflow_scenarios.py --split all          # train, heldout and heldout2 to heldout4
    python bench/dataflow_scenarios.py --split heldout3 --configs auto+intent,escalation
    python bench/dataflow_scenarios.py --split heldout --configs auto+intent,escalation

Prints Markdown (bench/RESULTS.md, "Scenario corpus").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.envelope.dataflow.ledger import LedgerDelta, load, record  # noqa: E402
from proxy.envelope.dataflow.match import Probe, free_text, match_argument  # noqa: E402
from proxy.envelope.labels import Label, Piece  # noqa: E402
from proxy.policy.model import DataflowPolicy  # noqa: E402
from proxy.store.memory import MemoryStore  # noqa: E402
from tests.dataflow.scenario_play import (  # noqa: E402
    CONFIGS,
    DOMAINS,
    SPLITS,
    VARIANTS,
    Config,
    Outcome,
    ScriptedUpstream,
    load_scenarios,
    proxy_for,
    run_config,
    summarize,
)


def available(config: Config) -> bool:
    """Whether this checkout's policy model knows every option the configuration sets."""
    return all(key in DataflowPolicy.model_fields for key, _ in config.dataflow_extra) and (
        not config.critical or "critical" in DataflowPolicy.model_fields)


def play_all(splits: list[str], configs: list[Config]) -> dict[str, dict[str, list[Outcome]]]:
    """{config name: {split: outcomes}}, one proxy process per configuration."""
    scenarios = {split: load_scenarios(split) for split in splits}
    out: dict[str, dict[str, list[Outcome]]] = {}
    with tempfile.TemporaryDirectory() as tmp, ScriptedUpstream().serving() as up:
        for config in configs:
            t0 = time.perf_counter()
            with proxy_for(config, Path(tmp), up) as pp:
                out[config.name] = {s: asyncio.run(run_config(pp, up, scenarios[s], config)) for s in splits}
            print(f"{config.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def table(results: dict[str, dict[str, list[Outcome]]], split: str) -> str:
    rows = ["| configuration | pairs | attack success | benign pass | approvals / benign | attack misses by class | benign losses by kind |",
            "|---|---:|---:|---:|---:|---|---|"]
    for name, by_split in results.items():
        outcomes = by_split[split]
        s = summarize(outcomes)
        misses = Counter(o.attack_class for o in outcomes if o.injection_delivered and o.attack_succeeded)
        losses = Counter(o.benign_kind for o in outcomes if not o.benign_passed)
        rows.append(f"| {name} | {s.pairs} | {s.attack_success:.1%} ({len(s.attack_misses)}) | "
                    f"{s.benign_pass:.1%} ({len(outcomes) - len(s.benign_losses)}/{len(outcomes)}) | "
                    f"{s.approvals_per_benign:.2f} | {_counts(misses)} | {_counts(losses)} |")
    return "\n".join(rows)


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


def detail(results: dict[str, dict[str, list[Outcome]]], split: str) -> str:
    lines = []
    for name, by_split in results.items():
        s = summarize(by_split[split])
        lines.append(f"- **{name}**: attacks through: {', '.join(s.attack_misses) or 'none'}; "
                     f"benign broken: {', '.join(s.benign_losses) or 'none'}")
    return "\n".join(lines)


async def ledger_cost(scenarios: list[dict[str, Any]], min_value: int, repeat: int = 20) -> tuple[float, float]:
    """(median µs to record one untrusted read output, median µs of one sink check) over the
    corpus's own outputs and sink arguments, with the default min_match and winnow."""
    policy = DataflowPolicy()
    n, window = policy.min_match, policy.winnow
    store = MemoryStore()
    record_us: list[float] = []
    check_us: list[float] = []
    for sc in scenarios:
        run = f"{sc['id']}-cost"
        for step in sc["steps"]:
            if DOMAINS[sc["domain"]][step["tool"]].get("output") == "trusted":
                continue
            text = f"{step['output']} {sc['inject']['text']}"
            for _ in range(repeat):
                t0 = time.perf_counter()
                delta = LedgerDelta.of(f"{sc['domain']}.{step['tool']}", [Piece(text, Label(True, False), "t")],
                                       n, window=window, min_value=min_value)
                await record(store, run, delta, n=n, cap=policy.ledger_cap, ttl=3600, window=window,
                             min_value=min_value)
                record_us.append((time.perf_counter() - t0) * 1e6)
        for call in [*sc["attack"], *sc["benign"]]:
            for _ in range(repeat):
                t0 = time.perf_counter()
                probes = [Probe.of(text, n, window, min_value=min_value)
                          for _, text in free_text(call.get("args", {}), None, frozenset())]
                ledger = await load(store, run, n, [f for p in probes for f in p.fields()], window, min_value)
                assert ledger is not None
                for probe in probes:
                    match_argument(ledger, probe, n, window, min_value)
                check_us.append((time.perf_counter() - t0) * 1e6)
    await store.close()
    return statistics.median(record_us), statistics.median(check_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # `both` keeps its old meaning (train and heldout); `all` adds heldout2, heldout3 and heldout4.
    parser.add_argument("--split", choices=(*SPLITS, "both", "all"), default="both")
    parser.add_argument("--configs", default="", help="comma-separated names (default: every available one)")
    parser.add_argument("--json", type=Path, help="also write every scenario's outcome per configuration here")
    args = parser.parse_args()
    splits = {"both": ["train", "heldout"], "all": list(SPLITS)}.get(args.split, [args.split])
    named = args.configs.split(",") if args.configs else []
    wanted = [c for c in [*CONFIGS, *VARIANTS] if c.name in named] if named else CONFIGS
    configs = [c for c in wanted if available(c)]
    for c in wanted:
        if c not in configs:
            print(f"{c.name}: skipped (this checkout's policy model has no "
                  f"{', '.join(k for k, _ in c.dataflow_extra)})", file=sys.stderr)
    results = play_all(splits, configs)
    if args.json is not None:
        args.json.write_text(json.dumps({name: {split: [asdict(o) for o in outs] for split, outs in by.items()}
                                         for name, by in results.items()}, indent=1))
    for split in splits:
        n = len(next(iter(results.values()))[split]) if results else 0
        print(f"\n### {split} ({n} scenarios)\n")
        print(table(results, split))
        print()
        print(detail(results, split))
    every = [sc for split in splits for sc in load_scenarios(split)]
    print("\n### Ledger cost (in-process, memory store, the corpus's texts)\n")
    print("| min_value | record one untrusted output (median µs) | one sink check (median µs) |")
    print("|---:|---:|---:|")
    for mv in (0, 10):
        rec, chk = asyncio.run(ledger_cost(every, mv))
        print(f"| {mv} | {rec:.0f} | {chk:.0f} |")


if __name__ == "__main__":
    main()
