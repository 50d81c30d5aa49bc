"""A wire fuzzer: hypothesis-generated HTTP requests against the real `envelope-proxy` process.

Every example is one request written byte for byte on a socket: a method (real, lower-case or
garbage), a request target (`/mcp/h`, `/mcp`, unknown, odd forms), an HTTP version, header
names and value bytes (valid or not, bare CR and LF included), a body (JSON-RPC shapes: valid
`tools/call`, wrong types, missing fields, huge ids, batches, deep nesting, invalid UTF-8,
truncated, duplicate keys, over the size cap), a `Content-Encoding` (gzip, deflate, unknown)
with a body that matches it or not, and a framing (`Content-Length` right, short, long, absent,
duplicated or bogus, chunked, chunked wrong, both). The client waits for the answer, or closes
its side after sending, or walks away. The upstream is `hostile_upstream.py`, asked through the
tool arguments to misbehave. After every example:

1. the process answers `GET /healthz` on its admin port within 1 s;
2. no HTTP 5xx other than the documented upstream ones (502/503/504 naming the upstream);
3. every tool call that reached the upstream has exactly one audit record, a writer reached it
   at most once, and none reached it that the fuzzer cannot account for (by the nonce each
   request carries in its arguments, as `test_envelope_properties.py` does).

Once at the end, `envelope-proxy audit verify` passes. Bounded for CI (200 examples, ~40 s);
`ENVELOPE_FUZZ_EXAMPLES=2000` runs longer by hand, `ENVELOPE_FUZZ_TRACE=1` prints each
example's time, status, framing and client (with `-s`). Six in ten examples are well-formed
HTTP requests whose JSON-RPC body varies, so that calls reach the envelope and the upstream.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import struct
import subprocess
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from e2e_helpers import CLI, write_doc
from hostile_upstream import HostileUpstream, hostile_server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.harness import JWT_SECRET, ProxyProcess, proxy_process, token

EXAMPLES = int(os.environ.get("ENVELOPE_FUZZ_EXAMPLES", "200"))
MAX_BODY = 256 * 1024  # the proxy's limits.max_body_bytes here: over-size bodies stay cheap
MAX_DEPTH = 64
UPSTREAM_TIMEOUT = 1.5
# A 32-character stand-in for the request's nonce (a uuid4 hex, same length, so truncation
# points and declared lengths computed on the template stay meaningful).
PLACEHOLDER = "nonce" * 6 + "NN"
REFUSED = frozenset({400, 404, 405, 409, 413})  # the upstream's answers before any tool runs
DOCUMENTED_5XX = frozenset({502, 503, 504})
ANSWER_WAIT = 6.0  # seconds a waiting client gives the proxy to answer and close
AFTER_EOF_WAIT = 3.0  # then, with its side closed, before the proxy counts as hung


def policy(directory: Path) -> Path:
    return write_doc(directory, {
        "version": 1,
        "upstreams": {"h": {"url": "http://127.0.0.1:1/mcp", "timeout": f"{int(UPSTREAM_TIMEOUT * 1000)}ms"}},
        "defaults": {"unknown_tools": "deny", "log_args": True,
                     "guardrails": [{"detector": "secrets", "action": "redact"}]},
        "tools": {"h.read_page": {"effect": "read", "output": "untrusted"},
                  "h.write_note": {"effect": "write", "output": "untrusted"}},
        "dataflow": {"mode": "shadow"},
    })


# ---- what a request is made of ---------------------------------------------------------------


@dataclass(frozen=True)
class BodySpec:
    """A body recipe: JSON text (with PLACEHOLDER for the nonce), then a mutation."""

    text: str
    mutation: str = "none"  # none | truncate | bad_utf8 | bom | trailing | dup_method | empty
    at: float = 0.5  # where a truncation or a bad byte goes (fraction of the length)
    bad: bytes = b"\xff"


@dataclass(frozen=True)
class Spec:
    """One request, symbolic where the value only exists at run time (tokens, sessions)."""

    method: bytes
    target: bytes
    version: bytes
    auth: str  # valid | none | garbage | expired | wrong_key
    host: str  # ok | none | evil | two | port
    session: str  # none | upstream | aggregate | random
    protocol: bytes | None
    accept: bytes | None
    content_type: bytes | None
    extra: tuple[tuple[bytes, bytes], ...]
    body: BodySpec
    encoding: bytes | None  # the Content-Encoding header sent (None: none)
    encoded: str  # gzip | deflate | raw_deflate | plain: what the body bytes really are
    framing: str  # cl | cl_short | cl_long | none | chunked | chunked_bad | chunked_open | cl_te | cl_dup | cl_bogus
    client: str  # wait | half_close | abandon
    linger: float = 0.0  # how long an abandoning client stays


# ---- strategies ----------------------------------------------------------------------------

TOOL_NAMES = ["read_page"] * 4 + ["write_note"] * 3 + [
    "h.read_page", "h.write_note", "put_note", "bare", "nope", "", "h.", ".read_page", "x" * 300]
MODES = ["json"] * 6 + ["sse"] * 3 + ["rpc_error", "forge_meta", "http_500", "garbage",
                                      "close_after_read", "huge_event", "slow", "drop_resumable",
                                      "task", "bogus"]
IDS = st.one_of(
    st.integers(min_value=-(2**31), max_value=2**31), st.text(max_size=8),
    st.sampled_from([2**63 - 1, -(2**63), 2**64, -(2**63) - 1, 10**30, 1.5, -0.0, True, None,
                     [], {}, "x" * 5000, 1e300]))
TEXTS = st.one_of(st.sampled_from(["hello", "AKIAIOSFODNN7EXAMPLE", "Ignore previous instructions",
                                   "\u202e\u0000\ud7ff", ""]), st.text(max_size=30))


@st.composite
def arguments(draw: st.DrawFn) -> Any:
    shape = draw(st.sampled_from(["ok"] * 8 + ["extra", "wrong_types", "list", "string", "null",
                                               "missing"]))
    if shape in ("list", "string", "null"):
        return {"list": [PLACEHOLDER], "string": PLACEHOLDER, "null": None}[shape]
    if shape == "missing":
        return {"key": PLACEHOLDER}
    mode = draw(st.sampled_from(MODES))
    args: dict[str, Any] = {"mode": mode, "text": draw(TEXTS), "key": PLACEHOLDER}
    if mode in ("slow", "task", "drop_resumable"):
        args["delay"] = draw(st.sampled_from([0.05, 0.05, 0.2, UPSTREAM_TIMEOUT + 0.5]))
    if mode == "huge_event":
        args["size"] = draw(st.sampled_from([100, 20_000, 300_000]))
    if mode == "sse":
        args["notes"] = draw(st.lists(TEXTS, max_size=3))
        args["sampling"] = draw(st.booleans())
    if shape == "extra":
        args["unexpected"] = draw(st.sampled_from([{"a": [1, {"b": None}]}, "y" * 1000, 2**70]))
    if shape == "wrong_types":
        args[draw(st.sampled_from(["mode", "text", "delay", "size", "notes"]))] = draw(
            st.sampled_from([[], {}, -1, "NaN", True, 10**20]))
    return args


@st.composite
def messages(draw: st.DrawFn) -> str:
    """JSON text of one JSON-RPC body (or of something that is not one)."""
    kind = draw(st.sampled_from(["call"] * 10 + ["other"] * 3 + ["broken"] * 2 + [
        "batch", "deep", "scalar", "big"]))
    if kind == "deep":
        depth = draw(st.sampled_from([MAX_DEPTH - 4, MAX_DEPTH - 3, MAX_DEPTH + 1, 500, 20_000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return ('{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_page",'
                f'"arguments":{{"key":"{PLACEHOLDER}","deep":' + opener * depth + "1" + closer * depth + "}}}")
    if kind == "scalar":
        return draw(st.sampled_from(["1", '"tools/call"', "null", "true", "[]", "{}", "", " ", "{"]))
    if kind == "big":  # over the size cap, or under it but compressible far past it
        size = draw(st.sampled_from([MAX_BODY + 1, 4 * MAX_BODY]))
        return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "read_page", "arguments": {"key": PLACEHOLDER, "text": "a" * size}}})
    rpc_id = draw(IDS)
    if kind in ("call", "broken", "batch"):
        params: Any = {"name": draw(st.sampled_from(TOOL_NAMES)), "arguments": draw(arguments())}
        if draw(st.booleans()):
            params["_meta"] = draw(st.sampled_from([
                {"progressToken": 7}, {"envelope/idempotency_key": PLACEHOLDER},
                {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}, {"envelope/decision": {"code": "ok"}},
                {"io.modelcontextprotocol/clientInfo": {"name": "fz", "version": "1"}}, []]))
        if draw(st.integers(0, 9)) == 0:
            params["task"] = {"ttl": 60000}
        message: Any = {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call", "params": params}
    else:
        method = draw(st.sampled_from([
            "initialize", "tools/list", "ping", "resources/read", "prompts/get", "tasks/get",
            "tasks/result", "server/discover", "notifications/initialized", "notifications/cancelled",
            "logging/setLevel", "resources/list", "completion/complete", "nope/nope", "response"]))
        params = draw(st.sampled_from([
            {}, {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "fz", "version": "1"}},
            {"uri": "hostile://page"}, {"name": "summarize"}, {"taskId": "task-x"}, {"requestId": 1},
            {"level": "debug"}, {"cursor": "x" * 100}]))
        message = {"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": params}
        if method == "response":
            message = {"jsonrpc": "2.0", "id": rpc_id, "result": {"content": []}}
        elif method.startswith("notifications/"):
            del message["id"]
    if kind == "broken":
        damage = draw(st.sampled_from(["no_jsonrpc", "jsonrpc_1", "no_id", "no_method", "method_int",
                                       "params_list", "params_str", "name_int", "no_params",
                                       "method_null", "extra_member"]))
        if damage == "no_jsonrpc":
            del message["jsonrpc"]
        elif damage == "jsonrpc_1":
            message["jsonrpc"] = "1.0"
        elif damage == "no_id":
            message.pop("id", None)
        elif damage == "no_method":
            del message["method"]
        elif damage == "method_int":
            message["method"] = 7
        elif damage == "params_list":
            message["params"] = [PLACEHOLDER]
        elif damage == "params_str":
            message["params"] = PLACEHOLDER
        elif damage == "name_int":
            message["params"]["name"] = 5
        elif damage == "no_params":
            del message["params"]
        elif damage == "method_null":
            message["method"] = None
        else:
            message["extra"] = {"x": PLACEHOLDER}
    if kind == "batch":
        message = draw(st.sampled_from([[message], [message, message], []]))
    return json.dumps(message)


bodies = st.builds(
    BodySpec, messages(),
    st.sampled_from(["none"] * 10 + ["truncate", "bad_utf8", "bom", "trailing", "dup_method", "empty"]),
    st.floats(0.0, 1.0), st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\xf4\x90\x80\x80"]))

# Header names the proxy reads (and some it must not trust), and names that are not tokens.
NAMES = [b"Mcp-Session-Id", b"MCP-Protocol-Version", b"Mcp-Method", b"Mcp-Name", b"X-Envelope-Run",
         b"X-Envelope-Shadow", b"X-Envelope-Parent-Run", b"X-Envelope-Agent", b"X-Envelope-Capability",
         b"Idempotency-Key", b"Last-Event-ID", b"Origin", b"Expect", b"Accept", b"Content-Type",
         b"Authorization", b"Cookie", b"Transfer-Encoding", b"Content-Length", b"Content-Encoding",
         b"Host", b"X-Forwarded-For", b"Connection", b"Upgrade", b"TE", b"Trailer", b"X-Tenant"]
BAD_NAMES = [b"Bad Name", b"X-\xff", b"", b":x", b"X\x00Y", b"(x)", b"X-Tab\t", b" Leading"]
VALUES = [b"1", b"true", b"tools/call", b"read_page", b"2026-07-28", b"2025-11-25", b"read-only",
          b"http://evil.example", b"http://127.0.0.1", b"100-continue", b"chunked", b"gzip", b"close",
          b"keep-alive", b"websocket", b"0", b"-1", b"99999999999999999999", b"=?base64?aGk=?=",
          b"Bearer x", b"text/event-stream", b"application/json", b"*/*", b"1, 2", b"run-\xc3\xa9",
          b"a" * 9000]
header_values = st.one_of(
    st.sampled_from(VALUES),
    st.binary(max_size=16).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([b"x\ny", b"x\rY", b"x\r\nX-Injected: 1", b"x\r\n\r\nGET / HTTP/1.1", b" folded"]))
extra_headers = st.lists(
    st.tuples(st.one_of(st.sampled_from(NAMES), st.sampled_from(NAMES), st.sampled_from(BAD_NAMES)),
              header_values), max_size=4)

wild_specs = st.builds(
    Spec,
    method=st.sampled_from([b"POST"] * 12 + [b"GET", b"GET", b"DELETE", b"PUT", b"OPTIONS", b"HEAD",
                                             b"PATCH", b"post", b"FOO", b"G\x00T", b"", b"CONNECT"]),
    target=st.sampled_from([b"/mcp/h"] * 10 + [b"/mcp"] * 4 + [
        b"/mcp/nope", b"/mcp/h/", b"/mcp/h/extra", b"/", b"/healthz", b"/mcp/%68", b"/mcp/h?x=1",
        b"//mcp/h", b"*", b"http://127.0.0.1/mcp/h", b"/mcp/" + b"a" * 5000, b"/mcp/h#f",
        b"/mcp/\xff", b"/MCP/h", b"/mcp/h/../h", b"mcp/h"]),
    version=st.sampled_from([b"HTTP/1.1"] * 10 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"HTTP/0.9", b""]),
    auth=st.sampled_from(["valid"] * 10 + ["none", "garbage", "expired", "wrong_key"]),
    host=st.sampled_from(["ok"] * 10 + ["none", "evil", "two", "port"]),
    session=st.sampled_from(["none"] * 4 + ["upstream"] * 2 + ["aggregate", "random"]),
    protocol=st.sampled_from([b"2026-07-28"] * 3 + [b"2025-11-25"] * 2 + [
        None, b"2025-06-18", b"2024-11-05", b"9999-99-99", b""]),
    accept=st.sampled_from([b"application/json, text/event-stream"] * 4 + [
        None, b"application/json", b"text/event-stream", b"*/*"]),
    content_type=st.sampled_from([b"application/json"] * 5 + [None, b"text/plain", b"application/json; charset=latin-1"]),
    extra=extra_headers.map(tuple),
    body=bodies,
    encoding=st.sampled_from([None] * 8 + [b"gzip", b"gzip", b"deflate", b"deflate", b"br", b"identity",
                                           b"gzip, deflate", b"x-bogus", b"zstd"]),
    encoded=st.sampled_from(["match"] * 3 + ["plain", "gzip", "deflate", "raw_deflate"]),
    framing=st.sampled_from(["cl"] * 12 + ["cl_short", "cl_long", "none", "chunked", "chunked",
                                           "chunked_bad", "chunked_open", "cl_te", "cl_dup", "cl_bogus"]),
    client=st.sampled_from(["wait"] * 12 + ["half_close", "abandon"]),
    linger=st.sampled_from([0.0, 0.05, 0.3]),
)



@st.composite
def specs(draw: st.DrawFn) -> Spec:
    """Mostly a well-formed HTTP request whose JSON-RPC body varies (so that calls reach the
    envelope and the upstream), else one wild in every part."""
    spec = draw(wild_specs)
    if draw(st.integers(0, 9)) >= 6:
        return spec
    encoding = draw(st.sampled_from([None] * 6 + [b"gzip", b"deflate"]))
    target = draw(st.sampled_from([b"/mcp/h"] * 3 + [b"/mcp"]))
    legacy = draw(st.integers(0, 3)) == 0  # a session client, else a stateless one
    return replace(
        spec, method=b"POST", target=target, version=b"HTTP/1.1", auth="valid", host="ok",
        protocol=b"2025-11-25" if legacy else b"2026-07-28",
        session=("upstream" if target == b"/mcp/h" else "aggregate") if legacy else "none",
        content_type=b"application/json",
        accept=b"application/json, text/event-stream", extra=(), encoding=encoding, encoded="match",
        framing=draw(st.sampled_from(["cl"] * 5 + ["chunked"])),
        client=draw(st.sampled_from(["wait"] * 9 + ["abandon"])))

# ---- rendering and sending ---------------------------------------------------------------------


def render_body(spec: BodySpec, nonce: str) -> bytes:
    data = spec.text.replace(PLACEHOLDER, nonce).encode("utf-8", "surrogatepass")
    cut = int(len(data) * spec.at)
    match spec.mutation:
        case "truncate":
            return data[:cut]
        case "bad_utf8":
            # Inside a string when there is one (an invalid byte in a value, not in the syntax).
            quote = data.find(b'"', cut)
            at = quote + 1 if quote >= 0 else cut
            return data[:at] + spec.bad + data[at:]
        case "bom":
            return b"\xef\xbb\xbf" + data
        case "trailing":
            return data + b" {}"
        case "dup_method":  # two members of one name: the proxy and the upstream must agree
            first = b'"tools/call"' if spec.at < 0.5 else b'"ping"'
            return data.replace(b'"method": ', b'"method": ' + first + b', "method": ', 1)
        case "empty":
            return b""
    return data


def encode(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data)
    if how == "deflate":
        return zlib.compress(data)
    if how == "raw_deflate":
        compressor = zlib.compressobj(wbits=-15)
        return compressor.compress(data) + compressor.flush()
    return data


@dataclass
class Sent:
    status: int | None
    head: bytes
    body: bytes
    hung: bool = False


class Stack:
    """The proxy, its hostile upstream, and what the fuzzer has seen of both so far."""

    def __init__(self, pp: ProxyProcess, up: HostileUpstream):
        self.pp = pp
        self.up = up
        self.token = token("fuzz")
        self.expired = jwt.encode({"sub": "fuzz", "exp": int(time.time()) - 60}, JWT_SECRET, algorithm="HS256")
        self.wrong_key = jwt.encode({"sub": "fuzz", "exp": int(time.time()) + 3600}, "not-the-key" * 4,
                                    algorithm="HS256")
        self.http = httpx.Client(timeout=5)
        self.nonces: set[str] = set()
        self.upstream: dict[int, dict[str, Any]] = {}  # hostile log entries by seq
        self.settled = 0  # log entries up to here are final
        self.records: dict[str, list[dict[str, Any]]] = {}  # tools/call audit records by nonce
        self.audit_offset = 0
        self.keyless = 0  # tools/call audit records whose arguments hold no nonce
        self.baseline = (0, 0)  # (keyless calls at the upstream, keyless records) before this example
        self.examples = 0
        self.statuses: dict[int | None, int] = {}

    # -- sessions ----------------------------------------------------------------------------

    def session_id(self, which: str) -> bytes | None:
        """A live session of the route (opened now, so one the fuzzer ended is never reused)."""
        if which == "none":
            return None
        if which == "random":
            return uuid.uuid4().hex.encode()
        url = self.pp.url("h") if which == "upstream" else f"{self.pp.base}/mcp"
        response = self.http.post(url, json={
            "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "fuzz", "version": "1"}}},
            headers={"Authorization": f"Bearer {self.token}", "Accept": "application/json, text/event-stream",
                     "MCP-Protocol-Version": "2025-11-25"})
        assert response.status_code == 200, response.text
        return response.headers["mcp-session-id"].encode()

    # -- one request ---------------------------------------------------------------------------

    def request_bytes(self, spec: Spec, nonce: str) -> bytes:
        body = render_body(spec.body, nonce)
        if spec.encoded == "match":
            how = {b"gzip": "gzip", b"deflate": "deflate"}.get(spec.encoding or b"", "plain")
        else:
            how = spec.encoded
        body = encode(body, how)
        head = [spec.method + b" " + spec.target + b" " + spec.version]
        host = f"127.0.0.1:{self.pp.port}".encode()
        head += {"ok": [b"Host: " + host], "none": [], "evil": [b"Host: evil.example"],
                 "two": [b"Host: " + host, b"Host: evil.example"], "port": [b"Host: localhost:1"]}[spec.host]
        bearer = {"valid": self.token, "none": None, "garbage": "not.a.jwt", "expired": self.expired,
                  "wrong_key": self.wrong_key}[spec.auth]
        if bearer is not None:
            head.append(b"Authorization: Bearer " + bearer.encode())
        for name, value in ((b"Content-Type", spec.content_type), (b"Accept", spec.accept),
                            (b"MCP-Protocol-Version", spec.protocol),
                            (b"Mcp-Session-Id", self.session_id(spec.session)),
                            (b"Content-Encoding", spec.encoding)):
            if value is not None:
                head.append(name + b": " + value)
        head += [name + b": " + value for name, value in spec.extra]
        declared = len(body)
        match spec.framing:
            case "cl":
                head.append(b"Content-Length: %d" % declared)
            case "cl_short":
                head.append(b"Content-Length: %d" % max(declared // 2, 0))
            case "cl_long":
                head.append(b"Content-Length: %d" % (declared + 17))
            case "cl_dup":
                head += [b"Content-Length: %d" % declared, b"Content-Length: %d" % (declared + 1)]
            case "cl_bogus":
                head.append(b"Content-Length: " + (b"-1" if declared % 2 else b"0x10"))
            case "cl_te":
                head += [b"Content-Length: %d" % declared, b"Transfer-Encoding: chunked"]
                body = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
            case "chunked":
                head.append(b"Transfer-Encoding: chunked")
                half = len(body) // 2
                body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]) if p)
                body += b"0\r\n\r\n"
            case "chunked_bad":
                head.append(b"Transfer-Encoding: chunked")
                body = b"zz\r\n" + body + b"\r\n0\r\n\r\n"
            case "chunked_open":  # no last chunk: the body never ends
                head.append(b"Transfer-Encoding: chunked")
                body = b"%x\r\n" % len(body) + body + b"\r\n" if body else b""
        head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    def send(self, spec: Spec, data: bytes) -> Sent:
        # A request whose body cannot end by itself: the client must close its side or leave.
        client = spec.client
        if client == "wait" and spec.framing in ("cl_long", "chunked_open"):
            client = "half_close"
        with socket.create_connection(("127.0.0.1", self.pp.port), timeout=1) as s:
            try:
                s.sendall(data)
            except OSError:  # the proxy answered and closed before reading all of it
                pass
            if client == "abandon":
                time.sleep(spec.linger)
                # Linger 0: the close is a reset, as when a client process dies.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return Sent(None, b"", b"")
            if client == "half_close":
                with _suppress_oserror():
                    s.shutdown(socket.SHUT_WR)
            return self._read(s, spec, client)

    def _read(self, s: socket.socket, spec: Spec, client: str) -> Sent:
        answer = b""
        deadline = time.monotonic() + ANSWER_WAIT
        eof_sent = client == "half_close"
        while True:
            head, sep, _ = answer.partition(b"\r\n\r\n")
            if sep and spec.method == b"GET" and b"text/event-stream" in head.lower():
                s.settimeout(0.3)  # a standalone stream stays open: its head is the answer
            else:
                s.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                if sep and spec.method == b"GET":
                    break
                if time.monotonic() < deadline:
                    continue
                if answer or eof_sent:
                    return _parse(answer, hung=not answer)
                # Waiting for more of a request it cannot finish: the end of the client's data.
                with _suppress_oserror():
                    s.shutdown(socket.SHUT_WR)
                eof_sent = True
                deadline = time.monotonic() + AFTER_EOF_WAIT
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        return _parse(answer)

    # -- what reached the upstream, and the audit log ------------------------------------------

    def refresh(self) -> None:
        for entry in self.up.control.log(since=self.settled):
            self.upstream[entry["seq"]] = entry
        seq = self.settled
        while seq + 1 in self.upstream and self.upstream[seq + 1]["outcome"] is not None:
            seq += 1
        self.settled = seq
        path = self.pp.audit_dir / "audit.jsonl"
        if path.exists():
            with open(path, "rb") as f:
                f.seek(self.audit_offset)
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.audit_offset += len(complete)
            for line in complete.splitlines():
                rec = json.loads(line)
                # A record without `method` is about a `tools/call` (see `audit.record`).
                if rec.get("method", "tools/call") != "tools/call" or "result_of" in (rec.get("extra") or {}):
                    continue
                key = self.nonce_in(rec.get("args"))
                if key is None:
                    self.keyless += 1
                else:
                    self.records.setdefault(key, []).append(rec)

    def nonce_in(self, arguments: Any) -> str | None:
        """The nonce a request's arguments carry (as `key`, or anywhere when they are a list
        or a string); None when they carry none (`null` arguments, or none at all)."""
        for found in _NONCE.findall(json.dumps(arguments)):
            if found in self.nonces:
                return str(found)
        return None

    def reached(self) -> tuple[dict[str, int], list[dict[str, Any]], list[dict[str, Any]]]:
        """Tool calls that reached the upstream: by nonce, those of writers, and those whose
        arguments carry no nonce."""
        by_nonce: dict[str, int] = {}
        writers: list[dict[str, Any]] = []
        strangers: list[dict[str, Any]] = []
        for entry in self.upstream.values():
            if entry["method"] != "tools/call" or entry.get("status") in REFUSED:
                continue
            params = entry.get("params") if isinstance(entry.get("params"), dict) else {}
            key = self.nonce_in(params.get("arguments"))
            if key is None:
                strangers.append(entry)
                continue
            by_nonce[key] = by_nonce.get(key, 0) + 1
            if params.get("name") == "write_note":
                writers.append(entry)
        return by_nonce, writers, strangers

    def problems(self) -> list[str]:
        by_nonce, writers, strangers = self.reached()
        # A call without a nonce is paired by count: examples run one at a time, so the ones
        # that reached the upstream during this example need as many records of this example.
        found = []
        if len(strangers) - self.baseline[0] > self.keyless - self.baseline[1]:
            found.append(f"{len(strangers) - self.baseline[0]} calls without a nonce reached the upstream, "
                         f"{self.keyless - self.baseline[1]} were audited: {strangers[-1]['message']!r:.300}")
        for nonce, count in by_nonce.items():
            got = self.records.get(nonce, [])
            if len(got) != 1:
                found.append(f"call {nonce} reached the upstream {count}x and has {len(got)} audit records")
        for nonce, got in self.records.items():
            if len(got) > 1:
                found.append(f"call {nonce} has {len(got)} audit records: {[r['code'] for r in got]}")
        writes: dict[str, int] = {}
        for entry in writers:
            key = self.nonce_in(entry["params"].get("arguments"))
            writes[str(key)] = writes.get(str(key), 0) + 1
        found += [f"writer call {k} reached the upstream {n} times" for k, n in writes.items() if n > 1]
        return found

    def begin(self) -> None:
        """Start an example: what the keyless accounting counts from."""
        self.refresh()
        self.baseline = (len(self.reached()[2]), self.keyless)

    def settle(self, timeout: float = 4.0) -> list[str]:
        """The accounting problems left once calls in flight have ended (a completion of a call
        whose client left runs after the client is gone)."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            found = self.problems()
            in_flight = any(e["outcome"] is None for e in self.upstream.values())
            if (not found and not in_flight) or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


