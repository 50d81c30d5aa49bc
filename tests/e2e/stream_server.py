"""An official-SDK MCP server that exercises the streaming parts of the protocol.

Tools (every one is declared `effect: read` by the tests' policy):

- `progress(n, interval, tag)`: sends `n` progress notifications `interval` seconds apart, then
  returns. The send time of the last notification is written to `<state>/progress-last-<tag>`.
- `log_messages(n)`: sends `n` logging notifications (`notifications/message`), then returns.
- `sample(prompt)`: asks the client's LLM (`sampling/createMessage`; an `input_required` round
  trip on 2026-07-28) and returns what the client answered.
- `elicit(question)`: asks the client for input (`elicitation/create`, or `input_required`)
  and returns the client's answer.
- `big(size)`: returns a deterministic text of `size` bytes (see `big_text`).
- `slow(seconds, tag)`: sleeps; a cancellation it observes is recorded in
  `<state>/cancelled-<tag>` and its start in `<state>/started-<tag>`.
- `broadcast(text)`: a logging notification not related to the call (legacy: it goes to the
  standalone GET stream).
- prompt `progress_prompt(n, interval)`: reports progress like `progress`, then returns a
  prompt (a stream the proxy relays without inspecting it).
- `counts()`: the cancellations and closed response streams observed so far.

The ASGI app is wrapped so that a closed response stream (the ASGI `http.disconnect` message
while a POST's response is still running) is recorded in `<state>/disconnects` as one line per
disconnect. `--event-store` keeps every SSE event in memory, so clients can resume with
`Last-Event-ID`.

Run: `python tests/e2e/stream_server.py --port P --state DIR [--mode sse|json|stateless]
[--event-store]`.
"""

import argparse
import asyncio
import hashlib
import itertools
import time
from pathlib import Path
from typing import Annotated, Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve, Sample
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp_types import CreateMessageResult, SamplingMessage, TextContent
from pydantic import BaseModel


def big_text(size: int) -> str:
    """`size` bytes of printable ASCII that differ along the text (so truncation shows)."""
    line = "".join(chr(33 + (i % 90)) for i in range(99)) + "\n"
    out = []
    n = 0
    for i in itertools.count():
        chunk = f"{i:08d}:" + line
        out.append(chunk)
        n += len(chunk)
        if n >= size:
            break
    return "".join(out)[:size]


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class MemoryEventStore(EventStore):
    """Every event kept in memory, ids `<stream>:<n>` (unique across streams)."""

    def __init__(self) -> None:
        self.events: list[tuple[StreamId, EventId, Any]] = []
        self.counter = itertools.count(1)

    async def store_event(self, stream_id: StreamId, message: Any) -> EventId:
        event_id = f"{stream_id}:{next(self.counter)}"
        self.events.append((stream_id, event_id, message))
        return event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        index = next((i for i, (_, eid, _) in enumerate(self.events) if eid == last_event_id), None)
        if index is None:
            return None
        stream_id = self.events[index][0]
        for sid, eid, message in self.events[index + 1:]:
            if sid == stream_id and message is not None:
                await send_callback(EventMessage(message, eid))
        return stream_id


class Answer(BaseModel):
    answer: str


def ask_llm(prompt: str) -> Sample:
    return Sample([SamplingMessage(role="user", content=TextContent(type="text", text=prompt))],
                  max_tokens=50)


def ask_user(question: str) -> Elicit[Answer]:
    return Elicit(question, Answer)


