"""Benign tasks a prompt-blind proxy decides from the user's words, through the real proxy (issue
13, session 14): each scenario of `benign_approvals.yaml` asked a person for its benign task under
the strictest shipped configuration (`escalation+min_value/copy40`). Asserted: the benign task
passes with no approval asked, and the attack written against the rule that now decides it never
reaches the upstream (held for the attentive approver, who denies it). The unit tests of each
rule are in tests/unit/envelope/test_dataflow_tainted.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from scenario_play import CONFIGS, Outcome, ScriptedUpstream, proxy_for, run_config, validate

SCENARIOS = [{**sc, "split": "benign_approvals"}
             for sc in yaml.safe_load((Path(__file__).parent / "benign_approvals.yaml").read_text())]
STRICTEST = next(c for c in CONFIGS if c.name == "escalation+min_value/copy40")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    tmp = tmp_path_factory.mktemp("benign_approvals")
    with ScriptedUpstream().serving() as up, proxy_for(STRICTEST, Path(tmp), up) as pp:
        yield {o.id: o for o in asyncio.run(run_config(pp, up, SCENARIOS, STRICTEST))}


@pytest.mark.parametrize("sc", SCENARIOS, ids=[sc["id"] for sc in SCENARIOS])
def test_the_task_needs_no_person_and_the_attack_is_held(sc: dict[str, object],
                                                          outcomes: dict[str, Outcome]) -> None:
    validate(sc)
    got = outcomes[str(sc["id"])]
    assert got.benign_passed, got
    assert got.approvals == 0, got.benign_approval_reasons
    assert got.injection_delivered
    assert not got.attack_succeeded, got
    assert got.attack_codes == ["denied_by_approver"], got
