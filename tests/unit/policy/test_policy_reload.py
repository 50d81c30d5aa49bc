"""PolicyWatcher: calls back on a file change and on a git-sync style symlink swap; the
collector around a reload (`Collector`)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.errors import PolicyError
from proxy.policy.reload import (
    RELOAD_SWITCH_INTERVAL,
    Collector,
    PolicyWatcher,
    load_stable,
    lower_priority,
    responsive_loop,
)


async def _wait(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), timeout=30)  # generous: a loaded CI machine
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


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority: Linux")
def test_lower_priority_lowers_the_calling_threads_priority_only() -> None:
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = nice()
    seen: list[int] = []

    def reload_thread() -> None:
        lower_priority(5)
        seen.append(nice())

    worker = threading.Thread(target=reload_thread)
    worker.start()
    worker.join()
    assert seen == [min(19, before + 5)]
    assert nice() == before  # the caller (the event loop's thread) keeps its priority


def test_responsive_loop_shortens_the_switch_interval_and_puts_it_back() -> None:
    before = sys.getswitchinterval()
    assert before > RELOAD_SWITCH_INTERVAL  # the interpreter's default, 5 ms
    with pytest.raises(RuntimeError), responsive_loop():
        assert sys.getswitchinterval() == pytest.approx(RELOAD_SWITCH_INTERVAL)
        raise RuntimeError("a failed reload")
    assert sys.getswitchinterval() == before


async def test_a_file_written_in_place_is_loaded_whole_not_cut_short(tmp_path: Path) -> None:
    # An in-place write truncates first: a poll between truncate and write sees an empty file
    # (a valid, empty policy). The watcher waits for the directory to hold still, so the one
    # callback sees the finished file.
    path = tmp_path / "a.yaml"
    path.write_text("version: 1\n")
    seen: list[str] = []
    changed = asyncio.Event()

    async def on_change() -> None:
        seen.append(path.read_text())
        changed.set()

    watcher = PolicyWatcher(tmp_path, on_change, interval=0.02)
    watcher.start()
    try:
        await asyncio.sleep(0.1)
        path.write_text("")  # truncated ...
        await asyncio.sleep(0.06)  # ... and polled (three polls) before the rest is written
        path.write_text("version: 1\ntools: {}\n")
        await _wait(changed)
        await asyncio.sleep(0.1)
        assert seen == ["version: 1\ntools: {}\n"]
    finally:
        await watcher.stop()


def test_a_load_that_overlaps_a_write_is_done_again(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("version: 1\n")
    loads: list[str] = []

    def load(directory: Path) -> str:
        text = (directory / "a.yaml").read_text()
        loads.append(text)
        if len(loads) == 1:  # a writer finishes while the first load runs
            path.write_text("version: 1\ntools: {}\n")
        return text

    assert load_stable(tmp_path, load) == "version: 1\ntools: {}\n"
    assert loads == ["version: 1\n", "version: 1\ntools: {}\n"]


def test_a_directory_that_never_holds_still_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("version: 1\n")

    def load(directory: Path) -> None:
        path.write_text(path.read_text() + "#\n")  # every load overlaps another write

    with pytest.raises(PolicyError, match="changed during each of 3 loads"):
        load_stable(tmp_path, load)


class _Node:
    """A cyclic object the collector alone can free (weak-referenceable, to see it go)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector() -> Iterator[Collector]:
    # The freeze is process-wide: whatever a test froze is unfrozen for the next one.
    enabled = gc.isenabled()
    try:
        yield Collector()
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def test_a_reload_is_not_collected_while_it_loads_then_frozen(collector: Collector) -> None:
    with collector.loading():  # nothing frozen yet (a process that never froze): no effect
        assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    collector.freeze()
    frozen = gc.get_freeze_count()
    with collector.loading():
        assert not gc.isenabled()  # no collection over the load's allocations
        made = [_Node() for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + 1000  # the new revision is out of sight too
    seen = {id(o) for o in gc.get_objects()}
    assert not any(id(n) in seen for n in made)


def test_a_failed_load_freezes_nothing_and_leaves_its_cycles_to_the_collector(
    collector: Collector,
) -> None:
    collector.freeze()
    frozen = gc.get_freeze_count()
    with pytest.raises(RuntimeError), collector.loading():
        garbage = weakref.ref(_Node())
        raise RuntimeError("a reload that fails mid-way")
    assert gc.isenabled()
    assert gc.get_freeze_count() <= frozen
    assert garbage() is None  # the young collection after the failure freed the cycle


def test_frozen_garbage_is_swept_every_so_many_reloads(collector: Collector) -> None:
    collector.sweep_every = 2
    collector.freeze()
    with collector.loading():
        leaked = weakref.ref(_Node())  # cyclic garbage made during a load: frozen with it
    with collector.loading():
        pass
    assert leaked() is not None and collector.sweeps == 0
    with collector.loading():  # the third reload starts with a sweep
        assert leaked() is None
    assert collector.sweeps == 1 and gc.isenabled() and gc.get_freeze_count() > 0


def test_the_start_up_freeze_after_a_frozen_load_traverses_nothing(collector: Collector) -> None:
    # `serve`: the start-up load froze what it made (`load_policy(freeze=True)`), so the
    # collector takes over without a full collection; reloads are then frozen as usual.
    garbage = weakref.ref(_Node())  # a cycle no collection has seen
    collector.freeze(collect=False)
    assert collector.frozen
    assert garbage() is not None  # frozen, not collected: nothing was traversed
    with collector.loading():
        assert not gc.isenabled()
    collector.freeze()  # the sweep's form unfreezes and collects everything
    assert garbage() is None
