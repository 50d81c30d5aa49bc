"""`python bench/guardrail_stall.py TREE [TREE ...]`: how long another client waits while the
output guardrails scan a 10 MB upstream reply, one real proxy per source tree, in turn.

Each tree's proxy (`envelope-proxy serve` with `PYTHONPATH=<tree>`) sits in front of a scripted
upstream (tests/e2e/scripted_upstream.py) whose `huge` tool answers `--mb` MB of one hostile
text (`api_key=` over and over; the same with a zero-width space after each `=`) and whose
`small` tool answers a word; `defaults.guardrails` is `{detector: secrets, action: block}` (a
block withholds the huge reply: the client reads a short refusal, so the time is the scan's).
Client A calls `huge`; as soon as the upstream has the call, client B calls `small` over and
over until A has its answer. Printed per tree, text and round: A's time, B's calls, and B's
longest call (the time a client of the process waited behind the scan). Trees alternate within
each round.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from scripted_upstream import Script, scripted_server  # noqa: E402
from test_response_path import Client  # noqa: E402

from tests.harness import proxy_process  # noqa: E402

TEXTS = {"api_key=": "api_key= ", "api_key=<U+200B>": "api_key=\u200b "}
JSON_HEADERS = {"Content-Type": "application/json"}


def _policy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    doc = {"version": 1,
           "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "120s"}},
           "defaults": {"unknown_tools": "deny", "guardrails": [{"detector": "secrets", "action": "block"}]},
           "tools": {"h.huge": {"effect": "read"}, "h.small": {"effect": "read"}}}
    (directory / "p.yaml").write_text(json.dumps(doc))
    return directory


def _answer(text: str) -> Script:
    body = json.dumps({"jsonrpc": "2.0", "id": None,
                       "result": {"content": [{"type": "text", "text": text}], "isError": False}})
    return Script([body.replace('"id": null', '"id": {id}').encode()], headers=JSON_HEADERS)


def _client(url: str) -> Client:
    client = Client(url, stateless=True)
    client.http.timeout = httpx.Timeout(600)  # a scan on the loop holds every call that long
    return client


def one(url: str, up: Any) -> tuple[float, int, float]:
    """(A's seconds, B's calls, B's longest call in seconds) for one huge call."""
    up.seen.clear()
    done: dict[str, Any] = {}

    def big() -> None:
        start = time.perf_counter()
        done["answer"] = _client(url).call("huge", {})
        done["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=big)
    thread.start()
    while not up.calls() and thread.is_alive():
        time.sleep(0.001)
    small = _client(url)
    waits = []
    while thread.is_alive():
        start = time.perf_counter()
        answer = small.call("small", {})
        waits.append(time.perf_counter() - start)
        assert answer["result"]["content"][0]["text"] == "small", answer
    thread.join()
    assert "guardrail_blocked" in done["answer"]["result"]["content"][0]["text"], done
    return done["seconds"], len(waits), max(waits, default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tools = [{"name": n, "inputSchema": {"type": "object"}} for n in ("huge", "small")]
    with tempfile.TemporaryDirectory() as tmp, scripted_server(tools) as up:
        up.scripts["tools/call:small"] = _answer("small")
        with __import__("contextlib").ExitStack() as stack:
            urls = []
            for i, tree in enumerate(args.trees):
                base = Path(tmp) / f"t{i}"
                base.mkdir()
                pp = stack.enter_context(proxy_process(base, {"h": up.url}, policies=_policy(base / "policy"),
                                                       env={"PYTHONPATH": str(tree.resolve())}))
                urls.append(pp.url("h"))
            for name, unit in TEXTS.items():
                up.scripts["tools/call:huge"] = _answer(unit * int(args.mb * 1e6 / len(unit)))
                for r in range(args.rounds):
                    for tree, url in zip(args.trees, urls, strict=True):
                        seconds, calls, longest = one(url, up)
                        print(f"{tree}  {name:18} round {r + 1}: huge call {seconds:6.2f} s, "
                              f"small calls meanwhile {calls:5d}, longest {longest * 1000:8.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
