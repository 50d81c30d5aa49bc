"""Stdio upstream pieces that need no process: the models' one-of rule, the child's
environment, the restart backoff."""

from __future__ import annotations

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
