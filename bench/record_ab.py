"""In-process A/B of fingerprinting on `bench/record_bench.py`'s outputs (issue 15): an older
checkout's `LedgerDelta.of` and `fingerprint.tokens` against this tree's, alternated in one
process so that a busy machine slows both alike (record_bench's wall and CPU columns move by
2x between runs of the same code on this shared machine).

For each size, eight distinct token-dense outputs (record_bench's prose: 1% each URLs, e-mail
addresses and long numbers); each output is timed `--rounds` times per version, alternating,
and keeps its least CPU time (this thread's); a cell is the median over the eight outputs.

Usage (from the repository root, venv active):

    mkdir /tmp/before && git archive <old-commit> proxy | tar -x -C /tmp/before
    python bench/record_ab.py --before /tmp/before [--rounds 30] [--sizes 1000,5000,10000,50000]

Prints a Markdown table, µs of CPU per output.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fingerprint_ab import Version, _load
from record_bench import CAP, N, output

from proxy.envelope.dataflow import fingerprint, ledger, match
from proxy.envelope.labels import Label, Piece

Op = Callable[[Version, str, list[Piece]], object]
OPS: dict[str, Op] = {
    "tokens": lambda version, text, pieces: version[0].tokens(text),
    "delta": lambda version, text, pieces: version[1].LedgerDelta.of("web.fetch", pieces, N, CAP),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="1000,5000,10000,50000")
    args = parser.parse_args()
    versions: dict[str, Version] = {"before": _load(args.before), "after": (fingerprint, ledger, match)}
    rng = random.Random(15)
    print("| output chars | operation | before µs | after µs | after/before |\n|---:|---|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        texts = [output(rng, size) for _ in range(8)]
        for op, fn in OPS.items():
            per: dict[str, list[float]] = {name: [] for name in versions}
            for text in texts:
                pieces = [Piece(text, Label(True, False), "t")]
                best = dict.fromkeys(versions, float("inf"))
                for _ in range(args.rounds):
                    for name, version in versions.items():
                        start = time.thread_time()
                        fn(version, text, pieces)
                        best[name] = min(best[name], time.thread_time() - start)
                for name in versions:
                    per[name].append(best[name] * 1e6)
            b, a = (statistics.median(per[name]) for name in versions)
            print(f"| {size:,} | {op} | {b:,.0f} | {a:,.0f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
