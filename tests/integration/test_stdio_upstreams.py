"""`StdioUpstreams` in-process: its loopback endpoint driven over real HTTP, real child
processes (a scripted line-oriented JSON-RPC server, `SCRIPT`), no proxy around it.

What the end-to-end tests cannot see from outside: the secret header, ids remapped so that two
stateless callers using the same id get their own replies, a line past the cap, the pool bound
answered at once, and `close()` leaving no process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.upstream import stdio as stdio_module
from proxy.upstream.stdio import PRINCIPAL_HEADER, SECRET_HEADER, StdioSpec, StdioUpstreams

# A stdio "server" that needs no SDK: `initialize` answers, `echo` replies `text` after `delay`
# seconds (requests run concurrently, so replies can cross), `big` writes one line of `size`
# bytes, `pid` its process id; `ask` sends a server request and replies with the answer;
# `noise` writes a 10,000-byte line and 300 short lines to stderr; `flood` writes `n` log
# notifications of ~1 KB, its reply, then `flooded` on stderr; `flood_later` replies first, then
# floods half a second later (no call in flight: for the session's GET stream). It speaks the handshake
# revisions only, unless MODERN is set: then it answers `server/discover` too.
SCRIPT = r"""
import asyncio, json, os, sys

async def main():
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout.buffer
    answers = {}

    def send(msg):
        out.write(json.dumps(msg).encode() + b"\n"); out.flush()

    async def handle(msg):
        m, p, i = msg.get("method"), msg.get("params") or {}, msg.get("id")
        if m == "server/discover" and os.environ.get("MODERN"):
            send({"jsonrpc": "2.0", "id": i, "result": {"supportedVersions": ["2026-07-28"],
                  "capabilities": {}, "resultType": "complete"}})
        elif m == "initialize":
            send({"jsonrpc": "2.0", "id": i, "result": {"protocolVersion": "2025-11-25",
                  "capabilities": {}, "serverInfo": {"name": "script", "version": "1"}}})
        elif m == "echo":
            await asyncio.sleep(p.get("delay", 0))
            send({"jsonrpc": "2.0", "id": i, "result": {"text": p["text"]}})
        elif m == "big":
            out.write(b'{"x": "' + b"a" * p["size"] + b'"}\n'); out.flush()
        elif m == "noise":
            sys.stderr.write("x" * 10000 + "\n" + "".join(f"line {n}\n" for n in range(300)))
            sys.stderr.flush()
            send({"jsonrpc": "2.0", "id": i, "result": {}})
        elif m == "whoami":
            send({"jsonrpc": "2.0", "id": i, "result": {"meta": p.get("_meta")}})
        elif m == "pid":
            send({"jsonrpc": "2.0", "id": i, "result": {"pid": os.getpid()}})
        elif m == "flood":
            for n in range(p["n"]):
                send({"jsonrpc": "2.0", "method": "notifications/message",
                      "params": {"level": "info", "data": f"{n} " + "x" * 1000}})
            send({"jsonrpc": "2.0", "id": i, "result": {"flooded": p["n"]}})
            sys.stderr.write("flooded\n"); sys.stderr.flush()
        elif m == "flood_later":
            send({"jsonrpc": "2.0", "id": i, "result": {}})
            await asyncio.sleep(0.5)
            for n in range(p["n"]):
                send({"jsonrpc": "2.0", "method": "notifications/message",
                      "params": {"level": "info", "data": f"{n} " + "x" * 1000}})
            sys.stderr.write("flooded\n"); sys.stderr.flush()
        elif m == "ask":
            fut = loop.create_future(); answers["q1"] = fut
            send({"jsonrpc": "2.0", "id": "q1", "method": "elicitation/create", "params": {"message": p["text"]}})
            answer = await fut
            send({"jsonrpc": "2.0", "id": i, "result": {"answer": answer}})
        elif i is not None:
            send({"jsonrpc": "2.0", "id": i, "error": {"code": -32601, "message": "Method not found"}})

    while True:
        line = await reader.readline()
        if not line:
            return
        msg = json.loads(line)
        if "method" not in msg and msg.get("id") in answers:
            answers.pop(msg["id"]).set_result(msg.get("result"))
            continue
        asyncio.ensure_future(handle(msg))

