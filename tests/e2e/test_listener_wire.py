"""The MCP listener's HTTP behaviour through the real process, for both servers
(`listener: aiohttp` and `listener: fast`, proxy/app/fast_listener.py): what a client sees on
the wire must not depend on which one serves it.

Raw sockets where the framing is the point (keep-alive, pipelining, chunked and gzip bodies,
timeouts, malformed heads); the upstream is `hostile_upstream.py`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest
from e2e_helpers import write_doc
from hostile_upstream import HostileUpstream, hostile_server

from tests.harness import ProxyProcess, metric_value, proxy_process, token

STATELESS = "2026-07-28"
KINDS = ("aiohttp", "fast")


def policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": "30s"}},
        "defaults": {"unknown_tools": "deny"},
        "tools": {"h.read_page": {"effect": "read"}},
    })


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileUpstream]:
    with hostile_server() as up:
        yield up


@contextlib.contextmanager
def served(tmp: Path, hostile: HostileUpstream, kind: str, **config: Any) -> Iterator[ProxyProcess]:
    hostile.control.reset()
    listener = {"kind": kind, **config.pop("listener", {})}
    with proxy_process(tmp, {"h": hostile.url}, policies=policy(tmp / "policy"),
                       config={"listener": listener, **config},
                       env={"ENVELOPE_LISTENER": kind}) as pp:
        yield pp


def call_body(rid: int, **arguments: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "read_page", "arguments": {"mode": "json", **arguments},
        "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS,
                  "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}}}).encode()


def head(port: int, length: int | None, extra: str = "", version: str = "1.1") -> bytes:
    lines = [f"POST /mcp/h HTTP/{version}", f"Host: 127.0.0.1:{port}",
             "Accept: application/json, text/event-stream", "Content-Type: application/json",
             f"MCP-Protocol-Version: {STATELESS}", f"Authorization: Bearer {token('alice')}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def request(port: int, rid: int, **arguments: Any) -> bytes:
    body = call_body(rid, **arguments)
    return head(port, len(body)) + body


def read_response(f: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response from `f`: status, headers (lower-case names), body."""
    status_line = f.readline()
    if not status_line:
        raise EOFError("connection closed before a response")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, f.read(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int(f.readline().split(b";")[0], 16):
            body += f.read(size)
            f.readline()
        f.readline()
        return status, headers, body
    return status, headers, f.read()


def result_of(body: bytes, rid: int) -> dict[str, Any]:
    text = body.decode()
    if text.startswith("{"):
        reply = json.loads(text)
    else:  # an SSE stream: the event answering `rid`
        replies = [json.loads(line[5:]) for line in text.splitlines()
                   if line.startswith("data:") and line[5:].strip()]
        [reply] = [r for r in replies if r.get("id") == rid]
    assert reply["id"] == rid, reply
    return dict(reply["result"])


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


def connect(pp: ProxyProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", pp.port), timeout=20)


@pytest.mark.parametrize("kind", KINDS)
def test_keep_alive_serves_several_calls_on_one_connection_and_http10_closes(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp, connect(pp) as sock, sock.makefile("rb") as f:
        for rid in range(1, 4):
            sock.sendall(request(pp.port, rid, text=f"call {rid}"))
            status, headers, body = read_response(f)
            assert status == 200 and headers.get("connection") != "close", (status, headers)
            assert result_of(body, rid)["content"][0]["text"] == f"call {rid}"
        # HTTP/1.0 without keep-alive: answered, then closed.
        body = call_body(9)
        sock.sendall(head(pp.port, len(body), version="1.0") + body)
        status, _, answer = read_response(f)
        assert status == 200 and result_of(answer, 9)["isError"] is False
        assert closed_within(sock, 5) is not None
        # `Connection: close` on HTTP/1.1: the same.
        with connect(pp) as other, other.makefile("rb") as g:
            other.sendall(head(pp.port, len(body), "Connection: close\r\n") + body)
            status, headers, _ = read_response(g)
            assert status == 200 and headers.get("connection") == "close"
            assert closed_within(other, 5) is not None


@pytest.mark.parametrize("kind", KINDS)
def test_pipelined_requests_are_answered_in_order(tmp_path: Path, hostile: HostileUpstream,
                                                  kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp, connect(pp) as sock, sock.makefile("rb") as f:
        # The first is slow: the second must still be answered after it, not before.
        sock.sendall(request(pp.port, 1, mode="slow", delay=0.5, text="first")
                     + request(pp.port, 2, text="second") + request(pp.port, 3, text="third"))
        texts = []
        for rid in (1, 2, 3):
            status, _, body = read_response(f)
            assert status == 200
            texts.append(result_of(body, rid)["content"][0]["text"])
        assert texts == ["first", "second", "third"]


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_and_gzip_request_bodies_are_read(tmp_path: Path, hostile: HostileUpstream,
                                                  kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp, connect(pp) as sock, sock.makefile("rb") as f:
        body = call_body(1, text="chunked")
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                          for i in range(0, len(body), 7)) + b"0\r\n\r\n"
        sock.sendall(head(pp.port, None, "Transfer-Encoding: chunked\r\n") + chunks)
        status, _, answer = read_response(f)
        assert status == 200 and result_of(answer, 1)["content"][0]["text"] == "chunked"
        packed = gzip.compress(call_body(2, text="gzipped " * 200))
        sock.sendall(head(pp.port, len(packed), "Content-Encoding: gzip\r\n") + packed)
        status, _, answer = read_response(f)
        assert status == 200
        assert result_of(answer, 2)["content"][0]["text"] == "gzipped " * 200
        # A coding the proxy cannot read is refused, not forwarded.
        sock.sendall(head(pp.port, 4, "Content-Encoding: compress\r\n") + b"abcd")
        status, _, answer = read_response(f)
        assert status == 415, answer


@pytest.mark.parametrize("kind", KINDS)
def test_a_late_head_is_closed_and_counted_and_other_clients_are_served(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    listener = {"header_timeout": "1s", "keepalive_timeout": "2s"}
    with served(tmp_path, hostile, kind, listener=listener) as pp:
        with connect(pp) as half:
            half.sendall(b"POST /mcp/h HT")
            with connect(pp) as sock, sock.makefile("rb") as f:
                sock.sendall(request(pp.port, 1))
                assert read_response(f)[0] == 200
                waited = closed_within(half, 5)
                assert waited is not None and waited < 3, waited
                # The served connection, now idle, is closed after the keep-alive timeout.
                idle = closed_within(sock, 6)
                assert idle is not None and 1.0 < idle < 4.5, idle
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total",
                            reason="header_timeout") >= 1


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_and_oversized_heads_are_refused_and_the_process_keeps_serving(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp:
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(b"GET /mcp/h HTTP/1.1 extra words\r\nHost: x\r\n\r\n")
            assert read_response(f)[0] == 400
            assert closed_within(sock, 5) is not None
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(b"POST /mcp/h HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
            status = read_response(f)[0]
            assert 400 <= status < 500 and status != 404, status
            assert closed_within(sock, 5) is not None
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert 400 <= read_response(f)[0] < 500
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(request(pp.port, 5, text="still here"))
            status, _, body = read_response(f)
            assert status == 200 and result_of(body, 5)["content"][0]["text"] == "still here"


@pytest.mark.parametrize("kind", KINDS)
def test_a_body_over_the_cap_is_refused_413(tmp_path: Path, hostile: HostileUpstream,
                                            kind: str) -> None:
    with served(tmp_path, hostile, kind, limits={"max_body_bytes": 4096}) as pp:
        with connect(pp) as sock, sock.makefile("rb") as f:
            body = call_body(1, text="x" * 8000)
            sock.sendall(head(pp.port, len(body)) + body)
            assert read_response(f)[0] == 413
        with connect(pp) as sock, sock.makefile("rb") as f:  # chunked: no length to check first
            sock.sendall(head(pp.port, None, "Transfer-Encoding: chunked\r\n")
                         + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            assert read_response(f)[0] == 413


def _trickle(socks: list[socket.socket], bodies: list[bytes], pause: float) -> list[int]:
    """Send each body one byte per `pause` on its socket until the proxy answers on it (readable);
    how many bytes of each went out by then (the client waits on the answer, never on a clock)."""
    sent = [0] * len(socks)
    waiting = set(range(len(socks)))
    while waiting:
        readable, _, _ = select.select([socks[i] for i in waiting], [], [], pause)
        for i in list(waiting):
            if socks[i] in readable:
                waiting.discard(i)
            elif sent[i] < len(bodies[i]):
                socks[i].sendall(bodies[i][sent[i]:sent[i] + 1])
                sent[i] += 1
            else:
                raise AssertionError(f"the whole body {i} went out and was not refused")
    return sent


@pytest.mark.parametrize("kind", KINDS)
def test_a_trickled_body_is_refused_408_closed_counted_and_never_forwarded(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    """A client that sends its head and then its body a byte at a time held a handler and its
    connection as long as it liked: the header timeout ends at the head. The body now has the
    same deadline (`listener.header_timeout`, here 1 s): 408 with the guard's JSON-RPC error,
    `Connection: close`, counted `body_timeout`, nothing forwarded or audited. Framed by
    Content-Length (under `listener: fast` the hot route, buffered by the listener) and chunked
    (read by the front)."""
    body = call_body(1, text="x" * 200)
    with served(tmp_path, hostile, kind, listener={"header_timeout": "1s"}) as pp:
        with connect(pp) as framed, connect(pp) as chunked, \
                framed.makefile("rb") as f, chunked.makefile("rb") as g:
            framed.sendall(head(pp.port, len(body)))
            chunked.sendall(head(pp.port, None, "Transfer-Encoding: chunked\r\n")
                            + b"%x\r\n" % len(body))
            sent = _trickle([framed, chunked], [body, body], 0.1)
            assert max(sent) < len(body), sent  # answered while the bodies were still coming
            for sock, answers in ((framed, f), (chunked, g)):
                status, headers, answer = read_response(answers)
                assert status == 408, answer
                assert headers.get("connection") == "close", headers
                error = json.loads(answer)["error"]
                assert error["code"] == -32600, error
                assert error["message"] == ("Request Timeout: the body did not arrive whole "
                                            "within 1 s (listener.header_timeout)"), error
                # aiohttp reads (and drops) what still comes for its lingering time, 10 s.
                assert closed_within(sock, 15) is not None
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total",
                            reason="body_timeout") == 2
        assert [r for r in pp.audit_records() if r.get("tool") == "read_page"] == []
    assert hostile.control.calls() == []


@pytest.mark.parametrize(("kind", "queued"), [(k, q) for k in KINDS for q in (0, 8)])
def test_a_pipelined_body_trickled_behind_a_call_in_flight_is_refused_408(
        tmp_path: Path, hostile: HostileUpstream, kind: str, queued: int) -> None:
    """Pipelined on one connection: a call in flight (the upstream answers it after 3 s),
    `queued` whole calls behind it, then a call whose head and first bytes come at once and
    whose body then trickles. Under `listener: fast` with 8 queued, the proxy itself holds the
    trickled request's bytes back unparsed (at most 8 requests are parsed ahead), and they must
    not count against the client while held; once parsed, its body has `header_timeout` (1 s)
    like any other. Every call before it is answered, in order; it gets 408, `Connection:
    close`, counted `body_timeout`, and never reaches the upstream."""
    late = call_body(99, text="z" * 300)
    with served(tmp_path, hostile, kind, listener={"header_timeout": "1s"}) as pp, \
            connect(pp) as sock, sock.makefile("rb") as f:
        ahead = request(pp.port, 1, mode="slow", delay=3, text="in flight") + b"".join(
            request(pp.port, rid, text=f"queued {rid}") for rid in range(2, 2 + queued))
        sock.sendall(ahead + head(pp.port, len(late)) + late[:10])
        # More of the body only while nothing is answered (the answers come after 3 s).
        [sent] = _trickle([sock], [late[10:]], 0.1)
        assert sent < len(late) - 10
        status, _, answer = read_response(f)
        assert status == 200, answer
        assert result_of(answer, 1)["content"][0]["text"] == "in flight"
        for rid in range(2, 2 + queued):
            status, _, answer = read_response(f)
            assert status == 200, answer
            assert result_of(answer, rid)["content"][0]["text"] == f"queued {rid}"
        status, headers, answer = read_response(f)
        assert status == 408, answer
        assert headers.get("connection") == "close", headers
        assert json.loads(answer)["error"]["message"] == (
            "Request Timeout: the body did not arrive whole within 1 s (listener.header_timeout)")
        assert closed_within(sock, 15) is not None
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total",
                            reason="body_timeout") == 1
        assert len(hostile.control.calls("read_page")) == 1 + queued


@pytest.mark.parametrize("kind", KINDS)
def test_a_body_slow_within_the_deadline_is_served(tmp_path: Path, hostile: HostileUpstream,
                                                   kind: str) -> None:
    """Large bodies sent in several writes with short pauses, well within the deadline (2 s):
    under 64 KiB (the fast listener's hot route), over it, and chunked, on one connection."""
    with served(tmp_path, hostile, kind, listener={"header_timeout": "2s"}) as pp, \
            connect(pp) as sock, sock.makefile("rb") as f:
        for rid, size, chunked in ((1, 48_000, False), (2, 200_000, False), (3, 100_000, True)):
            body = call_body(rid, text="y" * size)
            if chunked:
                sock.sendall(head(pp.port, None, "Transfer-Encoding: chunked\r\n"))
                body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            else:
                sock.sendall(head(pp.port, len(body)))
            step = len(body) // 6 + 1
            for start in range(0, len(body), step):
                time.sleep(0.05)
                sock.sendall(body[start:start + step])
            status, _, answer = read_response(f)
            assert status == 200, answer
            assert result_of(answer, rid)["content"][0]["text"] == "y" * size
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total",
                            reason="body_timeout") == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_that_leaves_mid_call_is_audited_client_disconnected(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp:
        with connect(pp) as sock:
            sock.sendall(request(pp.port, 1, mode="slow", delay=20, text="gone"))
            deadline = time.monotonic() + 10
            while not any(m.get("method") == "tools/call" for m in hostile.control.log()):
                assert time.monotonic() < deadline, "the call never reached the upstream"
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while not any(r.get("tool") == "read_page" for r in pp.audit_records()):
            assert time.monotonic() < deadline, "no audit record"
            time.sleep(0.1)
        time.sleep(0.3)  # a second record would come now
        [record] = [r for r in pp.audit_records() if r.get("tool") == "read_page"]
        assert record["code"] == "client_disconnected", record
        assert record["extra"]["client_disconnected"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_answer_is_relayed_as_sse(tmp_path: Path, hostile: HostileUpstream,
                                             kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp, connect(pp) as sock, sock.makefile("rb") as f:
        sock.sendall(request(pp.port, 1, mode="sse", text="streamed", notes=["one", "two"]))
        status, headers, body = read_response(f)
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), headers
        events = [json.loads(line[5:]) for line in body.decode().splitlines()
                  if line.startswith("data:") and line[5:].strip()]
        assert [e.get("method") for e in events[:-1]] == ["notifications/message",
                                                           "notifications/progress"]
        assert events[-1]["result"]["content"][0]["text"] == "streamed"
        # The connection stays usable after a streamed answer.
        sock.sendall(request(pp.port, 2, text="after"))
        status, _, body = read_response(f)
        assert status == 200 and result_of(body, 2)["content"][0]["text"] == "after"


@pytest.mark.parametrize("kind", KINDS)
def test_a_thousand_idle_connections_do_not_stop_other_calls(tmp_path: Path,
                                                             hostile: HostileUpstream,
                                                             kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp:
        idle = []
        try:
            for _ in range(1000):
                idle.append(socket.create_connection(("127.0.0.1", pp.port), timeout=10))
            # Each call is bounded by the client's timeout: a listener that the idle connections
            # stall fails it (no wall-clock assertion: the CI machine is shared).
            for rid in range(5):
                response = httpx.post(pp.url("h"), content=call_body(rid, text="busy"), timeout=10,
                                      headers={"Content-Type": "application/json",
                                               "Accept": "application/json, text/event-stream",
                                               "MCP-Protocol-Version": STATELESS,
                                               "Authorization": f"Bearer {token('bob')}"})
                assert response.status_code == 200
                assert result_of(response.content, rid)["content"][0]["text"] == "busy"
        finally:
            for s in idle:
                s.close()


@pytest.mark.parametrize("kind", KINDS)
def test_two_workers_share_the_port(tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    def counts() -> list[int]:
        return [len((pp.audit_dir / f"audit-w{w}.jsonl").read_text().splitlines())
                if (pp.audit_dir / f"audit-w{w}.jsonl").exists() else 0 for w in (0, 1)]

    with served(tmp_path, hostile, kind, workers=2) as pp:
        # A new connection each: the kernel spreads them over the workers listening. The second
        # worker may still be starting when the port first answers, so calls go on (bounded)
        # until both have answered some.
        calls, deadline = 0, time.monotonic() + 30
        while calls < 20 or (min(counts()) == 0 and time.monotonic() < deadline):
            with connect(pp) as sock, sock.makefile("rb") as f:
                sock.sendall(request(pp.port, calls, text="w"))
                status, _, body = read_response(f)
                assert status == 200 and result_of(body, calls)["isError"] is False
            calls += 1
            if calls >= 20:
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while sum(counts()) < calls and time.monotonic() < deadline:
            time.sleep(0.1)
        # Every call answered has its one audit record, and both workers served.
        assert sum(counts()) == calls and min(counts()) > 0, (counts(), calls, pp.log()[-4000:])


@pytest.mark.parametrize("kind", KINDS)
def test_an_expect_header_is_guarded_first_and_answered_as_http_says(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    """aiohttp answers an `Expect` before the route's handler, so its default handler saw header
    bytes the guard never checked: `Expect: \\xc1` made it fail with a 500 (found by the wire
    fuzz). Now the guard runs first (400, audited `invalid_request`), `100-continue` gets its
    100 and then the answer, and any other expectation 417; the process keeps serving."""
    body = call_body(21, text="expected")
    with served(tmp_path, hostile, kind) as pp:
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(head(pp.port, len(body), "Expect: \xc1\r\n").replace(b"\xc3\x81", b"\xc1") + body)
            status, _, answer = read_response(f)
            assert status == 400, answer
            decision = json.loads(answer)["error"]["data"]["envelope/decision"]
            assert decision["code"] == "invalid_request" and decision["check"] == "guard"
        [refusal] = [r for r in pp.audit_records() if r["decision_id"] == decision["decision_id"]]
        assert refusal["extra"]["header"].lower() == "expect" and refusal["extra"]["value"] == "\\xc1"
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(head(pp.port, len(body), "Expect: 100-continue\r\n"))
            assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
            sock.sendall(body)
            status, _, answer = read_response(f)
            assert status == 200 and result_of(answer, 21)["content"][0]["text"] == "expected"
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(head(pp.port, len(body), "Expect: teapot\r\n") + body)
            assert read_response(f)[0] == 417
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(request(pp.port, 22, text="still here"))
            status, _, answer = read_response(f)
            assert status == 200 and result_of(answer, 22)["content"][0]["text"] == "still here"
        # The admin listener: its routes answer an expectation without echoing it.
        admin = int(pp.admin.rsplit(":", 1)[1])
        for expect, wanted in ((b"\xc1", 417), (b"100-continue", 200)):
            with socket.create_connection(("127.0.0.1", admin), timeout=20) as sock, sock.makefile("rb") as f:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: " + expect + b"\r\n\r\n")
                if expect == b"100-continue":
                    assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
                assert read_response(f)[0] == wanted, expect


# ---- request smuggling and response splitting ------------------------------------------------

def _framed(port: int, rid: int, extra: str, chunks: bytes | None = None,
            length: int | None = None) -> bytes:
    """A call whose text says it was smuggled, framed by `extra` headers and `chunks` (or by its
    Content-Length when `length` is given)."""
    body = call_body(rid, text=f"smuggled {rid}")
    payload = body if chunks is None else chunks.replace(b"{body}", body).replace(
        b"{size}", b"%x" % len(body))
    return head(port, length if length is None else len(body), extra) + payload


_CHUNK = b"{size}\r\n{body}\r\n0\r\n\r\n"
# Requests whose framing a front proxy and the upstream could read two ways: each must be refused
# 400-class and its connection closed, never answered as a call.
SMUGGLED: dict[str, Any] = {
    "CL and TE": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked\r\n", _CHUNK, length=0),
    "TE then CL": lambda p, r: head(p, None, "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n")
    + _CHUNK.replace(b"{body}", call_body(r)).replace(b"{size}", b"%x" % len(call_body(r))),
    "two equal CLs": lambda p, r: _framed(p, r, f"Content-Length: {len(call_body(r, text=f'smuggled {r}'))}\r\n",
                                          length=0),
    "two different CLs": lambda p, r: _framed(p, r, "Content-Length: 2\r\n", length=0),
    "CL list": lambda p, r: head(p, None, "Content-Length: 3, 3\r\n") + b"abc",
    "CL with +": lambda p, r: head(p, None, "Content-Length: +3\r\n") + b"abc",
    "TE chunked, identity": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked, identity\r\n", _CHUNK),
    "TE xchunked": lambda p, r: _framed(p, r, "Transfer-Encoding: xchunked\r\n", _CHUNK),
    "TE identity": lambda p, r: _framed(p, r, "Transfer-Encoding: identity\r\n", b"{body}"),
    "TE gzip, chunked": lambda p, r: _framed(p, r, "Transfer-Encoding: gzip, chunked\r\n", _CHUNK),
    "TE in two fields": lambda p, r: _framed(p, r, "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
                                             _CHUNK),
    "TE obs-fold": lambda p, r: _framed(p, r, "Transfer-Encoding: x\r\n chunked\r\n", _CHUNK),
    "TE chunked, then gzip in a second field": lambda p, r: _framed(
        p, r, "Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n", _CHUNK),
    "TE chunked in two fields": lambda p, r: _framed(
        p, r, "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", _CHUNK),
    "TE empty, and CL": lambda p, r: _framed(p, r, "Transfer-Encoding: \r\n", length=0),
    # What Python's str.lower/strip turn into "chunked" and a byte-wise parser does not: the
    # Kelvin sign lowers to "k"; a no-break space (UTF-8) strips as a space.
    "TE with a Kelvin sign": lambda p, r: _framed(p, r, "Transfer-Encoding: chun\u212aed\r\n", _CHUNK),
    "TE with a no-break space": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked\u00a0\r\n", _CHUNK),
    "TE with a vertical tab": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked\x0b\r\n", _CHUNK),
    "obs-fold": lambda p, r: _framed(p, r, "X-Note: a\r\n b\r\n", length=0),
    "chunk size 0x": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked\r\n", b"0x" + _CHUNK),
    "chunk size +": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked\r\n", b"+" + _CHUNK),
    "chunk size huge": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked\r\n",
                                            b"1000000000000000" + _CHUNK),
    "chunk bare LF": lambda p, r: _framed(p, r, "Transfer-Encoding: chunked\r\n",
                                          b"{size}\n{body}\n0\n\n"),
    "head bare LF": lambda p, r: _framed(p, r, "", length=0).replace(b"\r\n", b"\n"),
    "NUL in the head": lambda p, r: _framed(p, r, "X-Note: a\x00b\r\n", length=0),
    "space before colon": lambda p, r: _framed(p, r, "Transfer-Encoding : chunked\r\n", _CHUNK),
    "HTTP/2.0 request line": lambda p, r: _framed(p, r, "", length=0).replace(b"HTTP/1.1", b"HTTP/2.0", 1),
    "HTTP/1.2 request line": lambda p, r: _framed(p, r, "", length=0).replace(b"HTTP/1.1", b"HTTP/1.2", 1),
    "two Host fields": lambda p, r: _framed(p, r, "Host: evil.example\r\n", length=0),
    # RFC 9112 3.2: HTTP/1.1 with no Host is a 400 (the listener must not take its own address).
    "HTTP/1.1 without Host": lambda p, r: _framed(p, r, "", length=0).replace(
        f"Host: 127.0.0.1:{p}\r\n".encode(), b"", 1),
    "lower-case method": lambda p, r: _framed(p, r, "", length=0).replace(b"POST", b"post", 1),
    "space after the version": lambda p, r: _framed(p, r, "", length=0).replace(b"HTTP/1.1", b"HTTP/1.1 ", 1),
    "HTTP/0.9": lambda p, r: b"GET /mcp/h\r\n\r\n" + _framed(p, r, "", length=0),
}


def _exchange(pp: ProxyProcess, data: bytes) -> tuple[int | None, bool]:
    """Send `data` on a new connection: the first answer's status (None: none) and whether the
    proxy closed the connection after it."""
    with connect(pp) as sock, sock.makefile("rb") as f:
        sock.sendall(data)
        try:
            status: int | None = read_response(f)[0]
        except (EOFError, ConnectionResetError):
            return None, True
        return status, closed_within(sock, 3) is not None


@pytest.mark.parametrize("kind", KINDS)
def test_ambiguous_request_framing_is_refused_and_closed_and_never_reaches_the_upstream(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp:
        answers = {name: _exchange(pp, build(pp.port, rid))
                   for rid, (name, build) in enumerate(SMUGGLED.items(), start=100)}
        wrong = {name: answer for name, answer in answers.items()
                 if not (answer[0] is None or 400 <= answer[0] < 500) or not answer[1]}
        assert not wrong, wrong
        assert hostile.control.calls() == []
        # The process keeps serving.
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(request(pp.port, 1, text="after"))
            status, _, body = read_response(f)
            assert status == 200 and result_of(body, 1)["content"][0]["text"] == "after"


@pytest.mark.parametrize("kind", KINDS)
def test_http11_without_host_is_refused_closed_and_counted_bad_host(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    """RFC 9112 3.2: an HTTP/1.1 request with no Host is a 400 and its connection is closed (the
    smuggling table above checks that much among the other framings), on the MCP and the HTTP
    front's routes. Either listener answers with the guard's refusal and counts it `bad_host`
    (under `listener: aiohttp`, aiohttp's parser refuses it before the guard: it was a plain-text
    400, never counted; under `listener: fast` the HTTP front's problem details kept the
    connection open), and HTTP/1.0, which has no Host requirement, is still served."""
    with served(tmp_path, hostile, kind) as pp:
        host_line = f"Host: 127.0.0.1:{pp.port}\r\n".encode()
        before = metric_value(pp.metrics(), "envelope_rejected_requests_total", reason="bad_host")
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(request(pp.port, 1, text="no host").replace(host_line, b"", 1))
            status, _, answer = read_response(f)
            assert status == 400, answer
            error = json.loads(answer)["error"]
            assert error["code"] == -32600 and "Host header" in error["message"], error
            assert closed_within(sock, 5) is not None
        # The same on the HTTP front's route (problem details under `listener: fast`, where the
        # guard runs in the route; aiohttp's parser refuses it before routing).
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(b"GET /http/h/items HTTP/1.1\r\nAccept: */*\r\n\r\n")
            status, _, answer = read_response(f)
            assert status == 400 and b"Host header" in answer, answer
            assert closed_within(sock, 5) is not None
        after = metric_value(pp.metrics(), "envelope_rejected_requests_total", reason="bad_host")
        assert after == before + 2, (before, after)
        body = call_body(2, text="ten, no host")
        with connect(pp) as sock, sock.makefile("rb") as f:
            sock.sendall(head(pp.port, len(body), version="1.0").replace(host_line, b"", 1) + body)
            status, _, answer = read_response(f)
            assert status == 200 and result_of(answer, 2)["content"][0]["text"] == "ten, no host"
        assert metric_value(pp.metrics(), "envelope_rejected_requests_total", reason="bad_host") == after
        # Like the 421 for a foreign host, the refusal is not audited: no call was read.
        assert [(r.get("tool"), r["code"]) for r in pp.audit_records()] == [("read_page", "ok")]
    assert [c["params"]["arguments"]["text"] for c in hostile.control.calls()] == ["ten, no host"]


def _hits_and_records(pp: ProxyProcess, hostile: HostileUpstream) -> tuple[list[str], list[str]]:
    texts = [c["params"]["arguments"]["text"] for c in hostile.control.calls()]
    records = [r["decision_id"] for r in pp.audit_records() if r.get("tool") == "read_page"]
    return texts, records


@pytest.mark.parametrize("kind", KINDS)
def test_framing_that_has_one_safe_reading_is_served_once(tmp_path: Path, hostile: HostileUpstream,
                                                          kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp, connect(pp) as sock, sock.makefile("rb") as f:
        # A second request hidden in the first one's declared body is body, not a request.
        hidden = request(pp.port, 2, text="hidden")
        body = call_body(1, text="outer")
        sock.sendall(head(pp.port, len(body) + len(hidden)) + body + hidden)
        status, _, answer = read_response(f)
        assert status == 400, answer
        # Chunk extensions, `chunked` in another case or with trailing space: one chunked body.
        for rid, extra, size in ((3, "Transfer-Encoding: chunked\r\n", b"{size};ext=1"),
                                 (4, "Transfer-Encoding: Chunked \r\n", b"{size}")):
            sock.sendall(_framed(pp.port, rid, extra, _CHUNK.replace(b"{size}", size)))
            status, _, answer = read_response(f)
            assert status == 200 and result_of(answer, rid)["content"][0]["text"] == f"smuggled {rid}"
        # A body on GET is read (and the GET answered as a GET): nothing in it is a call.
        inner = request(pp.port, 5, text="in a GET")
        sock.sendall(f"GET /mcp/h HTTP/1.1\r\nHost: 127.0.0.1:{pp.port}\r\nContent-Length: "
                     f"{len(inner)}\r\n\r\n".encode() + inner)
        status, _, _ = read_response(f)
        assert 400 <= status < 500, status
        # An absolute-form target names the host the guard checks, whatever the Host header says.
        body = call_body(9, text="absolute")
        sock.sendall(head(pp.port, len(body)).replace(b"POST /mcp/h", b"POST http://evil.example/mcp/h", 1)
                     + body)
        status, _, answer = read_response(f)
        assert status == 421, answer
        # OPTIONS * is answered, not routed to an upstream.
        sock.sendall(f"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1:{pp.port}\r\n\r\n".encode())
        status, _, _ = read_response(f)
        assert 400 <= status < 500, status
        # CONNECT is no tunnel: refused; what follows it is a request of its own (or is not read).
        with connect(pp) as other, other.makefile("rb") as g:
            other.sendall(f"CONNECT 127.0.0.1:{pp.port} HTTP/1.1\r\nHost: 127.0.0.1:{pp.port}\r\n\r\n"
                          .encode() + request(pp.port, 8, text="after CONNECT"))
            status, _, _ = read_response(g)
            assert 400 <= status < 500, status
            with contextlib.suppress(EOFError, ConnectionResetError):
                status, _, answer = read_response(g)
                assert status == 200 and result_of(answer, 8)["content"][0]["text"] == "after CONNECT"
        # HTTP/1.0 keep-alive: answered as 1.0, kept open, the next request served.
        for rid in (6, 7):
            body = call_body(rid, text=f"ten {rid}")
            sock.sendall(head(pp.port, len(body), "Connection: keep-alive\r\n", version="1.0") + body)
            status, headers, answer = read_response(f)
            assert status == 200 and headers.get("connection", "").lower() == "keep-alive", headers
            assert result_of(answer, rid)["content"][0]["text"] == f"ten {rid}"
    texts, records = _hits_and_records(pp, hostile)
    assert sorted(texts) in (["smuggled 3", "smuggled 4", "ten 6", "ten 7"],
                             ["after CONNECT", "smuggled 3", "smuggled 4", "ten 6", "ten 7"]), texts
    assert len(records) == len(texts), records


_OK = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
# Upstream answers whose framing cannot be read one safe way: the call is refused upstream_error,
# and nothing of the answer (the `key` text) reaches the agent.
SPLIT: dict[str, str] = {
    "two Content-Lengths": _OK + "Content-Length: {length}\r\nContent-Length: {length}\r\n\r\n{result}",
    "Content-Length and TE": _OK + "Content-Length: {length}\r\nTransfer-Encoding: chunked\r\n\r\n"
    "{size}\r\n{result}\r\n0\r\n\r\n",
    "unknown TE": _OK + "Transfer-Encoding: gzip\r\n\r\n{result}",
    "TE xchunked": _OK + "Transfer-Encoding: xchunked\r\n\r\n{result}",
    "TE chunked, identity": _OK + "Transfer-Encoding: chunked, identity\r\n\r\n{result}",
    "TE in two fields": _OK + "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
    "{size}\r\n{result}\r\n0\r\n\r\n",
    "TE chunked, then gzip in a second field": _OK + "Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n"
    "{size}\r\n{result}\r\n0\r\n\r\n",
    # The raw answer is sent as Latin-1: these are the UTF-8 bytes of a Kelvin sign (lowered to
    # "k" by Python) and of a no-break space (stripped by Python).
    "TE with a Kelvin sign": _OK + "Transfer-Encoding: chun\xe2\x84\xaaed\r\n\r\n{size}\r\n{result}\r\n0\r\n\r\n",
    "TE with a no-break space": _OK + "Transfer-Encoding: chunked\xc2\xa0\r\n\r\n{size}\r\n{result}\r\n0\r\n\r\n",
    "SSE ending mid-event": "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
    "event: message\r\ndata: {result}",
    "101 Switching Protocols": "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
    "Connection: Upgrade\r\n\r\n{result}",
    "obs-fold": _OK + "X-Note: a\r\n b\r\nContent-Length: {length}\r\n\r\n{result}",
    "bare LF": _OK.replace("\r\n", "\n") + "Content-Length: {length}\n\n{result}",
    # Header values are relayed to the agent: nothing there may split or smuggle.
    "LF in a header value": _OK + "X-Note: a\nSet-Cookie: s=1\r\nContent-Length: {length}\r\n\r\n{result}",
    "CR in a header value": _OK + "X-Note: a\rSet-Cookie: s=1\r\nContent-Length: {length}\r\n\r\n{result}",
    "control byte in a header value": _OK + "X-Note: a\x01b\r\nContent-Length: {length}\r\n\r\n{result}",
    "obs-text in a header value": _OK + "X-Note: a\xffb\r\nContent-Length: {length}\r\n\r\n{result}",
    "UTF-8 session id": _OK + "Mcp-Session-Id: s\xc3\xa9\r\nContent-Length: {length}\r\n\r\n{result}",
}


def _raw_call(pp: ProxyProcess, sock: socket.socket, f: BinaryIO, rid: int, raw: str, key: str,
              delay: float = 0.0) -> dict[str, Any]:
    body = json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {
        "name": "read_page", "arguments": {"mode": "raw", "text": raw, "key": key, "delay": delay},
        "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS}}}).encode()
    sock.sendall(head(pp.port, len(body)) + body)
    status, _, answer = read_response(f)
    assert status == 200, answer
    return result_of(answer, rid)


@pytest.mark.parametrize("kind", KINDS)
def test_an_upstream_answer_framed_two_ways_is_refused_and_audited_once(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    with served(tmp_path, hostile, kind) as pp, connect(pp) as sock, sock.makefile("rb") as f:
        wrong = {}
        for rid, (name, raw) in enumerate(SPLIT.items(), start=1):
            result = _raw_call(pp, sock, f, rid, raw, key=f"uninspected {rid}")
            decision = (result.get("_meta") or {}).get("envelope/decision", {})
            if decision.get("code") != "upstream_error" or f"uninspected {rid}" in json.dumps(result):
                wrong[name] = result
        assert not wrong, (sorted(wrong), wrong)
        records = [r for r in pp.audit_records() if r.get("tool") == "read_page"]
        assert len(records) == len(SPLIT) and {r["code"] for r in records} == {"upstream_error"}, records


@pytest.mark.parametrize("kind", KINDS)
def test_an_upstream_answer_with_one_safe_reading_is_delivered_once_and_its_extra_bytes_dropped(
        tmp_path: Path, hostile: HostileUpstream, kind: str) -> None:
    forged = json.dumps({"jsonrpc": "2.0", "id": 2, "result": {
        "content": [{"type": "text", "text": "forged"}], "isError": False}})
    with served(tmp_path, hostile, kind) as pp, connect(pp) as sock, sock.makefile("rb") as f:
        # Interim 1xx answers before the final one are skipped.
        early = ("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
                 + _OK + "Content-Length: {length}\r\n\r\n{result}")
        assert _raw_call(pp, sock, f, 1, early, key="after 1xx")["content"][0]["text"] == "after 1xx"
        # A body longer than its Content-Length: the extra bytes (a second answer) are not the
        # next call's answer; the upstream keeps the connection open meanwhile.
        longer = (_OK + "Content-Length: {length}\r\n\r\n{result}" + _OK
                  + f"Content-Length: {len(forged)}\r\n\r\n{forged}")
        assert _raw_call(pp, sock, f, 3, longer, key="framed", delay=3)["content"][0]["text"] == "framed"
        sock.sendall(request(pp.port, 2, text="second"))
        status, _, answer = read_response(f)
        assert status == 200 and result_of(answer, 2)["content"][0]["text"] == "second", answer
        # The second answer coming a moment later, once the connection may be pooled again:
        # HTTP/1.1 cannot tell it from the next call's answer, but its JSON-RPC id is not that
        # call's, so it is never that call's result (one carrying the next call's id would be).
        stray = forged.replace('"id": 2', '"id": 99')
        later = (_OK + "Content-Length: {length}\r\n\r\n{result}{pause}"
                 + _OK + f"Content-Length: {len(stray)}\r\n\r\n{stray}")
        assert _raw_call(pp, sock, f, 4, later, key="framed", delay=1)["content"][0]["text"] == "framed"
        sock.sendall(request(pp.port, 5, text="fifth"))
        status, _, answer = read_response(f)
        assert status == 200 and "forged" not in answer.decode(), answer
    records = [r for r in pp.audit_records() if r.get("tool") == "read_page"]
    assert len(records) == 5 and [r["code"] for r in records][:4] == ["ok"] * 4, records


def test_the_admin_listener_refuses_ambiguous_framing_and_closes(tmp_path: Path,
                                                                 hostile: HostileUpstream) -> None:
    with served(tmp_path, hostile, "fast") as pp:
        admin = int(pp.admin.rsplit(":", 1)[1])
        line = "POST /v1/approvals/x/approve HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        attacks = {
            "CL and TE": line + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "two CLs": line + "Content-Length: 2\r\nContent-Length: 5\r\n\r\n{}",
            "TE gzip, chunked": line + "Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            "TE in two fields": line + "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
            "2\r\n{}\r\n0\r\n\r\n",
            "obs-fold": line + "X-Note: a\r\n b\r\nContent-Length: 2\r\n\r\n{}",
            "two Host fields": line + "Host: evil.example\r\nContent-Length: 2\r\n\r\n{}",
            "HTTP/2.0": "GET /healthz HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n",
            "chunk size 0x": line + "Transfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
        }
        wrong = {}
        for name, attack in attacks.items():
            # A second request behind each: never answered on that connection.
            with socket.create_connection(("127.0.0.1", admin), timeout=20) as sock, \
                    sock.makefile("rb") as f:
                sock.sendall(attack.encode() + b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                status = read_response(f)[0]
                if status != 400 or closed_within(sock, 3) is None:
                    wrong[name] = status
        assert not wrong, wrong
