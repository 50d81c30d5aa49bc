"""The winnowing guarantee, as a property: any run of min_match characters copied from an output,
inside arbitrary surrounding text, shares a kept fingerprint with it."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proxy.envelope.dataflow.fingerprint import gram_hashes, normalise, winnowed

# Few distinct characters: many equal hashes and ties, where the rightmost-minimum rule matters.
_TEXT = st.text(alphabet="ab cé.1\u200b", max_size=200)


@settings(max_examples=500, deadline=None)
@given(output=st.text(alphabet="ab cé.1\u200b", min_size=40, max_size=200), before=_TEXT, after=_TEXT, start=st.integers(0, 200),
       n=st.sampled_from([8, 12, 32]), window=st.sampled_from([1, 2, 4, 8]))
def test_a_copied_run_of_min_match_characters_is_found(
        output: str, before: str, after: str, start: int, n: int, window: int) -> None:
    norm = normalise(output)
    assume(len(norm) >= n)
    start %= len(norm) - n + 1
    copied = norm[start: start + n]
    argument = normalise(f"{before} {copied} {after}")
    assume(copied in argument)  # surrounding whitespace collapsed around it, the run intact
    kept = set(winnowed(norm, n, window))
    assert kept & set(gram_hashes(argument, n, window)), (norm, copied, argument)
