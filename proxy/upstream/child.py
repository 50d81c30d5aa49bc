"""One stdio server process: started with a minimal environment in its own process group, read
line by line (one JSON-RPC message a line; a line past the cap or not JSON marks it broken and
kills it), its stderr logged line by line with bounds, stopped in order (stdin closed, SIGTERM,
SIGKILL). `proxy/upstream/stdio.py` pools these behind the loopback endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

log = logging.getLogger("envelope.stdio")

# The environment a child inherits from the proxy; everything else comes from `env`.
INHERITED_ENV = ("PATH", "HOME", "LANG")
# One stderr line in the proxy log at most this long (the rest is cut, said so).
STDERR_LINE_BYTES = 4096
# At most this many stderr lines a second per child reach the log (a chatty or looping child
# must not drown the proxy's own log); the rest are counted.
STDERR_LINES_PER_SECOND = 100
# Close: how long a child has after its stdin closed, then after SIGTERM.
CLOSE_GRACE = 2.0
# What one call's stream may hold unread of the child's messages before its reply (progress,
# logging, server requests): past it they are dropped (`Waiter.offer`), so a child flooding a
# call whose client reads slowly costs this much memory, not all of it. The reply always passes.
MAX_QUEUED_BYTES = 8 * 2**20


@dataclass(frozen=True, slots=True)
class StdioSpec:
    """How to run one command upstream."""

    name: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    max_processes: int = 16
    idle_timeout: float = 300.0
    # Session children one principal may hold at once; None: half of `max_processes`, rounded
    # up (`per_principal`).
    max_processes_per_principal: int | None = None

    @property
    def per_principal(self) -> int:
        """Session children one principal may hold at once (never more than the pool)."""
        share = self.max_processes_per_principal or -(-self.max_processes // 2)
        return min(share, self.max_processes)


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: PATH, HOME and LANG of the proxy plus `extra` (never the proxy's
    other variables: they may hold its credentials)."""
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    env.update(extra)
    return env


class ChildGone(Exception):
    """The child process is not running (exited, broken, or being restarted)."""


@dataclass(eq=False, slots=True)
class Waiter:
    """One caller's request in flight on a child: where its stream's messages go.

    `None` (`get`): the child is gone, the stream ends without a reply."""

    reply_id: Any  # the id the caller used (restored on the reply)
    progress: Any = None  # the caller's progress token, when remapped
    done: bool = False
    queue: asyncio.Queue[tuple[dict[str, Any] | None, int]] = field(default_factory=asyncio.Queue)
    queued: int = 0  # bytes (as the child wrote them) held unread
    dropped: int = 0

    def put(self, message: dict[str, Any] | None, size: int = 0) -> None:
        """Hold `message` (a reply, or None) whatever is held already."""
        self.queued += size
        self.queue.put_nowait((message, size))

    def offer(self, message: dict[str, Any], size: int) -> bool:
        """Hold a message that is not the reply, unless what is held unread would pass
        MAX_QUEUED_BYTES (one message alone always fits); False: dropped."""
        if self.queued and self.queued + size > MAX_QUEUED_BYTES:
            self.dropped += 1
            return False
        self.put(message, size)
        return True

    async def get(self) -> dict[str, Any] | None:
        message, size = await self.queue.get()
        self.queued -= size
        return message


