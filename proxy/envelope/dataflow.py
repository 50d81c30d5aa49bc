"""Data-flow check: untrusted content must not steer a sink (DESIGN section 2, check 7).

Per run, a **ledger** in the store holds fingerprints of the untrusted and secret content the
run has read: hashes of normalised character grams, winnowed (of every `winnow` consecutive
grams of N - winnow + 1 characters the smallest hash is kept, so every copied run of N =
`min_match` characters shares a kept one), and hashes of distinctive tokens (e-mail addresses, URLs and domains, account-number-like digit runs, IBANs;
normalised, at least 8 characters). It is two store hashes (`Store.hash_put` / `hash_get`): the
fingerprints, each pointing at its source tool, and a small one of flags (untrusted, secret,
overflowed), sources and pending markers. Checking a sink fetches the flags and asks for exactly
the fingerprints of its arguments (two round trips, cost proportional to the arguments, never to
the ledger); recording an output adds fields (flags only get set and fingerprints only get added,
so concurrent calls of a run never contend). When the cap `ledger_cap` is reached, later content
is not fingerprinted and every free-text sink argument counts as matching: eviction widens a
verdict, never narrows it.

A **sink** is a call whose effect is not `read`. Its string arguments (and long integers) are
matched unless the tool's schema constrains them (enum, const, boolean, bounded number, a
`skip_formats` format, maxLength below 8). A sink is flagged when an argument contains a run of
at least N untrusted characters verbatim, or carries a distinctive untrusted token, or (the
trifecta) the run holds both untrusted and secret content. `declassify` lets listed sinks or
arguments receive untrusted text: their verbatim runs are audited as declassified flows, but a
token lifted from untrusted content in them is still flagged.

Modes: `shadow` forwards flagged calls (audited with the evidence under `dataflow`, counted in
`envelope_dataflow_flagged_total`); `enforce` refuses them with `dataflow_policy_blocked`, or,
with `on_flag: approve` for the sink and an approval gate configured, sends them to the approval
gate with the evidence (`ToolCall.escalation`). No `dataflow:` section: shadow.

Recording: a result hook adds an output's fingerprints to the ledger before the output reaches
the agent. When the store cannot take them, enforce withholds the result (`ResultWithheld`:
refused `store_unavailable`), shadow delivers it and audits `dataflow_error`. A session read also
gets a pending marker before it is forwarded, because a client may resume a dropped session
stream past the proxy: a marker left past its deadline, or a call allowed but finished without
its result, makes the run coarse (fail closed: content the agent may see was not fingerprinted).
What this process recorded for a run in the last minute is not written again (`RECENT`).

Fail closed: in enforce mode a sink with no store refuses `misconfigured` and a store error
refuses `store_unavailable`; in shadow mode both are audited (`dataflow_error`) and the call
continues.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import re
import time
import unicodedata
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from proxy.envelope.call import (
    Code,
    Decision,
    Effect,
    ResultHook,
    Services,
    ToolCall,
    Verdict,
)
from proxy.envelope.labels import OutputLabels, Piece, annotation, output_labels, pieces
from proxy.envelope.tools import ToolRegistry
from proxy.errors import ResultWithheld, StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import DEFAULT_WINNOW, DataflowPolicy
from proxy.store.base import Store

NS = "ledger"
SNIPPET = 80  # evidence snippets are truncated to this many characters
MIN_TOKEN = 8  # shortest distinctive token
PENDING_GRACE = 30.0  # seconds past the upstream timeout before a pending marker counts as lost
MAX_DEPTH = 32

log = logging.getLogger("envelope.dataflow")

# -- normalisation and fingerprints ------------------------------------------------------------

_WS = re.compile(r"\s+")
# Window hashes are polynomial hashes mod 2**64 (numpy's wrapping uint64 arithmetic), computed
# for every window at once from prefix sums: hash(i) = sum(c[i+k] * B**k), stable across
# processes and replicas. A collision can only make a benign argument match (never hide a copy).
_B = 0x100000001B3  # odd, so invertible mod 2**64
_B_INV = pow(_B, -1, 1 << 64)
_SEGMENT = 1 << 15
_powers: tuple[np.ndarray, np.ndarray] = (np.ones(1, np.uint64), np.ones(1, np.uint64))


def _power_tables(length: int) -> tuple[np.ndarray, np.ndarray]:
    """B**i and B**-i mod 2**64 for i < length (grown by doubling, shared by every call)."""
    global _powers
    if len(_powers[0]) < length:
        size = 1 << max(12, (length - 1).bit_length())
        one = np.ones(1, np.uint64)
        with np.errstate(over="ignore"):
            _powers = (np.cumprod(np.concatenate((one, np.full(size - 1, _B, np.uint64))), dtype=np.uint64),
                       np.cumprod(np.concatenate((one, np.full(size - 1, _B_INV, np.uint64))), dtype=np.uint64))
    return _powers


# Invisible format characters (zero-width spaces and joiners, soft hyphen, bidi controls, BOM):
# a model told to slip them into a copied address must not break the match.
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e\u200b-\u200f"
                        "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]")


def _fold(text: str) -> str:
    """NFKC, invisible characters removed, case-folded."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text)).casefold()


