"""Gate waiver (`dataflow.waive_gate: intent`): a gated call the user's own words ask for.

A person approving "delete f-23" right after the user typed "delete f-23, it's a duplicate" adds
nothing but a click. With `waive_gate: intent` for a sink, its approval gate (`gated_effects` or
its `approval.required`) is waived when the run's intent (the user's words, sent by the agent
framework: `proxy.envelope.dataflow.intent`) asks for the call on its own:

- **the action**: a clause of the intent (`clauses`: split at sentence ends, ";", ":", ", ",
  line breaks and joining words such as "and", "then", "but", "also", "except") writes the
  tool's verb (the first word of its name: `delete` of `delete_file`, `cancel` of
  `cancelOrder`), inflected or not, not negated (no "not", "don't", "never", "instead",
  "rather", "keep" in the 3 words before it); another verb does not ask for it ("remove bob
  from #general" does not ask `delete_user` to delete bob's account);
- **the object**: every critical value of the call (`dataflow.critical`, else every argument
  that is not declassified; at least one) is named by the words of such a clause (so "archive
  the old notes, then delete f-22" and "delete f-23 but not f-24" name neither the old notes
  nor f-24 for a deletion): written whole
  (`IntentWords.spells`: "delete f-23"), a bare number written as a reference right after a
  word that names a kind of thing ("cancel event 58", "order #31"; not a count: "the 12 spam
  mails", "delete 12"), an identifier (a word with a digit) only when it is the one identifier
  its sentence writes ("delete the older of f-22 and f-23" leaves the choice to a person), an address whose owner the intent names and a trusted listing holds,
  or the one entry of a trusted listing the intent's words pick ("the file called 'old notes'")
  or its criterion picks ("the oldest draft"). Trusted outputs, handles and pointed reads,
  which endorse a tainted run's sink, do not waive a gate: they say the value exists, not that
  the user asked for this to be done to it.

Never waived: a call the data-flow check flagged or escalated (`on_flag`/`on_tainted`), a call
in shadow mode, a call with no intent on record, or with more critical values than are checked.
The waiver is audited (`extra.gate_waived`: the verb and how each argument was named) and
counted (`envelope_gates_waived_total`); the idempotency claim of a gated call is kept (a
waived writer still reaches its upstream at most once). An injected "delete f-22" in a run
whose user asked to delete f-23 names an object the user did not: the gate holds it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# A word that turns the verb after it into its opposite ("don't delete", "instead of deleting").
NEGATIONS = frozenset({
    "not", "no", "never", "nor", "without", "don't", "dont", "doesn't", "didn't", "won't",
    "shouldn't", "mustn't", "can't", "cannot", "isn't", "aren't", "instead", "rather", "avoid",
    "stop", "keep",
})
NEGATION_REACH = 3  # words before the verb a negation reaches
# Before a bare number, words that make it a count or an ordinal, not a reference to one object.
_NOT_A_KIND = frozenset({
    "the", "a", "an", "all", "these", "those", "my", "our", "your", "last", "first", "top",
    "oldest", "newest", "latest", "next", "past", "about", "over", "under", "than", "and", "or",
    "of", "to", "from", "in", "on", "at", "for", "by", "with", "every", "each", "some", "any",
})

_TOOL_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
_WORDS = re.compile(r"[^\W\d_]+(?:['\u2019][^\W\d_]+)?|#?\d+")
_SUFFIX = re.compile(r"(?:ing|ed|es|s)$")
_SENTENCE_END = re.compile(r"[.;!?]+(?=\s|$)|[\n\r]+")
# An identifier-shaped word with a digit ("f-23", "m-301", "58"), as `endorse` reads handles.
_ID = re.compile(r"(?<![\w@/.:-])(?=[\w-]*\d)[A-Za-z0-9][\w-]{0,63}(?![\w@/-]|[.:]\w)")
_CLAUSE_END = re.compile(
    r"[.;:!?]+(?=\s|$)|[\n\r]+|,(?=\s)|\s(?:and|then|but|or|also|plus|except|unless|while|after|before|"
    r"instead|though|although|whereas)(?=\s)", re.IGNORECASE)


def stem(word: str) -> str:
    """A verb's stem for comparing inflections: "deleted", "deletes", "deleting" and "delete"
    are "delet"; "cancelled" and "cancel" are "cancel"; "dropped" is "drop"."""
    word = word.casefold()
    s = _SUFFIX.sub("", word) if len(word) > 4 else word
    if len(s) > 3 and s[-1] == s[-2] and s[-1] not in "aeiou":
        s = s[:-1]  # cancelled, dropped
    return s[:-1] if len(s) > 3 and s.endswith("e") else s


def tool_verb(tool: str) -> str | None:
    """The first word of the tool's name (`delete_file`, `cancel-order`, `cancelOrder`,
    `files.delete` ends with it), lower-cased; None when it has none of 3 letters or more."""
    parts = [p for p in re.split(r"[._\-\s/]+", tool) if p]
    if not parts:
        return None
    words = [w.casefold() for p in parts for w in _TOOL_WORD.findall(p)]
    if not words:
        return None
    # `files.delete`: a dotted name's last part is the action; otherwise the first word is.
    first = words[-1] if "." in tool and len(parts) > 1 else words[0]
    return first if len(first) >= 3 else None


def clauses(text: str) -> list[str]:
    """The clauses of a text: split at sentence ends, ";", ":", ", ", line breaks and the words
    that join or set apart another request ("and", "then", "but", "also", "except"...)."""
    return [c.strip() for c in _CLAUSE_END.split(text) if c and c.strip()]


def sentences(text: str) -> list[str]:
    """The sentences of a text (split at ".", "!", "?", ";" before a space, and line breaks)."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


