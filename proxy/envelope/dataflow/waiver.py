"""Gate waiver (`dataflow.waive_gate: intent`): a gated call the user's own words ask for.

A person approving "delete f-23" right after the user typed "delete f-23, it's a duplicate" adds
nothing but a click. With `waive_gate: intent` for a sink, its approval gate (`gated_effects` or
its `approval.required`) is waived when the run's intent (the user's words, sent by the agent
framework: `proxy.envelope.dataflow.intent`) asks for the call on its own:

- **the action**: a clause of the intent (`clauses`: split at sentence ends, ";", ":", ", ",
  brackets, dashes, full-width punctuation, line breaks, joining words such as "and", "then",
  "but", "also", and the words that set a thing apart: "except", "apart from", "other than",
  "besides", "not") writes the tool's verb (the first word of its name: `delete` of
  `delete_file`, `cancel` of `cancelOrder`) in its base form, unquoted ("I deleted f-22
  yesterday", "who deleted f-22", "the deleted items" tell what happened, they ask nothing),
  with no negation before it in its sentence ("do NOT, under any circumstances, delete f-22",
  "I don't want you to delete f-22") nor after it in its clause ("delete nothing"), in a
  sentence that is a request: no condition anywhere in it ("delete f-23 if it is a duplicate":
  whether it holds is what an injection can assert), not a question, and no other person's
  words or guess before the verb or in its clause ("should I delete f-23", "Anna asked me
  whether to delete f-23"; the user's reason after it, "the seller says ...", is not one). A light verb ("set", "add",
  "send", "run", "drop", "close", "update": `LIGHT_VERBS`) asks only in a clause that also
  writes what the tool acts on ("drop me a note" is not `drop_table`). Another verb does not
  ask ("remove bob from #general" does not ask `delete_user` to delete bob's account);
- **the object**: every critical value of the call (`dataflow.critical`, else every argument
  that is not declassified; at least one) is named by the verb's object in such a clause: the
  words after the verb up to the first word relating it to another thing ("delete the copies
  of f-22", "the files listed in f-22", "the notes that f-22 mentions", "f-22's comments",
  "the files f-22 links to" name no f-22 to delete), so "archive the old notes, then delete
  f-22" and "delete f-23 but not f-24" name neither the old notes nor f-24 for a deletion:
  written whole
  (`IntentWords.spells`: "delete f-23"), a bare number written as a reference right after a
  word that names the kind of thing the tool or argument acts on ("cancel event 58" for
  `cancel_event`, "order #31"; not another kind: "room 12" for `delete_item`; not a count:
  "the 12 spam mails", "delete 12"), an identifier (a word with a digit) only when it is the one identifier
  its sentence writes ("delete the older of f-22 and f-23" leaves the choice to a person), an address whose owner the intent names and a trusted listing holds,
  or the one entry of a trusted listing the intent's words pick ("the file called 'old notes'";
  words that pick one entry in each of two listings of the run pick neither: the attacker's
  mail may be the one of its folder) or its criterion picks ("the oldest draft"). Trusted outputs, handles and pointed reads,
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

# A word that turns the verb into its opposite ("don't delete", "instead of deleting", "do NOT,
# under any circumstances, delete") anywhere before it in its sentence, or its object into none
# ("delete nothing") anywhere in its clause.
NEGATIONS = frozenset({
    "not", "no", "never", "nor", "without", "don't", "dont", "doesn't", "didn't", "won't",
    "shouldn't", "mustn't", "can't", "cannot", "isn't", "aren't", "instead", "rather", "avoid",
    "stop", "keep", "nothing", "none", "neither", "nobody",
})
# Words that make a sentence something other than the user asking for the action now: a
# condition the agent would judge ("delete f-23 if it is a duplicate": the attacker's text can
# say it is), anywhere in the sentence ...
CONDITIONS = frozenset({
    "if", "whether", "unless", "when", "whenever", "once", "provided", "assuming", "suppose",
    "supposing", "case", "depending",
})
# ... and, before the verb or in its clause, a question, another person's words or a guess
# ("should I delete f-23", "Anna asked me to delete f-23", "who deleted f-22"); the user's
# reason after the request ("cancel order 31, the seller says it is out of stock") is not one.
NOT_A_REQUEST = frozenset({
    "maybe", "perhaps", "might", "should", "would", "could", "who", "whom", "whose", "why",
    "how", "what", "whatever", "whichever", "whoever", "asked", "asks", "said", "says", "told",
    "tells", "suggested", "suggests", "wonder", "wondering", "think", "thinks", "according",
})
# Words after the verb that end its object: what follows is another thing the object relates to
# ("delete the copies of f-22", "the reminder for room 12") ...
OBJECT_ENDS = frozenset({
    "of", "on", "in", "from", "to", "for", "with", "about", "at", "by", "into", "onto", "under",
    "over", "after", "before", "inside", "within", "per", "via", "like", "than", "that", "which",
    "where", "listed", "linked", "mentioned", "referenced", "named", "besides", "beside",
})
# ... unless the object already wrote the kind of thing the tool acts on, which these then
# describe ("delete the payee for the gym" for `delete_payee`); a relative clause or a
# participle always ends it ("the files listed in f-22", "the notes that f-22 mentions").
_DESCRIBING = frozenset({"for", "from", "with", "by"})  # not "in", "on", "of": a place or a part is another thing
# Verbs whose action depends on their object ("set f-22 aside" is not `set_permissions`, "drop
# me a note" not `drop_table`): such a verb asks for the tool's action only in a clause that
# also writes the thing the tool acts on (another word of its name: "set the permissions").
LIGHT_VERBS = frozenset({
    "add", "apply", "bin", "call", "change", "clear", "close", "create", "do", "drop", "edit",
    "execute", "fix", "get", "give", "handle", "invoke", "make", "manage", "mark", "modify",
    "move", "open", "patch", "perform", "post", "process", "push", "put", "reset", "run",
    "send", "set", "start", "submit", "take", "trigger", "update", "use", "write",
})
_NOT_ASKING = NEGATIONS | NOT_A_REQUEST
_KIND_REACH = 64  # characters before a bare number where the word naming its kind is looked for
# Words before a bare number that say it is an identifier whatever the kind of thing.
_ID_WORDS = frozenset({"id", "no", "number", "num", "ref", "reference"})
# Before a bare number, words that make it a count or an ordinal, not a reference to one object.
_NOT_A_KIND = frozenset({
    "the", "a", "an", "all", "these", "those", "my", "our", "your", "last", "first", "top",
    "oldest", "newest", "latest", "next", "past", "about", "over", "under", "than", "and", "or",
    "of", "to", "from", "in", "on", "at", "for", "by", "with", "every", "each", "some", "any",
})

_TOOL_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
_WORDS = re.compile(r"[^\W\d_]+(?:['\u2019][^\W\d_]+)?|#?\d+")
_SUFFIX = re.compile(r"(?:ing|ed|es|s)$")
# Sentence ends, full-width ones too (U+3002, U+FF1F); a question mark makes the sentence a question.
_SENTENCE_END = re.compile(r"[.;!?]+(?=\s|$)|[\u3002\uff01\uff1f\uff1b]+|[\n\r]+")
# An identifier-shaped word with a digit ("f-23", "m-301", "58"), as `endorse` reads handles.
_ID = re.compile(r"(?<![\w@/.:-])(?=[\w-]*\d)[A-Za-z0-9][\w-]{0,63}(?![\w@/-]|[.:]\w)")
# Clause ends: punctuation (brackets, dashes, full-width marks too), joining words, and the
# words that set a thing apart from the request ("apart from f-22", "other than f-22").
_CLAUSE_END = re.compile(
    r"[.;:!?]+(?=\s|$)|[\n\r]+|,(?=\s)|[()\[\]{}\u3001\u3002\u300c-\u300f\u3010\u3011\uff08\uff09\uff0c"
    r"\uff1a\uff1b\uff01\uff1f\u2013\u2014]|\s-+\s|\s(?:and|then|but|or|also|plus|except|unless|while|"
    r"after|before|instead|though|although|whereas|apart\s+from|aside\s+from|other\s+than|besides|"
    r"excluding|save|not)(?=\s)", re.IGNORECASE)
_QUOTES = "'\"\u2018\u2019\u201c\u201d\u00ab\u00bb`\u300c\u300d\u300e\u300f"


def stem(word: str) -> str:
    """A verb's stem for comparing inflections: "deleted", "deletes", "deleting" and "delete"
    are "delet"; "cancelled" and "cancel" are "cancel"; "dropped" is "drop"."""
    word = word.casefold()
    s = _SUFFIX.sub("", word) if len(word) > 4 else word
    if len(s) > 3 and s[-1] == s[-2] and s[-1] not in "aeiou":
        s = s[:-1]  # cancelled, dropped
    return s[:-1] if len(s) > 3 and s.endswith("e") else s


def _tool_words(tool: str) -> tuple[list[str], int]:
    """The words of a tool's name, lower-cased, and the index of its verb (`tool_verb`)."""
    parts = [p for p in re.split(r"[._\-\s/]+", tool) if p]
    words = [w.casefold() for p in parts for w in _TOOL_WORD.findall(p)]
    # `files.delete`: a dotted name's last part is the action; otherwise the first word is.
    return words, (len(words) - 1 if "." in tool and len(parts) > 1 else 0)