def normalise(text: str) -> str:
    """Case-folded, NFKC, invisible characters removed, whitespace runs collapsed to one space,
    stripped."""
    return _WS.sub(" ", _fold(text)).strip()


def _window_hashes(norm: str, k: int) -> np.ndarray:
    """The hash of every k-character window of a normalised string, in order (computed in
    segments of `_SEGMENT` windows, so the power tables stay small for huge texts)."""
    length = len(norm)
    if length < k:
        return np.empty(0, np.uint64)
    codes = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    parts = []
    for start in range(0, length - k + 1, _SEGMENT):
        seg = codes[start: start + _SEGMENT + k - 1]
        size = len(seg)
        up, down = _power_tables(size)
        prefix = np.zeros(size + 1, np.uint64)
        with np.errstate(over="ignore"):
            np.cumsum(seg * up[:size], out=prefix[1:])
            parts.append((prefix[k:] - prefix[:-k]) * down[: size - k + 1])
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _as_fields(hashes: np.ndarray) -> list[bytes]:
    raw = hashes.astype("<u8").tobytes()
    return [raw[i: i + 8] for i in range(0, len(raw), 8)]


def gram_length(n: int, window: int) -> int:
    """The length k of the hashed grams: winnowing with `window` guarantees that every shared
    run of k + window - 1 = n characters shares a kept fingerprint."""
    return n - window + 1


def gram_hashes(norm: str, n: int, window: int = DEFAULT_WINNOW) -> list[bytes]:
    """The 8-byte fingerprint of every gram of a normalised string, in order (what an
    argument is looked up by)."""
    return _as_fields(_window_hashes(norm, gram_length(n, window)))


def winnowed(norm: str, n: int, window: int = DEFAULT_WINNOW) -> list[bytes]:
    """The fingerprints an output keeps (Schleimer, Wilkerson and Aiken's winnowing): in every
    run of `window` consecutive grams, the smallest hash (the rightmost on ties). Any text of
    at least n characters shared with the output contains `window` whole grams, so one of its
    grams is kept; about 2/(window+1) of the grams are stored. `window` 1 keeps every gram."""
    if len(norm) < gram_length(n, window):
        return []  # shorter than one gram (most short outputs): no numpy round trip
    hashes = _window_hashes(norm, gram_length(n, window))
    if window <= 1:
        return _as_fields(np.unique(hashes))
    if len(hashes) < window:
        return _as_fields(hashes[[int(hashes.argmin())]])
    views = np.lib.stride_tricks.sliding_window_view(hashes, window)
    rightmost = window - 1 - views[:, ::-1].argmin(axis=1)
    keep = np.unique(np.arange(len(views)) + rightmost)
    return _as_fields(hashes[keep])


_EMAIL = re.compile(r"[a-z0-9._%+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)*\.[a-z]{2,24}")
_URL = re.compile(r"(?:[a-z][a-z0-9+.-]*://|www\.)[^\s<>\"'`()\[\]{}|\\^]+")
_DOMAIN = re.compile(
    r"(?<![@\w.-])(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.)+[a-z]{2,24}(?![\w-])(?:/[^\s<>\"'`()\[\]{}]*)?"
)
_DIGITS = re.compile(r"(?<![\w])\d(?:[ .\-/()]{0,2}\d){7,}(?![\w])")
_IBAN = re.compile(r"\b[a-z]{2}\d{2}(?: ?[a-z0-9]{4}){2,7}(?: ?[a-z0-9]{1,4})?\b")
_DATE = re.compile(r"^\d{4}[-./]\d{1,2}[-./]\d{1,2}$|^\d{1,2}[-./]\d{1,2}[-./]\d{4}$")
# Bare "domains" that are file names, not hosts.
_FILE_TLDS = frozenset(
    "txt md pdf doc docx xls xlsx csv json yaml yml py js ts html htm png jpg jpeg gif svg zip "
    "gz tar log ini cfg toml xml sh rs go java c h cpp rb php css".split()
)
_TRAIL = ".,;:!?'\")]}>*"


def _url_tokens(raw: str) -> Iterator[tuple[str, str]]:
    value = raw.rstrip(_TRAIL)
    value = re.sub(r"^[a-z][a-z0-9+.-]*://", "", value)
    value = value.removeprefix("www.")
    value = value.rstrip("/")
    host, _, rest = value.partition("/")
    host = host.split("@")[-1].split(":")[0]
    if "." not in host or host.rsplit(".", 1)[-1] in _FILE_TLDS:
        return
    if len(host) >= MIN_TOKEN:
        yield "host", host
    if rest:
        yield "url", f"{host}/{rest}"


