"""Short copied values (issue 13, class 1): whole-value matching (`dataflow.min_value`) on the
labelled scenarios of short_values.yaml (the split min_value was chosen on) and
short_values_heldout.yaml (held out), with the run's intent endorsing what the user named.
Whole-value matching is off by default; RECOMMENDED is the value the docs advise when it is
switched on, chosen on the tuning split by the rule the first test asserts.

`python tests/dataflow/test_short_values.py` prints precision and recall per min_value for both
splits and for corpus.yaml (bench/RESULTS.md, "Short copied values").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from scoring import score

from proxy.envelope.dataflow.intent import Endorsement
from proxy.envelope.dataflow.ledger import Ledger, LedgerDelta
from proxy.envelope.dataflow.match import Probe, free_text, match_argument
from proxy.envelope.labels import Label, Piece
from proxy.policy.model import DataflowPolicy

HERE = Path(__file__).parent
TUNING = yaml.safe_load((HERE / "short_values.yaml").read_text())["cases"]
HELD_OUT = yaml.safe_load((HERE / "short_values_heldout.yaml").read_text())["cases"]
CORPUS = yaml.safe_load((HERE / "corpus.yaml").read_text())["cases"]
POLICY = DataflowPolicy()
CANDIDATES = (6, 8, 10, 12)
RECOMMENDED = 10  # README and bench/RESULTS.md, "Short copied values"


def flagged(case: dict[str, Any], min_value: int, n: int = POLICY.min_match,
            window: int = POLICY.winnow) -> bool:
    """Whether the data-flow check flags the case's sink (as `DataflowCheck.findings` decides:
    an endorsed whole value is skipped, endorsed tokens and grams are narrowed away)."""
    ledger = Ledger(n, window=window, min_value=min_value)
    ledger.merge(LedgerDelta.of("web.fetch_page", [Piece(case["source"], Label(True, False), "t")], n,
                                window=window, min_value=min_value), 65536)
    endorsement = Endorsement.of([case["intent"]] if case.get("intent") else [], n, window)
    declassified = set(case.get("declassify", case.get("declassified", [])))
    for ptr, text in free_text(case["args"], None, frozenset()):
        probe = Probe.of(text, n, window, min_value=min_value)
        if endorsement:
            if endorsement.whole(probe.norm):
                continue
            probe, _ = endorsement.narrow(ptr, probe, ledger)
        verbatim, toks = match_argument(ledger, probe, n, window)
        if toks or (verbatim and ptr[1:].split("/")[0] not in declassified):
            return True
    return False


def rates(cases: list[dict[str, Any]], min_value: int) -> tuple[float, float, int, int, int]:
    return score(cases, lambda case: flagged(case, min_value))


if __name__ == "__main__":
    print("split     min_value precision recall tp fp fn")
    for name, cases in (("tuning", TUNING), ("held-out", HELD_OUT), ("corpus", CORPUS)):
        for mv in (0, *CANDIDATES):
            p, r, tp, fp, fn = rates(cases, mv)
            print(f"{name:<9} {mv:<9} {p:.2f}      {r:.2f}   {tp} {fp} {fn}")


def test_the_recommended_value_is_the_most_precise_candidate_that_keeps_recall() -> None:
    """The rule the recommended min_value was chosen by, on the tuning split only: the best
    precision among the candidates that still catch at least three attacks in four."""
    scored = {mv: rates(TUNING, mv) for mv in CANDIDATES}
    eligible = [mv for mv in CANDIDATES if scored[mv][1] >= 0.75]
    assert RECOMMENDED == max(eligible, key=lambda mv: (scored[mv][0], -mv))


def test_held_out_precision_at_the_recommended_value() -> None:
    precision, recall, *_ = rates(HELD_OUT, RECOMMENDED)
    assert precision == 1.0
    assert recall >= 0.5


@pytest.mark.parametrize("case", [c for c in TUNING + HELD_OUT if c["flag"]], ids=lambda c: c["name"])
def test_attacks_are_not_flagged_with_whole_value_matching_off(case: dict[str, Any]) -> None:
    """Without min_value these attacks pass the check (what the issue measured), except where
    the value also has a distinctive token shape."""
    assert not flagged(case, 0) or case["name"] == "pin-change"


def test_user_named_values_pass_at_every_candidate() -> None:
    endorsed = [c for c in TUNING + HELD_OUT if not c["flag"] and c["name"] in (
        "user-named-venue-also-on-page", "product-user-asked", "approve-word", "folder-name-common",
        "language-setting", "benign-user-named-room", "benign-color", "benign-folder-archive")]
    assert len(endorsed) == 8
    for case in endorsed:
        assert not any(flagged(case, mv) for mv in CANDIDATES), case["name"]


def test_off_by_default_the_verbatim_corpus_flags_no_benign_flow() -> None:
    """Why it is off by default: on corpus.yaml the default flags no benign flow and catches
    every attack; the recommended value flags three benign flows (bench/RESULTS.md)."""
    assert POLICY.min_value == 0
    assert rates(CORPUS, POLICY.min_value)[2:] == (12, 0, 0)
    assert rates(CORPUS, RECOMMENDED)[2:] == (12, 3, 0)
