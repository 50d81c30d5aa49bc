"""Bounded resources, attacked through the real `envelope-proxy` process (issue 12, findings 5,
8 and 9). Each test reproduces what an attacker did to the old code:

- 5: GET streams held every upstream connection, so other principals' calls timed out;
- 8: one huge SSE event (or JSON reply) was read whole into the proxy's memory;
- 9: a connection that never finished its request head stayed open for ever.

The upstream is `hostile_upstream.py`; assertions are on what clients see (replies, status
codes, closed sockets), the audit log, and the proxy process's own memory (`/proc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import write_doc
from hostile_upstream import HostileUpstream, hostile_server

from tests.harness import ProxyProcess, proxy_process, token

LEGACY = "2025-11-25"
STATELESS = "2026-07-28"
MiB = 2**20
EVENT_CAP = 2 * MiB
REPLY_CAP = 1 * MiB


def policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "10s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"h.read_page": {"effect": "read"}},
    })


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    with hostile_server() as up:
        yield up


@contextlib.contextmanager
def limited_proxy(tmp: Path, hostile: HostileUpstream, **config: Any) -> Iterator[ProxyProcess]:
    hostile.control.reset()
    with proxy_process(tmp, {"h": hostile.url}, policies=policy(tmp / "policy"), config=config) as pp:
        yield pp


def headers(principal: str, session: str | None = None, stateless: bool = False) -> dict[str, str]:
    h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
         "MCP-Protocol-Version": STATELESS if stateless else LEGACY,
         "Authorization": f"Bearer {token(principal)}"}
    if session:
        h["Mcp-Session-Id"] = session
    return h


def messages(response: httpx.Response) -> list[dict[str, Any]]:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return [json.loads(line[5:]) for line in response.text.splitlines()
                if line.startswith("data:") and line[5:].strip()]
    return [response.json()]


def call(url: str, principal: str, arguments: dict[str, Any], timeout: float = 20) -> dict[str, Any]:
    """A stateless `tools/call` of `read_page`; its JSON-RPC reply."""
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "read_page", "arguments": arguments,
        "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                  "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
    response = httpx.post(url, json=body, headers=headers(principal, stateless=True), timeout=timeout)
    [reply] = [m for m in messages(response) if m.get("id") == 7]
    return reply


def vm(pid: int) -> dict[str, int]:
    """The process's VmRSS and VmHWM (peak RSS), in bytes."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


# ---- finding 8: what an upstream sends is capped -------------------------------------------


def test_an_event_four_times_the_cap_is_refused_audited_and_never_held(tmp_path: Path,
                                                                       hostile: HostileUpstream) -> None:
    with limited_proxy(tmp_path, hostile, limits={"max_upstream_event_bytes": EVENT_CAP}) as pp:
        url = pp.url("h")
        # Warm up (imports, pools, caches) so that the peak measured next is the call's own.
        for _ in range(3):
            assert call(url, "alice", {"mode": "huge_event", "size": 256 * 1024})["result"]["isError"] is False
        before = vm(pp.proc.pid)
        reply = call(url, "alice", {"mode": "huge_event", "size": 4 * EVENT_CAP})
        after = vm(pp.proc.pid)
        # The old code held the whole 8 MiB event, then its parse and copies: tens of MB.
        grown = max(after["VmHWM"] - before["VmHWM"], after["VmRSS"] - before["VmRSS"])
        assert grown <= 2 * EVENT_CAP, (before, after)
        result = reply["result"]
        assert result["isError"] is True, reply
        decision = result["_meta"]["envelope/decision"]
        assert decision["code"] == "upstream_error", decision
        assert f"reply exceeds {EVENT_CAP} bytes" in result["content"][0]["text"], result
        [record] = [r for r in pp.audit_records() if r.get("code") == "upstream_error"]
        assert record["tool"] == "read_page" and f"reply exceeds {EVENT_CAP} bytes" in record["reason"]
        # The proxy is fine afterwards.
        assert call(url, "alice", {"mode": "json", "text": "ok"})["result"]["isError"] is False


