"""Runtime wiring that needs no listener: the CEL engine chosen once and kept across reloads; a
reload's chain built off the event loop, and the old one kept when that fails."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.app.runtime import Runtime
from proxy.config import load_config
from proxy.envelope.pipeline import Chain
from proxy.envelope.types import Principal, RequestInfo, RunContext, ToolCall, Verdict
from proxy.policy.cel import available_engines
from proxy.policy.compiled import PolicyRevision
from proxy.policy.reload import RELOAD_NICE

POLICY = """
version: 1
upstreams: {demo: {url: "http://127.0.0.1:9/mcp"}}
tools:
  demo.t: {effect: write, allow: 'principal.id == "ops"'}
"""


def _runtime(tmp_path: Path, **settings: object) -> Runtime:
    """A runtime over POLICY (cel-python, memory store) with `settings` added to its config."""
    if "cel-python" not in available_engines():
        pytest.skip("cel-python is not installed")
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "policy.yaml").write_text(POLICY)
    return Runtime(load_config(None, {
        "policies": str(tmp_path / "policies"), "state_dir": str(tmp_path / "state"),
        "store": {"kind": "memory"}, "cel_engine": "cel-python", **settings,
    }, environ={}))


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    rt = _runtime(tmp_path)
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


def _call(principal: str) -> ToolCall:
    return ToolCall(decision_id="d-1", upstream="demo", tool="t", arguments={},
                    principal=Principal(principal), run=RunContext("run-1", principal),
                    request=RequestInfo("tools/call"))


async def _verdict(runtime: Runtime, principal: str) -> Verdict:
    return (await runtime.envelope.begin(_call(principal))).decision.verdict


def _reloads(runtime: Runtime, result: str) -> float:
    value = runtime.metrics.registry.get_sample_value("envelope_policy_reloads_total",
                                                      {"result": result})
    return value or 0.0


async def test_calls_after_a_reload_use_the_chain_built_off_the_event_loop(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime.load_policy()
    assert await _verdict(runtime, "ops") is Verdict.ALLOW
    built: list[tuple[Chain, int]] = []
    build = runtime.envelope.build

    def recording(revision: PolicyRevision) -> Chain:
        chain = build(revision)
        built.append((chain, threading.get_ident()))
        return chain

    monkeypatch.setattr(runtime.envelope, "build", recording)
    (runtime.config.policies / "policy.yaml").write_text(POLICY.replace('"ops"', '"admin"'))
    assert await runtime.reload("test")
    [(chain, thread)] = built
    assert thread != threading.get_ident()  # built in the reload's worker thread
    assert runtime.envelope.chain is chain and chain.revision is runtime.revision
    assert await _verdict(runtime, "admin") is Verdict.ALLOW
    assert await _verdict(runtime, "ops") is Verdict.DENY


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority: Linux")
async def test_a_reload_loads_at_a_lower_cpu_priority_than_the_event_loop(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Back-to-back reloads keep a core busy: the scheduler serves the loop's calls first.
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    runtime.load_policy()
    seen: list[int] = []
    prepare = runtime._prepare

    def recording(engine: Any) -> Any:
        seen.append(nice())
        return prepare(engine)

    monkeypatch.setattr(runtime, "_prepare", recording)
    for admin in ("admin", "root"):
        (runtime.config.policies / "policy.yaml").write_text(POLICY.replace('"ops"', f'"{admin}"'))
        assert await runtime.reload("test")
    assert seen == [min(19, nice() + RELOAD_NICE)] * 2
    assert await _verdict(runtime, "root") is Verdict.ALLOW


async def test_a_reload_that_fails_building_its_chain_keeps_the_old_revision_serving(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first = runtime.load_policy()
    serving = runtime.envelope.chain

    def broken(revision: PolicyRevision) -> Chain:
        raise RuntimeError("the chain could not be built")

    monkeypatch.setattr(runtime.envelope, "build", broken)
    (runtime.config.policies / "policy.yaml").write_text(POLICY.replace('"ops"', '"admin"'))
    assert not await runtime.reload("test")
    assert runtime.revision is first and runtime.envelope.chain is serving
    assert runtime.last_reload["result"] == "failure"
    assert "the chain could not be built" in runtime.last_reload["errors"][0]
    assert _reloads(runtime, "failure") == 1 and _reloads(runtime, "success") == 0
    assert "policy reload failed unexpectedly" in caplog.text
    assert await _verdict(runtime, "ops") is Verdict.ALLOW
    assert await _verdict(runtime, "admin") is Verdict.DENY


async def test_an_edit_made_while_the_process_starts_is_reloaded(tmp_path: Path) -> None:
    # Between the start-up load and the watcher's first scan, listeners are already accepting:
    # an edit made then must not become the watcher's baseline (it would never be loaded).
    runtime = _runtime(tmp_path, listen="127.0.0.1:0", reload_interval=0.05)
    first = runtime.load_policy()
    (runtime.config.policies / "policy.yaml").write_text(POLICY.replace('"ops"', '"admin"'))
    await runtime.start(admin=False)
    try:
        for _ in range(600):  # up to 30 s on a loaded machine
            if runtime.revision is not first:
                break
            await asyncio.sleep(0.05)
        assert runtime.revision is not first and runtime.last_reload["trigger"] == "change"
        assert await _verdict(runtime, "admin") is Verdict.ALLOW
    finally:
        await runtime.stop(quiet=True)
