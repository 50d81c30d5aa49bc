"""Cost of fingerprinting one text, per KB, on typical text and on the texts that made the old
token scan quadratic; and whether the event loop keeps running while a large output is hashed.

Three operations, each on the same text (characters; KB = 1,000 characters):

- tokens: the distinctive tokens (`fingerprint.tokens`);
- delta: what one untrusted output adds to a ledger (`LedgerDelta.of`, ledger cap 65,536
  fingerprints; "after" also applies the default `max_output_chars` cap of 1 MiB, "after,
  uncapped" does not);
- probe: what one sink argument asks of the ledger (`Probe.of`: every gram and the tokens;
  "after" does not hash an argument longer than `max_argument_chars`, 64 KiB).

Typical text is generated prose with an e-mail address, a URL, a bare domain, a phone number
or an IBAN in about one sentence in ten. Worst cases are long runs of "a", "a.", digits with
separators, "x@" and addresses back to back. Each (code, case, size) runs in its own process
with a time limit, so a quadratic case of the old code cannot hang the benchmark.

Usage (from the repository root, venv active):

    mkdir /tmp/before && git archive <old-commit> proxy | tar -x -C /tmp/before  # code to compare with
    python bench/fingerprint_bench.py --before /tmp/before [--timeout 30]

Without --before only the current code is measured. Prints Markdown tables; bench/RESULTS.md
quotes them ("Fingerprinting cost").
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when if so "
         "report revenue quarter customer invoice meeting schedule review budget forecast team "
         "project delivery update please thanks regards attached summary numbers agenda").split()
SPECIALS = ("write to {w}.{w}@{w}-corp.example", "see https://docs.{w}.example/{w}/{w}?id={n}",
            "mirror at files.{w}-{w}.example/{w}", "call +1 (415) 555-{n4} or 030 1234 {n4}",
            "pay to IBAN DE89 3704 0044 0532 {n4} 00", "order {n} ships on 2024-07-{d}")
CASES = {
    "typical prose": None,
    '"a" run': "a",
    '"a." run': "a.",
    "digits with separators": "1-2.",
    '"x@" run': "x@",
    "addresses back to back": "a@b.cc1",
}
SIZES_TYPICAL = (4_000, 64_000, 1_000_000, 4_000_000)
SIZES_WORST = (8_000, 16_000, 64_000, 1_000_000, 4_000_000)


def typical(size: int, seed: int = 7) -> str:
    """Generated prose of `size` characters with a token-bearing phrase every ~10 sentences."""
    rng = random.Random(seed)
    out: list[str] = []
    length = 0
    while length < size:
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 20))]
        if rng.random() < 0.1:
            special = rng.choice(SPECIALS).format(w=rng.choice(WORDS), n=rng.randrange(10**7, 10**8),
                                                  n4=rng.randrange(1000, 10000), d=rng.randrange(10, 29))
            words.insert(rng.randrange(len(words)), special)
        sentence = " ".join(words).capitalize() + ". "
        out.append(sentence)
        length += len(sentence)
    return "".join(out)[:size]


def text_of(case: str, size: int) -> str:
    unit = CASES[case]
    if unit is None:
        return typical(size)
    return (unit * (size // len(unit) + 1))[:size]


# -- one measurement, in a child process whose PYTHONPATH selects the code ----------------------


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(case: str, size: int) -> dict[str, float]:
    from proxy.envelope.dataflow.fingerprint import tokens
    from proxy.envelope.dataflow.ledger import LedgerDelta
    from proxy.envelope.dataflow.match import Probe
    from proxy.envelope.labels import Label, Piece

    text = text_of(case, size)
    pieces = [Piece(text, Label(True, False), "t")]
    repeat = 3 if size <= 16_000 else 1
    capped = "max_chars" in inspect.signature(LedgerDelta.of).parameters
    out = {"tokens": _best(lambda: tokens(text), repeat),
           "delta": _best(lambda: LedgerDelta.of("web.fetch", pieces, 32, 65536), repeat),
           "probe": _best(lambda: Probe.of(text, 32), repeat)}
    if capped:
        out["delta_uncapped"] = _best(lambda: LedgerDelta.of("web.fetch", pieces, 32, 65536, max_chars=None), repeat)
        out["probe_uncapped"] = _best(lambda: Probe.of(text, 32, max_chars=None), repeat)
    return out


def run_child(code: Path, case: str, size: int, timeout: float) -> dict[str, float] | None:
    env = {**os.environ, "PYTHONPATH": str(code)}
    try:
        done = subprocess.run([sys.executable, __file__, "--measure", case, str(size)], env=env,
                              capture_output=True, text=True, timeout=timeout, check=True, cwd=code)
    except subprocess.TimeoutExpired:
        return None
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# -- the event loop while a large output is hashed ---------------------------------------------


async def _stall(work: Any) -> tuple[float, float]:
    """(seconds `work()` took, longest gap between 1 ms ticks of the loop meanwhile)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    done.set()
    await task
    return took, max(gaps)


