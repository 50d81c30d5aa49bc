"""The token scans of issue 15, round 3 (the digit and IBAN patterns read over one byte of class
per character, the URL anchors counted once, tokens filtered as they are added) find exactly the
tokens the code before them found: the frozen copy `fingerprint_round2`, on a seeded corpus of
prose, token-dense text, adversarial runs of "@", ".", digits and separators, and text that is
not ASCII (decimal digits outside ASCII included), whichever scan (classes or plain text) the
share of characters that are not ASCII picks; and so does the native scan (`_tokens.c`), each
test run on both (the `token_scan` fixture)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import fingerprint_round2 as before
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.envelope.dataflow import fingerprint

# Pieces that start, end, extend and break every token pattern: separators of digit runs,
# letters before digits (IBANs), non-ASCII letters, digits ("٣", a fullwidth 5) and numerics
# ("²"), a literal "?" (the ASCII view's stand-in for what is not ASCII), invisible characters.
_PIECES = ["a", "b", "w", "x", "A", "1", "2", "0", "9", "٣", "\uff15", "²", "?", ".", "-", "_", "%",
           "+", "@", ":", "/", "(", ")", "|", ",", " ", "  ", "\t", "\n", "\xa0", "\u3000", "é",
           "ß", "\u200b", "www.", "http", "://", "https://", "x.yz", "ab.cd", "txt", "..", "cc1@",
           "@d.ee", "1a@b.cc", "de89", "37040044", "0532", " 0013", "12", "ab", "2024-07-12",
           "12/31/2024", "+1 (415) 555-0101", "4111 1111 1111 1111", "billing@evil-corp.example",
           "files.exfil-drop.example/x", "HTTPS://Docs.Example/Path?id=1", "a.b/c",
           "IBAN DE89 3704 0044 0532 0130 00", "gb82 west 1234 5698 7654 32", "Pay "]
_PROSE = ("the quarterly report is attached, please review the numbers before the meeting "
          "and send the summary to the team. ")
_WORDS = _PROSE.split()


@contextmanager
def _spacing(value: int) -> Iterator[None]:
    """ANCHOR_SPACING set to `value` (0: the class and anchored scans always; a huge value:
    the plain scans whenever a character is not ASCII), so that both paths are held to the old
    code."""
    saved = fingerprint.ANCHOR_SPACING
    fingerprint.ANCHOR_SPACING = value
    before.ANCHOR_SPACING = value
    try:
        yield
    finally:
        fingerprint.ANCHOR_SPACING = saved
        before.ANCHOR_SPACING = saved


def _assert_same(text: str) -> None:
    low = fingerprint.fold(text)
    for spacing in (0, fingerprint.ANCHOR_SPACING, 10**9):
        with _spacing(spacing):
            expected = before.folded_tokens(low)
            found = fingerprint.folded_tokens(low)
            assert found == expected, (spacing, text)
            assert fingerprint.tokens(text) == expected, (spacing, text)
            assert sorted(fingerprint.token_hash(k, v) for k, v in found) == \
                sorted(before.token_hash(k, v) for k, v in expected)


def _corpus(rng: random.Random) -> Iterator[str]:
    """Seeded texts of every kind: prose with sparse tokens, dense tokens, adversarial runs."""
    for _ in range(400):  # prose with a token now and then (the benchmark's outputs)
        yield " ".join(rng.choice(_PIECES) if rng.random() < 0.05 else rng.choice(_WORDS)
                       for _ in range(rng.randint(1, 400)))
    for _ in range(1500):  # dense: pieces only
        yield "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 80)))
    for unit in ("@", ".", "1", "1.", "1 ", "1-2", "ab12 ", "de89 3704 ", "a@", "a.", "٣", "1٣",
                 "x1", "(1)", "12/", "?1"):
        for length in (1, 7, 8, 9, 50, 3000):
            yield unit * length
            yield rng.choice(_WORDS) + " " + unit * length + " " + rng.choice(_PIECES)


pytestmark = pytest.mark.usefixtures("token_scan")
# The scan is set once per test, not per example.
_ONE_SCAN = [HealthCheck.function_scoped_fixture]


def test_a_seeded_corpus_makes_the_same_tokens_as_the_frozen_scans() -> None:
    for text in _corpus(random.Random(15)):
        _assert_same(text)


@settings(max_examples=2000, deadline=None, suppress_health_check=_ONE_SCAN)
@given(st.lists(st.sampled_from(_PIECES), max_size=60).map("".join))
def test_random_pieces_make_the_same_tokens_as_the_frozen_scans(text: str) -> None:
    _assert_same(text)


@settings(max_examples=500, deadline=None, suppress_health_check=_ONE_SCAN)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=80))
def test_arbitrary_text_makes_the_same_tokens_as_the_frozen_scans(text: str) -> None:
    _assert_same(text)


@pytest.mark.parametrize("text", ["", "?", "٣٣٣٣٣٣٣٣٣", "call 4111 1111 1111 1111 now", "de89 3704 0044 0532 0130 00"])
def test_edge_texts_make_the_same_tokens(text: str) -> None:
    _assert_same(text)


def test_token_and_phrase_hashes_are_the_frozen_ones() -> None:
    rng = random.Random(3)
    for text in [""] + ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 30))) for _ in range(300)]:
        assert fingerprint.token_hash("url", text) == before.token_hash("url", text)
        assert fingerprint.phrase_hash(text) == before.phrase_hash(text)
