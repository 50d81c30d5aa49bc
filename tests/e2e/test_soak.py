"""Soak + faults: sustained mixed load on the real proxy (`store: redis`) while its parts fail.

32 concurrent clients (half stateless 2026-07-28, half with sessions; reads and writes, some
with an `Idempotency-Key`, some of those repeated to be replayed) call `hostile_upstream.py`
through the real `envelope-proxy` process for `ENVELOPE_SOAK_SECONDS` (default 60; by hand e.g.
300). Every call carries a nonce in its arguments. Each cycle (60 s, or the whole run if
shorter) the upstream is killed and restarted on its port, Redis is killed and restarted on its
port, and the audit file "fills" (the proxy's soft `RLIMIT_FSIZE` lowered to just above the
audit file's size with `resource.prlimit`, later lifted; the store is Redis, so only the audit
file is written). After each fault is repaired a probe (a keyed write: it needs the upstream,
the store and the audit log) measures the recovery time.

Afterwards:
- no call performed without a record: every nonce that reached the upstream has an audit
  record, except calls whose result was withheld because the record could not be written
  (the client got `audit_unavailable`, documented in the README's "Audit log");
- a replayed answer's call was not performed again;
- no record lost: every reply's decision id (refusals carry one) is in the log, and every
  delivered result's nonce has a record, except replies refused `audit_unavailable`;
- `envelope-proxy audit verify` passes (the chain holds across the failed writes);
- the process recovered without a restart: same process, `/readyz` 200, a final call succeeds.

The numbers (calls, outcomes by code, recovery per fault) are printed as a markdown table.
Marker `soak`; needs `redis-server` (skips without it unless ENVELOPE_REQUIRE_REDIS=1).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import CLI, write_doc

from tests.harness import ProxyProcess, free_port, proxy_process, stop, token, wait_port
from tests.redis_server import RedisServer, redis_server_binary

pytestmark = pytest.mark.soak

SECONDS = float(os.environ.get("ENVELOPE_SOAK_SECONDS", "60"))
CYCLE = 60.0  # one round of the three faults per this many seconds
CONCURRENCY = 32
DOWN = 2.0  # seconds each fault lasts
FILL_HEADROOM = 32 * 1024  # bytes the audit file may still grow once the "disk" is full
STATELESS, LEGACY = "2026-07-28", "2025-11-25"
HOSTILE = Path(__file__).resolve().parent / "hostile_upstream.py"
ROOT = Path(__file__).resolve().parents[2]
# The upstream's own refusals (no session, unknown session...): no tool ran.
REFUSED_BY_UPSTREAM = frozenset({400, 404, 405, 409, 413})


def policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "3s"}},
        "defaults": {"unknown_tools": "deny", "log_args": True},
        "tools": {"h.read_page": {"effect": "read"}, "h.write_note": {"effect": "write"}},
    })


class Upstream:
    """The hostile upstream as a process that can be killed and restarted on the same port;
    its in-memory message log is collected as it goes (a restart starts a new one)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.life = 0
        self.log: dict[tuple[int, int], dict[str, Any]] = {}  # (life, seq) -> log entry

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HOSTILE), "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        self.life += 1
        wait_port(self.port, self.proc)

    def kill(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGKILL)
            self.proc = None

    async def collect(self, http: httpx.AsyncClient) -> None:
        """Fetch this life's new log entries, and again those still in flight (their status
        comes later). An entry is kept from its arrival: a call that reached the upstream."""
        mine = [seq for (life, seq) in self.log if life == self.life]
        open_ = [seq for seq in mine if self.log[(self.life, seq)].get("outcome") is None]
        since = min(open_) - 1 if open_ else max(mine, default=0)
        response = await http.get(f"http://127.0.0.1:{self.port}/_log", params={"since": since})
        response.raise_for_status()
        for entry in response.json():
            self.log[(self.life, entry["seq"])] = entry


@dataclass
class Reply:
    """What one client saw of one call."""

    nonce: str
    tool: str
    keyed: bool
    started: float
    ended: float
    status: int | None  # HTTP status; None: no answer (transport error)
    code: str  # the envelope's decision code, `ok` for a delivered result, else a wire label
    decision_id: str | None = None
    reason: str = ""


