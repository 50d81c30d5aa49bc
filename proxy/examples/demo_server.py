"""The bundled example MCP tool server used by `envelope-proxy demo` and the tests.

A tiny notes service over MCP Streamable HTTP (official SDK): one read-only tool, two writers
and a destructive one, so the example policy pack has something to allow, constrain and refuse.

    python -m proxy.examples.demo_server --port 9001 [--mode sse|json|stateless]
"""

from __future__ import annotations

import argparse
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations


def build_server() -> MCPServer:
    notes: dict[str, dict[str, str]] = {
        "welcome": {"folder": "inbox", "body": "Welcome to the envelope-proxy demo."},
    }
    server = MCPServer("demo-notes", instructions="A notes service behind envelope-proxy.")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    def search_notes(query: str, limit: int = 10) -> list[dict[str, Any]]:
        """Find notes whose title or body contains the query."""
        q = query.lower()
        hits = [
            {"title": t, "folder": n["folder"], "body": n["body"]}
            for t, n in notes.items()
            if q in t.lower() or q in n["body"].lower()
        ]
        return hits[: max(limit, 0)]

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False))
    def write_note(title: str, body: str, folder: str = "inbox") -> dict[str, Any]:
        """Create or replace a note."""
        notes[title] = {"folder": folder, "body": body}
        return {"saved": title, "folder": folder, "count": len(notes)}

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
    def delete_note(title: str) -> dict[str, Any]:
        """Delete a note for good."""
        existed = notes.pop(title, None) is not None
        return {"deleted": title, "existed": existed}

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--mode", choices=["sse", "json", "stateless"], default="sse",
                        help="sse: answers POSTs as SSE streams; json: plain JSON; stateless: no sessions")
    args = parser.parse_args()
    build_server().run(
        "streamable-http", host=args.host, port=args.port,
        json_response=args.mode != "sse", stateless_http=args.mode == "stateless",
    )


if __name__ == "__main__":
    main()
