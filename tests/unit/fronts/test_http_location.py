"""A backend's `Location` as the plain HTTP front relays it: through the proxy, or not at all; and
the backend's headers its `Connection` names, never."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.fronts.http_front import _downstream_headers, _location
from proxy.observability.metrics import Metrics
from tests.harness import metric_value

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


def test_a_relayed_header_the_backend_names_in_connection_is_dropped_and_counted() -> None:
    metrics = Metrics()
    resp = SimpleNamespace(headers=CIMultiDictProxy(CIMultiDict([
        ("Connection", "ETag, Location"), ("ETag", '"v1"'), ("Location", "/api/invoices/7"),
        ("Cache-Control", "no-store"), ("Content-Type", "application/json")])))
    kept = _downstream_headers(SENT, BASE, "/http/billing", metrics)(cast(Any, resp))
    assert dict(kept) == {"Cache-Control": "no-store", "Content-Type": "application/json"}
    assert metric_value(metrics.render()[0].decode(), "envelope_headers_dropped_total",
                        direction="response", reason="connection") == 2
