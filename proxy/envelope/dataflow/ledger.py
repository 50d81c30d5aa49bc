"""The run ledger in the store: what a run has read, recorded and loaded by fingerprint."""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import struct
import time
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from proxy.envelope.dataflow.criterion import criterion_keys
from proxy.envelope.dataflow.endorse import (
    MAX_KEYS,
    entry_keys,
    handle_key,
    handle_keys,
    pointed_keys,
    trusted_keys,
)
from proxy.envelope.dataflow.fingerprint import (
    MIN_TOKEN,
    as_fields,
    collapse,
    fold,
    folded_tokens,
    gram_length,
    packed,
    phrase_hash,
    phrases,
    token_hash,
    unpacked,
    variants,
    winnowed_hashes,
    winnowed_packed,
)
from proxy.envelope.labels import Piece
from proxy.errors import StoreError
from proxy.policy.model import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_WINNOW, MIN_PHRASE_CHARS
from proxy.store.base import Store

NS = "ledger"
# Most characters of one trusted string whose endorsing keys are recorded (bounded work).
MAX_TRUSTED_CHARS = 1 << 16

log = logging.getLogger("envelope.dataflow")

# -- the ledger ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def source_id(label: str, source: str) -> bytes:
    """The 4-byte id a fingerprint stores for its "<label>|<upstream>.<tool>" source."""
    return hashlib.blake2b(f"{label}|{source}".encode(), digest_size=4).digest()


def _scheme(n: int, window: int, min_value: int = 0) -> str:
    """How a ledger's fingerprints were made; a ledger made another way cannot be matched."""
    # "p": outputs also record whole-value phrases (min_value on). A ledger without them cannot
    # be matched for short values, so switching min_value on makes it coarse (fail closed).
    # "l": the fingerprints are in the run's log (`LOG_NS`, one entry per output). A ledger
    # written before the log (one `ledger_fp` field per fingerprint, tags without "l") is not
    # read: it is coarse until it expires, also when newer outputs were added to it.
    # "k": text is folded to its skeleton (`fingerprint.fold`: marks removed, look-alike letters
    # and other scripts' digits made ASCII); a ledger folded before cannot be matched for text
    # that is not ASCII, so it is coarse until it expires.
    return f"{n}w{window}plk" if min_value else f"{n}w{window}lk"


def _merged(into: dict[bytes, str], found: list[bytes], label: str) -> dict[bytes, str]:
    """`into` with each of `found` set to `label`: a new dict when `into` is empty (the first
    piece of an output: one insertion per fingerprint instead of two, ~3 µs/KB of prose)."""
    if not into:
        return dict.fromkeys(found, label)
    into.update(dict.fromkeys(found, label))
    return into


