"""SQLite store: the embedded default. One file in the state directory, shared by every worker.

Every sqlite call that may wait runs on one worker thread the store owns (its connection lives
there; checkpoints have a thread of their own, below), so the event loop never waits on another
process's lock. Two exceptions, each on a
connection of the event loop's own with busy timeout 0, which hands to the worker whatever would
wait: hash write batches (Group commit, below) and the warm sink check's read: a small `hash_since` (at most `INLINE_ENTRIES` entries, `INLINE_BYTES`) is answered on the event loop's
thread by a read-only connection of its own with busy timeout 0 (a WAL reader waits for no
writer; anything that would make it wait goes to the worker), and not read at all while
`PRAGMA data_version` shows no commit by any connection since its last answer found nothing new
(a thread hop cost ~100 µs of the ~250 µs that read took; the skip costs ~10 µs). Each plain operation is one SQL
statement in autocommit mode, which makes `add` and `cas` atomic across threads and processes.
Expiry is wall-clock (`time.time()`), because several processes read the same rows; expired rows
are invisible to reads and removed by an occasional purge.

Token buckets (`take`) are `kv` rows; a take is one `BEGIN IMMEDIATE` transaction that reads
and rewrites its few rows, on the wall clock of the process that takes (one host's clock).

Hashes live apart from `kv`: a `hash` row per field and a `hash_meta` row per hash holding its
expiry and its number of fields, kept exact so that a cap check never counts rows. A write to a
hash is one `BEGIN IMMEDIATE` transaction (the write lock is taken up front, so two processes
cannot both count the same free room under a cap); a read is one read transaction (one snapshot
across its chunks). Fields are named in `IN (...)` lists of at most `_IN_CHUNK`, so every hash
operation costs what its own fields cost, never what the hash holds. A log (`hash_append`) is a
hash whose fields are 8-byte big-endian sequence numbers plus its counter field: an append is
one write step (with the hash set alongside, `also`), `hash_since` one read transaction over a
range of the primary key.

Group commit: hash writes (`hash_append`, `hash_put`, `hash_delete`) queue up, and every write
queued in one turn of the event loop goes into a single `BEGIN IMMEDIATE` transaction, applied in
the order they came (each exactly as it would be alone: caps and sequence numbers see the writes before it).
Within the batch, each hash's meta row, a log's counter and a run's flags are read once and the
meta rows and counters written once, at the end (`_Batch`): a batch of one run's outputs costs
one statement per output (its entry), not eight. The loop's connection also carries from batch to
batch what the last ones left of the hashes they touched (`_Carried`), and reads none of it again
while `PRAGMA data_version` shows that no other connection committed since: a run's next output
then writes without reading (its log's head and its flags were two reads). Each caller is answered only after that
transaction committed, so an output is still recorded before it is delivered; concurrent calls
share one commit (a batch is committed on the event loop's next turn, so the answers that arrived
together share it). The loop's thread commits a batch itself (`_flush_inline`: no thread hop, no
interpreter-lock handoff per statement) unless it holds more than `INLINE_WRITES` writes or
`INLINE_WRITE_BYTES`, or a batch handed to the worker has not committed yet (order). Those
batches go to the worker, which takes the queue as it stands when it gets to it. When BEGIN
IMMEDIATE answers SQLITE_BUSY (this process's checkpoint or purge, or another process, holds the
write lock), nothing is written yet: the batch goes back to the head of the queue and the loop
tries again `_LOCK_RETRY` later, with the writes queued meanwhile behind it (`_retry_later`), so
the worker stays free for reads; after `_LOCK_PATIENCE` of that the worker takes it and waits
with its busy timeout. Either way it is applied once. `ENVELOPE_SQLITE_INLINE=0` (or
`inline_writes=False`) sends every batch to the worker. A batch fails as one: every caller in it
gets the StoreError and nothing of it is kept.

Checkpoints: the loop's connection never checkpoints (`wal_autocheckpoint = 0`); every
`CHECKPOINT_COMMITS` of its commits a thread of the store's own, with its own connection, does
(`_checkpoint`: on the worker, the tens of ms it takes delayed every read queued there). It
copies the WAL back with PASSIVE checkpoints, which block no writer, until one finds nothing
committed since the one before (the WAL is then wholly copied and the loop's next commit starts
it over); while the loop keeps committing that may never happen (the WAL grew to 300 MB in
20,000 outputs with PASSIVE alone), so once the WAL holds more than `WAL_RESTART_BYTES` a
RESTART copies the last frames and syncs the database holding the write lock (tens of ms; the
loop retries meanwhile), and the next writer starts the WAL over. The worker purges expired rows.

Failure: the file is opened lazily, on the first operation, so an unusable path (an unwritable
directory, a path under a regular file) raises StoreError from the first call (`ping` included),
not from the constructor; the next call tries again. Any sqlite error raises StoreError, and so
does an operation that takes longer than `timeout` seconds (another process holding the write
lock, a stalled disk). An operation that timed out may still complete on the worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from proxy.errors import StoreError
from proxy.store import buckets as arithmetic
from proxy.store.base import (
    LOG_COUNTER,
    Bucket,
    HashPut,
    LogRead,
    Store,
    Taken,
    bounded,
    log_counter,
    log_field,
)

T = TypeVar("T")

# Seconds between purges of expired rows (each purge is one indexed DELETE).
PURGE_INTERVAL = 60.0

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv ("
    " ns TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, expires REAL NULL,"
    " PRIMARY KEY (ns, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_expires ON kv (expires) WHERE expires IS NOT NULL",
    "CREATE TABLE IF NOT EXISTS hash ("
    " ns TEXT NOT NULL, key TEXT NOT NULL, field BLOB NOT NULL, value BLOB NOT NULL,"
    " PRIMARY KEY (ns, key, field)) WITHOUT ROWID",
    # `size` is the hash's number of fields. A field row exists only while its meta row does.
    "CREATE TABLE IF NOT EXISTS hash_meta ("
    " ns TEXT NOT NULL, key TEXT NOT NULL, expires REAL NULL, size INTEGER NOT NULL,"
    " PRIMARY KEY (ns, key)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS hash_meta_expires ON hash_meta (expires) WHERE expires IS NOT NULL",
)
_LIVE = "(expires IS NULL OR expires > ?)"
_GET = f"SELECT value FROM kv WHERE ns = ? AND key = ? AND {_LIVE}"
_PUT = (
    "INSERT INTO kv (ns, key, value, expires) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (ns, key) DO UPDATE SET value = excluded.value, expires = excluded.expires"
)
_SET_VALUE = "UPDATE kv SET value = ? WHERE ns = ? AND key = ?"
# Insert, or take over a row only when it has expired: one statement, so exclusive across
# processes; changes() says which happened.
_ADD = _PUT + " WHERE kv.expires IS NOT NULL AND kv.expires <= ?"
_CAS = f"UPDATE kv SET value = ?, expires = ? WHERE ns = ? AND key = ? AND value = ? AND {_LIVE}"
_DELETE = "DELETE FROM kv WHERE ns = ? AND key = ?"
_DELETE_IF = f"DELETE FROM kv WHERE ns = ? AND key = ? AND value = ? AND {_LIVE}"
_ITEMS = f"SELECT key, value FROM kv WHERE ns = ? AND {_LIVE} LIMIT ?"
_PURGE = "DELETE FROM kv WHERE expires IS NOT NULL AND expires <= ?"

_HASH_META = "SELECT expires, size FROM hash_meta WHERE ns = ? AND key = ?"
_HASH_SET_META = (
    "INSERT INTO hash_meta (ns, key, expires, size) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (ns, key) DO UPDATE SET expires = excluded.expires, size = excluded.size"
)
_HASH_DROP_META = "DELETE FROM hash_meta WHERE ns = ? AND key = ?"
# A hash's meta row with one field (a log's counter) or, completed with `(?, ...)` and
# `_HASH_HEAD_WHERE`, a few fields: one statement where two reads took two (no meta row, no row).
_LOG_HEAD = (
    "SELECT m.expires, m.size, h.value FROM hash_meta AS m LEFT JOIN hash AS h"
    " ON h.ns = m.ns AND h.key = m.key AND h.field = ? WHERE m.ns = ? AND m.key = ?"
)
_HASH_HEAD = (
    "SELECT m.expires, m.size, h.field, h.value FROM hash_meta AS m LEFT JOIN hash AS h"
    " ON h.ns = m.ns AND h.key = m.key AND h.field IN "
)
_HASH_HEAD_WHERE = " WHERE m.ns = ? AND m.key = ?"
_HASH_CLEAR = "DELETE FROM hash WHERE ns = ? AND key = ?"
_HASH_UPSERT = (
    "INSERT INTO hash (ns, key, field, value) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (ns, key, field) DO UPDATE SET value = excluded.value"
)
# Completed with `field IN (?, ...)` per chunk of fields.
_HASH_INSERT_NEW = "INSERT OR IGNORE INTO hash (ns, key, field, value) VALUES (?, ?, ?, ?)"
_HASH_REPLACE = "UPDATE hash SET value = ? WHERE ns = ? AND key = ? AND field = ? AND value IS NOT ?"
_HASH_FIELDS = "SELECT field FROM hash WHERE ns = ? AND key = ? AND field IN "
_HASH_VALUES = "SELECT field, value FROM hash WHERE ns = ? AND key = ? AND field IN "
_HASH_REMOVE = "DELETE FROM hash WHERE ns = ? AND key = ? AND field IN "
_HASH_ALL = "SELECT field, value FROM hash WHERE ns = ? AND key = ? LIMIT ?"
_LOG_SINCE = (
    "SELECT value FROM hash WHERE ns = ? AND key = ? AND field > ? AND field <= ?"
    " AND length(field) = 8 ORDER BY field"
)
_LOG_SIZE = (
    "SELECT coalesce(sum(length(value)), 0) FROM hash WHERE ns = ? AND key = ? AND field > ?"
    " AND field <= ? AND length(field) = 8"
)
# Fields before their meta rows, inside one transaction: no field outlives its meta row.
_HASH_PURGE = (
    "DELETE FROM hash WHERE (ns, key) IN"
    " (SELECT ns, key FROM hash_meta WHERE expires IS NOT NULL AND expires <= ?)"
)
_HASH_PURGE_META = "DELETE FROM hash_meta WHERE expires IS NOT NULL AND expires <= ?"

# Most log entries `hash_since` reads on the event loop's thread (a warm view asks for the few
# recorded since its last check; a larger read goes to the worker thread), and how many logs'
# last quiet answers it remembers (`PRAGMA data_version` skips the read while they hold).
INLINE_ENTRIES = 8
INLINE_BYTES = 64 * 1024
QUIET_LOGS = 4096

# Largest write batch the event loop's thread commits itself (`SqliteStore._flush_inline`): at most
# `INLINE_WRITES` writes of `INLINE_WRITE_BYTES` in all (a larger batch goes to the worker thread,
# so one loop turn spends a bounded time on disk). Every `CHECKPOINT_COMMITS` commits of the
# loop's connection (which never checkpoints itself), the checkpointer thread copies the WAL back
# into the database and has it started over (`SqliteStore._checkpoint`), which keeps it bounded.
INLINE_WRITES = 32
INLINE_WRITE_BYTES = 64 * 1024
CHECKPOINT_COMMITS = 256
# Most hashes whose last state the loop's write connection carries from batch to batch (`_Carried`).
CARRIED_HASHES = 4096
# Most fields of one hash carried with it (a run's flags and sources are a few).
CARRIED_FIELDS = 64
_RESTART_WAIT_MS = 100
# A checkpoint (`SqliteStore._checkpoint`) runs PASSIVE copies, each of what the loop committed
# while the one before ran, until one finds nothing new (at most `PASSIVE_PASSES`); it falls back
# to RESTART, which holds the write lock, only when the WAL holds more than `WAL_RESTART_BYTES`.
PASSIVE_PASSES = 8
WAL_RESTART_BYTES = 32 * 1024 * 1024
# A batch that meets a held write lock is tried again on the loop every `_LOCK_RETRY` seconds, for
# at most `_LOCK_PATIENCE` seconds (a checkpoint's RESTART holds the lock for tens of ms); then the
# worker takes it and waits with its busy timeout (another process may hold the lock for long).
_LOCK_RETRY = 0.001
_LOCK_PATIENCE = 0.25

# Fields per `IN (...)` list: well under SQLite's bound-parameter limit (999 before 3.32).
_IN_CHUNK = 500
# Most fields of an uncapped `hash_put` that reads what they hold before writing (fewer
# statements for a few fields; a large put writes without looking first).
_SMALL_PUT = 16


def _in_chunks(fields: Sequence[bytes]) -> Iterator[tuple[str, Sequence[bytes]]]:
    """`(?, ..., ?)` and the fields it binds, at most `_IN_CHUNK` at a time."""
    for start in range(0, len(fields), _IN_CHUNK):
        chunk = fields[start : start + _IN_CHUNK]
        yield "(" + ", ".join("?" * len(chunk)) + ")", chunk


def _transaction(conn: sqlite3.Connection, begin: str, fn: Callable[[], T]) -> T:
    """Run `fn` between `begin` and COMMIT; roll back when it (or the commit) fails."""
    conn.execute(begin)
    try:
        result = fn()
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


class _Batch:
    """One write transaction's view of the hashes its writes touch (`SqliteStore._flush`).

    Each hash's meta row (expiry, size) is read at most once and written at most once, at the
    end (`finish`, before COMMIT), however many writes of the batch touch it; so is a log's
    counter field (read with the meta row, one statement). A few fields read or written by a
    small `hash_put` (a run's flags) are remembered, so the next put of the same fields in the
    batch reads nothing. Concurrent outputs of one run share a log and a flags hash: a batch of
    32 of its appends reads each row once and writes each meta row and the counter once, not
    32 times. What a write reads is what the writes before it left, exactly as if each had its
    own transaction (any other write to a hash's fields first puts its counter in the table and
    forgets what was remembered of it); the view dies with the transaction (the next batch
    reads afresh: another process may have written in between)."""

    __slots__ = ("_carried", "_counters", "_dirty", "_dirty_counters", "_known", "_metas", "conn", "now")

    def __init__(self, conn: sqlite3.Connection, now: float, carried: _Carried | None = None) -> None:
        self.conn = conn
        self.now = now
        # What earlier batches of the same connection left, when nothing committed since
        # (`_Carried`): read from here instead of the table.
        self._carried = carried
        # (ns, key) -> (expires, size), or None: no such hash (absent, expired and cleared,
        # or dropped by this batch).
        self._metas: dict[tuple[str, str], tuple[float | None, int] | None] = {}
        self._dirty: set[tuple[str, str]] = set()
        # (ns, key) -> a log's counter field (None: absent); written at the end when dirty.
        self._counters: dict[tuple[str, str], bytes | None] = {}
        self._dirty_counters: set[tuple[str, str]] = set()
        # (ns, key) -> values of some of its fields as they now stand (None: absent).
        self._known: dict[tuple[str, str], dict[bytes, bytes | None]] = {}

    def _seen(self, ns: str, key: str, row: Any) -> tuple[float | None, int] | None:
        """Remember a meta row just read; an expired hash is cleared first (it starts afresh:
        no fields, no expiry, before the write counts anything)."""
        meta = None if row is None else (row[0], int(row[1]))
        if meta is not None and not _live(meta[0], self.now):
            self.conn.execute(_HASH_CLEAR, (ns, key))
            self._dirty.add((ns, key))  # its meta row is dropped at the end
            self._counters[(ns, key)] = None
            meta = None
        self._metas[(ns, key)] = meta
        return meta

    def _adopt(self, ns: str, key: str) -> bool:
        """What an earlier batch left of a hash (`_Carried`) taken as read, when it left it: the
        meta row (an expired hash is cleared as when read), the counter and the fields known."""
        if (ns, key) in self._metas:
            return True
        carried = None if self._carried is None else self._carried.take(ns, key)
        if carried is None:
            return False
        row, counter, known = carried
        if self._seen(ns, key, row) is not None:
            if counter is not _UNREAD:
                self._counters[(ns, key)] = counter
            if known is not None:
                self._known[(ns, key)] = dict(known)
        return True

    def meta(self, ns: str, key: str) -> tuple[float | None, int] | None:
        """A hash's (expires, size) before a write, or None when it has none."""
        if self._adopt(ns, key):
            return self._metas[(ns, key)]
        return self._seen(ns, key, self.conn.execute(_HASH_META, (ns, key)).fetchone())

    def meta_and_counter(self, ns: str, key: str) -> tuple[tuple[float | None, int] | None, bytes | None]:
        """A log's meta row and its counter field (None when absent), one statement at most."""
        if not self._adopt(ns, key):
            row = self.conn.execute(_LOG_HEAD, (LOG_COUNTER, ns, key)).fetchone()
            meta = self._seen(ns, key, row)
            if (ns, key) not in self._counters:
                self._counters[(ns, key)] = None if row is None or row[2] is None else bytes(row[2])
            return meta, self._counters[(ns, key)]
        meta = self._metas[(ns, key)]
        if (ns, key) not in self._counters:
            # A field row exists only while its meta row does: no meta, no counter.
            row = None if meta is None else self.conn.execute(
                _HASH_VALUES + "(?)", (ns, key, LOG_COUNTER)).fetchone()
            self._counters[(ns, key)] = None if row is None else bytes(row[1])
        return meta, self._counters[(ns, key)]

    def meta_and_values(self, ns: str, key: str,
                        fields: Sequence[bytes]) -> tuple[tuple[float | None, int] | None, dict[bytes, bytes]]:
        """A hash's meta row and the values it holds of a few `fields`: one statement, none
        when the batch (or an earlier one, `_Carried`) has read or written them already, or
        knows every field the hash holds."""
        marks = "(" + ", ".join("?" * len(fields)) + ")"
        if not self._adopt(ns, key):
            rows = self.conn.execute(_HASH_HEAD + marks + _HASH_HEAD_WHERE, (*fields, ns, key)).fetchall()
            meta = self._seen(ns, key, rows[0] if rows else None)
            held = {} if meta is None else {bytes(f): bytes(v) for _, _, f, v in rows if f is not None}
        else:
            meta = self._metas[(ns, key)]
            known = self._known.get((ns, key), {})
            if meta is None:
                held = {}  # no such hash: it holds none of them (known as such from now on)
            elif all(f in known for f in fields) or sum(v is not None for v in known.values()) == meta[1]:
                # Known already, or every field the hash holds is (as many as its size): a
                # field not among them is absent (a stream's new pending marker reads nothing).
                return meta, {f: v for f in fields if (v := known.get(f)) is not None}
            else:
                held = {bytes(f): bytes(v) for f, v in self.conn.execute(_HASH_VALUES + marks, (ns, key, *fields))}
        known = self._known.setdefault((ns, key), {})
        for f in fields:
            known[f] = held.get(f)
        return meta, held

    def wrote(self, ns: str, key: str, values: Mapping[bytes, bytes | None]) -> None:
        """Fields a small put just set, or a removal took away (None)."""
        known = self._known.get((ns, key))
        if known is not None:
            known.update(values)

    def set_meta(self, ns: str, key: str, expires: float | None, size: int) -> None:
        self._metas[(ns, key)] = (expires, size)
        self._dirty.add((ns, key))

    def drop_meta(self, ns: str, key: str) -> None:
        self._metas[(ns, key)] = None
        self._dirty.add((ns, key))

    def set_counter(self, ns: str, key: str, value: bytes) -> None:
        """A log's new counter, written at the end (`finish`) or before any other write to its
        fields (`fields_changed`)."""
        self._counters[(ns, key)] = value
        self._dirty_counters.add((ns, key))
        self._known.pop((ns, key), None)  # its entries changed: nothing remembered of its fields

    def fields_changed(self, ns: str, key: str, *, forget: bool = True) -> None:
        """A write to the hash's fields other than an append is about to run: its counter goes
        into the table first (what that write reads or counts is what an append left) and is
        read again afterwards; with `forget`, so are the fields remembered of it."""
        if (ns, key) in self._dirty_counters:
            self._dirty_counters.discard((ns, key))
            self.conn.execute(_HASH_UPSERT, (ns, key, LOG_COUNTER, self._counters[(ns, key)]))
        self._counters.pop((ns, key), None)
        if forget:
            self._known.pop((ns, key), None)

    def finish(self) -> None:
        """Write the counters and meta rows the batch changed (in its transaction, before COMMIT)."""
        if self._dirty_counters:
            self.conn.executemany(_HASH_UPSERT, [(ns, key, LOG_COUNTER, self._counters[(ns, key)])
                                                 for ns, key in self._dirty_counters])
            self._dirty_counters.clear()
        sets, drops = [], []
        for ns, key in self._dirty:
            meta = self._metas[(ns, key)]
            if meta is None:
                drops.append((ns, key))
            else:
                sets.append((ns, key, meta[0], meta[1]))
        if drops:
            self.conn.executemany(_HASH_DROP_META, drops)
        if sets:
            self.conn.executemany(_HASH_SET_META, sets)
        self._dirty.clear()

    def left(self) -> Iterator[tuple[tuple[str, str], _CarriedHash]]:
        """After `finish`: what the table now holds of every hash the batch touched (its meta
        row, counter and fields known), for the next batch of the connection (`_Carried`)."""
        for name, meta in self._metas.items():
            # Only fields the hash holds: a field known absent (a pending marker removed, one
            # per streamed call) is read again if asked for, so a long run's markers do not
            # pile up here; nor are more than `CARRIED_FIELDS` carried (none then).
            known = {f: v for f, v in self._known.get(name, {}).items() if v is not None}
            yield name, (meta, self._counters.get(name, _UNREAD),
                         known if 0 < len(known) <= CARRIED_FIELDS else None)


# A hash as a batch left it: its meta row (None: no such hash), its counter field (None: absent;
# `_UNREAD`: not read) and the values of fields it holds (None: none known).
_UNREAD = b"\0unread"
_CarriedHash = tuple[tuple[float | None, int] | None, bytes | None, dict[bytes, bytes] | None]


class _Carried:
    """What the event loop's write connection's last batches left of the hashes they touched
    (`_Batch.left`), for the next batch to read instead of the table: a batch of a run's output
    then reads nothing (its log's meta row and counter, its flags), where it read both with two
    statements. Valid only while no other connection committed: `PRAGMA data_version`, read
    inside the next batch's write transaction (so it cannot change until COMMIT), must equal
    the one seen when they were left (the connection's own commits do not change it; another
    process's, this one's worker's, a purge's do). Anything else (a failed batch, a closed
    connection) forgets all of it. At most `CARRIED_HASHES` hashes, the least recently
    written dropped first."""

    __slots__ = ("hashes", "version")

    def __init__(self) -> None:
        self.version: int | None = None
        self.hashes: OrderedDict[tuple[str, str], _CarriedHash] = OrderedDict()

    def valid_at(self, version: int) -> bool:
        """Whether what is carried still holds at `version` (else it is forgotten)."""
        if version != self.version:
            self.forget()
        return bool(self.hashes)

    def take(self, ns: str, key: str) -> _CarriedHash | None:
        return self.hashes.get((ns, key))

    def keep(self, version: int, batch: _Batch) -> None:
        self.version = version
        for name, left in batch.left():
            self.hashes[name] = left
            self.hashes.move_to_end(name)
        while len(self.hashes) > CARRIED_HASHES:
            self.hashes.popitem(last=False)

    def forget(self) -> None:
        self.version = None
        self.hashes.clear()


def _hash_put(batch: _Batch, ns: str, key: str, fields: Mapping[bytes, bytes],
              ttl: float | None, replace: bool = True, cap: int | None = None) -> HashPut:
    """`Store.hash_put` inside the caller's write transaction."""
    conn, now = batch.conn, batch.now
    items = list(fields.items())
    names = [field for field, _ in items]
    small = cap is None and len(items) <= _SMALL_PUT
    if items or not small:  # a put of no fields (an expiry) reads and writes none
        batch.fields_changed(ns, key, forget=not small)
    if small:
        # A few fields (a ledger's flags and sources, mostly unchanged since the run's last
        # output): one read of the meta row and what they hold, then only new or changed ones
        # written (two statements where the passes below take eight).
        meta, held = batch.meta_and_values(ns, key, names) if items else (batch.meta(ns, key), {})
        expires, size = (None, 0) if meta is None else meta
        writes = [(ns, key, f, v) for f, v in items if f not in held or (replace and held[f] != v)]
        if writes:
            conn.executemany(_HASH_UPSERT, writes)
            batch.wrote(ns, key, {f: v for _, _, f, v in writes})
        added = sum(1 for f in names if f not in held)
        if added or ttl is not None:
            batch.set_meta(ns, key, expires if ttl is None else now + ttl, size + added)
        return HashPut(added, 0)
    meta = batch.meta(ns, key)
    expires, size = (None, 0) if meta is None else meta
    if cap is None or size + len(items) <= cap:
        # Every field fits: insert the new ones in one pass (changes() counts them), and
        # only when some existed, replace those in a second; no lookup before writing.
        before = conn.total_changes
        conn.executemany(_HASH_INSERT_NEW, [(ns, key, f, v) for f, v in items])
        added = conn.total_changes - before
        if replace and added < len(items):
            conn.executemany(_HASH_REPLACE, [(v, ns, key, f, v) for f, v in items])
        if added or ttl is not None:
            batch.set_meta(ns, key, expires if ttl is None else now + ttl, size + added)
        return HashPut(added, 0)
    existing: set[bytes] = set()
    for marks, chunk in _in_chunks(names):
        existing.update(bytes(row[0]) for row in conn.execute(_HASH_FIELDS + marks, (ns, key, *chunk)))
    new = [(field, value) for field, value in items if field not in existing]
    # The first new fields (in the caller's order) that fit under the cap are added.
    room = len(new) if cap is None else max(0, min(len(new), cap - size))
    writes = [(ns, key, field, value) for field, value in new[:room]]
    if replace:
        writes += [(ns, key, field, value) for field, value in items if field in existing]
    conn.executemany(_HASH_UPSERT, writes)
    if room or ttl is not None:
        batch.set_meta(ns, key, expires if ttl is None else now + ttl, size + room)
    return HashPut(room, len(new) - room)


def _hash_append(batch: _Batch, ns: str, key: str, value: bytes, ttl: float | None,
                 weight: int, cap: int | None, also: tuple[str, Mapping[bytes, bytes]] | None,
                 drop: Sequence[bytes], if_refused: Mapping[bytes, bytes] | None) -> int:
    """`Store.hash_append` inside the caller's write transaction."""
    meta, counter = batch.meta_and_counter(ns, key)
    expires, size = (None, 0) if meta is None else meta
    expires = expires if ttl is None else batch.now + ttl
    seq, total = log_counter(counter)
    if cap is not None and total + weight > cap:
        if ttl is not None and meta is not None:
            batch.set_meta(ns, key, expires, size)
        seq, fields = 0, if_refused
    else:
        seq += 1
        batch.conn.execute(_HASH_UPSERT, (ns, key, log_field(seq), value))
        batch.set_counter(ns, key, b"%d %d" % (seq, total + weight))
        batch.set_meta(ns, key, expires, size + 1 + (counter is None))
        fields = also[1] if also is not None else None
    if also is not None and fields is not None:
        _hash_put(batch, also[0], key, fields, ttl)
        if drop:
            _hash_remove(batch, also[0], key, drop)
    return seq


def _hash_remove(batch: _Batch, ns: str, key: str, fields: Sequence[bytes]) -> None:
    """`Store.hash_delete` inside the caller's write transaction."""
    meta = batch.meta(ns, key)
    if meta is None:
        return  # absent, or expired (cleared now)
    batch.fields_changed(ns, key, forget=False)
    expires, size = meta
    for marks, chunk in _in_chunks(fields):
        size -= batch.conn.execute(_HASH_REMOVE + marks, (ns, key, *chunk)).rowcount
    batch.wrote(ns, key, dict.fromkeys(fields))
    if size <= 0 and expires is None:
        batch.drop_meta(ns, key)  # an empty hash without expiry is no hash
    else:
        batch.set_meta(ns, key, expires, max(0, size))


def _size_of(fields: Mapping[bytes, bytes]) -> int:
    """Bytes a write puts in its fields (a value that is not bytes fails in its batch, not here)."""
    return sum(len(field) + (len(value) if isinstance(value, bytes) else 0) for field, value in fields.items())


def _live(expires: float | None, now: float) -> bool:
    return expires is None or expires > now


@dataclass(frozen=True, slots=True)
class _Write:
    """One caller's hash write (`hash_append`, `hash_put`, `hash_delete`), queued for the
    worker's next batch (`SqliteStore._flush`): `work` runs inside the batch's transaction."""

    what: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    work: Callable[[_Batch], Any]
    size: int  # bytes it writes (values, fields), for the inline bound


def _settle(settled: list[tuple[asyncio.Future[Any], Any]], error: Exception | None) -> None:
    """On the event loop: hand each caller of a batch its answer, or the batch's error (a
    caller that gave up, timed out or was cancelled, is skipped)."""
    for future, answer in settled:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(answer)


def _apply(batch: _Batch, jobs: list[_Write]) -> list[Any]:
    """Every job of a batch in order, then the meta rows they changed (`_Batch.finish`)."""
    answers = [job.work(batch) for job in jobs]
    batch.finish()
    return answers


class _LoopConnection:
    """One of the event loop thread's own connections to the file (`SqliteStore._writer`,
    `SqliteStore._reader`): opened on first use, with a busy timeout of 0 (whatever would make it
    wait, a lock held elsewhere, a recovery, sends the work to the worker instead of stalling the
    loop) and `pragmas`, and served only to the thread that opened it."""

    __slots__ = ("conn", "pragmas", "thread")

    def __init__(self, *pragmas: str) -> None:
        self.pragmas = pragmas
        self.conn: sqlite3.Connection | None = None
        self.thread: int | None = None

    def get(self, path: str | Path) -> sqlite3.Connection | None:
        """The connection, or None on another thread or when it cannot be opened."""
        if self.conn is not None:
            return self.conn if self.thread == threading.get_ident() else None
        conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(path, isolation_level=None, timeout=0.0)
            for pragma in self.pragmas:
                conn.execute(pragma)
        except sqlite3.Error:
            if conn is not None:
                conn.close()
            return None
        self.conn, self.thread = conn, threading.get_ident()
        return conn

    def owned(self) -> bool:
        """Whether this thread opened the connection (only it may close it)."""
        return self.conn is not None and self.thread == threading.get_ident()

    def close(self) -> None:
        """Closed and forgotten (best effort: the connection is dropped either way)."""
        conn, self.conn, self.thread = self.conn, None, None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error:
                pass

    def forget(self) -> None:
        """Forgotten, not closed: after a fork, the connection is the parent's."""
        self.conn, self.thread = None, None


class _TooLarge(Exception):
    """A read larger than the event loop's thread may do (`SqliteStore._since_inline`)."""


def _log_since(conn: sqlite3.Connection, ns: str, key: str, after: int, limit: int,
               with_hash: str | None, now: float, most: int | None = None) -> tuple[LogRead, float]:
    """`hash_since` inside a read transaction, and until when the answer holds without a commit
    (the sooner expiry of the two hashes). Raises `_TooLarge` when it would read more than
    `most` entries."""
    until = math.inf
    meta = conn.execute(_HASH_META, (ns, key)).fetchone()
    last, entries = 0, []
    if meta is not None and _live(meta[0], now):
        until = min(until, math.inf if meta[0] is None else meta[0])
        row = conn.execute(_HASH_VALUES + "(?)", (ns, key, LOG_COUNTER)).fetchone()
        last = log_counter(None if row is None else bytes(row[1]))[0]
        start = max(0, after)
        end = min(last, start + max(0, limit))
        if most is not None and end > start:
            if end - start > most:
                raise _TooLarge
            # length() reads a blob's header, not its pages: one entry can hold a 10 MB page's
            # fingerprints, more than the event loop should copy.
            size = conn.execute(_LOG_SIZE, (ns, key, log_field(start), log_field(end))).fetchone()[0]
            if size > INLINE_BYTES:
                raise _TooLarge
        if end > start:
            rows = conn.execute(_LOG_SINCE, (ns, key, log_field(start), log_field(end)))
            entries = [bytes(value) for (value,) in rows]
    fields: dict[bytes, bytes] = {}
    if with_hash is not None:
        meta = conn.execute(_HASH_META, (with_hash, key)).fetchone()
        if meta is not None and _live(meta[0], now):
            until = min(until, math.inf if meta[0] is None else meta[0])
            fields = {bytes(f): bytes(v) for f, v in conn.execute(_HASH_ALL, (with_hash, key, 10_000))}
    return LogRead(last, entries, fields), until


class SqliteStore(Store):
    """`kv`, `hash` and `hash_meta` tables in one WAL-mode SQLite file; safe for several processes on one host."""

    kind = "sqlite"

    def __init__(self, path: Path, timeout: float, *, inline_writes: bool | None = None) -> None:
        self.path = Path(path)
        self.timeout = timeout
        # Write batches committed on the event loop's thread (`_flush_inline`); None: on unless
        # `ENVELOPE_SQLITE_INLINE=0` (every batch then goes to the worker thread, as before).
        self.inline_writes = (os.environ.get("ENVELOPE_SQLITE_INLINE") != "0"
                              if inline_writes is None else inline_writes)
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None  # touched only on the executor's thread
        self._ino: int | None = None  # the database file's inode when it was opened (`ping`)
        self._pid = os.getpid()
        self._next_purge = 0.0
        self._closed = False
        # Hash writes waiting for the worker's next batch, and whether a batch is already queued
        # on the worker (a new write then only joins the list: one thread hop per batch).
        self._writes: list[_Write] = []
        self._writes_lock = threading.Lock()
        self._flush_queued = False
        # Batches handed to the worker and not yet committed there: while there are any, later
        # batches follow them to the worker (writes commit in the order they came).
        self._worker_batches = 0
        # The event loop thread's write connection (`_flush_inline`), its commits since the last
        # checkpoint, and whether one is queued on the worker. No automatic checkpoints: the
        # worker runs them (`_checkpoint`). `synchronous` is per connection: NORMAL as on the
        # worker's (a WAL commit does not fsync).
        self._loop_writer = _LoopConnection("PRAGMA wal_autocheckpoint = 0", "PRAGMA synchronous = NORMAL")
        self._inline_commits = 0
        self._checkpoint_queued = False
        self._carried = _Carried()
        # The checkpoints' own thread and connection (`_checkpoint`): a checkpoint takes tens of
        # ms, which on the worker delayed every read queued behind it. And the first write of the
        # batch that met a held write lock, with when it first did (`_retry_later`).
        self._checkpointer: ThreadPoolExecutor | None = None
        self._checkpoint_conn: sqlite3.Connection | None = None  # touched only on the checkpointer's thread
        self._busy: tuple[_Write, float] | None = None
        # The event loop thread's read-only connection (`_since_inline`) and, per (log, hash
        # read with it), the last answer that found nothing new: (data_version, last sequence
        # number, valid until (wall time), the hash's fields).
        self._loop_reader = _LoopConnection("PRAGMA query_only = 1")
        self._quiet: OrderedDict[tuple[str, str, str | None],
                                 tuple[int, int, float, dict[bytes, bytes]]] = OrderedDict()

    # ---- worker thread ----------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit: every statement is its own transaction. The connection never leaves the
        # worker thread, so sqlite's same-thread check stays on as a guard. `timeout` is the
        # busy timeout, set before anything else: switching to WAL and creating the table take
        # the write lock, which another worker may hold while it does the same.
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=self._busy_timeout())
        try:
            self._set_up(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        with contextlib.suppress(OSError):
            self._ino = os.stat(self.path).st_ino
        return conn

    def _set_up(self, conn: sqlite3.Connection) -> None:
        # Two processes opening a new file at once: sqlite can refuse the switch to WAL as
        # "locked" straight away, without waiting on the busy timeout. The set-up is idempotent,
        # so it is tried again until the busy timeout has passed.
        deadline = time.monotonic() + self._busy_timeout()
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
                for statement in _SCHEMA:
                    conn.execute(statement)
                return
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                    raise
            time.sleep(0.01)

    def _busy_timeout(self) -> float:
        # A little under the operation timeout, so a locked database fails inside the worker
        # (freeing the thread) before the caller gives up on it.
        return max(0.0, self.timeout * 0.9)

    def _maybe_purge(self, conn: sqlite3.Connection, now: float) -> None:
        if now >= self._next_purge:
            self._next_purge = now + PURGE_INTERVAL
            conn.execute(_PURGE, (now,))

            def purge_hashes() -> None:
                conn.execute(_HASH_PURGE, (now,))
                conn.execute(_HASH_PURGE_META, (now,))

            _transaction(conn, "BEGIN IMMEDIATE", purge_hashes)

    def _close_conn(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    # ---- event loop side --------------------------------------------------------------------

    def _pool(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():
            # Forked after first use: the parent's thread and connection do not exist here.
            self._pid, self._executor, self._conn = os.getpid(), None, None
            self._loop_reader.forget()
            self._quiet.clear()
            self._writes, self._writes_lock, self._flush_queued = [], threading.Lock(), False
            self._loop_writer.forget()
            self._carried.forget()
            self._worker_batches = 0
            self._inline_commits, self._checkpoint_queued = 0, False
            self._checkpointer, self._checkpoint_conn, self._busy = None, None, None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envelope-sqlite")
        return self._executor

    async def _run(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise StoreError(f"sqlite store {self.path}: closed")
        loop = asyncio.get_running_loop()
        try:
            return await bounded(loop.run_in_executor(self._pool(), lambda: fn(self._connect())),
                                 loop.time() + self.timeout)
        except TimeoutError as exc:
            raise StoreError(f"sqlite store {self.path}: {what} timed out after {self.timeout}s") from exc
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"sqlite store {self.path}: {what} failed: {exc}") from exc

    @staticmethod
    def _expiry(now: float, ttl: float | None) -> float | None:
        return None if ttl is None else now + ttl

    async def get(self, ns: str, key: str) -> bytes | None:
        def op(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute(_GET, (ns, key, time.time())).fetchone()
            return None if row is None else bytes(row[0])

        return await self._run("get", op)

    async def put(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> None:
        def op(conn: sqlite3.Connection) -> None:
            now = time.time()
            conn.execute(_PUT, (ns, key, value, self._expiry(now, ttl)))
            self._maybe_purge(conn, now)

        await self._run("put", op)

    async def add(self, ns: str, key: str, value: bytes, ttl: float | None = None) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            now = time.time()
            changed = conn.execute(_ADD, (ns, key, value, self._expiry(now, ttl), now)).rowcount
            self._maybe_purge(conn, now)
            return changed == 1

        return await self._run("add", op)

    async def cas(self, ns: str, key: str, expected: bytes, value: bytes, ttl: float | None = None) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            now = time.time()
            params = (value, self._expiry(now, ttl), ns, key, expected, now)
            return conn.execute(_CAS, params).rowcount == 1

        return await self._run("cas", op)

    async def delete(self, ns: str, key: str) -> None:
        def op(conn: sqlite3.Connection) -> None:
            conn.execute(_DELETE, (ns, key))

        await self._run("delete", op)

    async def delete_if(self, ns: str, key: str, expected: bytes) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            return conn.execute(_DELETE_IF, (ns, key, expected, time.time())).rowcount == 1

        return await self._run("delete_if", op)

    async def items(self, ns: str, limit: int = 1000) -> list[tuple[str, bytes]]:
        def op(conn: sqlite3.Connection) -> list[tuple[str, bytes]]:
            rows = conn.execute(_ITEMS, (ns, time.time(), max(0, limit))).fetchall()
            return [(str(k), bytes(v)) for k, v in rows]

        return await self._run("items", op)

    # ---- hashes -------------------------------------------------------------------------------

    async def hash_put(self, ns: str, key: str, fields: Mapping[bytes, bytes], ttl: float | None = None,
                       *, replace: bool = True, cap: int | None = None) -> HashPut:
        return await self._write("hash_put", lambda batch: _hash_put(batch, ns, key, fields, ttl,
                                                                        replace, cap), _size_of(fields))

    async def hash_append(self, ns: str, key: str, value: bytes, ttl: float | None = None, *,
                          weight: int = 0, cap: int | None = None,
                          also: tuple[str, Mapping[bytes, bytes]] | None = None,
                          drop: Sequence[bytes] = (),
                          if_refused: Mapping[bytes, bytes] | None = None) -> int:
        size = len(value) + (0 if also is None else _size_of(also[1])) + _size_of(if_refused or {})
        return await self._write("hash_append", lambda batch: _hash_append(
            batch, ns, key, value, ttl, weight, cap, also, drop, if_refused), size)

    async def _write(self, what: str, work: Callable[[_Batch], T], size: int) -> T:
        """Group commit: `work` joins the writes queued in this turn of the event loop, which the
        next turn commits all at once in one write transaction: on the loop's own thread when
        it can (`_flush_inline`), else on the worker thread (`_flush`). The caller is answered
        once that transaction has committed (so an output is recorded before it is delivered, as
        with a transaction of its own). Concurrent calls' writes share one BEGIN/COMMIT."""
        if self._closed:
            raise StoreError(f"sqlite store {self.path}: closed")
        loop = asyncio.get_running_loop()
        pool = self._pool()
        future: asyncio.Future[T] = loop.create_future()
        with self._writes_lock:
            self._writes.append(_Write(what, loop, future, work, size))
            first, self._flush_queued = not self._flush_queued, True
        if first:
            # Flushed on the loop's next turn, not now: the calls the loop runs in this turn
            # (answers that arrived together) add their writes to the same batch first. A lone
            # call loses nothing: the loop has nothing else to run before it.
            loop.call_soon(self._start_flush, pool)
        try:
            return await bounded(future, loop.time() + self.timeout)
        except TimeoutError as exc:
            raise StoreError(f"sqlite store {self.path}: {what} timed out after {self.timeout}s") from exc
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"sqlite store {self.path}: {what} failed: {exc}") from exc

    def _start_flush(self, pool: ThreadPoolExecutor) -> None:
        """On the event loop: the queued writes committed here (`_flush_inline`) or handed to
        the worker thread (`_flush`). Behind a batch the worker has yet to commit, the queue
        stays for the worker to take when it gets to it (the writes queued until then join)."""
        if not self.inline_writes or self._worker_batches:
            self._hand_over(pool, None)
            return
        with self._writes_lock:
            batch, self._writes, self._flush_queued = self._writes, [], False
        if batch and not self._flush_inline(pool, batch):
            self._hand_over(pool, batch)
        # (no batch: `close` took it and commits it itself)

    def _hand_over(self, pool: ThreadPoolExecutor, batch: list[_Write] | None) -> None:
        """A batch (None: whatever is queued when the worker gets to it) to the worker thread,
        after every batch it has already."""
        with self._writes_lock:
            self._worker_batches += 1
        try:
            pool.submit(self._flush, batch)
        except RuntimeError:  # the store closed in the meantime: its worker takes no more work
            with self._writes_lock:
                self._worker_batches -= 1
                if batch is None:
                    batch, self._writes, self._flush_queued = self._writes, [], False
            error = StoreError(f"sqlite store {self.path}: closed")
            _settle([(job.future, None) for job in batch], error)

    def _flush(self, batch: list[_Write] | None) -> None:
        """On the worker thread: every write of a batch (None: of the queue) in one write
        transaction, in the order they came, then each caller woken (one wake-up of each event
        loop for the whole batch). A failure anywhere rolls the whole batch back and every
        caller in it gets the error: none of their outputs is delivered (fail closed)."""
        if batch is None:
            with self._writes_lock:
                batch, self._writes, self._flush_queued = self._writes, [], False
        answers: list[Any] = []
        error: Exception | None = None
        try:
            if not batch:
                return  # taken by an earlier flush (`close` drains the queue itself)
            conn = self._connect()
            now = time.time()
            answers = _transaction(conn, "BEGIN IMMEDIATE", lambda: _apply(_Batch(conn, now), batch))
            self._maybe_purge(conn, now)
        except Exception as exc:  # every caller of the batch gets it (sqlite, OS or a bug)
            error = exc
        finally:
            with self._writes_lock:
                self._worker_batches -= 1
        loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for i, job in enumerate(batch):
            loops.setdefault(job.loop, []).append((job.future, answers[i] if answers else None))
        for loop, settled in loops.items():
            try:
                loop.call_soon_threadsafe(_settle, settled, error)
            except RuntimeError:
                pass  # that loop has closed: nobody waits for these answers any more

    def _loop_connection(self, which: _LoopConnection) -> sqlite3.Connection | None:
        """One of the event loop thread's own connections, or None where it cannot serve."""
        if self._closed or self._conn is None or self._pid != os.getpid():
            return None  # the worker has not set the file up yet, or a fork: the worker path
        return which.get(self.path)

    def _writer(self) -> sqlite3.Connection | None:
        """The event loop thread's write connection: a write lock held elsewhere (another
        process, a checkpoint) sends the batch to the worker, which waits for it."""
        return self._loop_connection(self._loop_writer)

    def _flush_inline(self, pool: ThreadPoolExecutor, batch: list[_Write]) -> bool:
        """On the event loop: a batch committed by the loop's own connection, no thread hop.
        False when the worker must take it: a batch beyond `INLINE_WRITES`/`INLINE_WRITE_BYTES`,
        one behind a batch the worker has yet to commit, or no loop connection; also (then
        handed over here) when another connection holds the write lock (SQLITE_BUSY from
        BEGIN IMMEDIATE: nothing of it is written yet, the worker waits with its busy timeout).
        Any other failure rolls the batch back and refuses every caller in it (fail closed),
        exactly as on the worker."""
        loop = asyncio.get_running_loop()
        if (len(batch) > INLINE_WRITES or self._worker_batches
                or sum(job.size for job in batch) > INLINE_WRITE_BYTES
                or any(job.loop is not loop for job in batch)):
            return False
        conn = self._writer()
        if conn is None:
            return False
        now = time.time()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY:
                self._retry_later(pool, batch)  # never begun: applied once, from scratch, later
            else:
                self._close_writer()
                self._hand_over(pool, batch)
            return True
        answers: list[Any] = []
        error: Exception | None = None
        try:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            work = _Batch(conn, now, self._carried if self._carried.valid_at(version) else None)
            answers = _apply(work, batch)
            conn.execute("COMMIT")
            self._carried.keep(version, work)
        except Exception as exc:  # every caller of the batch gets it (sqlite, OS or a bug)
            error = exc
            self._carried.forget()
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            except sqlite3.Error:
                self._close_writer()  # a connection in an unknown state is not used again
        if error is None:
            self._after_inline_commit(pool, now)
        _settle([(job.future, answers[i] if answers else None) for i, job in enumerate(batch)], error)
        return True

    def _retry_later(self, pool: ThreadPoolExecutor, batch: list[_Write]) -> None:
        """On the event loop: a batch that met the write lock held by another connection (this
        process's checkpoint, mostly) back at the head of the queue, tried again on the loop in
        `_LOCK_RETRY` seconds (the loop runs other work meanwhile); writes queued until then join
        it behind, in order. After `_LOCK_PATIENCE` seconds of that, the worker takes the queue
        and waits with its busy timeout. (The worker used to take it at once: behind the
        checkpoint, then the lock, with every read queued on the worker waiting behind them.)"""
        now = time.monotonic()
        if self._busy is None or self._busy[0] is not batch[0]:
            self._busy = (batch[0], now)  # (a batch that met the lock before has committed since)
        elif now - self._busy[1] >= _LOCK_PATIENCE:
            self._busy = None
            self._hand_over(pool, batch)
            return
        with self._writes_lock:
            self._writes[:0] = batch
            self._flush_queued = True  # later writes join the queue; the retry flushes it
        asyncio.get_running_loop().call_later(_LOCK_RETRY, self._start_flush, pool)

    def _after_inline_commit(self, pool: ThreadPoolExecutor, now: float) -> None:
        """The worker's share of inline commits: the purge of expired rows every
        `PURGE_INTERVAL`; and a checkpoint every `CHECKPOINT_COMMITS`, on a thread of its own."""
        self._busy = None
        self._inline_commits += 1
        if self._inline_commits >= CHECKPOINT_COMMITS and not self._checkpoint_queued:
            self._inline_commits, self._checkpoint_queued = 0, True
            if self._checkpointer is None:
                self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envelope-sqlite-checkpoint")
            self._checkpointer.submit(self._checkpoint)
        if now >= self._next_purge:
            self._next_purge = now + PURGE_INTERVAL
            pool.submit(self._purge, now)

    def _checkpoint(self) -> None:
        """On the checkpointer's thread: the WAL copied back into the database, and kept under
        `WAL_RESTART_BYTES`. PASSIVE copies block no writer: each copies what the loop committed
        while the one before ran, until one finds nothing new (at most `PASSIVE_PASSES`); the
        whole WAL is then copied and the database synced, and the loop's next commit starts the
        WAL file over by itself. While the loop keeps committing, no pass may find it so (the WAL
        grew to 300 MB in 20,000 outputs with PASSIVE alone): once the WAL holds more than
        `WAL_RESTART_BYTES`, RESTART copies the last frames and syncs the database holding the
        write lock (tens of ms, during which the loop retries its batch, `_retry_later`), and
        waits at most `_RESTART_WAIT_MS` for the lock and a reader's old snapshot (if that is not
        enough, the next checkpoint tries again). Best effort: a failure drops the connection,
        and the next checkpoint catches up."""
        self._checkpoint_queued = False
        try:
            conn = self._checkpoint_connection()
            frames, last = 0, -1
            for _ in range(PASSIVE_PASSES):
                _, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if frames == copied == last:
                    break  # nothing committed since the last pass, which copied it all
                last = copied
            page = conn.execute("PRAGMA page_size").fetchone()[0]
            if frames * (page + 24) > WAL_RESTART_BYTES:  # a frame is a page and its 24-byte header
                conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
        except sqlite3.Error:
            self._close_checkpoint_connection()

    def _checkpoint_connection(self) -> sqlite3.Connection:
        """The checkpointer thread's connection, opened on first use (after the worker set the
        file up): its busy timeout is RESTART's wait for the write lock and old readers."""
        if self._checkpoint_conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=_RESTART_WAIT_MS / 1000)
            try:
                conn.execute("PRAGMA synchronous = NORMAL")  # as the worker's: the same checkpoint
            except BaseException:
                conn.close()
                raise
            self._checkpoint_conn = conn
        return self._checkpoint_conn

    def _close_checkpoint_connection(self) -> None:
        conn, self._checkpoint_conn = self._checkpoint_conn, None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error:
                pass

    def _purge(self, now: float) -> None:
        """On the worker: expired rows removed (`_maybe_purge`'s work, due after an inline commit)."""
        try:
            self._next_purge = 0.0
            self._maybe_purge(self._connect(), now)
        except sqlite3.Error:
            self._next_purge = 0.0  # tried again after the next write

    def _close_writer(self) -> None:
        self._loop_writer.close()
        self._carried.forget()

    async def hash_since(self, ns: str, key: str, after: int, limit: int = 256, *,
                         with_hash: str | None = None) -> LogRead:
        # A warm sink check asks this once per call, mostly for nothing new: answered on the
        # event loop's thread when the read is small (`_since_inline`), else by the worker.
        found = self._since_inline(ns, key, after, limit, with_hash)
        if found is not None:
            return found
        # One read transaction: the log and the hash read with it are one snapshot.
        return await self._run("hash_since", lambda conn: _transaction(
            conn, "BEGIN", lambda: _log_since(conn, ns, key, after, limit, with_hash, time.time())[0]))

    def _reader(self) -> sqlite3.Connection | None:
        """The event loop thread's read-only connection: a WAL reader waits for no writer."""
        return self._loop_connection(self._loop_reader)

    def _since_inline(self, ns: str, key: str, after: int, limit: int,
                      with_hash: str | None) -> LogRead | None:
        """`hash_since` on the event loop's thread, or None (the worker answers instead).

        Bounded: at most `INLINE_ENTRIES` entries of `INLINE_BYTES` in all (a larger read goes
        to the worker), and no
        read at all when `PRAGMA data_version` says no connection committed since this one last
        read the same log and hash, found nothing after `after`, and neither can have expired
        since (SQLite guarantees the version changes on any other connection's commit, this
        process's worker included; this connection never writes). Any sqlite error drops the
        connection and leaves the call to the worker, which fails closed as ever."""
        conn = self._reader()
        if conn is None:
            return None
        try:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            now = time.time()
            quiet = self._quiet.get((ns, key, with_hash))
            if quiet is not None and quiet[0] == version and quiet[1] == after and now < quiet[2]:
                return LogRead(after, [], dict(quiet[3]))
            read = _transaction(conn, "BEGIN",
                                lambda: _log_since(conn, ns, key, after, limit, with_hash, now, INLINE_ENTRIES))
        except _TooLarge:
            return None
        except sqlite3.Error:
            self._close_reader()
            return None
        found, until = read
        self._quiet[(ns, key, with_hash)] = (version, found.last, until, dict(found.fields))
        self._quiet.move_to_end((ns, key, with_hash))
        while len(self._quiet) > QUIET_LOGS:
            self._quiet.popitem(last=False)
        return found

    def _close_reader(self) -> None:
        self._loop_reader.close()
        self._quiet.clear()

    async def hash_get(self, ns: str, key: str, fields: Sequence[bytes]) -> list[bytes | None]:
        if not fields:
            return []

        def read(conn: sqlite3.Connection) -> list[bytes | None]:
            meta = conn.execute(_HASH_META, (ns, key)).fetchone()
            if meta is None or not _live(meta[0], time.time()):
                return [None] * len(fields)
            found: dict[bytes, bytes] = {}
            for marks, chunk in _in_chunks(fields):
                rows = conn.execute(_HASH_VALUES + marks, (ns, key, *chunk))
                found.update((bytes(field), bytes(value)) for field, value in rows)
            return [found.get(field) for field in fields]

        # One read transaction: every chunk sees the same snapshot.
        return await self._run("hash_get", lambda conn: _transaction(conn, "BEGIN", lambda: read(conn)))

    async def hash_all(self, ns: str, key: str, limit: int = 10_000) -> dict[bytes, bytes]:
        def read(conn: sqlite3.Connection) -> dict[bytes, bytes]:
            meta = conn.execute(_HASH_META, (ns, key)).fetchone()
            if meta is None or not _live(meta[0], time.time()):
                return {}
            rows = conn.execute(_HASH_ALL, (ns, key, max(0, limit)))
            return {bytes(field): bytes(value) for field, value in rows}

        return await self._run("hash_all", lambda conn: _transaction(conn, "BEGIN", lambda: read(conn)))

    async def hash_delete(self, ns: str, key: str, fields: Sequence[bytes]) -> None:
        if not fields:
            return

        await self._write("hash_delete", lambda batch: _hash_remove(batch, ns, key, fields),
                          sum(len(field) for field in fields))

    # ---- token buckets ------------------------------------------------------------------------

    async def take(self, ns: str, buckets: Sequence[Bucket]) -> Taken:
        def decide(conn: sqlite3.Connection) -> Taken:
            now = time.time()  # read under the lock: stamps only move forward
            states: list[bytes | None] = []
            for bucket in buckets:
                row = conn.execute(_GET, (ns, bucket.key, now)).fetchone()
                states.append(None if row is None else bytes(row[0]))
            taken, writes = arithmetic.take(states, buckets, now)
            conn.executemany(_PUT, [(ns, bucket.key, state, now + bucket.ttl)
                                    for bucket, state in zip(buckets, writes, strict=False)])
            return taken

        def op(conn: sqlite3.Connection) -> Taken:
            # The write lock up front: two processes cannot both read the same last token.
            taken = _transaction(conn, "BEGIN IMMEDIATE", lambda: decide(conn))
            self._maybe_purge(conn, time.time())
            return taken

        return await self._run("take", op)

    async def give(self, ns: str, bucket: Bucket) -> None:
        def op(conn: sqlite3.Connection) -> None:
            def update() -> None:
                now = time.time()
                row = conn.execute(_GET, (ns, bucket.key, now)).fetchone()
                state = arithmetic.give(None if row is None else bytes(row[0]), bucket, now)
                if state is not None:  # its expiry kept
                    conn.execute(_SET_VALUE, (state, ns, bucket.key))
            _transaction(conn, "BEGIN IMMEDIATE", update)

        await self._run("give", op)

    async def ping(self) -> None:
        """Raise StoreError when the database cannot be written, or its file was removed or
        replaced under the running process (this process goes on with the state it holds open,
        which is gone at the next start, and another process opening the path starts empty).

        A write, not a read: a file or file system gone read-only, a full disk once the write
        needs space, a write lock another process holds past the busy timeout all refuse every
        gated, keyed, limited and recorded call while reads still answer. One short-lived row
        per ping (namespace `#ready`: no namespace starts with `#`), on the worker thread,
        within the timeout."""
        def op(conn: sqlite3.Connection) -> None:
            conn.execute(_PUT, ("#ready", "ping", b"1", time.time() + 60))
            try:
                ino = os.stat(self.path).st_ino
            except FileNotFoundError:
                ino = None
            if self._ino is not None and ino != self._ino:
                raise OSError(f"the database file {self.path} was removed or replaced under the running "
                              "process: its state is lost at the next start")

        await self._run("ping", op)

    async def close(self) -> None:
        """Close the connection and stop the worker thread; later calls raise StoreError."""
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid() and self._loop_reader.owned():
            self._close_reader()
        if self._pid == os.getpid() and self._loop_writer.owned():
            self._close_writer()
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None and self._pid == os.getpid():
            checkpointer.submit(self._close_checkpoint_connection)  # after a checkpoint under way
            checkpointer.shutdown(wait=False)
        executor, self._executor = self._executor, None
        if executor is None or self._pid != os.getpid():
            return
        loop = asyncio.get_running_loop()
        with self._writes_lock:
            batch, self._writes, self._flush_queued = self._writes, [], False
            self._worker_batches += bool(batch)
        if batch:
            executor.submit(self._flush, batch)  # writes queued this turn commit before the connection closes
        try:
            async with asyncio.timeout(self.timeout):
                await loop.run_in_executor(executor, self._close_conn)
        except (TimeoutError, sqlite3.Error) as exc:
            raise StoreError(f"sqlite store {self.path}: close failed: {exc or 'timed out'}") from exc
        finally:
            executor.shutdown(wait=False)
