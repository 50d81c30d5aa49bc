"""`same_person`: the self-approval and self-release rules compare an approver's name with a
call's principal as a reader takes them (case, width, invisible characters ignored)."""

from __future__ import annotations

import pytest

from proxy.approvals.approvers import own_call, same_person


@pytest.mark.parametrize("other", [
    "alice", "Alice", "ALICE", "aLiCe",
    "\uff41\uff4c\uff49\uff43\uff45",  # fullwidth
    "ali\u200bce", "alice\u200b", "\u2066alice\u2069", "al\u00adice",  # zero-width, bidi isolates, soft hyphen
    "ali\u034fce", "alice\ufe0f",  # combining grapheme joiner, variation selector
    " alice ",
])
def test_names_that_read_as_alice_are_alice(other: str) -> None:
    assert same_person("alice", other) and same_person(other, "alice")


def test_fold_and_compatibility_forms() -> None:
    assert same_person("strasse", "Stra\u00dfe")  # casefold: sharp s is ss
    assert same_person("\u212bngstr\u00f6m", "\u00c5ngstro\u0308m")  # Angstrom sign, a combining diaeresis
    assert same_person("\ufb01le", "file")  # the fi ligature


@pytest.mark.parametrize(("a", "b"), [
    ("alice", "bob"), ("alice", "alice2"), ("alice", "al ice"), ("alice", "alic\u0435"),  # Cyrillic e
    ("j\u00f6rg", "jorg"),
])
def test_other_names_are_other_people(a: str, b: str) -> None:
    assert not same_person(a, b)


def test_the_refusal_names_both_when_they_differ_and_escapes_the_principal() -> None:
    assert own_call("ops", "ops") == "ops cannot decide a call made by ops"
    said = own_call("Ops", "ops\u200b", "release")
    assert said.startswith("Ops cannot release a call made by ops\\u200b: the same name")
    assert "ignoring case, width and invisible characters" in said
