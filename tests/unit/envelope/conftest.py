"""Fixtures shared by the envelope check tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from envelope_helpers import ENGINES, native_or_skip

from proxy.envelope.dataflow import fingerprint
from proxy.envelope.tools import ToolRegistry


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["python", "native"])
def token_scan(request: pytest.FixtureRequest,
               monkeypatch: pytest.MonkeyPatch) -> Callable[[str], set[tuple[str, str]]]:
    """Each token scan in turn serving `fingerprint.folded_tokens` (and so `tokens`): the Python
    scans, then the native one (skipped when it is not built, failed under
    ENVELOPE_REQUIRE_NATIVE=1)."""
    scan = fingerprint._python_folded_tokens
    if request.param == "native":
        scan = native_or_skip("_tokens").folded_tokens
    monkeypatch.setattr(fingerprint, "folded_tokens", scan)
    return scan