@dataclass(slots=True)
class LedgerDelta:
    """What one tool output adds to a run's ledger (also what widens a parent's ledger)."""

    source: str  # "<upstream>.<tool>"
    untrusted: bool = False
    secret: bool = False
    # The grams of the first untrusted piece that has any, `fingerprint.packed` (sorted 8-byte
    # fingerprints in one bytes): most outputs are one text, whose grams then reach the store's
    # log entry with no Python object per fingerprint (a bytes object and a dict entry each
    # cost ~25 µs/KB). `grams` unpacks them into `_grams` on first use (another piece's grams,
    # a secret piece, a caller that reads them): then `_grams` holds them all.
    packed_grams: bytes = field(default=b"", repr=False)
    _grams: dict[bytes, str] | None = field(default=None, repr=False)
    # fingerprint -> "untrusted" | "secret" (untrusted wins when both)
    tokens: dict[bytes, str] = field(default_factory=dict)
    # whole-value phrase fingerprints (untrusted pieces only: secret-only matches never flag)
    values: dict[bytes, str] = field(default_factory=dict)
    # endorsing keys of trusted pieces (`proxy.envelope.dataflow.endorse`: recorded only when
    # some sink's on_tainted escalates); they never taint the run
    trusted: set[bytes] = field(default_factory=set)
    overflow: bool = False
    lost: bool = False  # the output may reach the agent without passing the proxy

    @classmethod
    def of(cls, source: str, parts: Iterable[Piece], n: int, limit: int | None = None,
           window: int = DEFAULT_WINNOW,
           max_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS, min_value: int = 0,
           trusted: bool = False, handles: Iterable[str] = (), pointed: bool = False,
           pick_secret: bytes | None = None) -> LedgerDelta:
        """The fingerprints of labelled pieces (grams winnowed with `window`; with `min_value`,
        0: off, also the whole-value phrases of untrusted pieces; with `trusted`, the
        endorsing keys of trusted pieces, at most `endorse.MAX_KEYS`, the sole-handle keys of
        `handles` (the ids a read made in a clean run was asked for) and, with `pointed` (a
        read the intent pointed at), the keys of the one token its untrusted pieces write);
        `pick_secret` keys the signatures of the listing entries a word picks (`endorse.
        entry_keys`: without it, no listing entry is recorded as picked).
        Beyond `limit` fingerprints, or `max_chars` characters of its pieces, the rest of the
        output is not hashed and the delta says `overflow` (bounded work per output)."""
        delta = cls(source)
        upstream = source.split(".", 1)[0]  # upstream names hold no "."
        if trusted:
            for handle in list(handles)[:MAX_KEYS // 2]:
                delta.trusted.add(handle_key(upstream, handle, sole=True))
        pointed_texts: list[str] = []
        budget = max_chars
        shortest = min(MIN_TOKEN, gram_length(n, window))
        if min_value:
            shortest = min(shortest, MIN_PHRASE_CHARS)
        endorsing = MAX_KEYS - len(delta.trusted)  # endorsing keys this output may still record
        for piece in parts:
            if trusted and endorsing > 0:
                # The one identifier a trusted piece hands out (`endorse`: handles), recorded
                # with the endorsing keys: an untrusted one makes none (an injected "reply to
                # m-999" writes one id), nor one id of several (a choice).
                keys = handle_keys(upstream, piece.text[:MAX_TRUSTED_CHARS], endorsing,
                                   sole=not piece.label.tracked)
                delta.trusted.update(keys)
                endorsing -= len(keys)
            if not piece.label.tracked:
                # A trusted piece (yielded only when asked for): what it endorses, no taint.
                if trusted and endorsing > 0:
                    keys = trusted_keys(piece.text[:MAX_TRUSTED_CHARS], endorsing)
                    # The entries of a listing a word of the intent may pick (`endorse`).
                    keys |= entry_keys(piece.text[:MAX_TRUSTED_CHARS], endorsing - len(keys), secret=pick_secret)
                    # Its extreme entries by a field, which a superlative of the intent picks.
                    keys |= criterion_keys(piece.text[:MAX_TRUSTED_CHARS], endorsing - len(keys))
                    delta.trusted.update(keys)
                    endorsing -= len(keys)
                continue
            label = "untrusted" if piece.label.untrusted else "secret"
            if trusted and pointed and piece.label.untrusted:
                pointed_texts.append(piece.text)
            delta.untrusted |= piece.label.untrusted
            delta.secret |= piece.label.secret
            if limit is not None and delta.count >= limit:
                delta.overflow = True
                continue
            text = piece.text
            if budget is not None:
                if len(text) > budget:
                    text = text[:budget]
                    delta.overflow = True
                budget -= len(text)
                if not text:
                    continue
            if len(text) < shortest and text.isascii():
                continue  # shorter than any gram or token (ASCII stays as long when normalised)
            low = fold(text)  # folded once, for the grams and the tokens
            norm = collapse(low)
            # Winnowing keeps at least one gram of every `window`: past this length the output
            # would overflow the cap anyway, so no more of it is hashed (bounded work).
            most = None if limit is None else max(0, limit - delta.gram_count) * window + n
            if most is not None and len(norm) > most:
                norm = norm[:most]
                delta.overflow = True
            toks = [token_hash(kind, value) for kind, value in variants(folded_tokens(low))]
            if label == "untrusted" and not min_value and delta._grams is None and not delta.packed_grams:
                # The first piece with grams (most outputs: the only one), kept packed: only its
                # distinct values are needed, not the positions winnowing kept them at.
                delta.packed_grams = winnowed_packed(norm, n, window)
                delta.tokens = _merged(delta.tokens, toks, label)
                continue
            grams = winnowed_hashes(norm, n, window)
            if min_value and label == "untrusted":
                held = delta.count + len(grams) + len(toks)
                room = None if limit is None else max(0, limit - held)
                found_phrases = phrases(norm, n, room)
                if room is not None and len(found_phrases) >= room:
                    delta.overflow = True
                delta.values.update(dict.fromkeys(map(phrase_hash, found_phrases), label))
            if label == "untrusted":
                if delta._grams is None and not delta.packed_grams:
                    delta.packed_grams = packed(grams)  # the first piece with grams: kept packed
                elif len(grams):
                    delta.grams = _merged(delta.grams, as_fields(grams), label)
                delta.tokens = _merged(delta.tokens, toks, label)
            else:
                for into, found in ((delta.grams, as_fields(grams)), (delta.tokens, toks)):
                    for h in found:
                        into.setdefault(h, label)
        # A pointed output longer than one trusted string's bound is not read for its token
        # (bounded work): it endorses nothing, so the run escalates more, never less.
        if pointed_texts and sum(map(len, pointed_texts)) <= MAX_TRUSTED_CHARS and endorsing > 0:
            delta.trusted |= set(list(pointed_keys(pointed_texts))[:endorsing])
        return delta

    @property
    def grams(self) -> dict[bytes, str]:
        """Gram fingerprint -> "untrusted" | "secret" (untrusted wins when both)."""
        if self._grams is None:
            self._grams = dict.fromkeys(unpacked(self.packed_grams), "untrusted")
            self.packed_grams = b""
        return self._grams

    @grams.setter
    def grams(self, value: dict[bytes, str]) -> None:
        self._grams, self.packed_grams = value, b""

    @property
    def gram_count(self) -> int:
        """len(grams), without unpacking them."""
        return len(self.packed_grams) // FP_SIZE if self._grams is None else len(self._grams)

    @property
    def count(self) -> int:
        """Its gram, token and whole-value fingerprints (what counts toward `ledger_cap`)."""
        return self.gram_count + len(self.tokens) + len(self.values)

    @property
    def empty(self) -> bool:
        return not (self.taints or self.trusted)

    @property
    def taints(self) -> bool:
        """Whether it marks the run (untrusted, secret, overflowed or lost), beyond endorsing."""
        return self.untrusted or self.secret or self.overflow or self.lost

    def labels(self) -> set[str]:
        """The labels its fingerprints carry."""
        if self.untrusted and not self.secret:
            return {"untrusted"} if self.gram_count or self.tokens or self.values else set()
        return set(self.grams.values()) | set(self.tokens.values()) | set(self.values.values())

    def fields(self, label: str) -> dict[bytes, bytes]:
        """The fingerprint fields of one label, each pointing at this delta's source id."""
        sid = source_id(label, self.source)
        if label == "trusted":
            return dict.fromkeys(self.trusted, sid)
        if self.labels() == {label}:
            out = dict.fromkeys(self.tokens, sid)
            out.update(dict.fromkeys(self.values, sid))
            out.update(dict.fromkeys(self.grams, sid))
            return out
        out = {h: sid for h, lab in self.tokens.items() if lab == label}
        out.update((h, sid) for h, lab in self.values.items() if lab == label)
        out.update((h, sid) for h, lab in self.grams.items() if lab == label)
        return out

    def groups(self) -> list[tuple[bytes, bool, bytes]]:
        """(source id, replace, its fingerprints joined) per label it carries, as one log entry
        holds them (what `fields` says, without building a dict: untrusted ones replace, others
        do not). Raises ValueError when a fingerprint is not 8 bytes long (a reader splits by it)."""
        out = []
        labels = self.labels()
        for label, replace in (("untrusted", True), ("secret", False)):
            if label not in labels:
                continue
            if labels == {label}:
                parts = [*self.tokens, *self.values]
                grams = self.packed_grams if self._grams is None else b"".join(self._grams)
            else:
                parts = [h for part in (self.tokens, self.values) for h, lab in part.items() if lab == label]
                grams = b"".join(h for h, lab in self.grams.items() if lab == label)
            joined = _joined(parts) + grams
            if joined:
                out.append((source_id(label, self.source), replace, joined))
        if self.trusted:
            out.append((source_id("trusted", self.source), False, _joined(self.trusted)))
        return out

    def meta(self, n: int, window: int = DEFAULT_WINNOW, min_value: int = 0) -> dict[bytes, bytes]:
        """The flag and source fields this delta sets in the run's meta hash."""
        out: dict[bytes, bytes] = {}
        present = self.labels()
        for label, on in (("untrusted", self.untrusted), ("secret", self.secret)):
            if on or label in present:
                out[label[0].encode()] = b"1"
                out[b"src:" + source_id(label, self.source)] = f"{label}|{self.source}".encode()
        if out:
            out[b"n:" + _scheme(n, window, min_value).encode()] = b"1"
        if self.trusted:
            # Endorsing keys do not depend on min_match, winnow or min_value: no scheme tag (a
            # run that read only trusted content never turns coarse when they change).
            out[b"src:" + source_id("trusted", self.source)] = f"trusted|{self.source}".encode()
        if self.overflow:
            out[b"o"] = b"1"
        if self.lost:
            out[b"l"] = b"1"
        return out


@dataclass(slots=True)
class Ledger:
    """What the check knows of one run's ledger: coarse flags, pending markers, the sources,
    and fingerprints (field -> source id). Loaded from the store, it holds only the
    fingerprints a call asked about; built in memory (`merge`), all of them."""

    n: int
    untrusted: bool = False
    secret: bool = False
    overflow: bool = False
    lost: bool = False  # an output reached the agent (or may have) without being fingerprinted
    lost_by_store: bool = False  # the state store lost the run's ledger (`lost`)
    pending: dict[str, float] = field(default_factory=dict)  # decision id -> deadline (epoch)
    sources: dict[bytes, str] = field(default_factory=dict)  # source id -> "<label>|<source>"
    schemes: set[str] = field(default_factory=set)  # every (min_match, winnow, phrases) it was built with
    window: int = DEFAULT_WINNOW
    min_value: int = 0  # whole-value matching (0: off): whether outputs record phrases
    fingerprints: dict[bytes, bytes] = field(default_factory=dict)

    @classmethod
    def from_meta(cls, n: int, meta: Mapping[bytes, bytes], window: int = DEFAULT_WINNOW,
                  min_value: int = 0) -> Ledger:
        ledger = cls(n, untrusted=b"u" in meta, secret=b"s" in meta, overflow=b"o" in meta,
                     lost=b"l" in meta, lost_by_store=meta.get(b"l") == LOST_BY_STORE,
                     window=window, min_value=min_value)
        for key, value in meta.items():
            if key.startswith(b"src:"):
                ledger.sources[key[4:]] = value.decode(errors="replace")
            elif key.startswith(b"p:"):
                try:
                    ledger.pending[key[2:].decode(errors="replace")] = float(value)
                except ValueError:
                    ledger.pending[key[2:].decode(errors="replace")] = 0.0  # unreadable: lost
            elif key.startswith(b"n:"):
                ledger.schemes.add(key[2:].decode(errors="replace"))
        return ledger

    # -- reading -------------------------------------------------------------------------

    def coarse(self, now: float, n: int, window: int | None = None,
               min_value: int | None = None) -> str | None:
        """Why every free-text argument counts as matching, or None."""
        if self.overflow:
            return "the run's ledger reached its size cap"
        window = self.window if window is None else window
        min_value = self.min_value if min_value is None else min_value
        if self.schemes - {_scheme(n, window, min_value)}:
            return (f"the run's ledger was built with another min_match, winnow or whole-value "
                    f"setting than the policy's ({n}, {window}, min_value {min_value}), or by an "
                    "older proxy")
        if self.lost_by_store:
            return ("the state store lost the run's ledger (restarted without persistence, or "
                    "flushed): what the run read is unknown")
        if self.lost:
            return ("an output of the run may have reached the agent without passing the proxy "
                    "(a dropped stream the client can resume)")
        if any(deadline < now for deadline in self.pending.values()):
            return "an untrusted output of the run was not fingerprinted (its result was lost)"
        return None

    def find(self, fingerprint: bytes) -> str | None:
        """The "<label>|<source>" of a gram or token fingerprint, or None."""
        sid = self.fingerprints.get(fingerprint)
        if sid is None:
            return None
        return self.sources.get(sid, "untrusted|an earlier tool")

    def trusted_source(self, fingerprint: bytes | None) -> str | None:
        """The trusted output a key was recorded from (what endorses a critical value), or
        None: not recorded, or recorded from untrusted content."""
        found = self.find(fingerprint) if fingerprint is not None else None
        return found[len("trusted|"):] if found is not None and found.startswith("trusted|") else None

    def first_source(self, label: str) -> str | None:
        prefix = f"{label}|"
        return next((s[len(prefix):] for s in sorted(self.sources.values()) if s.startswith(prefix)), None)

    # -- writing (in memory: tests and the corpus) ---------------------------------------------

    def merge(self, delta: LedgerDelta, cap: int) -> None:
        """Add a delta as the store would (untrusted fingerprints replace, secret ones do not;
        new fingerprints beyond `cap` are left out and the ledger overflows)."""
        for key, value in delta.meta(self.n, self.window, self.min_value).items():
            if key.startswith(b"src:"):
                self.sources[key[4:]] = value.decode()
        self.untrusted |= delta.untrusted
        self.secret |= delta.secret
        self.overflow |= delta.overflow
        for label, replace in (("untrusted", True), ("secret", False), ("trusted", False)):
            for key, sid in delta.fields(label).items():
                if key in self.fingerprints:
                    if replace:
                        self.fingerprints[key] = sid
                elif len(self.fingerprints) >= cap:
                    self.overflow |= label != "trusted"
                else:
                    self.fingerprints[key] = sid


# Store layout, per run (keyed by `RunContext.key`: principal-scoped, so another principal
# naming the same run id has a ledger of its own): the hash `ledger`/<run key> holds the flags
# (`u`, `s`, `o`), one `n:<scheme>` per scheme used, `src:<id>` -> "<label>|<source>" and the
# pending markers `p:<decision>` -> deadline; the log `ledger_log`/<run key> (`Store.hash_append`)
# holds one entry per recorded output: its fingerprints, sorted, per label (`_entry`). One write
# per output whatever its size (one field per fingerprint cost ~100 ms for a 10 KB page on
# SQLite), and a reader that holds the entries up to n reads only those after n (`LedgerViews`).
# Both expire `ledger_ttl` after the run's last recorded output. Flags only ever get set,
# entries only ever get added: concurrent writers never conflict, so no compare-and-set is
# needed. `ledger_cap` bounds the fingerprints of the log's entries (counted per entry: an
# output recorded again after `RecentWrites`' window counts again); an entry beyond it is not
# written and the run overflows (coarse).
META_NS = NS
FP_NS = "ledger_fp"  # ledgers written before the log (not read: their scheme tag makes them coarse)
LOG_NS = "ledger_log"

# An entry: version byte, the writer's wall time (8-byte double: `LedgerViews` staleness), then
# per label: source id (4), replace flag (1: untrusted fingerprints replace an earlier label,
# others do not), count (4), count 8-byte fingerprints.
_VERSION = 1
_HEAD = struct.Struct(">Bd")
_GROUP = struct.Struct(">4sBI")
FP_SIZE = 8


def _joined(fps: Collection[bytes]) -> bytes:
    """8-byte fingerprints as one bytes. Raises ValueError when one is not 8 bytes long."""
    joined = b"".join(fps)
    if len(joined) != len(fps) * FP_SIZE:  # every fingerprint kind is 8 bytes: a reader splits by it
        raise ValueError("a ledger fingerprint is not 8 bytes long")
    return joined


def _entry(groups: list[tuple[bytes, bool, bytes]], now: float) -> bytes:
    """One log entry of (source id, replace, joined 8-byte fingerprints) groups (in no set
    order: the reader builds a dict; an output's grams come sorted, `LedgerDelta.packed_grams`)."""
    out = [_HEAD.pack(_VERSION, now)]
    for sid, replace, joined in groups:
        out.append(_GROUP.pack(sid, replace, len(joined) // FP_SIZE))
        out.append(joined)
    return b"".join(out)


def _apply(entry: bytes, into: dict[bytes, bytes]) -> float:
    """Add an entry's fingerprints to a view as `Ledger.merge` would; the entry's wall time.
    Raises ValueError for an entry this version cannot read (the caller fails closed)."""
    if len(entry) < _HEAD.size or entry[0] != _VERSION:
        raise ValueError("unreadable ledger entry")
    _, at = _HEAD.unpack_from(entry)
    pos = _HEAD.size
    while pos < len(entry):
        sid, replace, count = _GROUP.unpack_from(entry, pos)
        pos += _GROUP.size
        end = pos + count * FP_SIZE
        if end > len(entry):
            raise ValueError("truncated ledger entry")
        block = entry[pos:end]
        fps = [block[i: i + FP_SIZE] for i in range(0, len(block), FP_SIZE)]
        if replace:
            into.update(dict.fromkeys(fps, sid))
        else:
            for fp in fps:
                into.setdefault(fp, sid)
        pos = end
    return float(at)


@dataclass(slots=True)
class _View:
    seq: int = 0  # entries applied: 1..seq
    newest: float = 0.0  # wall time of the newest entry applied
    fingerprints: dict[bytes, bytes] = field(default_factory=dict)
    # The highest sequence number this process appended to the run's log (`LedgerViews.wrote`),
    # and when: a log found shorter than that while it cannot have expired was lost.
    floor: int = 0
    floor_at: float = 0.0
    # The shortest `ledger_ttl` the log was read or written with (a policy reload may change it).
    ttl: float = math.inf

    def young(self, ttl: float) -> bool:
        """Whether the run's log cannot have expired since this view last learned of it."""
        return time.time() - max(self.newest, self.floor_at) <= min(self.ttl, ttl) / 2


class LedgerLost(Exception):
    """The store's log of a run is shorter than what this process read or wrote of it while it
    cannot have expired: the store lost it (a Redis restarted without persistence, a flush)."""


class LedgerViews:
    """Run ledgers as this process last read them from the store's logs (fingerprint -> source
    id), per store (weakly), per run. A check syncs the run's view first (one store read of
    the entries other processes or replicas added since), so it sees every fingerprint
    recorded before it, and then looks its arguments up in memory. Bounded: least recently
    used runs go when the views hold more than `budget` fingerprints (a run's own view is
    kept, whatever its size)."""

    # Entries read per store call while catching up.
    PAGE = 256

    def __init__(self, budget: int = 1 << 20, runs: int = 4096) -> None:
        self.budget = budget
        self.runs = runs
        self._stores: weakref.WeakKeyDictionary[Store, OrderedDict[str, _View]] = weakref.WeakKeyDictionary()
        self._held = 0

    def _runs(self, store: Store) -> OrderedDict[str, _View]:
        runs = self._stores.get(store)
        if runs is None:
            runs = self._stores[store] = OrderedDict()
        return runs

    def _drop(self, runs: OrderedDict[str, _View], run_key: str) -> None:
        view = runs.pop(run_key, None)
        if view is not None:
            self._held -= len(view.fingerprints)

    async def read(self, store: Store, run_key: str, ttl: float) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
        """(the run's flags hash, its fingerprints up to date with the store's log), in one
        store read when this process's view is warm (the flags and what the log gained since,
        one snapshot: every fingerprint of an output whose flags are seen is seen). Raises
        StoreError when the store cannot answer, ValueError for an entry it cannot read."""
        runs = self._runs(store)
        view = runs.get(run_key)
        # A log expires `ttl` after its newest entry (less the `RecentWrites` window, at most
        # a tenth of it) and then starts again at 1: a view older than half of that is read
        # afresh, so it never mistakes a new log's entries for ones it holds.
        if view is not None and (view.seq or view.floor) and not view.young(ttl):
            self._drop(runs, run_key)
            view = None
        if view is None:
            view = runs[run_key] = _View()
        runs.move_to_end(run_key)
        meta: dict[bytes, bytes] | None = None
        pages = 0
        while True:
            after = view.seq
            # What this process knew of the log before asking (an append of its own that ends
            # while this read is in flight may be ordered after it on the server).
            known = max(view.seq, view.floor) if view.young(ttl) else 0
            found = await store.hash_since(LOG_NS, run_key, after, self.PAGE,
                                           with_hash=META_NS if meta is None else None)
            pages += 1
            if meta is None:
                meta = found.fields
            if runs.get(run_key) is not view:
                # Evicted (or replaced) while waiting: this call's view is the one kept.
                self._drop(runs, run_key)
                runs[run_key] = view
                self._held += len(view.fingerprints)
            view.ttl = min(view.ttl, ttl)
            if found.last < known:
                raise LedgerLost(run_key)
            if found.last < after:
                # The log expired and started again since this view was read: read it afresh.
                self._drop(runs, run_key)
                view = runs[run_key] = _View()
                continue
            if view.seq == after:  # no concurrent read applied these entries meanwhile
                before = len(view.fingerprints)
                for entry in found.entries:
                    view.newest = max(view.newest, _apply(entry, view.fingerprints))
                    view.seq += 1
                self._held += len(view.fingerprints) - before
            if not found.entries or view.seq >= found.last:
                break
        if pages > 1:
            # Caught up over several reads: the flags again, so that they name the sources of
            # every entry read (read after the entries: they cover them).
            meta = await store.hash_all(META_NS, run_key)
        self._evict(runs)
        return meta, view.fingerprints

    def _evict(self, runs: OrderedDict[str, _View]) -> None:
        # The run just synced is the most recently used: it is never the one dropped.
        while len(runs) > 1 and (len(runs) > self.runs or self._held > self.budget):
            self._drop(runs, next(iter(runs)))

    def known(self, store: Store, run_key: str, ttl: float) -> int:
        """The highest sequence number of the run's log this process read or wrote, while the
        log cannot have expired since (else 0). An append sent after this is read gets a
        higher one, unless the store lost the log."""
        view = self._runs(store).get(run_key)
        return max(view.seq, view.floor) if view is not None and view.young(ttl) else 0

    def wrote(self, store: Store, run_key: str, seq: int, ttl: float) -> None:
        """This process appended entry `seq` to the run's log: a log found shorter later while
        it cannot have expired was lost (`LedgerLost`)."""
        runs = self._runs(store)
        view = runs.get(run_key)
        if view is None:
            view = runs[run_key] = _View()
        view.floor, view.floor_at, view.ttl = max(view.floor, seq), time.time(), min(view.ttl, ttl)
        runs.move_to_end(run_key)
        self._evict(runs)

    def forget(self, store: Store, run_key: str) -> None:
        self._drop(self._runs(store), run_key)


# This process's views (every check of every policy revision shares them).
VIEWS = LedgerViews()


async def load(store: Store, run_key: str, n: int, probes: Iterable[bytes] = (),
               window: int = DEFAULT_WINNOW, min_value: int = 0, *, ttl: float = 24 * 3600.0,
               views: LedgerViews | None = None, endorsing: bool = False) -> Ledger | None:
    """The run's flags and the fingerprints among `probes` it holds, or None when the run has
    no ledger. One store read when warm (the flags and what the run's log gained since this
    process last read it, `views`: the process's `VIEWS` by default); the lookup is in memory,
    so the cost follows the probes and what was recorded since, not the ledger. `ttl` is the policy's
    `ledger_ttl`. A clean run's fingerprints are not looked up (nothing there can flag) unless
    `endorsing` (the probes are endorsing keys: a gate waiver reads them in any run). Raises
    StoreError when the store cannot answer or holds an entry this version cannot read (fail
    closed)."""
    # No set of the probes: the intersection below iterates them either way, and building one
    # of ~240 probes per check cost ~5 µs (the check passes a list, used as it is).
    wanted = probes if isinstance(probes, list) else list(probes)
    views = views or VIEWS
    held: dict[bytes, bytes] = {}
    try:
        if wanted:
            meta, held = await views.read(store, run_key, ttl)
        else:
            meta = await _flags(store, run_key, ttl, views)
    except ValueError as exc:
        raise StoreError(f"the run's ledger holds an entry this proxy cannot read: {exc}") from exc
    except LedgerLost:
        meta = await lost(store, run_key, ttl, views)
    if not meta:
        return None
    ledger = Ledger.from_meta(n, meta, window, min_value)
    if ledger.untrusted or ledger.secret or endorsing:
        # The intersection in C (iterating the probes, looked up in the view): a clean argument
        # of 300 characters has ~240 probes and no hit, so no Python loop runs over them.
        ledger.fingerprints = {k: held[k] for k in held.keys() & wanted}
    return ledger


class RecentWrites:
    """What this process wrote to which run ledgers in the last `window` seconds, so that an
    output already recorded (an agent reading the same page again) and unchanged flags cost no
    store write. A run is "fresh" when this process refreshed both of its hashes (same expiry)
    within the window; only then are writes skipped, and a skipped refresh moves an expiry at
    most `window` seconds earlier than a rewrite would have. Bounded (LRU over runs)."""

    def __init__(self, window: float = 60.0, size: int = 4096) -> None:
        self.window = window
        self.size = size
        # Per store (weakly: a closed store's entries go with it), per run: when, and digests.
        self._stores: weakref.WeakKeyDictionary[Store, OrderedDict[str, tuple[float, set[bytes]]]] = (
            weakref.WeakKeyDictionary())

    def _runs(self, store: Store) -> OrderedDict[str, tuple[float, set[bytes]]]:
        runs = self._stores.get(store)
        if runs is None:
            runs = self._stores[store] = OrderedDict()
        return runs

    def _entry(self, store: Store, run_key: str, ttl: float) -> set[bytes] | None:
        entry = self._runs(store).get(run_key)
        if entry is None or time.monotonic() - entry[0] > min(self.window, ttl / 10):
            return None
        return entry[1]

    def fresh(self, store: Store, run_key: str, ttl: float) -> bool:
        return self._entry(store, run_key, ttl) is not None

    def covers(self, store: Store, run_key: str, digests: Iterable[bytes], ttl: float) -> bool:
        seen = self._entry(store, run_key, ttl)
        return seen is not None and all(d in seen for d in digests)

    def refreshed(self, store: Store, run_key: str, digests: Iterable[bytes], ttl: float) -> None:
        """Both hashes of the run were just written with expiry `ttl`, holding `digests`."""
        seen = self._entry(store, run_key, ttl)
        if seen is None:
            seen = set()
        seen.update(digests)
        runs = self._runs(store)
        runs[run_key] = (time.monotonic(), seen)
        runs.move_to_end(run_key)
        while len(runs) > self.size:
            runs.popitem(last=False)

    def forget(self, store: Store, run_key: str) -> None:
        self._runs(store).pop(run_key, None)


def _digest(kind: bytes, fields: Mapping[bytes, bytes]) -> bytes:
    h = hashlib.blake2b(kind, digest_size=16)
    for k, v in fields.items():
        h.update(k)
        h.update(v)
    return h.digest()


async def run_flags(store: Store, run_key: str, ttl: float = 24 * 3600.0,
                    views: LedgerViews | None = None) -> tuple[bool, bool]:
    """(tainted, secret) of a run: whether it has read untrusted content (or an output may have
    reached it unrecorded, or the store lost its ledger) and whether it has read secret
    content. One store read. Raises StoreError when the store cannot answer."""
    views = views or VIEWS
    try:
        meta = await _flags(store, run_key, ttl, views)
    except LedgerLost:
        meta = await lost(store, run_key, ttl, views)
    return (b"u" in meta or b"l" in meta), b"s" in meta


async def _flags(store: Store, run_key: str, ttl: float, views: LedgerViews) -> dict[bytes, bytes]:
    """The run's flags hash, with its log's length in the same store read: `LedgerLost` when
    the log is shorter than what this process read or wrote of it."""
    known = views.known(store, run_key, ttl)
    found = await store.hash_since(LOG_NS, run_key, 0, 0, with_hash=META_NS)
    if found.last < known:
        raise LedgerLost(run_key)
    return found.fields


# The `l` flag's value when the store lost the run's ledger (else "1": an unrecorded output).
LOST_BY_STORE = b"store"


async def lost(store: Store, run_key: str, ttl: float, views: LedgerViews) -> dict[bytes, bytes]:
    """The store lost the run's ledger (`LedgerLost`): what the run read is unknown, so it
    counts as tainted and coarse from now on, in the store (every replica sees it, until the
    flags expire `ttl` from now) and in this process. The flags written. Raises StoreError
    when the store cannot take them (the caller refuses)."""
    log.error("the state store lost the data-flow ledger of run %s (restarted without persistence, "
              "or flushed): the run counts as tainted and coarse", run_key)
    flags = {b"u": b"1", b"l": LOST_BY_STORE}
    await store.hash_put(META_NS, run_key, flags, ttl=ttl)
    views.forget(store, run_key)
    return await store.hash_all(META_NS, run_key)


async def mark_pending(store: Store, run_key: str, decision_id: str, deadline: float, *,
                       ttl: float, recent: RecentWrites | None = None) -> None:
    """Say that an output of the run is on its way (cleared by `record`). Both hashes get the
    same expiry, unless this process refreshed them moments ago (`recent`: then the expiry
    stays)."""
    marker = {b"p:" + decision_id.encode(): repr(deadline).encode()}
    if recent is not None and recent.fresh(store, run_key, ttl):
        await store.hash_put(META_NS, run_key, marker)
        return
    await store.hash_put(META_NS, run_key, marker, ttl=ttl)
    await store.hash_put(LOG_NS, run_key, {}, ttl=ttl)
    if recent is not None:
        # Both hashes now carry expiry `ttl`: the run is fresh (no output's digest is known), so
        # the markers of the run's next calls are one write each, not two.
        recent.refreshed(store, run_key, (), ttl)


async def record(store: Store, run_key: str, delta: LedgerDelta, *, n: int, cap: int, ttl: float,
                 done: str | None = None, window: int = DEFAULT_WINNOW, min_value: int = 0,
                 recent: RecentWrites | None = None, views: LedgerViews | None = None) -> None:
    """Add a delta to the run's ledger, then clear the pending marker `done`. The fingerprints
    (one log entry) and the flags go in together, the marker last, so an interruption leaves
    the run coarse (fail closed). Both get the same expiry: flags that outlived their
    fingerprints would narrow verdicts. An entry that would take the log beyond `cap`
    fingerprints is not written and the run overflows. What this process wrote moments ago
    (`recent`, the process's `RecentWrites`) is not written again. Raises StoreError when the
    store cannot answer."""
    meta = delta.meta(n, window, min_value)
    groups = delta.groups()
    entry = _entry(groups, time.time()) if groups else b""
    # What was written is known by digest: the entry's fingerprints (not its wall time).
    # SHA-256 (truncated): collision resistant like BLAKE2b, and twice as fast where the CPU
    # has SHA instructions (~20 µs for a 10 KB page's entry instead of ~40).
    digests = [hashlib.sha256(entry[_HEAD.size:]).digest()[:16]] if groups else []
    marker = [] if done is None else [b"p:" + done.encode()]
    if meta or groups:
        digests.append(_digest(b"meta", meta))
        if recent is None or not recent.covers(store, run_key, digests, ttl):
            # The run stays fresh while this write is in flight: its hashes' expiry was set by
            # the earlier write that made it fresh, whatever this one does, so the calls that
            # mark an output pending meanwhile write their marker alone (one write, not two).
            # A write that fails forgets the run (what the store holds is then unknown).
            try:
                if groups:
                    # The entry, the flags and the marker's removal in one step (one round
                    # trip). The flags only when the entry went in (flags without their
                    # fingerprints would narrow verdicts); when the cap refuses it, the flags
                    # with the overflow flag instead, and the marker's removal, in that step.
                    weight = sum(len(joined) // FP_SIZE for _, _, joined in groups)
                    # Endorsing keys left out only endorse less (more escalation): no overflow.
                    full = {**meta, b"o": b"1"} if len(groups) > bool(delta.trusted) else meta
                    views = views or VIEWS
                    known = views.known(store, run_key, ttl)
                    seq = await store.hash_append(LOG_NS, run_key, entry, ttl=ttl, weight=weight, cap=cap,
                                                  also=(META_NS, meta), drop=marker, if_refused=full)
                    if not seq:
                        meta = full
                    elif seq <= known:  # the log started again under an entry this process knew
                        await lost(store, run_key, ttl, views)
                    else:
                        views.wrote(store, run_key, seq, ttl)
                    marker = []
                else:
                    await store.hash_put(LOG_NS, run_key, {}, ttl=ttl)
                    await store.hash_put(META_NS, run_key, meta, ttl=ttl)
            except BaseException:
                if recent is not None:
                    recent.forget(store, run_key)
                raise
            if recent is not None:
                # An overflow is written again next time (none of its digests is kept as
                # written), but both hashes' expiry was just set: the run is fresh, so the
                # markers of its next calls are one write each, as in a run that fits its cap.
                recent.refreshed(store, run_key, () if b"o" in meta else digests, ttl)
    if marker:
        await store.hash_delete(META_NS, run_key, marker)


async def widen_parent(store: Store, parent_key: str, delta: LedgerDelta, *,
                       n: int, cap: int = 65536, ttl: float = 24 * 3600.0,
                       window: int = DEFAULT_WINNOW, min_value: int = 0,
                       recent: RecentWrites | None = None) -> None:
    """Widen (never narrow) a parent run's ledger with a child's delta.

    For run lineage: call it for each ancestor that should inherit a child's taint. Raises
    StoreError when the store cannot answer (the caller fails closed).
    """
    await record(store, parent_key, delta, n=n, cap=cap, ttl=ttl, window=window, min_value=min_value,
                 recent=recent)

