"""An MCP SDK server for `envelope-proxy scaffold`: a tool of every annotation kind, with input
schemas using enum, integer bounds, a format and a nested object, listed two tools per page.

    python tests/e2e/scaffold_server.py                  # stdio
    python tests/e2e/scaffold_server.py --port 9001      # Streamable HTTP at /mcp
"""

from __future__ import annotations

import argparse
from typing import Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.types import ListToolsResult, PaginatedRequestParams, ToolAnnotations
from pydantic import BaseModel, Field

PAGE = 2


class Address(BaseModel):
    street: str
    zip_code: int = Field(ge=1000)


def build_server() -> MCPServer:
    server = MCPServer("scaffold-fixture")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def search(query: str, mode: Literal["fast", "exact"], limit: int = Field(ge=5, le=50)) -> str:
        """Search the web (read-only, open world)."""
        return f"{query} {mode} {limit}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    def get_record(record_id: int = Field(ge=1), since: str = Field(json_schema_extra={"format": "date"})) -> str:
        """Read a local record (read-only, closed world)."""
        return f"{record_id} {since}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False))
    def save_contact(name: str, address: Address, tags: list[str] | None = None) -> str:
        """Save a contact in the local book (a closed-world writer)."""
        return name

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False))
    def send_email(to: str, body: str, priority: Literal["low", "high"] = "low") -> str:
        """Send an email (an open-world writer)."""
        return to

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False))
    def drop_table(table: str) -> str:
        """Drop a table (destructive, closed world)."""
        return table

    @server.tool()
    def mystery(payload: dict[str, Any]) -> str:
        """No annotations at all: the safe default."""
        return "?"

    async def paged(ctx: Any, params: PaginatedRequestParams | None) -> ListToolsResult:
        # Pages of PAGE tools, so the scaffold must follow nextCursor.
        tools = await server.list_tools()
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + PAGE
        return ListToolsResult(tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None)

    server._lowlevel_server.add_request_handler("tools/list", PaginatedRequestParams, paged)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    if args.port is None:
        build_server().run("stdio")
    else:
        build_server().run("streamable-http", host="127.0.0.1", port=args.port, json_response=True)


if __name__ == "__main__":
    main()