asyncio.run(main())
"""


def spec(max_processes: int = 4, idle_timeout: float = 300.0, name: str = "script",
         modern: bool = False) -> StdioSpec:
    return StdioSpec(name, (sys.executable, "-c", SCRIPT), max_processes=max_processes,
                     idle_timeout=idle_timeout, env=(("MODERN", "1"),) if modern else ())


@pytest.fixture
async def stdio() -> AsyncIterator[StdioUpstreams]:
    upstreams = StdioUpstreams(max_line_bytes=64 * 1024)
    upstreams.configure({"script": spec(max_processes=2),
                         "modern": spec(name="modern", modern=True)})
    await upstreams.start()
    try:
        yield upstreams
    finally:
        await upstreams.close()


async def post(stdio: StdioUpstreams, body: Any, headers: dict[str, str] | None = None,
               secret: bool = True, name: str = "script") -> tuple[int, dict[str, str], list[dict[str, Any]]]:
    """POST one message; (status, headers, the JSON messages of the answer, SSE or JSON)."""
    hdrs = {"Content-Type": "application/json", **(stdio.headers if secret else {}), **(headers or {})}
    async with aiohttp.ClientSession() as http, http.post(stdio.url(name), data=orjson.dumps(body),
                                                          headers=hdrs) as resp:
        raw = await resp.read()
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            messages = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
        elif resp.headers.get("Content-Type", "").startswith("application/json"):
            messages = [orjson.loads(raw)]
        else:
            messages = []
        return resp.status, dict(resp.headers), messages


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False


async def test_requests_without_the_secret_are_refused(stdio: StdioUpstreams) -> None:
    status, _, _ = await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "pid"}, secret=False)
    assert status == 403
    status, _, _ = await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "pid"},
                              headers={SECRET_HEADER: "guess"}, secret=False)
    assert status == 403
    assert stdio.processes("script") == 0  # nothing was started for them


async def test_stateless_callers_with_the_same_id_get_their_own_replies(stdio: StdioUpstreams) -> None:
    slow = post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "echo", "params": {"text": "slow", "delay": 0.5}})
    fast = post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "echo", "params": {"text": "fast", "delay": 0}})
    (s1, _, m1), (s2, _, m2) = await asyncio.gather(slow, fast)
    # The script speaks only the handshake revisions: the proxy initialised it and completes
    # its results for 2026-07-28 callers.
    assert (s1, m1) == (200, [{"jsonrpc": "2.0", "id": 1, "result": {"text": "slow", "resultType": "complete"}}])
    assert (s2, m2) == (200, [{"jsonrpc": "2.0", "id": 1, "result": {"text": "fast", "resultType": "complete"}}])
    assert stdio.processes("script") == 1  # one shared child served both


async def test_a_handshake_only_server_is_initialised_for_stateless_callers(
        stdio: StdioUpstreams) -> None:
    status, _, [discovered] = await post(stdio, {"jsonrpc": "2.0", "id": "d", "method": "server/discover",
                                                 "params": {}})
    assert (status, discovered["result"]) == (200, {
        "supportedVersions": ["2026-07-28"], "capabilities": {}, "resultType": "complete",
        "ttlMs": 0, "cacheScope": "private",
        "_meta": {"io.modelcontextprotocol/serverInfo": {"name": "script", "version": "1"}}})
    # The child's server request cannot reach a stateless caller: refused, the call goes on.
    _, _, [reply] = await post(stdio, {"jsonrpc": "2.0", "id": 8, "method": "ask", "params": {"text": "?"}})
    assert reply == {"jsonrpc": "2.0", "id": 8, "result": {"answer": None, "resultType": "complete"}}


async def test_a_server_request_reaches_its_stateless_caller_and_the_answer_the_child(
        stdio: StdioUpstreams) -> None:
    async with aiohttp.ClientSession() as http:
        hdrs = {"Content-Type": "application/json", **stdio.headers}
        body = {"jsonrpc": "2.0", "id": 7, "method": "ask", "params": {"text": "name?"}}
        async with http.post(stdio.url("modern"), data=orjson.dumps(body), headers=hdrs) as resp:
            line = b""
            while not line.startswith(b"data: "):
                line = (await resp.content.readline()).strip()
            request = orjson.loads(line[6:])
            assert request["method"] == "elicitation/create"
            assert str(request["id"]).startswith("envelope-stdio-")  # never the child's own id
            answer = {"jsonrpc": "2.0", "id": request["id"], "result": {"name": "ada"}}
            async with http.post(stdio.url("modern"), data=orjson.dumps(answer), headers=hdrs) as r2:
                assert r2.status == 202
            rest = await resp.read()
    [reply] = [orjson.loads(x[6:]) for x in rest.split(b"\n") if x.startswith(b"data: ")]
    assert reply == {"jsonrpc": "2.0", "id": 7, "result": {"answer": {"name": "ada"}}}


async def test_a_line_past_the_cap_breaks_the_child(stdio: StdioUpstreams) -> None:
    _, _, [first] = await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "pid"})
    pid = first["result"]["pid"]
    status, _, messages = await post(stdio, {"jsonrpc": "2.0", "id": 2, "method": "big",
                                             "params": {"size": 100_000}})
    assert (status, messages) == (200, [])  # the stream ended without a reply
    for _ in range(100):
        if not alive(pid):
            break
        await asyncio.sleep(0.05)
    assert not alive(pid)
    _, _, [again] = await post(stdio, {"jsonrpc": "2.0", "id": 3, "method": "pid"})
    assert again["result"]["pid"] != pid  # the next call started another child


async def test_sessions_past_the_bound_are_refused_at_once(stdio: StdioUpstreams) -> None:
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    # Two principals: each holds its share (1 of 2), and the pool is full for both.
    first = await post(stdio, init, {PRINCIPAL_HEADER: "a"})
    second = await post(stdio, init, {PRINCIPAL_HEADER: "b"})
    assert first[0] == second[0] == 200
    status, headers, [error] = await post(stdio, init, {PRINCIPAL_HEADER: "c"})
    assert (status, headers["Retry-After"]) == (503, "1")
    assert error["error"] == {"code": -32000, "message": "stdio upstream 'script' runs as many "
                              "processes as it may (max_processes: 2); try again later"}
    # Ending a session gives its process back.
    sid = first[1]["Mcp-Session-Id"]
    async with aiohttp.ClientSession() as http, http.delete(
            stdio.url("script"), headers={**stdio.headers, "Mcp-Session-Id": sid}) as resp:
        assert resp.status == 200
    assert (await post(stdio, init, {PRINCIPAL_HEADER: "a"}))[0] == 200
    status, _, _ = await post(stdio, {"jsonrpc": "2.0", "id": 2, "method": "pid"},
                              headers={"Mcp-Session-Id": sid})
    assert status == 404  # the ended session is unknown


async def test_close_leaves_no_child() -> None:
    stdio = StdioUpstreams()
    stdio.configure({"script": spec()})
    await stdio.start()
    try:
        await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}})
        await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "pid"})
        pids = stdio.pids()
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        await stdio.close()
    assert not [p for p in pids if alive(p)]


async def test_stderr_is_logged_bounded(stdio: StdioUpstreams, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="envelope.stdio")
    _, _, [first] = await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "pid"})
    pid = first["result"]["pid"]
    _, _, [reply] = await post(stdio, {"jsonrpc": "2.0", "id": 2, "method": "noise"})
    assert reply["result"] == {"resultType": "complete"}
    await stdio.close()  # the child's stderr ends: every line read, the count logged
    lines = [r.getMessage() for r in caplog.records if "stderr" in r.getMessage()]
    tag = f"stdio upstream script [{pid}] stderr: "
    assert lines[0] == tag + "x" * 4096 + " [... the rest of the line not logged]"
    assert lines[1:100] == [f"{tag}line {n}" for n in range(99)]  # 100 a second in all
    assert lines[100] == f"stdio upstream script [{pid}]: 201 stderr lines not logged (more than 100 a second)"


async def test_the_trace_context_reaches_the_child_in_meta(stdio: StdioUpstreams) -> None:
    """Over stdio the W3C trace context travels in `params._meta` (no headers on stdin): the
    `traceparent` the proxy's client span sent replaces any the caller's body carried."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    body = {"jsonrpc": "2.0", "id": 1, "method": "whoami",
            "params": {"_meta": {"traceparent": "00-forged", "com.example/tag": 1}}}
    _, _, [reply] = await post(stdio, body, headers={"traceparent": parent, "tracestate": "env=1"})
    assert reply["result"]["meta"] == {"traceparent": parent, "tracestate": "env=1", "com.example/tag": 1}
    # Without a (well-formed) trace context the message goes as it came.
    _, _, [reply] = await post(stdio, body, headers={"traceparent": "junk\u00e9"})
    assert reply["result"]["meta"] == {"traceparent": "00-forged", "com.example/tag": 1}


