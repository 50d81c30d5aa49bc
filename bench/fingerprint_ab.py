"""In-process A/B of fingerprinting: the current code against an older checkout's, alternated in
one process so that a busy machine slows both alike (the least CPU time of many calls, each
timed alone).

Usage (from the repository root, venv active):

    mkdir /tmp/before && git archive <old-commit> proxy | tar -x -C /tmp/before
    python bench/fingerprint_ab.py --before /tmp/before [--rounds 40]

The older checkout's `proxy` package is imported as a second copy (its modules swapped out of
`sys.modules` again), so `delta` and `probe` are each version's own `LedgerDelta.of` and
`Probe.of` (whatever of normalising, token scanning and hashing the commits changed), and
`tokens` each version's `fingerprint.tokens`. Prints a Markdown table, µs of CPU per KB (KB = 1,000
characters) of typical prose (as generated, all ASCII, and with typographic quotes, dashes and
accents: the non-ASCII paths), and of the adversarial runs of fingerprint_bench.py.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fingerprint_bench import CASES, text_of

from proxy.envelope.dataflow import fingerprint, ledger, match
from proxy.envelope.labels import Label, Piece

Version = tuple[ModuleType, ModuleType, ModuleType]  # fingerprint, ledger, match
NON_ASCII = "typical prose, non-ASCII"


def _ops(version: Version) -> dict[str, Callable[[str, list[Piece]], object]]:
    fp, led, mat = version
    return {
        "tokens": lambda text, pieces: fp.tokens(text),
        "delta": lambda text, pieces: led.LedgerDelta.of("web.fetch", pieces, 32, 65536),
        "probe": lambda text, pieces: mat.Probe.of(text, 32),
    }


def _is_proxy(name: str) -> bool:
    return name == "proxy" or name.startswith("proxy.")


def _load(before: Path) -> Version:
    """The older checkout's fingerprint, ledger and match modules (a second `proxy` package)."""
    current = {name: module for name, module in sys.modules.items() if _is_proxy(name)}
    for name in current:
        del sys.modules[name]
    sys.path.insert(0, str(before))
    try:
        return (importlib.import_module("proxy.envelope.dataflow.fingerprint"),
                importlib.import_module("proxy.envelope.dataflow.ledger"),
                importlib.import_module("proxy.envelope.dataflow.match"))
    finally:
        sys.path.remove(str(before))
        for name in [name for name in sys.modules if _is_proxy(name)]:
            del sys.modules[name]
        sys.modules.update(current)


def _text(case: str, size: int) -> str:
    if case == NON_ASCII:
        prose = text_of("typical prose", size)
        return prose.replace(". ", "\u2019s \u2014 caf\u00e9. ", size // 400)[:size]
    return text_of(case, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    versions = {"before": _ops(_load(args.before)), "after": _ops((fingerprint, ledger, match))}
    ops = list(versions["after"])
    print("| case | size | operation | before µs/KB | after µs/KB | after/before |\n|---|---:|---|---:|---:|---:|")
    for case in ["typical prose", NON_ASCII, *list(CASES)[1:]]:
        for size in (5_000, 64_000):
            text = _text(case, size)
            pieces = [Piece(text, Label(True, False), "t")]
            repeat = max(1, 50_000 // size)
            best = {(op, name): float("inf") for op in ops for name in versions}
            for _ in range(args.rounds):
                for name, version in versions.items():
                    for op, fn in version.items():
                        # Each call's CPU time (this thread's), timed alone: on a shared
                        # machine wall-clock samples include the time other processes ran.
                        for _ in range(repeat):
                            start = time.thread_time()
                            fn(text, pieces)
                            best[op, name] = min(best[op, name], time.thread_time() - start)
            for op in ops:
                b, a = (best[op, name] * 1e6 / (size / 1000) for name in versions)
                print(f"| {case} | {size // 1000} KB | {op} | {b:,.0f} | {a:,.0f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
