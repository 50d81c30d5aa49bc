"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest
from e2e_helpers import upstream_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def sse_upstream():
    """One SDK notes server answering POSTs with SSE streams, shared by the whole session."""
    with upstream_server("sse") as up:
        yield up
