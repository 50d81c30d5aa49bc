"""Tainted-run escalation: which critical sink values the run's trusted sources endorse.

A run that has read untrusted content may be steered to a choice no untrusted text spells
("book the most expensive option", "reserve X" where X is a real entry of a trusted listing):
the argument carries nothing to match. `dataflow.on_tainted` sends such a sink to a person (or
refuses it) unless every value of its critical arguments (`dataflow.critical`, else every
argument that is not declassified) is **endorsed** by a trusted source of the same run:

- the run's **intent** (the user's words): a string whose whole normalised value (case, width,
  whitespace and invisible characters folded, edge punctuation stripped) occurs in the intent
  between word boundaries, a distinctive token (e-mail, URL, host, account number) equal to one
  of the intent's, or a number / amount whose canonical decimal the intent writes
  ("$1,200.50" = "1200.50" = 1200.5; "twelve hundred" is not a number);
- a **trusted output** read in the same run: a string equal, normalised, to a whole string of
  the output, to one of its fields (`segments`: "Grand Palace" of "Grand Palace - $1,240.50
  per night, 180 m2", a value after "name:") unless the field is one of a listing's entries
  (`listing_parts`: entries of one shape; being listed is not being chosen: only a word of the
  intent picking that entry, `name_keys`, the intent or a criterion endorses it), or to one of
  its distinctive tokens;
  a number equal to one the output writes with 3 digits or more or with decimals (a price,
  an id; "2" of a numbered list endorses nothing: small integers only by the intent), or
  written as money with two decimals ("14.00" endorses a critical "14.00", not "14");
- a **handle** the same upstream handed out in the run: an identifier argument (named `id`,
  `*_id`, `*Id`, or their plurals) whose value is one identifier-shaped word with a digit
  ("m-301", "T-7300", "42") that a trusted output of the call's upstream wrote as the **sole**
  id of its string (a record read by its id). Not one id of a listing's several: which object
  a sink acts on (the product added, the ticket assigned, the event moved) is exactly the
  choice an injection makes among real entries; the intent picks or names it, or a person
  does. Nor the one id an untrusted text writes (an injected "reply to m-999" writes one).
  Destructive effects on an object (delete by id) are stopped by the approval gate
  (`gated_effects`), not by endorsement.
- the intent's **number words**: "two nights" endorses 2 ("zero" to "ninety-nine"); and any
  intent endorses 1, the count "add the hub" implies.
- a **read by id made while the run was clean**: the values of a read's identifier arguments,
  when the run had read no untrusted content at the time of the read (nothing read through the
  proxy can have chosen them) and the upstream answered it without an error (the id names a
  record of that upstream), are recorded as that upstream's *sole* handles: `read_email(m-301)`
  then `reply_email(m-301)`. An id the agent reads only after the run is tainted ("reply to
  m-999", injected) endorses nothing this way: an injected text can name a real record.
- a **read the user pointed at**: when a string argument of a read that names one object (a
  path, URL, file name or record id: a digit, "/" or "."; not a bare word such as a channel,
  folder or search term, a place anyone writes into; not a bare number) is endorsed by the
  intent ("pay the invoice in
  Documents/invoices/lumen-march.pdf"), its untrusted output endorses the one distinctive
  token it writes (address, account number, URL) and the one amount with decimals it writes
  ("140.00" too: `pointed_keys`), for a *critical* argument whose value is that token or
  amount (with decimals, or written as money: "140.00"), also
  against a data-flow flag. An output that writes several
  distinct tokens (the document's own account and an injected "use this one instead") is a
  choice the user did not make: it endorses none. Likewise the one value it writes under a
  label ("New address: 12 Elm Row, Leeds LS1 4AB") whose word (4 letters or more) the intent
  writes ("update their address to the one they wrote": `label_key`), when every word of the
  intent that labels such a value there (not a number) labels this one; a second value under
  a label with the same word, or an injected "Customer: 1 Evil Road" beside the address for
  "update the customer's address", endorses neither. An identifier argument is judged only
  among the ids the pointed read writes right after a word, with or without a colon, the id
  ending its phrase (`labelled_ids`: "T-6100 (customer C-4410): I moved!"; not the "12" of
  "address: 12 Elm Row"): "the customer in T-6100" endorses C-4410 when every word of the
  intent that precedes an id there precedes this one (`id_label_key`); an injected "Customer:
  C-3002" is a second id after that word, so neither is endorsed (as a label's value it was
  the one value under "customer" and endorsed the attacker's id). What this cannot tell apart: a pointed
  source whose only token (or labelled id) is the attacker's (an injection in a document that had none, a
  thread where only the attacker wrote an address). The user did point there; a person must.

- an **entry of a trusted listing the intent picks**: a listing (a trusted string of several
  entries: lines, "|", ";" or sentences) whose entries hold addresses, accounts, amounts or
  ids is a choice; a word of the intent (3 letters or more, inflections folded: "plumber" /
  "plumbing") that occurs in exactly one of its entries picks that entry ("pay my landlord": "p-1 Greystone Properties (landlord) IBAN
  ..."), and every value of that entry is endorsed, only when *every* word of the intent that
  picks an entry of any trusted listing of the run picks this one (`entry_keys`: "refund
  order O-8812" also picks the entry "Other order of this customer: O-8790 ...", so it
  endorses neither). The attacker can change neither the listing nor the intent; a user
  criterion that no single word of the entry carries ("the cheapest") is
  `proxy.envelope.dataflow.criterion`'s: the one extreme entry of a field. For the gate waiver
  a word must pick one entry run-wide: each picking word records the `pick_signature` of its
  entry, a MAC keyed with the store's pick secret (`proxy.envelope.dataflow.secret`), so that
  a word picking one entry in each of two listings (the inbox and a folder the attacker's mail
  lands in) picks none, and the attacker, who never sees the secret, cannot grind an entry
  whose signature passes for the user's.

What endorses nothing, whatever the sources above write (the adversarial pass, bench/RESULTS.md):
a **disguised** value (`fingerprint.disguised`: folding changes more than its case, as
"hans@faß.example", fullwidth letters, an invisible character) is endorsed only by the intent
writing the very same characters; a value holding a **second token** or an "@" its token does
not hold ("anna@corp.example, eve@...", "anna@corp.example@evil.example", an IBAN with digits
appended) is endorsed only whole; a **signed** number ("-50", "(120)") only by the intent
writing it negative; a number only **as a number** (never as part of a longer one: "1,200" of
"1,200,000"); and nothing the intent **negates** ("not to bob@...", "except ...", "instead of
...": `affirmed`). A pointed read's one amount is its one number **written as money** with or
without decimals ("140 EUR" beside an injected "1,400.00" is a choice of two). Tokens of one
string are compared pairwise only up to MAX_DISTINCT (past it: several), so recording stays
linear in what an output writes.

Trusted outputs record these as 8-byte hashes in their own namespace (`trusted_keys`: the
`trusted` label of the run's fingerprint hash), only when some sink's `on_tainted` is not
`allow`; at most `MAX_KEYS` per output (a value past them is simply not endorsed: more
escalation, never less). Booleans and null are never critical: they carry no chosen value.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.envelope.dataflow.fingerprint import disguised, faithful, normalise, tokens

if TYPE_CHECKING:
    from proxy.envelope.dataflow.criterion import Criterion

MAX_PHRASE_CHARS = 64  # longest field of a trusted string recorded (characters)
MAX_WHOLE_CHARS = 256  # longest whole string of a trusted output recorded as one value
MAX_KEYS = 8192  # most keys one trusted output records
MAX_CRITICAL = 256  # most critical values one call is checked for; beyond: not endorsed
MAX_DEPTH = 32
MAX_WORDS = 256  # most distinct words of an intent that pick entries of trusted listings
# Most tokens of one string compared pairwise (which contain which: an address holds its host);
# past it every one counts as a value of its own: a choice, never one value (fail closed), and
# the comparison stays bounded whatever an output writes.
MAX_DISTINCT = 16
MAX_LABEL_WORDS = 3  # longest label of a "label: value" entry of a pointed read (words)
_LABEL = re.compile(rf"[^\W\d_]+(?:[ '-][^\W\d_]+){{0,{MAX_LABEL_WORDS - 1}}}")
IMPLIED_COUNT = "1"  # the count every intent endorses (`IntentWords.of`)

# Stripped from both ends of a value and of a phrase: "pay Acme Ltd." names "acme ltd".
_EDGE = "\"'`.,;:!?()[]{}<>*_~-#\u2010\u2011\u2012\u2013\u2014\u2026\u00ab\u00bb\u2018\u2019\u201c\u201d"
# A number as people write it: optional currency sign, digits with optional thousands commas,
# optional decimals; not part of a word, of a longer number or of an identifier ("v2", "3.1.4",
# the 8812 of "O-8812" are not amounts: counting them made a record with one price look like a
# listing of several and endorse none).
_NUMBER = re.compile(r"(?<![\w.,])(?<!\w-)[$€£¥]?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w]|[.,]\d)")
# Where a field of a listing or record ends (a "." only before a space: "1,240.50" stays whole).
_SEPARATORS = re.compile(r"[\n\r\t|;,:()\[\]{}<>\u2022\u00b7]+|\s[-\u2013\u2014/]+\s|(?<=[.!?])\s+")
# Where an entry of a record ends: a line break, "|", ";", or a sentence end ("." before a space).
_RECORDS = re.compile(r"[\n\r|;\u2022]+|(?<=[.!?])\s+")
_WORD = re.compile(r"[^\W\d_]+")
_SHAPE_WORDS = re.compile(r"[^\W\d_]+(?:\s+[^\W\d_]+)*")
_SHAPE_DIGITS = re.compile(r"\d(?:[\d,.]*\d)?")
# Inflections of one word a person may use for a setting's value ("edit access" for "editor").
_SUFFIX = re.compile(r"(?:or|er|ing|ed|s)$")
_ENUMERATOR = re.compile(r"^(?:\d{1,3}[.)]|[a-z][.)]|[-*#>])\s+")
# An identifier-shaped word with a digit, as a handle an upstream hands out ("m-301", "f_88",
# "42"): not part of an address, path, URL or longer word.
_HANDLE = re.compile(r"(?<![\w@/.:-])(?=[\w-]*\d)[A-Za-z0-9][\w-]{0,63}(?![\w@/-]|[.:]\w)")
# An identifier written right after a word, ending its phrase: "(customer C-4410):",
# "Order: O-8812.", not the house number of "address: 12 Elm Row" (`labelled_ids`). Linear: the
# word and the identifier are bounded runs with no overlap between what precedes and follows.
_LABELLED_ID = re.compile(r"(?<![^\W\d_])([^\W\d_]{4,64}):?[ \t]+\(?((?=[\w-]*\d)[A-Za-z0-9][\w-]{0,63})"
                          r"(?=$|[\n\r),;:|!?\]]|\.(?:\s|$))")
_LONG_WORD = re.compile(r"(?<![^\W\d_])[^\W\d_]{4,64}(?![^\W\d_])")
ID_REACH = 24  # characters after a word where an identifier is its rival (`labelled_ids`)
_HANDLE_VALUE = re.compile(r"(?=[\w-]*\d)[A-Za-z0-9][\w-]{0,63}")
# An argument named as an identifier: "id", "email_id", "file-id", "eventId", "ids", "item_ids".
_ID_NAME = re.compile(r"(?i:^ids?$|[_-]ids?$)|[a-z0-9]Ids?$")
# What names one object rather than a place: a path, URL, file name or record id has one of these.
_OBJECT = re.compile(r"[\d/.]")
_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
          "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = {w: 10 * i for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()) if i >= 2}
_NUMBER_WORD = re.compile(rf"\b({'|'.join(_TENS)})(?:[\s-]+({'|'.join(_UNITS[1:10])}))?\b|\b({'|'.join(_UNITS)})\b")
_WHOLE_NUMBER = re.compile(r"^[$€£¥]?\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?\s?(?:[a-z]{3})?$")
# A sign or accounting brackets around a number written as a string ("-50", "(120)", "50-"):
# edge stripping drops them, so the value would compare equal to the positive number.
_SIGN = re.compile("[-\u2212\u2010-\u2015()]")


# Copying a keyed hash state is cheaper than building one per key (recording a trusted output
# hashes hundreds of keys).
_BASE = hashlib.blake2b(digest_size=8, person=b"trusted")


def _hash(text: str) -> bytes:
    h = _BASE.copy()
    h.update(text.encode())
    return h.digest()


def _key(kind: str, value: str) -> bytes:
    """The 8-byte hash of an endorsing value (own namespace: never equal to a gram's, token's or
    phrase's hash of the untrusted ledger)."""
    return _hash(f"{kind}:{value}")


def canonical_number(whole: str, fraction: str | None) -> str:
    """'1,200' + '50' -> '1200.5'; '007' -> '7'; '12.00' -> '12'."""
    integer = whole.replace(",", "").lstrip("0") or "0"
    frac = (fraction or "").rstrip("0")
    return f"{integer}.{frac}" if frac else integer


def numbers(norm: str) -> set[str]:
    """The canonical decimals a normalised text writes."""
    return {canonical_number(m.group(1), m.group(2)) for m in _NUMBER.finditer(norm)}


def written_amount(fraction: str | None) -> bool:
    """Whether a number written with this fraction is written as money: two decimals ("14.00",
    "1,450.00"). Such a number is an amount however small its value (a list position, a count
    or a day is never written "2.00"), so it is as distinctive as one with cents."""
    return fraction is not None and len(fraction) == 2


def amounts(norm: str) -> set[str]:
    """The canonical decimals a normalised text writes that a trusted output endorses
    (`distinctive`, or written as money: `written_amount`)."""
    return {number for m in _NUMBER.finditer(norm)
            if distinctive(number := canonical_number(m.group(1), m.group(2))) or written_amount(m.group(2))}


def negatives(norm: str) -> set[str]:
    """The negative numbers a normalised text writes ("refund -50" -> "-50"; not the 50 of
    "10-50", a range)."""
    return {f"-{canonical_number(m.group(1), m.group(2))}" for m in _NUMBER.finditer(norm)
            if m.start() >= 1 and norm[m.start() - 1] in "-\u2212" and not norm[max(0, m.start() - 2):m.start() - 1].isalnum()}


# A clause the user negates: "not to bob@x.example", "never 1,450", "except eve@...", "instead of
# DE02 ...", up to the next clause mark (",", ";", ":", "!", "?", a line break, a sentence end,
# "but", "then"; a comma inside a number is none).
_NEGATED = re.compile(
    r"\b(?:not|never|except|excluding|instead\s+of|rather\s+than|other\s+than)\b"
    r"(?:[^,;:!?.\n]|[,.](?=\d)|\.(?=\S))*?(?=,(?!\d)|[;:!?\n]|\.(?:\s|$)|\s(?:but|then)\b|$)",
    re.IGNORECASE)


def affirmed(text: str) -> str:
    """The intent without the clauses it negates ("send the notes to Anna, not to bob@x.example"
    -> "send the notes to Anna, "): a value the user named only to exclude it is not one they
    chose. Only what endorses a value reads this; what makes a choice ambiguous (the words that
    pick listing entries, a criterion's conditions) reads the whole text (fail closed)."""
    return _NEGATED.sub("\n", text)


def bounded(value: str) -> re.Pattern[str]:
    """`value` between word boundaries (not inside a longer word, address or number). The
    value comes first and the boundary before it is looked behind from its end: a pattern
    starting with a literal is searched for as a substring (10-30x faster on a 16 KiB intent
    than testing the boundary at every position, bench/inline_cost.py)."""
    escaped = re.escape(value)
    return re.compile(rf"{escaped}(?<![\w@.\-]{escaped})(?![\w@\-]|\.\w)")


def number_words(norm: str) -> set[str]:
    """The numbers a normalised text writes in words ("two" -> "2", "twenty-five" -> "25")."""
    out: set[str] = set()
    for m in _NUMBER_WORD.finditer(norm):
        if m.group(3) is not None:
            out.add(str(_UNITS.index(m.group(3))))
        else:
            out.add(str(_TENS[m.group(1)] + (_UNITS.index(m.group(2)) if m.group(2) else 0)))
    return out


def id_argument(name: str) -> bool:
    """Whether an argument's name says it holds identifiers ("email_id", "eventId", "ids";
    not "paid" or "valid")."""
    return _ID_NAME.search(name) is not None


def handle_key(upstream: str, handle: str, sole: bool = False) -> bytes:
    """The endorsing key of an identifier an output of `upstream` wrote (`sole`: as the only
    one of its string)."""
    return _key("h1" if sole else "h", f"{upstream}/{handle}")


def handle_keys(upstream: str, text: str, limit: int = MAX_KEYS, sole: bool = True) -> set[bytes]:
    """The sole-handle key of one string of an output of `upstream`: with `sole` (trusted
    text), when it writes exactly one identifier-shaped word with a digit; none otherwise (one
    id of several is a choice; the one id an untrusted text writes may be an injection's)."""
    if not sole or limit < 1:
        return set()
    found: set[str] = set()
    for m in _HANDLE.finditer(text):
        found.add(m.group())
        if len(found) > 1:
            return set()
    return {handle_key(upstream, next(iter(found)), sole=True)} if found else set()


def names_object(value: Any) -> bool:
    """Whether a read's argument value can name one object (a path, URL, file name or record
    id: a string with a digit, "/" or "."), not a place anyone writes into (a bare word)."""
    return isinstance(value, str) and _OBJECT.search(value) is not None


def pointed_key(kind: str, value: str) -> bytes:
    """The endorsing key of a distinctive token written by a read the intent pointed at."""
    return _key(f"p{kind}", value)


def pointed_keys(texts: Iterable[str]) -> set[bytes]:
    """The keys a pointed read's untrusted output records: those of its distinctive tokens when
    they are all one value (an address and its host, an IBAN and its digits, a URL and its
    host), and of its amount when it writes one number with decimals (the sum an invoice
    asks for); none of several: one of several is a choice the user did not make."""
    found: set[tuple[str, str]] = set()
    sums: set[str] = set()
    for text in texts:
        found |= tokens(text)
        # Every number written as money counts, with decimals or not: a bill writing "140 EUR"
        # beside an injected "transfer 1,400.00 EUR" is a choice of two sums, not one.
        norm = normalise(text)
        sums |= {canonical_number(m.group(1), m.group(2))
                 for m in _NUMBER.finditer(norm) if m.group(2) is not None or _money(norm, m)}
    keys = {pointed_key(kind, value) for kind, value in found} if len(maximal({v for _, v in found})) == 1 else set()
    if len(sums) == 1:
        keys.add(pointed_key("n", next(iter(sums))))
    labelled: dict[str, set[str]] = {}
    for text in texts:
        for word, value in labelled_values(text):
            labelled.setdefault(word, set()).add(value)
    keys |= {label_key(word, next(iter(held))) for word, held in labelled.items() if len(held) == 1}
    # Every word that labels a value other than a number, whatever it is: a value is endorsed
    # only when every such word of the intent labels that value (an injected "Customer: 1 Evil
    # Road" beside "New address: 12 Elm Row" makes "update the customer's address" endorse
    # neither). Numbers are the pointed amount's ("Amount due: 950.00 EUR" beside the landlord).
    keys |= {label_word_key(word) for word, held in labelled.items()
             if any(_WHOLE_NUMBER.match(value) is None for value in held)}
    ids: dict[str, set[str]] = {}  # every id after a word (rivals)
    endorsable: set[str] = set()  # words with an id written as that word's (`labelled_ids`)
    for text in texts:
        for word, handle, own in labelled_ids(text):
            ids.setdefault(word, set()).add(handle)
            if own:
                endorsable.add(word)
    # One id after the word, and written as its: an injected "customer C-9999" beside
    # "customer C-4410" (or beside "customer #C-4410") endorses neither.
    keys |= {id_label_key(word, next(iter(ids[word]))) for word in endorsable if len(ids[word]) == 1}
    # Every word that labels an id, as for values: an id is endorsed only when every such word
    # of the intent labels that id.
    keys |= {id_label_word_key(word) for word in endorsable}
    return keys


# A currency code or word beside a number ("140 EUR", "EUR 140", "140 euros").
_CURRENCY = r"(?:eur|usd|gbp|chf|jpy|cad|aud|sek|nok|dkk|pln|czk|euros?|dollars?|pounds?|francs?)"
_CURRENCY_AFTER = re.compile(rf"\s?{_CURRENCY}\b")
_CURRENCY_BEFORE = re.compile(rf"\b{_CURRENCY}\s?$")


def _money(norm: str, m: re.Match[str]) -> bool:
    """Whether a `_NUMBER` match of a normalised text is written as money: after a currency
    sign (part of the match) or beside a currency code or word."""
    return (m.group()[:1] in "$€£¥" or _CURRENCY_AFTER.match(norm, m.end()) is not None
            or _CURRENCY_BEFORE.search(norm[max(0, m.start() - 9):m.start()]) is not None)


def label_word_key(word: str) -> bytes:
    """The key saying that a read the intent pointed at writes something under a label with
    `word` (`label_key` for what)."""
    return pointed_key("lw", word)


def label_key(word: str, value: str) -> bytes:
    """The endorsing key of the one value a read the intent pointed at labels with `word`
    ("New address: 12 Elm Row, Leeds LS1 4AB" -> "address")."""
    return pointed_key("l", f"{word}|{value}")


def id_label_word_key(word: str) -> bytes:
    """The key saying that a read the intent pointed at writes an identifier right after a
    word (`id_label_key` for which)."""
    return pointed_key("liw", word)


def id_label_key(word: str, handle: str) -> bytes:
    """The endorsing key of the one identifier a read the intent pointed at writes right after
    `word` ("T-6100 (customer C-4410): I moved!" -> "customer"), for an identifier argument."""
    return pointed_key("li", f"{word}|{handle}")


def labelled_ids(text: str) -> Iterator[tuple[str, str, bool]]:
    """(word, identifier, endorsable) of a text's identifiers written after a word of 4 letters
    or more. Endorsable: right after it, with or without a colon, the identifier ending its
    phrase (a clause mark, a bracket or the end follows: "customer C-4410)", "Order: O-8812.";
    the "12" of "address: 12 Elm Row" is a house number), or as the whole value of a label
    with that word ("Customer ID: C-4410"). Not endorsable but still a rival: any identifier
    within ID_REACH characters after the word ("customer #C-4410", "customer is C-4410"), so an
    injected "customer C-3002." beside a form this does not read is a choice of two. The
    identifier normalised and edge-stripped, as a critical value is; the word as `words_of`
    gives it."""
    for m in _LABELLED_ID.finditer(text):
        for word in words_of(normalise(m.group(1))):
            yield word, _strip(normalise(m.group(2))), True
    for word, value in labelled_values(text):
        if _HANDLE_VALUE.fullmatch(value) is not None:
            yield word, value, True
    for m in _LONG_WORD.finditer(text):
        ids = [h.group() for h in _HANDLE.finditer(text, m.end(), min(len(text), m.end() + ID_REACH))]
        if ids:
            for word in words_of(normalise(m.group())):
                for found in ids:
                    yield word, _strip(normalise(found)), False


def labelled_values(text: str) -> Iterator[tuple[str, str]]:
    """(label word, value) of a text's "label: value" entries (`records`' entries) whose label
    is a short phrase of letters only (up to MAX_LABEL_WORDS words: a sentence, or "T-6100
    (customer C-4410)", is no label) and whose value,
    normalised and edge-stripped, is up to MAX_PHRASE_CHARS: one pair per word of 4 letters or
    more of the label (`words_of`)."""
    for part in _RECORDS.split(text):
        label, sep, value = part.rpartition(": ")
        if not sep or not _LABEL.fullmatch(label.strip()):
            continue
        key = _strip(normalise(value))
        if key and len(key) <= MAX_PHRASE_CHARS:
            for word in words_of(normalise(label)):
                if len(word) >= 4:
                    yield word, key


def distinctive(number: str) -> bool:
    """Whether a trusted output writing this number endorses it: an amount with decimals or a
    number of 3 digits or more. Small integers (list positions, counts, days) occur in every
    listing: only the user's words endorse them."""
    return "." in number or len(number.lstrip("-")) >= 3


def _strip(norm: str) -> str:
    return norm.strip(_EDGE).strip()


def maximal(values: set[str]) -> set[str]:
    """The values none of the others contains (an address, not its host; an IBAN, not its
    digits); all of them when there are more than MAX_DISTINCT (bounded work; several either
    way)."""
    if len(values) > MAX_DISTINCT:
        return values
    return {v for v in values if not any(v != w and v in w for w in values)}


def _holds_candidate(key: str, several: set[str]) -> bool:
    """Whether a field holds one of a string's candidates (`candidates`). Past MAX_DISTINCT
    candidates, any field that could hold one does: one with an "@" or a digit (addresses and
    account numbers have them), so the work stays linear in the string."""
    if len(several) <= MAX_DISTINCT:
        return any(value in key for value in several)
    return "@" in key or any(ch.isdigit() for ch in key)


def edge_stripped(norm: str) -> str:
    """A normalised text without the punctuation at its ends, as critical values are compared."""
    return _strip(norm)


def segments(text: str) -> Iterator[str]:
    """The fields of a trusted string, normalised: its parts between separators a listing or a
    record uses (line breaks, tabs, "|", ";", ",", ":", " - ", brackets, sentence ends), a
    leading enumerator ("2.", "b)", "-", "*") and edge punctuation stripped."""
    for part in _SEPARATORS.split(text):
        key = _strip(_ENUMERATOR.sub("", normalise(part)))
        if key and len(key) <= MAX_PHRASE_CHARS:
            yield key


def candidates(found: set[tuple[str, str]]) -> set[str]:
    """The addresses and account numbers of a string that holds several of them: each is one
    candidate of a choice (a contact list, a customer's orders), and which one the agent picks
    is what an injection steers. A trusted string endorses one only when it holds no other."""
    emails = {value for kind, value in found if kind == "email"}
    accounts = {value for kind, value in found if kind == "number"}
    # An IBAN also yields its digits: one account, not two.
    return (emails if len(emails) > 1 else set()) | (accounts if len(maximal(accounts)) > 1 else set())


def records(text: str) -> Iterator[str]:
    """The values of a record's "label: value" entries, normalised: each line or sentence's
    text after its last ": " ("Saved address: 8 Birch Road, Bristol BS1 5TR" -> "8 birch road,
    bristol bs1 5tr", a value `segments` cuts at its commas)."""
    for part in _RECORDS.split(text):
        label, sep, value = part.rpartition(": ")
        if sep and label.strip():
            key = _strip(normalise(value))
            if key and len(key) <= MAX_PHRASE_CHARS:
                yield key


def trusted_keys(text: str, limit: int = MAX_KEYS) -> set[bytes]:
    """The endorsing keys one string of a trusted output records: its whole value (up to
    MAX_WHOLE_CHARS), its fields (`segments`), its distinctive tokens and its distinctive
    numbers; at most `limit`. A string that holds several addresses, account numbers or
    distinctive numbers (`candidates`: a listing to choose from) endorses none of them (nor a
    field holding one): only the intent does."""
    found: set[str] = set()  # "<kind>:<value>", hashed once each at the end
    norm = normalise(text)
    whole = _strip(norm)
    if not whole:
        return set()
    if len(whole) <= MAX_WHOLE_CHARS:
        found.add(f"v:{whole}")
    held = tokens(text)
    several = candidates(held)
    if any(ch.isdigit() for ch in norm):
        held_amounts = amounts(norm)
        # Several amounts are counted as written: "mug 14.00, machine 489.00" is a choice of
        # two prices; "14.5 km" is not money but still makes the string hold two numbers.
        written = {canonical_number(m.group(1), m.group(2)) for m in _NUMBER.finditer(norm)
                   if m.group(2) is not None or len(m.group(1).replace(",", "").lstrip("0")) >= 3}
        if len(held_amounts) == 1 and len(written) <= 1:
            found.update(f"n:{number}" for number in held_amounts)
    found.update(f"t{kind}:{value}" for kind, value in held if value not in several)
    # One of several addresses: endorsed only with the intent naming its owner (`IntentWords`).
    found.update(f"c:{value}" for kind, value in held if kind == "email" and value in several)
    # The fields of the entries of a listing are its candidates: being listed says a value
    # exists, not that the user chose it (`listing_parts`; `name_keys` for the intent's picks).
    listed = {key for part in listing_parts(text) for key in segments(part)}
    for key in records(text):
        if key not in listed and not _holds_candidate(key, several):
            found.add(f"v:{key}")
    for key in segments(text):
        if len(found) >= limit:
            break
        if key not in listed and not _holds_candidate(key, several):
            found.add(f"v:{key}")
    return {_hash(k) for k in list(found)[:limit]}


def shape(text: str) -> str:
    """The structure of a normalised field or entry: each run of words of letters is "a", each
    run of digits "9", punctuation kept, spaces dropped ("Heron (2 seats)" and "Executive
    Suite (16 seats" are both "a(9a"): entries of one listing share it whatever they name."""
    return re.sub(r"\s+", "", _SHAPE_DIGITS.sub("9", _SHAPE_WORDS.sub("a", _strip(text))))


def _top_level(value: str) -> list[str]:
    """The parts of a value between its commas outside brackets ("Heron (2 seats), Executive
    Suite (16 seats, approval needed)" is two parts), blank ones left out."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(value):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    parts.append(value[start:])
    return [part for part in parts if part.strip()]


def _parallel(parts: list[tuple[str, str]]) -> list[str]:
    """The values of `parts` ((label, value) each) when two or more share a shape under one
    label (both without a label, or the same one): then every value is a candidate (fail
    closed: an entry of another shape, "3. Pension Ruhe - $95" without "per night", is still
    one of the listing's); else none. Values of one shape under different labels ("Name: Maria
    Lind. City: Lisbon") are the fields of one record, not a listing."""
    seen: set[tuple[str, str]] = set()
    for label, value in parts:
        key = (label, shape(normalise(value)))
        if key in seen:
            return [value for _, value in parts]
        seen.add(key)
    return []


# `trusted_keys` and `entry_keys` (`name_keys`) both ask for the parts of the same string.
@functools.lru_cache(maxsize=16)
def listing_parts(text: str) -> tuple[str, ...]:
    """The entries of a trusted string that is a listing of several candidates, decided by
    structure only: two entries or more (`listing_entries`) whose values (after a short
    "label: ") have one shape (`shape`), or two parts or more of one entry's value between
    commas outside brackets ("folders: Contracts, Public Share, Archive"; "Heron (2 seats),
    Finch (4 seats), Executive Suite (16 seats)"). Labels are left out of the parts. A string
    of one value, or of values of different shapes (a record), has none: its fields are facts,
    endorsed as before."""
    entries = []
    for entry in listing_entries(text):
        label, sep, value = entry.rpartition(": ")
        if sep and _LABEL.fullmatch(label.strip()):
            entries.append((normalise(label.strip()), value))
        else:
            entries.append(("", entry))
    out = _parallel(entries)
    for _, value in entries:
        out += _parallel([("", part) for part in _top_level(value)])
    return tuple(out)


def name_pick_key(word: str) -> bytes:
    """The key saying that `word` picks one entry of some trusted listing (`name_keys`)."""
    return _key("nw", word)


def name_key(word: str, norm: str) -> bytes:
    """The key saying that the listing entry `word` picks has the field `norm`."""
    return _key("ne", f"{word}|{norm}")


def name_keys(text: str, limit: int = MAX_KEYS, *, secret: bytes) -> set[bytes]:
    """The keys by which a word of the intent picks a field of a listing's entry (`listing_parts`):
    for each word (3 letters or more, inflections folded: `words_of`) or identifier (`id_words`)
    that occurs in exactly one entry, `name_pick_key(word)` and `name_key(word, field)` for each
    field (`segments`) of that entry ("book the Tejo Mar": "Hotel Tejo Mar 112 EUR/night"). The
    check endorses a listed name only when every word of the intent that picks an entry of any
    listing of the run picks the one holding it. `secret`: the store's pick secret
    (`pick_signature_keys`)."""
    parts = [(words_of(normalise(part)) | id_words(part), list(segments(part))) for part in listing_parts(text)]
    seen: dict[str, int] = {}
    for words, _ in parts:
        for w in words:
            seen[w] = seen.get(w, 0) + 1
    out: set[bytes] = set()
    for words, fields in parts:
        for w in sorted(words):
            if seen[w] != 1:
                continue
            if len(out) + len(fields) + 1 + PICK_DIGITS > limit:
                return out
            out.add(name_pick_key(w))
            out.update(name_key(w, f) for f in fields)
            out.update(pick_signature_keys(w, fields, "nb", secret=secret))
    return out


def words_of(norm: str) -> set[str]:
    """The words of 3 letters or more of a normalised text, one-word inflections folded
    ("plumber" and "plumbing" are "plumb"; a stem shorter than 4 letters stays whole)."""
    out = set()
    for w in _WORD.findall(norm):
        if len(w) >= 3:
            stem = _SUFFIX.sub("", w)
            out.add(stem if len(stem) >= 4 else w)
    return out


def id_words(text: str) -> set[str]:
    """The identifiers a text writes that start with a letter ("O-8812", "p-100", "INV-0937";
    not "4pm", "12th" nor a bare number), normalised, as picking words in their own namespace
    ("#o-8812"): an identifier the user typed picks the one entry of a listing writing it."""
    return {f"#{h}" for m in _HANDLE.finditer(text) if (h := normalise(m.group()))[:1].isalpha()}


def entry_value_forms(critical: Critical) -> list[str]:
    """The forms under which an entry of a listing records a value (`entry_keys`)."""
    forms = []
    if critical.number is not None and (distinctive(critical.number) or critical.amount):
        forms.append(f"n:{critical.number}")
    if critical.token is not None:
        forms.append(f"t:{critical.token}")
    if isinstance(critical.value, str | int) and _HANDLE_VALUE.fullmatch(str(critical.value).strip()):
        forms.append(f"h:{normalise(str(critical.value).strip())}")
    return forms


# The signature of the entry a word picks (`pick_signature_keys`): PICK_BITS bits of a MAC keyed
# with the store's pick secret, recorded as PICK_DIGITS base-4 digits (one key per digit, four
# probes). Base 4 records half the keys base 2 would for the same bits and probes as many: 8
# keys per picking word of a listing entry (as the 8 unkeyed bits did), 32 probes per word and
# kind for a waiver's check (16 before). 16 bits: without the secret a colliding entry can only
# be guessed, one run of the user's own per guess (p = 2**-16), never ground offline.
PICK_BITS = 16
PICK_DIGITS = PICK_BITS // 2
PICK_SECRET_BYTES = 32


def _signature_key(kind: str, word: str, position: int, digit: int) -> bytes:
    return _key(kind, f"{word}|{position}|{digit}")


def pick_signature(values: Iterable[str], secret: bytes) -> int:
    """PICK_BITS bits of a MAC, keyed with `secret`, of an entry's values (order and repeats
    ignored): the attacker, who never sees the secret, cannot choose values whose signature
    equals another entry's."""
    mac = _keyed(secret).copy()
    mac.update("|".join(sorted(set(values))).encode())
    return int.from_bytes(mac.digest(), "big")


@functools.lru_cache(maxsize=8)
def _keyed(secret: bytes) -> hashlib.blake2b:
    """The MAC's state keyed with `secret`, copied per signature (keying one costs more than
    copying it: a listing signs hundreds of entries). One secret per store, few stores."""
    return hashlib.blake2b(digest_size=PICK_BITS // 8, key=secret, person=b"pick-signature")


def pick_signature_keys(word: str, values: Iterable[str], kind: str = "eb", *, secret: bytes) -> list[bytes]:
    """The keys saying which entry `word` picks in one listing, by its `pick_signature` (keyed
    with the store's pick secret, `proxy.envelope.dataflow.secret`) as PICK_DIGITS base-4
    digits: the same entry listed twice, by any process or replica sharing the store, writes
    the same digits; two entries that one word picks in two listings of a run (the inbox and a
    folder the attacker's mail lands in) differ in a digit unless their signatures collide
    (probability 2**-PICK_BITS, which the attacker cannot raise without the secret:
    `picks_one_entry`). `kind`: "eb" for an entry's values (`entry_keys`), "nb" for its fields
    (`name_keys`)."""
    signature = pick_signature(values, secret)
    return [_signature_key(kind, word, i, (signature >> (2 * i)) & 3) for i in range(PICK_DIGITS)]


def pick_signature_probes(word: str, kind: str = "eb") -> list[bytes]:
    """Every signature key `word` may have recorded (each value of each digit): no secret is
    needed to read them."""
    return [_signature_key(kind, word, i, d) for i in range(PICK_DIGITS) for d in range(4)]


def picks_one_entry(word: str, recorded: Callable[[bytes], bool], kind: str = "eb") -> bool:
    """Whether every entry `word` picks in the run's listings is the same one (no digit of their
    signatures recorded two ways): a word that picks one entry in each of two listings names
    neither."""
    return not any(sum(1 for d in range(4) if recorded(_signature_key(kind, word, i, d))) > 1
                   for i in range(PICK_DIGITS))


def pick_key(word: str) -> bytes:
    """The key saying that `word` picks one entry of some trusted listing of the run."""
    return _key("ew", word)


def entry_key(word: str, form: str) -> bytes:
    """The key saying that the entry `word` picks holds the value of `form`."""
    return _key("e", f"{word}|{form}")


def entry_forms(part: str) -> frozenset[str]:
    """The forms of the values an entry of a listing holds (`entry_value_forms`: addresses,
    account numbers, distinctive amounts, ids)."""
    forms = {f"t:{v}" for _, v in tokens(part)}
    forms |= {f"n:{n}" for n in amounts(normalise(part))}
    forms |= {f"h:{normalise(m.group())}" for m in _HANDLE.finditer(part)}
    return frozenset(forms)


def listing_entries(text: str) -> list[str]:
    """The entries of a listing: its lines, "|"- or ";"-separated parts or sentences, blank
    ones left out."""
    return [part for part in _RECORDS.split(text) if part.strip()]


def _field_forms(part: str) -> frozenset[str]:
    """The forms of the values a field of a record holds: its addresses, account numbers and
    distinctive amounts (an identifier is the record's name, not one of its fields' values)."""
    forms = {f"t:{v}" for _, v in tokens(part)}
    forms |= {f"n:{n}" for n in amounts(normalise(part))}
    return frozenset(forms)


def _picks(parts: list[tuple[set[str], frozenset[str]]], limit: int, out: set[bytes], *,
           secret: bytes | None = None) -> None:
    """Adds to `out` the pick and entry keys of each word that occurs in exactly one of `parts`
    ((words, forms) each), for the forms of that part, when two parts or more hold a value
    (with `secret`: and the signature keys of the part it picks, `pick_signature_keys`)."""
    if sum(1 for _, forms in parts if forms) < 2:
        return
    seen: dict[str, int] = {}
    for words, _ in parts:
        for w in words:
            seen[w] = seen.get(w, 0) + 1
    for words, forms in parts:
        if not forms:
            continue
        for w in sorted(words):
            if seen[w] != 1:
                continue
            if len(out) + len(forms) + 1 + (PICK_DIGITS if secret is not None else 0) > limit:
                return
            out.add(pick_key(w))
            out.update(entry_key(w, f) for f in forms)
            if secret is not None:
                out.update(pick_signature_keys(w, forms, secret=secret))


def entry_keys(text: str, limit: int = MAX_KEYS, *, secret: bytes | None) -> set[bytes]:
    """The keys of a trusted listing's entries that a word of the intent can pick: for each word
    (3 letters or more) or identifier (`id_words`) that occurs in exactly one entry holding a
    value (an address, account number, distinctive amount or id), `pick_key(word)` and
    `entry_key(word, value)` for each value of that entry. The same over the fields of the
    whole text (`segments`' separators: "items 129.00, shipping 6.50"), for the words that
    occur in exactly one of its fields and the addresses, accounts and amounts of that field
    ("refund the shipping fee"). A string of one entry with one valued field records nothing
    (it is not a choice: its values are endorsed as a record's already). And the `name_keys`
    of a listing's entries. `secret`: the store's pick secret (`pick_signature_keys`); None
    (the store could not give it) records neither the entries' picks nor their names, which
    would otherwise read as picking one entry run-wide: they endorse nothing (fail closed)."""
    out: set[bytes] = set()
    if secret is not None:
        _picks([(words_of(normalise(part)) | id_words(part), entry_forms(part)) for part in listing_entries(text)],
               limit, out, secret=secret)
    _picks([(words_of(normalise(part)), _field_forms(part)) for part in _SEPARATORS.split(text) if part.strip()],
           limit, out)
    if secret is not None:
        # The names of a listing's entries, which only a pick (or a criterion) endorses.
        out |= name_keys(text, limit - len(out), secret=secret)
    return out


@dataclass(frozen=True, slots=True)
class Critical:
    """One critical value of a sink call: where it is, what it is, and the keys a trusted
    output would have recorded for it (any one of them endorses it)."""

    pointer: str
    value: str | int | float
    norm: str  # normalised, edge punctuation stripped ("" for numbers)
    number: str | None  # canonical decimal when the value is a number or an amount
    keys: tuple[bytes, ...]
    # The keys of the value as a handle of the call's upstream (an identifier argument): any
    # output wrote it, the only id of its output wrote it (not in `keys`); None when the value
    # is not one.
    handle: bytes | None = None
    sole: bytes | None = None
    # The key of the value as one of several addresses of a trusted listing (`trusted_keys`):
    # it endorses only with the intent naming the address's owner (`IntentWords.names`).
    candidate: bytes | None = None
    # The key of the value as the one token (or amount) of a read the intent pointed at
    # (`pointed_keys`).
    pointed: bytes | None = None
    # Its longest distinctive token (an address, URL, account number) when it is one.
    token: str | None = None
    # A string number written as money ("14.00": `written_amount`): endorsed as an amount by a
    # trusted output writing it, however small.
    amount: bool = False
    # A disguised string (`fingerprint.disguised`: folding changes more than its case) as
    # compared faithfully; it then has no other form: only the intent writing these very
    # characters endorses it.
    faithful: str | None = None

    @classmethod
    def of(cls, pointer: str, value: str | int | float, handle_of: str | None = None) -> Critical:
        """`handle_of`: the call's upstream when the value is in an identifier argument."""
        handle = sole = None
        if handle_of is not None:
            text = str(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else value
            if isinstance(text, str) and _HANDLE_VALUE.fullmatch(text) is not None:
                handle, sole = handle_key(handle_of, text), handle_key(handle_of, text, sole=True)
        if isinstance(value, int | float):
            number = _json_number(value)
            of_number = [_key("n", number)] if number is not None and distinctive(number) else []
            amount = pointed_key("n", number) if number is not None and "." in number else None
            return cls(pointer, value, "", number, tuple(of_number), handle, sole, None, amount)
        if disguised(value):
            # Equal folded to a value the upstream treats as another ("faß.de" is not
            # "fass.de"): no folded form of it endorses (`fingerprint.disguised`).
            return cls(pointer, value, "", None, (), handle, sole, faithful=_strip(faithful(value)))
        folded = normalise(value)
        norm = _strip(folded)
        keys: list[bytes] = []
        number = None
        candidate = pointed = whole_token = None
        money = False
        m = _WHOLE_NUMBER.match(norm)
        if m is not None:
            # A number written as a string follows the rules of numbers (not of phrases: "2"
            # of "2. Grand Palace" does not endorse two nights).
            number = canonical_number(m.group(1), m.group(2))
            money = written_amount(m.group(2))
            if _SIGN.search(folded) is not None:
                # "-50" or "(50)" is not 50 (a refund is not a charge): only the intent writing
                # the negative number endorses it; no trusted output's amount does.
                return cls(pointer, value, norm, f"-{number}", (), handle, sole)
            if distinctive(number) or money:
                keys.append(_key("n", number))
            if "." in number or money:
                pointed = pointed_key("n", number)
        elif norm:
            keys.append(_key("v", norm))
        found = tokens(value)
        if found and len(maximal({v for _, v in found})) == 1:
            # The value is (or wraps) one address, URL or account number: an equal token
            # endorses it. Only its longest token counts (an address's host alone endorses
            # nothing). A value writing two ("anna@corp.example, eve@evil.example", an IBAN
            # with digits appended) or an "@" its token does not hold ("anna@corp.example@evil
            # .example") carries more than the endorsed token: only its whole value can be.
            kind, token = max(found, key=lambda t: (len(t[1]), t))
            if len(token) * 2 >= len(norm) and norm.count("@") == token.count("@"):
                keys.append(_key(f"t{kind}", token))
                pointed = pointed_key(kind, token)
                whole_token = token
                if kind == "email":
                    candidate = _key("c", token)
        return cls(pointer, value, norm, number, tuple(keys), handle, sole, candidate, pointed, whole_token, money)


def _json_number(value: int | float) -> str | None:
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        text = f"{value:.10f}" if abs(value) < 1e15 else f"{value:.0f}"
    else:
        text = str(value)
    sign = "-" if text.startswith("-") else ""
    whole, _, frac = text.lstrip("-").partition(".")
    return sign + canonical_number(whole, frac)


def _escape(seg: str) -> str:
    return seg.replace("~", "~0").replace("/", "~1")


def _scalars(value: Any, ptr: str, depth: int) -> Iterator[tuple[str, str | int | float]]:
    if depth > MAX_DEPTH:
        yield ptr, "<nested too deep>"  # never endorsed: fail closed
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, str):
        if value.strip():
            yield ptr, value
    elif isinstance(value, int | float):
        yield ptr, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _scalars(v, f"{ptr}/{_escape(str(k))}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _scalars(v, f"{ptr}/{i}", depth + 1)


def critical_values(arguments: Mapping[str, Any], names: Iterable[str],
                    upstream: str | None = None) -> tuple[list[Critical], bool]:
    """The critical values of the named top-level arguments (strings and numbers, nested ones
    included), and whether there were more than MAX_CRITICAL (the rest count as unendorsed).
    With `upstream`, the values of identifier arguments (`id_argument`) also carry their
    handle key."""
    out: list[Critical] = []
    for name in names:
        if name not in arguments:
            continue
        handle_of = upstream if upstream is not None and id_argument(name) else None
        for ptr, value in _scalars(arguments[name], f"/{_escape(name)}", 0):
            if len(out) >= MAX_CRITICAL:
                return out, True
            out.append(Critical.of(ptr, value, handle_of))
    return out, False


@dataclass(frozen=True, slots=True)
class IntentWords:
    """What the run's intent endorses for critical values: its normalised texts, its tokens'
    keys and its numbers."""

    texts: tuple[str, ...]
    token_keys: frozenset[bytes]
    numbers: frozenset[str]
    # The stems (`_SUFFIX` folded) of the words the intent writes in lower case: common words
    # ("archives", "forwarded"), not names ("the Palaces tour").
    common_stems: frozenset[str] = frozenset()
    # The texts as a disguised value is compared (`fingerprint.faithful`).
    faithful: tuple[str, ...] = ()
    # The whole texts, normalised, negated clauses kept (`texts` are `affirmed`): for the words
    # that pick listing entries and the criteria, where more words mean more ambiguity.
    said: tuple[str, ...] = ()
    # The words (`_WORD`) of `texts`: what `endorses` and `names` look a critical value's words
    # up in, once per call rather than a scan of the intent per value (up to MAX_CRITICAL
    # values against an intent `max_intent_chars` long, on the event loop).
    vocabulary: frozenset[str] = frozenset()
    # `words()` and `criteria()`, each computed once: linear (or worse) in the intent, which
    # `max_intent_chars` allows up to 1 MiB, so `offload.intent_words_of` computes them in its
    # worker thread for a long intent, never on the event loop.
    _words: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    _criteria: tuple[Criterion, ...] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, texts: Iterable[str]) -> IntentWords:
        whole = list(texts)
        texts = [affirmed(t) for t in whole]
        norms = tuple(normalise(t) for t in texts)
        keys = frozenset(_key(f"t{kind}", value) for t in texts for kind, value in tokens(t))
        said = {n for norm in norms for n in numbers(norm) | number_words(norm) | negatives(norm)}
        common = frozenset(_SUFFIX.sub("", w) for t in texts for w in _WORD.findall(t)
                           if len(w) >= 4 and w.islower())
        # "Add the hub", "book a table": a request for a thing implies one of it. One is the
        # smallest count there is, not a choice an injection gains by steering a sink to.
        return cls(norms, keys, frozenset(said | {IMPLIED_COUNT}), common, tuple(faithful(t) for t in texts),
                   tuple(normalise(t) for t in whole), frozenset(w for t in norms for w in _WORD.findall(t)))

    def spells(self, critical: Critical) -> bool:
        """Whether the intent writes the string itself: its whole normalised value between word
        boundaries, or one of its distinctive tokens; a disguised value (`Critical.faithful`)
        only as written. Numbers are `endorses`' (compared as numbers). The strict part of
        `endorses` (no inflection, no setting): part of what waives an approval gate
        (`proxy.envelope.dataflow.waiver`)."""
        if critical.faithful is not None:
            return bool(critical.faithful) and any(
                bounded(critical.faithful).search(text) is not None for text in self.faithful)
        if critical.number is not None:
            return False
        if critical.norm:
            pattern = bounded(critical.norm)
            if any(critical.norm in text and pattern.search(text) for text in self.texts):
                return True
        return any(k in self.token_keys for k in critical.keys)

    def endorses(self, critical: Critical) -> bool:
        if critical.faithful is None and critical.number is not None:
            # A number is compared as a number, never as a phrase: "1,200" is not endorsed by
            # "1,200,000", nor "200.50" by "1,200.50".
            return critical.number in self.numbers
        if self.spells(critical):
            return True
        if critical.faithful is not None:
            return False
        if critical.norm and _WORD.fullmatch(critical.norm) and len(critical.norm) > 4:
            # One word, inflected: "editor" is what "edit access" asks for.
            stem = _SUFFIX.sub("", critical.norm)
            if len(stem) >= 4 and stem in self.vocabulary:
                return True
        if self._setting(critical):
            return True
        return False

    def _setting(self, critical: Critical) -> bool:
        """Whether a critical value that is one common word (written in lower case, 4 letters
        or more: a setting or keyword a tool takes, such as a filter's `archive`, not a name)
        is a word the user wrote in lower case, inflections folded on both sides: "archives
        anything mentioning ..." endorses `archive`, "gets forwarded to ..." `forward`. A
        capitalised word of the intent or of the value is a name ("the Palaces tour" does not
        endorse `Palace`: round 6); the attacker can pick only a word the user wrote."""
        value = critical.value
        if not isinstance(value, str) or not critical.norm or not value.strip().islower():
            return False
        if len(critical.norm) < 4 or _WORD.fullmatch(critical.norm) is None:
            return False
        return bool({critical.norm, _SUFFIX.sub("", critical.norm)} & self.common_stems)

    def points_at(self, value: Any) -> bool:
        """Whether a read's argument value names one object and the intent names it: a path,
        URL, file name or record id (a string with a digit, "/" or "."), not a bare word (a
        channel, folder or search term names a place anyone can write into: its only token may
        be the attacker's) nor a bare number (every intent endorses the count 1)."""
        if not names_object(value):
            return False
        critical = Critical.of("", value)
        return critical.number is None and bool(critical.norm) and self.endorses(critical)

    def words(self) -> list[str]:
        """The intent's words of 3 letters or more and its identifiers (`id_words`); none when
        there are more than MAX_WORDS (the lookups are bounded, and a word left out could be
        one that makes a pick ambiguous)."""
        words = self._words
        if words is None:
            found = sorted({w for text in self.said for w in words_of(text) | id_words(text)})
            words = tuple(found) if len(found) <= MAX_WORDS else ()
            # Frozen, but a cache: the same value whichever thread computes it first.
            object.__setattr__(self, "_words", words)
        return list(words)

    def criteria(self) -> list[Criterion]:
        """The criteria the intent states (`criterion.criteria` of `said`: "the cheapest ..."),
        computed once."""
        stated = self._criteria
        if stated is None:
            # Imported here: the criterion module builds on this one.
            from proxy.envelope.dataflow.criterion import criteria
            stated = tuple(criteria(self.said))
            object.__setattr__(self, "_criteria", stated)
        return list(stated)

    def prepared(self) -> IntentWords:
        """This intent with `words()` and `criteria()` computed (for a worker thread to do)."""
        self.words()
        self.criteria()
        return self

    def names(self, critical: Critical) -> bool:
        """Whether the intent names the owner of an address: a word of 3 letters or more of
        its local part ("leo" of "leo.brandt@...") is a word of the intent. Only for an address
        a trusted listing holds (`Critical.candidate`): a trusted source says it exists, the
        user's words say which one."""
        if critical.candidate is None:
            return False
        local = critical.norm.rpartition("@")[0]
        owner = {w for w in _WORD.findall(local) if len(w) >= 3}
        return not owner.isdisjoint(self.vocabulary)
