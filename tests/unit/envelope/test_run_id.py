"""The one rule a run id a client names is held to (`X-Envelope-Run`, the admin API's run)."""

from __future__ import annotations

import pytest

from proxy.envelope.types import MAX_RUN_ID_CHARS, RUN_ID_RULE, run_id_problem


@pytest.mark.parametrize("run", ["r", "run-1", "a b", "principal:p/client:c@1.0", "~!{}%FF",
                                 "r" * MAX_RUN_ID_CHARS])
def test_run_ids(run: str) -> None:
    assert run_id_problem(run) is None


@pytest.mark.parametrize(("run", "why"), [
    ("", "it is empty"),
    ("r" * (MAX_RUN_ID_CHARS + 1), f"it has {MAX_RUN_ID_CHARS + 1}"),
    ("run\nforged", "U+000A at position 3"),
    ("run\t1", "U+0009 at position 3"),
    ("\x7f", "U+007F at position 0"),
    ("caf\u00e9", "U+00E9 at position 3"),
    ("run\u202e", "U+202E at position 3"),
    (" run", "U+0020 at position 0"),
    ("run ", "U+0020 at position 3"),
])
def test_not_run_ids_name_the_rule_and_the_place(run: str, why: str) -> None:
    assert run_id_problem(run) == f"{RUN_ID_RULE}: {why}"