def tokens(text: str) -> set[tuple[str, str]]:
    """Distinctive tokens of a text, normalised: (kind, value), values of at least 8 chars."""
    low = _fold(text)
    found: set[tuple[str, str]] = set()
    emails = _EMAIL.findall(low)
    for e in emails:
        found.add(("email", e))
        host = e.rsplit("@", 1)[1]
        if len(host) >= MIN_TOKEN:
            found.add(("host", host))
    for m in _URL.findall(low):
        found.update(_url_tokens(m))
    for m in _DOMAIN.findall(low):
        found.update(_url_tokens(m))
    for m in _DIGITS.findall(low):
        if _DATE.match(m):
            continue
        digits = re.sub(r"\D", "", m)
        if len(digits) >= MIN_TOKEN:
            found.add(("number", digits))
    for m in _IBAN.findall(low):
        compact = m.replace(" ", "")
        if any(ch.isdigit() for ch in compact[4:]):
            found.add(("number", compact))
    return {(k, v) for k, v in found if len(v) >= MIN_TOKEN}


def token_hash(kind: str, value: str) -> bytes:
    """The 8-byte fingerprint of a distinctive token."""
    return hashlib.blake2b(f"{kind}:{value}".encode(), digest_size=8).digest()


# -- the ledger ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def source_id(label: str, source: str) -> bytes:
    """The 4-byte id a fingerprint stores for its "<label>|<upstream>.<tool>" source."""
    return hashlib.blake2b(f"{label}|{source}".encode(), digest_size=4).digest()


def _scheme(n: int, window: int) -> str:
    """How a ledger's fingerprints were made; a ledger made another way cannot be matched."""
    return f"{n}w{window}"


@dataclass(slots=True)
class LedgerDelta:
    """What one tool output adds to a run's ledger (also what widens a parent's ledger)."""

    source: str  # "<upstream>.<tool>"
    untrusted: bool = False
    secret: bool = False
    # fingerprint -> "untrusted" | "secret" (untrusted wins when both)
    grams: dict[bytes, str] = field(default_factory=dict)
    tokens: dict[bytes, str] = field(default_factory=dict)
    overflow: bool = False
    lost: bool = False  # the output may reach the agent without passing the proxy

    @classmethod
    def of(cls, source: str, parts: Iterable[Piece], n: int, limit: int | None = None,
           window: int = DEFAULT_WINNOW) -> LedgerDelta:
        """The fingerprints of labelled pieces (grams winnowed with `window`). Beyond `limit`
        fingerprints the rest of the output is not hashed and the delta says `overflow`
        (bounded work per output)."""
        delta = cls(source)
        for piece in parts:
            label = "untrusted" if piece.label.untrusted else "secret"
            delta.untrusted |= piece.label.untrusted
            delta.secret |= piece.label.secret
            if limit is not None and len(delta.grams) + len(delta.tokens) >= limit:
                delta.overflow = True
                continue
            norm = normalise(piece.text)
            # Winnowing keeps at least one gram of every `window`: past this length the output
            # would overflow the cap anyway, so no more of it is hashed (bounded work).
            most = None if limit is None else max(0, limit - len(delta.grams)) * window + n
            if most is not None and len(norm) > most:
                norm = norm[:most]
                delta.overflow = True
            grams = winnowed(norm, n, window)
            toks = [token_hash(kind, value) for kind, value in tokens(piece.text)]
            for into, found in ((delta.grams, grams), (delta.tokens, toks)):
                if label == "untrusted":
                    into.update(dict.fromkeys(found, label))
                else:
                    for h in found:
                        into.setdefault(h, label)
        return delta

    @property
    def empty(self) -> bool:
        return not (self.untrusted or self.secret or self.overflow or self.lost)

    def labels(self) -> set[str]:
        """The labels its fingerprints carry."""
        if self.untrusted and not self.secret:
            return {"untrusted"} if self.grams or self.tokens else set()
        return set(self.grams.values()) | set(self.tokens.values())

    def fields(self, label: str) -> dict[bytes, bytes]:
        """The fingerprint fields of one label, each pointing at this delta's source id."""
        sid = source_id(label, self.source)
        if self.labels() == {label}:
            out = dict.fromkeys(self.tokens, sid)
            out.update(dict.fromkeys(self.grams, sid))
            return out
        out = {h: sid for h, lab in self.tokens.items() if lab == label}
        out.update((h, sid) for h, lab in self.grams.items() if lab == label)
        return out

    def meta(self, n: int, window: int = DEFAULT_WINNOW) -> dict[bytes, bytes]:
        """The flag and source fields this delta sets in the run's meta hash."""
        out: dict[bytes, bytes] = {}
        present = self.labels()
        for label, on in (("untrusted", self.untrusted), ("secret", self.secret)):
            if on or label in present:
                out[label[0].encode()] = b"1"
                out[b"src:" + source_id(label, self.source)] = f"{label}|{self.source}".encode()
        if out:
            out[b"n:" + _scheme(n, window).encode()] = b"1"
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
    pending: dict[str, float] = field(default_factory=dict)  # decision id -> deadline (epoch)
    sources: dict[bytes, str] = field(default_factory=dict)  # source id -> "<label>|<source>"
    schemes: set[str] = field(default_factory=set)  # every (min_match, winnow) it was built with
    window: int = DEFAULT_WINNOW
    fingerprints: dict[bytes, bytes] = field(default_factory=dict)

    @classmethod
    def from_meta(cls, n: int, meta: Mapping[bytes, bytes], window: int = DEFAULT_WINNOW) -> Ledger:
        ledger = cls(n, untrusted=b"u" in meta, secret=b"s" in meta, overflow=b"o" in meta,
                     lost=b"l" in meta, window=window)
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

    def coarse(self, now: float, n: int, window: int | None = None) -> str | None:
        """Why every free-text argument counts as matching, or None."""
        if self.overflow:
            return "the run's ledger reached its size cap"
        if self.schemes - {_scheme(n, self.window if window is None else window)}:
            return (f"the run's ledger was built with another min_match or winnow than the policy's "
                    f"({n}, {self.window if window is None else window})")
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

    def first_source(self, label: str) -> str | None:
        prefix = f"{label}|"
        return next((s[len(prefix):] for s in sorted(self.sources.values()) if s.startswith(prefix)), None)

    # -- writing (in memory: tests and the corpus) ---------------------------------------------

    def merge(self, delta: LedgerDelta, cap: int) -> None:
        """Add a delta as the store would (untrusted fingerprints replace, secret ones do not;
        new fingerprints beyond `cap` are left out and the ledger overflows)."""
        for key, value in delta.meta(self.n, self.window).items():
            if key.startswith(b"src:"):
                self.sources[key[4:]] = value.decode()
        self.untrusted |= delta.untrusted
        self.secret |= delta.secret
        self.overflow |= delta.overflow
        for label, replace in (("untrusted", True), ("secret", False)):
            for key, sid in delta.fields(label).items():
                if key in self.fingerprints:
                    if replace:
                        self.fingerprints[key] = sid
                elif len(self.fingerprints) >= cap:
                    self.overflow = True
                else:
                    self.fingerprints[key] = sid


