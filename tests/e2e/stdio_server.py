"""A tiny stdio MCP server (official SDK, `MCPServer.run("stdio")`) for the stdio upstream tests:
the cases the npm reference servers cannot script.

Tools:
- `echo(text)`: returns `text` (a reader).
- `pid()`: the process id (tells the children of a pool apart).
- `write_note(text)`: a writer; appends `text` to `<STDIO_STATE>/notes` (what reached the child).
- `crash(code)`: the process exits at once with `code`, mid-call (no reply is ever written).
- `garbage()`: writes a line that is not JSON to stdout (a broken child).
- `ask(question)`: asks the client (`elicitation/create`; `input_required` on 2026-07-28).
- `slow(seconds, tag)`: sleeps, then returns; with a tag, its start and its cancellation are
  recorded in `<STDIO_STATE>/started-<tag>` and `cancelled-<tag>`.
- `progress(n)`: reports progress `n` times, then returns.
- `shout(text)`: writes `text` to stderr, then returns it.

A file `<STDIO_STATE>/start_delay` holding seconds makes the process sleep that long before it
serves (a restart the test can watch happen).

Run: `python tests/e2e/stdio_server.py` (state directory from `STDIO_STATE`, else none).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve
from mcp_types import ToolAnnotations
from pydantic import BaseModel

READ = ToolAnnotations(readOnlyHint=True, destructiveHint=False, openWorldHint=False)


class Answer(BaseModel):
    answer: str


def ask_user(question: str) -> Elicit[Answer]:
    return Elicit(question, Answer)


def build_server() -> MCPServer:
    server = MCPServer("stdio-fixture")
    state = os.environ.get("STDIO_STATE")

    @server.tool(annotations=READ)
    def echo(text: str) -> str:
        """Return text."""
        return text

    @server.tool(annotations=READ)
    def pid() -> int:
        """This process's id."""
        return os.getpid()

    @server.tool()
    def write_note(text: str) -> str:
        """Append text to the notes file."""
        if state:
            with open(Path(state) / "notes", "a") as f:
                f.write(text + "\n")
        return f"noted: {text}"

    @server.tool(annotations=READ)
    def crash(code: int = 3) -> str:
        """Exit at once, mid-call."""
        os._exit(code)

    @server.tool(annotations=READ)
    def garbage() -> str:
        """Write a line that is not JSON on the protocol stream."""
        # The SDK diverts fd 1 away from the wire (so prints cannot corrupt it) and writes the
        # protocol on a private duplicate: write there, as a buggy server's stray output would.
        from mcp.server import stdio

        claim = stdio._claims.get(1)
        os.write(claim.private_fd if claim is not None and claim.private_fd is not None else 1,
                 b"this is not json\n")
        return "unreachable"

    @server.tool(annotations=READ)
    async def ask(question: str, answer: Annotated[Answer, Resolve(ask_user)]) -> str:
        """Ask the client for input and return it."""
        return f"answered: {answer.answer}"

    def mark(name: str) -> None:
        if state:
            with open(Path(state) / name, "a") as f:
                f.write("1\n")

    @server.tool(annotations=READ)
    async def slow(seconds: float = 1.0, tag: str = "") -> str:
        """Sleep, then return; with a tag, `started-<tag>` and `cancelled-<tag>` are recorded."""
        if tag:
            mark(f"started-{tag}")
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            if tag:
                mark(f"cancelled-{tag}")
            raise
        return f"slept {seconds}"

    @server.tool(annotations=READ)
    async def progress(ctx: Context, n: int = 3) -> str:
        """Report progress n times, then return."""
        for i in range(n):
            await ctx.report_progress(i + 1, n, f"step {i + 1}")
            await asyncio.sleep(0.05)
        return f"progressed {n}"

    @server.tool(annotations=READ)
    def shout(text: str) -> str:
        """Write text to stderr, then return it."""
        print(text, file=sys.stderr, flush=True)
        return text

    return server


if __name__ == "__main__":
    delay = Path(os.environ.get("STDIO_STATE", "/nonexistent")) / "start_delay"
    if delay.exists():
        import time

        time.sleep(float(delay.read_text() or 0))
    build_server().run("stdio")
