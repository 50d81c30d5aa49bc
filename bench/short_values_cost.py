"""What whole-value matching (`dataflow.min_value`) adds to recording one untrusted output:
ledger fingerprints and time of `LedgerDelta.of`, for typical prose, `min_value: 0` (the
default: grams and tokens only) against `min_value: 10` (phrases too).

    python bench/short_values_cost.py
"""

from __future__ import annotations

import random
import time

from proxy.envelope.dataflow.ledger import LedgerDelta
from proxy.envelope.labels import Label, Piece

WORDS = ("the of and to in report revenue customer account password meeting invoice please "
         "update team order shipped Thursday migration notice quarterly northern region demand "
         "Acme Ltd Hotel Miramar payment reference review laptop battery life").split()


def prose(chars: int, seed: int = 7, words: tuple[str, ...] | list[str] = WORDS) -> str:
    """`chars` characters of sentences of 6-16 random `words` (the same text for one seed)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 16))).capitalize() + "."
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)[:chars]


def measure(text: str, min_value: int) -> tuple[int, int, float]:
    piece = [Piece(text, Label(True, False), "t")]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        delta = LedgerDelta.of("web.fetch", piece, 32, limit=65536, min_value=min_value)
        best = min(best, time.perf_counter() - start)
    return len(delta.grams) + len(delta.tokens), len(delta.values), best * 1000


if __name__ == "__main__":
    print("chars     | before: fingerprints  ms | after: grams+tokens  phrases  ms | overflow")
    for chars in (1_000, 4_000, 16_000, 64_000, 256_000, 1_000_000):
        text = prose(chars)
        g0, _, t0 = measure(text, 0)
        g1, v1, t1 = measure(text, 10)
        over = LedgerDelta.of("web.fetch", [Piece(text, Label(True, False), "t")], 32, limit=65536,
                              min_value=10).overflow
        print(f"{chars:>9,} | {g0:>20,} {t0:7.1f} | {g1:>18,} {v1:>8,} {t1:7.1f} | {over}")
