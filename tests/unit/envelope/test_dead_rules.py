"""`check`'s warnings about argument rules that can never decide a call."""

from __future__ import annotations

from pathlib import Path

import pytest
from envelope_helpers import UPSTREAMS, build_revision

from proxy.cli import main
from proxy.envelope.checks.catalogue import dead_rules


def dead(rules: list[dict[str, str]]) -> list[str]:
    revision = build_revision({"upstreams": UPSTREAMS,
                               "tools": {"demo.x": {"effect": "read", "rules": rules}}})
    return [f"{subject.split(': ', 1)[-1]} {why}" for subject, why in dead_rules(revision)]


def test_a_false_rule_and_allow_rules_after_an_always_true_one_never_decide() -> None:
    assert dead([
        {"id": "off", "forbid": "false"},
        {"id": "all", "allow": " (true) "},
        {"id": "later", "allow": "args.a == 1"},
        {"id": "forbid-after", "forbid": "args.b == 2"},  # forbid rules all run: never shadowed
    ]) == [
        "tools.demo.x rule 'off' never matches: its forbid expression is false",
        "tools.demo.x rule 'later' never decides: allow rule 'all' before it is always true, and "
        "the first allow rule that matches allows",
    ]


def test_rules_that_can_decide_are_not_reported() -> None:
    assert dead([{"id": "kill-switch", "forbid": "true"}, {"id": "a", "allow": "args.a == 1"},
                 {"id": "b", "allow": "true"}, {"id": "c", "forbid": "args.c == false"}]) == []


def test_check_warns_with_the_rules_place_and_passes(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text('version: 1\nupstreams:\n  gh: {url: "http://127.0.0.1:9/mcp"}\ntools:\n'
                      "  gh.x:\n    effect: read\n    rules:\n      - {id: off, forbid: 'false'}\n")
    assert main(["check", str(tmp_path)]) == 0
    assert main(["check", "--strict", str(tmp_path)]) == 0
    assert (f"warning: {policy}:8:9: tools.gh.x rule 'off' never matches: its forbid expression "
            "is false") in capsys.readouterr().out
