"""A tiny stdio MCP server (official SDK, `MCPServer.run("stdio")`) for the stdio upstream tests:
the cases the npm reference servers cannot script.

Tools:
- `echo(text)`: returns `text` (a reader).
- `pid()`: the process id (tells the children of a pool apart).
- `write_note(text)`: a writer; appends `text` to `<STDIO_STATE>/notes` (what reached the child).
- `crash(code)`: the process exits at once with `code`, mid-call (no reply is ever written).
- `garbage()`: writes a line that is not JSON to stdout (a broken child).
- `ask(question)`: asks the client (`elicitation/create`; `input_required` on 2026-07-28).
- `slow(seconds)`: sleeps, then returns.
- `shout(text)`: writes `text` to stderr, then returns it.

Run: `python tests/e2e/stdio_server.py` (state directory from `STDIO_STATE`, else none).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import MCPServer
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
        os.write(1, b"this is not json\n")
        return "unreachable"

    @server.tool(annotations=READ)
    async def ask(question: str, answer: Annotated[Answer, Resolve(ask_user)]) -> str:
        """Ask the client for input and return it."""
        return f"answered: {answer.answer}"

    @server.tool(annotations=READ)
    async def slow(seconds: float = 1.0) -> str:
        """Sleep, then return."""
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool(annotations=READ)
    def shout(text: str) -> str:
        """Write text to stderr, then return it."""
        print(text, file=sys.stderr, flush=True)
        return text

    return server


if __name__ == "__main__":
    build_server().run("stdio")
