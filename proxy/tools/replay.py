"""Decision recording and replay: re-decide recorded traffic under another policy.

`Recorder` (`serve --record FILE`, or `record: {path: FILE}` in the runtime config) appends one
JSON line per audited `tools/call` decision with everything needed to decide it again: the
principal (id, groups, **claims**: verified JWT claims, possibly sensitive), the run, the request
info, upstream, tool, full arguments, what the upstream announced for the tool, the result's
labels and digest (never the result itself), the decision and the policy revision. It writes
like the audit log (append, flushed to the OS per line, optional fsync) but it is not the audit
log: a line that cannot be written is logged and counted
(`envelope_record_failures_total`), and the call goes on.

`replay` re-decides every line with the same `Chain` the proxy builds (`load_policy`, a
`ToolRegistry` filled from the recorded announcements, `Services` with an empty `MemoryStore`)
and reports what changed. Stateful checks are decided statically: a call that reaches the
approval gate is "needs approval" (`approval_pending`) at once, without waiting; idempotency and
shadow run against the empty store (a run's sticky shadow flag, which is client state, is
carried over from the recording). Recorded outcomes that only the state decided (an approved,
denied or expired approval; an idempotent replay or in-flight duplicate) are compared as "needs
approval" and "allowed" respectively; so are rate-limit refusals (replay runs
faster than the recorded traffic, so its buckets run dry where the recording's did not).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orjson

from proxy.approvals.reveal import visible
from proxy.audit.record import utc_timestamp
from proxy.envelope.types import (
    Code,
    Decision,
    Principal,
    RequestInfo,
    RunContext,
    Services,
    ToolCall,
    Verdict,
)

if TYPE_CHECKING:
    from proxy.config import Config
    from proxy.envelope.pipeline import Chain, Pending
    from proxy.policy.compiled import PolicyRevision

log = logging.getLogger("envelope.record")

RECORD_VERSION = 1
_OPT = orjson.OPT_SORT_KEYS


# ---- recording ------------------------------------------------------------------------------


def result_digest(result: Any) -> str:
    """"sha256:<hex>" of the canonical JSON (sorted keys, no spaces) of a tool result."""
    return "sha256:" + hashlib.sha256(orjson.dumps(result, option=_OPT)).hexdigest()


def _decision_json(decision: Decision) -> dict[str, Any]:
    return {
        "verdict": decision.verdict.value,
        "code": decision.code.value,
        "check": decision.check,
        "rule": decision.rule,
        "reason": decision.reason,
    }


def _policy_shadow(chain: Chain | None, call: ToolCall) -> bool:
    """Whether the (recording) policy itself puts this call's run in shadow mode."""
    if chain is None:
        return False
    principal = chain.revision.principals.get(call.principal.id)
    tool = chain.revision.tools.get(call.qualified_name)
    return bool((principal is not None and principal.policy.mode == "shadow")
                or (tool is not None and tool.policy.mode == "shadow"))


def build_line(
    pending: Pending,
    decision: Decision,
    reply: Mapping[str, Any] | None,
    *,
    include_claims: bool = True,
) -> dict[str, Any]:
    """The record of one decided call (see the module docstring and the README for fields).

    `decision` is the call's final decision (upstream failures included); the envelope's own
    decision, the one replay compares against, is `pending.decision`.
    """
    call = pending.call
    chain = pending.chain
    run = call.run
    info = call.upstream_tool
    tool_policy = chain.revision.tools.get(call.qualified_name) if chain is not None else None
    result: Any = None
    if isinstance(reply, Mapping) and "result" in reply:
        result = reply["result"]
    elif decision.result is not None:
        result = decision.result
    result_info: dict[str, Any] | None = None
    if result is not None:
        output = tool_policy.policy.output if tool_policy is not None else None
        result_info = {
            "digest": result_digest(result),
            "is_error": bool(isinstance(result, Mapping) and result.get("isError")),
            "labels": {"output": output or "untrusted", "source": "policy" if output else "default"},
        }
    extra = {**call.audit_extra, **(decision.audit or {})}
    return {
        "v": RECORD_VERSION,
        "time": utc_timestamp(),
        "decision_id": call.decision_id,
        "revision": chain.revision.revision if chain is not None else "none",
        "principal": {
            "id": call.principal.id,
            "groups": list(call.principal.groups),
            "claims": dict(call.principal.claims) if include_claims else None,
            "source": call.principal.source,
        },
        "run": {
            "id": run.id,
            "parent": run.parent,
            "depth": run.depth,
            "shadow": run.shadow,
            "tainted": run.tainted,
            "secret": run.secret,
            "session": run.session,
            # Shadow because of the run's sticky flag (client state), not the request or policy.
            "shadow_sticky": bool(run.shadow and not call.shadow_requested
                                  and not _policy_shadow(chain, call)),
        },
        "request": {
            "method": call.request.method,
            "protocol_version": call.request.protocol_version,
            "headers": dict(call.request.headers),
        },
        "shadow_requested": call.shadow_requested,
        "idempotency_key": call.idempotency_key,
        "upstream": call.upstream,
        "tool": call.tool,
        "effect": call.effect.value if call.effect is not None else None,
        "arguments": call.arguments,
        "announced": None if info is None else {
            "inputSchema": dict(info.input_schema) if info.input_schema is not None else None,
            "annotations": dict(info.annotations),
        },
        "decision": _decision_json(pending.decision),
        "outcome": _decision_json(decision),
        "extra": extra,
        "result": result_info,
    }