@dataclass
class Run:
    replies: list[Reply] = field(default_factory=list)
    faults: list[tuple[str, float]] = field(default_factory=list)  # (fault, recovery seconds)
    stopping: bool = False


def messages_of(response: httpx.Response) -> list[dict[str, Any]]:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        out = []
        for line in response.text.replace("\r\n", "\n").split("\n"):
            if line.startswith("data:"):
                data = line[5:].strip()
                if data:
                    out.append(json.loads(data))
        return out
    return [response.json()] if response.content else []


def classify(response: httpx.Response, rpc_id: int) -> tuple[str, str | None, str]:
    """(code, decision id, reason) of a reply."""
    try:
        answers = [m for m in messages_of(response) if m.get("id") == rpc_id]
    except ValueError:
        answers = []
    if not answers:
        return f"http_{response.status_code}", None, response.text[:200]
    message = answers[-1]
    body = message.get("result") if "result" in message else message.get("error", {}).get("data")
    meta = (body or {}).get("_meta") if isinstance(body, dict) else None
    decision = (meta or {}).get("envelope/decision") if isinstance(meta, dict) else None
    if isinstance(decision, dict):
        return str(decision.get("code")), decision.get("decision_id"), str(decision.get("reason", ""))
    if "error" in message:
        return f"rpc_{message['error'].get('code')}", None, str(message["error"].get("message"))[:200]
    if isinstance(meta, dict) and meta.get("envelope/replayed"):
        return "replayed", None, ""
    return "ok", None, ""


