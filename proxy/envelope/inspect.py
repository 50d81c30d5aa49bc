"""The one inspection seam for what an upstream sends toward the client.

Every message an upstream sends that the client will receive passes `Inspector` before it is
delivered, on every route and stream form (JSON reply, SSE event of a call's stream, standalone
or resumed GET stream, aggregated `/mcp`): tool results (also `tasks/result` and task status),
JSON-RPC error replies, resource contents (`resources/read`), prompt messages (`prompts/get`),
and the server-to-client requests and notifications relayed in a stream. Three steps, in order:

1. `_meta` keys in the `envelope/` namespace are removed wherever they appear: only the proxy
   speaks there, so an upstream cannot forge a decision, a replay or a shadow mark;
2. the output guardrails of the content's `Subject` (`defaults.guardrails`, then the tool's,
   resource's or prompt's own) scan every string and key of the message's payload (`result`,
   `error` or `params`): redact rewrites it, warn counts, block withholds it whole;
3. what will be delivered is recorded in the run's data-flow ledger with the subject's labels
   (untrusted unless the policy says otherwise), before delivery.

Steps 1 and 2 are `scan` (on the event loop for a small message, in a worker thread for a
large one); step 3 waits for the store (`record`). The envelope
(`proxy.envelope.pipeline.Envelope`) runs them and decides what a failure means; fronts only
hand messages in and deliver what comes out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.envelope.checks.guardrails import (
    UNCHANGED,
    Guarded,
    Rule,
    ScanTimeout,
    compiled,
    payload_chars,
    scan_payload,
)
from proxy.envelope.dataflow.fingerprint import load_numpy
from proxy.envelope.dataflow.ledger import (
    LedgerDelta,
    RecentWrites,
    mark_pending,
    record,
    widen_parent,
)
from proxy.envelope.dataflow.offload import delta_of, sized
from proxy.envelope.invisible import invisible_class
from proxy.envelope.labels import Label, OutputLabels, Piece, ToolLabels, pieces
from proxy.envelope.types import RunContext, ToolCall, run_key
from proxy.policy.compiled import PolicyRevision
from proxy.policy.model import ContentPolicy, DataflowPolicy, escalates
from proxy.store.base import Store

log = logging.getLogger("envelope.inspect")

NAMESPACE = "envelope/"
UNTRUSTED = Label(untrusted=True, secret=False)
# A message of at most this many characters is scanned on the event loop, a larger one in a
# worker thread (`Inspector.scan`). The costliest text per character for the built-in detectors
# (`api_key=` over and over, or text dense in zero-width characters: read twice) costs about
# 1 ms per KB, so this bounds the loop's time to ~2 ms, against ~0.03 ms of the loop's for
# the hop to a thread (bench/RESULTS.md "Guardrails off the event loop").
INLINE_SCAN_CHARS = 2048
# A scan not done after this many seconds withholds its message (fail closed): the default of
# `limits.guardrail_scan_timeout` (`proxy.config.Limits`, where its measurements are). The default
# reply cap is 32 MiB: that much hostile text may be withheld, never delivered unread.
SCAN_TIMEOUT = 60.0
# Walk no deeper into a payload than this when collecting text for the ledger (the front caps
# JSON depth on requests; upstream replies are parsed by orjson, which caps at 1024).
MAX_DEPTH = 256


def copy_chars(result: Mapping[str, Any], bound: int) -> int:
    """The characters of a tool result's `content` texts that `labels.pieces` compares with its
    `structuredContent` (0 without one), counted until past `bound`."""
    content = result.get("content")
    total = 0
    if result.get("structuredContent") is None or not isinstance(content, list):
        return total
    for item in content:
        if isinstance(item, Mapping) and isinstance(text := item.get("text"), str):
            total += len(text)
            if total > bound:
                break
    return total


def strip_envelope_meta(message: Any) -> bool:
    """Remove `envelope/*` keys from every `_meta` object in `message`, in place; whether any
    was removed. Iterative (no recursion limit)."""
    changed = False
    stack = [message]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            meta = node.get("_meta")
            if isinstance(meta, dict):
                forged = [k for k in meta if isinstance(k, str) and k.startswith(NAMESPACE)]
                for key in forged:
                    del meta[key]
                changed = changed or bool(forged)
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return changed


def may_name_envelope(raw: bytes) -> bool:
    """Whether JSON bytes may hold a key in the `envelope/` namespace: they spell it, or hold
    an escape (`\\uXXXX`, `\\/`) that could spell it."""
    return b"envelope/" in raw or b"\\u" in raw or b"\\/" in raw


def payload_of(message: Mapping[str, Any]) -> Any:
    """The part of a JSON-RPC message that carries the upstream's content: `result`, `error`
    or `params` (None when it has none). `Inspector.scan` has made sure it carries one only."""
    for key in ("result", "error", "params"):
        if key in message:
            return message[key]
    return None


# The members of a JSON-RPC 2.0 message; a client reads no other.
MEMBERS = frozenset({"jsonrpc", "id", "method", "params", "result", "error"})


def ambiguous(message: Mapping[str, Any]) -> str | None:
    """Why `message` is not one JSON-RPC message (a response has `result` or `error`, a request
    or notification `method` and `params`: never two of these), None when it is one. A client
    reads such a message its own way (the MCP SDK takes `error` over `result`, and `params`
    over both when there is a `method`), which need not be the payload the proxy inspected."""
    found = [k for k in ("result", "error") if k in message]
    if "method" in message or "params" in message:
        found.append("method" if "method" in message else "params")
    if len(found) > 1:
        return f"a message with both {found[0]!r} and {found[1]!r}"
    return None


def drop_foreign_members(message: dict[str, Any]) -> bool:
    """Remove the top-level members JSON-RPC does not define (no client reads them, so no
    guardrail does either: no upstream text passes unread); whether any was removed."""
    foreign = [k for k in message if k not in MEMBERS]
    for key in foreign:
        del message[key]
    return bool(foreign)


def all_pieces(value: Any, label: Label, where: str, trusted: bool = False) -> Iterator[Piece]:
    """Every string of `value` (and long integers, which can be account numbers) as a piece
    (nothing for a trusted `label` unless `trusted`: what it endorses is wanted)."""
    if not (label.tracked or trusted):
        return
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            yield Piece(node, label, where)
        elif depth >= MAX_DEPTH:
            continue
        elif isinstance(node, Mapping):
            for k, v in node.items():
                if isinstance(k, str):
                    yield Piece(k, label, where)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) >= 10_000_000:
            yield Piece(str(node), label, where)


# The members of a tool result not read whole below: `labels.pieces` reads the first two (with
# labels by path); the others are protocol fields no model reads (`requestState` goes back to
# the server only; `_meta` is the protocol's, passed the guardrails all the same).
NOT_READ_WHOLE = frozenset({"content", "structuredContent", "isError", "resultType", "requestState",
                            "_meta"})


def result_pieces(result: Mapping[str, Any], labels: OutputLabels, trusted: bool = False) -> Iterator[Piece]:
    """Every string of a tool result an agent can read: `content` and `structuredContent` with
    their labels, then every other member's (an `input_required` result's `inputRequests`,
    whose sampling or elicitation text the client hands to its model as a session's server
    request; a task's `statusMessage`) with the tool's base label."""
    yield from pieces(result, labels, trusted)
    for key, value in result.items():
        if key not in NOT_READ_WHOLE and isinstance(value, dict | list | str):
            yield from all_pieces(value, labels.base, key, trusted)


@dataclass(frozen=True, slots=True)
class Subject:
    """Whose content a message is: where it is recorded from, its labels, its guardrails.

    `source` names it in the ledger and in evidence (`<upstream>.<tool>`, `<upstream>.<URI>`,
    `<upstream>.<prompt>`); `tool_result` says the payload is a tool result (labels by path of
    `structuredContent` apply); `metric_tool` is the bounded metric label.
    """

    source: str
    labels: OutputLabels
    rules: tuple[Rule, ...]
    tool_result: bool
    metric_tool: str


@dataclass(slots=True)
class Scan:
    """What `Inspector.scan` did to one message."""

    changed: bool = False  # the message differs from the upstream's bytes
    stripped: bool = False  # forged `envelope/*` meta was removed
    guarded: Guarded = UNCHANGED
    error: Exception | None = None  # the guardrails failed: withhold (fail closed)
    malformed: str | None = None  # not one JSON-RPC message (`ambiguous`): withhold


@dataclass(slots=True)
class Notes:
    """What inspection did over one call (its stream and its reply), for its audit record."""

    guardrails: dict[str, dict[str, Any]] = field(default_factory=dict)  # rule id -> entry
    recorded: dict[str, Any] | None = None
    meta_stripped: int = 0

    def add_guarded(self, guarded: Guarded) -> None:
        for fired in guarded.fired:
            entry = self.guardrails.get(fired.rule.id)
            if entry is None:
                self.guardrails[fired.rule.id] = fired.as_audit()
            else:
                entry["matches"] += fired.matches

    def add_recorded(self, delta: LedgerDelta) -> None:
        if not (delta.untrusted or delta.secret):
            return
        r = self.recorded
        if r is None:
            r = self.recorded = {"untrusted": False, "secret": False, "fingerprints": 0}
        r["untrusted"] |= delta.untrusted
        r["secret"] |= delta.secret
        r["fingerprints"] += delta.count
        if delta.overflow:
            r["overflow"] = True

    def audit(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.guardrails:
            out["guardrails"] = list(self.guardrails.values())
        if self.recorded is not None:
            out["dataflow_recorded"] = dict(self.recorded)
        if self.meta_stripped:
            out["meta_stripped"] = self.meta_stripped
        return out


class Inspector:
    """The inspection of one policy revision: subjects, guardrails, ledger recording.

    Built once per revision (by `Chain`) and immutable but for its caches.
    """

    def __init__(self, revision: PolicyRevision, scan_timeout: float = SCAN_TIMEOUT):
        self.revision = revision
        self.scan_timeout = scan_timeout  # seconds a scan off the loop may take (`scan`)
        document = revision.document
        # No `dataflow:` section: shadow (outputs are recorded; nothing is refused).
        self.dataflow: DataflowPolicy = (document.dataflow if document.dataflow is not None
                                         else DataflowPolicy(mode="shadow"))
        self._escalates = escalates(self.dataflow)
        if self.dataflow.mode != "off":
            load_numpy()  # the fingerprints' library, imported at policy load, not by the first call
        self._tool_labels = ToolLabels(revision)
        self._defaults = compiled(document.defaults.guardrails)
        self._tools: dict[tuple[str, bool, bool], Subject] = {}
        # Resources: per upstream, (prefix, policy) longest prefix first; `*` matches any URI.
        self._resources: dict[str, list[tuple[str, ContentPolicy]]] = {}
        for key, policy in document.resources.items():
            upstream, _, prefix = key.partition(".")
            self._resources.setdefault(upstream, []).append(("" if prefix == "*" else prefix, policy))
        for entries in self._resources.values():
            entries.sort(key=lambda e: -len(e[0]))
        self._prompts: dict[str, ContentPolicy] = dict(document.prompts)
        if self.dataflow.mode != "off" or self._defaults or any(
                tool.policy.guardrails for tool in revision.tools.values()) or any(
                policy.guardrails for policy in (*document.resources.values(), *document.prompts.values())):
            # Read by the guardrails' scan and the ledger's fold: built at policy load (once a
            # process), not by the first call.
            invisible_class()

    @property
    def recording(self) -> bool:
        return self.dataflow.mode != "off"

    @property
    def escalates(self) -> bool:
        """Whether some sink's `on_tainted` is not `allow` (trusted outputs then record what
        they endorse)."""
        return self._escalates

    # -- subjects --------------------------------------------------------------------------

    def tool(self, call: ToolCall, metric_tool: str) -> Subject:
        """A tool's results (also its task results and the messages of its stream)."""
        labels = self._tool_labels.of(call)
        key = (call.qualified_name, labels.base.untrusted, labels.base.secret)
        found = self._tools.get(key)
        if found is None:
            tool = self.revision.tools.get(call.qualified_name)
            rules = compiled(self.revision.document.defaults.guardrails,
                             tool.policy.guardrails if tool is not None else ())
            found = Subject(call.qualified_name, labels, rules, True, metric_tool)
            if len(self._tools) < 10_000:
                self._tools[key] = found
        return found

    def _content(self, source: str, policy: ContentPolicy | None, metric: str) -> Subject:
        if policy is None:
            return Subject(source, OutputLabels(UNTRUSTED), self._defaults, False, metric)
        label = Label(untrusted=policy.output != "trusted", secret=policy.sensitivity == "secret")
        return Subject(source, OutputLabels(label), self._defaults + compiled(policy.guardrails),
                       False, metric)

    def resource(self, upstream: str, uri: str) -> Subject:
        """A resource's contents: the `resources:` entry with the longest matching URI prefix."""
        policy = next((p for prefix, p in self._resources.get(upstream, ()) if uri.startswith(prefix)),
                      None)
        return self._content(f"{upstream}.{uri[:200]}", policy, "resources/read")

    def prompt(self, upstream: str, name: str) -> Subject:
        return self._content(f"{upstream}.{name[:200]}", self._prompts.get(f"{upstream}.{name}"),
                             "prompts/get")

    def relayed(self, upstream: str, what: str) -> Subject:
        """Anything else an upstream sends (untrusted, `defaults.guardrails`)."""
        return self._content(f"{upstream}.{what}", None, what)

    # -- steps 1 and 2 ---------------------------------------------------------------------

    async def scan(self, subject: Subject, message: dict[str, Any], raw: bytes | None = None) -> Scan:
        """`scan_now`, in a worker thread when the message holds more than INLINE_SCAN_CHARS
        characters (its bytes when `raw` is given, else its strings and keys), so that a large
        reply does not stall every other client of the process (`offload.sized`: the same
        mechanism as the ledger's fingerprinting). Never raises: a scan that fails, or that has
        not ended within `scan_timeout` seconds, is `Scan.error` (the caller withholds the message;
        a thread still running goes on to its end, linear in the text, and its result is dropped)."""
        work = functools.partial(self.scan_now, subject, message, raw)
        if not subject.rules:  # no guardrail: only `envelope/*` meta to strip, a walk of the keys
            return work()
        size = len(raw) if raw is not None else payload_chars(message, INLINE_SCAN_CHARS)
        if size <= INLINE_SCAN_CHARS:
            return work()
        try:
            return await asyncio.wait_for(sized(work, size, bound=INLINE_SCAN_CHARS), self.scan_timeout)
        except Exception as exc:  # fail closed: the content is withheld
            if isinstance(exc, TimeoutError):
                exc = ScanTimeout(f"the guardrails did not finish within {self.scan_timeout:g} s "
                                  "(limits.guardrail_scan_timeout)")
            log.error("inspection of %s failed", subject.source, exc_info=exc)
            return Scan(error=exc)

    def scan_now(self, subject: Subject, message: dict[str, Any], raw: bytes | None = None) -> Scan:
        """Strip forged `envelope/*` meta and run the subject's guardrails on `message` (in
        place). `raw`, the bytes it was parsed from, lets a message that cannot hold such a key
        skip the walk. Never raises: a guardrail failure is `Scan.error` (the caller withholds)."""
        scan = Scan()
        try:
            scan.malformed = ambiguous(message)
            if scan.malformed is not None:
                return scan
            if not message.keys() <= MEMBERS:
                scan.changed = drop_foreign_members(message)
            if raw is None or may_name_envelope(raw):
                scan.stripped = strip_envelope_meta(message)
                scan.changed = scan.changed or scan.stripped
            payload = payload_of(message)
            if subject.rules and payload is not None:
                # A bare string payload (`"result": "..."`) is scanned too: some client shows it.
                boxed = payload if isinstance(payload, dict | list) else [payload]
                scan.guarded = scan_payload(boxed, subject.rules)
                scan.changed = scan.changed or scan.guarded.changed
                if boxed is not payload and scan.guarded.changed:
                    message[next(k for k in ("result", "error", "params") if k in message)] = boxed[0]
        except Exception as exc:  # fail closed: content that could not be checked is withheld
            log.error("inspection of %s failed", subject.source, exc_info=exc)
            scan.error = exc
        return scan

    # -- the ledger -----------------------------------------------------------------------

    async def delta(self, subject: Subject, message: Mapping[str, Any], *, handles: tuple[str, ...] = (),
                    pointed: bool = False, pick_secret: bytes | None = None) -> LedgerDelta:
        """What delivering `message` adds to the run's ledger (computed, not yet written): at
        most `max_output_chars` of it are fingerprinted (past that the run turns coarse), in a
        worker thread when it is large (`proxy.envelope.dataflow.offload`). `handles` and
        `pointed`: what the data-flow check found about the read (`ToolCall.read_endorses`),
        recorded only when some sink escalates; `pick_secret` (`dataflow.secret`) keys the
        signatures of the listing entries a word picks (None: none is recorded as picked)."""
        policy = self.dataflow
        payload = payload_of(message)
        # Trusted content is read only when some sink escalates tainted runs (it endorses).
        trusted = self.escalates
        if subject.tool_result and "result" in message and isinstance(payload, Mapping):
            labels = subject.labels
            if labels.paths:
                # A text that may be structuredContent's copy is read twice to tell (orjson,
                # then Python's exact parse, ~80 µs per KB: `labels.pieces`): off the event
                # loop past INLINE_SCAN_CHARS of such text, as the guardrails' scan is.
                def read() -> list[Piece]:
                    return list(result_pieces(payload, labels, trusted))

                found: Iterable[Piece] = await sized(read, copy_chars(payload, INLINE_SCAN_CHARS),
                                                     bound=INLINE_SCAN_CHARS)
            else:
                found = result_pieces(payload, labels, trusted)
        else:
            found = all_pieces(payload, subject.labels.base, subject.source, trusted)
        return await delta_of(subject.source, found, policy.min_match, limit=policy.ledger_cap,
                              window=policy.winnow, max_chars=policy.max_output_chars,
                              min_value=policy.min_value, trusted=trusted,
                              handles=handles if trusted else (), pointed=pointed and trusted,
                              pick_secret=pick_secret if trusted else None)

    async def mark(self, store: Store, recent: RecentWrites, run: RunContext, decision_id: str,
                   deadline: float) -> None:
        """Say in the run's ledger that an output of the call `decision_id` is on its way
        (`ledger.mark_pending`). Raises StoreError (or TimeoutError) when the store cannot."""
        await mark_pending(store, run.key, decision_id, deadline, ttl=self.dataflow.ledger_ttl, recent=recent)

    async def record(self, store: Store, recent: RecentWrites, run: RunContext, delta: LedgerDelta,
                     done: str | None = None) -> None:
        """Write `delta` to the run's ledger (and widen its ancestors'), then clear the pending
        marker `done`. Raises StoreError (or TimeoutError) when the store cannot take it."""
        policy = self.dataflow
        kw: dict[str, Any] = {"n": policy.min_match, "cap": policy.ledger_cap,
                              "ttl": policy.ledger_ttl, "window": policy.winnow,
                              "min_value": policy.min_value, "recent": recent}
        if delta.empty and done is None:
            return
        await record(store, run.key, delta, done=done, **kw)
        if not delta.empty:
            for ancestor in ancestors(run):
                await widen_parent(store, ancestor, delta, **kw)


def ancestors(run: RunContext) -> tuple[str, ...]:
    """The store keys of the runs whose ledgers a run's output widens besides its own:
    `run.taint_targets` when the delegation check set it (already cut at `propagate_taint:
    false`), else the direct parent as a run of the same principal (never another's)."""
    if run.taint_targets is not None:
        return tuple(run.taint_targets)
    return (run_key(run.principal, run.parent),) if run.parent else ()
