"""Hot reload: poll a policy directory's fingerprint and call back when it changes.

Polling (not inotify) because git-sync swaps a symlink atomically and container volumes do not
always deliver events; a stat of a few dozen files a second costs nothing.

A file written in place (an editor, `cp`, a test's `write_text`) is truncated, then written:
read in between, a policy file can be empty or cut after any line, and a YAML file cut short
is often still valid (a `rules:` list missing its last forbid rules). So a change is loaded
only once the directory has held still for a moment (`PolicyWatcher`), and a load counts only
when the directory's fingerprint is the same after it as before it (`load_stable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

from proxy.errors import PolicyError, PolicyProblem
from proxy.policy.loader import collector_paused, policy_tree

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a changed directory must hold still before it is loaded, and how many times in a row it may change under the watcher or under a load
# before the watcher loads it anyway / the load gives up (a directory rewritten without pause).
SETTLE_SECONDS = 0.2
SETTLE_ROUNDS = 10
LOAD_ATTEMPTS = 3

# The GIL switch interval while a reload compiles in a worker thread. By default a thread that
# holds the GIL is asked to drop it only after 5 ms, and the event loop needs it back after
# every socket wait (four or more per call): with a reload running, calls' p99 rose from 1.8 to
# 24 ms (bench/policy_load.py --traffic). At 0.5 ms the loop gets it back ten times sooner.
RELOAD_SWITCH_INTERVAL = 0.0005


@contextlib.contextmanager
def responsive_loop(interval: float = RELOAD_SWITCH_INTERVAL) -> Iterator[None]:
    """Shorten the GIL switch interval for the duration (a reload in a worker thread), then put
    back what it was. Process-wide: the caller runs one reload at a time."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, interval))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)

# How much nicer than the event loop's the reload thread's CPU priority is. Back-to-back reloads
# keep one core busy (a 1,000-tool policy in one file: ~0.5 s of CPU a reload) while the loop,
# its clients and its upstreams share the other: at the same priority, calls' p99 during reloads
# was 2.6-3.4x the steady p99; with the reload thread at +10, 2.1-2.4x, and the reload takes
# longer instead (bench/RESULTS.md, "Policy load at scale", round 5 (reload)).
RELOAD_NICE = 10


def lower_priority(increment: int = RELOAD_NICE) -> None:
    """Make the calling thread's CPU priority `increment` lower (its nice value up, at most 19),
    for good: the thread must be one that only reloads. Linux only (elsewhere a thread's id is
    not a process id `setpriority` may take); where it is refused, nothing changes."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread,
                       min(19, os.getpriority(os.PRIO_PROCESS, thread) + increment))
    except OSError as exc:
        log.info("policy reload: the reload thread keeps the loop's priority (%s)", exc)


# A process that froze its policy out of the cyclic collector freezes each reloaded revision too,
# and every this many reloads sweeps: everything unfrozen for one full collection (see
# `Collector`).
SWEEP_RELOADS = 100


class Collector:
    """The cyclic collector around hot reloads, once `freeze()` has put the serving policy out
    of its sight (`serve`: ~700,000 objects for 1,000 tools).

    A reloaded revision left to the collector is traversed again and again: the young
    collection at the end of each load (5-30 ms in the reload thread, holding the GIL) and,
    every few reloads, a full collection over every revision object not frozen (80-440 ms for
    1,000 tools, on whichever thread allocates next): the longest stalls of calls during
    back-to-back reloads (bench/RESULTS.md "Policy load at scale", round 4). So `loading()`
    pauses the collector while a reload loads and builds its chain, then freezes all it made.

    What that keeps for good is cyclic garbage frozen with it: measured over 30 reloads of a
    1,000-tool policy, ~46 objects a reload (the load's own short-lived cycles, and cached
    entries evicted later; none of the revisions replaced), against ~27,000 objects a one-file
    reload keeps alive. To keep that bounded, every `sweep_every` reloads the next one starts
    with a sweep: everything unfrozen, a full collection (0.6-1.8 s for 1.36 million objects, in
    the reload thread), everything alive frozen again. The trigger is a count because the
    frozen set's size is not: `gc.get_freeze_count()` walks the list, 0.2-0.35 s for 1.3
    million objects holding the GIL (it stalled the loop at the start of every reload).
    """

    def __init__(self, sweep_every: int = SWEEP_RELOADS) -> None:
        self.sweep_every = sweep_every
        self.frozen = False
        self.sweeps = 0
        self._reloads = 0  # frozen since the last sweep

    def freeze(self, collect: bool = True) -> None:
        """Collect everything, then freeze all that is alive (the policy just loaded). Without
        `collect`, only freeze: the start-up load already froze what it made (`load_policy`'s
        `freeze`), and a full collection would traverse it all again (~0.5 s for 1,000 tools)."""
        if collect:
            gc.unfreeze()
            gc.collect()
        gc.freeze()
        self.frozen = True
        self._reloads = 0

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Around one reload's load and chain build (in its worker thread, one at a time): no
        collection while it runs, then what it made is frozen. A load that raises leaves its
        garbage to one young collection here, as `load_policy` does, and freezes nothing."""
        if not self.frozen:
            yield
            return
        if self._reloads >= self.sweep_every:
            started = time.perf_counter()
            self.freeze()
            self.sweeps += 1
            log.info("policy reload: swept the objects frozen by the last %d reloads (%.2f s)",
                     self.sweep_every, time.perf_counter() - started)
        with collector_paused(freeze=True):  # frozen only if the reload loaded
            yield
        self._reloads += 1