def tool_verb(tool: str) -> str | None:
    """The first word of the tool's name (`delete_file`, `cancel-order`, `cancelOrder`,
    `files.delete` ends with it), lower-cased; None when it has none of 3 letters or more."""
    words, at = _tool_words(tool)
    if not words:
        return None
    first = words[at]
    return first if len(first) >= 3 else None


def tool_objects(tool: str) -> frozenset[str]:
    """The stems of the other words of the tool's name (3 letters or more): what it acts on
    (`permission` of `set_permissions`, `file` of `files.delete`)."""
    words, at = _tool_words(tool)
    return frozenset(stem(w) for i, w in enumerate(words) if i != at and len(w) >= 3)


def clauses(text: str) -> list[str]:
    """The clauses of a text: split at sentence ends, ";", ":", ", ", brackets, dashes, line
    breaks and the words that join or set apart another request ("and", "then", "but",
    "also", "except", "apart from", "other than"...)."""
    return [c.strip() for _, c in _clauses(text)]


def _clauses(text: str) -> list[tuple[int, str]]:
    """The clauses of a text, each with where it starts (the words before it, the words that
    split it off included, can negate its verb: "do not delete it")."""
    out: list[tuple[int, str]] = []
    at = 0
    for m in [*_CLAUSE_END.finditer(text), None]:
        end = m.start() if m is not None else len(text)
        if text[at:end].strip():
            out.append((at, text[at:end]))
        if m is not None:
            at = m.end()
    return out


