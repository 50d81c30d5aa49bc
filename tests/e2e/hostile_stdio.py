"""A stdio MCP server that misbehaves on request, with no SDK: newline-delimited JSON-RPC on
stdin/stdout, speaking the 2025-11-25 handshake (the proxy initialises it for stateless callers).

Each tool is one misbehaviour; `tools/call` runs the tool named in `params.name` with
`params.arguments`:

- `echo(text)`: replies `text` (a well-behaved reader).
- `write(text)`: a writer; appends `text` to `<HOSTILE_STATE>/writes` (what reached the child).
- `write_crash(text)`: a writer that appends `text` to `writes`, then exits at once (no reply).
- `twice(text)`: replies twice to the same id (`first: text`, then `second: text`).
- `stranger(text)`: first a reply to an id nobody asked for, then the real reply.
- `idless(text)`: first a message with a result and no id (and no method), then the real reply.
- `badutf8()`: writes a line of invalid UTF-8 (`{"x": "\\xff"}`).
- `dupkey(text)`: replies with a result naming `content` twice: `text` first, then `clean`.
- `huge(size)`: writes `size` bytes of one line, no newline, then waits.
- `hang()`: never answers.
- `late(seconds, text)`: answers after `seconds` (`<HOSTILE_STATE>/started-<text>` marks its start).
- `stderr(lines)`: writes `lines` stderr lines, then answers.
- `ask(text)`: sends `sampling/createMessage` (a server request) and a log notification, then
  replies with what the client answered.
- `pid()`: the process id.
- `flood(n)`: `n` log notifications as fast as the pipe takes them, then the reply.

`HOSTILE_MODERN` set: it answers `server/discover` too (a 2026-07-28 server: the proxy relays its
server requests to stateless callers). `HOSTILE_EXIT` set: the process exits with that code at start-up, before reading anything.

Run: `python tests/e2e/hostile_stdio.py`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

OUT = sys.stdout.buffer
LOCK = threading.Lock()
ANSWERS: dict[Any, Any] = {}
STATE = os.environ.get("HOSTILE_STATE")

TOOLS = [{"name": n, "description": n, "inputSchema": {"type": "object"},
          "annotations": {"readOnlyHint": not n.startswith("write")}}
         for n in ("echo", "write", "write_crash", "twice", "stranger", "idless", "badutf8", "dupkey", "huge", "hang",
                   "late", "stderr", "ask", "pid", "flood")]


def raw(data: bytes) -> None:
    with LOCK:
        OUT.write(data)
        OUT.flush()


def send(message: dict[str, Any]) -> None:
    raw(json.dumps(message).encode() + b"\n")


def text_result(rid: Any, text: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": text}],
                                                    "isError": False}}


def call(rid: Any, name: str, args: dict[str, Any]) -> None:
    text = str(args.get("text", ""))
    if name == "echo":
        send(text_result(rid, text))
    elif name == "write":
        if STATE:
            with open(Path(STATE) / "writes", "a") as f:
                f.write(text + "\n")
        send(text_result(rid, f"wrote: {text}"))
    elif name == "write_crash":
        if STATE:
            with open(Path(STATE) / "writes", "a") as f:
                f.write(text + "\n")
        os._exit(3)
    elif name == "twice":
        send(text_result(rid, f"first: {text}"))
        send(text_result(rid, f"second: {text}"))
    elif name == "stranger":
        send(text_result("nobody-asked-for-this", f"stranger: {text}"))
        send(text_result(rid, f"real: {text}"))
    elif name == "idless":
        message = text_result(rid, f"idless: {text}")
        del message["id"]
        send(message)
        send(text_result(rid, f"real: {text}"))
    elif name == "badutf8":
        raw(b'{"jsonrpc": "2.0", "id": ' + json.dumps(rid).encode() + b', "result": {"x": "\xff\xfe"}}\n')
    elif name == "dupkey":
        content = json.dumps([{"type": "text", "text": text}])
        raw(b'{"jsonrpc": "2.0", "id": ' + json.dumps(rid).encode() + b', "result": {"content": '
            + content.encode() + b', "content": [{"type": "text", "text": "clean"}]}}\n')
    elif name == "huge":
        size = int(args.get("size", 1 << 20))
        chunk = b"a" * 65536
        with LOCK:
            OUT.write(b'{"x": "')
            while size > 0:
                OUT.write(chunk[:size])
                size -= len(chunk)
            OUT.flush()
        time.sleep(3600)
    elif name == "hang":
        return
    elif name == "late":
        if STATE:
            (Path(STATE) / f"started-{text}").touch()
        time.sleep(float(args.get("seconds", 1)))
        send(text_result(rid, f"late: {text}"))
    elif name == "stderr":
        for n in range(int(args.get("lines", 1000))):
            sys.stderr.write(f"noise {n} " + "x" * 200 + "\n")
        sys.stderr.flush()
        send(text_result(rid, "noisy"))
    elif name == "ask":
        qid = f"q-{rid}"
        event = threading.Event()
        ANSWERS[qid] = event
        send({"jsonrpc": "2.0", "method": "notifications/message",
              "params": {"level": "info", "data": f"log: {text}"}})
        send({"jsonrpc": "2.0", "id": qid, "method": "sampling/createMessage",
              "params": {"messages": [{"role": "user", "content": {"type": "text", "text": text}}],
                         "maxTokens": 10}})
        event.wait(30)
        answer = ANSWERS.pop(qid + "-answer", None)
        send(text_result(rid, f"answered: {json.dumps(answer)}"))
    elif name == "pid":
        send(text_result(rid, str(os.getpid())))
    elif name == "flood":
        line = json.dumps({"jsonrpc": "2.0", "method": "notifications/message",
                           "params": {"level": "info", "data": "x" * 100}}).encode() + b"\n"
        with LOCK:
            for _ in range(int(args.get("n", 1000))):
                OUT.write(line)
            OUT.flush()
        send(text_result(rid, "flooded"))
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32602, "message": f"no tool {name}"}})


def handle(message: dict[str, Any]) -> None:
    method, rid, params = message.get("method"), message.get("id"), message.get("params") or {}
    if method is None:
        if rid in ANSWERS:
            ANSWERS[f"{rid}-answer"] = message.get("result", message.get("error"))
            ANSWERS.pop(rid).set()
        return
    if rid is None:
        return  # a notification
    if method == "server/discover" and os.environ.get("HOSTILE_MODERN"):
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "supportedVersions": ["2026-07-28"], "capabilities": {"tools": {}}, "resultType": "complete"}})
    elif method == "initialize":
        send({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": params.get("protocolVersion", "2025-11-25"),
            "capabilities": {"tools": {}}, "serverInfo": {"name": "hostile-stdio", "version": "1"}}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": rid, "result": {}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        threading.Thread(target=call, args=(rid, params.get("name"), params.get("arguments") or {}),
                         daemon=True).start()
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "Method not found"}})


def main() -> None:
    if os.environ.get("HOSTILE_EXIT"):
        sys.exit(int(os.environ["HOSTILE_EXIT"]))
    for line in sys.stdin.buffer:
        if line.strip():
            handle(json.loads(line))


if __name__ == "__main__":
    main()
