"""Data-flow check: untrusted content must not steer a sink (DESIGN section 2, check 7).

Per run, a **ledger** in the store (namespace `ledger`, key `<run id>`, TTL `ledger_ttl`)
holds fingerprints of the untrusted and secret content the run has read: hashes of every
normalised character n-gram of length `min_match` (N), and hashes of distinctive tokens
(e-mail addresses, URLs and domains, account-number-like digit runs, IBANs; normalised, at least
8 characters). Both are sorted arrays: a lookup is a binary search, so checking a call costs
O(size of its arguments x log ledger), never a scan of the ledger. The ledger also keeps the
run's coarse flags: untrusted, secret, and overflowed (the cap `ledger_cap` was reached: later
content is not fingerprinted, and every free-text sink argument counts as matching: eviction
widens a verdict, never narrows it).

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
gate with the evidence (`ToolCall.escalation`). No `dataflow:` section: off.

Recording: for a call whose output can be untrusted or secret, the check first writes a pending
marker into the run's ledger, then a result hook adds the output's fingerprints and clears the
marker. A marker left past its deadline (the hook failed, the process died) makes the run coarse
(fail closed: content the agent may have seen was not fingerprinted).

Fail closed: in enforce mode a sink with no store refuses `misconfigured` and a store error
refuses `store_unavailable`; in shadow mode both are audited (`dataflow_error`) and the call
continues.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import heapq
import logging
import re
import time
import unicodedata
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from proxy.envelope.call import (
    Code,
    Decision,
    Effect,
    ResultHook,
    Services,
    ToolCall,
    Verdict,
)
from proxy.envelope.labels import OutputLabels, Piece, output_labels, pieces
from proxy.envelope.tools import ToolRegistry
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import DataflowPolicy
from proxy.store.base import Store

NS = "ledger"
SNIPPET = 80  # evidence snippets are truncated to this many characters
MIN_TOKEN = 8  # shortest distinctive token
CAS_ATTEMPTS = 16
PENDING_GRACE = 30.0  # seconds past the upstream timeout before a pending marker counts as lost
MAX_SOURCES = 255  # source table size (one byte per fingerprint); beyond: "several tools"
MAX_DEPTH = 32

log = logging.getLogger("envelope.dataflow")

# -- normalisation and fingerprints ------------------------------------------------------------

_WS = re.compile(r"\s+")
_P = (1 << 61) - 1  # Mersenne prime modulus of the rolling hash (stable across processes)
_B = 1_000_003


def normalise(text: str) -> str:
    """Case-folded, NFKC, whitespace runs collapsed to one space, stripped."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def gram_hashes(norm: str, n: int) -> list[int]:
    """Rolling (Rabin-Karp) hashes of every n-character window of a normalised string."""
    if len(norm) < n:
        return []
    top = pow(_B, n - 1, _P)
    h = 0
    out: list[int] = []
    codes = [ord(c) for c in norm]
    for i, c in enumerate(codes):
        if i >= n:
            h = (h - codes[i - n] * top) % _P
        h = (h * _B + c) % _P
        if i >= n - 1:
            out.append(h)
    return out


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
    low = unicodedata.normalize("NFKC", text).casefold()
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


def token_hash(kind: str, value: str) -> int:
    digest = hashlib.blake2b(f"{kind}:{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# -- the ledger ---------------------------------------------------------------------------------


@dataclass(slots=True)
class LedgerDelta:
    """What one tool output adds to a run's ledger (also what widens a parent's ledger)."""

    source: str  # "<upstream>.<tool>"
    untrusted: bool = False
    secret: bool = False
    # hash -> "untrusted" | "secret" (untrusted wins when both)
    grams: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, str] = field(default_factory=dict)
    overflow: bool = False

    @classmethod
    def of(cls, source: str, parts: Iterable[Piece], n: int) -> LedgerDelta:
        delta = cls(source)
        for piece in parts:
            label = "untrusted" if piece.label.untrusted else "secret"
            delta.untrusted |= piece.label.untrusted
            delta.secret |= piece.label.secret
            for h in gram_hashes(normalise(piece.text), n):
                if delta.grams.get(h) != "untrusted":
                    delta.grams[h] = label
            for kind, value in tokens(piece.text):
                h = token_hash(kind, value)
                if delta.tokens.get(h) != "untrusted":
                    delta.tokens[h] = label
        return delta

    @property
    def empty(self) -> bool:
        return not (self.untrusted or self.secret or self.overflow)


