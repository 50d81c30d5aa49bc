"""The native winnowing extension (proxy/envelope/dataflow/_winnow.c) against the numpy functions
it replaces: the same fingerprints, bit for bit, on any text, so ledgers written by replicas of
mixed builds (one with a C compiler at install, one without) match each other's arguments.

Skipped without the extension (a machine with no C compiler); under ENVELOPE_REQUIRE_NATIVE=1
(CI, `.ci/run`) a missing extension fails instead, so a broken build cannot pass silently."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from envelope_helpers import each_in_a_thread, native_or_skip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.envelope.dataflow import fingerprint
from proxy.envelope.dataflow import ledger as ledger_module
from proxy.envelope.dataflow.fingerprint import (
    _SEGMENT,
    _numpy_window_hashes,
    _numpy_winnowed_hashes,
    _numpy_winnowed_packed,
    gram_length,
    normalise,
)
from proxy.envelope.dataflow.ledger import LedgerDelta
from proxy.envelope.labels import Label, Piece

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def native() -> None:
    native_or_skip("_winnow")


needs_native = pytest.mark.usefixtures("native")


def test_the_native_functions_serve_when_built() -> None:
    """With the extension built, fingerprinting uses it (and says so). Fails, rather than skips,
    under ENVELOPE_REQUIRE_NATIVE=1."""
    native_or_skip("_winnow")
    assert fingerprint.WINNOW_IMPL == "native"
    assert fingerprint.winnowed_packed is fingerprint._native_winnowed_packed
    assert fingerprint.winnowed_hashes is fingerprint._native_winnowed_hashes
    assert ledger_module.winnowed_packed is fingerprint._native_winnowed_packed


def test_envelope_native_0_falls_back_to_numpy_and_python() -> None:
    """ENVELOPE_NATIVE=0 forces the numpy functions and the Python token scans (for measuring
    them, or a suspect build), whatever is built: one switch for both extensions."""
    code = ("from proxy.envelope.dataflow import fingerprint as f, ledger; "
            "print(f.WINNOW_IMPL, f.winnowed_packed is f._numpy_winnowed_packed, "
            "f.TOKENS_IMPL, f.folded_tokens is f._python_folded_tokens, "
            "ledger.folded_tokens is f._python_folded_tokens)")
    env = {**os.environ, "ENVELOPE_NATIVE": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["numpy", "True", "python", "True", "True"]


def _pytest_without_extensions(require: bool) -> subprocess.CompletedProcess[str]:
    """The test of each extension that it serves, run by pytest in a new process where neither
    can be imported (as on a machine without a C compiler), with ENVELOPE_REQUIRE_NATIVE=1 or
    not."""
    tests = ["tests/unit/envelope/test_dataflow_native.py::test_the_native_functions_serve_when_built",
             "tests/unit/envelope/test_dataflow_native_tokens.py::test_the_native_scan_serves_when_built"]
    code = ("import sys, pytest; "
            "sys.modules['proxy.envelope.dataflow._winnow'] = None; "
            "sys.modules['proxy.envelope.dataflow._tokens'] = None; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{tests!r}]))")
    env = {key: value for key, value in os.environ.items()
           if key not in ("ENVELOPE_NATIVE", "ENVELOPE_REQUIRE_NATIVE")}
    env["PYTHONPATH"] = str(ROOT)
    if require:
        env["ENVELOPE_REQUIRE_NATIVE"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_missing_extensions_fail_under_envelope_require_native() -> None:
    """Without the extensions, their tests skip on a developer's machine and fail under
    ENVELOPE_REQUIRE_NATIVE=1 (CI): a build that broke cannot pass as a skip."""
    strict = _pytest_without_extensions(require=True)
    assert strict.returncode == 1 and "2 failed" in strict.stdout, strict.stdout
    assert "ENVELOPE_REQUIRE_NATIVE=1 but the native" in strict.stdout
    for module in ("_winnow", "_tokens"):
        assert f"is not built (proxy.envelope.dataflow.{module})" in strict.stdout
    lenient = _pytest_without_extensions(require=False)
    assert lenient.returncode == 0 and "2 skipped" in lenient.stdout, lenient.stdout


def _assert_same(text: str, n: int, window: int) -> None:
    k = gram_length(n, window)
    assert fingerprint._native_window_hashes(text, k).tolist() == _numpy_window_hashes(text, k).tolist()
    native = fingerprint._native_winnowed_hashes(text, n, window)
    assert native.dtype == np.uint64
    assert native.tolist() == _numpy_winnowed_hashes(text, n, window).tolist()
    assert fingerprint._native_winnowed_packed(text, n, window) == _numpy_winnowed_packed(text, n, window)


# Texts with repeats (few distinct characters: equal windows, so ties among minima), every kind
# of str storage (one byte, Latin-1, BMP, astral) and lone surrogates, which a str can hold.
_ALPHABETS = ["ab", "ab ", "a\u00e9", "x\u4e00 ", "\U0001f600a", "\ud800a\udfff", "\ud83d\ude00z"]
_TEXTS = st.one_of(
    st.builds(lambda alphabet, picks: "".join(alphabet[i % len(alphabet)] for i in picks),
              st.sampled_from(_ALPHABETS), st.lists(st.integers(0, 6), max_size=120)),
    st.lists(st.integers(0, 0x10FFFF), max_size=120).map(lambda codes: "".join(map(chr, codes))),
    st.text(max_size=120),
)


@needs_native
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXTS, n=st.integers(1, 40), window=st.integers(1, 17))
def test_native_matches_numpy(text: str, n: int, window: int) -> None:
    """Any text, any gram length (lengths around it: the texts are short), window 1 (every gram)
    and windows longer than the text has grams: the same hashes, kept grams and packed set."""
    if gram_length(n, window) < 1:
        return
    _assert_same(text, n, window)


@needs_native
@pytest.mark.parametrize("alphabet", ["abcdefgh ", "ab", "\u00e9a ", "\u4e00\u4e01 a", "\U0001f600\ud800 a"])
def test_native_matches_numpy_past_a_segment(alphabet: str) -> None:
    """Texts longer than `_SEGMENT` windows (numpy hashes them in segments; the native code in one
    rolling pass) and long enough that the native code runs without the GIL."""
    rng = random.Random(15)
    text = "".join(rng.choice(alphabet) for _ in range(2 * _SEGMENT + 77))
    for n, window in ((32, 4), (32, 1), (32, 16), (32, 17), (40, 24), (8, 3)):
        _assert_same(text, n, window)


def _crowded(count: int, k: int, top_bits: int) -> str:
    """A text whose `count` window hashes all have their top `top_bits` bits zero: each next
    character chosen so that the window it ends has such a hash (what an attacker who knows the
    hash could send to crowd one bucket of the native sort)."""
    mask, b = (1 << 64) - 1, fingerprint._B
    top, b_inv = pow(b, k - 1, 1 << 64), fingerprint._B_INV
    text = ["a"] * (k - 1)
    prefix = sum(ord(c) * pow(b, j, 1 << 64) for j, c in enumerate(text)) & mask  # the first k-1
    # The first window: prefix + c * B**(k-1); later ones: (previous - first char) / B + c * B**(k-1).
    current = prefix
    for i in range(count):
        base = current if i == 0 else ((current - ord(text[i - 1])) * b_inv) & mask
        c = next(c for c in range(0x4E00, 0x10FFFF)
                 if ((base + c * top) & mask) >> (64 - top_bits) == 0 and not 0xD800 <= c < 0xE000)
        text.append(chr(c))
        current = (base + c * top) & mask
    return "".join(text)


@needs_native
def test_a_text_crowding_one_bucket_sorts_right() -> None:
    """Hashes crowded into one bucket of the native sort's top bits (its quadratic case, were it
    not bounded) still come out as numpy's: sorted, distinct, the same bytes."""
    text = _crowded(300, gram_length(32, 1), 10)
    hashes = _numpy_window_hashes(text, gram_length(32, 1))
    assert len(hashes) == 300 and int(hashes.max()) >> 54 == 0
    _assert_same(text, 32, 1)
    _assert_same(text, 32, 4)


