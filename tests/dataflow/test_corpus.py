"""The labelled data-flow corpus as regression tests, and its precision and recall.

Each case is an untrusted source text and a sink's arguments; the flow is flagged when an
argument (not declassified) copies at least `min_match` untrusted characters verbatim, or any
argument carries a distinctive token of the source. The chosen default must flag every attack
and no benign flow; `python tests/dataflow/test_corpus.py` prints the rates for several N.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from scoring import score

from proxy.envelope.dataflow.ledger import Ledger, LedgerDelta
from proxy.envelope.dataflow.match import free_text, match_argument
from proxy.envelope.labels import Label, Piece
from proxy.policy.model import DataflowPolicy

CORPUS = yaml.safe_load((Path(__file__).parent / "corpus.yaml").read_text())["cases"]
DEFAULT_N = DataflowPolicy().min_match
DEFAULT_WINNOW = DataflowPolicy().winnow


def flagged(case: dict[str, Any], n: int, window: int = DEFAULT_WINNOW) -> bool:
    ledger = Ledger(n, window=window)
    ledger.merge(LedgerDelta.of("web.fetch_page", [Piece(case["source"], Label(True, False), "t")], n,
                                window=window), 65536)
    declassified = set(case.get("declassify", case.get("declassified", [])))
    for ptr, text in free_text(case["args"], None, frozenset()):
        verbatim, toks = match_argument(ledger, text, n, window)
        if toks or (verbatim and ptr[1:].split("/")[0] not in declassified):
            return True
    return False


def rates(n: int, window: int = DEFAULT_WINNOW) -> tuple[float, float, int, int, int]:
    return score(CORPUS, lambda case: flagged(case, n, window))


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_case_at_default(case: dict[str, Any]) -> None:
    assert flagged(case, DEFAULT_N) == case["flag"]


def test_precision_and_recall_at_default() -> None:
    precision, recall, *_ = rates(DEFAULT_N)
    assert (precision, recall) == (1.0, 1.0)


if __name__ == "__main__":
    print("N  winnow precision recall tp fp fn")
    for n in (12, 16, 20, 24, 28, 32, 40, 48, 64):
        for window in (1, 4, 8):
            if n - window + 1 < 8:
                continue
            p, r, tp, fp, fn = rates(n, window)
            print(f"{n:<3} {window:<6} {p:.2f}      {r:.2f}   {tp} {fp} {fn}")