def _b64(a: array[int]) -> str:
    return base64.b64encode(a.tobytes()).decode()


def _unb64(s: str, code: str) -> array[int]:
    a = array(code)
    a.frombytes(base64.b64decode(s))
    return a


@dataclass(slots=True)
class Ledger:
    """One run's ledger: coarse flags, pending markers and sorted fingerprint arrays."""

    n: int
    untrusted: bool = False
    secret: bool = False
    overflow: bool = False
    pending: dict[str, float] = field(default_factory=dict)  # decision id -> deadline (epoch)
    sources: list[str] = field(default_factory=list)  # "<label>|<upstream>.<tool>"
    grams: array[int] = field(default_factory=lambda: array("Q"))
    gram_src: array[int] = field(default_factory=lambda: array("B"))
    toks: array[int] = field(default_factory=lambda: array("Q"))
    tok_src: array[int] = field(default_factory=lambda: array("B"))

    # -- encoding ------------------------------------------------------------------------

    def dumps(self) -> bytes:
        return orjson.dumps({
            "v": 1, "n": self.n, "u": self.untrusted, "s": self.secret, "o": self.overflow,
            "p": self.pending, "src": self.sources,
            "g": _b64(self.grams), "gs": _b64(self.gram_src),
            "t": _b64(self.toks), "ts": _b64(self.tok_src),
        })

    @classmethod
    def loads(cls, raw: bytes) -> Ledger:
        d = orjson.loads(raw)
        return cls(
            n=int(d["n"]), untrusted=bool(d["u"]), secret=bool(d["s"]), overflow=bool(d["o"]),
            pending={str(k): float(v) for k, v in d.get("p", {}).items()},
            sources=list(d.get("src", [])),
            grams=_unb64(d["g"], "Q"), gram_src=_unb64(d["gs"], "B"),
            toks=_unb64(d["t"], "Q"), tok_src=_unb64(d["ts"], "B"),
        )

    # -- reading -------------------------------------------------------------------------

    def coarse(self, now: float, n: int) -> str | None:
        """Why every free-text argument counts as matching, or None."""
        if self.overflow:
            return "the run's ledger reached its size cap"
        if self.n != n and (self.untrusted or self.secret):
            return f"the run's ledger was built with min_match {self.n}, the policy now says {n}"
        if any(deadline < now for deadline in self.pending.values()):
            return "an untrusted output of the run was not fingerprinted (its result was lost)"
        return None

    def _find(self, keys: array[int], srcs: array[int], h: int) -> str | None:
        i = bisect_left(keys, h)
        if i < len(keys) and keys[i] == h:
            return self.sources[srcs[i]] if srcs[i] < len(self.sources) else "untrusted|several tools"
        return None

    def gram(self, h: int) -> str | None:
        """The "<label>|<source>" of a gram hash, or None."""
        return self._find(self.grams, self.gram_src, h)

    def token(self, h: int) -> str | None:
        return self._find(self.toks, self.tok_src, h)

    # -- writing -------------------------------------------------------------------------

    def _source(self, label: str, source: str) -> int:
        key = f"{label}|{source}"
        try:
            return self.sources.index(key)
        except ValueError:
            if len(self.sources) >= MAX_SOURCES:
                return MAX_SOURCES  # "several tools"
            self.sources.append(key)
            return len(self.sources) - 1

    def merge(self, delta: LedgerDelta, cap: int) -> None:
        """Add a delta (flags ORed, fingerprints unioned up to `cap`; beyond it: overflow)."""
        self.untrusted |= delta.untrusted
        self.secret |= delta.secret
        self.overflow |= delta.overflow
        # Sources are named even without fingerprints (a short secret still names its tool).
        labels = set(delta.grams.values()) | set(delta.tokens.values())
        labels |= {lab for lab, on in (("untrusted", delta.untrusted), ("secret", delta.secret)) if on}
        index = {label: self._source(label, delta.source) for label in sorted(labels)}
        room = cap - len(self.grams) - len(self.toks)
        for attr_keys, attr_src, new in (("toks", "tok_src", delta.tokens),
                                         ("grams", "gram_src", delta.grams)):
            keys: array[int] = getattr(self, attr_keys)
            srcs: array[int] = getattr(self, attr_src)
            fresh = sorted(h for h in new if self._find(keys, srcs, h) is None)
            if len(fresh) > room:
                self.overflow = True
                fresh = sorted(fresh[:max(room, 0)])
            room -= len(fresh)
            if not fresh:
                continue
            merged_k: array[int] = array("Q")
            merged_s: array[int] = array("B")
            old = zip(keys, srcs, strict=True)
            add = ((h, index[new[h]]) for h in fresh)
            for h, s in heapq.merge(old, add):
                merged_k.append(h)
                merged_s.append(s)
            setattr(self, attr_keys, merged_k)
            setattr(self, attr_src, merged_s)

    def absorb(self, other: Ledger, cap: int) -> None:
        """Merge another run's whole ledger into this one (widening a parent)."""
        self.overflow |= other.overflow or other.n != self.n
        for src_idx, key in enumerate([*other.sources, "untrusted|several tools"]):
            label, _, source = key.partition("|")
            delta = LedgerDelta(source, untrusted=other.untrusted, secret=other.secret)
            delta.grams = {h: label for h, s in zip(other.grams, other.gram_src, strict=True)
                           if s == src_idx}
            delta.tokens = {h: label for h, s in zip(other.toks, other.tok_src, strict=True)
                            if s == src_idx}
            self.merge(delta, cap)
        self.untrusted |= other.untrusted
        self.secret |= other.secret


