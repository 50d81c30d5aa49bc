"""The MCP server the official conformance suite (`@modelcontextprotocol/conformance` 0.1.16,
`conformance server --url ...`) expects, written with the official Python SDK.

Every name and value below comes from the suite's server scenarios (tools `test_*`, resources
`test://...`, prompts `test_*_prompt*`, completion for `test_prompt_with_arguments`).

    python tests/conformance/fixture_server.py --port 8123 [--protocol-version 2025-06-18]
    python tests/conformance/fixture_server.py --stdio    (on stdin/stdout: a stdio upstream)

Answers requests with SSE streams (the suite's `server-sse-polling` reads the priming event and
the `retry:` field), keeps an in-memory event store so `test_reconnection` can close its stream
mid-call and the client resumes with `GET` + `Last-Event-ID`. `--protocol-version` pins the
revision the server negotiates in `initialize` (the suite's client always asks for its latest,
2025-11-25; pinning makes a 2025-06-18 run speak 2025-06-18 on the wire).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.prompts.base import Message, UserMessage
from mcp.server.streamable_http import EventCallback, EventMessage, EventStore
from mcp.types import (
    AudioContent,
    CallToolResult,
    Completion,
    EmbeddedResource,
    EmptyResult,
    ImageContent,
    SamplingMessage,
    SetLevelRequestParams,
    SubscribeRequestParams,
    TextContent,
    TextResourceContents,
    UnsubscribeRequestParams,
)

# A 1x1 red pixel PNG and a minimal (silent, 8 samples) 8 kHz mono 8-bit WAV.
RED_PIXEL_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)
_WAV = (
    b"RIFF" + (36 + 8).to_bytes(4, "little") + b"WAVEfmt "
    + (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + (1).to_bytes(2, "little")
    + (8000).to_bytes(4, "little") + (8000).to_bytes(4, "little")
    + (1).to_bytes(2, "little") + (8).to_bytes(2, "little")
    + b"data" + (8).to_bytes(4, "little") + b"\x80" * 8
)
SILENT_WAV = base64.b64encode(_WAV).decode()

# Every tool the fixture serves (the conformance policy lists each of them).
TOOL_NAMES = (
    "test_simple_text",
    "test_image_content",
    "test_audio_content",
    "test_embedded_resource",
    "test_multiple_content_types",
    "test_tool_with_logging",
    "test_tool_with_progress",
    "test_error_handling",
    "test_sampling",
    "test_elicitation",
    "test_elicitation_sep1034_defaults",
    "test_elicitation_sep1330_enums",
    "test_reconnection",
    "json_schema_2020_12_tool",
)


class InMemoryEventStore(EventStore):
    """Resumability for SSE streams: every event kept in memory, replayed after `Last-Event-ID`."""

    def __init__(self) -> None:
        self._events: list[tuple[str, str, Any]] = []  # (event id, stream id, message or None)
        self._ids = itertools.count(1)

    async def store_event(self, stream_id: str, message: Any) -> str:
        event_id = str(next(self._ids))
        self._events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id: str, send_callback: EventCallback) -> str | None:
        index = next((i for i, e in enumerate(self._events) if e[0] == last_event_id), None)
        if index is None:
            return None
        stream_id = self._events[index][1]
        for event_id, sid, message in self._events[index + 1:]:
            if sid == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream_id


def build_server() -> MCPServer:
    mcp = MCPServer("envelope-conformance-fixture", version="1.0.0")

    # -- tools ----------------------------------------------------------------------------------

    @mcp.tool(description="Returns simple text content")
    def test_simple_text() -> str:
        return "This is a simple text response for testing."

    @mcp.tool(description="Returns image content (a 1x1 red PNG)")
    def test_image_content() -> ImageContent:
        return ImageContent(type="image", data=RED_PIXEL_PNG, mime_type="image/png")

    @mcp.tool(description="Returns audio content (a short silent WAV)")
    def test_audio_content() -> AudioContent:
        return AudioContent(type="audio", data=SILENT_WAV, mime_type="audio/wav")

    @mcp.tool(description="Returns an embedded resource")
    def test_embedded_resource() -> EmbeddedResource:
        return EmbeddedResource(type="resource", resource=TextResourceContents(
            uri="test://embedded-resource", mime_type="text/plain",
            text="This is an embedded resource content."))

    @mcp.tool(description="Returns text, image and embedded resource content")
    def test_multiple_content_types() -> list[TextContent | ImageContent | EmbeddedResource]:
        return [
            TextContent(type="text", text="Multiple content types test:"),
            ImageContent(type="image", data=RED_PIXEL_PNG, mime_type="image/png"),
            EmbeddedResource(type="resource", resource=TextResourceContents(
                uri="test://mixed-content-resource", mime_type="application/json",
                text=json.dumps({"test": "data", "value": 123}))),
        ]

    @mcp.tool(description="Sends three info log notifications while it runs")
    async def test_tool_with_logging(ctx: Context) -> str:
        await ctx.info("Tool execution started")
        await asyncio.sleep(0.05)
        await ctx.info("Tool processing data")
        await asyncio.sleep(0.05)
        await ctx.info("Tool execution completed")
        return "Tool with logging executed successfully"

    @mcp.tool(description="Reports progress 0, 50, 100 of 100")
    async def test_tool_with_progress(ctx: Context) -> str:
        await ctx.report_progress(0, 100)
        await asyncio.sleep(0.05)
        await ctx.report_progress(50, 100)
        await asyncio.sleep(0.05)
        await ctx.report_progress(100, 100)
        return "Tool with progress executed successfully"

    @mcp.tool(description="Always fails with an isError result")
    def test_error_handling() -> CallToolResult:
        return CallToolResult(is_error=True, content=[TextContent(
            type="text", text="This tool intentionally returns an error for testing")])

    @mcp.tool(description="Asks the client's LLM (sampling/createMessage)")
    async def test_sampling(prompt: str, ctx: Context) -> str:
        result = await ctx.session.create_message(
            [SamplingMessage(role="user", content=TextContent(type="text", text=prompt))],
            max_tokens=100, related_request_id=ctx.request_id)
        content = result.content
        text = getattr(content, "text", None) or json.dumps(content.model_dump(mode="json")
                                                            if hasattr(content, "model_dump") else str(content))
        return f"LLM response: {text}"

    @mcp.tool(description="Asks the user for a username and an email (elicitation/create)")
    async def test_elicitation(message: str, ctx: Context) -> str:
        result = await ctx.session.elicit_form(message, {
            "type": "object",
            "properties": {
                "username": {"type": "string", "description": "User's response"},
                "email": {"type": "string", "description": "User's email address"},
            },
            "required": ["username", "email"],
        }, related_request_id=ctx.request_id)
        return f"User response: action={result.action}, content={json.dumps(result.content)}"

    @mcp.tool(description="Elicitation with a default for every primitive type (SEP-1034)")
    async def test_elicitation_sep1034_defaults(ctx: Context) -> str:
        result = await ctx.session.elicit_form("Please review and update the form fields with defaults", {
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "User name", "default": "John Doe"},
                "age": {"type": "integer", "description": "User age", "default": 30},
                "score": {"type": "number", "description": "User score", "default": 95.5},
                "status": {"type": "string", "description": "User status",
                           "enum": ["active", "inactive", "pending"], "default": "active"},
                "verified": {"type": "boolean", "description": "Verification status", "default": True},
            },
            "required": [],
        }, related_request_id=ctx.request_id)
        return f"Elicitation completed: action={result.action}, content={json.dumps(result.content)}"

    @mcp.tool(description="Elicitation with the five enum schema variants (SEP-1330)")
    async def test_elicitation_sep1330_enums(ctx: Context) -> str:
        result = await ctx.session.elicit_form("Please select options from the enum fields", {
            "type": "object",
            "properties": {
                "untitledSingle": {"type": "string", "description": "Untitled single-select",
                                   "enum": ["option1", "option2", "option3"]},
                "titledSingle": {"type": "string", "description": "Titled single-select", "oneOf": [
                    {"const": "value1", "title": "First Option"},
                    {"const": "value2", "title": "Second Option"},
                    {"const": "value3", "title": "Third Option"}]},
                "legacyEnum": {"type": "string", "description": "Legacy titled enum",
                               "enum": ["opt1", "opt2", "opt3"],
                               "enumNames": ["Option One", "Option Two", "Option Three"]},
                "untitledMulti": {"type": "array", "description": "Untitled multi-select",
                                  "items": {"type": "string", "enum": ["option1", "option2", "option3"]}},
                "titledMulti": {"type": "array", "description": "Titled multi-select", "items": {"anyOf": [
                    {"const": "value1", "title": "First Choice"},
                    {"const": "value2", "title": "Second Choice"},
                    {"const": "value3", "title": "Third Choice"}]}},
            },
            "required": [],
        }, related_request_id=ctx.request_id)
        return f"Elicitation completed: action={result.action}, content={json.dumps(result.content)}"

    @mcp.tool(description="Closes its SSE stream mid-call; the result arrives after the client resumes")
    async def test_reconnection(ctx: Context) -> str:
        await asyncio.sleep(0.1)
        await ctx.close_sse_stream()
        await asyncio.sleep(0.2)
        return "Reconnection test completed successfully"

    @mcp.tool(description="Tool with JSON Schema 2020-12 features")
    def json_schema_2020_12_tool(name: str | None = None, address: dict[str, Any] | None = None) -> str:
        return f"name={name} address={json.dumps(address)}"

    tool = mcp._tool_manager.get_tool("json_schema_2020_12_tool")
    assert tool is not None
    tool.parameters = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "$defs": {"address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}}}},
        "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"}},
        "additionalProperties": False,
    }

    # -- resources ------------------------------------------------------------------------------

    @mcp.resource("test://static-text", name="static-text", description="A static text resource",
                  mime_type="text/plain")
    def static_text() -> str:
        return "This is the content of the static text resource."

    @mcp.resource("test://static-binary", name="static-binary", description="A static binary resource",
                  mime_type="image/png")
    def static_binary() -> bytes:
        return base64.b64decode(RED_PIXEL_PNG)

    @mcp.resource("test://watched-resource", name="watched-resource",
                  description="A resource clients can subscribe to", mime_type="text/plain")
    def watched_resource() -> str:
        return "Watched resource content."

    @mcp.resource("test://template/{id}/data", name="template-data",
                  description="A resource template with an id parameter", mime_type="application/json")
    def template_data(id: str) -> str:
        return json.dumps({"id": id, "templateTest": True, "data": f"Data for ID: {id}"})

    subscriptions: set[str] = set()

    async def subscribe(ctx: Any, params: SubscribeRequestParams) -> EmptyResult:
        subscriptions.add(str(params.uri))
        return EmptyResult()

    async def unsubscribe(ctx: Any, params: UnsubscribeRequestParams) -> EmptyResult:
        subscriptions.discard(str(params.uri))
        return EmptyResult()

    async def set_level(ctx: Any, params: SetLevelRequestParams) -> EmptyResult:
        return EmptyResult()

    mcp._lowlevel_server.add_request_handler("resources/subscribe", SubscribeRequestParams, subscribe)
    mcp._lowlevel_server.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, unsubscribe)
    mcp._lowlevel_server.add_request_handler("logging/setLevel", SetLevelRequestParams, set_level)

    # -- prompts --------------------------------------------------------------------------------

    @mcp.prompt(description="A simple prompt without arguments")
    def test_simple_prompt() -> str:
        return "This is a simple prompt for testing."

    @mcp.prompt(description="A prompt with two required arguments")
    def test_prompt_with_arguments(arg1: str, arg2: str) -> str:
        return f"Prompt with arguments: arg1='{arg1}', arg2='{arg2}'"

    @mcp.prompt(description="A prompt that embeds a resource")
    def test_prompt_with_embedded_resource(resourceUri: str) -> list[Message]:
        return [
            UserMessage(content=EmbeddedResource(type="resource", resource=TextResourceContents(
                uri=resourceUri, mime_type="text/plain", text="Embedded resource content for testing."))),
            UserMessage(content=TextContent(type="text", text="Please process the embedded resource above.")),
        ]

    @mcp.prompt(description="A prompt with image content")
    def test_prompt_with_image() -> list[Message]:
        return [
            UserMessage(content=ImageContent(type="image", data=RED_PIXEL_PNG, mime_type="image/png")),
            UserMessage(content=TextContent(type="text", text="Please analyze the image above.")),
        ]

    # -- completion -----------------------------------------------------------------------------

    @mcp.completion()
    async def complete(ref: Any, argument: Any, context: Any) -> Completion:
        candidates = ["paris", "park", "party", "test", "testValue1", "testValue2"]
        values = [v for v in candidates if v.startswith(argument.value or "")]
        return Completion(values=values, total=len(values), has_more=False)

    return mcp


def pin_protocol_version(version: str) -> None:
    """Make `initialize` negotiate `version` whatever the client asks for (a server may answer
    with another revision it supports; the client then speaks that one)."""
    from mcp.server import runner
    from mcp.types import InitializeRequestParams

    def negotiate(params: Any) -> tuple[InitializeRequestParams, str]:
        return InitializeRequestParams.model_validate(params or {}, by_name=False), version

    runner.ServerRunner._negotiate_initialize = staticmethod(negotiate)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--stdio", action="store_true",
                        help="serve on stdin/stdout instead (a stdio upstream of the proxy)")
    parser.add_argument("--protocol-version", default=None,
                        help="pin the negotiated protocol revision (e.g. 2025-06-18)")
    args = parser.parse_args()
    if args.protocol_version:
        pin_protocol_version(args.protocol_version)
    mcp = build_server()
    mcp.settings.log_level = "WARNING"
    if args.stdio:
        mcp.run("stdio")
        return
    if args.port is None:
        parser.error("--port is required (or --stdio)")
    mcp.run("streamable-http", host=args.host, port=args.port, json_response=False,
            stateless_http=False, event_store=InMemoryEventStore(), retry_interval=500)


if __name__ == "__main__":
    main()
