"""CPU-heavy work beside inference, at a lower CPU priority.

Counting the tokens of a 3.5 MiB body (``/v1/messages/count_tokens``), or tokenizing it
(``/tokenize``), takes a core for about 2 s here; in a thread of normal priority it
takes that core from the streams decoding beside it (measured: a bystander stream at
0.51× its rate beside the same request made small, ``benchmarks/hostile.py``). Such work
runs in threads of its own, niced (:data:`SIDE_WORK_NICE`, Linux: a thread's own nice
value), so that the scheduler gives the cores to inference first and the side work the
rest. A thread's nice value cannot be lowered again without privileges, so these are
never Trio's cached worker threads (which later run inference's own work).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable

import trio

__all__ = ["SIDE_WORK_NICE", "run_side_work"]

logger = logging.getLogger("trioserve.backend")

#: the nice value of side-work threads (0 to 19; 10 weighs about a tenth of a thread at 0)
SIDE_WORK_NICE = 10
#: side-work threads at once (more wait their turn, in order)
_WORKERS = 2


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SIDE_WORK_NICE)
    except (AttributeError, OSError):  # pragma: no cover - not Linux: normal priority
        logger.debug("side-work threads run at normal priority on this platform")


_executor = concurrent.futures.ThreadPoolExecutor(
    _WORKERS, thread_name_prefix="trioserve-side", initializer=_lower_priority
)


async def run_side_work[T](fn: Callable[[], T]) -> T:
    """Run ``fn`` in a niced side-work thread and return its result (or raise its error).

    Cancellation: the caller waits for ``fn`` to return (shielded): what it reads — a
    model's vocabulary — must outlive it, and the caller's lease ensures that."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    future = _executor.submit(fn)

    def finished(_: concurrent.futures.Future[T]) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # (the run ended meanwhile)
            token.run_sync_soon(done.set)

    future.add_done_callback(finished)
    with trio.CancelScope(shield=True):
        await done.wait()
    return future.result()
