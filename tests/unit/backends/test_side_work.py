"""CPU-heavy side work in niced threads of its own (trioserve/_backends/_side_work.py)."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from trioserve._backends._side_work import SIDE_WORK_NICE, run_side_work


def _own_nice() -> tuple[str, int]:
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_side_work_runs_in_a_niced_thread_of_its_own() -> None:
    name, nice = await run_side_work(_own_nice)
    assert name.startswith("trioserve-side")
    assert nice == max(SIDE_WORK_NICE, os.getpriority(os.PRIO_PROCESS, 0))
    # Trio's own worker threads keep the process's priority
    assert (await trio.to_thread.run_sync(_own_nice))[1] == os.getpriority(os.PRIO_PROCESS, 0)


async def test_side_work_raises_its_own_error() -> None:
    def fail() -> None:
        raise ValueError("from the side")

    with pytest.raises(ValueError, match="from the side"):
        await run_side_work(fail)


async def test_a_cancelled_caller_waits_for_its_side_work_to_return() -> None:
    started, release, returned = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        release.wait(10)
        returned.set()

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_side_work, work)
            await trio.to_thread.run_sync(started.wait)
            scope.cancel()
            release.set()
    # the cancel took effect only once the work had returned: nothing outlives the caller
    assert returned.is_set()