# Store layout, per run: the hash `ledger`/<run> holds the flags (`u`, `s`, `o`), one `n:<N>`
# per min_match used, `src:<id>` -> "<label>|<source>" and the pending markers `p:<decision>`
# -> deadline; the hash `ledger_fp`/<run> holds fingerprint -> source id. Both expire
# `ledger_ttl` after the run's last recorded output. Flags only ever get set, fingerprints only
# ever get added: concurrent writers never conflict, so no compare-and-set is needed.
META_NS = NS
FP_NS = "ledger_fp"


async def load(store: Store, run_id: str, n: int, probes: Iterable[bytes] = (),
               window: int = DEFAULT_WINNOW) -> Ledger | None:
    """The run's flags and the fingerprints among `probes` it holds, or None when the run has
    no ledger. Two store round trips at most; cost follows the probes, not the ledger."""
    meta = await store.hash_all(META_NS, run_id)
    if not meta:
        return None
    ledger = Ledger.from_meta(n, meta, window)
    wanted = list(dict.fromkeys(probes))
    if wanted and (ledger.untrusted or ledger.secret):
        values = await store.hash_get(FP_NS, run_id, wanted)
        ledger.fingerprints = {k: v for k, v in zip(wanted, values, strict=True) if v is not None}
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

    def _entry(self, store: Store, run_id: str, ttl: float) -> set[bytes] | None:
        entry = self._runs(store).get(run_id)
        if entry is None or time.monotonic() - entry[0] > min(self.window, ttl / 10):
            return None
        return entry[1]

    def fresh(self, store: Store, run_id: str, ttl: float) -> bool:
        return self._entry(store, run_id, ttl) is not None

    def covers(self, store: Store, run_id: str, digests: Iterable[bytes], ttl: float) -> bool:
        seen = self._entry(store, run_id, ttl)
        return seen is not None and all(d in seen for d in digests)

    def refreshed(self, store: Store, run_id: str, digests: Iterable[bytes], ttl: float) -> None:
        """Both hashes of the run were just written with expiry `ttl`, holding `digests`."""
        seen = self._entry(store, run_id, ttl)
        if seen is None:
            seen = set()
        seen.update(digests)
        runs = self._runs(store)
        runs[run_id] = (time.monotonic(), seen)
        runs.move_to_end(run_id)
        while len(runs) > self.size:
            runs.popitem(last=False)

    def forget(self, store: Store, run_id: str) -> None:
        self._runs(store).pop(run_id, None)