class Child:
    """One stdio server process: a reader of its stdout and stderr, a writer to its stdin.

    `on_message(child, msg, size)` receives every message that is not a reply to a pending
    request (`size`: its line's bytes); `on_exit(child, reason)` runs once when it ends, after
    every waiter got `None`."""

    def __init__(self, spec: StdioSpec, max_line_bytes: int,
                 on_message: Callable[[Child, dict[str, Any], int], None],
                 on_exit: Callable[[Child, str], None]):
        self.spec = spec
        self.max_line_bytes = max_line_bytes
        self.on_message = on_message
        self.on_exit = on_exit
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[str, Waiter] = {}
        self.alive = False
        self.broken: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._write_lock = asyncio.Lock()
        # Messages of the child no caller could receive, and replies to no pending request:
        # logged at 1, 2, 4, 8, ... (a child writing millions must not flood the log).
        self.unroutable = 0
        self.stray = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def start(self) -> None:
        """Start the process; ChildGone with the reason when it cannot be started."""
        spec = self.spec
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *spec.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=child_env(dict(spec.env)), cwd=spec.cwd,
                # Its own process group: shutdown reaches the grandchildren too, and a ^C at the
                # proxy's terminal does not kill children before the proxy closes them in order.
                start_new_session=True,
                limit=self.max_line_bytes + 1,
            )
        except OSError as exc:
            raise ChildGone(f"cannot start {spec.command[0]!r}: {exc.strerror or exc}") from exc
        self.alive = True
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read(), name=f"stdio-{spec.name}-out"),
                       loop.create_task(self._stderr(), name=f"stdio-{spec.name}-err")]

    async def send(self, message: Mapping[str, Any]) -> None:
        """Write one message as one line; ChildGone when the child cannot take it."""
        proc = self.proc
        if not self.alive or proc is None or proc.stdin is None:
            raise ChildGone(self.broken or "the process is not running")
        line = orjson.dumps(message) + b"\n"
        async with self._write_lock:
            try:
                proc.stdin.write(line)
                await proc.stdin.drain()
            except (ConnectionError, RuntimeError) as exc:
                raise ChildGone(f"its stdin is closed: {exc}") from exc

    def register(self, key: str, waiter: Waiter) -> None:
        self.pending[key] = waiter

    def forget(self, key: str) -> None:
        self.pending.pop(key, None)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        reason = "exited"
        try:
            while True:
                try:
                    line = await stdout.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    reason = f"wrote a line past {self.max_line_bytes} bytes"
                    self.broken = reason
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    message = orjson.loads(line)
                except orjson.JSONDecodeError:
                    reason = "wrote a line that is not JSON"
                    self.broken = reason
                    break
                if not isinstance(message, dict):
                    reason = "wrote a line that is not one JSON-RPC message"
                    self.broken = reason
                    break
                self._dispatch(message, len(line))
        finally:
            self.alive = False
            if self.broken is not None:
                log.error("stdio upstream %s: child %s %s: stopping it", self.spec.name,
                          self.pid, self.broken)
                self._signal(signal.SIGKILL)
            code = await self._wait(CLOSE_GRACE)
            if code is None:
                # Its stdout is closed but it runs on: of no use, and it would outlive its slot.
                self._signal(signal.SIGKILL)
                await self._wait(CLOSE_GRACE)
            if self.broken is None:
                reason = f"exited with code {code}" if code is not None else "closed its stdout"
            for waiter in list(self.pending.values()):
                waiter.put(None)
            self.pending.clear()
            self.on_exit(self, reason)

    def _dispatch(self, message: dict[str, Any], size: int) -> None:
        if "method" not in message and "id" in message:
            waiter = self.pending.pop(key_of(message.get("id")), None)
            if waiter is not None:
                waiter.put(message, size)
                return
            self.stray += 1
            if log_due(self.stray):
                log.info("stdio upstream %s: child %s dropped a reply to no pending request (%d "
                         "so far)", self.spec.name, self.pid, self.stray)
            return
        self.on_message(self, message, size)

    async def _stderr(self) -> None:
        """Log the child's stderr line by line: each line capped at STDERR_LINE_BYTES (the rest
        of a longer line is skipped up to its newline), at most STDERR_LINES_PER_SECOND lines a
        second (the lines past it are counted, and the count logged)."""
        assert self.proc is not None and self.proc.stderr is not None
        stderr = self.proc.stderr
        buffer = b""
        skipping = 0  # bytes of an over-long line skipped so far
        window, logged, dropped = time.monotonic(), 0, 0
        while True:
            chunk = await stderr.read(65536)
            if not chunk:
                break
            buffer += chunk
            lines: list[tuple[bytes, int]] = []
            while True:
                end = buffer.find(b"\n")
                if end < 0:
                    break
                line, buffer = buffer[:end], buffer[end + 1:]
                if skipping:
                    skipping = 0  # the end of a line already logged in part
                    continue
                lines.append((line[:STDERR_LINE_BYTES], max(0, len(line) - STDERR_LINE_BYTES)))
            if not skipping and len(buffer) > STDERR_LINE_BYTES:
                lines.append((buffer[:STDERR_LINE_BYTES], len(buffer) - STDERR_LINE_BYTES))
                skipping, buffer = len(buffer), b""
            elif skipping:
                skipping += len(buffer)
                buffer = b""
            for line, cut in lines:
                now = time.monotonic()
                if now - window >= 1.0:
                    if dropped:
                        log.warning("stdio upstream %s [%s]: %d stderr lines not logged (more "
                                    "than %d a second)", self.spec.name, self.pid, dropped,
                                    STDERR_LINES_PER_SECOND)
                    window, logged, dropped = now, 0, 0
                if logged >= STDERR_LINES_PER_SECOND:
                    dropped += 1
                    continue
                logged += 1
                self._log_stderr(line, cut)
        if buffer and not skipping:
            self._log_stderr(buffer[:STDERR_LINE_BYTES], max(0, len(buffer) - STDERR_LINE_BYTES))
        if dropped:
            log.warning("stdio upstream %s [%s]: %d stderr lines not logged (more than %d a "
                        "second)", self.spec.name, self.pid, dropped, STDERR_LINES_PER_SECOND)

    def _log_stderr(self, line: bytes, cut: int) -> None:
        text = line.decode("utf-8", "replace").rstrip()
        if cut:
            text += " [... the rest of the line not logged]"
        if text:
            log.info("stdio upstream %s [%s] stderr: %s", self.spec.name, self.pid, text)

    def _signal(self, sig: int) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    async def _wait(self, seconds: float) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        try:
            async with asyncio.timeout(seconds):
                return await proc.wait()
        except TimeoutError:
            return None

    async def close(self, grace: float = CLOSE_GRACE) -> None:
        """Close stdin, wait `grace`, then SIGTERM, wait, then SIGKILL (the process group)."""
        proc = self.proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        if proc.returncode is None and await self._wait(grace) is None:
            self._signal(signal.SIGTERM)
            if await self._wait(grace) is None:
                self._signal(signal.SIGKILL)
                await self._wait(grace)
        # The group may outlive its leader (a grandchild that ignored stdin closing).
        self._signal(signal.SIGKILL)
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, grace)


def log_due(count: int) -> bool:
    """Whether the `count`-th occurrence of a repeated event is logged (1, 2, 4, 8, ...)."""
    return count & (count - 1) == 0


def key_of(rpc_id: Any) -> str:
    """A pending-map key for a JSON-RPC id (1 and "1" are different ids)."""
    return orjson.dumps(rpc_id).decode()
