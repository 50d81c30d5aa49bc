"""A raw asyncio MCP upstream that answers with bytes a test scripts, framing and all.

`hostile_upstream.py` misbehaves in named ways; this one writes exactly what a test gives it,
so a test can split an SSE event at any byte, mix line endings, hide fields, or keep a stream
open for ever. It runs in a thread of the test process (`scripted_server()`), so scripts are
plain Python values.

Every request is read whole (Content-Length bodies; the proxy writes its own framing), logged
in `ScriptedUpstream.seen` as (method, path, headers, JSON body), then answered:

- a script registered for the request's `tools/call` name, or for its method, or for `GET`
  (`scripts[key]`): a `Script`, written as an HTTP/1.1 answer with `Connection: close`;
  `{id}` in its parts stands for the request's JSON-RPC id (as JSON);
- else `initialize` gets a JSON result and `Mcp-Session-Id: s-1`, a notification or a
  client's answer 202, `tools/list` the tools of `tools`, anything else -32601.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

SESSION = "s-1"


@dataclass
class Script:
    """An answer: `parts` written in order, `pause` seconds apart; `status` and `headers` start
    it (an SSE stream unless `headers` says otherwise); `hold` keeps the connection open that
    many seconds after the last part (a stream that never ends); `split` cuts the whole answer
    into writes of that many bytes instead."""

    parts: list[bytes]
    pause: float = 0.0
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/event-stream"})
    hold: float = 0.0
    split: int = 0  # write the answer this many bytes at a time (0: part by part)


def json_answer(message: dict[str, Any]) -> Script:
    return Script([json.dumps(message).encode()], headers={"Content-Type": "application/json"})


@dataclass
class ScriptedUpstream:
    port: int = 0
    scripts: dict[str, Script] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)
    seen: list[tuple[str, str, dict[str, str], Any]] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def calls(self, method: str = "tools/call") -> list[Any]:
        return [body for _, _, _, body in self.seen if isinstance(body, dict) and body.get("method") == method]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body: Any = None
        length = int(headers.get("content-length", "0"))
        if length:
            raw = await reader.readexactly(length)
            with contextlib.suppress(ValueError):
                body = json.loads(raw)
        self.seen.append((method, path, headers, body))
        rpc = body if isinstance(body, dict) else {}
        rid = rpc.get("id")
        params = rpc.get("params") if isinstance(rpc.get("params"), dict) else {}
        key = method if method != "POST" else str(rpc.get("method"))
        if key == "tools/call" and f"tools/call:{params.get('name')}" in self.scripts:
            key = f"tools/call:{params.get('name')}"
        script = self.scripts.get(key)
        if script is None:
            if method == "GET" or method == "DELETE":
                script = Script([b""], status=405, headers={})
            elif "method" not in rpc or "id" not in rpc:
                script = Script([b""], status=202, headers={})
            elif rpc["method"] == "initialize":
                script = json_answer({"jsonrpc": "2.0", "id": rid, "result": {
                    "protocolVersion": params.get("protocolVersion", "2025-11-25"),
                    "capabilities": {"tools": {}, "resources": {"subscribe": True}, "prompts": {},
                                     "completions": {}, "logging": {}},
                    "serverInfo": {"name": "scripted", "version": "1"}}})
                script.headers["Mcp-Session-Id"] = SESSION
            elif rpc["method"] == "tools/list":
                script = json_answer({"jsonrpc": "2.0", "id": rid, "result": {"tools": self.tools}})
            else:
                script = json_answer({"jsonrpc": "2.0", "id": rid,
                                      "error": {"code": -32601, "message": "no such method"}})
        await self._write(writer, script, json.dumps(rid).encode())
        return False  # Connection: close

    async def _write(self, writer: asyncio.StreamWriter, script: Script, rid: bytes) -> None:
        reason = {200: "OK", 202: "Accepted", 405: "Method Not Allowed"}.get(script.status, "X")
        head = f"HTTP/1.1 {script.status} {reason}\r\nConnection: close\r\n"
        for name, value in script.headers.items():
            head += f"{name}: {value}\r\n"
        writer.write(head.encode() + b"\r\n")
        await writer.drain()
        parts = [part.replace(b"{id}", rid) for part in script.parts]
        if script.split:
            whole = b"".join(parts)
            parts = [whole[i:i + script.split] for i in range(0, len(whole), script.split)]
        for i, part in enumerate(parts):
            if i and script.pause:
                await asyncio.sleep(script.pause)
            writer.write(part)
            await writer.drain()
        if script.hold:
            await asyncio.sleep(script.hold)


@contextlib.contextmanager
def scripted_server(tools: list[dict[str, Any]] | None = None) -> Iterator[ScriptedUpstream]:
    """A `ScriptedUpstream` listening on a free loopback port, in a thread, until the block ends."""
    up = ScriptedUpstream(tools=list(tools or []))
    ready = threading.Event()
    stopping: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stopping
        stopping = asyncio.Event()
        up.loop = asyncio.get_running_loop()
        server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
        up.port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await stopping.wait()
            server.close()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield up
    finally:
        assert up.loop is not None and stopping is not None
        up.loop.call_soon_threadsafe(stopping.set)
        thread.join(10)