def build_server(state: Path) -> MCPServer:
    server = MCPServer("stream-fixture")

    def mark(name: str, text: str = "1") -> None:
        with open(state / name, "a") as f:
            f.write(text + "\n")

    @server.tool()
    async def progress(ctx: Context, n: int = 5, interval: float = 0.5, tag: str = "p") -> str:
        """Send n progress notifications interval seconds apart."""
        for i in range(n):
            if i:
                await asyncio.sleep(interval)
            await ctx.report_progress(i + 1, n, f"step {i + 1}")
            if i == n - 1:
                (state / f"progress-last-{tag}").write_text(repr(time.time()))
        return f"progressed {n}"

    @server.tool()
    async def log_messages(ctx: Context, n: int = 3) -> str:
        """Send n logging notifications."""
        for i in range(n):
            await ctx.log("info", f"log line {i + 1}", logger_name="fixture")
        return f"logged {n}"

    @server.tool()
    async def sample(prompt: str, reply: Annotated[CreateMessageResult, Resolve(ask_llm)]) -> str:
        """Ask the client's LLM and return its answer."""
        content = reply.content
        text = content.text if isinstance(content, TextContent) else repr(content)
        return f"sampled: {text} (model {reply.model})"

    @server.tool()
    async def elicit(question: str, answer: Annotated[Answer, Resolve(ask_user)]) -> str:
        """Ask the client for input and return it."""
        return f"elicited: {answer.answer}"

    @server.tool()
    async def big(size: int = 10 * 1024 * 1024) -> str:
        """A deterministic text of size bytes."""
        return big_text(size)

    @server.tool()
    async def slow(ctx: Context, seconds: float = 30.0, tag: str = "s") -> str:
        """Sleep; records cancellations. One progress notification first (when the caller asked
        for progress), so the response stream starts at once."""
        await ctx.report_progress(0, None, "started")
        mark(f"started-{tag}", repr(time.time()))
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            mark(f"cancelled-{tag}", repr(time.time()))
            raise
        mark(f"finished-{tag}", repr(time.time()))
        return f"slept {seconds}"

    @server.prompt()
    async def progress_prompt(ctx: Context, n: str = "4", interval: str = "0.4") -> str:
        """A prompt that reports progress first (a relayed, not inspected, SSE stream)."""
        count = int(n)
        for i in range(count):
            if i:
                await asyncio.sleep(float(interval))
            await ctx.report_progress(i + 1, count, f"step {i + 1}")
        return f"prompt after {count} steps"

    @server.tool()
    async def broadcast(ctx: Context, text: str) -> str:
        """Send a logging notification unrelated to this request (legacy: on the GET stream)."""
        await ctx.session.send_log_message(level="info", data=text, logger="broadcast")
        return "sent"

    @server.tool()
    async def counts() -> dict[str, int]:
        """Cancellations and closed response streams observed so far."""
        cancelled = sum(len(p.read_text().splitlines()) for p in state.glob("cancelled-*"))  # noqa: ASYNC240 (tiny test files)
        path = state / "disconnects"
        disconnects = len(path.read_text().splitlines()) if path.exists() else 0
        return {"cancelled": cancelled, "disconnects": disconnects}

    return server


class DisconnectRecorder:
    """ASGI middleware: a POST whose client goes away while its response runs is recorded."""

    def __init__(self, app: Any, state: Path):
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        done = False

        async def recording_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and not done:
                with open(self.state / "disconnects", "a") as f:  # noqa: ASYNC230
                    f.write(f"{time.time()!r}\n")
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal done
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        try:
            await self.app(scope, recording_receive, tracking_send)
        finally:
            done = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--mode", choices=["sse", "json", "stateless"], default="sse")
    parser.add_argument("--event-store", action="store_true")
    args = parser.parse_args()
    args.state.mkdir(parents=True, exist_ok=True)
    import uvicorn

    app = build_server(args.state).streamable_http_app(
        json_response=args.mode == "json", stateless_http=args.mode == "stateless",
        event_store=MemoryEventStore() if args.event_store else None, host=args.host,
        retry_interval=100 if args.event_store else None,
    )
    uvicorn.run(DisconnectRecorder(app, args.state), host=args.host, port=args.port,
                log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()


# ---- for the tests -----------------------------------------------------------------------------


class StreamUpstream:
    """A running fixture server (see `stream_upstream`)."""

    def __init__(self, url: str, state: Path, proc: Any):
        self.url = url
        self.state = state
        self.proc = proc

    def lines(self, name: str) -> list[str]:
        path = self.state / name
        return path.read_text().splitlines() if path.exists() else []

    def disconnects(self) -> int:
        return len(self.lines("disconnects"))


def stream_upstream(state: Path, mode: str = "sse", event_store: bool = True) -> Any:
    """Context manager: run this file as a server process on a free loopback port."""
    import contextlib
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.harness import free_port, stop, wait_port

    @contextlib.contextmanager
    def run() -> Any:
        port = free_port()
        state.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--state", str(state),
               "--mode", mode, *(["--event-store"] if event_store else [])]
        with open(state / "server.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_port(port, proc)
            yield StreamUpstream(f"http://127.0.0.1:{port}/mcp", state, proc)
        finally:
            stop(proc)

    return run()
