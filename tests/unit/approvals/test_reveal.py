"""What an approver reads of a call's arguments: hidden characters escaped, and listed."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.approvals.reveal import (
    disguised,
    hidden_characters,
    is_hidden,
    revealed,
    revealed_json,
    visible,
)

# A right-to-left override makes "/tmp/x\u202efdsa.sh" read as "/tmp/xhs.asdf"; a zero-width
# space makes two different keys and values look equal.
TRICKY = {"path": "/tmp/x\u202efdsa.sh", "na\u200bme": ["a\u00a0b", "line\nbreak", "\U000e0041", "\x7f"]}


def test_revealed_json_escapes_every_hidden_character_and_stays_the_same_json() -> None:
    text = revealed_json(TRICKY)
    assert json.loads(text) == TRICKY
    assert not any(is_hidden(c) for c in text)
    assert '"/tmp/x\\u202efdsa.sh"' in text and '"na\\u200bme"' in text
    assert '"a\\u00a0b"' in text and '"\\udb40\\udc41"' in text and '"\\u007f"' in text
    assert '"line\\nbreak"' in text  # control characters are JSON escapes already
    assert revealed_json({"a": "plain", "é": "ü 1"}, indent=None) == '{"a":"plain","é":"ü 1"}'


def test_hidden_characters_name_where_they_are() -> None:
    assert hidden_characters(TRICKY) == [
        {"path": "/path", "characters": ["U+202E"]},
        {"path": "/na\\u200bme (key)", "characters": ["U+200B"]},
        {"path": "/na\\u200bme/0", "characters": ["U+00A0"]},
        {"path": "/na\\u200bme/2", "characters": ["U+E0041"]},
        {"path": "/na\\u200bme/3", "characters": ["U+007F"]},
    ]
    assert hidden_characters({"body": "two\nlines\tand tabs", "n": 1, "a/b": ["~"]}) == []
    assert hidden_characters("\u2066x\u2069") == [{"path": "/", "characters": ["U+2066", "U+2069"]}]


def test_visible_escapes_what_a_terminal_would_obey_or_hide() -> None:
    assert visible("run\x1b[2J\x07\u202eok é\t") == "run\\u001b[2J\\u0007\\u202eok é\\u0009"
    assert visible("plain text / 1.5") == "plain text / 1.5"


def test_look_alike_letters_are_escaped_and_listed_where_scripts_mix() -> None:
    """A Cyrillic "a" (U+0430) in a Latin address reads as the address the user knows and is another one:
    escaped and listed. Text written in one script, however the scripts around it, is left as
    written: a Cyrillic name in a Latin message, Japanese mixing kana, kanji and a Latin letter."""
    tricky = {"to": "billing@p\u0430ypal.com", "p\u0430th": "/srv/ok", "list": ["\u0430pple.com/x"]}
    text = revealed_json(tricky, indent=None)
    assert json.loads(text) == tricky
    assert '"billing@p\\u0430ypal.com"' in text and '"\\u0430pple.com/x"' in text and '"p\\u0430th"' in text
    assert hidden_characters(tricky) == [
        {"path": "/to", "characters": ["U+0430"]},
        {"path": "/p\\u0430th (key)", "characters": ["U+0430"]},
        {"path": "/list/0", "characters": ["U+0430"]},
    ]
    # The minority script is the one escaped: a Latin "a" in a Cyrillic word too.
    assert disguised("\u043c\u0061\u043c\u0430") == {1}
    assert visible("ok p\u0430ypal") == "ok p\\u0430ypal"
    honest = {"name": "Мария", "note": "Привет, Bob", "jp": "Tシャツを買う", "fr": "déjà vu", "el": "Αθήνα"}
    assert hidden_characters(honest) == []
    assert revealed_json(honest, indent=None) == json.dumps(honest, ensure_ascii=False, separators=(",", ":"))


def test_invisible_marks_and_fillers_are_escaped_and_listed() -> None:
    """Characters no hidden category holds that a screen still shows as nothing: the combining
    grapheme joiner, variation selectors (an emoji's, a Mongolian one, the supplement's), Hangul
    and Khmer fillers, the blank Braille pattern. Each makes "paypal" another string."""
    blanks = ["\u034f", "\ufe0f", "\u180b", "\U000e0100", "\u3164", "\uffa0", "\u115f", "\u17b4", "\u2800"]
    tricky = {"to": [f"pay{c}pal.com" for c in blanks]}
    text = revealed_json(tricky, indent=None)
    assert json.loads(text) == tricky
    assert '"pay\\u034fpal.com"' in text and '"pay\\udb40\\udd00pal.com"' in text
    assert not any(is_hidden(c) for c in text)
    assert hidden_characters(tricky) == [
        {"path": f"/to/{i}", "characters": [f"U+{ord(c):04X}"]} for i, c in enumerate(blanks)]
    assert visible("pay\u3164pal") == "pay\\u3164pal"


def test_compatibility_letters_are_look_alikes_where_they_mix_with_latin() -> None:
    """A fullwidth or mathematical letter reads as the Latin one it folds to and is another
    character: in a Latin run it is escaped and listed; a run written wholly in one such form
    (Japanese fullwidth text) is left as written."""
    tricky = {"to": "\uff50aypal.com", "path": "/srv/\U0001d5c9aypal", "cmd": "rm -rf /\U0001d41ctmp"}
    text = revealed_json(tricky, indent=None)
    assert json.loads(text) == tricky
    assert '"\\uff50aypal.com"' in text and '"/srv/\\ud835\\uddc9aypal"' in text
    assert hidden_characters(tricky) == [
        {"path": "/to", "characters": ["U+FF50"]},
        {"path": "/path", "characters": ["U+1D5C9"]},
        {"path": "/cmd", "characters": ["U+1D41C"]},
    ]
    honest = {"jp": "ＡＢＣ社のＴシャツ", "kana": "ｶﾀｶﾅ", "math": "\U0001d6fc = 0.05"}
    assert hidden_characters(honest) == []


def _one_by_one(text: str) -> str:
    """`revealed` as first written: every character judged in turn (the reference)."""
    from collections import Counter

    from proxy.approvals.reveal import _escape, _lookalike_script
    marked: set[int] = set()
    for run in re.finditer(r'[^\s"]+', text):
        scripts = [_lookalike_script(c) for c in run.group()]
        counts = Counter(s for s in scripts if s is not None)
        if len(counts) > 1:
            main = counts.most_common(1)[0][0]
            marked.update(run.start() + i for i, s in enumerate(scripts) if s not in (None, main))
    return "".join(_escape(c) if is_hidden(c) or i in marked else c for i, c in enumerate(text))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["pay", "pal", "\u0430", "\u043c", "\u03bf", "\uff41", "\u202e", "\u200b",
                                 "\ufe0f", " ", '"', "\u00a0", "\x7f", "é", "東", "-", "@", "1"]), max_size=30))
def test_revealed_text_is_what_judging_each_character_gives(pieces: list[str]) -> None:
    """The C-speed search for what to escape (distinct characters judged once, runs of one script
    skipped) escapes exactly what judging every character in turn does."""
    text = "".join(pieces)
    assert revealed(text) == _one_by_one(text)