RECENT = RecentWrites()


def _digest(kind: bytes, fields: Mapping[bytes, bytes]) -> bytes:
    h = hashlib.blake2b(kind, digest_size=16)
    for k, v in fields.items():
        h.update(k)
        h.update(v)
    return h.digest()


async def run_flags(store: Store, run_id: str) -> tuple[bool, bool]:
    """(tainted, secret) of a run: whether it has read untrusted content (or an output may have
    reached it unrecorded) and whether it has read secret content. One store read. Raises
    StoreError when the store cannot answer."""
    meta = await store.hash_all(META_NS, run_id)
    return (b"u" in meta or b"l" in meta), b"s" in meta


async def mark_pending(store: Store, run_id: str, decision_id: str, deadline: float, *,
                       ttl: float) -> None:
    """Say that an output of the run is on its way (cleared by `record`). Both hashes get the
    same expiry, unless this process refreshed them moments ago (then the expiry stays)."""
    marker = {b"p:" + decision_id.encode(): repr(deadline).encode()}
    if RECENT.fresh(store, run_id, ttl):
        await store.hash_put(META_NS, run_id, marker)
        return
    await store.hash_put(META_NS, run_id, marker, ttl=ttl)
    await store.hash_put(FP_NS, run_id, {}, ttl=ttl)
    RECENT.forget(store, run_id)


async def record(store: Store, run_id: str, delta: LedgerDelta, *, n: int, cap: int, ttl: float,
                 done: str | None = None, window: int = DEFAULT_WINNOW) -> None:
    """Add a delta to the run's ledger, then clear the pending marker `done`. The fingerprints
    go in first and the marker goes last, so an interruption leaves the run coarse (fail
    closed). Both hashes get the same expiry: flags that outlived their fingerprints would
    narrow verdicts. What this process wrote moments ago is not written again (`RECENT`).
    Raises StoreError when the store cannot answer."""
    meta = delta.meta(n, window)
    parts = [(label, replace, delta.fields(label)) for label, replace in (("untrusted", True), ("secret", False))]
    parts = [part for part in parts if part[2]]
    digests = [_digest(label.encode(), fields) for label, _, fields in parts]
    if meta or parts:
        digests.append(_digest(b"meta", meta))
        if not RECENT.covers(store, run_id, digests, ttl):
            RECENT.forget(store, run_id)
            for _, replace, fields in parts:
                put = await store.hash_put(FP_NS, run_id, fields, ttl=ttl, replace=replace, cap=cap)
                if put.refused:
                    meta[b"o"] = b"1"
            if not parts:
                await store.hash_put(FP_NS, run_id, {}, ttl=ttl)
            await store.hash_put(META_NS, run_id, meta, ttl=ttl)
            if b"o" not in meta:  # an overflowing output is written again next time
                RECENT.refreshed(store, run_id, digests, ttl)
    if done is not None:
        await store.hash_delete(META_NS, run_id, [b"p:" + done.encode()])


async def widen_parent(store: Store, parent_run_id: str, delta: LedgerDelta, *,
                       n: int, cap: int = 65536, ttl: float = 24 * 3600.0,
                       window: int = DEFAULT_WINNOW) -> None:
    """Widen (never narrow) a parent run's ledger with a child's delta.

    For run lineage: call it for each ancestor that should inherit a child's taint. Raises
    StoreError when the store cannot answer (the caller fails closed).
    """
    await record(store, parent_run_id, delta, n=n, cap=cap, ttl=ttl, window=window)


# -- arguments ------------------------------------------------------------------------------------


def _constrained(schema: Any, skip_formats: frozenset[str]) -> bool:
    """Whether a schema leaves no room for an attacker's text (enum, boolean, bounded number,
    a skipped format, a short maxLength)."""
    if not isinstance(schema, Mapping):
        return False
    if "enum" in schema or "const" in schema:
        return True
    kind = schema.get("type")
    if kind == "boolean":
        return True
    if kind in ("number", "integer"):
        return (("minimum" in schema or "exclusiveMinimum" in schema)
                and ("maximum" in schema or "exclusiveMaximum" in schema))
    if schema.get("format") in skip_formats:
        return True
    max_len = schema.get("maxLength")
    return isinstance(max_len, int) and max_len < MIN_TOKEN


def _escape(seg: str) -> str:
    return seg.replace("~", "~0").replace("/", "~1")


