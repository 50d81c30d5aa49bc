"""Upstream URLs as the admin listener shows them, and the names its Host check accepts."""

from __future__ import annotations

import pytest

from proxy.admin.protect import REDACTED, admin_hosts, strip_credentials


@pytest.mark.parametrize(("url", "shown"), [
    ("http://user:pa55@example.com:8443/mcp", "http://example.com:8443/mcp"),
    ("https://tok@example.com/mcp", "https://example.com/mcp"),
    ("http://[::1]:9000/mcp", "http://[::1]:9000/mcp"),
    ("https://u:p@[fe80::1]/mcp", "https://[fe80::1]/mcp"),
    ("https://api.example/mcp?api_key=abc&region=eu",
     f"https://api.example/mcp?api_key={REDACTED}&region=eu"),
    ("https://api.example/mcp?access_token=a&Secret=b&password=c&x-amz-signature=d",
     f"https://api.example/mcp?access_token={REDACTED}&Secret={REDACTED}&password={REDACTED}"
     f"&x-amz-signature={REDACTED}"),
    ("https://api.example/mcp#access_token=abc", "https://api.example/mcp"),
    ("http://127.0.0.1:8001/mcp", "http://127.0.0.1:8001/mcp"),
])
def test_credentials_are_stripped(url: str, shown: str) -> None:
    assert strip_credentials(url) == shown
    for secret in ("pa55", "tok@", "abc", "u:p"):
        assert secret not in (strip_credentials(url) or "")


def test_an_unparsable_url_is_hidden_whole() -> None:
    assert strip_credentials("http://u:p@example.com:notaport/mcp") == REDACTED
    assert strip_credentials(None) is None


def test_admin_hosts() -> None:
    assert admin_hosts("0.0.0.0", []) == {"127.0.0.1", "localhost", "::1"}
    assert admin_hosts("::", ["[fd00::5]", "Ops.Example"]) >= {"fd00::5", "ops.example"}
    assert "10.1.2.3" in admin_hosts("10.1.2.3", [])
