"""Cost of the `rate_limit` check per call: nothing for a call no limit applies to, one store
round trip for a limited one.

Times, per store (memory, sqlite in a temp file, redis on a redis-server started here when the
binary exists):

- applies: `RateLimitCheck.applies` for a principal and tool without limits (the whole cost of
  the check for them: the store is never touched);
- decide: `applies` + `decide` for a call with three buckets (the principal's rate, the tool's
  rate, the run's budget), all granted: one `Store.take`.

Usage (from the repository root, venv active):

    python bench/ratelimit_bench.py [--repeat 2000]

Prints a Markdown table (median µs per call).
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

from proxy.envelope.checks.ratelimit import RateLimitCheck
from proxy.envelope.tools import ToolRegistry
from proxy.envelope.types import Principal, RequestInfo, RunContext, Services, ToolCall
from proxy.policy.loader import load_policy
from proxy.store.base import Store
from proxy.store.memory import MemoryStore
from proxy.store.redis import RedisStore
from proxy.store.sqlite import SqliteStore

# Rates no benchmark run can spend: every timed call is granted.
POLICY = """\
version: 1
upstreams: {demo: {url: "http://127.0.0.1:9/mcp"}}
tools:
  demo.search: {effect: read, rate: 1000000/s}
  demo.echo: {effect: read}
principals:
  limited: {rate: 1000000/s, max_calls_per_run: 100000000}
  free: {}
"""


def call(principal: str, tool: str) -> ToolCall:
    return ToolCall(decision_id="d-1", upstream="demo", tool=tool, arguments={},
                    principal=Principal(principal), run=RunContext("run-1", principal),
                    request=RequestInfo("tools/call"))


@asynccontextmanager
async def stores(tmp: Path) -> AsyncIterator[list[tuple[str, Callable[[], Store]]]]:
    found: list[tuple[str, Callable[[], Store]]] = [("memory", MemoryStore)]
    found.append(("sqlite", lambda: SqliteStore(tmp / "state.db", timeout=30.0)))
    if shutil.which("redis-server"):
        from tests.redis_server import running_redis
        (tmp / "redis").mkdir()
        with running_redis(tmp / "redis") as server:
            found.append(("redis", lambda: RedisStore(server.url, prefix="b:", timeout=30.0)))
            yield found
    else:
        yield found


async def measure(check: RateLimitCheck, repeat: int) -> tuple[float, float]:
    """(median µs of `applies` for an unlimited call, median µs of a limited call's decision)."""
    free, limited = call("free", "echo"), call("limited", "search")
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        applies = check.applies(free)
        samples.append(time.perf_counter() - t0)
        assert not applies
    applies_us = statistics.median(samples) * 1e6
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        decision = await check.decide(limited) if check.applies(limited) else None
        samples.append(time.perf_counter() - t0)
        assert decision is None, decision  # granted: the store work, not a refusal, is timed
    return applies_us, statistics.median(samples) * 1e6


async def main(repeat: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "policy").mkdir()
        (Path(tmp) / "policy" / "policy.yaml").write_text(POLICY)
        revision = load_policy(Path(tmp) / "policy")
        async with stores(Path(tmp)) as found:
            for name, opener in found:
                store = opener()
                try:
                    check = RateLimitCheck(revision, ToolRegistry(), Services(store=store))
                    await measure(check, 50)  # warm: connections, scripts, tables
                    applies_us, decide_us = await measure(check, repeat)
                    rows.append((name, applies_us, decide_us))
                    print(f"{name}: applies {applies_us:.2f} µs, decide {decide_us:.0f} µs",
                          file=sys.stderr, flush=True)
                finally:
                    await store.close()
    print("| store | no limit: `applies` µs | limited (3 buckets, one take) µs |")
    print("|---|---:|---:|")
    for name, applies_us, decide_us in rows:
        print(f"| {name} | {applies_us:.2f} | {decide_us:.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2000)
    asyncio.run(main(parser.parse_args().repeat))