def free_text(value: Any, schema: Any, skip_formats: frozenset[str], ptr: str = "",
              depth: int = 0) -> Iterator[tuple[str, str]]:
    """(JSON pointer, text) of every argument value that can carry an attacker's text."""
    if depth > MAX_DEPTH or _constrained(schema, skip_formats):
        return
    sch = schema if isinstance(schema, Mapping) else {}
    if isinstance(value, str):
        yield ptr, value
    elif isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 10 ** (MIN_TOKEN - 1):
            yield ptr, str(value)
    elif isinstance(value, Mapping):
        found = sch.get("properties")
        props: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        extra = sch.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k, extra if isinstance(extra, Mapping) else None)
            yield from free_text(v, sub, skip_formats, f"{ptr}/{_escape(str(k))}", depth + 1)
    elif isinstance(value, list):
        items = sch.get("items")
        for i, v in enumerate(value):
            yield from free_text(v, items, skip_formats, f"{ptr}/{i}", depth + 1)


def _snippet(text: str) -> str:
    return text if len(text) <= SNIPPET else text[: SNIPPET - 1] + "…"


@dataclass(frozen=True, slots=True)
class Finding:
    """One piece of evidence: which argument, what matched, from which tool."""

    kind: str  # verbatim | token | trifecta | coarse
    argument: str | None
    source: str
    snippet: str

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "argument": self.argument, "source": self.source,
                "snippet": self.snippet}

    def describe(self) -> str:
        arg = f"argument '{self.argument}'" if self.argument else "the call"
        if self.kind == "verbatim":
            return f"{arg} copies untrusted text from {self.source} verbatim: {self.snippet!r}"
        if self.kind == "token":
            return f"{arg} carries {self.snippet!r}, lifted from untrusted output of {self.source}"
        if self.kind == "coarse":
            return f"{arg} may carry untrusted content: {self.snippet}"
        return (f"the run holds untrusted content and secret content (from {self.source}); a "
                "sink may not fire (lethal trifecta)")


@dataclass(slots=True)
class Probe:
    """One argument value, fingerprinted the way outputs are: what to ask the ledger for."""

    norm: str
    grams: list[bytes]  # every gram, in order (outputs keep only winnowed ones)
    tokens: list[tuple[str, str, bytes]]  # (kind, value, fingerprint)
    k: int = 0  # gram length

    @classmethod
    def of(cls, text: str, n: int, window: int = DEFAULT_WINNOW) -> Probe:
        norm = normalise(text)
        return cls(norm, gram_hashes(norm, n, window),
                   [(k, v, token_hash(k, v)) for k, v in sorted(tokens(text))], gram_length(n, window))

    def fields(self) -> Iterator[bytes]:
        for _, _, h in self.tokens:
            yield h
        yield from self.grams


def match_argument(ledger: Ledger, text: str | Probe, n: int,
                   window: int = DEFAULT_WINNOW) -> tuple[list[Finding], list[Finding]]:
    """(untrusted verbatim findings, untrusted token findings) of one argument value (its
    pointer is filled in by the caller). Secret-only matches are not findings. Kept grams of a
    copied run lie at most `window` grams apart: hits that close are one run of evidence."""
    probe = text if isinstance(text, Probe) else Probe.of(text, n, window)
    k = probe.k or gram_length(n, window)
    verbatim: list[Finding] = []
    hits = [(i, found) for i, h in enumerate(probe.grams) if (found := ledger.find(h)) is not None]
    start = 0
    while start < len(hits):
        end = start
        while end + 1 < len(hits) and hits[end + 1][0] - hits[end][0] <= window:
            end += 1
        source = next((f for _, f in hits[start: end + 1] if f.startswith("untrusted|")), None)
        if source is not None:
            first, last = hits[start][0], hits[end][0]
            verbatim.append(Finding("verbatim", None, source.partition("|")[2],
                                    _snippet(probe.norm[first: last + k])))
        start = end + 1
    toks: list[Finding] = []
    for _, value, h in probe.tokens:
        found = ledger.find(h)
        if found is not None and found.startswith("untrusted|"):
            toks.append(Finding("token", None, found.partition("|")[2], _snippet(value)))
    return verbatim, toks


# -- the check ------------------------------------------------------------------------------------