async def test_a_session_request_reusing_an_id_in_flight_is_refused(stdio: StdioUpstreams) -> None:
    """MCP forbids reusing a request id within a session: the second request with an id still
    in flight is refused at once and never reaches the child, so the first keeps its own reply
    (it would otherwise be delivered to the second, and the first wait until its timeout)."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    _, headers, _ = await post(stdio, init)
    session = {"Mcp-Session-Id": headers["Mcp-Session-Id"]}
    first = asyncio.ensure_future(post(stdio, {"jsonrpc": "2.0", "id": 7, "method": "echo", "params": {
        "text": "first", "delay": 0.5}}, headers=session))
    await asyncio.sleep(0.1)  # the first is in flight
    async with asyncio.timeout(10):
        second = await post(stdio, {"jsonrpc": "2.0", "id": 7, "method": "echo", "params": {
            "text": "second", "delay": 1.0}}, headers=session)
        status, _, [reply] = await first
    assert (status, reply) == (200, {"jsonrpc": "2.0", "id": 7, "result": {"text": "first"}})
    assert second[0] == 400
    assert second[2] == [{"jsonrpc": "2.0", "id": 7, "error": {
        "code": -32600, "message": "request id 7 is already in flight in this session"}}]
    # Once answered, the id may be used again.
    _, _, [again] = await post(stdio, {"jsonrpc": "2.0", "id": 7, "method": "echo", "params": {
        "text": "again"}}, headers=session)
    assert again["result"] == {"text": "again"}


async def test_a_child_that_exits_before_answering_initialize_opens_no_session() -> None:
    """The session's child exits at once: `initialize` is answered 502 with a JSON-RPC error
    (never an empty stream with a session id), and its process slot is given back."""
    stdio = StdioUpstreams()
    stdio.configure({"dead": StdioSpec("dead", (sys.executable, "-c", "import sys; sys.exit(3)"),
                                       max_processes=1)})
    await stdio.start()
    try:
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
        status, headers, messages = await post(stdio, init, name="dead")
        assert status == 502 and "Mcp-Session-Id" not in headers
        [error] = messages
        assert error["id"] == 1 and error["error"]["code"] == -32603
        assert error["error"]["message"].startswith("stdio upstream 'dead': ")
        assert stdio.processes("dead") == 0
    finally:
        await stdio.close()


async def test_a_session_ended_while_its_child_restarts_leaves_no_child(tmp_path: Any) -> None:
    """DELETE while the session's crashed child is being restarted: the child the restart
    brings up is stopped, not left running outside every session and slot."""
    marker = tmp_path / "slow-start"
    command = ("sh", "-c", f'test -f {marker} && sleep 2; exec "$0" -c "$1"', sys.executable, SCRIPT)
    others = frozenset(_children())
    stdio = StdioUpstreams(max_line_bytes=64 * 1024)
    stdio.configure({"script": StdioSpec("script", command)})
    await stdio.start()
    try:
        _, headers, _ = await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}})
        session = {"Mcp-Session-Id": headers["Mcp-Session-Id"]}
        _, _, [first] = await post(stdio, {"jsonrpc": "2.0", "id": 2, "method": "pid"}, headers=session)
        marker.touch()  # the restarted child takes 2 s to answer its replayed initialize
        await post(stdio, {"jsonrpc": "2.0", "id": 3, "method": "big", "params": {"size": 100_000}},
                   headers=session)  # a line past the cap: the child is killed and restarted
        await _until(lambda: [p for p in _children(others) if p != first["result"]["pid"]])  # restarting
        async with aiohttp.ClientSession() as http, http.delete(
                stdio.url("script"), headers={**stdio.headers, **session}) as resp:
            assert resp.status == 200
        await _until(lambda: not stdio._tasks)  # the restart finished
        assert [p for p in _children(others) if alive(p)] == []
        assert stdio.processes("script") == 0
    finally:
        await stdio.close()


async def test_a_restart_whose_child_never_reads_its_replayed_initialize_gives_up(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replayed `initialize` (here 200 KB: more than the pipe holds) is written within the
    handshake's deadline too: a restarted child that never reads stdin fails that restart, and
    after `MAX_SESSION_RESTARTS` of them the session ends (404). The write used to wait for
    ever: the session hung, neither restarted nor ended."""
    monkeypatch.setattr(stdio_module, "HANDSHAKE_SECONDS", 0.5)
    marker = tmp_path / "deaf"
    command = ("sh", "-c", f'test -f {marker} && exec sleep 60; exec "$0" -c "$1"', sys.executable, SCRIPT)
    stdio = StdioUpstreams(max_line_bytes=1024 * 1024)  # a 200 KB initialize is accepted
    stdio.configure({"script": StdioSpec("script", command)})
    await stdio.start()
    try:
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"clientInfo": {"name": "t", "version": "1", "pad": "x" * 200_000}}}
        status, headers, _ = await post(stdio, init)
        assert status == 200, status
        session = {"Mcp-Session-Id": headers["Mcp-Session-Id"]}
        marker.touch()  # every restarted child sleeps, never reading its stdin
        await post(stdio, {"jsonrpc": "2.0", "id": 2, "method": "big", "params": {"size": 2_000_000}},
                   headers=session)  # a line past the cap: the child is killed and restarted

        async def ended() -> bool:
            status, _, _ = await post(stdio, {"jsonrpc": "2.0", "id": 3, "method": "pid"}, headers=session)
            return status == 404

        # 5 restarts: 7.75 s of backoff, 2.5 s of deadlines. A call waits for the restart (or
        # is told 404), so it is bounded too.
        async with asyncio.timeout(40):
            for _ in range(80):
                if await ended():
                    break
                await asyncio.sleep(0.5)
            else:
                raise AssertionError("the session neither restarted nor ended")
    finally:
        await stdio.close()


