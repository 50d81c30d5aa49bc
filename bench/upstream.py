"""A fast fake MCP upstream for the benchmark: raw asyncio (uvloop when installed), no framework.

Answers every `POST` with a fixed JSON-RPC `tools/call` result, like an MCP SDK server in
json_response + stateless mode would, echoing the request's id. Keep-alive, pipelining-safe,
HTTP/1.1 only. It does as little as possible so the proxies' own costs stay visible.

    python bench/upstream.py --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import re

_ID = re.compile(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")')
_RESULT = b'"result":{"content":[{"type":"text","text":"ok"}],"isError":false,"resultType":"complete"}}'
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
_NOT_FOUND = b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n"


def answer(body: bytes) -> bytes:
    """The JSON-RPC result this upstream sends for a request body (its id echoed)."""
    m = _ID.search(body)
    return b'{"jsonrpc":"2.0","id":' + (m.group(1) if m else b"null") + b"," + _RESULT


def reply(body: bytes) -> bytes:
    payload = answer(body)
    return _HEAD % len(payload) + payload


class Upstream(asyncio.Protocol):
    __slots__ = ("buf", "transport")

    def __init__(self) -> None:
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
            out.append(reply(body) if head.startswith(b"POST ") else _NOT_FOUND)
        self.buf = buf
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def main(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, host, port, backlog=1024)
    print(f"fake MCP upstream on http://{host}:{port}/mcp", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(main(args.host, args.port))
    except ImportError:
        asyncio.run(main(args.host, args.port))
    except KeyboardInterrupt:
        pass