def sentences(text: str) -> list[str]:
    """The sentences of a text (split at ".", "!", "?", ";" before a space, their full-width
    forms, and line breaks)."""
    return [s for s, _ in _sentences(text)]


def _sentences(text: str) -> list[tuple[str, bool]]:
    """The sentences of a text, each with whether it is a question (ends with "?")."""
    out: list[tuple[str, bool]] = []
    at = 0
    for m in _SENTENCE_END.finditer(text):
        if text[at:m.start()].strip():
            out.append((text[at:m.start()].strip(), "?" in m.group(0) or "\uff1f" in m.group(0)))
        at = m.end()
    if text[at:].strip():
        out.append((text[at:].strip(), False))
    return out


@dataclass(frozen=True, slots=True)
class Asking:
    """A clause of the intent that asks for the tool's action: the word that asks, the clause,
    the identifiers its sentence writes (casefolded), and its object: the clause from the verb
    to the first word that relates the object to another thing (`OBJECT_ENDS`, a possessive)."""

    word: str
    clause: str
    ids: frozenset[str]
    object: str = ""


def _object(clause: str, end: int, objects: frozenset[str] = frozenset()) -> str:
    """The verb's object in `clause` (the verb ends at `end`): the words after it up to the
    first `OBJECT_ENDS` word (past it when the object wrote a word of `objects`, the kind the
    tool acts on, and the word only describes it: `_DESCRIBING`) or possessive ("f-22's tags"
    acts on the tags); none when the clause ends with a stranded preposition ("the files f-22
    links to")."""
    rest = list(_WORDS.finditer(clause, end))
    if rest and rest[-1].group(0).casefold() in OBJECT_ENDS - {"that", "which", "where"}:
        return ""
    stop = len(clause)
    kind = False  # whether the object so far writes the kind of thing the tool acts on
    for m in rest:
        word = m.group(0).casefold()
        if word in OBJECT_ENDS and not (kind and word in _DESCRIBING):
            stop = m.start()
            break
        kind = kind or stem(word) in objects
        if re.match(r"['\u2019]s\b", clause[m.end():m.end() + 3]) or word.endswith(("'s", "\u2019s")):
            stop = m.start()
            break
    return clause[end:stop].strip()


