"""What recording one untrusted tool output adds before it is delivered (issue 15: a 10 KB output
<= 1 ms on the embedded store and on Redis).

For each store (memory, SQLite in a temp file, Redis on a redis-server started here when the
binary exists) and each output size, distinct prose-like untrusted outputs (ASCII words, a few
URLs, e-mail addresses and numbers) are recorded in one run's ledger the way `Envelope.complete`
does it: `offload.delta_of` (fingerprinting, in a worker thread past `INLINE_CHARS`) then
`ledger.record` with the process's `RecentWrites`; for a session read answered with an SSE
stream also with the pending marker the call left (`done`), cleared in the same record. Times are medians of the wall time
per output, in µs: fingerprinting, the store write, and the two together (what the agent
waits for); and the CPU time this process spent on one stateless record (every thread; not the
Redis server's), which a busy shared machine disturbs less than wall time.

With `--code DIR`, the `proxy` package is imported from DIR (another checkout, e.g. the base of
a change: `git archive <commit> proxy | tar -x -C DIR`), so runs of this script alternating
between checkouts compare both sides in one session.

Usage (from the repository root):

    python bench/record_bench.py [--sizes 1000,10000,50000] [--repeat 60] [--code DIR] [--concurrency 32]

With `--concurrency C`, each row also gives the CPU per output when C calls record at once
(stateless, and streamed session reads that write their pending marker first), which is where the
SQLite store's group commit of concurrent writes shows.

Prints one Markdown row per store and size on stdout; bench/RESULTS.md quotes them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--code" in sys.argv:  # before `proxy` is imported: the checkout to measure
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))

from ledger_bench import stores  # bench/ledger_bench.py: the stores measured (Redis started here)

from proxy.envelope.dataflow.ledger import RecentWrites, mark_pending, record
from proxy.envelope.dataflow.offload import delta_of
from proxy.envelope.labels import Label, Piece
from proxy.store.base import Store

N = 32
CAP = 10_000_000
TTL = 3600.0
WORDS = ("the of and to in is for on with as by at from this that report quarterly revenue team "
         "customer support ticket update release notes version server deploy config page "
         "account invoice payment schedule meeting review draft summary issue comment project "
         "budget forecast market product feature request error log latency cache storage").split()


def output(rng: random.Random, size: int) -> str:
    """Distinct prose of `size` characters, with a URL, an address or a number now and then."""
    out, length = [], 0
    while length < size:
        roll = rng.random()
        if roll < 0.01:
            word = f"https://docs.example{rng.randrange(10**6)}.com/page/{rng.randrange(10**6)}"
        elif roll < 0.02:
            word = f"user{rng.randrange(10**6)}@mail{rng.randrange(1000)}.example.org"
        elif roll < 0.03:
            word = str(rng.randrange(10**9, 10**10))
        else:
            word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:size]


async def measure(store: Store, size: int, repeat: int, rng: random.Random) -> dict[str, float]:
    """Median µs per output of fingerprinting, of the store write, and of both, stateless and
    with a pending marker to clear (a session read)."""
    recent = RecentWrites()
    samples: dict[str, list[float]] = {k: [] for k in ("fingerprint", "write", "total", "session", "cpu")}
    piece = Label(True, False)
    for i in range(repeat):
        run = f"run{i % 8}"
        text = output(rng, size)
        cpu = time.process_time()
        t0 = time.perf_counter()
        delta = await delta_of("web.fetch", [Piece(text, piece, "t")], N, limit=CAP)
        t1 = time.perf_counter()
        await record(store, run, delta, n=N, cap=CAP, ttl=TTL, recent=recent)
        t2 = time.perf_counter()
        samples["cpu"].append(time.process_time() - cpu)
        samples["fingerprint"].append(t1 - t0)
        samples["write"].append(t2 - t1)
        samples["total"].append(t2 - t0)
        # A streamed session read: the marker is written before the stream is relayed (not
        # timed), cleared with the record.
        marker = f"d{i}"
        await mark_pending(store, run, marker, time.time() + 60, ttl=TTL, recent=recent)
        text = output(rng, size)
        t0 = time.perf_counter()
        delta = await delta_of("web.fetch", [Piece(text, piece, "t")], N, limit=CAP)
        await record(store, run, delta, n=N, cap=CAP, ttl=TTL, done=marker, recent=recent)
        samples["session"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in samples.items()}


async def measure_concurrent(store: Store, size: int, repeat: int, rng: random.Random,
                             concurrency: int) -> dict[str, float]:
    """CPU µs per output (this process, every thread) when `concurrency` calls record at once,
    as a loaded proxy does: stateless (fingerprint, record) and as session reads (the pending
    marker written first, then fingerprint and record clearing it). Medians over the rounds."""
    recent = RecentWrites()
    piece = Label(True, False)
    samples: dict[str, list[float]] = {"stateless": [], "session": []}

    async def stateless(i: int, text: str) -> None:
        delta = await delta_of("web.fetch", [Piece(text, piece, "t")], N, limit=CAP)
        await record(store, f"run{i % 8}", delta, n=N, cap=CAP, ttl=TTL, recent=recent)

    async def session(i: int, text: str) -> None:
        run, marker = f"run{i % 8}", f"c{i}-{time.monotonic_ns()}"
        await mark_pending(store, run, marker, time.time() + 60, ttl=TTL, recent=recent)
        delta = await delta_of("web.fetch", [Piece(text, piece, "t")], N, limit=CAP)
        await record(store, run, delta, n=N, cap=CAP, ttl=TTL, done=marker, recent=recent)

    for _ in range(max(1, repeat // concurrency)):
        for name, call in (("stateless", stateless), ("session", session)):
            texts = [output(rng, size) for _ in range(concurrency)]
            cpu = time.process_time()
            await asyncio.gather(*(call(i, text) for i, text in enumerate(texts)))
            samples[name].append((time.process_time() - cpu) / concurrency)
    return {k: statistics.median(v) * 1e6 for k, v in samples.items()}


async def main(sizes: list[int], repeat: int, concurrency: int) -> None:
    rng = random.Random(15)
    with tempfile.TemporaryDirectory() as tmp:
        async with stores(Path(tmp)) as found:
            for name, opener in found:
                store = opener()
                try:
                    for size in sizes:
                        await measure(store, size, 5, rng)  # warm: connections, tables, scripts
                        got = await measure(store, size, repeat, rng)
                        row = (f"| {name} | {size:,} | {got['fingerprint']:.0f} | {got['write']:.0f} "
                               f"| {got['total']:.0f} | {got['session']:.0f} | {got['cpu']:.0f} |")
                        if concurrency > 1:
                            many = await measure_concurrent(store, size, repeat * 4, rng, concurrency)
                            row += f" {many['stateless']:.0f} | {many['session']:.0f} |"
                        print(row, flush=True)
                finally:
                    await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--repeat", type=int, default=60)
    parser.add_argument("--code", help="import `proxy` from this directory (another checkout)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="also the CPU per output when this many calls record at once (stateless, session)")
    args = parser.parse_args()
    many = args.concurrency > 1
    print("| store | output chars | fingerprint µs | store write µs | added before delivery µs "
          "| session read (marker cleared) µs | CPU of this process µs |"
          + (f" CPU per output at c={args.concurrency} µs | CPU per session read at c={args.concurrency} µs |"
             if many else ""))
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if many else ""))
    asyncio.run(main([int(s) for s in args.sizes.split(",")], args.repeat, args.concurrency))
