"""What the SQLite store's inline write batches cost (issue 15; bench/RESULTS.md, "SQLite writes on
the event loop").

`batch`: the event loop's time for one inline batch (bounds raised to let it in) of N appends of S-byte entries (each with
its run's flags hash, as a ledger records an output), median over 100 batches: the bound
`INLINE_WRITES` / `INLINE_WRITE_BYTES` is picked from it.

`checkpoint`: 10,000 sequential outputs (`--outputs`) of S-byte entries (`--size`; a 200 B output's
entry is ~500 B, a 5 KB output's ~16 KB) spread over R runs (`--runs`) with the worker's checkpoint
every N inline commits: the WAL file's peak size, how many batches met the checkpoint's write
lock and went to the worker, the wall and CPU (every thread) per commit, and each append's
latency; with `--reads`, a `hash_all` on the worker after each (a cold view's read) and its latency;
with `--concurrency C`, C callers side by side (their writes share batches).

`statements`: where one recorded output's inline write goes: each SQL statement kind's time per
write (the loop's connection wrapped by a timer), against the whole `hash_append`, for S-byte
entries over R runs (`--size`, `--runs`), and a bare sqlite3 transaction inserting one such
entry in a table of the same shape (no checkpoint) for comparison.

`layouts`: where a log's entries and counter could live instead (`LAYOUTS`: entries in a rowid
table, the counter in the log's meta row), against the store's own statements (`current`), in bare
sqlite3: one recorded output's write transaction as the loop's connection runs it with everything
carried (BEGIN IMMEDIATE, `PRAGMA data_version`, the entry, the counter, the two meta rows,
COMMIT), S-byte entries over R runs, the store's checkpoint on a thread of its own beside it; the
layouts alternated, a new file each, for `--rounds` rounds: wall and thread CPU per write, the
entry+counter statements, and each round's ratio to the first layout.

Usage (from the repository root):

    python bench/sqlite_inline.py batch [--shapes 64x200,1x50000,1x200]
    python bench/sqlite_inline.py checkpoint [--every 64,256,1024] [--size 200] [--runs 8] [--outputs 10000] [--reads] [--concurrency 1]
    python bench/sqlite_inline.py statements [--size 500] [--runs 1] [--outputs 2000]
    python bench/sqlite_inline.py layouts [--layouts current,rowid-meta] [--size 16000] [--runs 8] [--outputs 1000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.store import sqlite as store_module
from proxy.store.base import LOG_COUNTER, log_field


async def batch_cost(count: int, size: int) -> str:
    """Loop wall and thread CPU of one inline batch of `count` appends of `size` bytes (the
    inline bounds raised to let it in)."""
    store_module.INLINE_WRITES = max(store_module.INLINE_WRITES, count)
    store_module.INLINE_WRITE_BYTES = max(store_module.INLINE_WRITE_BYTES, count * (size + 2))
    with tempfile.TemporaryDirectory() as tmp:
        store = store_module.SqliteStore(Path(tmp) / "state.db", timeout=10.0, inline_writes=True)
        await store.ping()
        times: list[tuple[float, float]] = []
        real = store._flush_inline

        def timed(pool: Any, batch: Any) -> bool:
            wall, cpu = time.perf_counter(), time.thread_time()
            done = real(pool, batch)
            times.append((time.perf_counter() - wall, time.thread_time() - cpu))
            return done

        store._flush_inline = timed  # type: ignore[method-assign]
        for r in range(100):
            await asyncio.gather(*[store.hash_append("log", f"run{r % 8}", os.urandom(size), ttl=600.0, weight=1,
                                                     also=("meta", {b"u": b"1"})) for _ in range(count)])
        await store.close()
    wall = statistics.median(t[0] for t in times) * 1e6
    cpu = statistics.median(t[1] for t in times) * 1e6
    return (f"{count} x {size} B: {len(times)} inline batches, loop wall {wall:.0f} µs, thread CPU {cpu:.0f} µs,"
            f" {cpu / count:.0f} µs a write")


def _tail(seconds: list[float]) -> str:
    """p50, p99 and the largest of some latencies, in µs, those over 5 ms (stalls): how many, and
    their sum, and how many over 25 ms (at c=32 a batch's queueing alone passes 5 ms)."""
    ordered = sorted(seconds)
    stalls = [s for s in ordered if s > 0.005]
    return (f"p50 {ordered[len(ordered) // 2] * 1e6:.0f}, p99 {ordered[int(len(ordered) * 0.99)] * 1e6:.0f},"
            f" max {ordered[-1] * 1e6:.0f} µs, {len(stalls)} over 5 ms summing {sum(stalls) * 1e3:.0f} ms,"
            f" {sum(s > 0.025 for s in stalls)} over 25 ms")


async def checkpoint_cost(every: int, outputs: int = 10_000, size: int = 200, runs: int = 8,
                          reads: bool = False, concurrency: int = 1) -> str:
    """WAL peak, batches sent to the worker, CPU per commit with a checkpoint every `every` commits,
    and each append's latency; with `reads`, a `hash_all` of another run's flags after each append
    (a cold view's read, on the worker thread), and its latency. With `concurrency` C, C callers
    record the outputs side by side (their writes share batches), and the costs are per output."""
    store_module.CHECKPOINT_COMMITS = every
    threads: list[int] = []
    real = store_module._apply

    def spying(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args)

    with tempfile.TemporaryDirectory() as tmp:
        store = store_module.SqliteStore(Path(tmp) / "state.db", timeout=10.0, inline_writes=True)
        await store.ping()
        store_module._apply = spying  # type: ignore[assignment]
        peak = 0
        appends: list[float] = []
        read_times: list[float] = []
        wall, cpu = time.perf_counter(), time.process_time()

        async def caller(first: int) -> None:
            nonlocal peak
            for i in range(first, outputs, concurrency):
                start = time.perf_counter()
                await store.hash_append("log", f"run{i % runs}", b"entry %d " % i + os.urandom(size), ttl=600.0,
                                        weight=1, also=("meta", {b"u": b"1"}))
                appends.append(time.perf_counter() - start)
                if reads:
                    start = time.perf_counter()
                    await store.hash_all("meta", f"run{i * 7919 % runs}")
                    read_times.append(time.perf_counter() - start)
                if i % 100 == 0:
                    peak = max(peak, await asyncio.to_thread(os.path.getsize, f"{store.path}-wal"))

        try:
            await asyncio.gather(*[caller(first) for first in range(concurrency)])
        finally:
            store_module._apply = real
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await store.close()
    me = threading.get_ident()
    per = "commit" if concurrency == 1 else f"output at c={concurrency}, {len(threads)} batches"
    return (f"every {every}, {size} B x {runs} runs: WAL peak {peak // 1024} KB, batches to the worker {sum(t != me for t in threads)}"
            f"/{outputs}, {wall / outputs * 1e6:.0f} µs wall, {cpu / outputs * 1e6:.0f} µs CPU per {per}"
            f" (append {_tail(appends)}" + (f"; read {_tail(read_times)})" if reads else ")"))


class _Timed:
    """A connection whose `execute`/`executemany` time is summed per statement kind."""

    def __init__(self, conn: Any, totals: dict[str, list[float]]) -> None:
        self._conn, self._totals = conn, totals

    def _timed(self, many: bool, sql: str, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return (self._conn.executemany if many else self._conn.execute)(sql, *args)
        finally:
            kind = ("many " if many else "") + " ".join(sql.split()[:3])
            self._totals.setdefault(kind, [0.0, 0])
            self._totals[kind][0] += time.perf_counter() - start
            self._totals[kind][1] += 1

    def execute(self, sql: str, *args: Any) -> Any:
        return self._timed(False, sql, *args)

    def executemany(self, sql: str, *args: Any) -> Any:
        return self._timed(True, sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def statement_cost(size: int, runs: int, outputs: int) -> str:
    """Per write: each statement kind's µs, the SQL in all, and the whole `hash_append`."""
    totals: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = store_module.SqliteStore(Path(tmp) / "state.db", timeout=10.0, inline_writes=True)
        await store.ping()
        for r in range(max(runs, 2)):  # every run exists; the loop's connection is open
            await store.hash_append("log", f"run{r % runs}", os.urandom(size), ttl=600.0, weight=1,
                                    also=("meta", {b"u": b"1"}))
        assert store._loop_writer.conn is not None
        store._loop_writer.conn = _Timed(store._loop_writer.conn, totals)  # type: ignore[assignment]
        whole = time.perf_counter()
        for i in range(outputs):
            await store.hash_append("log", f"run{(i * 7919) % runs}", os.urandom(size), ttl=600.0,
                                    weight=1, also=("meta", {b"u": b"1"}))
        whole = time.perf_counter() - whole
        await store.close()
        bare = sqlite3.connect(Path(tmp) / "bare.db", isolation_level=None)
        bare.execute("PRAGMA journal_mode = WAL")
        bare.execute("PRAGMA synchronous = NORMAL")
        bare.execute("PRAGMA wal_autocheckpoint = 0")
        bare.execute("CREATE TABLE hash (ns TEXT NOT NULL, key TEXT NOT NULL, field BLOB NOT NULL,"
                     " value BLOB NOT NULL, PRIMARY KEY (ns, key, field)) WITHOUT ROWID")
        alone = time.perf_counter()
        for i in range(outputs):
            bare.execute("BEGIN IMMEDIATE")
            bare.execute("INSERT INTO hash VALUES ('log', ?, ?, ?)", (f"run{(i * 7919) % runs}", b"%08d" % i,
                                                                      os.urandom(size)))
            bare.execute("COMMIT")
        alone = time.perf_counter() - alone
        bare.close()
    rows = [f"  {t / outputs * 1e6:7.1f} µs  {n / outputs:4.2f} per write  {kind}"
            for kind, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    sql = sum(t for t, _ in totals.values())
    return "\n".join([f"{size} B entries x {runs} runs, {outputs} writes: hash_append {whole / outputs * 1e6:.1f} µs, "
                      f"of which SQL {sql / outputs * 1e6:.1f} µs; a bare insert transaction "
                      f"{alone / outputs * 1e6:.1f} µs", *rows])


# Log-entry layouts `layouts` compares (issue 15): each is the tables it adds to the store's
# (`_SCHEMA`), the statement that writes an entry, whether the log's counter is a field of `hash`
# (else two columns of the log's meta row, written anyway: no statement of its own), and the read
# of the entries after a sequence number (`hash_since`). `current` is the store's own statements;
# `rowid-*` keeps entries in a rowid table keyed (ns, key, seq) by a separate index, `intpk-*` in
# one with an INTEGER PRIMARY KEY and a UNIQUE index; `current-meta` only moves the counter.
_COUNTER_COLUMNS = ("ALTER TABLE hash_meta ADD COLUMN seq INTEGER NULL",
                    "ALTER TABLE hash_meta ADD COLUMN total INTEGER NULL")
_META_SET_COUNTER = ("INSERT INTO hash_meta (ns, key, expires, size, seq, total) VALUES (?, ?, ?, ?, ?, ?)"
                     " ON CONFLICT (ns, key) DO UPDATE SET expires = excluded.expires, size = excluded.size,"
                     " seq = excluded.seq, total = excluded.total")
_ROWID_LOG = ("CREATE TABLE log (ns TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL,"
              " value BLOB NOT NULL, PRIMARY KEY (ns, key, seq))")
_INTPK_LOG = ("CREATE TABLE log (id INTEGER PRIMARY KEY, ns TEXT NOT NULL, key TEXT NOT NULL,"
              " seq INTEGER NOT NULL, value BLOB NOT NULL, UNIQUE (ns, key, seq))")
_LOG_INSERT = "INSERT INTO log (ns, key, seq, value) VALUES (?, ?, ?, ?)"
_LOG_READ = "SELECT value FROM log WHERE ns = ? AND key = ? AND seq > ? AND seq <= ? ORDER BY seq"
_IN_HASH = {"entry": store_module._HASH_UPSERT, "read": store_module._LOG_SINCE, "field": True}
_IN_LOG = {"entry": _LOG_INSERT, "read": _LOG_READ, "field": False}
LAYOUTS: dict[str, dict[str, Any]] = {
    "current": {"tables": (), "counter": True, **_IN_HASH},
    "current-meta": {"tables": _COUNTER_COLUMNS, "counter": False, **_IN_HASH},
    "rowid-counter": {"tables": (_ROWID_LOG,), "counter": True, **_IN_LOG},
    "rowid-meta": {"tables": (*_COUNTER_COLUMNS, _ROWID_LOG), "counter": False, **_IN_LOG},
    "intpk-meta": {"tables": (*_COUNTER_COLUMNS, _INTPK_LOG), "counter": False, **_IN_LOG},
}


class _Checkpointer:
    """A thread and connection of their own running the store's checkpoint beside the writes
    (`SqliteStore._checkpoint`: PASSIVE passes until one finds nothing new, at most
    `PASSIVE_PASSES`; RESTART when the WAL holds more than `WAL_RESTART_BYTES`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.conn: sqlite3.Connection | None = None
        self.queued = False

    def _run(self) -> None:
        self.queued = False
        if self.conn is None:
            self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=0.1)
        frames, last = 0, -1
        for _ in range(store_module.PASSIVE_PASSES):
            _, frames, copied = self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if frames == copied == last:
                break
            last = copied
        if frames * (4096 + 24) > store_module.WAL_RESTART_BYTES:
            self.conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()

    def start(self) -> None:
        if not self.queued:
            self.queued = True
            self.pool.submit(self._run)

    def _close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def close(self) -> None:
        """After the checkpoint under way, if any."""
        self.pool.submit(self._close).result()
        self.pool.shutdown()


def layout_cost(layout: str, path: Path, size: int, runs: int, outputs: int, every: int = 256) -> dict[str, float]:
    """µs per write of one layout, on a new file: the whole write transaction, the entry's
    statement, the counter's (0 where the counter is meta columns), the meta rows' and COMMIT; and
    the read of the newest entry afterwards (`read`, outside the transaction). Every `every`
    commits the store's checkpoint runs on a thread of its own beside the writes, as in the store."""
    shape = LAYOUTS[layout]
    conn = sqlite3.connect(path, isolation_level=None, timeout=0.0)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    for table in (*store_module._SCHEMA, *shape["tables"]):
        conn.execute(table)
    checkpoints = _Checkpointer(path)
    spent = dict.fromkeys(("write", "cpu", "entry", "counter", "meta", "commit", "read"), 0.0)
    seqs = [0] * runs
    clock = time.perf_counter
    for i in range(-2 * runs, outputs):  # each run's first two writes untimed (its rows exist)
        run = (i * 7919) % runs
        key = f"run{run}"
        value = os.urandom(size)
        seqs[run] += 1
        seq = seqs[run]
        expires = time.time() + 600.0  # a new expiry each write (its index row moves), as a ledger's ttl
        counter = [("ledger_log", key, LOG_COUNTER, b"%d %d" % (seq, seq * 2000))]
        metas: list[tuple[Any, ...]] = (
            [("ledger_log", key, expires, seq + 1), ("ledger", key, expires, 3)] if shape["counter"]
            else [("ledger_log", key, expires, seq, seq, seq * 2000), ("ledger", key, expires, 3, None, None)])
        c0, t0 = time.thread_time(), clock()
        while True:  # the checkpoint's RESTART holds the write lock: the store retries (`_retry_later`)
            try:
                conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError:
                time.sleep(store_module._LOCK_RETRY)
        conn.execute("PRAGMA data_version").fetchone()
        t1 = clock()
        conn.execute(shape["entry"], ("ledger_log", key, log_field(seq) if shape["field"] else seq, value))
        t2 = clock()
        if shape["counter"]:
            conn.executemany(store_module._HASH_UPSERT, counter)
        t3 = clock()
        conn.executemany(store_module._HASH_SET_META if shape["counter"] else _META_SET_COUNTER, metas)
        t4 = clock()
        conn.execute("COMMIT")
        t5, c5 = clock(), time.thread_time()
        got = conn.execute(shape["read"], ("ledger_log", key, log_field(seq - 1) if shape["field"] else seq - 1,
                                           log_field(seq) if shape["field"] else seq)).fetchall()
        t6 = clock()
        assert len(got) == 1 and len(got[0][0]) == size
        if i >= 0:
            for part, took in (("write", t5 - t0), ("cpu", c5 - c0), ("entry", t2 - t1), ("counter", t3 - t2),
                               ("meta", t4 - t3), ("commit", t5 - t4), ("read", t6 - t5)):
                spent[part] += took
        if (i + 2 * runs + 1) % every == 0:
            checkpoints.start()
    checkpoints.close()
    conn.close()
    return {part: took / outputs * 1e6 for part, took in spent.items()}


def _rounds(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def layouts_cost(names: list[str], size: int, runs: int, outputs: int, rounds: int) -> str:
    """Every layout in turn, `rounds` times (alternated, one new file each time): µs per write and
    per entry+counter for each round, their medians, and each layout's median against the first's."""
    table: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name in names:
                path = Path(tmp) / f"{name}-{r}.db"
                table[name].append(layout_cost(name, path, size, runs, outputs))
                for leftover in Path(tmp).glob(f"{name}-{r}.db*"):
                    leftover.unlink()
    first = statistics.median(row["write"] for row in table[names[0]])
    lines = [f"{size} B entries x {runs} runs, {outputs} writes a round, {rounds} rounds alternated,"
             f" load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; µs per write"]
    for name in names:
        rows = table[name]
        writes = [row["write"] for row in rows]
        pairs = [row["entry"] + row["counter"] for row in rows]
        write = statistics.median(writes)
        cpus = [row["cpu"] for row in rows]
        ratios = [mine / base["write"] for mine, base in zip(writes, table[names[0]], strict=True)]
        cpu_ratios = [mine / base["cpu"] for mine, base in zip(cpus, table[names[0]], strict=True)]
        lines.append(f"  {name:14} write {write:6.1f} ({_rounds(writes)}), entry+counter"
                     f" {statistics.median(pairs):6.1f} ({_rounds(pairs)}),"
                     f" meta {statistics.median(row['meta'] for row in rows):5.1f},"
                     f" commit {statistics.median(row['commit'] for row in rows):5.1f},"
                     f" read {statistics.median(row['read'] for row in rows):5.1f}; write x{write / first:.2f}"
                     f" (round by round, median x{statistics.median(ratios):.2f}); thread CPU"
                     f" {statistics.median(cpus):6.1f} ({_rounds(cpus)}), round by round, median"
                     f" x{statistics.median(cpu_ratios):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("batch")
    b.add_argument("--shapes", default="64x200,1x50000,1x200", help="COUNTxBYTES,... (default 64x200,1x50000,1x200)")
    c = sub.add_parser("checkpoint")
    c.add_argument("--every", default="64,256,1024", help="commits between checkpoints (default 64,256,1024)")
    c.add_argument("--size", type=int, default=200, help="bytes per log entry (default 200)")
    c.add_argument("--runs", type=int, default=8, help="runs the outputs go to, in turn (default 8)")
    c.add_argument("--outputs", type=int, default=10_000, help="outputs recorded (default 10,000)")
    c.add_argument("--reads", action="store_true", help="a hash_all (on the worker) after each output")
    c.add_argument("--concurrency", type=int, default=1, help="callers recording side by side (default 1)")
    st = sub.add_parser("statements")
    st.add_argument("--size", type=int, default=500, help="bytes per log entry (default 500)")
    st.add_argument("--runs", type=int, default=1, help="runs the writes go to (default 1)")
    st.add_argument("--outputs", type=int, default=2000, help="writes timed (default 2,000)")
    lay = sub.add_parser("layouts")
    lay.add_argument("--layouts", default=",".join(LAYOUTS), help=f"compared, the first the base (default {','.join(LAYOUTS)})")
    lay.add_argument("--size", type=int, default=16_000, help="bytes per log entry (default 16,000: a 5 KB output's)")
    lay.add_argument("--runs", type=int, default=8, help="runs the writes go to (default 8)")
    lay.add_argument("--outputs", type=int, default=1000, help="writes timed per layout and round (default 1,000)")
    lay.add_argument("--rounds", type=int, default=6, help="rounds, the layouts alternated in each (default 6)")
    args = p.parse_args(argv)
    if args.what == "layouts":
        print(layouts_cost(args.layouts.split(","), args.size, args.runs, args.outputs, args.rounds))
    elif args.what == "statements":
        print(asyncio.run(statement_cost(args.size, args.runs, args.outputs)))
    elif args.what == "batch":
        for shape in args.shapes.split(","):
            count, size = (int(x) for x in shape.split("x"))
            print(asyncio.run(batch_cost(count, size)))
    else:
        for every in args.every.split(","):
            print(asyncio.run(checkpoint_cost(int(every), args.outputs, args.size, args.runs, args.reads,
                                              args.concurrency)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
