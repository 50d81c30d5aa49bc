"""proxy/fronts/headers.py: which fields a `Connection` names, which it may not, and underscores."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.fronts.headers import (
    connection_refusal,
    layered,
    nominated,
    protected,
    underscored,
)


def _headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def test_every_connection_header_and_token_is_read_case_insensitively() -> None:
    headers = _headers(("Connection", "Keep-Alive,  X-Foo ,"), ("connection", "x-BAR"))
    assert nominated(headers) == {"x-foo", "x-bar"}  # options and hop-by-hop fields go anyway
    assert nominated(_headers(("X-Foo", "1"))) == frozenset()
    assert nominated(_headers(("Connection", "Keep-Alive"))) == frozenset()


def _refusal(connection: str) -> str | None:
    return connection_refusal(nominated(_headers(("Connection", connection))))


def test_naming_a_field_the_proxy_reads_or_sets_is_refused_and_options_are_not() -> None:
    assert _refusal("keep-alive, close, upgrade, te, x-foo") is None
    for name in ("Authorization", "mcp-session-id", "Mcp-Param-Region", "X-Envelope-Run",
                 "x-forwarded-for", "Host", "traceparent"):
        reason = _refusal(f"keep-alive, {name}")
        assert reason is not None and name.lower() in reason
    assert "more than 10" in (_refusal(", ".join(f"x-{i}" for i in range(11))) or "")
    assert protected("x-envelope-intent") and not protected("x-kept")


def test_an_underscore_is_found_in_any_field_name_only() -> None:
    assert underscored([(b"Host", b"a_b"), (b"X-Run", b"x_y")]) is None
    assert underscored([(b"Host", b"h"), (b"X_Envelope_Run", b"r")]) == "X_Envelope_Run"


def test_a_later_layer_replaces_a_field_of_any_case_and_keeps_the_rest() -> None:
    # The agent's forwarded Authorization and header parameter, then the upstream's own headers:
    # one field per name reaches the upstream, the configured one, in the case it was written.
    merged = layered({"Accept": "application/json", "Authorization": "Bearer agent"},
                     {"X-Tag": "agent"},
                     {"authorization": "Bearer proxy", "x-tag": "proxy"})
    assert merged == {"Accept": "application/json", "authorization": "Bearer proxy", "x-tag": "proxy"}
