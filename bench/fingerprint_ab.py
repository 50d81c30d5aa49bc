"""In-process A/B of fingerprinting: the current `tokens` against the one in an older checkout,
alternated in one process so that a busy machine slows both alike (best of many rounds).

Usage (from the repository root, venv active):

    mkdir /tmp/before && git archive <old-commit> proxy | tar -x -C /tmp/before
    python bench/fingerprint_ab.py --before /tmp/before [--rounds 40]

`delta` and `probe` are `LedgerDelta.of` and `Probe.of` with `tokens` swapped between the two
versions (the only function the compared commits changed). Prints a Markdown table, µs per KB
(KB = 1,000 characters) of typical prose and of the adversarial runs of fingerprint_bench.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fingerprint_bench import CASES, text_of

from proxy.envelope.dataflow import fingerprint as after
from proxy.envelope.dataflow import ledger, match
from proxy.envelope.labels import Label, Piece


# Each looks `tokens` up in the module that calls it, where main() swaps the two versions.
def _tokens(text: str, pieces: list[Piece]) -> object:
    return ledger.tokens(text)


def _delta(text: str, pieces: list[Piece]) -> object:
    return ledger.LedgerDelta.of("web.fetch", pieces, 32, 65536)


def _probe(text: str, pieces: list[Piece]) -> object:
    return match.Probe.of(text, 32)


OPS: dict[str, Callable[[str, list[Piece]], object]] = {"tokens": _tokens, "delta": _delta, "probe": _probe}


def _load(before: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        "fingerprint_before", before / "proxy/envelope/dataflow/fingerprint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    before = _load(args.before)
    versions = {"before": before.tokens, "after": after.tokens}
    print("| case | size | operation | before µs/KB | after µs/KB | after/before |\n|---|---:|---|---:|---:|---:|")
    for case in CASES:
        for size in (5_000, 64_000):
            text = text_of(case, size)
            pieces = [Piece(text, Label(True, False), "t")]
            repeat = max(1, 50_000 // size)
            best = {(op, name): float("inf") for op in OPS for name in versions}
            for _ in range(args.rounds):
                for name, tokens in versions.items():
                    ledger.tokens = match.tokens = tokens
                    for op, fn in OPS.items():
                        start = time.perf_counter()
                        for _ in range(repeat):
                            fn(text, pieces)
                        best[op, name] = min(best[op, name], (time.perf_counter() - start) / repeat)
            for op in OPS:
                b, a = (best[op, name] * 1e6 / (size / 1000) for name in versions)
                print(f"| {case} | {size // 1000} KB | {op} | {b:,.0f} | {a:,.0f} | {a / b:.2f} |")
    ledger.tokens = match.tokens = after.tokens


if __name__ == "__main__":
    main()
