"""Read audit logs back: filter records (`query_records`) and follow a live log (`Follower`).

Reading is streaming: files are read one at a time (a file's lines fully, never all files at
once). Newest first, each log is read from its current file back through its rotated files,
and a file's lines in reverse; several logs in one directory (one per worker) are merged by
`ts`. Rotated files whose rotation time is before `since` are skipped without being opened.

Query is not verification: lines that are not JSON objects are skipped silently here;
`proxy.audit.verify` is what proves a log intact.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from proxy.approvals.reveal import visible
from proxy.audit.log import _TS_FORMAT, ROTATED_RE, rotated_files

_CURRENT_RE = re.compile(r"^(?P<name>.+)\.jsonl$")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
# The record fields the exact-match filters of `query_records` compare.
FILTER_FIELDS = ("principal", "run", "upstream", "tool", "verdict", "code", "decision_id")


# -- time ----------------------------------------------------------------------------------


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """An aware UTC datetime from RFC 3339 (`2026-01-02T03:04:05Z`, a date, an offset) or a
    relative time back from `now`: `90s`, `15m`, `1h`, `2d`, `1w`. ValueError otherwise.

    A time without an offset is taken as UTC.
    """
    s = text.strip()
    m = _RELATIVE.match(s)
    try:
        if m:
            base = now if now is not None else datetime.now(UTC)
            return _utc(base) - timedelta(seconds=float(m.group(1)) * _UNIT_SECONDS[m.group(2)])
        return _utc(datetime.fromisoformat(s.replace("z", "Z")))
    except OverflowError:
        # `99999999999999d`, or `9999-12-31T23:00:00-23:59` (past year 9999 in UTC).
        raise ValueError(f"not a time: {text!r} is outside years 1 to 9999") from None
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (use RFC 3339 like 2026-01-02T03:04:05Z, or 30m, 1h, 2d)"
        ) from None


def _utc(dt: datetime) -> datetime:
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def ts_key(dt: datetime) -> str:
    """A datetime in the audit `ts` format: such strings compare in time order."""
    return _utc(dt).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- files ---------------------------------------------------------------------------------


def log_names(directory: Path) -> list[str]:
    """The names of the logs in a directory (`audit`, `audit-w0`, ...), sorted."""
    names: set[str] = set()
    for p in Path(directory).glob("*.jsonl"):
        m = ROTATED_RE.match(p.name) or _CURRENT_RE.match(p.name)
        if m:
            names.add(m.group("name"))
    return sorted(names)


def log_files(directory: Path, name: str) -> list[Path]:
    """One log's files oldest first: rotated ones, then the current `<name>.jsonl` if any."""
    files = rotated_files(Path(directory), name)
    current = Path(directory) / f"{name}.jsonl"
    if current.exists():
        files.append(current)
    return files


def _rotated_at(path: Path) -> str | None:
    """The rotation time of a rotated file, in `ts` format (its records are all older)."""
    m = ROTATED_RE.match(path.name)
    if not m:
        return None
    try:
        return ts_key(datetime.strptime(m.group("ts"), _TS_FORMAT))
    except ValueError:
        return None


def _parse(line: bytes) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


def _file_lines(path: Path) -> list[bytes]:
    """A file's lines (read fully); [] when it vanished (rotated or deleted meanwhile)."""
    try:
        with open(path, "rb") as fh:
            return fh.read().split(b"\n")
    except FileNotFoundError:
        return []


def _log_records(
    directory: Path, name: str, newest_first: bool, since: str | None
) -> Iterator[dict[str, Any]]:
    files = log_files(directory, name)
    if since is not None:
        # A rotated file holds only records written before its rotation time.
        files = [f for f in files if (r := _rotated_at(f)) is None or r >= since]
    if newest_first:
        for f in reversed(files):
            for line in reversed(_file_lines(f)):
                rec = _parse(line)
                if rec is not None:
                    yield rec
    else:
        for f in files:
            try:
                fh = open(f, "rb")
            except FileNotFoundError:
                continue
            with fh:
                for line in fh:
                    rec = _parse(line)
                    if rec is not None:
                        yield rec


def _ts(rec: Mapping[str, Any]) -> str:
    ts = rec.get("ts")
    return ts if isinstance(ts, str) else ""


