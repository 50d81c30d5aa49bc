"""Verify an audit log's hash chain and name the first bad record.

What a hash chain proves, and what it cannot:

- A file's last line cut short (no newline, not JSON) is a write a crash interrupted, not a
  problem: it is listed in `torn` and the chain goes on from the record before it (a proxy
  restarted on it continued from there, so the next file's first `prev` names that record;
  anything else there is reported as a deletion).
- An edited record (its hash no longer matches its content), a record deleted, inserted or
  reordered in the middle (a `prev` no longer matches the hash before it), a rotated file
  deleted (the next file's first `prev` no longer matches), and records removed from the
  start of a log (the first `prev` is not the genesis hash) are all detected.
- Removing records from the END of the newest file (or the newest file whole) leaves a
  shorter but intact chain: a hash chain alone cannot detect it. Neither can a wholesale
  rewrite by someone who recomputes every hash. Both need an anchor kept elsewhere: a head the
  proxy published (`proxy.audit.anchor`), given to `verify` as `anchors`, must be the hash of
  a record in the chain; one that is not means the log was cut below it or rewritten.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from proxy.audit.log import GENESIS, ROTATED_RE, record_hash, rotated_files

_CURRENT_RE = re.compile(r"^(?P<name>.+)\.jsonl$")


@dataclass
class VerifyResult:
    """The outcome of `verify`: ok, or the first problem with its file and 1-based line."""

    ok: bool
    records: int
    files: list[str] = field(default_factory=list)
    problem: str | None = None
    file: str | None = None
    line: int | None = None
    # Per anchor found in an intact chain: how many records of its chain follow it.
    after: dict[str, int] = field(default_factory=dict)
    # Per anchor found in a directory: the names of the logs holding it (every log for the
    # genesis hash). A head names its log (`chain`): found in another log, it proves nothing
    # of its own, since whoever rewrites one log can add a copy of it under another name.
    logs: dict[str, set[str]] = field(default_factory=dict)
    # Last lines cut short (no newline, not JSON: a write a crash interrupted), as "file:line".
    # Not a problem: the proxy restarted on such a file sets it aside and continues the chain
    # from the last intact record, which the next file's first `prev` must then name.
    torn: list[str] = field(default_factory=list)


def verify(path: Path, anchors: Iterable[str] = ()) -> VerifyResult:
    """Verify one file or every log in a directory; stop at the first bad record.

    A single file may start anywhere (it may be a rotated continuation). In a directory each
    log (`<name>-<ts>.jsonl`... then `<name>.jsonl`) must start at genesis and continue from
    file to file. Never raises for a damaged log; an unreadable file is reported as a problem.
    `anchors` (record hashes kept elsewhere) found in the chain are in `after` (and, in a
    directory, the logs holding them in `logs`); one missing there while `ok`, or found only
    in a log other than the one its head names, is the log cut below it or rewritten (the
    caller reports it).
    """
    path = Path(path)
    chains: dict[str | None, list[Path]]
    if path.is_dir():
        chains = dict(_chains(path))
        if not chains:
            return VerifyResult(False, 0, [], f"no audit log files (*.jsonl) in {path}")
    elif path.exists():
        chains = {None: [path]}
    else:
        return VerifyResult(False, 0, [], f"no such file or directory: {path}")

    wanted = frozenset(anchors)
    result = VerifyResult(True, 0, [])
    for name, chain in chains.items():
        # A directory holds whole logs: they start at genesis. A lone file may not.
        expected: str | None = GENESIS if path.is_dir() else None
        prev_file: str | None = None
        # Anchor -> records verified (over every chain) up to and including it.
        found = {GENESIS: result.records} if expected in wanted else {}
        for file in chain:
            result.files.append(str(file))
            expected = _verify_file(file, expected, prev_file, result, wanted, found)
            if not result.ok:
                return result
            prev_file = file.name
        result.after.update((h, result.records - at) for h, at in found.items())
        if name is not None:
            for h in found:
                result.logs.setdefault(h, set()).add(name)
    return result


def _chains(directory: Path) -> list[tuple[str, list[Path]]]:
    """Per log name (sorted): rotated files oldest first, then the current file."""
    names: set[str] = set()
    for p in directory.glob("*.jsonl"):
        m = ROTATED_RE.match(p.name) or _CURRENT_RE.match(p.name)
        if m:
            names.add(m.group("name"))
    chains = []
    for name in sorted(names):
        files = rotated_files(directory, name)
        current = directory / f"{name}.jsonl"
        if current.exists():
            files.append(current)
        chains.append((name, files))
    return chains


def _verify_file(
    file: Path, expected: str | None, prev_file: str | None, result: VerifyResult,
    wanted: frozenset[str], found: dict[str, int],
) -> str | None:
    """Check one file, continuing from `expected` (None: accept any first prev); note in
    `found` where each `wanted` hash is.

    Returns the hash the next file must continue from; on a problem sets it on `result`.
    """

    def bad(line: int, problem: str) -> None:
        result.ok = False
        result.file = str(file)
        result.line = line
        result.problem = f"line {line}: {problem}"

    try:
        fh = open(file, "rb")
    except OSError as e:
        result.ok = False
        result.file = str(file)
        result.problem = f"cannot read: {e}"
        return expected
    with fh:
        lineno = 0
        for lineno, raw, whole in _numbered(fh):
            try:
                rec = orjson.loads(raw)
            except orjson.JSONDecodeError:
                if not whole:  # the last line, cut short: the chain goes on from the one before
                    result.torn.append(f"{file}:{lineno}")
                    return expected
                bad(lineno, "not valid JSON")
                return expected
            if (
                not isinstance(rec, dict)
                or not isinstance(rec.get("hash"), str)
                or not isinstance(rec.get("prev"), str)
            ):
                bad(lineno, "not an audit record (no hash or prev)")
                return expected
            if record_hash(rec) != rec["hash"]:
                bad(lineno, "hash does not match the record's content (record edited)")
                return expected
            if expected is not None and rec["prev"] != expected:
                if lineno > 1:
                    bad(
                        lineno,
                        f"prev does not match the hash of line {lineno - 1} "
                        "(a record was deleted, inserted or reordered)",
                    )
                elif prev_file is not None:
                    bad(
                        lineno,
                        f"prev does not match the hash of the last record of {prev_file} "
                        "(a file or records were deleted, inserted or reordered)",
                    )
                else:
                    bad(lineno, "chain does not start at genesis (records before it were removed)")
                return expected
            expected = rec["hash"]
            result.records += 1
            if expected in wanted:
                found[expected] = result.records
    return expected


def _numbered(lines: Iterable[bytes]) -> Iterable[tuple[int, bytes, bool]]:
    """(1-based number, line without its newline, whether it ended with one: only the last
    line of a file may not)."""
    for n, raw in enumerate(lines, 1):
        whole = raw.endswith(b"\n")
        yield n, raw[:-1] if whole else raw, whole
