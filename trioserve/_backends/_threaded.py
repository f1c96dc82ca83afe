"""Backends whose inference is blocking code run in a Trio worker thread.

:meth:`ThreadedBackend.run_in_thread` runs ``infer(prompt, emit, aborted, progress)``
under ``trio.to_thread.run_sync`` *without* ``abandon_on_cancel``: a cancelled request
waits for its thread to return, so nothing outlives it. ``emit`` is the channel's
``put_wait`` (blocks while full, raises :class:`~trioserve._core._channel.Aborted` once
the request is torn down); ``aborted()`` reads one flag, cheap enough to call every
millisecond. The thread only *reports* an abort: the Trio side raises the request's own
``Cancelled``, and an abort without a cancel is a :class:`BackendError`
(``docs/cancellation.md``, design rule 2).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import trio

from .._core._backend import Backend, GenerationProgress, PreparedPrompt
from .._core._channel import Aborted, PieceChannel
from .._core._errors import unwrap_group
from .._core._exceptions import BackendError
from .._core._types import GenerationEnd

__all__ = ["Emit", "Infer", "ThreadedBackend"]

Emit = Callable[[bytes], None]
Infer = Callable[[PreparedPrompt, Emit, Callable[[], bool], GenerationProgress], GenerationEnd]


async def _abort_on_cancel(channel: PieceChannel) -> None:
    try:
        await trio.sleep_forever()
    finally:
        channel.abort()


class ThreadedBackend(Backend):
    """Base for backends whose inference blocks: see :meth:`run_in_thread`."""

    async def run_in_thread(
        self, infer: Infer, prompt: PreparedPrompt, channel: PieceChannel, progress: GenerationProgress
    ) -> GenerationEnd:
        """Run ``infer(prompt, emit, aborted, progress)`` in a worker thread.

        Cancellation: not abandoned. A cancel sets the channel's abort flag, which
        ``emit`` and ``aborted()`` see; this returns (or raises the cancel) only once
        ``infer`` has returned.
        """

        def aborted() -> bool:
            return channel.aborted

        def in_thread() -> GenerationEnd | Literal["aborted"]:
            with self.generations:
                try:
                    return infer(prompt, channel.put_wait, aborted, progress)
                except Aborted:
                    return "aborted"
                finally:
                    progress.inference_ended = time.perf_counter()

        with unwrap_group():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_abort_on_cancel, channel)
                result = await trio.to_thread.run_sync(in_thread)
                nursery.cancel_scope.cancel()
        # a cancel that caused the abort has been raised by the nursery above
        if result == "aborted":
            await trio.lowlevel.checkpoint_if_cancelled()
            raise BackendError("inference was aborted, but the request was not cancelled")
        return result