class Caller:
    """One client: stateless, or with a session it opens again when the upstream loses it."""

    def __init__(self, base: str, stateless: bool, bearer: str):
        self.url = f"{base}/mcp/h"
        self.stateless = stateless
        self.session: str | None = None
        self.ids = 0
        self.http = httpx.AsyncClient(timeout=15, headers={"Authorization": f"Bearer {bearer}"})

    def headers(self, extra: dict[str, str]) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
             "MCP-Protocol-Version": STATELESS if self.stateless else LEGACY, **extra}
        if self.session:
            h["Mcp-Session-Id"] = self.session
        return h

    async def open(self) -> bool:
        if self.stateless or self.session:
            return True
        try:
            response = await self.http.post(self.url, headers=self.headers({}), json={
                "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": LEGACY, "capabilities": {},
                    "clientInfo": {"name": "soak", "version": "1"}}})
        except httpx.HTTPError:
            return False
        self.session = response.headers.get("mcp-session-id")
        if self.session is None:
            return False
        await self.http.post(self.url, headers=self.headers({}),
                             json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        return True

    async def call(self, tool: str, nonce: str, key: str | None) -> Reply:
        self.ids += 1
        rpc_id = self.ids
        params: dict[str, Any] = {"name": tool, "arguments": {"mode": "json", "text": "soak", "key": nonce}}
        if self.stateless:
            params["_meta"] = {"io.modelcontextprotocol/protocolVersion": STATELESS,
                               "io.modelcontextprotocol/clientInfo": {"name": "soak", "version": "1"}}
        extra = {"Idempotency-Key": key} if key else {}
        started = time.monotonic()
        try:
            response = await self.http.post(self.url, headers=self.headers(extra), json={
                "jsonrpc": "2.0", "id": rpc_id, "method": "tools/call", "params": params})
        except httpx.HTTPError as exc:
            return Reply(nonce, tool, key is not None, started, time.monotonic(), None,
                         f"transport_{type(exc).__name__}")
        code, decision_id, reason = classify(response, rpc_id)
        if response.status_code == 404:  # the upstream lost the session: open a new one
            self.session = None
        return Reply(nonce, tool, key is not None, started, time.monotonic(), response.status_code,
                     code, decision_id, reason)

    async def close(self) -> None:
        await self.http.aclose()


async def worker(n: int, base: str, run: Run, rng: random.Random) -> None:
    caller = Caller(base, stateless=n % 2 == 0, bearer=token(f"soak-{n % 4}"))
    try:
        while not run.stopping:
            if not await caller.open():
                await asyncio.sleep(0.1)
                continue
            tool = "read_page" if rng.random() < 0.6 else "write_note"
            key = uuid.uuid4().hex if rng.random() < 0.3 else None
            nonce = uuid.uuid4().hex
            reply = await caller.call(tool, nonce, key)
            run.replies.append(reply)
            if key and reply.code == "ok" and rng.random() < 0.3:
                # The same call again: answered from the store, never performed twice.
                run.replies.append(await caller.call(tool, nonce, key))
    finally:
        await caller.close()


async def probe(base: str, run: Run, since: float, within: float = 30.0) -> float:
    """Seconds from `since` until a keyed write succeeds (it needs all three parts)."""
    caller = Caller(base, stateless=True, bearer=token("soak-probe"))
    try:
        while time.monotonic() - since < within:
            reply = await caller.call("write_note", uuid.uuid4().hex, uuid.uuid4().hex)
            run.replies.append(reply)
            if reply.code == "ok":
                return reply.ended - since
            await asyncio.sleep(0.05)
        raise AssertionError(f"no successful call {within}s after the repair")
    finally:
        await caller.close()


async def faults(pp: ProxyProcess, upstream: Upstream, redis: RedisServer, run: Run,
                 control: httpx.AsyncClient, start: float) -> None:
    """The schedule: per cycle, upstream at 15 %, Redis at 40 %, audit disk at 65 %."""
    cycle = min(CYCLE, SECONDS)

    async def at(offset: float) -> None:
        while time.monotonic() - start < offset:
            await upstream.collect(control)
            await asyncio.sleep(min(1.0, max(offset - (time.monotonic() - start), 0)))

    begin = 0.0
    while begin + cycle <= SECONDS + 0.01:
        await at(begin + 0.15 * cycle)
        await upstream.collect(control)
        upstream.kill()
        await asyncio.sleep(DOWN)
        await asyncio.to_thread(upstream.start)
        run.faults.append(("upstream killed, restarted", await probe(pp.base, run, time.monotonic())))

        await at(begin + 0.40 * cycle)
        redis.kill()
        await asyncio.sleep(DOWN)
        await asyncio.to_thread(redis.start)
        run.faults.append(("redis killed, restarted", await probe(pp.base, run, time.monotonic())))

        await at(begin + 0.65 * cycle)
        size = (pp.audit_dir / "audit.jsonl").stat().st_size
        resource.prlimit(pp.proc.pid, resource.RLIMIT_FSIZE, (size + FILL_HEADROOM, resource.RLIM_INFINITY))
        await asyncio.sleep(DOWN)
        resource.prlimit(pp.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        run.faults.append(("audit disk full, freed", await probe(pp.base, run, time.monotonic())))
        begin += cycle
    await at(SECONDS)


async def soak(pp: ProxyProcess, upstream: Upstream, redis: RedisServer) -> Run:
    run = Run()
    rng = random.Random(12)
    async with httpx.AsyncClient(timeout=10) as control:
        start = time.monotonic()
        workers = [asyncio.create_task(worker(n, pp.base, run, rng)) for n in range(CONCURRENCY)]
        try:
            await faults(pp, upstream, redis, run, control, start)
        finally:
            run.stopping = True
            ended = await asyncio.gather(*workers, return_exceptions=True)
        crashed = [e for e in ended if isinstance(e, BaseException)]
        assert not crashed, f"load generator failed: {crashed[0]!r}"
        await upstream.collect(control)
    return run


@pytest.fixture()
def parts(tmp_path: Path) -> Iterator[tuple[ProxyProcess, Upstream, RedisServer]]:
    redis = RedisServer(redis_server_binary(), tmp_path)
    redis.start()
    upstream = Upstream()
    upstream.start()
    try:
        with proxy_process(tmp_path, {"h": upstream.url}, policies=policy(tmp_path / "policy"),
                           config={"store": {"kind": "redis", "url": redis.url, "timeout": 1.0}}) as pp:
            yield pp, upstream, redis
    finally:
        upstream.kill()
        redis.stop()


def table(run: Run, performed: int, withheld: int, records: int) -> str:
    codes = Counter(r.code for r in run.replies)
    lines = [f"soak: {SECONDS:.0f} s, {CONCURRENCY} clients, {len(run.replies)} calls "
             f"({len(run.replies) / SECONDS:.0f}/s), {performed} performed ({withheld} of them "
             f"withheld unrecorded: audit write failed), {records} audit records", "",
             "| outcome | calls |", "|---|---|"]
    lines += [f"| `{code}` | {n} |" for code, n in codes.most_common()]
    lines += ["", "| fault | recovery (s) |", "|---|---|"]
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in run.faults]
    return "\n".join(lines)


@pytest.mark.timeout(int(SECONDS) + 240)
def test_the_proxy_keeps_its_promises_through_upstream_store_and_disk_faults(
        parts: tuple[ProxyProcess, Upstream, RedisServer]) -> None:
    pp, upstream, redis = parts
    pid = pp.proc.pid
    run = asyncio.run(soak(pp, upstream, redis))

    # Recovered without a restart: same process, ready, and a plain call succeeds.
    assert pp.proc.poll() is None and pp.proc.pid == pid
    deadline = time.monotonic() + 10
    while httpx.get(f"{pp.admin}/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "not ready 10 s after the last fault"
        time.sleep(0.2)
    final = asyncio.run(probe(pp.base, Run(), time.monotonic(), within=10))
    assert final < 10

    # Every file of the log, rotated ones too (a long run passes `audit.max_bytes`).
    records = [json.loads(line) for path in sorted(pp.audit_dir.glob("audit*.jsonl"))
               for line in path.read_text().splitlines() if line.strip()]
    by_id = {r["decision_id"] for r in records}
    audited = {(r.get("args") or {}).get("key") for r in records if "method" not in r}
    replies = {r.nonce: r for r in run.replies}

    # No call performed without a record (withheld results excepted, see the docstring).
    performing = [(life, e["params"]["arguments"]["key"]) for (life, _), e in upstream.log.items()
                  if e["method"] == "tools/call" and e.get("status") not in REFUSED_BY_UPSTREAM]
    performed = {key for _, key in performing}
    # A replayed answer came from the store: that call was not performed again. (Within one
    # life of the upstream: a keyed call that failed with the upstream's crash frees its key,
    # so the agent's next try performs it again, by design.)
    times = Counter(performing)
    twice = [r.nonce for r in run.replies if r.code == "replayed"
             and any(times[(life, r.nonce)] > 1 for life in range(1, upstream.life + 1))]
    assert not twice, f"replayed calls performed more than once: {twice[:20]}"
    unrecorded = performed - audited
    unexplained = [(n, replies[n].code if n in replies else None) for n in sorted(unrecorded)
                   if n not in replies or replies[n].code != "audit_unavailable"]
    assert not unexplained, f"performed without an audit record: {unexplained[:20]}"
    log = pp.log()
    unlogged = [n for n in unrecorded if str(replies[n].decision_id) not in log]
    assert not unlogged, f"withheld calls whose decision id the proxy did not log: {unlogged[:20]}"
    # No record lost.
    lost = [r for r in run.replies if r.code != "audit_unavailable"
            and ((r.decision_id is not None and r.decision_id not in by_id)
                 or (r.code in ("ok", "replayed") and r.nonce not in audited))]
    assert not lost, f"replies without their record: {lost[:20]}"
    # The chain verifies.
    done = subprocess.run([*CLI, "audit", "verify", str(pp.audit_dir)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    # Every fault was survived, and the load did something.
    assert len(run.faults) == 3 * max(int(SECONDS // min(CYCLE, SECONDS)), 1)
    assert sum(r.code == "ok" for r in run.replies) > len(run.replies) / 2, Counter(r.code for r in run.replies)
    print("\n" + table(run, len(performed), len(unrecorded), len(records)))
