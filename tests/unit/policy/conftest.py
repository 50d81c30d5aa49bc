from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.policy.cel import available_engines


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write a dedented YAML file under tmp_path/policy and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / "policy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return _write


@pytest.fixture(params=["cel-cpp", "cel-python"])
def engine(request: pytest.FixtureRequest) -> str:
    if request.param not in available_engines():
        pytest.skip(f"{request.param} is not installed")
    return str(request.param)