def test_a_json_reply_past_its_cap_is_refused_and_audited(tmp_path: Path, hostile: HostileUpstream) -> None:
    with limited_proxy(tmp_path, hostile, limits={"max_upstream_reply_bytes": REPLY_CAP}) as pp:
        small = call(pp.url("h"), "alice", {"mode": "json", "text": "x" * (REPLY_CAP // 4)})
        assert small["result"]["isError"] is False, small
        reply = call(pp.url("h"), "alice", {"mode": "json", "text": "x" * (2 * REPLY_CAP)})
        result = reply["result"]
        assert result["isError"] is True
        assert result["_meta"]["envelope/decision"]["code"] == "upstream_error"
        assert f"reply exceeds {REPLY_CAP} bytes" in result["content"][0]["text"]
        [record] = [r for r in pp.audit_records() if r.get("code") == "upstream_error"]
        assert f"reply exceeds {REPLY_CAP} bytes" in record["reason"]



def test_a_relayed_json_answer_past_the_cap_is_a_502_not_a_buffer(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    """A listing is relayed, not a call: past the reply cap the client gets 502 with a JSON-RPC
    error naming the cap, and the proxy does not hold the whole answer."""
    cap = 64 * 1024
    with limited_proxy(tmp_path, hostile, limits={"max_upstream_reply_bytes": cap}) as pp:
        def listing() -> httpx.Response:
            body = {"jsonrpc": "2.0", "id": 3, "method": "resources/list", "params": {
                "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                          "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}
            return httpx.post(pp.url("h"), json=body, headers=headers("alice", stateless=True),
                              timeout=20)

        assert listing().status_code == 200  # within the cap: relayed as it came
        hostile.control.texts(resources={"note://inbox/" + "x" * (2 * cap): "big"})
        too_big = listing()
        assert too_big.status_code == 502, too_big.text
        error = too_big.json()["error"]
        assert f"{cap}" in error["message"] and "max_upstream_reply_bytes" in error["message"], error
        assert too_big.json()["id"] == 3
        assert call(pp.url("h"), "alice", {"mode": "json", "text": "still"})["result"]["isError"] is False


async def test_past_the_cap_a_session_call_is_cancelled_and_a_relayed_stream_ends(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    with limited_proxy(tmp_path, hostile, limits={"max_upstream_event_bytes": MiB}) as pp:
        url = pp.url("h")
        async with httpx.AsyncClient(timeout=httpx.Timeout(20, read=None)) as client:
            session = await open_session(client, url, "alice")
            body = {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
                "name": "read_page", "arguments": {"mode": "huge_event", "size": 4 * MiB}}}
            [reply] = messages(await client.post(url, json=body, headers=headers("alice", session)))
            assert reply["result"]["isError"] is True
            assert f"reply exceeds {MiB} bytes" in reply["result"]["content"][0]["text"]
            # The session upstream is told the call is abandoned.
            await asyncio.to_thread(hostile.control.wait, lambda log: any(
                e["method"] == "notifications/cancelled" and e["params"]["requestId"] == 5 for e in log))

            # A relayed GET stream: a small event passes, one past the cap ends the stream.
            get = {**headers("alice", session), "Accept": "text/event-stream"}
            async with client.stream("GET", url, headers=get) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()

                async def next_data() -> str:
                    async for line in lines:
                        if line.startswith("data:") and line[5:].strip():
                            return line
                    return ""

                note = {"jsonrpc": "2.0", "method": "notifications/message",
                        "params": {"level": "info", "data": "small"}}
                await asyncio.to_thread(hostile.control.push, note, session, 5)
                async with asyncio.timeout(5):
                    assert "small" in await next_data()
                huge = {**note, "params": {"level": "info", "data": "y" * (2 * MiB)}}
                await asyncio.to_thread(hostile.control.push, huge, session, 5)
                async with asyncio.timeout(5):
                    assert await next_data() == ""  # ended, nothing of the huge event relayed

# ---- finding 5: long-lived streams cannot starve calls ---------------------------------------


async def open_session(client: httpx.AsyncClient, url: str, principal: str) -> str:
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    response = await client.post(url, json=body, headers=headers(principal))
    assert response.status_code == 200, response.text
    session = response.headers["mcp-session-id"]
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await client.post(url, json=note, headers=headers(principal, session))).status_code == 202
    return session


@contextlib.asynccontextmanager
async def get_streams(url: str, principal: str, n: int) -> AsyncIterator[list[httpx.Response]]:
    """`n` standalone GET streams of `principal`, each on a session of its own, held open; the
    responses (status and headers read, bodies not)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=None),
                                 limits=httpx.Limits(max_connections=None)) as client, \
            contextlib.AsyncExitStack() as stack:
        responses = []
        for _ in range(n):
            session = await open_session(client, url, principal)
            get = {**headers(principal, session), "Accept": "text/event-stream"}
            responses.append(await stack.enter_async_context(client.stream("GET", url, headers=get)))
        yield responses


async def test_streams_past_the_principals_cap_are_refused_and_calls_still_pass(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    # The calls' pool is as small as the stream cap: on the old code the streams took it.
    limits = {"max_streams_per_principal": 3, "max_upstream_connections": 3}
    with limited_proxy(tmp_path, hostile, limits=limits) as pp:
        url = pp.url("h")
        async with get_streams(url, "mallory", 4) as streams:
            assert [r.status_code for r in streams] == [200, 200, 200, 503]
            refused = json.loads(await streams[3].aread())
            assert "limits.max_streams_per_principal" in refused["error"]["message"]
            assert streams[3].headers["Retry-After"]
            # Another principal's calls are served while the three streams are open.
            replies = await asyncio.gather(*(
                asyncio.to_thread(call, url, "bob", {"mode": "json", "text": f"hi {i}"}, 10)
                for i in range(6)))
            assert all(r["result"]["isError"] is False for r in replies), replies
        # A stream that ended frees its slot, once the proxy saw its client leave (polled: a
        # fixed pause was too short on a loaded machine).
        deadline = time.monotonic() + 15
        while True:
            async with get_streams(url, "mallory", 3) as streams:
                codes = [r.status_code for r in streams]
            if codes == [200, 200, 200] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert codes == [200, 200, 200]


async def test_the_upstreams_stream_budget_is_apart_from_the_calls_pool(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    limits = {"max_upstream_streams": 2, "max_upstream_connections": 2}
    with limited_proxy(tmp_path, hostile, limits=limits) as pp:
        url = pp.url("h")
        async with get_streams(url, "mallory", 2) as first, get_streams(url, "eve", 1) as second:
            assert [r.status_code for r in first] == [200, 200]
            assert second[0].status_code == 503
            assert "limits.max_upstream_streams" in json.loads(await second[0].aread())["error"]["message"]
            replies = await asyncio.gather(*(
                asyncio.to_thread(call, url, "bob", {"mode": "json", "text": f"hi {i}"}, 10)
                for i in range(4)))
            assert all(r["result"]["isError"] is False for r in replies), replies


# ---- finding 9: listener timeouts -------------------------------------------------------------


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed `sock` (None if it did not within `seconds`)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_slow_heads_and_idle_connections_are_closed_and_calls_still_pass(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    listener = {"header_timeout": "1s", "keepalive_timeout": "2s"}
    with limited_proxy(tmp_path, hostile, listener=listener) as pp:
        half = socket.create_connection(("127.0.0.1", pp.port), timeout=5)
        half.sendall(b"GET /mcp/h HT")
        slow = [socket.create_connection(("127.0.0.1", pp.port), timeout=5) for _ in range(200)]
        for s in slow:
            s.sendall(b"POST /mcp/h HTTP/1.1\r\nHost: x\r\n")
        try:
            # A normal call and the admin health check pass while 200 heads are pending.
            assert call(pp.url("h"), "bob", {"mode": "json", "text": "hi"})["result"]["isError"] is False
            assert httpx.get(f"{pp.admin}/healthz", timeout=5).status_code == 200
            waited = closed_within(half, 5)
            assert waited is not None and waited < 3, waited
            assert all(closed_within(s, 3) is not None for s in slow)
        finally:
            for s in [half, *slow]:
                s.close()
        # An idle keep-alive connection is closed after its own timeout, not the head's.
        with socket.create_connection(("127.0.0.1", pp.admin_port), timeout=5) as idle:
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert idle.recv(4096).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            waited = closed_within(idle, 6)
            assert waited is not None and 1.5 < time.monotonic() - started < 4.5, waited
        assert httpx.get(f"{pp.admin}/healthz", timeout=5).status_code == 200
        assert "header_timeout" in pp.metrics()


async def test_the_aggregated_get_holds_one_upstream_stream_per_session_within_the_budget(
        tmp_path: Path, hostile: HostileUpstream) -> None:
    config = {"aggregate": {"enabled": True}, "health_interval": 0,
              "limits": {"max_streams_per_principal": 1}}
    with limited_proxy(tmp_path, hostile, **config) as pp:
        agg = f"{pp.base}/mcp"

        def open_streams() -> int:
            return sum(s["get_streams"] for s in hostile.control.sessions())

        async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=None)) as client:
            session = await open_session(client, agg, "mallory")
            get = {**headers("mallory", session), "Accept": "text/event-stream"}
            async with client.stream("GET", agg, headers=get) as first:
                assert first.status_code == 200
                await asyncio.to_thread(hostile.control.wait, lambda _: open_streams() == 1)
                # A second GET on the session takes the first one's place: the first ends, the
                # upstream still sees one stream, and no second slot of the budget is taken.
                async with client.stream("GET", agg, headers=get) as second:
                    assert second.status_code == 200
                    async with asyncio.timeout(5):
                        assert await first.aread() == b""
                    await asyncio.sleep(0.5)
                    assert open_streams() == 1
                    # Another session of the same principal is past its budget: refused.
                    other = await open_session(client, agg, "mallory")
                    refused = await client.get(agg, headers={**headers("mallory", other),
                                                             "Accept": "text/event-stream"})
                    assert refused.status_code == 503
                    assert "limits.max_streams_per_principal" in refused.json()["error"]["message"]
            # The session's stream ended with its last GET: the slot is free again.
            await asyncio.to_thread(hostile.control.wait, lambda _: open_streams() == 0)
            async with client.stream("GET", agg, headers={**headers("mallory", other),
                                                          "Accept": "text/event-stream"}) as again:
                assert again.status_code == 200
