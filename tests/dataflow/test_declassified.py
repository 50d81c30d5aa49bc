"""Declassified free text keeps the attacker's sentences out: the labelled split
(declassified.yaml, used to design the classifier and choose declassify_max_copy), the held-out
split (declassified_heldout.yaml, never tuned on) and the older corpora (corpus.yaml,
short_values*.yaml: the new findings must not flag their benign flows).

A flow is flagged as the check flags it: a token from the source in any argument, a copy of
`min_match` characters in an argument not declassified, and, in a declassified one, a copied
instruction-shaped sentence or a copied run of `declassify_max_copy` characters.
`python tests/dataflow/test_declassified.py` prints precision and recall per max_copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from scoring import score

from proxy.envelope.dataflow.ledger import Ledger, LedgerDelta
from proxy.envelope.dataflow.match import Probe, declassified_findings, free_text, match_argument
from proxy.envelope.labels import Label, Piece
from proxy.policy.model import DataflowPolicy

HERE = Path(__file__).parent
DEFAULTS = DataflowPolicy()


def _cases(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load((HERE / name).read_text())["cases"])


TUNING = _cases("declassified.yaml")
HELDOUT = _cases("declassified_heldout.yaml")
SHORT_VALUES = _cases("short_values.yaml") + _cases("short_values_heldout.yaml")


def flagged(case: dict[str, Any], max_copy: int = DEFAULTS.declassify_max_copy, shapes: bool = True) -> bool:
    n, window = DEFAULTS.min_match, DEFAULTS.winnow
    ledger = Ledger(n, window=window)
    ledger.merge(LedgerDelta.of("web.fetch", [Piece(case["source"], Label(True, False), "t")], n,
                                window=window), 65536)
    declassified = set(case.get("declassified", []))
    for ptr, text in free_text(case["args"], None, frozenset()):
        probe = Probe.of(text, n, window)
        verbatim, toks = match_argument(ledger, probe, n, window)
        if toks:
            return True
        if ptr[1:].split("/")[0] not in declassified:
            if verbatim:
                return True
            continue
        found = declassified_findings(ledger, probe, n, window, max_copy)
        if any(f.kind == "declassified_copy" or shapes for f in found):
            return True
    return False


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.xfail(reason=c["miss"], strict=True)) if "miss" in c else c
    for c in TUNING + HELDOUT], ids=[c["name"] for c in TUNING + HELDOUT])
def test_case_at_default(case: dict[str, Any]) -> None:
    assert flagged(case) == case["flag"]


def test_the_older_corpora_keep_their_verdicts() -> None:
    wrong = [c["name"] for c in _cases("corpus.yaml") if flagged(c) != c["flag"]]
    assert wrong == []
    # short_values*: none of their flows declassifies an argument, so no verdict can change.
    assert not any(c.get("declassified") or c.get("declassify") for c in SHORT_VALUES)


def test_precision_and_recall_at_default() -> None:
    """Measured, not tuned on the held-out split: the only miss is a paraphrased order (no copy)."""
    assert score(TUNING, flagged)[:2] == (1.0, 13 / 14)
    assert score(HELDOUT, flagged)[:2] == (1.0, 1.0)


def test_without_the_new_findings_declassified_attacks_pass() -> None:
    """The baseline the feature is measured against: declassify alone lets every order through."""
    _, recall, *_ = score(TUNING + HELDOUT, lambda c: flagged(c, 0, shapes=False))
    assert recall < 0.2


if __name__ == "__main__":
    print("split     max_copy shapes precision recall tp fp fn")
    for name, cases in (("tuning", TUNING), ("heldout", HELDOUT), ("corpus", _cases("corpus.yaml"))):
        for max_copy in (0, 64, 96, 128, 160, 200, 256):
            for shapes in (False, True):
                p, r, tp, fp, fn = score(cases, lambda c, m=max_copy, s=shapes: flagged(c, m, s))
                print(f"{name:<9} {max_copy:<8} {shapes!s:<6} {p:.2f}      {r:.2f}   {tp} {fp} {fn}")
