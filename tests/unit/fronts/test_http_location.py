"""A backend's `Location` as the plain HTTP front relays it: through the proxy, or not at all."""

from __future__ import annotations

import pytest

from proxy.fronts.http_front import _location

BASE = "http://billing.internal:8080/api"
SENT = "http://billing.internal:8080/api/invoices"


@pytest.mark.parametrize(("value", "expected"), [
    ("/api/invoices/7", "/http/billing/invoices/7"),
    ("invoices/7", "/http/billing/invoices/7"),  # relative to the request's URL
    ("http://billing.internal:8080/api/invoices/7?view=full", "/http/billing/invoices/7?view=full"),
    ("/api", "/http/billing/"),
    ("http://evil.example/api/invoices/7", None),  # another host
    ("https://billing.internal:8080/api/x", None),  # another scheme is another origin
    ("/apix/invoices/7", None),  # outside the upstream's base path
    ("/other", None),
    ("//evil.example/api/x", None),  # scheme-relative: another host
])
def test_location_goes_through_the_proxy_or_is_dropped(value: str, expected: str | None) -> None:
    assert _location(value, SENT, BASE, "/http/billing") == expected