def iter_records(
    directory: Path, *, newest_first: bool = True, since: datetime | None = None
) -> Iterator[dict[str, Any]]:
    """Every record of every log in `directory` (rotated files too), lazily, in `ts` order
    (newest first or oldest first). Only the files currently being read are in memory."""
    since_key = ts_key(since) if since is not None else None
    streams = [_log_records(directory, n, newest_first, since_key) for n in log_names(directory)]
    if len(streams) == 1:
        return streams[0]
    return heapq.merge(*streams, key=_ts, reverse=newest_first)


def matcher(
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    **fields: str | None,
) -> Any:
    """A predicate over records for the given filters (None: no condition). `since` is
    inclusive, `until` exclusive; the other fields must equal the record's field."""
    unknown = set(fields) - set(FILTER_FIELDS)
    if unknown:
        raise TypeError(f"unknown filter(s): {', '.join(sorted(unknown))}")
    wanted = [(k, v) for k, v in fields.items() if v is not None]
    lo = ts_key(since) if since is not None else None
    hi = ts_key(until) if until is not None else None

    def match(rec: Mapping[str, Any]) -> bool:
        if lo is not None or hi is not None:
            ts = _ts(rec)
            if (lo is not None and ts < lo) or (hi is not None and ts >= hi):
                return False
        return all(rec.get(k) == v for k, v in wanted)

    return match


