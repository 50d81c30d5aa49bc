"""`python bench/approvals_list.py TREE [TREE ...]`: the cost of `GET /v1/approvals` with many
large pending approvals, one real proxy per source tree, asked in turn.

Each tree's proxy (`envelope-proxy serve` with `PYTHONPATH=<tree>`) gets `--count` pending
approvals of `--size` bytes of arguments (gated `delete_note` calls, refused as pending), then
the trees are asked for the pending list `--rounds` times, alternating. Printed per tree: the
answer's size, the median and worst time to the last byte, the most resident memory the
process grew by while answering (its RSS sampled every 5 ms, less the RSS just before), and the
bytes read from the store per answer (median): with `--store redis` (one redis-server per tree)
what the server sent (`total_net_output_bytes`); with SQLite (the default) the process's
`rchar` (/proc/<pid>/io: the file's preads, and any other file read meanwhile; SQLite's own page
cache answers without one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import ProxyProcess, mcp_client, proxy_process, token, upstream_server  # noqa: E402

APPROVER = "bench-approver-token"
OPS = token("ops", tenant="acme")


def _policy(directory: Path) -> Path:
    import json

    directory.mkdir(parents=True, exist_ok=True)
    doc = {"version": 1,
           "upstreams": {"notes": {"url": "http://127.0.0.1:1/mcp", "timeout": "30s"}},
           "defaults": {"unknown_tools": "deny"},
           "tools": {"notes.delete_note": {"effect": "destructive",
                                           "approval": {"required": True, "wait": "0s"}}}}
    (directory / "policy.yaml").write_text(json.dumps(doc))
    return directory


def _rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def _peak(pid: int) -> Iterator[list[int]]:
    """[growth KiB]: the most RSS over the value on entry, sampled every 5 ms until exit."""
    base, out, done = _rss_kib(pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            out[0] = max(out[0], _rss_kib(pid) - base)
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()


async def _fill(pp: ProxyProcess, count: int, size: int) -> None:
    async with mcp_client(pp.url("notes"), "auto", bearer=OPS) as client:
        for i in range(count):
            result = await client.call_tool("delete_note", {"title": f"{i:04d}-" + "x" * size})
            assert result.is_error, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--size", type=int, default=2**20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", choices=("sqlite", "redis"), default="sqlite")
    args = parser.parse_args()
    import hashlib

    import redis

    from tests.redis_server import running_redis

    config = {"approvals": {"approvers": {
        "bench": {"token_sha256": hashlib.sha256(APPROVER.encode()).hexdigest()}}}}
    with tempfile.TemporaryDirectory() as tmp, upstream_server("sse") as up, contextlib.ExitStack() as stack:
        proxies: list[ProxyProcess] = []
        read_bytes: list[Callable[[], int]] = []
        for i, tree in enumerate(args.trees):
            work = Path(tmp) / f"t{i}"
            work.mkdir()
            tree_config = dict(config)
            if args.store == "redis":
                server = stack.enter_context(running_redis(work))
                tree_config["store"] = {"kind": "redis", "url": server.url, "timeout": 30}
                client = redis.Redis.from_url(server.url)
                read_bytes.append(lambda c=client: int(c.info("stats")["total_net_output_bytes"]))
            pp = stack.enter_context(proxy_process(
                work, {"notes": up.url}, policies=_policy(work / "policies"), config=tree_config,
                env={"PYTHONPATH": str(tree.resolve())}))
            if args.store == "sqlite":
                read_bytes.append(lambda pid=pp.proc.pid: _rchar(pid))
            asyncio.run(_fill(pp, args.count, args.size))
            proxies.append(pp)
        results: dict[int, list[tuple[float, int, int, int]]] = {i: [] for i in range(len(proxies))}
        headers = {"Authorization": f"Bearer {APPROVER}"}
        with httpx.Client(timeout=120, headers=headers) as http:
            for _ in range(args.rounds):
                for i, pp in enumerate(proxies):
                    with _peak(pp.proc.pid) as grew:
                        before = read_bytes[i]()
                        start = time.perf_counter()
                        r = http.get(f"{pp.admin}/v1/approvals", params={"state": "pending"})
                        took = time.perf_counter() - start
                        read = read_bytes[i]() - before
                    assert r.status_code == 200 and len(r.json()["approvals"]) == args.count, r.text[:200]
                    results[i].append((took, len(r.content), grew[0], read))
        for i, tree in enumerate(args.trees):
            times = [t for t, _, _, _ in results[i]]
            print(f"{tree} ({args.store}): answer {results[i][0][1] / 1e6:.2f} MB, "
                  f"median {statistics.median(times):.3f} s, worst {max(times):.3f} s, "
                  f"RSS growth max {max(g for _, _, g, _ in results[i]) / 1024:.0f} MiB, "
                  f"store read median {statistics.median(b for _, _, _, b in results[i]) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
