"""`proxy.store.base.bounded`: a store deadline that cancels only the operation it awaits, so a
call's completion that starts in the caller's task and goes on in its own
(`proxy.envelope.outcome._resume`) times out there, and the caller is never cancelled."""

from __future__ import annotations

import asyncio

import pytest

from proxy.envelope.outcome import _resume
from proxy.store.base import bounded


async def _completion(hang: float) -> str:
    """What a completion does with a store call that hangs: its timeout is a refusal."""
    try:
        await bounded(asyncio.sleep(hang), asyncio.get_running_loop().time() + 0.05)
    except TimeoutError:
        return "store timed out: refused and audited"
    return "answered"


async def test_the_result_within_the_deadline() -> None:
    assert await bounded(asyncio.sleep(0, "done"), asyncio.get_running_loop().time() + 5) == "done"


async def test_a_deadline_met_in_a_completion_that_moved_to_its_own_task() -> None:
    async def caller() -> str:
        coro = _completion(10)
        waiting = coro.send(None)  # started eagerly in the caller's task, as `complete` does
        task = asyncio.get_running_loop().create_task(_resume(coro, waiting))
        return await asyncio.shield(task)

    # With `asyncio.timeout` the deadline cancelled the caller's task (the client got no reply)
    # and left the completion waiting; with `_resume` letting a cancelled future's error out, the
    # completion task died before its record.
    assert await asyncio.wait_for(caller(), 5) == "store timed out: refused and audited"


async def test_the_callers_cancellation_still_cancels() -> None:
    task = asyncio.get_running_loop().create_task(
        bounded(asyncio.sleep(10), asyncio.get_running_loop().time() + 5))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
