"""Stdio upstream pieces that need no process: the models' one-of rule, the child's
environment, the restart backoff."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.config import UpstreamOverride
from proxy.policy.model import Upstream
from proxy.upstream.child import StdioSpec, child_env
from proxy.upstream.stdio import _backoff, command_upstream


@pytest.mark.parametrize("model", [Upstream, UpstreamOverride])
def test_exactly_one_of_url_or_command(model: type[Upstream] | type[UpstreamOverride]) -> None:
    assert model.model_validate({"url": "http://127.0.0.1:9/mcp"}).command is None
    up = model.model_validate({"command": ["server", "--flag"], "idle_timeout": "1m"})
    assert (up.url, up.command, up.idle_timeout, up.max_processes, up.env, up.cwd) == (
        None, ["server", "--flag"], 60.0, 16, {}, None)
    for bad in ({}, {"url": "http://127.0.0.1:9/mcp", "command": ["server"]}):
        with pytest.raises(ValidationError, match="exactly one of 'url' or 'command'"):
            model.model_validate(bad)
    for empty in ([], [""]):
        with pytest.raises(ValidationError, match="must name a program"):
            model.model_validate({"command": empty})
    with pytest.raises(ValidationError):
        model.model_validate({"command": ["server"], "max_processes": 0})


@pytest.mark.parametrize(("pool", "given", "share"), [
    (16, None, 8), (5, None, 3), (1, None, 1), (4, 4, 4), (4, 9, 4), (16, 2, 2)])
def test_a_principals_share_is_half_the_pool_unless_given(pool: int, given: int | None,
                                                          share: int) -> None:
    assert StdioSpec("s", ("server",), max_processes=pool,
                     max_processes_per_principal=given).per_principal == share


def test_command_upstream_is_what_the_stdio_front_serves() -> None:
    up = command_upstream(["npx", "server"], {"TOKEN": "t"}, "/srv")
    assert (up.url, up.command, up.env, up.cwd) == (None, ["npx", "server"], {"TOKEN": "t"}, "/srv")


def test_child_env_inherits_only_path_home_and_lang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/bin")
    monkeypatch.setenv("HOME", "/home/me")
    monkeypatch.delenv("LANG", raising=False)
    monkeypatch.setenv("ENVELOPE_ADMIN_TOKEN", "secret")  # the proxy's own credentials stay home
    assert child_env({"EXTRA": "1", "PATH": "/opt/bin"}) == {
        "PATH": "/opt/bin", "HOME": "/home/me", "EXTRA": "1"}


def test_backoff_doubles_up_to_thirty_seconds() -> None:
    assert [_backoff(n) for n in (1, 2, 3, 4)] == [0.25, 0.5, 1.0, 2.0]
    assert _backoff(20) == 30.0


# ---- sessions another worker holds ---------------------------------------------------------

def _workers(n: int, secret: str = "shared", forwarder: Any = None) -> list[Any]:
    """The stdio endpoints of `n` workers of one serve (sockets bound as their supervisor does)."""
    from proxy.upstream.forwarder import Forwarder
    from proxy.upstream.stdio import Siblings, StdioUpstreams

    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = frozenset(sock.getsockname()[1] for sock in socks)
    forwarder = forwarder or Forwarder()
    return [StdioUpstreams(siblings=Siblings(secret, sock, ports), forwarder=forwarder) for sock in socks]


async def test_only_a_session_id_an_endpoint_of_this_serve_made_names_its_worker() -> None:
    from proxy.upstream.stdio import StdioUpstreams

    here, there = _workers(2)
    [stranger] = _workers(1, "another serve")  # a serve of its own: knows neither
    alone = StdioUpstreams()  # one worker: nothing is looked for elsewhere
    try:
        theirs = there._session_id()
        assert here._peer(theirs) == there.port
        assert here._peer(here._session_id()) is None  # its own: ended here, not elsewhere
        assert stranger._peer(theirs) is None and alone._peer(theirs) is None
        port, rand, tag = theirs.split(".")
        # A client cannot point the endpoint (and its secret) at a port of its choosing: not
        # with a forged tag, nor with a tag the serve made for a port that is not a worker's.
        [outsider] = _workers(1)
        made_elsewhere = outsider._session_id()
        forged = [f"{outsider.port}.{rand}.{tag}", f"{port}.{rand}.{'0' * 32}", made_elsewhere,
                  f"{port}.{rand}", f"{port}..{tag}", "x" * 200, f"-{port}.{rand}.{tag}", ""]
        assert [here._peer(sid) for sid in forged] == [None] * len(forged)
        await outsider.close()
    finally:
        for endpoint in (here, there, stranger, alone):
            await endpoint.close()


async def _sibling_answering(sock: socket.socket, answers: list[bytes]) -> tuple[Any, list[bytes]]:
    """A sibling endpoint on `sock`: each request it reads is answered with the next of
    `answers` (raw bytes), then its connection closed; returns the server and the requests read."""
    import asyncio

    sock.listen()
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(answers[len(heads) - 1])
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, sock=sock), heads


async def _ask(here: Any, sid: str, method: str = "POST", secret: str | None = None) -> Any:
    import httpx

    from proxy.upstream.stdio import SECRET_HEADER

    async with httpx.AsyncClient() as client:
        return await client.request(method, here.url("fix"), headers={
            SECRET_HEADER: secret or here.secret, "Mcp-Session-Id": sid},
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"} if method == "POST" else None)


@contextlib.asynccontextmanager
async def _two_workers() -> AsyncIterator[tuple[Any, Any]]:
    """This worker's endpoint (started, serving upstream `fix`) and its sibling's (not started)."""
    from proxy.upstream.child import StdioSpec
    from proxy.upstream.forwarder import Forwarder

    forwarder = Forwarder()
    await forwarder.start()
    here, there = _workers(2, forwarder=forwarder)
    here.configure({"fix": StdioSpec("fix", ("server",))})
    await here.start()
    try:
        yield here, there
    finally:
        await here.close()
        await there.close()
        await forwarder.close()


async def test_a_session_of_a_worker_gone_is_not_found() -> None:
    async with _two_workers() as (here, gone):
        sid = gone._session_id()
        gone._sock.close()  # its port no longer answers: nothing can be written to it
        post, get = await _ask(here, sid), await _ask(here, sid, "GET")
    assert post.status_code == 404 and post.json()["error"]["message"] == "Session not found"
    assert get.status_code == 404


async def test_a_worker_that_breaks_off_is_a_failed_call_never_a_second_send() -> None:
    event = b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":{}}\n\n'
    partial = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n" % len(event) + event + b"\r\n")
    async with _two_workers() as (here, there):
        server, heads = await _sibling_answering(there._sock, [b"", partial])
        sid = there._session_id()
        # Written, then closed without an answer: 502 (it may have been performed), not 404
        # (which has the client start over as if nothing happened), and never sent again.
        broken = await _ask(here, sid)
        assert len(heads) == 1
        # Cut off mid-answer: what arrived is relayed, then the stream ends (no reply: the
        # front refuses the call as an upstream error, as for a child that exits mid-call).
        cut = await _ask(here, sid)
        server.close()
    assert broken.status_code == 502 and "broke off" in broken.json()["error"]["message"], broken.text
    assert cut.status_code == 200 and cut.text == event.decode()
    assert len(heads) == 2 and all(sid.encode() in head and here.secret.encode() in head for head in heads)


async def test_a_request_to_the_endpoint_without_its_secret_is_refused_first() -> None:
    async with _two_workers() as (here, there):
        server, heads = await _sibling_answering(there._sock, [b""])
        wrong = await _ask(here, there._session_id(), secret="guess")
        server.close()
    assert wrong.status_code == 403 and heads == []  # nothing handed on
