"""The faster fingerprinting of issue 15 (round 2) makes exactly the fingerprints the code before
it made: the same folded and normalised text, the same tokens, the same winnowed grams and so the
same ledger deltas and probes, on random, token-dense, non-ASCII and hostile text, whichever scan
(anchored or plain) the density of anchors picks."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import fingerprint_round1 as before
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.envelope.dataflow import fingerprint
from proxy.envelope.dataflow.ledger import LedgerDelta
from proxy.envelope.dataflow.match import Probe
from proxy.envelope.invisible import visible
from proxy.envelope.labels import Label, Piece

# The normal form has since gained a last step on purpose (`fingerprint.skeleton`: marks removed,
# look-alike letters and other scripts' digits made ASCII; the ledger scheme says so): the
# reference folds as it did, then takes the skeleton. It has also gained, on purpose, the invisible
# characters the reference kept (tag characters, supplementary variation selectors, the other
# format characters: `proxy.envelope.invisible`, the one list the guardrails read too): removed
# after the reference's fold. Every other step is held to it unchanged.
_reference_fold = before._fold
before._fold = lambda text: fingerprint.skeleton(visible(_reference_fold(text)))

# Pieces that start, end, extend and break every token pattern, whitespace of every kind
# str.split() knows (ASCII and not), characters NFKC and case-folding change, invisible ones.
_PIECES = ["a", "b", "w", "x", "1", "2", "0", "٣", ".", "-", "_", "%", "+", "@", ":", "/", "(",
           ")", "|", " ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\xa0",
           "\u2003", "\u3000", "\x85", "é", "É", "ß", "\ufb01", "\uff21", "\u200b", "\u00ad", "\U000e0020", "\U000e0101", "\u0600", "²", "Ǆ",
           "www.", "http", "://", "https://", "x.yz", "ab.cd", "txt", "..", "cc1@", "@d.ee",
           "1a@b.cc", "de89", "37040044", "0532", " 0013", "12", "ab", "2024-07-12",
           "+1 (415) 555-0101", "billing@evil-corp.example", "files.exfil-drop.example/x",
           "HTTPS://Docs.Example/Path?id=1", "IBAN DE89 3704 0044 0532 0130 00", "Mail ", "Pay "]
# Plain prose around them, so that texts also have the sparse anchors of real outputs.
_PROSE = ("the quarterly report is attached, please review the numbers before the meeting "
          "and send the summary to the team. ")


@contextmanager
def _spacing(value: int) -> Iterator[None]:
    """Anchors at most one per `value` characters take the anchored scans (0: always; a huge
    value: never), so that both paths are held to the old code."""
    saved = fingerprint.ANCHOR_SPACING
    fingerprint.ANCHOR_SPACING = value
    try:
        yield
    finally:
        fingerprint.ANCHOR_SPACING = saved


def _assert_same(text: str) -> None:
    low = fingerprint.fold(text)
    assert low == before._fold(text)
    assert fingerprint.collapse(low) == fingerprint.normalise(text) == before.normalise(text)
    expected = before.tokens(text)
    for spacing in (0, fingerprint.ANCHOR_SPACING, 10**9):
        with _spacing(spacing):
            assert fingerprint.folded_tokens(low) == fingerprint.tokens(text) == expected, (spacing, text)


_TEXTS = st.lists(st.sampled_from(_PIECES), max_size=60).map("".join)


@settings(max_examples=3000, deadline=None)
@given(_TEXTS)
def test_random_pieces_make_the_same_tokens_and_normal_form(text: str) -> None:
    _assert_same(text)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_PIECES), st.integers(0, 3)), max_size=12))
def test_tokens_in_prose_make_the_same_tokens(parts: list[tuple[str, int]]) -> None:
    """Sparse anchors in prose: what the anchored scans are for."""
    _assert_same("".join(piece + _PROSE * gap for piece, gap in parts))


_ASCII_TEXTS = st.lists(st.sampled_from([piece for piece in _PIECES if piece.isascii()]),
                        max_size=60).map("".join)


@settings(max_examples=3000, deadline=None)
@given(_ASCII_TEXTS)
def test_ascii_pieces_make_the_same_tokens_and_normal_form(text: str) -> None:
    """ASCII text: the fast paths (folding, whitespace, character classes)."""
    _assert_same(text)


_DOMAIN_PIECES = ["a", "b", "1", ".", "-", "@", "_", " ", "/", ":", "x.yz", "ab.cd", "txt", "..",
                  "-a", "a.b.cc/", "www.", ".@", "cd.", ". ", "a_b.cc"]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_DOMAIN_PIECES), max_size=40).map("".join))
def test_domains_from_the_dots_a_label_follows_are_the_patterns_matches(text: str) -> None:
    """Skipping the dots no label follows (ASCII text) finds what every dot found."""
    dots = text.encode("ascii").translate(fingerprint._DOTS)
    assert [m.span() for m in fingerprint._domains(text, dots)] == \
        [m.span() for m in fingerprint._domains(text)] == \
        [m.span() for m in fingerprint._DOMAIN.finditer(text)]


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=80))
def test_any_text_makes_the_same_tokens_and_normal_form(text: str) -> None:
    _assert_same(text)


@pytest.mark.parametrize("unit", ["a", "a.", "1-2.", "1 2-3.", "x@", "a@b.cc1", "a1+", "www.",
                                  "a-.a", "ab12 ", "://", "a://", "@a", " ", "\n\t ", "ab1 "])
def test_hostile_runs_make_the_same_tokens(unit: str) -> None:
    for size in (1, 7, 100, 3_000):
        _assert_same(unit * (size // len(unit) + 1))
        _assert_same(_PROSE * 3 + unit * (size // len(unit) + 1) + " mail billing@evil-corp.example")


def test_generated_pages_make_the_same_deltas_and_probes() -> None:
    """End to end: the fingerprints an output records and a sink argument asks for, the old
    functions' fingerprints (grams winnowed from the old normal form, tokens hashed)."""
    rng = random.Random(15)
    for round_ in range(60):
        text = "".join(rng.choice(_PIECES) if rng.random() < 0.3 else _PROSE[: rng.randint(0, 90)]
                       for _ in range(rng.randint(1, 200)))
        if round_ % 3 == 0:
            text = text.encode("ascii", "ignore").decode()  # the ASCII fast paths
        norm = before.normalise(text)
        # What a ledger records and a probe asks for has since gained the other canonical
        # forms of each token (`fingerprint.variants`, on purpose), taken of the old tokens.
        tokens = {before.token_hash(kind, value) for kind, value in fingerprint.variants(before.tokens(text))}
        delta = LedgerDelta.of("web.fetch", [Piece(text, Label(True, False), "t")], 32, None, 4)
        assert set(delta.grams) == set(before.winnowed(norm, 32, 4))
        assert set(delta.tokens) == tokens
        probe = Probe.of(text, 32, 4, None)
        assert probe.norm == norm
        assert probe.grams == before.gram_hashes(norm, 32, 4)
        assert [(kind, value) for kind, value, _ in probe.tokens] == sorted(
            fingerprint.variants(before.tokens(text), parents=True))
        assert {h for _, _, h in probe.tokens} == {
            before.token_hash(kind, value) for kind, value in fingerprint.variants(before.tokens(text), parents=True)}
