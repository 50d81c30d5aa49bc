"""`python bench/lagprobe.py LAGFILE serve ...`: `envelope-proxy serve ...` with a probe on its
event loop, for bench/policy_load.py --traffic.

Once the runtime has started, a task sleeps `INTERVAL` seconds over and over; each wake-up later
than asked is the loop's lag, time nothing else on the loop could run (a callback or a thread
holding the GIL). Every lag over `FLOOR` is appended to LAGFILE as `<unix time> <seconds>`, so
the bench reads the longest stall of each phase; once a second it writes the process's resident
set size (pages) to LAGFILE with the suffix `.rss`. Bench-only: the proxy itself carries no probe.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

INTERVAL = 0.002
FLOOR = 0.001


def resident(path: Path) -> None:
    """Write the process's resident set size (pages) to `path` (a read of /proc: microseconds)."""
    with open("/proc/self/statm", encoding="ascii") as statm, open(path, "w", encoding="ascii") as now:
        now.write(statm.read().split()[1])


async def probe(path: Path) -> None:
    rss = path.with_suffix(".rss")
    with path.open("a", buffering=1, encoding="utf-8") as out:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(INTERVAL)
            lag = time.perf_counter() - t0 - INTERVAL
            if lag > FLOOR:
                out.write(f"{time.time():.4f} {lag:.5f}\n")
            if int(t0) != int(time.perf_counter()):  # once a second
                resident(rss)


def main() -> int:
    path = Path(sys.argv[1])
    sys.argv = ["envelope-proxy", *sys.argv[2:]]
    from proxy.app import runtime
    from proxy.cli import main as cli_main

    start = runtime.Runtime.start
    tasks: set[asyncio.Task[None]] = set()

    async def started(self: runtime.Runtime, *args: Any, **kwargs: Any) -> Any:
        result = await start(self, *args, **kwargs)
        tasks.add(asyncio.get_running_loop().create_task(probe(path)))
        return result

    runtime.Runtime.start = started  # type: ignore[method-assign]
    return int(cli_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