async def _until(predicate: Callable[[], Any]) -> None:
    for _ in range(400):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not within 20 s")


def _children(besides: frozenset[int] = frozenset()) -> list[int]:
    """This process's live child processes (from /proc), but for `besides` (those a test found
    already running: other tests' fixtures, such as a session-wide upstream server)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z" and int(entry) not in besides:
                found.append(int(entry))
    return found


async def test_a_flood_for_a_call_read_slowly_is_dropped_past_the_budget_and_the_reply_passes(
        stdio: StdioUpstreams, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child writing notifications for a call faster than its caller reads them (20 MB, more
    than the sockets between them buffer): what is held for the call stops at
    `MAX_QUEUED_BYTES` (the rest dropped, counted in the log), so the proxy's memory does not
    follow the child's output; the reply still arrives, last."""
    monkeypatch.setattr("proxy.upstream.child.MAX_QUEUED_BYTES", 64 * 1024, raising=False)
    caplog.set_level(logging.INFO, logger="envelope.stdio")
    sent = 20_000
    body = {"jsonrpc": "2.0", "id": 5, "method": "flood", "params": {"n": sent}}
    async with aiohttp.ClientSession() as http, http.post(
            stdio.url("script"), data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **stdio.headers}) as resp:
        await _until(lambda: any(r.getMessage().endswith("stderr: flooded") for r in caplog.records))
        raw = await resp.read()  # read only once the child wrote everything
    messages = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert messages[-1] == {"jsonrpc": "2.0", "id": 5, "result": {"flooded": sent, "resultType": "complete"}}
    held = [int(m["params"]["data"].split()[0]) for m in messages[:-1]]
    assert held == sorted(held) and len(held) < sent
    logged = [r.getMessage() for r in caplog.records if "messages of child" in r.getMessage()]
    assert logged == [f"stdio upstream script: dropped {sent - len(held)} messages of child "
                      f"{stdio.pids()[0]} for a call whose client read them slower than they came"]


