"""A raw Redis connection for the one hot read, beside the redis-py client.

A warm sink check makes one store call, `hash_since` (one Lua script). Through redis-py's
asyncio client that call cost ~300-380 µs on this project's benchmark machine, of which the
round trip to the server (a raw `PING`) was ~70-80 µs: the rest is the client's Python (pool
checkout, command packing, retry and timeout wrappers, the stream reader). A `Lane` is one TCP
connection speaking RESP through an `asyncio.Protocol` and hiredis's reader: commands are packed
once, written, and answered in order (pipelined: concurrent callers share it), ~125 µs for the
same script there.

It is only a fast path: it serves plain `redis://` (TCP) servers, and any failure of its own
(a dropped connection, an error reply, a closed loop) is `LaneError`, after which the caller
asks redis-py instead, which reconnects, retries once and maps errors to `StoreError` as for
every other command. The connection is dropped on any failure and made again on the next call.

The lane bounds each call by the caller's deadline itself (`TimeoutError`): one timer per
connection, armed at the earliest deadline of the calls not yet answered, instead of an
`asyncio.timeout` per call (a timer handle pushed on and cancelled off the loop's heap, and the
task's cancellation bookkeeping: ~6 µs of a ~20 µs call on the benchmark machine).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, cast

import hiredis

from proxy.store.base import bounded

# Replies a connection may owe before it counts as hung (timed-out callers' included).
MAX_WAITING = 1024


class LaneError(Exception):
    """The lane could not answer (the caller asks redis-py instead)."""


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        # Callers in the order their commands were written, with their deadlines (loop time).
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's `TCPTransport` is one without subclassing
        # `asyncio.Transport`: no isinstance check here).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data)
            while (reply := self.reader.gets()) is not False:
                if not self.waiting:
                    raise LaneError("a reply nobody asked for")
                waiter, _ = self.waiting.popleft()
                if not waiter.done():  # a caller cancelled or timed out still had its reply read
                    waiter.set_result(reply)
        except (hiredis.ProtocolError, LaneError) as exc:
            self._fail(LaneError(f"unreadable reply: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(LaneError(f"connection lost: {exc or 'closed by the server'}"))

    def watch(self, deadline: float) -> None:
        """Make sure a caller waiting until `deadline` is timed out then."""
        if self.timer is None or deadline < self.timer.when():
            if self.timer is not None:
                self.timer.cancel()
            self.timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        # The callers past their deadline fail; their replies are still read when they come
        # (and dropped), so the connection stays in step.
        self.timer = None
        now = asyncio.get_running_loop().time()
        later: list[float] = []
        for waiter, deadline in self.waiting:
            if waiter.done():
                continue
            if deadline <= now:
                waiter.set_exception(TimeoutError())
            else:
                later.append(deadline)
        if later:
            self.watch(min(later))

    def _fail(self, exc: LaneError) -> None:
        self.lost = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        while self.waiting:
            waiter, _ = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class Lane:
    """One pipelined RESP connection to `host:port` (AUTH and SELECT done when it is made)."""

    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None) -> None:
        self.host, self.port, self.db = host, port, db
        self._auth: tuple[str, ...] = ()
        if password is not None:
            self._auth = ("AUTH", password) if username is None else ("AUTH", username, password)
        self._protocol: _Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Lock | None = None

    async def call(self, *args: str | bytes | int, deadline: float) -> Any:
        """The server's reply to one command. Raises LaneError when the lane cannot answer
        (connection, protocol or error reply), TimeoutError at `deadline` (the loop's time),
        connecting included."""
        protocol = self._protocol
        if protocol is None or protocol.lost or self._loop is not asyncio.get_running_loop():
            protocol = await self._connected(deadline)
        # (hiredis's stub types the argument as a 1-tuple; any tuple of these is packed)
        reply = await self._send(protocol, hiredis.pack_command(args), deadline)  # type: ignore[arg-type]
        if isinstance(reply, hiredis.ReplyError):
            raise LaneError(str(reply))
        return reply

    def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None and self._loop is not None \
                and not self._loop.is_closed():
            protocol.transport.close()

    def _send(self, protocol: _Protocol, packed: bytes, deadline: float) -> asyncio.Future[Any]:
        if len(protocol.waiting) >= MAX_WAITING:
            # A server that stopped answering: the replies owed (also to callers that gave up)
            # are not awaited for ever; the connection goes and the next call makes another.
            protocol.connection_lost(None)
            raise LaneError("too many replies outstanding")
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if protocol.transport is None or protocol.lost:
            raise LaneError("not connected")
        protocol.waiting.append((waiter, deadline))
        protocol.watch(deadline)
        protocol.transport.write(packed)
        return waiter

    async def _connected(self, deadline: float) -> _Protocol:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # Another event loop (a new one in this process): the old connection is not ours.
            self._protocol, self._loop, self._connecting = None, loop, asyncio.Lock()
        protocol = self._protocol
        if protocol is not None and not protocol.lost:
            return protocol
        # `bounded`, not `asyncio.timeout`: the caller may be a call's completion that goes on
        # in another task than the one it started in (`proxy.store.base.bounded`).
        return await bounded(self._connect(loop, deadline), deadline)

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Protocol:
        assert self._connecting is not None
        async with self._connecting:
            if self._protocol is not None and not self._protocol.lost:
                return self._protocol
            self.close()
            try:
                _, made = await loop.create_connection(_Protocol, self.host, self.port)
            except OSError as exc:
                raise LaneError(f"cannot connect: {exc}") from exc
            setup = [self._auth] if self._auth else []
            if self.db:
                setup.append(("SELECT", str(self.db)))
            try:
                for command in setup:
                    packed = hiredis.pack_command(command)  # type: ignore[arg-type]
                    reply = await self._send(made, packed, deadline)
                    if isinstance(reply, hiredis.ReplyError):
                        raise LaneError(f"{command[0]} refused: {reply}")
            except BaseException:  # refused, or the caller's deadline: no half-made lane
                if made.transport is not None:
                    made.transport.close()
                raise
            self._protocol = made
            return made
