"""Runtime wiring that needs no listener: the CEL engine chosen once and kept across reloads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.app.runtime import Runtime
from proxy.config import load_config
from proxy.policy.cel import available_engines

POLICY = """
version: 1
upstreams: {demo: {url: "http://127.0.0.1:9/mcp"}}
tools:
  demo.t: {effect: write, allow: 'principal.id == "ops"'}
"""


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    if "cel-python" not in available_engines():
        pytest.skip("cel-python is not installed")
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "policy.yaml").write_text(POLICY)
    config = load_config(None, {
        "policies": str(tmp_path / "policies"), "state_dir": str(tmp_path / "state"),
        "store": {"kind": "memory"}, "cel_engine": "cel-python",
    }, environ={})
    rt = Runtime(config)
    try:
        yield rt
    finally:
        rt.audit.close()


async def test_reloads_compile_with_the_engine_the_first_load_resolved(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = runtime.load_policy()
    assert first.engine == "cel-python" and runtime.cel is first.cel
    # The environment is read once, by the config: changing it later changes nothing.
    monkeypatch.setenv("ENVELOPE_CEL_ENGINE", "cel-cpp")
    (runtime.config.policies / "policy.yaml").write_text(POLICY.replace('"ops"', '"admin"'))
    assert await runtime.reload("test")
    second = runtime.revision
    assert second is not None and second.revision != first.revision
    assert second.cel is first.cel and second.engine == "cel-python"
