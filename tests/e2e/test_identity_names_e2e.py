"""Principal and group ids through the real proxy: a JWT whose principal (or a group) reads as
another name (a zero-width or bidi character in it, a space at its end) or is huge is refused 401
before any check, as a token the proxy cannot verify is: counted `unauthenticated`, no call
audited, the upstream never asked. Such a token was taken as it is, its principal another name
than the one it reads as (so `alice\\u200b` could approve alice's calls), kept in every audit record
and store key whatever its size. The 401 names the character escaped, never itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_helpers import write_policy
from fake_upstream import FakeUpstream, fake_upstream

from tests.harness import ProxyProcess, metric_value, proxy_process, rpc, token

ECHO = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"text": "hi"}}}


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, FakeUpstream]]:
    tmp = tmp_path_factory.mktemp("names")
    with fake_upstream() as fake:
        policies = write_policy(tmp / "policies", {"counted": {}}, tools={"notes.echo": {"effect": "read"}},
                                principals={})
        with proxy_process(tmp, {"counted": fake.url}, policies=policies) as pp:
            yield pp, fake


@pytest.mark.parametrize(("sub", "groups", "said"), [
    ("alice\u200b", [], r"principal claim 'sub': 'alice\u200b' is not a usable id: it holds U+200B"),
    ("\u202eecila", [], r"principal claim 'sub': '\u202eecila' is not a usable id: it holds U+202E"),
    ("alice ", [], "principal claim 'sub': 'alice ' is not a usable id: it has whitespace at its"),
    ("a" * 300, [], "(first 64 of 300 characters) is not a usable id: it has 300 characters"),
    ("alice", ["dev", "ops\u2066"], r"groups claim 'groups': 'ops\u2066' is not a usable id"),
], ids=["zero-width", "bidi", "trailing space", "300 characters", "a group"])
def test_a_token_naming_a_principal_that_is_not_an_id_is_refused_401_before_the_upstream(
        counted: tuple[ProxyProcess, FakeUpstream], sub: str, groups: list[str], said: str) -> None:
    pp, fake = counted
    before = len(pp.audit_records())
    rejected = metric_value(pp.metrics(), "envelope_rejected_requests_total", reason="unauthenticated")
    resp = rpc(pp.url("counted"), ECHO, bearer=token(sub, groups))
    assert resp.status_code == 401, resp.text
    assert resp.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'
    message = resp.json()["error"]["message"]
    assert message.startswith("Unauthorized: ") and said in message, message
    assert resp.content.isascii() and len(message) < 500  # escaped and cut: never the raw claim
    assert fake.attempts["echo"] == 0  # the upstream never saw it
    assert len(pp.audit_records()) == before  # no call was decided
    assert metric_value(pp.metrics(), "envelope_rejected_requests_total",
                        reason="unauthenticated") == rejected + 1


def test_the_same_names_written_plainly_are_served(counted: tuple[ProxyProcess, FakeUpstream]) -> None:
    pp, fake = counted
    before = fake.calls["echo"]
    for sub, groups in (("alice", ["dev", "ops"]), ("Jos\u00e9 Garc\u00eda", []), ("a" * 256, [])):
        resp = rpc(pp.url("counted"), ECHO, bearer=token(sub, groups))
        assert resp.status_code == 200 and resp.json()["result"]["isError"] is False, resp.text
    assert fake.calls["echo"] == before + 3
