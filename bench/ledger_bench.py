"""Cost of the data-flow ledger as the ledger grows: a sink check must cost the same whether
the run has read 1 KB or 1 MB of untrusted text.

For each store (memory, sqlite in a temp file, redis on a redis-server started here when the
binary exists) and each ledger size, the run's ledger is filled with distinct untrusted text
(the size is in characters read; winnowed with the default window 4, about 40% of its grams are
kept as fingerprints), then two operations are timed:

- check: what the flow check does for one sink call with a 300-character argument: load the
  run's flags and the argument's fingerprints, then match (`load` + `match_argument`), with the
  run's ledger warm in this process (every check after the first: the store is still read
  once per check, for the flags and whatever was recorded since); its wall time (median) and
  the CPU this process spent per check (mean, every thread);
- record: fingerprint a 1,000-character untrusted output and add it to the ledger (`record`);
- record 10 KB: what delivering a 10,000-character untrusted page costs before it reaches the
  agent, split into fingerprinting (`LedgerDelta.of`, CPU) and the store write (`record`).

With `--code DIR`, the `proxy` package is imported from DIR (another checkout, e.g. the code
before a change: `git archive <commit> proxy | tar -x -C DIR`), so one run of this script
measures both sides. With `--uvloop`, everything runs on uvloop, the event loop
`envelope-proxy serve` uses when it is installed (asyncio's own loop otherwise, and here by
default).

With `--trusted`, what tainted-run escalation (`dataflow.on_tainted` not `allow`) adds: the
CPU cost of a trusted output's endorsing keys (`LedgerDelta.of(..., trusted=True)`, 1,000 and
64,000 characters of listing-like text), recording a 1,000-character trusted output (with
escalation off it records nothing and writes nothing), and a sink check that also looks up
three critical values' keys.

Usage (from the repository root, venv active):

    python bench/ledger_bench.py [--sizes 1000,64000,256000,1000000] [--repeat 200] [--trusted]
                                 [--code DIR] [--uvloop]

Prints a Markdown table (median µs per operation); bench/RESULTS.md quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--code" in sys.argv:  # before `proxy` is imported: the checkout to measure
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))

from proxy.envelope.dataflow.endorse import Critical
from proxy.envelope.dataflow.ledger import LedgerDelta, load, record
from proxy.envelope.dataflow.match import Probe, match_argument
from proxy.envelope.labels import Label, Piece
from proxy.store.base import Store
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore
from proxy.store.sqlite import SqliteStore

N = 32
ARGUMENT = ("Hi team, the quarterly numbers are in the attached sheet; revenue went up and costs "
            "went down, so the forecast holds. Please review the summary before Thursday's call "
            "and send your comments to the finance channel. Thanks, and see you all at the offsite "
            "next month.")[:300]


def page(i: int, size: int) -> str:
    """Distinct untrusted text of `size` characters (every 32-gram new)."""
    out, length, j = [], 0, 0
    while length < size:
        word = f"w{i}x{j}"
        out.append(word)
        length += len(word) + 1
        j += 1
    return " ".join(out)[:size]


def delta(text: str) -> LedgerDelta:
    return LedgerDelta.of("web.fetch", [Piece(text, Label(True, False), "t")], N)


@asynccontextmanager
async def stores(tmp: Path) -> AsyncIterator[list[tuple[str, Callable[[], Store]]]]:
    found: list[tuple[str, Callable[[], Store]]] = [("memory", MemoryStore)]
    found.append(("sqlite", lambda: SqliteStore(tmp / f"state-{time.monotonic_ns()}.db", timeout=30.0)))
    if shutil.which("redis-server"):
        from tests.redis_server import running_redis
        (tmp / "redis").mkdir()
        with running_redis(tmp / "redis") as server:
            found.append(("redis", lambda: RedisStore(server.url, prefix=f"b{time.monotonic_ns()}:", timeout=30.0)))
            yield found
    else:
        yield found


async def fill(store: Store, run: str, characters: int) -> None:
    chunk, i = 20_000, 0
    while characters > 0:
        take = min(chunk, characters)
        await record(store, run, delta(page(i, take)), n=N, cap=10_000_000, ttl=3600)
        characters -= take
        i += 1


async def timed(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()  # type: ignore[misc]
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


async def measure(store: Store, repeat: int) -> dict[str, float]:
    """Median µs of a warm sink check, of recording a 1,000-character output, and of the two
    halves of recording a 10,000-character one (fingerprinting, the store write)."""
    probe = Probe.of(ARGUMENT, N)
    fields = list(probe.fields())
    counter = iter(range(10**9))

    async def check() -> None:
        ledger = await load(store, "run", N, fields)
        assert ledger is not None
        match_argument(ledger, probe, N)

    async def add() -> None:
        await record(store, "other", delta(page(10_000 + next(counter), 1000)),
                     n=N, cap=10_000_000, ttl=3600)

    await check()  # the first check of the run in this process reads its ledger: then warm
    cpu = time.process_time()
    out = {"check": await timed(check, repeat)}
    # CPU of this process (every thread: SQLite's worker too) per check: on a loaded machine the
    # wall time of a Redis round trip is mostly waiting for the server to be scheduled.
    out["check cpu"] = (time.process_time() - cpu) / repeat * 1e6
    out["record 1k"] = await timed(add, max(20, repeat // 4))
    pages = [page(20_000 + i, 10_000) for i in range(max(20, repeat // 4))]
    deltas = iter([delta(text) for text in pages])
    texts = iter(pages)

    async def fingerprint() -> None:
        delta(next(texts))

    async def write() -> None:
        await record(store, "pages", next(deltas), n=N, cap=10_000_000, ttl=3600)

    out["fingerprint 10k"] = await timed(fingerprint, len(pages))
    out["write 10k"] = await timed(write, len(pages))
    return out


def listing(i: int, size: int) -> str:
    """Trusted listing-like text of `size` characters: names, prices, ids on short lines."""
    out, length, j = [], 0, 0
    while length < size:
        line = f"{j}. Hotel Nr{i}x{j} Central - ${100 + j}.50 per night - ref {i:04d}{j:06d}"
        out.append(line)
        length += len(line) + 1
        j += 1
    return "\n".join(out)[:size]


def trusted(text: str, on: bool) -> LedgerDelta:
    return LedgerDelta.of("web.hotels", [Piece(text, Label(False, False), "t")], N, trusted=on)


async def measure_trusted(store: Store, repeat: int) -> dict[str, float]:
    """Median µs of what escalation adds (see the module docstring)."""
    out: dict[str, float] = {}
    for size in (1000, 64000):
        text = listing(0, size)
        for on in (False, True):
            async def cpu(text: str = text, on: bool = on) -> None:
                trusted(text, on)
            out[f"keys {size} {'on' if on else 'off'}"] = await timed(cpu, max(10, repeat // (20 if size > 1000 else 1)))
    counter = iter(range(10**9))
    for on in (False, True):
        async def add(on: bool = on) -> None:
            d = trusted(listing(next(counter), 1000), on)
            if not d.empty:  # what Envelope.complete does: an empty delta writes nothing
                await record(store, "other", d, n=N, cap=10_000_000, ttl=3600)
        out[f"record 1000 {'on' if on else 'off'}"] = await timed(add, max(20, repeat // 4))
    probe = Probe.of(ARGUMENT, N)
    keys = [k for v in ("Hotel Nr0x5 Central", 105.5, "0000000005") for k in Critical.of("/x", v).keys]
    for on in (False, True):
        fields = list(probe.fields()) + (keys if on else [])

        async def check(fields: list[bytes] = fields) -> None:
            ledger = await load(store, "run", N, fields)
            assert ledger is not None
            match_argument(ledger, probe, N)
        out[f"check {'on' if on else 'off'}"] = await timed(check, repeat)
    return out


async def main_trusted(repeat: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with stores(Path(tmp)) as found:
            for name, opener in found:
                store = opener()
                try:
                    await fill(store, "run", 64000)
                    await record(store, "run", trusted(listing(0, 4000), True), n=N, cap=10_000_000, ttl=3600)
                    got = await measure_trusted(store, repeat)
                    rows.append((name, got))
                    print(name, {k: round(v) for k, v in got.items()}, file=sys.stderr, flush=True)
                finally:
                    await store.close()
    print("| store | keys of a 1,000-char trusted output (off / on) µs | keys of 64,000 chars (off / on) µs "
          "| record a 1,000-char trusted output (off / on) µs | sink check, +3 critical values (off / on) µs |")
    print("|---|---:|---:|---:|---:|")
    for name, got in rows:
        cells = [f"{got[f'{what} off']:.0f} / {got[f'{what} on']:.0f}"
                 for what in ("keys 1000", "keys 64000", "record 1000", "check")]
        print(f"| {name} | " + " | ".join(cells) + " |")


async def main(sizes: list[int], repeat: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with stores(Path(tmp)) as found:
            for name, opener in found:
                store = opener()
                try:
                    have = 0
                    for size in sizes:
                        await fill(store, "run", size - have)
                        have = size
                        got = await measure(store, repeat)
                        rows.append((name, size, got))
                        print(f"{name} {size}: " + ", ".join(f"{k} {v:.0f} µs" for k, v in got.items()),
                              file=sys.stderr, flush=True)
                finally:
                    await store.close()
    print("| store | untrusted text in the run's ledger (characters) | warm sink check (300-char argument) µs "
          "| warm sink check: CPU of this process µs "
          "| record (1,000-char output) µs | 10 KB output: fingerprint µs | 10 KB output: store write µs "
          "| 10 KB output: added before delivery µs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, size, got in rows:
        print(f"| {name} | {size:,} | {got['check']:.0f} | {got['check cpu']:.0f} | {got['record 1k']:.0f} "
              f"| {got['fingerprint 10k']:.0f} "
              f"| {got['write 10k']:.0f} | {got['fingerprint 10k'] + got['write 10k']:.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,64000,256000,1000000")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--trusted", action="store_true", help="measure what tainted-run escalation adds")
    parser.add_argument("--code", metavar="DIR", help="import the proxy package from DIR (another checkout)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop (as `envelope-proxy serve` does)")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop
        run = uvloop.run
    else:
        run = asyncio.run
    if args.trusted:
        run(main_trusted(args.repeat))
    else:
        run(main([int(x) for x in args.sizes.split(",")], args.repeat))
