"""An official-SDK MCP server that keeps state per session (Streamable HTTP, JSON answers).

`count` answers `<session number>:<calls in this session>:<session id>`: sessions are numbered
in the order they made their first call, so a test sees whether one client session reached one
upstream session, whichever proxy worker carried each call (and, with the id, whether that
session still exists after its client ended its own).

    python tests/e2e/session_server.py --port 9010
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations


def build_server() -> MCPServer:
    server = MCPServer("session-counter")
    numbers: dict[str, int] = {}
    calls: dict[str, int] = {}

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    def count(ctx: Context) -> str:
        """How many calls this session made, with its number."""
        headers = ctx.headers or {}
        session = headers.get("mcp-session-id", "")
        number = numbers.setdefault(session, len(numbers) + 1)
        calls[session] = calls.get(session, 0) + 1
        return f"{number}:{calls[session]}:{session}"

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    build_server().run("streamable-http", host="127.0.0.1", port=args.port, json_response=True,
                       stateless_http=False)


if __name__ == "__main__":
    main()
