"""Fixtures shared by the envelope check tests."""

from __future__ import annotations

import pytest
from envelope_helpers import ENGINES

from proxy.envelope.tools import ToolRegistry


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param