async def loop_report() -> list[str]:
    from proxy.envelope.dataflow.ledger import LedgerDelta
    from proxy.envelope.dataflow.match import Probe
    from proxy.envelope.dataflow.offload import INLINE_CHARS, delta_of
    from proxy.envelope.labels import Label, Piece

    lines = ["| input | fingerprinted | took ms | longest loop stall ms |", "|---|---|---:|---:|"]
    for label, text in (("4 MB typical page", typical(4_000_000)),
                        ('1 MB "a" run (longest single scans)', text_of('"a" run', 1_000_000)),
                        ('1 MB of "a@b.cc1" (densest addresses)', text_of("addresses back to back", 1_000_000))):
        pieces = [Piece(text, Label(True, False), "t")]

        async def inline(pieces: list[Piece] = pieces) -> None:
            LedgerDelta.of("web.fetch", pieces, 32, 65536)

        async def offloaded(pieces: list[Piece] = pieces) -> None:
            await delta_of("web.fetch", pieces, 32, limit=65536)

        for how, work in (("inline (`LedgerDelta.of`)", inline), ("worker thread (`delta_of`)", offloaded)):
            took, stall = await _stall(work)
            lines.append(f"| {label} | {how} | {took * 1e3:,.0f} | {stall * 1e3:,.1f} |")

    def noop() -> None:
        return None

    hops = []
    for _ in range(500):
        start = time.perf_counter()
        await asyncio.to_thread(noop)
        hops.append(time.perf_counter() - start)
    lines += ["", f"Thread hop (`asyncio.to_thread` of a no-op, median of 500): {statistics.median(hops) * 1e6:.0f} µs. "
              f"Inline cost on typical text (INLINE_CHARS = {INLINE_CHARS:,}):", "",
              "| characters | delta µs | probe µs |", "|---:|---:|---:|"]
    for size in (1_000, 2_000, 4_000, 8_000, 16_000):
        text = typical(size)
        pieces = [Piece(text, Label(True, False), "t")]
        delta = statistics.median(_best(lambda p=pieces: LedgerDelta.of("web.fetch", p, 32, 65536), 1)
                                  for _ in range(30))
        probe = statistics.median(_best(lambda t=text: Probe.of(t, 32), 1) for _ in range(30))
        lines.append(f"| {size:,} | {delta * 1e6:,.0f} | {probe * 1e6:,.0f} |")
    return lines


# -- report -------------------------------------------------------------------------------------


def _cell(result: dict[str, float] | None, key: str, size: int, timeout: float) -> str:
    if result is None:
        return f"> {timeout:.0f} s"
    if key not in result:
        return "-"
    seconds = result[key]
    return f"{seconds * 1e3:,.1f} ms ({seconds * 1e6 / (size / 1000):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a directory holding the old `proxy` package")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per measurement (default 30)")
    parser.add_argument("--measure", nargs=2, metavar=("CASE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        return

    sys.path.insert(0, str(ROOT))  # this process reports on the code of this checkout
    sides = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    print("Each cell: best time for the whole text (µs per KB in brackets); "
          f"`> {args.timeout:.0f} s`: stopped at the time limit.\n")
    for op, title in (("tokens", "tokens"), ("delta", "LedgerDelta.of"), ("probe", "Probe.of")):
        header = "| case | size |" + "".join(f" {name} |" for name, _ in sides)
        if op != "tokens":
            header += " after, uncapped |"
        print(f"### {title}\n\n{header}\n|---|---:|" + "---:|" * (header.count("|") - 3))
        for case in CASES:
            slow = {name: False for name, _ in sides}
            for size in SIZES_TYPICAL if CASES[case] is None else SIZES_WORST:
                cells = []
                for name, code in sides:
                    if slow[name]:
                        cells.append("not run")
                        continue
                    if (name, case, size) not in _results:
                        _results[(name, case, size)] = run_child(code, case, size, args.timeout)
                    result = _results[(name, case, size)]
                    slow[name] = result is None
                    cells.append(_cell(result, op, size, args.timeout))
                if op != "tokens":
                    cells.append(_cell(_results[("after", case, size)], f"{op}_uncapped", size, args.timeout))
                print(f"| {case} | {size / 1000:,.0f} KB | " + " | ".join(cells) + " |")
        print()
    print("### The event loop while one output is fingerprinted (current code)\n")
    print("\n".join(asyncio.run(loop_report())))


_results: dict[tuple[str, str, int], dict[str, float] | None] = {}

if __name__ == "__main__":
    main()
