"""`bench/ledger_parts.py --prose mix` at a small size: what fingerprinting the mix bench's
outputs costs, part by part.

What a wrong bench would do: time other texts than the ones bench/mix.py's upstream sends (the
5 KB cell's fingerprint cost in RESULTS would not be that cell's), texts of another size or one
text again and again, or drop a part from the table.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import ledger_parts  # noqa: E402
import mix_upstream  # noqa: E402

from proxy.envelope.dataflow import fingerprint as F  # noqa: E402

PARTS = ["LedgerDelta.of", "fold", "collapse (of folded text)",
         "winnowed_packed (fold + collapse + winnow)", "folded_tokens (fold + scan)", "tokens + hash"]


def test_mix_prose_is_the_mix_upstreams_windows_distinct_and_without_tokens() -> None:
    texts = ledger_parts.texts("mix", 700, 30)
    answers = mix_upstream.Answers(700)
    assert texts == [answers.window() for _ in range(30)]  # what the upstream sends, in order
    assert {len(t) for t in texts} == {700} and len(set(texts)) == 30
    # RESULTS: "this prose has no tokens" (no URL, address or number), unlike the record prose.
    assert not any(F.folded_tokens(F.fold(t)) for t in texts)
    assert any(F.folded_tokens(F.fold(t)) for t in ledger_parts.texts("record", 700, 30))


def test_mix_prose_report_lists_every_part_with_a_cost(capsys: pytest.CaptureFixture[str]) -> None:
    assert ledger_parts.main(["--size", "500", "--outputs", "20", "--passes", "1", "--prose", "mix"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert head.startswith("500 chars of mix prose, 20 outputs, best of 1 passes"), head
    assert head.endswith(f"winnowing: {F.WINNOW_IMPL}, token scan: {getattr(F, 'TOKENS_IMPL', 'python')}")
    rows = [line.strip("|").split("|") for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| part ")]
    assert [name.strip() for name, _ in rows] == PARTS
    assert all(math.isfinite(float(us)) and float(us) > 0 for _, us in rows), rows
