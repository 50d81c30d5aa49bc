"""PolicyWatcher: calls back on a file change and on a git-sync style symlink swap."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from proxy.policy.reload import RELOAD_SWITCH_INTERVAL, PolicyWatcher, responsive_loop


async def _wait(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), timeout=5)
    event.clear()


async def test_watcher_sees_a_changed_file_and_survives_callback_errors(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("version: 1\n")
    changed = asyncio.Event()
    calls = 0

    async def on_change() -> None:
        nonlocal calls
        calls += 1
        changed.set()
        if calls == 1:
            raise RuntimeError("a bad reload must not stop the watcher")

    watcher = PolicyWatcher(tmp_path, on_change, interval=0.02)
    watcher.start()
    try:
        await asyncio.sleep(0.1)
        assert calls == 0  # nothing changed yet
        (tmp_path / "a.yaml").write_text("version: 1\ntools: {}\n")
        await _wait(changed)
        (tmp_path / "b.yml").write_text("version: 1\n")
        await _wait(changed)
        assert calls == 2
    finally:
        await watcher.stop()


async def test_watcher_sees_a_symlink_swap(tmp_path: Path) -> None:
    for rev in ("rev1", "rev2"):
        (tmp_path / rev).mkdir()
        (tmp_path / rev / "a.yaml").write_text("version: 1\n")
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "rev1")
    changed = asyncio.Event()

    async def on_change() -> None:
        changed.set()

    watcher = PolicyWatcher(link, on_change, interval=0.02)
    watcher.start()
    try:
        await asyncio.sleep(0.1)
        assert not changed.is_set()
        # git-sync: make a new link and rename it over the old one (atomic swap)
        tmp = tmp_path / "current.tmp"
        tmp.symlink_to(tmp_path / "rev2")
        os.replace(tmp, link)
        await _wait(changed)
    finally:
        await watcher.stop()


def test_responsive_loop_shortens_the_switch_interval_and_puts_it_back() -> None:
    before = sys.getswitchinterval()
    assert before > RELOAD_SWITCH_INTERVAL  # the interpreter's default, 5 ms
    with pytest.raises(RuntimeError), responsive_loop():
        assert sys.getswitchinterval() == pytest.approx(RELOAD_SWITCH_INTERVAL)
        raise RuntimeError("a failed reload")
    assert sys.getswitchinterval() == before
