"""A fake MCP upstream for the realistic mix (bench/mix.py): raw asyncio, sized untrusted output.

Unlike bench/upstream.py (which answers every POST with a two-byte `ok`), this one speaks enough
MCP for real clients and proxies (the Python peers open a session through it): `initialize`
(with an `Mcp-Session-Id` for the session revisions), notifications (202), `ping`, `tools/list`
and `tools/call`, whose text is `--size` bytes of English-like prose. The text changes on every
call (a sliding window over a generated corpus): a proxy that fingerprints untrusted output must
not get the benefit of the same output recorded again and again, which real tools never send.

    python bench/mix_upstream.py --port 9100 --size 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re

_ID = re.compile(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")')
_METHOD = re.compile(rb'"method"\s*:\s*"([^"]*)"')
_PROTO = re.compile(rb'"protocolVersion"\s*:\s*"([^"]*)"')
_HEAD = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
_ACCEPTED = b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n"
_NOT_ALLOWED = b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n"
_OK_EMPTY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
SESSION_ID = b"bench-session-0001"
TOOL = {
    "name": "search_issues",
    "description": "Search the issues of a repository.",
    "inputSchema": {
        "type": "object",
        "properties": {
            "repo": {"type": "string"}, "query": {"type": "string"}, "state": {"type": "string"},
            "limit": {"type": "integer"}, "labels": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["repo", "query"],
    },
}
_WORDS = ("the build of checkout service fails when the payment gateway answers slowly and retries "
          "exhaust their budget while the cache warms up after deploy on monday morning customers saw "
          "duplicate charges logs show timeouts from region eu west flaky test in ci pipeline blocks "
          "release owners asked for a rollback plan and a postmortem with action items").split()


# Where an output may start in the corpus. 61 and SPAN are coprime, so the window moves through
# SPAN distinct starts before any output comes back: ~1 M calls, more than any bench sends to one
# upstream. (It was 4,096: a cell past 4,096 calls got outputs the proxy had recorded seconds
# before, whose store write the envelope rightly skips, which real tools never give it.)
SPAN = 1 << 20


def corpus(size: int, seed: int = 15) -> str:
    """Deterministic prose, at least `size` characters plus room for the sliding window."""
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < size + SPAN:
        w = rng.choice(_WORDS)
        words.append(w)
        length += len(w) + 1
    return " ".join(words)


class Answers:
    """The bodies this upstream sends; `call` slides a window over the corpus per call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.text = corpus(size)
        self.calls = 0

    def window(self) -> str:
        """The next call's text."""
        start = (self.calls * 61) % SPAN
        self.calls += 1
        return self.text[start: start + self.size]

    def call_result(self) -> bytes:
        text = self.window()
        result = {"content": [{"type": "text", "text": text}], "isError": False}
        return json.dumps(result, separators=(",", ":")).encode()

    def reply(self, body: bytes) -> bytes:
        m_id, m_method = _ID.search(body), _METHOD.search(body)
        method = m_method.group(1) if m_method else b""
        if m_id is None:  # a notification or a response: accepted, no body
            return _ACCEPTED
        extra = b""
        if method == b"tools/call":
            result = self.call_result()
        elif method == b"initialize":
            proto = _PROTO.search(body)
            version = proto.group(1) if proto else b"2025-06-18"
            result = (b'{"protocolVersion":"' + version + b'","capabilities":{"tools":{"listChanged":false}},'
                      b'"serverInfo":{"name":"bench-mix-upstream","version":"1.0"}}')
            extra = b"Mcp-Session-Id: " + SESSION_ID + b"\r\n"
        elif method == b"tools/list":
            result = json.dumps({"tools": [TOOL]}, separators=(",", ":")).encode()
        else:  # ping and anything else: an empty result
            result = b"{}"
        payload = b'{"jsonrpc":"2.0","id":' + m_id.group(1) + b',"result":' + result + b"}"
        return _HEAD % (200, b"OK", len(payload), extra) + payload


class Upstream(asyncio.Protocol):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            length = 0
            i = head.lower().find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17: j if j >= 0 else len(head)])
            total = end + 4 + length
            if len(buf) < total:
                break
            body = buf[end + 4: total]
            buf = buf[total:]
            if head.startswith(b"POST "):
                out.append(self.answers.reply(body))
            elif head.startswith(b"DELETE "):
                out.append(_OK_EMPTY)
            else:  # GET: no server-initiated stream here
                out.append(_NOT_ALLOWED)
        self.buf = buf
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def main(host: str, port: int, size: int) -> None:
    loop = asyncio.get_running_loop()
    answers = Answers(size)
    server = await loop.create_server(lambda: Upstream(answers), host, port, backlog=1024)
    print(f"fake MCP upstream ({size} B outputs) on http://{host}:{port}/mcp", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--size", type=int, default=200, help="bytes of text in each tools/call result")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(main(args.host, args.port, args.size))
    except ImportError:
        asyncio.run(main(args.host, args.port, args.size))
    except KeyboardInterrupt:
        pass