async def load(store: Store, run_id: str) -> Ledger | None:
    """The run's ledger, or None. Raises StoreError when the store cannot answer."""
    raw = await store.get(NS, run_id)
    return Ledger.loads(raw) if raw is not None else None


async def update(store: Store, run_id: str, n: int, change: Any, *, ttl: float) -> Ledger:
    """Apply `change(ledger)` to the run's ledger atomically (add / compare-and-set loop).

    Raises StoreError when the store fails or the ledger keeps changing under us.
    """
    for _ in range(CAS_ATTEMPTS):
        raw = await store.get(NS, run_id)
        ledger = Ledger.loads(raw) if raw is not None else Ledger(n)
        change(ledger)
        new = ledger.dumps()
        if raw is None:
            if await store.add(NS, run_id, new, ttl=ttl):
                return ledger
        elif await store.cas(NS, run_id, raw, new, ttl=ttl):
            return ledger
    raise StoreError(f"the ledger of run {run_id!r} kept changing; update abandoned")


async def widen_parent(store: Store, parent_run_id: str, delta: LedgerDelta | Ledger, *,
                       n: int, cap: int = 65536, ttl: float = 24 * 3600.0) -> None:
    """Widen (never narrow) a parent run's ledger with a child's delta or whole ledger.

    For run lineage: call it for each ancestor that should inherit a child's taint. Raises
    StoreError when the store cannot answer (the caller fails closed).
    """
    def change(ledger: Ledger) -> None:
        if isinstance(delta, Ledger):
            ledger.absorb(delta, cap)
        else:
            ledger.merge(delta, cap)
    await update(store, parent_run_id, n, change, ttl=ttl)


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


