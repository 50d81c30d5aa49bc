"""The run's intent: what the user asked, as the agent framework (trusted code) tells it.

The framework sends the user's words in `X-Envelope-Intent` (percent-encoded UTF-8) on any
call of a run, or an approver sets them through the admin API (`POST /v1/runs/{run}/intent`).
They are sticky per run and appended, never replaced: the store hash `intent`/<run key>
(`RunContext.key`: principal-scoped) holds one field per distinct text (its digest -> the
text), so sending the same intent on every call stores it once, concurrent appends from
several replicas never conflict, and the hash lives as long as the run's ledger
(`ledger_ttl` after its last append).

Values found in the intent are **endorsed** (`Endorsement`): a sink argument whose whole
normalised value occurs in the intent between word boundaries, a distinctive token (e-mail,
URL, host, account number) equal to one of the intent's, and grams of a copied run that the
intent holds too neither flag nor count as copied. Endorsement only narrows what is flagged
by the user's own words: a model cannot set headers, so a framework that forwards model text
in the header defeats it (README, "Data flow").
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from proxy.envelope.dataflow.endorse import affirmed, bounded
from proxy.envelope.dataflow.fingerprint import (
    collapse,
    faithful,
    fold,
    folded_tokens,
    gram_hashes,
    token_hash,
    variants,
)
from proxy.envelope.dataflow.ledger import Ledger
from proxy.envelope.dataflow.match import Probe
from proxy.errors import EnvelopeError
from proxy.policy.model import DEFAULT_WINNOW
from proxy.store.base import Store

NS = "intent"
HEADER = "X-Envelope-Intent"
# Most distinct texts a run's intent holds (one store field each): `load` reads them in one go.
MAX_TEXTS = 1000

# A percent-encoded value: any visible character but "%", or "%" and two hex digits.
_PERCENT_ENCODED = re.compile(r"(?:[^%]|%[0-9A-Fa-f]{2})*")
# Control characters other than tab and line breaks: never part of what a person typed.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class IntentError(EnvelopeError):
    """An intent that cannot be taken: malformed encoding, not UTF-8, or over the size bound."""


def decode(raw: str, max_chars: int) -> str:
    """The text of an `X-Envelope-Intent` value, decoded strictly (every "%" starts a valid
    escape, the bytes are UTF-8, no control characters but tab and line breaks, at most
    `max_chars` characters). Raises IntentError otherwise."""
    if _PERCENT_ENCODED.fullmatch(raw) is None:
        raise IntentError(f"{HEADER} is not percent-encoded: a '%' is not followed by two hex digits")
    try:
        text = unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IntentError(f"{HEADER} does not decode to UTF-8 (byte {exc.start})") from exc
    return checked(text, max_chars)


def checked(text: str, max_chars: int) -> str:
    """`text` when it may be stored as intent; IntentError when it holds a control character
    or is longer than `max_chars` characters."""
    found = _CONTROL.search(text)
    if found is not None:
        raise IntentError(f"the intent holds a control character (U+{ord(found.group()):04X} at {found.start()})")
    if len(text) > max_chars:
        raise IntentError(f"the intent is {len(text):,} characters long, more than the {max_chars:,} "
                          "a run may hold (dataflow.max_intent_chars)")
    return text


def _field(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


async def load(store: Store, run_key: str) -> list[str]:
    """The run's intent texts (no order). One store read; raises StoreError."""
    found = await store.hash_all(NS, run_key)
    return [value.decode("utf-8", errors="replace") for value in found.values()]


