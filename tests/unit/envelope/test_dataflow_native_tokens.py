"""The native distinctive-token scan (proxy/envelope/dataflow/_tokens.c) against the Python scans it
replaces: the same set of tokens for any str (folded or not, lone surrogates included), so a
replica built without a C compiler records and looks up the same token fingerprints.

Skipped without the extension; under ENVELOPE_REQUIRE_NATIVE=1 (CI, `.ci/run`) a missing
extension fails instead. The frozen-reference tests (test_dataflow_fingerprint_round3.py) and the
linear-time tests (test_dataflow_cost.py) run on both scans too (the `token_scan` fixture)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from envelope_helpers import each_in_a_thread, native_or_skip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.envelope.dataflow import fingerprint, intent, match
from proxy.envelope.dataflow import ledger as ledger_module
from proxy.envelope.dataflow.fingerprint import _python_folded_tokens, fold

Scan = Callable[[str], set[tuple[str, str]]]


@pytest.fixture
def native() -> Scan:
    scan: Scan = native_or_skip("_tokens").folded_tokens
    return scan


def test_the_native_scan_serves_when_built() -> None:
    """With the extension built, every caller scans natively (and the start-up log says so).
    Fails, rather than skips, under ENVELOPE_REQUIRE_NATIVE=1."""
    module = native_or_skip("_tokens")
    assert fingerprint.TOKENS_IMPL == "native"
    for user in (fingerprint, ledger_module, match, intent):
        assert user.folded_tokens is module.folded_tokens, user


def _assert_same(native: Scan, text: str) -> None:
    """The native scan finds what the Python scans find, in the text as it is and folded."""
    for low in (text, fold(text)):
        assert native(low) == _python_folded_tokens(low), low


# Pieces dense in what the patterns read: every anchor ("@", "://", "www."), the characters each
# pattern's runs are made of and those that end them (URL and path delimiters, `_TRAIL`), file
# extensions, dates, IBAN-shaped pieces, digits that are decimal ("٣"), digits that are not ("²",
# "①"), letters outside ASCII ("é", "ß", "Ω": word characters, not [a-z]), spaces outside ASCII,
# an astral character and a lone surrogate.
_PIECES = [
    "@", ".", ":", "/", "w", "www.", "http", "https://", "://", "0", "1", "4", "9", "12", "2024",
    "-", "_", "%", "+", " ", "  ", "\t", "\n", "(", ")", "'", '"', "<", ">", "|", "^", "`", "[", "]",
    "{", "}", "\\", ",", ";", "!", "*", "?", "a", "b", "c", "x", "z", "ab", "de", "A", "Z", "é",
    "ß", "Ω", "٣", "²", "①", "\u3000", "\xa0", "\U0001f600", "\ud800", "txt", "docx", "html", "c",
    "de89", "ab12", "37040044", " 0013", "0532", "2024-07-12", "12/31/2024", "x.yz", "ab.cd", "..",
    "a-", "-a", "cc1@", "@d.ee", "evil-corp.example", "files.exfil-drop.example/x",
]
_PIECE_TEXTS = st.lists(st.sampled_from(_PIECES), max_size=60).map("".join)
# Any code points, surrogates included (st.text leaves them out).
_ANY_TEXTS = st.lists(st.integers(0, 0x10FFFF), max_size=80).map(lambda codes: "".join(map(chr, codes)))
# Few distinct characters: long runs of one pattern's characters and their edges.
_RUN_TEXTS = st.builds(lambda alphabet, picks: "".join(alphabet[i % len(alphabet)] for i in picks),
                       st.lists(st.sampled_from(_PIECES), min_size=1, max_size=4),
                       st.lists(st.integers(0, 3), max_size=120))


@settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_PIECE_TEXTS)
def test_native_matches_python_on_pattern_pieces(native: Scan, text: str) -> None:
    _assert_same(native, text)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_RUN_TEXTS)
def test_native_matches_python_on_runs(native: Scan, text: str) -> None:
    _assert_same(native, text)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_ANY_TEXTS)
def test_native_matches_python_on_any_code_points(native: Scan, text: str) -> None:
    _assert_same(native, text)


_TOKENS = ["billing@evil-corp.example", "https://files.exfil-drop.example/up?id=7", "www.acme.io/a",
           "4412 9981 2207 13", "de89 3704 0044 0532 0130 00", "2024-07-12", "report.pdf",
           "docs.example150489.com/page/1", "+1 (415) 555-0101", "٣٣٣٣٣٣٣٣٣", "x@y.zz", "a.b.1x"]
_WORDS = "the quarterly report is attached please review the numbers before the meeting".split()


def _long_text(rng: random.Random, size: int) -> str:
    """Prose with tokens and pieces at random, past the size at which the scan drops the GIL and
    with more tokens than it buffers before adding them to its set."""
    parts: list[str] = []
    length = 0
    while length < size:
        roll = rng.random()
        part = rng.choice(_TOKENS) if roll < 0.15 else rng.choice(_PIECES) if roll < 0.4 else rng.choice(_WORDS)
        part += rng.choice([" ", " ", ", ", "\n", ""])
        parts.append(part)
        length += len(part)
    return "".join(parts)


@pytest.mark.parametrize("seed", range(12))
def test_native_matches_python_on_long_texts(native: Scan, seed: int) -> None:
    rng = random.Random(seed)
    text = _long_text(rng, rng.choice([4096, 6000, 20_000, 60_000]))
    assert len(text) >= 4096
    found = native(text)
    assert len(found) > 0
    _assert_same(native, text)


def test_a_text_with_more_tokens_than_the_buffer_holds(native: Scan) -> None:
    """Thousands of distinct tokens (the scan adds them to its set 256 at a time), in an ASCII
    text and in one that is not (another view of the text)."""
    text = " ".join(f"user{i}@host{i}.example 4412 9981 {i:04d} 13" for i in range(3000))
    for variant in (text, text + " \u00e9", text + " \u4e00", text + " \U0001f600"):
        found = native(variant)
        assert len(found) == 3 * 3000
        assert found == _python_folded_tokens(variant)


def test_scanning_from_threads_is_right(native: Scan) -> None:
    """Large outputs are fingerprinted in worker threads, natively without the GIL: every thread
    gets its own text's tokens."""
    rng = random.Random(9)
    texts = [_long_text(rng, 30_000) + chr(0x4E00 + i) * (i % 2) for i in range(8)]
    expected = [_python_folded_tokens(t) for t in texts]
    assert each_in_a_thread(native, texts) == expected


@pytest.mark.parametrize("text", [
    "", "@", "www.", "http://", "a://b", "1234567", "12345678", "٣٣٣٣٣٣٣٣", "²²²²²²²²", "de89 3704 0044",
    "ab12 3456 7890 ab", "a@b.cc", "mail: billing@evil-corp.example.", "see evil-pay.example/x).",
    "\ud800" * 10, "x" * 5000 + "@y.zz", "a.bc/def", "a.bc/de", "see x.yz/abc.", "http://a.bc/d",
    "user@a.bc:8/d", "www.a.bc/def", "read notes.txt/x", "www.", "awww.bb.cc/d", "1a://bb.cc",
    "mail abcdef-.com now", "x-y.example-.org", "foo.com@bar.org", "foo.example.1x/y z",
    "ann@b.-c.de", "ann@b.-.de", "ann@b-.c-.de", "ann@b.c1.dee2", "www.a.bc://d", "foo.com/",
])
def test_edge_texts(native: Scan, text: str) -> None:
    _assert_same(native, text)


def test_the_native_scan_takes_only_a_str(native: Scan) -> None:
    with pytest.raises(TypeError):
        native(b"billing@evil-corp.example")  # type: ignore[arg-type]
