"""Anchors: the audit chain's head kept outside the log, so a cut or rewritten log is detected.

A hash chain alone cannot show that records were removed from the end of the newest file, or
that the whole log was rewritten with every hash recomputed (`proxy.audit.verify`). A head
published elsewhere can: the running proxy serves its head (`GET /v1/audit/head` on the admin
listener) and logs it to the process log every `audit.anchor_interval` when it moved (and once
more at shutdown), one line

    ... INFO proxy.audit.anchor: audit head {"chain":"audit","records":12,"hash":"sha256:...","file":"audit.jsonl","ts":"..."}

which a log shipper carries off the machine. `envelope-proxy audit verify <dir> --anchor HASH`
(or `--anchors FILE` of such lines) then proves that the anchored record is still in the chain.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import orjson

from proxy.audit.log import GENESIS, AuditLog
from proxy.errors import AuditError

log = logging.getLogger(__name__)

HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
# What precedes the head's JSON on a process log line.
HEAD_MESSAGE = "audit head"


@dataclass(frozen=True)
class Anchor:
    """A chain head kept elsewhere: the hash is what is checked, the rest says where it came from."""

    hash: str
    chain: str | None = None
    ts: str | None = None
    source: str | None = None  # `file:line` of an anchors file, None for `--anchor`

    def describe(self) -> str:
        """The anchor as a person finds it again: hash, then chain, time and origin when known."""
        known = [f"chain {self.chain}" if self.chain else "", self.ts or "",
                 f"from {self.source}" if self.source else ""]
        context = ", ".join(part for part in known if part)
        return f"{self.hash} ({context})" if context else self.hash


def parse_hash(text: str) -> str:
    """An anchor given as a bare hash (`--anchor`); ValueError unless `sha256:` + 64 hex digits."""
    value = text.strip()
    if not HASH_RE.fullmatch(value):
        raise ValueError(f"not an audit hash: {text!r} (expected sha256: and 64 lower-case hex digits)")
    return value


def parse_line(line: str, source: str | None = None) -> Anchor:
    """One anchor from a head as served (a JSON object) or as logged (text, then that object).

    ValueError when the line holds no JSON object with a valid `hash`.
    """
    start = line.find("{")
    if start < 0:
        raise ValueError("no JSON object (a head as served by /v1/audit/head or logged as "
                         f"{HEAD_MESSAGE!r})")
    try:
        head = orjson.loads(line[start:])
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(head, dict) or not isinstance(head.get("hash"), str):
        raise ValueError("no \"hash\" in the object")
    chain, ts = head.get("chain"), head.get("ts")
    return Anchor(hash=parse_hash(head["hash"]), chain=chain if isinstance(chain, str) else None,
                  ts=ts if isinstance(ts, str) else None, source=source)


def read_anchors(path: Path) -> list[Anchor]:
    """Every anchor of a file of heads, one a line (blank lines skipped).

    ValueError naming `file:line` for a line that is not a head, or when the file cannot be
    read: an anchor silently skipped would leave a cut log undetected.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read anchors: {exc}") from None
    anchors = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            where = f"{path}:{number}"
            try:
                anchors.append(parse_line(line, where))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
    return anchors


class HeadPublisher:
    """Logs one audit log's head to the process log (INFO) when it moved since last logged."""

    def __init__(self, audit: AuditLog) -> None:
        self._audit = audit
        self._published: str | None = None

    def publish(self) -> None:
        """Log the head unless it was logged already or the log is empty. An unreadable head
        (the log is not writable) is not logged: the log's own error says why, and a stale
        head must not pass for the current one."""
        try:
            head = self._audit.head()
        except AuditError:
            return
        if head["hash"] in (self._published, GENESIS):
            return
        log.info("%s %s", HEAD_MESSAGE, orjson.dumps(head).decode())
        self._published = head["hash"]

    async def run(self, interval: float) -> None:
        """Publish every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.publish()