@needs_native
def test_hashing_from_threads_is_right() -> None:
    """Large outputs are fingerprinted in worker threads, natively without the GIL: every thread
    gets its own text's fingerprints."""
    rng = random.Random(7)
    texts = ["".join(rng.choice("abc de\u00e9\u4e00") for _ in range(20_000 + i)) for i in range(8)]
    expected = [_numpy_winnowed_packed(t, 32, 4) for t in texts]
    assert each_in_a_thread(lambda t: fingerprint._native_winnowed_packed(t, 32, 4), texts) == expected


PAGE = ("Quarterly report: revenue grew 12% to EUR 4.2m; contact finance@acme-example.com or "
        "wire the balance to DE89 3704 0044 0532 0130 00 by Friday. Das Büro in Köln bleibt "
        "geschlossen. 会议在星期五举行。 Emoji \U0001f600 and more prose to pass a few grams. ") * 3


def _delta(**kwargs: object) -> LedgerDelta:
    pieces = [Piece(PAGE, Label(True, False), "t"), Piece(PAGE[::-1], Label(True, False), "t")]
    return LedgerDelta.of("web.fetch", pieces, 32, limit=65536, **kwargs)  # type: ignore[arg-type]


@needs_native
@pytest.mark.parametrize("min_value", [0, 6])
def test_a_ledger_recorded_by_a_numpy_replica_is_the_native_ones(
        monkeypatch: pytest.MonkeyPatch, min_value: int) -> None:
    """A replica without the extension records the same fingerprints as one with it: the packed
    first piece, the winnowed grams of the others and (with min_value) the phrases."""
    native = _delta(min_value=min_value)
    monkeypatch.setattr(ledger_module, "winnowed_packed", _numpy_winnowed_packed)
    monkeypatch.setattr(ledger_module, "winnowed_hashes", _numpy_winnowed_hashes)
    numpy = _delta(min_value=min_value)
    assert native.grams and native.grams == numpy.grams
    assert native.tokens == numpy.tokens and native.values == numpy.values


def test_fingerprints_are_the_pinned_ones() -> None:
    """The fingerprints of a fixed text, pinned: stored ledgers outlive a build, so neither path
    may drift (each computes these)."""
    norm = normalise(PAGE)
    found = [_numpy_winnowed_packed(norm, 32, 4)]
    if fingerprint._native is not None:
        found.append(fingerprint._native_winnowed_packed(norm, 32, 4))
    for packed in found:
        assert len(packed) // 8 == PINNED_COUNT
        assert hashlib.sha256(packed).hexdigest() == PINNED_SHA256


# Computed by main at d7fe17f (numpy only): 86, f89583ef...; again when folding took the skeleton
# ("Büro", "Köln" lose their marks; the ledger scheme changed with it, "k").
PINNED_COUNT = 88
PINNED_SHA256 = "93044f1a7090614798363d002ed2ffe42d929e5e9387bddbd58987710cfd2643"