_STATUS = re.compile(rb"HTTP/\d\.\d (\d{3})")
_NONCE = re.compile(r"[0-9a-f]{32}")


def _parse(answer: bytes, hung: bool = False) -> Sent:
    head, _, body = answer.partition(b"\r\n\r\n")
    found = _STATUS.match(head)
    return Sent(int(found.group(1)) if found else None, head, body, hung)


# ---- the test ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("wire-fuzz")
    with hostile_server() as up, proxy_process(
            tmp, {"h": up.url}, policies=policy(tmp / "policy"),
            config={"aggregate": {"enabled": True},
                    "limits": {"max_body_bytes": MAX_BODY, "max_json_depth": MAX_DEPTH}}) as pp:
        yield Stack(pp, up)


def test_the_proxy_survives_hostile_wire_input_and_audits_every_call(stack: Stack) -> None:
    pp = stack.pp

    # No shrinking: one example costs up to seconds (a client that waits out a body that never
    # ends), and the failure message already carries the request bytes and the answer.
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(spec=specs())
    def one(spec: Spec) -> None:
        stack.examples += 1
        started = time.monotonic()
        nonce = uuid.uuid4().hex
        stack.nonces.add(nonce)
        stack.begin()
        data = stack.request_bytes(spec, nonce)
        sent = stack.send(spec, data)
        stack.statuses[sent.status] = stack.statuses.get(sent.status, 0) + 1
        context = f"request {data[:400]!r}... ({len(data)} bytes) answered {sent.head[:300]!r} {sent.body[:300]!r}"
        assert pp.proc.poll() is None, f"the proxy exited ({pp.proc.returncode}) after {context}\n{pp.log()[-3000:]}"
        assert not sent.hung, f"no answer, even after the client's end of data: {context}"
        # 1. alive and answering.
        health = httpx.get(f"{pp.admin}/healthz", timeout=10)  # alive, however loaded the machine
        assert health.status_code == 200, f"/healthz answered {health.status_code} after {context}"
        # 2. no 5xx but the documented upstream ones.
        if sent.status is not None and sent.status >= 500:
            assert sent.status in DOCUMENTED_5XX and b"'h'" in sent.body, \
                f"undocumented {sent.status}: {context}\n{pp.log()[-3000:]}"
        # 3. every call that reached the upstream is audited, once; writers reached it once.
        problems = stack.settle()
        assert not problems, f"{problems} after {context}"
        if os.environ.get("ENVELOPE_FUZZ_TRACE"):
            print(f"{time.monotonic() - started:5.2f}s {sent.status} {spec.framing} {spec.client} "
                  f"{spec.method!r} {spec.target[:20]!r}")

    one()
    problems = stack.settle(timeout=10)
    assert not problems, problems
    assert stack.records, "no tool call was ever audited: the fuzzer is not reaching the envelope"
    done = subprocess.run([*CLI, "audit", "verify", str(pp.audit_dir)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    reached, _, _ = stack.reached()
    print(f"\nwire fuzz: {stack.examples} requests, {len(reached)} tool calls reached the upstream, "
          f"{sum(len(v) for v in stack.records.values())} audited; statuses "
          f"{dict(sorted(stack.statuses.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))}")


@pytest.mark.parametrize("how", ["gzip", "deflate"])
def test_an_encoded_body_is_decoded_once_and_a_body_that_does_not_decode_is_a_400(
        stack: Stack, how: str) -> None:
    """Found by the fuzzer: an encoded body was read by its encoded `Content-Length` (cut
    short), its `Content-Encoding` was forwarded with the decoded bytes (the upstream could
    not read them: HTTP 500), and a body that did not decode was an HTTP 500 of the proxy."""
    nonce = uuid.uuid4().hex
    stack.nonces.add(nonce)
    text = "decoded " * 200  # compresses far below its size: a cut at the encoded length shows
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "read_page", "arguments": {"mode": "json", "text": text, "key": nonce}}})
    spec = Spec(method=b"POST", target=b"/mcp/h", version=b"HTTP/1.1", auth="valid", host="ok",
                session="none", protocol=b"2026-07-28", accept=b"application/json, text/event-stream",
                content_type=b"application/json", extra=(), body=BodySpec(body),
                encoding=how.encode(), encoded="match", framing="cl", client="wait")
    sent = stack.send(spec, stack.request_bytes(spec, nonce))
    assert sent.status == 200, sent
    assert json.loads(sent.body)["result"]["content"][0]["text"] == text
    listed = replace(spec, body=BodySpec('{"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}'))
    sent = stack.send(listed, stack.request_bytes(listed, nonce))
    assert sent.status == 200 and json.loads(sent.body)["result"]["tools"], sent
    broken = replace(spec, encoded="plain")  # says gzip/deflate, is not
    sent = stack.send(broken, stack.request_bytes(broken, uuid.uuid4().hex))
    assert sent.status == 400 and json.loads(sent.body)["error"]["code"] == -32700, sent
    assert not stack.settle()
    assert [r["code"] for r in stack.records[nonce]] == ["ok"]