async def append(store: Store, run_key: str, text: str, *, max_chars: int, ttl: float) -> bool:
    """Add `text` to the run's intent (stripped; empty text adds nothing). False when the run
    already holds it (its expiry slides all the same), True when it was added. IntentError when
    the run's intent would hold more than `max_chars` characters or `MAX_TEXTS` texts;
    StoreError when the store cannot answer. The bound is checked against what the run held
    when it was read: appends racing on several replicas may pass it by one text each."""
    text = text.strip()
    if not text:
        return False
    held = await load(store, run_key)
    if text in held:
        await store.hash_put(NS, run_key, {}, ttl=ttl)
        return False
    if len(held) >= MAX_TEXTS:
        raise IntentError(f"the run's intent already holds {MAX_TEXTS} distinct texts")
    total = sum(len(t) for t in held) + len(text)
    if total > max_chars:
        raise IntentError(f"the run's intent would hold {total:,} characters, more than the "
                          f"{max_chars:,} a run may hold (dataflow.max_intent_chars)")
    await store.hash_put(NS, run_key, {_field(text): text.encode()}, ttl=ttl)
    return True


# -- endorsement -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endorsement:
    """What a run's intent endorses: its normalised texts, token fingerprints and every gram
    fingerprint (not winnowed: an argument's grams are looked up one by one)."""

    texts: tuple[str, ...]
    tokens: frozenset[bytes]
    grams: frozenset[bytes]
    # The texts as a disguised value is compared (`fingerprint.faithful`), for `written`.
    faithful: tuple[str, ...] = ()

    @classmethod
    def of(cls, texts: Iterable[str], n: int, window: int = DEFAULT_WINNOW) -> Endorsement:
        norms: list[str] = []
        said: list[str] = []
        toks: set[bytes] = set()
        grams: set[bytes] = set()
        for text in texts:
            # A value the user named only to exclude it ("not to bob@x.example") is not endorsed.
            kept = affirmed(text)
            low = fold(kept)  # folded once, for the grams and the tokens
            norm = collapse(low)
            norms.append(norm)
            said.append(faithful(kept))
            toks.update(token_hash(kind, value) for kind, value in variants(folded_tokens(low), parents=True))
            grams.update(gram_hashes(norm, n, window))
        return cls(tuple(norms), frozenset(toks), frozenset(grams), tuple(said))

    def __bool__(self) -> bool:
        return bool(self.texts)

    def whole(self, norm: str) -> bool:
        """Whether a normalised argument value occurs in the intent as a whole: not inside a
        longer word, address or number (a part of a token is not endorsed)."""
        if not norm:
            return False
        pattern = bounded(norm)
        return any(norm in text and pattern.search(text) is not None for text in self.texts)

    def written(self, value: str) -> bool:
        """Whether the intent writes a disguised value (`Probe.faithful`) with its very
        characters, as a whole: "josé@empresa.example" typed by the user endorses the same
        characters, never "jose@empresa.example" nor "hans@faß.example" for "hans@fass.example"."""
        if not value:
            return False
        pattern = bounded(value)
        return any(value in text and pattern.search(text) is not None for text in self.faithful)

    def narrow(self, ptr: str, probe: Probe, ledger: Ledger) -> tuple[Probe, list[dict[str, Any]]]:
        """`probe` without what the intent endorses (its tokens equal to the intent's, its grams
        the intent holds: a gram stands for `probe.k` characters, so a copied run is endorsed
        only where every window of it is the user's), and the audit entries of what was
        endorsed that the run's ledger holds as untrusted (what would otherwise match)."""
        def untrusted(h: bytes) -> bool:
            found = ledger.find(h)
            return found is not None and found.startswith("untrusted|")

        entries: list[dict[str, Any]] = []
        kept = []
        for kind, value, h in probe.tokens:
            if h in self.tokens:
                if untrusted(h):
                    entries.append({"arg": ptr, "by": "intent", "kind": "token", "token": kind})
            else:
                kept.append((kind, value, h))
        # An endorsed gram is replaced by one no ledger holds (fingerprints are 8 bytes), so the
        # positions of the others, and the runs they form, stay as they were.
        grams = [b"" if h in self.grams else h for h in probe.grams]
        if any(h in self.grams and untrusted(h) for h in probe.grams):
            entries.append({"arg": ptr, "by": "intent", "kind": "text"})
        return dataclasses.replace(probe, tokens=kept, grams=grams), entries
