"""Stdio upstream pieces that need no process: the models' one-of rule, the child's
environment, the restart backoff."""

from __future__ import annotations

import socket
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

def _workers(n: int, secret: str = "shared") -> list[Any]:
    """The stdio endpoints of `n` workers of one serve (sockets bound as their supervisor does)."""
    from proxy.upstream.stdio import Siblings, StdioUpstreams

    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = frozenset(sock.getsockname()[1] for sock in socks)
    return [StdioUpstreams(siblings=Siblings(secret, sock, ports)) for sock in socks]


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


async def test_a_session_of_a_worker_gone_is_not_found() -> None:
    import httpx

    from proxy.upstream.child import StdioSpec
    from proxy.upstream.stdio import SECRET_HEADER

    here, gone = _workers(2)
    sid = gone._session_id()
    await gone.close()  # its port no longer answers
    here.configure({"fix": StdioSpec("fix", ("server",))})
    await here.start()
    try:
        async with httpx.AsyncClient() as client:
            headers = {SECRET_HEADER: here.secret, "Mcp-Session-Id": sid}
            post = await client.post(here.url("fix"), headers=headers,
                                     json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            get = await client.get(here.url("fix"), headers=headers)
            wrong = await client.post(here.url("fix"), headers={**headers, SECRET_HEADER: "guess"},
                                      json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert post.status_code == 404 and post.json()["error"]["message"] == "Session not found"
        assert get.status_code == 404
        assert wrong.status_code == 403  # the secret first, as for any request
    finally:
        await here.close()