@dataclass(frozen=True, slots=True)
class Asking:
    """A clause of the intent that asks for the tool's action: the word that asks, the clause,
    and the identifiers its sentence writes (casefolded)."""

    word: str
    clause: str
    ids: frozenset[str]


def asking_clauses(tool: str, texts: Iterable[str]) -> list[Asking]:
    """Every clause of the intent that asks for the tool's action: it writes the tool's verb
    (the first word of its name), inflected or not, not negated in the words before it. Only
    these clauses name the call's objects: "archive the old notes, then delete f-22" does not
    ask to delete the old notes. Another verb for the action ("remove" for `delete_user`) does
    not ask: removing someone from a channel is not deleting their account."""
    verb = tool_verb(tool)
    if verb is None:
        return []
    wanted = stem(verb)
    found: list[Asking] = []
    for text in texts:
        for sentence in sentences(text):
            ids = frozenset(m.group(0).casefold() for m in _ID.finditer(sentence))
            for clause in clauses(sentence):
                words = [w.casefold() for w in _WORDS.findall(clause)]
                for i, word in enumerate(words):
                    if stem(word) == wanted and not NEGATIONS & set(words[max(0, i - NEGATION_REACH):i]):
                        found.append(Asking(word, clause, ids))
                        break
    return found


def names_id(value: str, asking: Asking) -> bool:
    """Whether an identifier-shaped value (a word with a digit) that the clause writes is the
    only identifier its sentence writes: "delete the older of f-22 and f-23" names two, and
    which one the user meant is a judgment the proxy cannot make."""
    return asking.ids <= {value.casefold()}


def names_number(number: str, clause: str, tool: str) -> bool:
    """Whether the clause writes the bare number `number` as a reference to one object: after
    `#`, or right after a word naming a kind of thing ("event 58", "order 31"), not a count
    ("the 12 spam mails", "delete 12": after a determiner, a preposition or the tool's verb)."""
    if not number.isdigit():
        return False
    verb = tool_verb(tool)
    words = [w.casefold() for w in _WORDS.findall(clause)]
    for i, word in enumerate(words):
        if word == f"#{number}":
            return True
        if word == number and i > 0:
            before = words[i - 1]
            if before.isalpha() and len(before) >= 2 and before not in _NOT_A_KIND \
                    and (verb is None or stem(before) != stem(verb)):
                return True
    return False
