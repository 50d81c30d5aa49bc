"""How a labelled corpus scores a flow check: precision and recall of its flags."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Case = dict[str, Any]


def score(cases: Iterable[Case], flagged: Callable[[Case], bool]) -> tuple[float, float, int, int, int]:
    """(precision, recall, tp, fp, fn) of `flagged` against each case's `flag` label."""
    tp = fp = fn = 0
    for case in cases:
        got = flagged(case)
        tp += got and case["flag"]
        fp += got and not case["flag"]
        fn += (not got) and case["flag"]
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    return precision, recall, tp, fp, fn