class DataflowCheck:
    """Flags sinks fed with untrusted content; records labelled outputs into the run's ledger."""

    id: ClassVar[str] = "dataflow"

    def __init__(self, revision: PolicyRevision, registry: ToolRegistry,
                 services: Services | None = None):
        self._revision = revision
        self._registry = registry
        self._services = services
        policy = revision.document.dataflow
        # No `dataflow:` section: shadow (flows are tracked, flagged, audited and counted, never
        # refused). Its cost is measured in bench/RESULTS.md; `mode: off` turns it off.
        self.policy: DataflowPolicy = policy if policy is not None else DataflowPolicy(mode="shadow")
        self.mode = self.policy.mode
        self._n = self.policy.min_match
        self._window = self.policy.winnow
        self._skip = frozenset(self.policy.skip_formats)
        self._ttl = self.policy.ledger_ttl
        self._cap = self.policy.ledger_cap
        self._trust = {name: up.trust_annotations for name, up in revision.document.upstreams.items()}
        self._labels: dict[tuple[str, bool, Any], OutputLabels] = {}
        self._timeouts = {name: up.timeout for name, up in revision.document.upstreams.items()}
        self._store: Store | None = services.store if services is not None else None
        approvals = getattr(services.settings, "approvals", None) if services is not None else None
        self._gate = self._store is not None and bool(getattr(approvals, "enabled", True))

    # -- cheap filters -------------------------------------------------------------------

    def labels(self, call: ToolCall) -> OutputLabels:
        """The output labels of the call's tool (cached per tool and annotation hint: they
        depend on nothing else)."""
        trust = self._trust.get(call.upstream, False)
        info = call.upstream_tool
        key = (call.qualified_name, info is None, trust and info is not None and annotation(info, "openWorldHint"))
        found = self._labels.get(key)
        if found is None:
            compiled = self._revision.tools.get(call.qualified_name)
            found = output_labels(compiled.policy if compiled is not None else None, info, trust)
            if len(self._labels) < 10_000:
                self._labels[key] = found
        return found

    def applies(self, call: ToolCall) -> bool:
        if self.mode == "off":
            return False
        return call.effect is not Effect.READ or self.labels(call).tracked

    def _declassified(self, call: ToolCall) -> bool | frozenset[str]:
        entry = self.policy.declassify.get(call.qualified_name)
        if entry is True:
            return True
        if isinstance(entry, list):
            return frozenset(entry)
        return False

    def _on_flag(self, call: ToolCall) -> str:
        return self.policy.on_flag.get(call.qualified_name) or self.policy.on_flag.get("default", "block")

    def _schema(self, call: ToolCall) -> Any:
        compiled = self._revision.tools.get(call.qualified_name)
        if compiled is not None and compiled.policy.input_schema is not None:
            return compiled.policy.input_schema
        return call.upstream_tool.input_schema if call.upstream_tool is not None else None

    # -- deciding ------------------------------------------------------------------------

    async def decide(self, call: ToolCall) -> Decision | None:
        """None to continue (clean, shadow-flagged, or escalated to approval); a refusal
        `dataflow_policy_blocked` for a flagged sink in enforce mode. Without a store (or with a
        failing one) enforce refuses sinks (`misconfigured` / `store_unavailable`); shadow
        audits `dataflow_error` and continues."""
        sink = call.effect is not Effect.READ
        labels = self.labels(call)
        store = self._store
        if store is None:
            if self.mode == "enforce" and sink:
                return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                                "the data-flow check is enforced but no state store is configured "
                                "for the run ledgers; sinks are refused", "dataflow.mode")
            call.audit_extra["dataflow_error"] = "no state store: flows are not tracked"
            return None
        try:
            decision = await self._check_sink(store, call) if sink else None
            if decision is None and labels.tracked:
                if call.run.session:
                    # A session's stream may be resumed past the proxy (GET + Last-Event-ID)
                    # if the client drops it: say beforehand that an output is on its way.
                    deadline = time.time() + self._timeouts.get(call.upstream, 30.0) + PENDING_GRACE
                    await mark_pending(store, call.run.id, call.decision_id, deadline, ttl=self._ttl)
                call.on_result.append(self._recorder(store, labels))
            return decision
        except (StoreError, TimeoutError) as exc:
            if self.mode == "shadow":
                call.audit_extra["dataflow_error"] = f"state store unavailable: {exc}"
                return None
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"the state store cannot answer for the run's data-flow ledger ({exc or 'timed out'}); "
                            "sinks are refused until it can")

    def probes(self, call: ToolCall) -> list[tuple[str, Probe]]:
        """(JSON pointer, probe) of every argument of a sink that can carry an attacker's text."""
        return [(ptr, Probe.of(text, self._n, self._window))
                for ptr, text in free_text(call.arguments, self._schema(call), self._skip)]

    def findings(self, call: ToolCall, ledger: Ledger,
                 probes: list[tuple[str, Probe]] | None = None) -> tuple[list[Finding], list[Finding]]:
        """(flagging findings, declassified flows) of a sink call against a run's ledger."""
        flagged: list[Finding] = []
        declassified: list[Finding] = []
        decl = self._declassified(call)
        coarse = ledger.coarse(time.time(), self._n, self._window)
        for ptr, probe in self.probes(call) if probes is None else probes:
            top = ptr[1:].split("/", 1)[0].replace("~1", "/").replace("~0", "~")
            is_decl = decl is True or (isinstance(decl, frozenset) and top in decl)
            verbatim, toks = match_argument(ledger, probe, self._n, self._window)
            flagged += [dataclasses.replace(f, argument=ptr) for f in toks]
            if is_decl:
                declassified += [dataclasses.replace(f, argument=ptr) for f in verbatim]
            else:
                flagged += [dataclasses.replace(f, argument=ptr) for f in verbatim]
                if coarse and not verbatim and len(probe.norm) >= self._n:
                    flagged.append(Finding("coarse", ptr, "this run", coarse))
        if ledger.untrusted and ledger.secret:
            flagged.append(Finding("trifecta", None, ledger.first_source("secret") or "a secret tool", ""))
        return flagged, declassified

    async def _check_sink(self, store: Store, call: ToolCall) -> Decision | None:
        probes = self.probes(call)
        ledger = await load(store, call.run.id, self._n,
                            (f for _, probe in probes for f in probe.fields()), self._window)
        if ledger is None:
            return None
        flagged, declassified = self.findings(call, ledger, probes)
        if declassified:
            call.audit_extra["dataflow_declassified"] = [f.as_dict() for f in declassified]
        if not flagged:
            return None
        evidence = [f.as_dict() for f in flagged]
        reason = "data flow: " + "; ".join(f.describe() for f in flagged[:3])
        if len(flagged) > 3:
            reason += f" (and {len(flagged) - 3} more)"
        rule = f"dataflow.{flagged[0].kind}"
        metrics = self._services.metrics if self._services is not None else None
        if metrics is not None and hasattr(metrics, "dataflow_flagged"):
            known = call.qualified_name in self._revision.tools or call.upstream_tool is not None
            metrics.dataflow_flagged(call.tool if known else "<unknown>", self.mode)
        audit: dict[str, Any] = {"flagged": True, "mode": self.mode, "rule": rule,
                                 "evidence": evidence}
        if self.mode == "shadow":
            call.audit_extra["dataflow"] = audit
            return None
        if self._on_flag(call) == "approve":
            if self._gate:
                audit["on_flag"] = "approve"
                call.audit_extra["dataflow"] = audit
                call.escalation = f"{reason} (dataflow.on_flag approve)"
                return None
            reason += " (on_flag approve, but no approval gate is configured)"
        return Decision(Verdict.DENY, Code.DATAFLOW_POLICY_BLOCKED, self.id, reason, rule,
                        audit={"dataflow": {**audit, "on_flag": "block"}})

    # -- recording -----------------------------------------------------------------------

    def _recorder(self, store: Store, labels: OutputLabels) -> ResultHook:
        n, window, ttl, cap, mode = self._n, self._window, self._ttl, self._cap, self.mode

        async def hook(call: ToolCall, decision: Decision, reply: Mapping[str, Any] | None) -> None:
            """Record the output before it reaches the agent. When it cannot be recorded, the
            result is withheld (enforce; shadow audits `dataflow_error` and lets it through). A
            call allowed but finished without a result (a resumable stream the client dropped)
            may still reach the agent by resumption, past the proxy: the run goes coarse."""
            result: Any = reply.get("result") if isinstance(reply, Mapping) else None
            if result is None and decision.code is Code.REPLAYED:
                result = decision.result
            delta = LedgerDelta(call.qualified_name)
            if isinstance(result, Mapping):
                delta = LedgerDelta.of(call.qualified_name, pieces(result, labels), n, limit=cap,
                                       window=window)
            elif reply is None and decision.verdict is Verdict.ALLOW and decision.code is Code.OK:
                delta = LedgerDelta(call.qualified_name, untrusted=labels.base.untrusted,
                                    secret=labels.base.secret, lost=True)
            try:
                await record(store, call.run.id, delta, n=n, cap=cap, ttl=ttl, window=window,
                             done=call.decision_id if call.run.session else None)
                if not delta.empty:
                    for ancestor in _ancestors(call):
                        await widen_parent(store, ancestor, delta, n=n, cap=cap, ttl=ttl, window=window)
            except (StoreError, TimeoutError) as exc:
                # A session's pending marker stays: past its deadline the run counts as coarse.
                log.error("data-flow ledger of run %s not updated: %s", call.run.id, exc)
                call.audit_extra["dataflow_error"] = f"ledger not updated: {exc}"
                if mode == "enforce" and isinstance(result, Mapping) and not delta.empty:
                    raise ResultWithheld(Decision(
                        Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                        f"the run's data-flow ledger cannot record this {'untrusted' if delta.untrusted else 'secret'} "
                        f"output ({exc or 'timed out'}); the result is withheld")) from exc
                return
            if delta.untrusted or delta.secret:
                call.audit_extra["dataflow_recorded"] = {
                    "untrusted": delta.untrusted, "secret": delta.secret,
                    "fingerprints": len(delta.grams) + len(delta.tokens),
                    **({"overflow": True} if delta.overflow else {}),
                    **({"lost": True} if delta.lost else {})}

        return hook


def _ancestors(call: ToolCall) -> tuple[str, ...]:
    """Runs whose ledgers a call's output widens besides its own: `run.taint_targets` when the
    lineage layer sets it (already filtered by `propagate_taint`), else the direct parent."""
    targets = getattr(call.run, "taint_targets", None)
    if targets is not None:
        return tuple(targets)
    return (call.run.parent,) if call.run.parent else ()