async def test_a_flood_for_a_session_stream_read_slowly_is_dropped_past_the_budget(
        stdio: StdioUpstreams, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bound on a session's GET stream (messages no call caused): at most
    `MAX_QUEUED_BYTES` held unread, whatever the child writes (was 256 messages of up to the
    line cap each)."""
    monkeypatch.setattr("proxy.upstream.child.MAX_QUEUED_BYTES", 64 * 1024, raising=False)
    caplog.set_level(logging.INFO, logger="envelope.stdio")
    sent = 20_000
    _, headers, _ = await post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}})
    session = {"Mcp-Session-Id": headers["Mcp-Session-Id"]}
    async with aiohttp.ClientSession() as http, http.get(
            stdio.url("script"), headers={**stdio.headers, **session}) as stream:
        await post(stdio, {"jsonrpc": "2.0", "id": 2, "method": "flood_later", "params": {"n": sent}},
                   headers=session)
        await _until(lambda: any(r.getMessage().endswith("stderr: flooded") for r in caplog.records))
        async with http.delete(stdio.url("script"), headers={**stdio.headers, **session}):
            pass  # ends the stream once what it holds is written (it never did with 256 held)
        async with asyncio.timeout(30):
            raw = await stream.read()
    held = [int(orjson.loads(line[6:])["params"]["data"].split()[0])
            for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert held == sorted(held) and 0 < len(held) < sent


async def test_an_upstream_dropped_while_its_shared_child_starts_leaves_no_child() -> None:
    """A reload removes (or changes) the upstream while its shared child is still starting: the
    child that comes up is stopped, its slot given back, never left running for nobody."""
    command = ("sh", "-c", 'sleep 1; exec "$0" -c "$1"', sys.executable, SCRIPT)
    others = frozenset(_children())
    stdio = StdioUpstreams(max_line_bytes=64 * 1024)
    stdio.configure({"script": StdioSpec("script", command)})
    await stdio.start()
    try:
        call = asyncio.ensure_future(post(stdio, {"jsonrpc": "2.0", "id": 1, "method": "pid"}))
        await _until(lambda: _children(others))  # the child is starting
        stdio.configure({})  # the reload drops the upstream meanwhile
        status, _, [error] = await call
        assert (status, error["error"]["message"]) == (
            502, "stdio upstream 'script': the upstream was reconfigured while its process started")
        await _until(lambda: not stdio._tasks)
        assert [p for p in _children(others) if alive(p)] == []
        assert stdio.processes("script") == 0
    finally:
        await stdio.close()
