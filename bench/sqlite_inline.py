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

Usage (from the repository root):

    python bench/sqlite_inline.py batch [--shapes 64x200,1x50000,1x200]
    python bench/sqlite_inline.py checkpoint [--every 64,256,1024] [--size 200] [--runs 8] [--outputs 10000] [--reads] [--concurrency 1]
    python bench/sqlite_inline.py statements [--size 500] [--runs 1] [--outputs 2000]
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.store import sqlite as store_module


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
    args = p.parse_args(argv)
    if args.what == "statements":
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