def match_argument(ledger: Ledger, text: str, n: int) -> tuple[list[Finding], list[Finding]]:
    """(untrusted verbatim findings, untrusted token findings) of one argument value (its
    pointer is filled in by the caller). Secret-only matches are not findings."""
    verbatim: list[Finding] = []
    norm = normalise(text)
    hashes = gram_hashes(norm, n)
    i = 0
    while i < len(hashes):
        hit = ledger.gram(hashes[i])
        if hit is None or not hit.startswith("untrusted|"):
            i += 1
            continue
        j = i
        while j + 1 < len(hashes) and ledger.gram(hashes[j + 1]) is not None:
            j += 1
        verbatim.append(Finding("verbatim", None, hit.partition("|")[2],
                                _snippet(norm[i: j + n])))
        i = j + 1
    toks: list[Finding] = []
    for kind, value in sorted(tokens(text)):
        hit = ledger.token(token_hash(kind, value))
        if hit is not None and hit.startswith("untrusted|"):
            toks.append(Finding("token", None, hit.partition("|")[2], _snippet(value)))
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
        # No `dataflow:` section: the check is off. Tracking costs store round trips on every
        # untrusted read (measured in bench/RESULTS.md), so a policy opts in explicitly.
        self.policy: DataflowPolicy = policy if policy is not None else DataflowPolicy(mode="off")
        self.mode = self.policy.mode
        self._n = self.policy.min_match
        self._skip = frozenset(self.policy.skip_formats)
        self._ttl = self.policy.ledger_ttl
        self._cap = self.policy.ledger_cap
        self._trust = {name: up.trust_annotations for name, up in revision.document.upstreams.items()}
        self._timeouts = {name: up.timeout for name, up in revision.document.upstreams.items()}
        self._store: Store | None = services.store if services is not None else None
        approvals = getattr(services.settings, "approvals", None) if services is not None else None
        self._gate = self._store is not None and bool(getattr(approvals, "enabled", True))

    # -- cheap filters -------------------------------------------------------------------

    def labels(self, call: ToolCall) -> OutputLabels:
        compiled = self._revision.tools.get(call.qualified_name)
        return output_labels(compiled.policy if compiled is not None else None,
                             call.upstream_tool, self._trust.get(call.upstream, False))

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
                deadline = time.time() + self._timeouts.get(call.upstream, 30.0) + PENDING_GRACE
                await update(store, call.run.id, self._n,
                             lambda ledger: ledger.pending.__setitem__(call.decision_id, deadline),
                             ttl=self._ttl)
                call.on_result.append(self._recorder(store, labels))
            return decision
        except (StoreError, TimeoutError) as exc:
            if self.mode == "shadow":
                call.audit_extra["dataflow_error"] = f"state store unavailable: {exc}"
                return None
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"the state store cannot answer for the run's data-flow ledger ({exc or 'timed out'}); "
                            "sinks are refused until it can")

    def findings(self, call: ToolCall, ledger: Ledger) -> tuple[list[Finding], list[Finding]]:
        """(flagging findings, declassified flows) of a sink call against a run's ledger."""
        flagged: list[Finding] = []
        declassified: list[Finding] = []
        decl = self._declassified(call)
        coarse = ledger.coarse(time.time(), self._n)
        for ptr, text in free_text(call.arguments, self._schema(call), self._skip):
            top = ptr[1:].split("/", 1)[0].replace("~1", "/").replace("~0", "~")
            is_decl = decl is True or (isinstance(decl, frozenset) and top in decl)
            verbatim, toks = match_argument(ledger, text, self._n)
            flagged += [dataclasses.replace(f, argument=ptr) for f in toks]
            if is_decl:
                declassified += [dataclasses.replace(f, argument=ptr) for f in verbatim]
            else:
                flagged += [dataclasses.replace(f, argument=ptr) for f in verbatim]
                if coarse and not verbatim and len(normalise(text)) >= self._n:
                    flagged.append(Finding("coarse", ptr, "this run", coarse))
        if ledger.untrusted and ledger.secret:
            secret = next((s.partition("|")[2] for s in ledger.sources if s.startswith("secret|")),
                          "a secret tool")
            flagged.append(Finding("trifecta", None, secret, ""))
        return flagged, declassified

    async def _check_sink(self, store: Store, call: ToolCall) -> Decision | None:
        ledger = await load(store, call.run.id)
        if ledger is None:
            return None
        flagged, declassified = self.findings(call, ledger)
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
        n, ttl, cap = self._n, self._ttl, self._cap

        async def record(call: ToolCall, decision: Decision, reply: Mapping[str, Any] | None) -> None:
            result: Any = reply.get("result") if isinstance(reply, Mapping) else None
            if result is None and decision.code is Code.REPLAYED:
                result = decision.result
            delta = LedgerDelta(call.qualified_name)
            if isinstance(result, Mapping):
                delta = LedgerDelta.of(call.qualified_name, pieces(result, labels), n)

            def change(ledger: Ledger) -> None:
                ledger.pending.pop(call.decision_id, None)
                ledger.merge(delta, cap)

            try:
                await update(store, call.run.id, n, change, ttl=ttl)
                if not delta.empty:
                    for ancestor in _ancestors(call):
                        await widen_parent(store, ancestor, delta, n=n, cap=cap, ttl=ttl)
            except (StoreError, TimeoutError) as exc:
                # The pending marker stays: once past its deadline the run counts as coarse.
                log.error("data-flow ledger of run %s not updated: %s", call.run.id, exc)
                call.audit_extra["dataflow_error"] = f"ledger not updated: {exc}"
                return
            if delta.untrusted or delta.secret:
                call.audit_extra["dataflow_recorded"] = {
                    "untrusted": delta.untrusted, "secret": delta.secret,
                    "fingerprints": len(delta.grams) + len(delta.tokens)}

        return record


def _ancestors(call: ToolCall) -> tuple[str, ...]:
    """Runs whose ledgers a call's output widens besides its own: `run.taint_targets` when the
    lineage layer sets it (already filtered by `propagate_taint`), else the direct parent."""
    targets = getattr(call.run, "taint_targets", None)
    if targets is not None:
        return tuple(targets)
    return (call.run.parent,) if call.run.parent else ()