Fingerprint = tuple[tuple[str, int, int], ...]


def fingerprint(directory: Path) -> Fingerprint:
    """(relative path, size, mtime_ns) of every YAML file, following symlinks; (relative path,
    -1, -errno) for one that cannot be stat'ed or is a directory (`loader.policy_files`)."""
    root = Path(os.path.realpath(directory))
    out = []
    for path, kind in policy_tree(root):
        rel = path.relative_to(root).as_posix()
        if kind == "directory":  # a directory named like a policy file: the load refuses it
            out.append((rel, -1, -errno.EISDIR))
            continue
        if kind == "loop":  # a directory link back to where it is: the load refuses it
            out.append((rel, -1, -errno.ELOOP))
            continue
        try:
            st = path.stat()
        except OSError as exc:
            # Unreadable (a symlink loop, a dangling link) is still a policy file: the load
            # reports it (`cannot read`), so its coming and going is a change to reload.
            out.append((rel, -1, -(exc.errno or 0)))
            continue
        out.append((rel, st.st_size, st.st_mtime_ns))
    # The resolved root is part of the fingerprint: a symlink swap to an identical tree with
    # identical mtimes still counts as a change.
    return ((str(root), 0, 0), *sorted(out))


def load_stable(directory: Path, load: Callable[[Path], T], attempts: int = LOAD_ATTEMPTS) -> T:
    """`load(directory)`, accepted only when no policy file changed while it ran (same
    fingerprint before and after); tried again otherwise, up to `attempts` times. Raises
    `PolicyError` when the directory never held still (the caller keeps its revision)."""
    return load_stable_at(directory, load, attempts)[0]


def load_stable_at(
    directory: Path, load: Callable[[Path], T], attempts: int = LOAD_ATTEMPTS
) -> tuple[T, Fingerprint]:
    """`load_stable`, with the fingerprint of the files it loaded (a watcher started later
    compares against it, so an edit made in between is not taken for the baseline)."""
    for _ in range(attempts):
        before = fingerprint(directory)
        result = load(directory)
        if fingerprint(directory) == before:
            return result, before
        log.info("policy files changed while %s was loading; loading again", directory)
    raise PolicyError([PolicyProblem(str(directory), 1, 1,
                                     f"the policy files changed during each of {attempts} loads; "
                                     "not loaded (write them with a rename, or pause between writes)")])


class PolicyWatcher:
    """Calls `on_change()` whenever the policy directory's fingerprint changes and has then
    held still for `settle` seconds (a file written in place is seen whole, not cut short).

    Errors from `on_change` are logged and the watcher keeps going; `stop()` cancels the task.
    """

    def __init__(
        self,
        directory: Path,
        on_change: Callable[[], Awaitable[None]],
        interval: float = 1.0,
        settle: float = SETTLE_SECONDS,
    ) -> None:
        self.directory = Path(directory)
        self.interval = interval
        self.settle = settle
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self._last: Fingerprint | None = None

    def start(self, baseline: Fingerprint | None = None) -> None:
        """Start polling from `baseline` (the fingerprint of the files the serving revision was
        loaded from: a change since then is reloaded), else from the directory as it is now."""
        if self._task is not None:
            return
        self._last = baseline if baseline is not None else self._safe_fingerprint()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="policy-watcher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _settled(self, current: Fingerprint) -> Fingerprint | None:
        """The fingerprint once two scans `settle` seconds apart agree (at most SETTLE_ROUNDS
        waits: a directory that never holds still is loaded as it is then)."""
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(self.settle)
            again = await asyncio.to_thread(self._safe_fingerprint)
            if again == current:
                return current
            if again is None:
                return None
            current = again
        return current

    def _safe_fingerprint(self) -> Fingerprint | None:
        try:
            return fingerprint(self.directory)
        except OSError as exc:
            log.warning("policy watcher: cannot scan %s: %s", self.directory, exc)
            return None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            current = await asyncio.to_thread(self._safe_fingerprint)
            if current is None or current == self._last:
                continue
            current = await self._settled(current)
            if current is None or current == self._last:
                continue
            self._last = current
            try:
                await self._on_change()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("policy watcher: reload callback failed")