class Recorder:
    """Appends decision records to one JSONL file. Never raises from `record`.

    Like the audit log, each line goes to the OS in one `write` on an O_APPEND descriptor before
    `record` returns (fsynced when `fsync`). Unlike it, a failure does not refuse calls: it is
    logged, counted (`failures`, and `envelope_record_failures_total` when given a metrics
    registry) and the file is reopened on the next record.
    """

    def __init__(self, path: Path, *, fsync: bool = False, include_claims: bool = True,
                 registry: Any = None) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.include_claims = include_claims
        self.records = 0
        self.failures = 0
        self._fd = -1
        self._counter: Any = None
        if registry is not None:
            from prometheus_client import Counter

            self._counter = Counter(
                "envelope_record_failures", "Decision records (serve --record) that could not be "
                "written; the calls went on.", registry=registry)
        try:
            self._open()
        except OSError as exc:  # the proxy still serves; every record will retry the open
            self._failed(f"cannot open {self.path}: {exc}")

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _failed(self, message: str) -> None:
        self.failures += 1
        if self._counter is not None:
            self._counter.inc()
        log.error("decision record not written (recording continues; calls are not refused): %s",
                  message)

    def record(self, pending: Pending, decision: Decision,
               reply: Mapping[str, Any] | None = None) -> None:
        """Append the record of one decided call; log and count any failure."""
        try:
            line = orjson.dumps(build_line(pending, decision, reply,
                                           include_claims=self.include_claims),
                                option=_OPT | orjson.OPT_APPEND_NEWLINE)
        except Exception as exc:  # a record that cannot be built is a recording failure only
            self._failed(f"decision {pending.call.decision_id}: {type(exc).__name__}: {exc}")
            return
        try:
            if self._fd < 0:
                self._open()
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"short write ({written} of {len(line)} bytes)")
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._close_fd()
            self._failed(f"decision {pending.call.decision_id}: {self.path}: {exc}")
            return
        self.records += 1

    def _close_fd(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def close(self) -> None:
        self._close_fd()


def open_recorder(config: Config, worker: int = 0, registry: Any = None) -> Recorder | None:
    """The recorder the runtime config asks for, or None. With several workers each writes its
    own `<stem>-w<worker><suffix>` (one writer per file, like the audit log)."""
    rc = config.record
    if rc is None:
        return None
    path = Path(rc.path)
    if config.workers > 1:
        path = path.with_name(f"{path.stem}-w{worker}{path.suffix}")
    return Recorder(path, fsync=rc.fsync, include_claims=rc.claims, registry=registry)


# ---- replay ---------------------------------------------------------------------------------


class RecordError(Exception):
    """The record file cannot be read; the message names file:line."""


def load_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a file, in order. A truncated last line (a crash mid-write) is skipped."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RecordError(f"{path}: cannot read: {exc}") from exc
    lines = data.split(b"\n")
    records: list[dict[str, Any]] = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if n == len(lines) and not data.endswith(b"\n"):
                log.warning("%s:%d: truncated last record skipped", path, n)
                continue
            raise RecordError(f"{path}:{n}: not JSON: {exc}") from exc
        if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
            raise RecordError(f"{path}:{n}: not a version {RECORD_VERSION} decision record")
        for key in ("upstream", "tool", "principal", "run", "decision"):
            if key not in rec:
                raise RecordError(f"{path}:{n}: record lacks {key!r}")
        rec["_line"] = n
        records.append(rec)
    return records


def call_from_record(rec: Mapping[str, Any]) -> ToolCall:
    """The `ToolCall` as the front built it (before any check ran)."""
    p = rec["principal"]
    r = rec["run"]
    q = rec.get("request") or {}
    return ToolCall(
        decision_id=str(rec.get("decision_id") or ""),
        upstream=rec["upstream"],
        tool=rec["tool"],
        arguments=dict(rec.get("arguments") or {}),
        principal=Principal(id=p["id"], groups=tuple(p.get("groups") or ()),
                            claims=dict(p.get("claims") or {}), source=p.get("source", "static")),
        # `shadow` is set by the shadow check during the decision: the front starts without it.
        run=RunContext(id=r["id"], principal=p["id"], parent=r.get("parent"), depth=int(r.get("depth") or 0),
                       tainted=bool(r.get("tainted")), secret=bool(r.get("secret")),
                       session=r.get("session")),
        request=RequestInfo(method=q.get("method", "tools/call"),
                            protocol_version=q.get("protocol_version", ""),
                            headers=dict(q.get("headers") or {})),
        idempotency_key=rec.get("idempotency_key"),
        shadow_requested=bool(rec.get("shadow_requested")),
    )


_NOT_PERFORMED = Decision(Verdict.ERROR, Code.INTERNAL_ERROR, "replay", "not performed (replay)")


class Replayer:
    """Decides recorded calls under one policy revision with the proxy's own chain."""

    def __init__(self, revision: PolicyRevision, config: Config | None = None) -> None:
        from proxy.config import Config
        from proxy.envelope.pipeline import Chain
        from proxy.envelope.tools import ToolRegistry
        from proxy.store.memory import MemoryStore

        config = config or Config()
        # Duplicates never wait for a first call that replay never performs.
        config = config.model_copy(update={
            "idempotency": config.idempotency.model_copy(update={"wait": 0.0})})
        self.revision = revision
        self.registry = ToolRegistry()
        self.store = MemoryStore()
        self.services = Services(store=self.store, settings=config, hold_calls=False)
        self.chain = Chain(revision, self.registry, None, self.services)

    async def decide(self, rec: Mapping[str, Any]) -> Decision:
        announced = rec.get("announced")
        if isinstance(announced, Mapping):
            self.registry.learn(rec["upstream"], [{"name": rec["tool"], **announced}])
        call = call_from_record(rec)
        run = rec.get("run") or {}
        if run.get("shadow_sticky"):
            from proxy.envelope.checks.shadow import RUN_FLAG_TTL, RUN_NS, run_flag_key

            await self.store.put(RUN_NS, run_flag_key(call.run.key), orjson.dumps({"shadow": True}),
                                 ttl=RUN_FLAG_TTL)
        decision = await self.chain.run(call)
        # Nothing is performed: let result hooks release what the checks claimed (idempotency).
        for hook in call.on_result:
            try:
                await hook(call, _NOT_PERFORMED, None)
            except Exception as exc:  # a hook failure only leaves a claim behind
                log.debug("replay: result hook failed for %s: %s", call.decision_id, exc)
        return decision


# ---- comparing ------------------------------------------------------------------------------

ChangeKind = Literal["newly_refused", "newly_allowed", "changed"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """A decision as compared: stateful outcomes folded into what policy alone decides."""

    verdict: str
    code: str
    check: str
    rule: str | None

    @property
    def allowed(self) -> bool:
        return self.verdict == Verdict.ALLOW.value

    def show(self) -> str:
        where = f"{self.check}/{self.rule}" if self.rule else self.check
        return f"{self.code} ({where})"


_APPROVAL_CODES = frozenset({Code.APPROVAL_PENDING.value, Code.APPROVAL_DENIED.value,
                             Code.APPROVAL_EXPIRED.value, Code.STORE_UNAVAILABLE.value})


def outcome(decision: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> Outcome:
    """Normalize a decision (record JSON) for comparison.

    - Any outcome of the approval gate (pending, denied, expired, store down), and a call let
      through by an approval or grant, is "needs approval" (`approval_pending`, check approval).
    - Idempotency outcomes (a replayed result, a duplicate in flight, a key conflict, store
      down) were decided by state after every policy check passed: "allowed" (`ok`).
    - Rate-limit outcomes (an empty bucket, a spent run budget, a run's calls in flight) were
      decided by time and state, and replay runs faster than the traffic did: "allowed" (`ok`).
    """
    verdict, code = str(decision.get("verdict")), str(decision.get("code"))
    check, rule = str(decision.get("check")), decision.get("rule")
    extra = extra or {}
    if (check == "approval" and code in _APPROVAL_CODES) or (
            verdict == Verdict.ALLOW.value and ("approval_id" in extra or "grant_id" in extra)):
        return Outcome(Verdict.DENY.value, Code.APPROVAL_PENDING.value, "approval",
                       rule if check == "approval" else None)
    if check in ("idempotency", "rate_limit") or code == Code.REPLAYED.value:
        return Outcome(Verdict.ALLOW.value, Code.OK.value, "envelope", None)
    return Outcome(verdict, code, check, rule)


@dataclass(frozen=True, slots=True)
class Change:
    kind: ChangeKind
    line: int
    decision_id: str
    principal: str
    upstream: str
    tool: str
    old: Outcome
    new: Outcome
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "line": self.line, "decision_id": self.decision_id,
            "principal": self.principal, "upstream": self.upstream, "tool": self.tool,
            "old": dataclasses.asdict(self.old), "new": dataclasses.asdict(self.new),
            "reason": self.reason,
        }


def _rules_differ(old: Outcome, new: Outcome) -> bool:
    if old.rule == new.rule:
        return False
    # A call let through by an approval does not say which rule gated it.
    return not (old.code == Code.APPROVAL_PENDING.value and None in (old.rule, new.rule))


def compare(rec: Mapping[str, Any], new: Decision) -> Change | None:
    """How a re-decided call differs from its record; None when it does not."""
    old = outcome(rec["decision"], rec.get("extra"))
    new_json = _decision_json(new)
    now = outcome(new_json, new.audit)
    if old.allowed and not now.allowed:
        kind: ChangeKind = "newly_refused"
    elif now.allowed and not old.allowed:
        kind = "newly_allowed"
    elif (old.code, old.check) != (now.code, now.check) or _rules_differ(old, now):
        kind = "changed"
    else:
        return None
    return Change(kind, int(rec.get("_line", 0)), str(rec.get("decision_id") or ""),
                  str(rec["principal"].get("id")), str(rec["upstream"]), str(rec["tool"]),
                  old, now, new.reason)


@dataclass(slots=True)
class Report:
    revision: str
    recorded_revisions: list[str]
    total: int
    changes: list[Change]

    def counts(self) -> dict[str, int]:
        counts = {"newly_refused": 0, "newly_allowed": 0, "changed": 0}
        for c in self.changes:
            counts[c.kind] += 1
        counts["unchanged"] = self.total - len(self.changes)
        counts["total"] = self.total
        return counts

    def summary(self) -> str:
        c = self.counts()
        was = ", ".join(self.recorded_revisions) or "none"
        return (f"{c['total']} call(s) replayed under revision {self.revision} (recorded under "
                f"{was}): {c['newly_refused']} newly refused, {c['newly_allowed']} newly allowed, "
                f"{c['changed']} changed code, {c['unchanged']} unchanged")

    def as_json(self) -> dict[str, Any]:
        return {"revision": self.revision, "recorded_revisions": self.recorded_revisions,
                "summary": self.counts(), "changes": [c.as_json() for c in self.changes]}

    def text(self) -> str:
        labels = {"newly_refused": "NEWLY REFUSED", "newly_allowed": "NEWLY ALLOWED",
                  "changed": "CHANGED CODE"}
        # Principals, tools and reasons come from the recorded traffic: written for a terminal,
        # with no escape sequence or hidden character of a caller's (`reveal.visible`).
        lines = [
            visible(f"{labels[c.kind]:<13}  {c.upstream}.{c.tool}  principal={c.principal}  "
                    f"{c.old.show()} -> {c.new.show()}  line {c.line}  decision={c.decision_id}")
            for c in self.changes
        ]
        lines.append(self.summary())
        return "\n".join(lines)


async def replay(records: Iterable[Mapping[str, Any]], revision: PolicyRevision,
                 config: Config | None = None) -> Report:
    """Re-decide every record under `revision` and collect the differences."""
    replayer = Replayer(revision, config)
    changes: list[Change] = []
    seen: list[str] = []
    total = 0
    for rec in records:
        total += 1
        old_rev = str(rec.get("revision"))
        if old_rev not in seen:
            seen.append(old_rev)
        change = compare(rec, await replayer.decide(rec))
        if change is not None:
            changes.append(change)
    return Report(revision.revision, seen, total, changes)


def format_report(report: Report, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report.as_json(), indent=2, sort_keys=True)
    return report.text()
