"""Data-flow check: untrusted content must not steer a sink (DESIGN section 2, check 8).

See `proxy.envelope.dataflow` for the ledger it reads and writes."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, ClassVar

from proxy.envelope.dataflow import intent as intents
from proxy.envelope.dataflow import offload, waiver
from proxy.envelope.dataflow.criterion import (
    GRID_BITS,
    Criterion,
    bound_condition,
    criterion_key,
    critical_forms,
)
from proxy.envelope.dataflow.endorse import (
    Critical,
    IntentWords,
    critical_values,
    entry_key,
    entry_value_forms,
    id_argument,
    id_label_key,
    id_label_word_key,
    label_key,
    label_word_key,
    name_key,
    name_pick_key,
    names_object,
    pick_key,
    pick_signature_probes,
    picks_one_entry,
)
from proxy.envelope.dataflow.intent import Endorsement, IntentError
from proxy.envelope.dataflow.ledger import (
    Ledger,
    load,
    run_flags,
)
from proxy.envelope.dataflow.match import (
    Finding,
    Probe,
    declassified_findings,
    free_text,
    match_argument,
    oversized,
    value_probes,
)
from proxy.envelope.dataflow.offload import (
    asking_of,
    clause_words_of,
    each_of,
    endorsement_of,
    intent_words_of,
    on_loop,
    probes_of,
    sized,
    whole,
)
from proxy.envelope.effects import gated
from proxy.envelope.labels import OutputLabels, ToolLabels
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import (
    Code,
    Decision,
    Services,
    ToolCall,
    Verdict,
)
from proxy.errors import StoreError
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import DataflowPolicy, escalates
from proxy.policy.vocab import Effect
from proxy.store.base import Store

# Most ledger lookups one call makes for entries of trusted listings picked by the intent.
MAX_PICK_KEYS = 4096
PENDING_GRACE = 30.0  # seconds past the upstream timeout before a pending marker counts as lost

log = logging.getLogger("envelope.dataflow")

# -- the check ------------------------------------------------------------------------------------


class DataflowCheck:
    """Flags sinks fed with untrusted content (the outputs are recorded into the run's ledger
    by the inspection of what the upstream sends: `proxy.envelope.inspect`)."""

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
        self._max_argument = self.policy.max_argument_chars
        self._min_value = self.policy.min_value
        self._labels = ToolLabels(revision)
        self._timeouts = {name: up.timeout for name, up in revision.document.upstreams.items()}
        self._store: Store | None = services.store if services is not None else None
        self._gate = self._store is not None and services is not None and services.settings.approvals.enabled
        self._escalates = escalates(self.policy)

    # -- cheap filters -------------------------------------------------------------------

    def labels(self, call: ToolCall) -> OutputLabels:
        """The output labels of the call's tool."""
        return self._labels.of(call)

    def applies(self, call: ToolCall) -> bool:
        if self.mode == "off":
            return False
        return call.effect is not Effect.READ or self.labels(call).tracked or call.intent is not None

    def _declassified(self, call: ToolCall) -> bool | frozenset[str]:
        entry = self.policy.declassify.get(call.qualified_name)
        if entry is True:
            return True
        if isinstance(entry, list):
            return frozenset(entry)
        return False

    def _on_flag(self, call: ToolCall) -> str:
        return self.policy.on_flag.get(call.qualified_name) or self.policy.on_flag.get("default", "block")

    def _on_tainted(self, call: ToolCall) -> str:
        return self.policy.on_tainted.get(call.qualified_name) or self.policy.on_tainted.get("default", "allow")

    def _tool_label(self, call: ToolCall) -> str:
        """A bounded metric label: the tool's name when the catalogue knows it (as
        `Chain.tool_label`)."""
        known = call.qualified_name in self._revision.tools or call.upstream_tool is not None
        return call.tool if known else "<unknown>"

    def _waives(self, call: ToolCall) -> bool:
        """Whether the call's approval gate may be waived by the intent (`waive_gate: intent`,
        enforce mode, a gated call nothing escalated): `proxy.envelope.dataflow.waiver`."""
        waive = self.policy.waive_gate.get(call.qualified_name) or self.policy.waive_gate.get("default", "never")
        return (waive == "intent" and self.mode == "enforce" and call.escalation is None
                and gated(self._revision, call))

    def criticals(self, call: ToolCall) -> tuple[list[Critical], bool]:
        """The critical values of a sink call (`dataflow.critical`, else every argument that is
        not declassified) and whether some were left out (more than `endorse.MAX_CRITICAL`)."""
        names = self.policy.critical.get(call.qualified_name)
        if names is None:
            decl = self._declassified(call)
            if decl is True:
                return [], False
            names = [k for k in call.arguments if not (isinstance(decl, frozenset) and k in decl)]
        return critical_values(call.arguments, names, call.upstream)

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
        intent: str | None = None
        if call.intent is not None:
            try:
                intent = intents.decode(call.intent, self.policy.max_intent_chars)
            except IntentError as exc:
                # The framework's header is broken: refused in any mode, so the user's words
                # are never silently dropped (the framework sees the refusal and the audit).
                return Decision(Verdict.DENY, Code.INVALID_REQUEST, self.id, f"{exc}; the call was refused",
                                intents.HEADER)
        if store is None:
            if self.mode == "enforce" and sink:
                return Decision(Verdict.ERROR, Code.MISCONFIGURED, self.id,
                                "the data-flow check is enforced but no state store is configured "
                                "for the run ledgers; sinks are refused", "dataflow.mode")
            call.audit_extra["dataflow_error"] = "no state store: flows are not tracked"
            return None
        try:
            if intent is not None:
                try:
                    added = await intents.append(store, call.run.key, intent,
                                                 max_chars=self.policy.max_intent_chars, ttl=self._ttl)
                except IntentError as exc:
                    return Decision(Verdict.DENY, Code.INVALID_REQUEST, self.id,
                                    f"{exc}; the call was refused", intents.HEADER)
                call.audit_extra["intent"] = {"by": "header", "chars": len(intent), "appended": added}
            if sink and intent is None and self.policy.intent == "required" and self.mode == "enforce" \
                    and not await intents.load(store, call.run.key):
                # The deployment promised the user's words for every run (`intent: required`):
                # a framework that stopped sending them is refused, not silently escalated.
                return Decision(Verdict.DENY, Code.INVALID_REQUEST, self.id,
                                f"the run has no intent on record ({intents.HEADER} or the admin API) "
                                "and the policy requires one before any side effect", "dataflow.intent")
            if not sink and self._escalates:
                await self._read_endorses(store, call)
            decision = await self._sink(store, call, len(intent or "")) if sink else None
            if decision is None and labels.tracked and call.run.session:
                # A session's stream may be resumed with GET + Last-Event-ID after the client
                # drops it, possibly on another replica that does not know this call's labels:
                # an output is said to be on its way before anything of that stream reaches the
                # client (`Envelope.stream_opens`; a JSON answer, which only this process
                # delivers, needs no marker). Recording the output clears the marker; a marker
                # left past its deadline makes the run coarse (fail closed).
                call.ledger_due = time.time() + self._timeouts.get(call.upstream, 30.0) + PENDING_GRACE
            return decision
        except (StoreError, TimeoutError) as exc:
            if self.mode == "shadow":
                call.audit_extra["dataflow_error"] = f"state store unavailable: {exc}"
                return None
            return Decision(Verdict.ERROR, Code.STORE_UNAVAILABLE, self.id,
                            f"the state store cannot answer for the run's data-flow ledger ({exc or 'timed out'}); "
                            "sinks are refused until it can")

    async def _read_endorses(self, store: Store, call: ToolCall) -> None:
        """What a read's answer will endorse (`endorse`: a read by id in a clean run, a read the
        user pointed at), set on the call for `Envelope.complete` to record with its output
        and audited `extra.dataflow_read`. A store that cannot answer endorses nothing (the
        run escalates more, never less); the read itself is not refused for it."""
        found: dict[str, Any] = {}
        try:
            names = [name for name in call.arguments if id_argument(name)]
            ids = [str(c.value) for c in critical_values(call.arguments, names, call.upstream)[0]
                   if c.handle is not None] if names else []
            if ids and not (await run_flags(store, call.run.key))[0]:
                # Nothing read through the proxy can have chosen these ids: the run was clean.
                call.read_handles = tuple(dict.fromkeys(ids))
                found["clean_ids"] = list(call.read_handles)
            values = critical_values(call.arguments, list(call.arguments))[0]
            if any(names_object(c.value) for c in values):
                texts = await intents.load(store, call.run.key)
                pointed = []
                if texts:
                    words = await intent_words_of(texts, prepare=False)
                    at = await each_of(lambda c: words.points_at(c.value), values, sum(map(len, texts)))
                    pointed = [c.pointer for c, yes in zip(values, at, strict=True) if yes]
                if pointed:
                    call.read_pointed = True
                    found["pointed_by"] = pointed
        except (StoreError, TimeoutError) as exc:
            call.read_handles, call.read_pointed = (), False
            found = {"error": f"state store unavailable: {exc or 'timed out'}; the read endorses nothing"}
        if found:
            call.audit_extra["dataflow_read"] = found

    def probes(self, call: ToolCall) -> list[tuple[str, Probe]]:
        """(JSON pointer, probe) of every argument of a sink that can carry an attacker's text."""
        return [(ptr, probe) for ptr, text in free_text(call.arguments, self._schema(call), self._skip)
                for probe in value_probes(text, self._n, self._window, self._max_argument, self._min_value)]

    def findings(self, call: ToolCall, ledger: Ledger, probes: list[tuple[str, Probe]] | None = None,
                 endorsement: Endorsement | None = None,
                 ) -> tuple[list[Finding], list[Finding], list[dict[str, Any]]]:
        """(flagging findings, declassified flows, endorsed pieces) of a sink call against a
        run's ledger. What `endorsement` (the run's intent) endorses neither flags nor counts as
        declassified: a whole argument value it holds, its tokens, the grams it shares."""
        flagged: list[Finding] = []
        declassified: list[Finding] = []
        endorsed: list[dict[str, Any]] = []
        decl = self._declassified(call)
        coarse = ledger.coarse(time.time(), self._n, self._window, self._min_value)
        for ptr, probe in self.probes(call) if probes is None else probes:
            if probe.oversized:
                # Too long to be matched (bounded work): it counts as matching whatever the run
                # has read that is untrusted, declassified or not (its tokens are unknown).
                if ledger.untrusted or coarse:
                    flagged.append(dataclasses.replace(oversized(probe, self._max_argument), argument=ptr))
                continue
            top = ptr[1:].split("/", 1)[0].replace("~1", "/").replace("~0", "~")
            is_decl = decl is True or (isinstance(decl, frozenset) and top in decl)
            if endorsement and probe.disguised:
                # A disguised value ("hans@faß.de") folds equal to the user's "hans@fass.de":
                # only the intent writing its very characters endorses it, whole
                # (`fingerprint.disguised`); none of its folded tokens or grams.
                if probe.faithful is not None and endorsement.written(probe.faithful):
                    verbatim, toks = match_argument(ledger, probe, self._n, self._window)
                    if verbatim or toks or (coarse and (len(probe.norm) >= self._n or probe.value)):
                        endorsed.append({"arg": ptr, "by": "intent", "kind": "value"})
                    continue
            elif endorsement:
                if endorsement.whole(probe.norm):
                    # The user named this very value: whatever untrusted content also holds it.
                    verbatim, toks = match_argument(ledger, probe, self._n, self._window)
                    if verbatim or toks or (coarse and (len(probe.norm) >= self._n or probe.value)):
                        endorsed.append({"arg": ptr, "by": "intent", "kind": "value"})
                    continue
                probe, pieces = endorsement.narrow(ptr, probe, ledger)
                endorsed += pieces
            verbatim, toks = match_argument(ledger, probe, self._n, self._window)
            flagged += [dataclasses.replace(f, argument=ptr) for f in toks]
            if is_decl:
                if " " not in probe.norm:
                    # A declassified argument that is one untrusted word found whole (a code
                    # such as "LAGOSTA-VIP" as a booking note) carries no text of the agent's
                    # own: it is a short copied value, not prose quoting a source.
                    flagged += [dataclasses.replace(f, argument=ptr) for f in verbatim if f.kind == "value"]
                    verbatim = [f for f in verbatim if f.kind != "value"]
                declassified += [dataclasses.replace(f, argument=ptr) for f in verbatim]
                if verbatim:
                    # Declassified text may carry untrusted text, not the attacker's orders nor
                    # wholesale copies (declassify_max_copy).
                    flagged += [dataclasses.replace(f, argument=ptr) for f in declassified_findings(
                        ledger, probe, self._n, self._window, self.policy.declassify_max_copy)]
            else:
                flagged += [dataclasses.replace(f, argument=ptr) for f in verbatim]
                # A coarse ledger may lack the phrases and tokens of what the run read: a value
                # long enough to be looked up whole, or carrying a distinctive token (an
                # address, a URL, an account number), counts as matching too (widens, never
                # narrows).
                if coarse and not verbatim and not toks and (len(probe.norm) >= self._n or probe.value
                                                             or probe.tokens):
                    flagged.append(Finding("coarse", ptr, "this run", coarse))
        if ledger.untrusted and ledger.secret:
            flagged.append(Finding("trifecta", None, ledger.first_source("secret") or "a secret tool", ""))
        return flagged, declassified, endorsed

    async def _read(self, store: Store, call: ToolCall, wanted: list[bytes],
                    endorsing: bool = False) -> Ledger | None:
        """The run's ledger as far as `wanted` needs it (one store read; `ledger.load`;
        `endorsing`: `wanted` are endorsing keys, looked up in a clean run too): None when the
        run has none. StoreError propagates: the check refuses (fail closed)."""
        return await on_loop(load, store, call.run.key, self._n, wanted, self._window, self._min_value,
                             ttl=self._ttl, endorsing=endorsing)

    async def _sink(self, store: Store, call: ToolCall, intent_chars: int) -> Decision | None:
        """`_check_sink`, inline, or as a whole in one worker thread when the call's values ask
        more than INLINE_CALL_WORK of the loop (`offload.call_work`: many small values pass
        every per-step bound while their sum is milliseconds). Same decision, same audit;
        raises what `_check_sink` raises."""
        action = self._on_tainted(call) if self._escalates else "allow"
        waives = self._waives(call)
        per_value = offload.VALUE_WORK if action != "allow" or waives else offload.PROBE_WORK
        if offload.call_work(call.arguments, per_value=per_value, intent_chars=intent_chars) <= offload.INLINE_CALL_WORK:
            return await self._check_sink(store, call, action, waives)
        return await whole(lambda: self._check_sink(store, call, action, waives))

    async def _check_sink(self, store: Store, call: ToolCall, action: str, waives: bool) -> Decision | None:
        # Large arguments are hashed in a worker thread: the event loop keeps serving.
        probes = await probes_of(free_text(call.arguments, self._schema(call), self._skip), self._n,
                                 window=self._window, max_chars=self._max_argument,
                                 min_value=self._min_value)
        # Matching them walks every gram too: past INLINE_CHARS, in a worker thread (`sized`).
        chars = sum(len(probe.norm) for _, probe in probes)
        criticals, cut = self.criticals(call) if action != "allow" or waives else ([], False)
        wanted = await sized(lambda: [f for _, probe in probes for f in probe.fields()], chars)
        wanted += [k for c in criticals for k in c.keys]
        wanted += [k for c in criticals for k in (c.candidate, c.sole, c.pointed) if k is not None]
        # A gate waiver reads its endorsing keys in a clean run too (`ledger.load`).
        ledger = await self._read(store, call, wanted, endorsing=waives)
        if ledger is None:
            if waives:
                await self._waive(store, call, None, criticals, cut)
            return None
        flagged, declassified, _ = await sized(lambda: self.findings(call, ledger, probes), chars)
        if flagged or declassified:
            # Only a call that would flag or declassify reads the run's intent (one store read).
            texts = await on_loop(intents.load, store, call.run.key)
            if texts:
                endorsement = await endorsement_of(texts, self._n, window=self._window)
                flagged, declassified, endorsed = await sized(
                    lambda: self.findings(call, ledger, probes, endorsement), chars)
                if endorsed:
                    call.audit_extra["endorsed"] = endorsed
        if flagged and criticals:
            flagged = self._pointed(call, ledger, flagged, criticals)
        if flagged and criticals:
            flagged = await self._chosen(store, call, flagged, criticals)
        if declassified:
            call.audit_extra["dataflow_declassified"] = [f.as_dict() for f in declassified]
        if not flagged:
            refused = await self._tainted(store, call, ledger, action, criticals, cut) if action != "allow" else None
            if refused is None and waives and call.escalation is None:
                await self._waive(store, call, ledger, criticals, cut)
            return refused
        evidence = [f.as_dict() for f in flagged]
        reason = "data flow: " + "; ".join(f.describe() for f in flagged[:3])
        if len(flagged) > 3:
            reason += f" (and {len(flagged) - 3} more)"
        rule = f"dataflow.{flagged[0].kind}"
        metrics = self._services.metrics if self._services is not None else None
        if metrics is not None:
            metrics.dataflow_flagged(self._tool_label(call), self.mode)
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
                call.escalation_reason = "dataflow_flag"
                return None
            reason += " (on_flag approve, but no approval gate is configured)"
        return Decision(Verdict.DENY, Code.DATAFLOW_POLICY_BLOCKED, self.id, reason, rule,
                        audit={"dataflow": {**audit, "on_flag": "block"}})

    @staticmethod
    def _pointed(call: ToolCall, ledger: Ledger, flagged: list[Finding],
                 criticals: list[Critical]) -> list[Finding]:
        """`flagged` without the findings on a critical argument whose value is the one token of
        a read the user pointed at (`endorse.pointed_keys`); what was endorsed so is audited
        `extra.endorsed` (`by: pointed_read`, the read as source)."""
        endorsed: dict[str, str] = {}
        for critical in criticals:
            if (source := ledger.trusted_source(critical.pointed)) is not None:
                endorsed[critical.pointer] = source
        if not endorsed:
            return flagged
        kept = [f for f in flagged if f.argument not in endorsed]
        if len(kept) < len(flagged):
            entries = call.audit_extra.setdefault("endorsed", [])
            entries += [{"arg": ptr, "by": "pointed_read", "source": source}
                        for ptr, source in endorsed.items() if any(f.argument == ptr for f in flagged)]
        return kept

    async def _picked(self, store: Store, call: ToolCall, words: IntentWords, left: list[Critical],
                      endorsed: list[dict[str, Any]]) -> list[Critical]:
        """Of `left`, those no entry of a trusted listing picked by the intent holds
        (`endorse.entry_keys`: every word of the intent that picks an entry of a listing of the
        run picks the one holding the value); the others are added to `endorsed`
        (`by: intent+trusted_listing`, the words). One more ledger read, only for a call that
        is about to be escalated; past MAX_PICK_KEYS lookups nothing is endorsed this way.
        Run-wide, not per listing: when a word picks one entry in each of two listings of the
        run (`endorse.picks_one_entry`: the user's payees and ones an outsider added, the inbox
        and a folder the attacker's mail lands in), no entry is endorsed by a pick; the picking
        words' signatures are a second read, only when some word picks."""
        said = words.words()
        forms = {c.pointer: entry_value_forms(c) for c in left}
        # A string that is not a number: a name a listing's entry may hold (`name_keys`).
        names = {c.pointer: c.norm for c in left if c.norm and c.number is None}
        # Counted before any key is hashed: up to 256 words times 256 values' forms.
        count = len(said) * (1 + sum(map(len, forms.values())) + (1 + len(names) if names else 0))
        if not said or count > MAX_PICK_KEYS or not (any(forms.values()) or names):
            return left
        wanted = [pick_key(w) for w in said]
        wanted += [entry_key(w, f) for w in said for fs in forms.values() for f in fs]
        if names:
            wanted += [name_pick_key(w) for w in said]
            wanted += [name_key(w, norm) for w in said for norm in names.values()]
        ledger = await self._read(store, call, wanted, endorsing=True)
        if ledger is None:
            return left

        def trusted(key: bytes) -> bool:
            return ledger.trusted_source(key) is not None

        def sole_ids(picked: list[str]) -> list[str]:
            # An identifier the user typed names its entry ("refund order O-8812"): a common
            # word of the intent that another entry writes ("Other order: O-8790") does not
            # make the pick ambiguous; two identifiers of different entries still do.
            ids = [w for w in picked if w.startswith("#")]
            return ids or picked

        picked = sole_ids([w for w in said if trusted(pick_key(w))])
        # A listed name is the user's choice only when every word of the intent that picks an
        # entry of a listing picks the one holding it ("book the Tejo Mar").
        named = sole_ids([w for w in said if trusted(name_pick_key(w))]) if names else []
        if picked or named:
            probes = [k for w in picked for k in pick_signature_probes(w, "eb")]
            probes += [k for w in named for k in pick_signature_probes(w, "nb")]
            signed = await self._read(store, call, probes, endorsing=True) if len(probes) <= MAX_PICK_KEYS else None
            if signed is None:
                return left

            def recorded(key: bytes) -> bool:
                return signed.trusted_source(key) is not None
            if not (all(picks_one_entry(w, recorded) for w in picked)
                    and all(picks_one_entry(w, recorded, "nb") for w in named)):
                # The user's words pick one entry in one listing and another in another: which
                # one they meant is a person's call (the attacker's mail may be the second).
                return left
        still = []
        for critical in left:
            if picked and any(all(trusted(entry_key(w, f)) for w in picked) for f in forms[critical.pointer]):
                endorsed.append({"arg": critical.pointer, "by": "intent+trusted_listing", "words": picked[:5]})
            elif (named and critical.pointer in names
                  and all(trusted(name_key(w, names[critical.pointer])) for w in named)):
                endorsed.append({"arg": critical.pointer, "by": "intent+trusted_listing", "words": named[:5]})
            else:
                still.append(critical)
        return still

    async def _criterion(self, store: Store, call: ToolCall, words: IntentWords, left: list[Critical],
                         endorsed: list[dict[str, Any]]) -> list[Critical]:
        """Of `left`, those that no extreme entry of a trusted listing holds by a criterion the
        intent states (`criterion`: "the cheapest" and the listing's one cheapest entry; with
        conditions, "a well-reviewed Italian place", the extreme among the entries writing
        every condition word); the others are added to `endorsed` (`by: intent+criterion`,
        with the criterion's words, its field, its conditions and the listing's source). A
        criterion with a condition the proxy cannot evaluate endorses nothing. One more ledger
        read, only when the intent states a criterion; past MAX_PICK_KEYS lookups nothing is
        endorsed this way."""
        stated = [cr for cr in words.criteria() if not cr.opaque]
        forms = {c.pointer: critical_forms(c) for c in left}

        def groups(cr: Criterion, form: str) -> list[list[bytes]]:
            # Every condition must hold: the value is the extreme among the entries writing
            # each condition word and among those meeting each bound (then among those meeting
            # them all, as it meets them all). A bound is found by any dyadic block holding its
            # grid value (`criterion.bound_condition`).
            if not cr.conditions and not cr.bounds:
                return [[criterion_key(cr.field, cr.direction, form)]]
            out = [[criterion_key(cr.field, cr.direction, form, w)] for w in cr.conditions]
            out += [[criterion_key(cr.field, cr.direction, form, bound_condition(b, level))
                     for level in range(GRID_BITS + 1)] for b in cr.bounds]
            return out

        # Counted before any key is hashed (each criterion has as many keys for every form).
        per_form = sum(len(cr.conditions) + len(cr.bounds) * (GRID_BITS + 1) or 1 for cr in stated)
        count = per_form * sum(map(len, forms.values()))
        if not count or count > MAX_PICK_KEYS:
            return left
        wanted = [k for cr in stated for fs in forms.values() for f in fs for g in groups(cr, f) for k in g]
        ledger = await self._read(store, call, wanted, endorsing=True)
        if ledger is None:
            return left

        def source(cr: Criterion, form: str) -> str | None:
            found = []
            for group in groups(cr, form):
                hit = next((f for k in group if (f := ledger.trusted_source(k)) is not None), None)
                if hit is None:
                    return None
                found.append(hit)
            return found[0]

        still = []
        for critical in left:
            hit = next(((cr, src) for cr in stated for f in forms[critical.pointer]
                        if (src := source(cr, f)) is not None), None)
            if hit is None:
                still.append(critical)
            else:
                cr, src = hit
                entry: dict[str, Any] = {"arg": critical.pointer, "by": "intent+criterion", "criterion": cr.words,
                                         "field": cr.field, "direction": cr.direction, "source": src}
                if cr.conditions:
                    entry["conditions"] = list(cr.conditions)
                if cr.bounds:
                    entry["bounds"] = [b.words for b in cr.bounds]
                endorsed.append(entry)
        return still

    async def _labelled(self, store: Store, call: ToolCall, words: IntentWords, left: list[Critical],
                        endorsed: list[dict[str, Any]]) -> list[Critical]:
        """Of `left`, those that no read the intent pointed at writes as its one value under a
        label whose word the intent writes, when every word of the intent that labels
        something there labels this value (`endorse.label_key`: "update their address to the
        one they wrote" and the ticket's "New address: ..."); the others are added to
        `endorsed` (`by: pointed_read+label`, the word and the read as source). One more ledger
        read, only for string values still unendorsed; past MAX_PICK_KEYS lookups nothing is
        endorsed this way. An identifier argument's value is judged only among the ids the
        pointed read writes right after a word (`endorse.labelled_ids`: "the customer in
        T-6100" and the ticket's "(customer C-4410)"), every word of the intent that labels an
        id there labelling this one."""
        said = [w for w in words.words() if not w.startswith("#") and len(w) >= 4]
        strings = [c for c in left if c.norm and c.number is None]
        ids = [c for c in strings if c.handle is not None]
        if not strings or len(said) * (2 + len(strings)) > MAX_PICK_KEYS:  # counted before hashing
            return left
        wanted = [label_word_key(w) for w in said] + [label_key(w, c.norm) for w in said for c in strings
                                                      if c.handle is None]
        if ids:
            wanted += [id_label_word_key(w) for w in said] + [id_label_key(w, c.norm) for w in said for c in ids]
        ledger = await self._read(store, call, wanted, endorsing=True)
        if ledger is None:
            return left

        trusted = ledger.trusted_source

        # Every word of the intent that labels something in a pointed read must label this value
        # (an id: every word that labels an id there must label this id).
        labels = [w for w in said if trusted(label_word_key(w)) is not None]
        id_labels = [w for w in said if trusted(id_label_word_key(w)) is not None] if ids else []
        still = []
        for critical in left:
            # `critical in strings`, without comparing it to every value (quadratic in the values).
            is_string = bool(critical.norm) and critical.number is None
            if is_string and critical.handle is not None:
                # An identifier is judged among the ids written after a word only: as a value
                # under a label, an injected "Customer: C-3002" beside the ticket's "(customer
                # C-2291)" was the one value under "customer" and endorsed the attacker's id.
                sources = [trusted(id_label_key(w, critical.norm)) for w in id_labels]
                if id_labels and all(sources):
                    endorsed.append({"arg": critical.pointer, "by": "pointed_read+label", "label": id_labels[0],
                                     "source": sources[0]})
                else:
                    still.append(critical)
                continue
            sources = [trusted(label_key(w, critical.norm)) for w in labels] if is_string else []
            if labels and all(sources):
                endorsed.append({"arg": critical.pointer, "by": "pointed_read+label", "label": labels[0],
                                 "source": sources[0]})
                continue
            still.append(critical)
        return still

    async def _chosen(self, store: Store, call: ToolCall, flagged: list[Finding],
                      criticals: list[Critical]) -> list[Finding]:
        """`flagged` without the findings on a critical argument whose whole value the intent's
        criterion picks from a trusted listing (`_criterion`), or that a read the user pointed
        at writes under a label the intent names (`_labelled`): the user chose it, whatever
        untrusted output also writes it ("Casa Alfama" in its reviews). Audited
        `extra.endorsed`. Reads the intent only when a flagged argument is critical."""
        on = [c for c in criticals if any(f.argument == c.pointer for f in flagged)]
        if not on:
            return flagged
        texts = await on_loop(intents.load, store, call.run.key)
        if not texts:
            return flagged
        endorsed: list[dict[str, Any]] = []
        words = await intent_words_of(texts)
        still = await self._criterion(store, call, words, on, endorsed)
        still = await self._labelled(store, call, words, still, endorsed) if still else still
        chosen = {c.pointer for c in on} - {c.pointer for c in still}
        if not chosen:
            return flagged
        call.audit_extra.setdefault("endorsed", []).extend(e for e in endorsed if e["arg"] in chosen)
        return [f for f in flagged if f.argument not in chosen]

    async def _waive(self, store: Store, call: ToolCall, ledger: Ledger | None, criticals: list[Critical],
                     cut: bool) -> None:
        """Waive the call's approval gate when the intent asks for it (`waiver`): its action,
        not negated, and every critical value by the user's words (written whole, a number
        written as a reference, an address whose owner it names, the one entry of a trusted
        listing its words or its criterion pick). Sets `call.gate_waived`, audited
        `extra.gate_waived` and counted; otherwise audited `extra.gate_waiver` with what the
        intent did not name (the call goes to the gate as before)."""
        if not criticals or cut:
            return
        texts = await on_loop(intents.load, store, call.run.key)
        if not texts:
            return
        asking = await asking_of(call.tool, texts)
        if not asking:
            call.audit_extra["gate_waiver"] = {"waived": False, "why": "the intent does not ask for the action"}
            return
        verb = asking[0].word
        # Only the objects of the clauses that ask for the action name them ("archive the old
        # notes, then delete f-22" does not ask to delete the old notes; "delete the copies of
        # f-22" does not ask to delete f-22).
        said = [a.object for a in asking if a.object]
        words, each = await clause_words_of(said)
        spelling = list(zip([a for a in asking if a.object], each, strict=True))

        def named(critical: Critical) -> bool:
            # An identifier counts only as its sentence's one identifier (`waiver.names_id`).
            if critical.number is not None:
                return critical.norm.isdigit() and any(
                    waiver.names_number(critical.norm, a.object, call.tool, critical.pointer)
                    and waiver.names_id(critical.norm, a) for a in asking)
            has_digit = any(ch.isdigit() for ch in critical.norm)
            return any(w.spells(critical) and (not has_digit or waiver.names_id(critical.norm, a))
                       for a, w in spelling)

        endorsed: list[dict[str, Any]] = []
        left: list[Critical] = []
        by_name = await each_of(named, criticals, sum(map(len, said)))
        for critical, is_named in zip(criticals, by_name, strict=True):
            if is_named:
                endorsed.append({"arg": critical.pointer, "by": "intent"})
            elif words.names(critical) and ledger is not None \
                    and (source := ledger.trusted_source(critical.candidate)) is not None:
                endorsed.append({"arg": critical.pointer, "by": "intent+trusted_output", "source": source})
            else:
                left.append(critical)
        if left:
            left = await self._picked(store, call, words, left, endorsed)
        if left:
            left = await self._criterion(store, call, words, left, endorsed)
        if left:
            call.audit_extra["gate_waiver"] = {"waived": False, "action": verb,
                                               "unnamed": list(dict.fromkeys(c.pointer for c in left))}
            return
        call.gate_waived = True
        call.audit_extra["gate_waived"] = {"by": "dataflow.waive_gate", "action": verb, "endorsed": endorsed}
        metrics = self._services.metrics if self._services is not None else None
        if metrics is not None:
            metrics.gate_waived(self._tool_label(call))

    async def _tainted(self, store: Store, call: ToolCall, ledger: Ledger, action: str,
                       criticals: list[Critical], cut: bool) -> Decision | None:
        """Tainted-run escalation (`on_tainted` approve/block): None when the run never read
        untrusted content or every critical value is endorsed (by the run's intent or a trusted
        output of the run; audited `extra.tainted_run`), or in shadow mode (audited, counted);
        otherwise the call goes to the approval gate (`approve`) or is refused
        `dataflow_policy_blocked`, rule `dataflow.tainted_run` (`block`, or `approve` with no
        gate), naming the unendorsed arguments."""
        now = time.time()
        if not (ledger.untrusted or ledger.lost or ledger.coarse(now, self._n, self._window, self._min_value)):
            return None
        endorsed: list[dict[str, Any]] = []
        left: list[Critical] = []
        for critical in criticals:
            # Which object a sink acts on is a choice an injection can make among the ids a
            # listing hands out: only a sole id endorses it (a trusted record read by its id, a
            # read by id in a clean run; `endorse`).
            hit = next(((k, source) for k in (*critical.keys, critical.sole, critical.pointed)
                        if (source := ledger.trusted_source(k)) is not None), None)
            if hit is not None:
                by = ("trusted_output" if hit[0] in critical.keys
                      else "pointed_read" if hit[0] == critical.pointed else "handle")
                endorsed.append({"arg": critical.pointer, "by": by, "source": hit[1]})
            else:
                left.append(critical)
        if left:
            # The intent is read only when trusted outputs left something unendorsed.
            texts = await on_loop(intents.load, store, call.run.key)
            words = await intent_words_of(texts)
            still = []
            endorses = await each_of(words.endorses, left, sum(map(len, texts)))
            for critical, endorsed_whole in zip(left, endorses, strict=True):
                if endorsed_whole:
                    endorsed.append({"arg": critical.pointer, "by": "intent"})
                elif words.names(critical) and (source := ledger.trusted_source(critical.candidate)):
                    endorsed.append({"arg": critical.pointer, "by": "intent+trusted_output",
                                     "source": source})
                else:
                    still.append(critical)
            left = await self._picked(store, call, words, still, endorsed) if still else still
            left = await self._criterion(store, call, words, left, endorsed) if left else left
            left = await self._labelled(store, call, words, left, endorsed) if left else left
        unendorsed = list(dict.fromkeys(c.pointer for c in left))
        if cut:
            unendorsed.append("(more values than are checked)")
        audit: dict[str, Any] = {"mode": self.mode, "on_tainted": action, "endorsed": endorsed,
                                 "unendorsed": unendorsed,
                                 "untrusted_source": ledger.first_source("untrusted") or "this run"}
        if not unendorsed:
            call.audit_extra["tainted_run"] = audit
            return None
        metrics = self._services.metrics if self._services is not None else None
        if metrics is not None:
            metrics.dataflow_tainted(self._tool_label(call), self.mode, action)
        shown = ", ".join(unendorsed[:5]) + (f" (and {len(unendorsed) - 5} more)" if len(unendorsed) > 5 else "")
        reason = (f"tainted run: the run has read untrusted content ({audit['untrusted_source']}) and "
                  f"critical arguments {shown} are endorsed neither by the user's intent nor by a "
                  "trusted output of the run")
        rule = "dataflow.tainted_run"
        if self.mode == "shadow":
            call.audit_extra["tainted_run"] = audit
            return None
        if action == "approve":
            if self._gate:
                call.audit_extra["tainted_run"] = audit
                call.escalation = f"{reason} (dataflow.on_tainted approve)"
                call.escalation_reason = "tainted_run"
                return None
            reason += " (on_tainted approve, but no approval gate is configured)"
        return Decision(Verdict.DENY, Code.DATAFLOW_POLICY_BLOCKED, self.id, reason, rule,
                        audit={"tainted_run": {**audit, "on_tainted": "block"}})