def query_records(
    directory: Path,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    principal: str | None = None,
    run: str | None = None,
    upstream: str | None = None,
    tool: str | None = None,
    verdict: str | None = None,
    code: str | None = None,
    decision_id: str | None = None,
    limit: int = 100,
    newest_first: bool = True,
) -> list[dict]:
    """The parsed audit records of `directory` (every log, rotated files too) that match every
    given filter, at most `limit` of them (`limit <= 0`: all), newest first by default.

    `since` (inclusive) and `until` (exclusive) compare with the record's `ts`; naive datetimes
    are UTC. The other filters are exact matches on the record field of the same name. Records
    are returned as written (with `v`, `prev`, `hash`). A missing directory gives [].
    Reading stops as soon as `limit` records are found.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    match = matcher(
        since=since, until=until, principal=principal, run=run, upstream=upstream, tool=tool,
        verdict=verdict, code=code, decision_id=decision_id,
    )
    until_key = ts_key(until) if until is not None else None
    since_key = ts_key(since) if since is not None else None
    out: list[dict[str, Any]] = []
    for rec in iter_records(directory, newest_first=newest_first, since=since):
        if match(rec):
            out.append(rec)
            if 0 < limit <= len(out):
                break
        # Time-ordered streams: past the end of the window nothing further can match.
        elif not newest_first and until_key is not None and _ts(rec) >= until_key:
            break
        elif newest_first and since_key is not None and _ts(rec) and _ts(rec) < since_key:
            break
    return out


# -- follow --------------------------------------------------------------------------------


@dataclass
class _Tail:
    path: Path
    fh: BinaryIO | None = None
    ino: int | None = None
    buf: bytes = b""
    seen_eof: bool = field(default=False)


class Follower:
    """New records of the logs of a directory as they are written (`tail -f`).

    Starts at the current end of every `<name>.jsonl`. When a file is rotated (renamed aside
    and a new `<name>.jsonl` started), the rest of the old file is read through the open
    descriptor, then the new file from its start; a log that appears later is read from its
    start. `poll()` returns what was completed since the last call (partial lines wait).
    """

    def __init__(self, directory: Path) -> None:
        self._dir = Path(directory)
        self._tails: dict[str, _Tail] = {}
        for name in log_names(self._dir):
            t = _Tail(self._dir / f"{name}.jsonl")
            self._open(t, at_end=True)
            self._tails[name] = t

    def _open(self, t: _Tail, at_end: bool) -> None:
        try:
            fh = open(t.path, "rb")
        except FileNotFoundError:
            t.fh, t.ino = None, None
            return
        st = os.fstat(fh.fileno())
        if at_end:
            fh.seek(st.st_size)
        t.fh, t.ino, t.buf = fh, st.st_ino, b""

    def _read(self, t: _Tail) -> list[bytes]:
        assert t.fh is not None
        data = t.fh.read()
        if not data:
            return []
        parts = (t.buf + data).split(b"\n")
        t.buf = parts.pop()
        return parts

    def _rotated_after(self, name: str, ino: int | None) -> list[bytes]:
        """The lines of the rotated files of `name` newer than the one with inode `ino`."""
        files = rotated_files(self._dir, name)
        for i, f in enumerate(files):
            try:
                if os.stat(f).st_ino == ino:
                    return [ln for g in files[i + 1 :] for ln in _file_lines(g)]
            except FileNotFoundError:
                continue
        return []

    def poll(self) -> list[dict[str, Any]]:
        """Records completed since the last poll, in `ts` order."""
        for name in log_names(self._dir):
            if name not in self._tails:
                self._tails[name] = _Tail(self._dir / f"{name}.jsonl")
        out: list[dict[str, Any]] = []
        for name, t in self._tails.items():
            lines: list[bytes] = []
            if t.fh is None:
                self._open(t, at_end=False)
                if t.fh is None:
                    continue
            lines += self._read(t)
            try:
                ino: int | None = os.stat(t.path).st_ino
            except FileNotFoundError:
                ino = None
            if ino != t.ino:
                # Rotated away: finish the old file, read any file rotated after it (several
                # rotations between two polls), then start on the new current one.
                lines += self._read(t)
                if t.buf:
                    lines.append(t.buf)
                with contextlib.suppress(OSError):
                    t.fh.close()
                old_ino, t.fh, t.ino, t.buf = t.ino, None, None, b""
                lines += self._rotated_after(name, old_ino)
                if ino is not None:
                    self._open(t, at_end=False)
                    lines += self._read(t)
            out.extend(r for r in map(_parse, lines) if r is not None)
        out.sort(key=_ts)
        return out

    def close(self) -> None:
        for t in self._tails.values():
            if t.fh is not None:
                with contextlib.suppress(OSError):
                    t.fh.close()
                t.fh = None

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



# -- output --------------------------------------------------------------------------------

# (header, width); the last column (reason) takes what is left of `width`.
_COLUMNS = (
    ("TIME", 27),
    ("DECISION", 32),  # whole: it is what --decision-id takes
    ("PRINCIPAL", 16),
    ("UPSTREAM.TOOL", 28),
    ("VERDICT", 7),
    ("CODE", 18),
    ("RULE", 16),
    ("REASON", 0),
)


def _cut(text: str, width: int) -> str:
    # One line per record, whatever the reason holds; nothing a terminal would obey (escape
    # sequences in a run id or an argument quoted in a reason) or that hides text.
    text = visible(" ".join(text.split()))
    if width <= 0 or len(text) <= width:
        return text
    return text[: width - 1] + "…"


def _cells(rec: Mapping[str, Any]) -> list[str]:
    def s(key: str) -> str:
        v = rec.get(key)
        return "-" if v is None else str(v)

    return [s("ts"), s("decision_id"), s("principal"), f"{s('upstream')}.{s('tool')}",
            s("verdict"), s("code"), s("rule"), s("reason")]


def table_header(width: int = 160) -> str:
    return _row([h for h, _ in _COLUMNS], width)


def table_row(rec: Mapping[str, Any], width: int = 160) -> str:
    """One record as a table row: columns truncated to fixed widths (reason: the rest)."""
    return _row(_cells(rec), width)


def _row(cells: list[str], width: int) -> str:
    parts = [_cut(c, w).ljust(w) for c, (_, w) in zip(cells[:-1], _COLUMNS[:-1], strict=True)]
    used = sum(w + 2 for _, w in _COLUMNS[:-1])
    parts.append(_cut(cells[-1], max(width - used, 20)))
    return "  ".join(parts).rstrip()


def json_line(rec: Mapping[str, Any]) -> str:
    """One record as a JSON line (sorted keys): the same JSON as written, with the characters a
    terminal would obey or hide (C1 controls such as U+009B, bidi overrides, zero-width ones;
    orjson escapes only those below U+0020) and look-alike letters written as `\\uXXXX` escapes
    (`reveal.visible`: outside strings a record's JSON is plain ASCII)."""
    return visible(orjson.dumps(rec, option=orjson.OPT_SORT_KEYS).decode())
