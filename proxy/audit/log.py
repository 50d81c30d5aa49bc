"""The audit log writer: append-only JSONL with a SHA-256 hash chain, rotated by size and time.

Every line is one record carrying `prev` (the previous record's hash) and `hash`
("sha256:" + hex of the canonical JSON of the record without `hash`). The chain continues
across restarts and across rotated files, so `proxy.audit.verify` can prove a log untouched.

Rotation renames `<name>.jsonl` to `<name>-<UTC timestamp>.jsonl` and starts a new file whose
first record's `prev` is the last hash of the renamed one. It happens before a write that
would take the file past `max_bytes`, and (with `rotate_interval`) before the first write in a
new interval: intervals are aligned to the Unix epoch, so `24h` gives one file per UTC day and
`1h` one per hour. An idle log is not rotated until its next record.

One `AuditLog` is the only writer of its `<name>.jsonl` (an exclusive lock on `<name>.lock`
enforces it; workers use distinct names). It is synchronous and not thread-safe: it is called
on the event loop, and one line write is a few microseconds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from proxy.audit.record import utc_timestamp
from proxy.errors import AuditError

log = logging.getLogger(__name__)

GENESIS = "sha256:" + "0" * 64
_OPT = orjson.OPT_SORT_KEYS
# `<name>-YYYYmmddTHHMMSSffffff.jsonl`: lexical order is time order.
ROTATED_RE = re.compile(r"^(?P<name>.+)-(?P<ts>\d{8}T\d{12})\.jsonl$")
_TS_FORMAT = "%Y%m%dT%H%M%S%f"
_TAIL_CHUNK = 64 * 1024
# Space reserved (then released) by `check_writable` to prove the disk takes writes again.
_PROBE_BYTES = 64 * 1024


def sanitized(value: Any) -> Any:
    """`value` with every string JSON cannot hold (lone surrogates) backslash-escaped and every
    non-JSON value replaced by its repr; JSON values are kept as they are."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, Mapping):
        return {sanitized(k) if isinstance(k, str) else repr(k): sanitized(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [sanitized(v) for v in value]
    if value is None or isinstance(value, bool | int | float | orjson.Fragment):
        return value
    return repr(value)


def canonical(record: Mapping[str, Any]) -> bytes:
    """The bytes a record's hash is computed over: sorted keys, no spaces (orjson)."""
    return orjson.dumps(record, option=_OPT)


def record_hash(record: Mapping[str, Any]) -> str:
    """The `hash` a record must carry: over its canonical JSON without the `hash` key."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return "sha256:" + hashlib.sha256(canonical(body)).hexdigest()


def valid_line_hash(line: bytes) -> str | None:
    """The hash of a line if it is an intact record (parses, carries prev, hash matches)."""
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(rec, dict):
        return None
    h = rec.get("hash")
    if not isinstance(h, str) or not isinstance(rec.get("prev"), str):
        return None
    return h if record_hash(rec) == h else None


def rotated_files(directory: Path, name: str) -> list[Path]:
    """Rotated files of one log, oldest first."""
    found = []
    for p in directory.glob(f"{glob_escape(name)}-*.jsonl"):
        m = ROTATED_RE.match(p.name)
        if m and m.group("name") == name:
            found.append((m.group("ts"), p))
    return [p for _, p in sorted(found)]


def glob_escape(text: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", text)


def _lines_reversed(fh: BinaryIO, size: int) -> Iterator[bytes]:
    """Lines of a file from the end, reading backwards in chunks (never the whole file).

    The first item is whatever follows the last newline (b"" when the file ends with one).
    """
    pos = size
    # The line being read backwards, as chunks last first: joined once it is whole. (Prepending
    # each chunk to it and splitting it again made a long line quadratic: a 50 MB torn tail held
    # a restart 35 s.)
    pieces: list[bytes] = []
    while pos > 0:
        n = min(_TAIL_CHUNK, pos)
        pos -= n
        fh.seek(pos)
        parts = fh.read(n).split(b"\n")
        if len(parts) > 1:
            yield parts[-1] + b"".join(reversed(pieces))
            yield from reversed(parts[1:-1])
            pieces = []
        pieces.append(parts[0])  # may continue in the previous chunk
    yield b"".join(reversed(pieces))


def _last_valid_hash(path: Path) -> str | None:
    """The hash of the last intact record of a file, scanning backwards; None if none."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        for line in _lines_reversed(fh, size):
            if line:
                h = valid_line_hash(line)
                if h is not None:
                    return h
    return None


class AuditLog:
    """Append-only, hash-chained JSONL audit log `<directory>/<name>.jsonl`.

    `write` returns only once the line is handed to the OS (and fsynced when `fsync`), so a
    caller that replies after `write` never replies to an unaudited call. Any I/O failure
    raises `AuditError`, marks the log unhealthy and is retried (file reopened, a partial line
    cut off) on the next write or readiness probe; a later successful write makes it healthy.
    """

    def __init__(
        self,
        directory: Path,
        name: str = "audit",
        fsync: bool = False,
        max_bytes: int = 100 * 2**20,
        rotate_interval: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Open (or create) the log and continue its chain. Raises `AuditError` on failure.

        `rotate_interval` (seconds; None: never by time) starts a new file per interval;
        `clock` (Unix seconds) decides the interval, and is replaceable for tests.
        """
        if rotate_interval is not None and rotate_interval <= 0:
            raise AuditError("audit rotate_interval must be positive")
        self._dir = Path(directory)
        self._name = name
        self._path = self._dir / f"{name}.jsonl"
        self._fsync = fsync
        self._max_bytes = max_bytes
        self._interval = rotate_interval
        self._clock = clock
        # The interval (Unix seconds // rotate_interval) of the current file's first record.
        self._period: int | None = None
        self._fh: BinaryIO | None = None
        self._fd = -1  # of _fh: writes go straight to os.write (FileIO.write costs ~0.5 µs more)
        self._lock_fd: int | None = None
        self._ino: int | None = None
        self._size = 0  # bytes of intact records in the current file
        self._last = GENESIS
        self._healthy = True
        self._last_error: str | None = None
        self._records = 0
        self._closed = False
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._lock()
            self._open_existing()
        except (OSError, ValueError) as e:
            self.close()
            raise AuditError(f"cannot open audit log {self._path}: {e}") from e

    # -- public -------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @property
    def records_written(self) -> int:
        """Records written by this instance (not the file's total)."""
        return self._records

    @property
    def last_hash(self) -> str:
        return self._last

    def head(self) -> dict[str, Any]:
        """The chain head to anchor elsewhere (`proxy.audit.anchor`): `chain` (the log's name),
        `records` (written by this instance), `hash` (of the last record; the genesis hash
        for an empty log), `file` (the name of the file holding that record; None for an
        empty log) and `ts` (now).

        Raises `AuditError` when the log is closed or not writable: what the file holds then
        is not known, so no head is vouched for.
        """
        if self._closed or not self._healthy:
            state = "closed" if self._closed else f"not writable ({self._last_error})"
            raise AuditError(f"audit log {self._path} is {state}: its head is unknown")
        if self._size:
            file: str | None = self._path.name
        elif self._last == GENESIS:
            file = None
        else:  # reopened right after a rotation: the head is the newest rotated file's last record
            rotated = rotated_files(self._dir, self._name)
            file = rotated[-1].name if rotated else None
        return {"chain": self._name, "records": self._records, "hash": self._last, "file": file,
                "ts": utc_timestamp()}

    def write(self, record: Mapping[str, Any]) -> str:
        """Append one record (adds `prev` and `hash`) and return its hash.

        A value JSON cannot hold is escaped (`sanitized`, and the record says `"sanitized":
        true`) rather than losing the record. Raises `AuditError` if the record cannot be
        written (the log turns unhealthy until a write succeeds); nothing of a failed record
        stays in the file.
        """
        if self._closed:
            raise AuditError("audit log is closed")
        rec = dict(record)
        rec.pop("hash", None)
        rec["prev"] = self._last
        try:
            body = orjson.dumps(rec, option=_OPT)
        except orjson.JSONEncodeError:
            # A value JSON cannot hold (a string with lone surrogates from undecodable bytes):
            # the decision is recorded all the same, with such values escaped and marked.
            rec = {**sanitized(rec), "sanitized": True}
            try:
                body = orjson.dumps(rec, option=_OPT)
            except orjson.JSONEncodeError as e:
                raise AuditError(f"audit record cannot be serialized: {e}") from e
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        # `hash` is appended unsorted: verify re-canonicalizes the parsed record anyway.
        line = body[:-1] + b',"hash":"' + digest.encode() + b'"}\n'
        try:
            if self._fh is None or not self._healthy or not self._same_file():
                self._reopen()
            period = self._current_period()
            if self._size and (
                self._size + len(line) > self._max_bytes
                or (period is not None and self._period is not None and period != self._period)
            ):
                self._rotate()
            self._append(line)
            if self._size == 0 or self._period is None:
                self._period = period
        except (OSError, ValueError) as e:
            self._fail(e)
            raise AuditError(f"audit write failed: {self._last_error}") from e
        self._size += len(line)
        self._last = digest
        self._records += 1
        if not self._healthy:
            log.warning("audit log %s writable again", self._path)
        self._healthy = True
        self._last_error = None
        return digest

    def check_writable(self, force: bool = False) -> bool:
        """Readiness: True if the file is open and the last write succeeded.

        After a failure (or always, with `force`, as at startup) it probes (reopen, reserve then
        release disk space) without writing a record, so an unready replica that receives no
        traffic can still become ready, and a log that cannot take a record is known before the
        first call is forwarded.
        """
        if self._closed:
            return False
        if self._healthy and self._fh is not None and not force:
            return True
        try:
            self._reopen()
            assert self._fh is not None
            fd = self._fh.fileno()
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._fail(OSError(f"{self._path} is not a regular file"))
                return False
            os.posix_fallocate(fd, self._size, _PROBE_BYTES)
            os.ftruncate(fd, self._size)
        except (OSError, ValueError) as e:
            self._fail(e)
            return False
        return True

    def close(self) -> None:
        """Close the file and release the lock. Idempotent; later writes raise `AuditError`."""
        self._closed = True
        if self._fh is not None:
            with contextlib.suppress(OSError, ValueError):
                self._fh.close()
            self._fh = None
            self._fd = -1
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _current_period(self) -> int | None:
        return None if self._interval is None else int(self._clock() // self._interval)

    def _file_period(self) -> int | None:
        """The interval of the current file's first record (by its `ts`); None if unknown."""
        if self._interval is None:
            return None
        try:
            with open(self._path, "rb") as fh:
                first = orjson.loads(fh.readline())
            started = datetime.strptime(first["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
        except (OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            return None
        return int(started.timestamp() // self._interval)

    def _lock(self) -> None:
        fd = os.open(self._dir / f"{self._name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise OSError(e.errno, "another process is writing this audit log") from e
            raise
        self._lock_fd = fd

    def _open_existing(self) -> None:
        """Open `<name>.jsonl` and find the hash to continue from (file tail, else rotations)."""
        fh = self._open_append()
        st = os.fstat(fh.fileno())
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        if size == 0:
            self._size = 0
            rotated = rotated_files(self._dir, self._name)
            if rotated:
                # Restarted right after a rotation: the chain continues from the last file.
                self._last = _last_valid_hash(rotated[-1]) or GENESIS
            return
        with open(self._path, "rb") as rd:
            lines = _lines_reversed(rd, size)
            tail = next(lines)
            missing_newline = tail != b""
            last_line = tail if missing_newline else next(lines, b"")
            h = valid_line_hash(last_line) if last_line else None
            if h is not None:
                self._last = h
                self._size = size
                self._period = self._file_period()
                if missing_newline:
                    self._append(b"\n")
                    self._size += 1
                return
            # Damaged tail (crash mid-write or tampering): keep it for verify to report,
            # continue the chain from the last intact record in a fresh file.
            last_good = next((x for x in (valid_line_hash(ln) for ln in lines if ln) if x), None)
        if last_good is None:
            # Not one intact record here (a crash mid-way through the first record after a
            # rotation): the chain continues from the last rotated file, as from an empty one.
            rotated = rotated_files(self._dir, self._name)
            last_good = _last_valid_hash(rotated[-1]) if rotated else None
        self._last = last_good or GENESIS
        aside = self._rotate()
        log.warning(
            "audit log %s ends with a damaged record; moved aside to %s, chain continues from %s",
            self._path,
            aside.name,
            self._last,
        )

    def _open_append(self) -> BinaryIO:
        # Unbuffered: each write() is one write(2) on an O_APPEND descriptor, no flush needed.
        fh = open(self._path, "ab", buffering=0)
        self._fh = fh
        self._fd = fh.fileno()
        self._ino = os.fstat(self._fd).st_ino
        return fh

    def _append(self, data: bytes) -> None:
        fd = self._fd
        n = os.write(fd, data)
        while n < len(data):  # short write (rare: signal, disk full): finish or raise
            data = data[n:]
            n = os.write(fd, data)
            if not n:
                raise OSError(errno.EIO, "short write to audit log")
        if self._fsync:
            os.fsync(fd)

    def _same_file(self) -> bool:
        """Whether `<name>.jsonl` is still the file this log writes. A file deleted or renamed
        under the running process (logrotate without copytruncate, a mistaken `rm`) would take
        every later record with it, out of sight: the next record goes to a new file instead
        (the chain continues there, so `verify` names what was removed). One stat per record."""
        try:
            same = os.stat(self._path).st_ino == self._ino
        except FileNotFoundError:
            same = False
        if not same:
            log.error("audit log %s was removed or replaced under the running process; records "
                      "continue in a new %s (the chain continues from %s)", self._path,
                      self._path.name, self._last)
        return same

    def _reopen(self) -> None:
        """Reopen after a failure; cut off a partial line the failed write may have left."""
        old, old_ino = self._fh, self._ino
        self._fh, self._fd = None, -1
        if old is not None:
            with contextlib.suppress(OSError, ValueError):
                old.close()
        fh = self._open_append()
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            return
        if st.st_ino != old_ino:
            # A different file (replaced or rotated away under us): the chain continues in it.
            self._size = st.st_size
        elif st.st_size > self._size:
            os.ftruncate(fh.fileno(), self._size)
        else:
            self._size = st.st_size

    def _rotate(self) -> Path:
        """Rename the current file aside and start a new one; the chain continues."""
        if self._fh is not None:
            fh, self._fh, self._fd = self._fh, None, -1
            fh.close()
        now = datetime.now(UTC)
        while True:
            target = self._dir / f"{self._name}-{now.strftime(_TS_FORMAT)}.jsonl"
            if not target.exists():
                break
            now += timedelta(microseconds=1)
        os.rename(self._path, target)
        self._size = 0
        self._open_append()
        if self._fsync:
            # Make the rename and the new file durable too, not only the records.
            dfd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return target

    def _fail(self, exc: BaseException) -> None:
        msg = str(exc) or type(exc).__name__
        if self._healthy:
            log.error("audit log %s not writable: %s", self._path, msg)
        self._healthy = False
        self._last_error = msg