def asking_clauses(tool: str, texts: Iterable[str]) -> list[Asking]:
    """Every clause of the intent that asks for the tool's action: it writes the tool's verb
    (the first word of its name) in its base form ("delete": not "deleted", "deleting", which
    tell what happened or is happening), not quoted, in a sentence that is a request (not a
    question, a condition, another person's words: `NOT_A_REQUEST`) with no negation before
    the verb and none in the clause after it. A light verb ("set", "add", `LIGHT_VERBS`) asks
    only in a clause that also writes what the tool acts on. Only these clauses name the
    call's objects: "archive the old notes, then delete f-22" does not ask to delete the old
    notes. Another verb for the action ("remove" for `delete_user`) does not ask: removing
    someone from a channel is not deleting their account."""
    verb = tool_verb(tool)
    if verb is None:
        return []
    objects = tool_objects(tool)
    if verb in LIGHT_VERBS and not objects:
        return []
    found: list[Asking] = []
    for text in texts:
        for sentence, question in _sentences(text):
            words = [w.casefold() for w in _WORDS.findall(sentence)]
            if question or CONDITIONS & set(words):
                continue
            ids = frozenset(m.group(0).casefold() for m in _ID.finditer(sentence))
            # Whether a word of the sentence before this clause negates the verb or makes it no
            # request (kept as it goes, and read once per clause: linear however many words and
            # verbs a sentence writes).
            negated = False
            upto = 0
            for start, clause in _clauses(sentence):
                negated = negated or not _NOT_ASKING.isdisjoint(
                    w.casefold() for w in _WORDS.findall(sentence, upto, start))
                upto = start
                matches = list(_WORDS.finditer(clause))
                said = [m.group(0).casefold() for m in matches]
                if negated or not _NOT_ASKING.isdisjoint(said):
                    continue
                # Where the clause last writes what the tool acts on (a light verb asks only
                # before it).
                last_object = max((i for i, w in enumerate(said) if stem(w) in objects), default=-1) \
                    if verb in LIGHT_VERBS else len(said)
                for i, m in enumerate(matches):
                    if said[i] != verb:
                        continue
                    # A quoted verb is a mention ("the 'delete' button"), not a request.
                    at, end = start + m.start(), start + m.end()
                    quoted = (at > 0 and sentence[at - 1] in _QUOTES) or \
                        (end < len(sentence) and sentence[end] in _QUOTES)
                    if quoted or last_object <= i:
                        continue
                    found.append(Asking(m.group(0).casefold(), clause.strip(), ids,
                                        _object(clause, m.end(), objects)))
                    break
    return found


def names_id(value: str, asking: Asking) -> bool:
    """Whether an identifier-shaped value (a word with a digit) that the clause writes is the
    only identifier its sentence writes: "delete the older of f-22 and f-23" names two, and
    which one the user meant is a judgment the proxy cannot make."""
    return asking.ids <= {value.casefold()}


def names_number(number: str, clause: str, tool: str, argument: str = "") -> bool:
    """Whether the clause writes the bare number `number` as a reference to one object: after
    `#`, or right after a word naming the kind of thing the tool acts on (a word of its name
    or of the argument's: "cancel event 58" for `cancel_event`, "order 31" for `order_id`; or
    "id", "number"), not a count ("the 12 spam mails", "delete 12": after a determiner, a
    preposition or the tool's verb), not another kind ("room 12" for `delete_item`), not part
    of another number ("23.5", "1,200")."""
    if not number.isdigit():
        return False
    kinds = tool_objects(tool) | {stem(w) for w in re.split(r"[^a-z]+", argument.casefold()) if len(w) >= 3}
    for m in re.finditer(rf"(?<![\w.,-]){re.escape(number)}(?![\w-]|[.,]\d)", clause):
        if m.start() > 0 and clause[m.start() - 1] == "#":
            return True
        # The word right before it, looked for in a bounded window (linear in the clause
        # however many times it writes the number); a word the window cuts is no kind word.
        start = max(0, m.start() - _KIND_REACH)
        before = list(_WORDS.finditer(clause, start, m.start()))
        if not before or (before[-1].start() == start and start > 0):
            continue
        word = before[-1].group(0).casefold()
        if word.isalpha() and word not in _NOT_A_KIND and (word in _ID_WORDS or stem(word) in kinds):
            return True
    return False
