"""What fingerprinting one untrusted output costs, part by part, in this process.

For outputs of `--size` characters of bench/record_bench.py's prose (words with a URL, an e-mail
address or a number now and then; `--prose mix`: the windows bench/mix.py's upstream sends, with
none), the best of `--passes` passes over `--outputs` distinct
outputs, in µs per output:

- `LedgerDelta.of`: everything one output adds to a run's ledger (what `Envelope.complete` runs
  before delivery; fingerprinting only, no store write);
- `fold`, `collapse`: the two normalising passes;
- `winnowed_packed`: fold, collapse and the winnowed gram fingerprints (native or numpy);
- `folded_tokens`, `tokens + hash`: the distinctive-token scans, and with their hashes.

`ENVELOPE_NATIVE=0` makes the same tree use its numpy winnowing and Python token scans
(`fingerprint.WINNOW_IMPL` and `TOKENS_IMPL` are printed): alternate the two to compare them in
one run.

    python bench/ledger_parts.py --size 200
    ENVELOPE_NATIVE=0 python bench/ledger_parts.py --size 200
    python bench/ledger_parts.py --size 5000 --outputs 300 --prose mix
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from mix_upstream import Answers  # noqa: E402
from record_bench import output  # noqa: E402

from proxy.envelope.dataflow import fingerprint as F  # noqa: E402
from proxy.envelope.dataflow.ledger import LedgerDelta  # noqa: E402
from proxy.envelope.labels import Label, Piece  # noqa: E402

N, CAP, WINDOW = 32, 65_536, 4


def best_us(texts: list[str], fn: Callable[[str], object], passes: int) -> float:
    """The best of `passes` passes over `texts`, in µs per text."""
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for text in texts:
            fn(text)
        best = min(best, (time.perf_counter() - start) / len(texts) * 1e6)
    return best


def texts(prose: str, size: int, outputs: int) -> list[str]:
    """`outputs` distinct outputs of `size` characters: record_bench.py's prose (`record`), or the
    windows bench/mix.py's upstream sends, in the order it sends them (`mix`)."""
    if prose == "mix":
        answers = Answers(size)
        return [answers.window() for _ in range(outputs)]
    rng = random.Random(3)
    return [output(rng, size) for _ in range(outputs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=200, help="characters per output (default 200)")
    p.add_argument("--outputs", type=int, default=2000, help="distinct outputs per pass (default 2000)")
    p.add_argument("--passes", type=int, default=3, help="passes; the best is reported (default 3)")
    p.add_argument("--prose", choices=["record", "mix"], default="record",
                   help="record_bench.py's token-dense prose (default), or the windows bench/mix.py's "
                        "upstream sends (no URLs, addresses or numbers)")
    args = p.parse_args(argv)
    outputs = texts(args.prose, args.size, args.outputs)
    untrusted = Label(True, False)
    parts: list[tuple[str, Callable[[str], object]]] = [
        ("LedgerDelta.of", lambda t: LedgerDelta.of("web.fetch", [Piece(t, untrusted, "t")], N, limit=CAP)),
        ("fold", F.fold),
        ("collapse (of folded text)", lambda t: F.collapse(t.lower())),
        ("winnowed_packed (fold + collapse + winnow)", lambda t: F.winnowed_packed(F.collapse(F.fold(t)), N, WINDOW)),
        ("folded_tokens (fold + scan)", lambda t: F.folded_tokens(F.fold(t))),
        ("tokens + hash", lambda t: [F.token_hash(k, v) for k, v in F.folded_tokens(F.fold(t))]),
    ]
    print(f"{args.size:,} chars of {args.prose} prose, {args.outputs:,} outputs, best of {args.passes} passes, winnowing: "
          f"{F.WINNOW_IMPL}, token scan: {getattr(F, 'TOKENS_IMPL', 'python')}\n")
    print("| part | µs per output |\n|---|---:|")
    for name, fn in parts:
        print(f"| {name} | {best_us(outputs, fn, args.passes):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
