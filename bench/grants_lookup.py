"""`python bench/grants_lookup.py TREE [TREE ...]`: what it costs a gated call to look for a grant
when the store holds many, per source tree (`ApprovalService.find_grant` in a process with
`PYTHONPATH=<tree>`), on one SQLite file or one redis-server seeded once by this tree.

Seeded: `--same` grants of the calling principal for the called tool (other argument values),
`--others` grants of other principals, then the one grant that matches the call (created last).
Each tree looks it up `--rounds` times, the trees alternating; printed per tree: whether it was
found and the median time of a look-up (the first, which on this tree indexes grants of an
earlier version once, is left out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOOKUP = r"""
import asyncio, json, statistics, sys, time
from proxy.approvals.records import CallBinding
from proxy.approvals.service import ApprovalService
from proxy.store.redis import RedisStore
from proxy.store.sqlite import SqliteStore

async def main(where, n):
    store = RedisStore(where, prefix="envelope:", timeout=30) if where.startswith("redis:") \
        else SqliteStore(where, timeout=30)
    service = ApprovalService(store)
    binding = CallBinding("ops", "run-1", "gated", "write_note", "sha256:x")
    args = {"title": "t", "folder": "last"}
    found, times = None, []
    for _ in range(n + 1):
        start = time.perf_counter()
        grant = await service.find_grant(binding, args)
        times.append(time.perf_counter() - start)
        found = grant.id if grant else None
    await store.close()
    print(json.dumps({"found": found, "median": statistics.median(times[1:])}))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def _seed(where: str, same: int, others: int) -> str:
    from proxy.approvals.records import Grant
    from proxy.approvals.service import ApprovalService
    from proxy.store.base import Store
    from proxy.store.redis import RedisStore
    from proxy.store.sqlite import SqliteStore

    store: Store = (RedisStore(where, prefix="envelope:", timeout=30) if where.startswith("redis:")
                    else SqliteStore(Path(where), timeout=30))
    service = ApprovalService(store)
    now = time.time()

    def grant(i: int, principal: str, folder: str) -> Grant:
        return Grant(id=f"grt-{i:016x}", scope="tool", principal=principal, upstream="gated",
                     tool="write_note", run=None, args={"folder": folder}, approver="alice",
                     reason="seeded", approval_id="apr-0000000000000000", created_at=now,
                     expires_at=now + 3600)

    seeded = [grant(i, "ops", f"f-{i}") for i in range(same)]
    seeded += [grant(same + i, f"p-{i}", "last") for i in range(others)]
    for start in range(0, len(seeded), 20):
        await asyncio.gather(*(service.add_grant(g) for g in seeded[start:start + 20]))
    # As an approver gives it: a random id, a moment later (so it also expires later).
    last = Grant(id=f"grt-{secrets.token_hex(8)}", scope="tool", principal="ops", upstream="gated",
                 tool="write_note", run=None, args={"folder": "last"}, approver="alice",
                 reason="the last one", approval_id="apr-0000000000000001", created_at=now + 1,
                 expires_at=now + 3601)
    await service.add_grant(last)
    await store.close()
    return last.id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--same", type=int, default=1000)
    parser.add_argument("--others", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=20)
    parser.add_argument("--store", choices=("sqlite", "redis"), default="sqlite")
    args = parser.parse_args()
    from tests.redis_server import running_redis

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        where = (stack.enter_context(running_redis(Path(tmp))).url if args.store == "redis"
                 else str(Path(tmp) / "state.db"))
        expected = asyncio.run(_seed(where, args.same, args.others))
        results: dict[Path, list[dict[str, object]]] = {t: [] for t in args.trees}
        for _ in range(args.rounds):
            for tree in args.trees:
                out = subprocess.run([sys.executable, "-c", LOOKUP, where, str(args.lookups)],
                                     env={**os.environ, "PYTHONPATH": str(tree.resolve())},
                                     cwd=tmp,  # `-c` puts the working directory first on the path
                                     capture_output=True, text=True, check=True)
                results[tree].append(json.loads(out.stdout))
        for tree, runs in results.items():
            medians = sorted(float(r["median"]) for r in runs)  # type: ignore[arg-type]
            found = {r["found"] == expected for r in runs}
            print(f"{tree} ({args.store}, {args.same}+{args.others}+1 grants): found {found}, "
                  f"median look-up {medians[len(medians) // 2] * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
