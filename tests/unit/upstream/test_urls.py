"""Upstream URLs as the proxy shows them: no credentials, whatever the URL holds."""

from __future__ import annotations

import pytest

from proxy.upstream.urls import REDACTED, scrub, strip_credentials


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


def test_scrub_removes_the_credentials_of_the_url_wherever_they_are_quoted() -> None:
    url = "https://bot:s3cr3tpw@api.example/mcp?access_token=t0k3nval&region=eu"
    text = (f"request to {url} failed; connecting as bot:s3cr3tpw@api.example; "
            "token t0k3nval rejected")
    scrubbed = scrub(text, url)
    assert "s3cr3tpw" not in scrubbed and "t0k3nval" not in scrubbed, scrubbed
    assert "https://api.example/mcp?access_token=REDACTED&region=eu" in scrubbed
    assert scrub("timed out", url) == "timed out"
    assert scrub("bad url", "http://u:p@h:notaport/") == "bad url"
