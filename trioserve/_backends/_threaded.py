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

__all__ = ["AbortFlag", "Emit", "Infer", "ThreadedBackend"]

Emit = Callable[[bytes], None]
Infer = Callable[[PreparedPrompt, Emit, Callable[[], bool], GenerationProgress], GenerationEnd]


class AbortFlag:
    """The ``aborted`` that :meth:`ThreadedBackend.run_in_thread` hands ``infer``: call
    it (one attribute read), or :meth:`wait` on it — a paced producer's step, woken at
    once by an abort."""

    __slots__ = ("_channel",)

    def __init__(self, channel: PieceChannel) -> None:
        self._channel = channel

    def __call__(self) -> bool:
        return self._channel.aborted

    def wait(self, seconds: float) -> bool:
        """Block up to ``seconds`` or until the abort; whether aborted."""
        return self._channel.wait_aborted(seconds)


async def _abort_on_cancel(channel: PieceChannel) -> None:
    try:
        await trio.sleep_forever()
    finally:
        channel.abort()


class ThreadedBackend(Backend):
    """Base for backends whose inference blocks: see :meth:`run_in_thread`.

    Its generations' threads come from a limiter of its own, sized to its slots
    (admission already bounds them there), never Trio's default one: that one holds 40
    threads for every ``to_thread`` of the process — a body decoded off the loop, a
    render, a tokenization — and 40 streams would take them all (the 41st stream would
    wait for a thread its slot had already promised it)."""

    _thread_limiter: trio.CapacityLimiter | None = None

    def _generation_threads(self) -> trio.CapacityLimiter:
        limiter = self._thread_limiter
        if limiter is None:
            limiter = self._thread_limiter = trio.CapacityLimiter(max(1, self.slots))
        elif limiter.total_tokens != max(1, self.slots):
            limiter.total_tokens = max(1, self.slots)
        return limiter

    async def run_in_thread(
        self, infer: Infer, prompt: PreparedPrompt, channel: PieceChannel, progress: GenerationProgress
    ) -> GenerationEnd:
        """Run ``infer(prompt, emit, aborted, progress)`` in a worker thread.

        Cancellation: not abandoned. A cancel sets the channel's abort flag, which
        ``emit`` and ``aborted()`` see; this returns (or raises the cancel) only once
        ``infer`` has returned.
        """

        aborted = AbortFlag(channel)

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
                result = await trio.to_thread.run_sync(in_thread, limiter=self._generation_threads())
                nursery.cancel_scope.cancel()
        # a cancel that caused the abort has been raised by the nursery above
        if result == "aborted":
            await trio.lowlevel.checkpoint_if_cancelled()
            raise BackendError("inference was aborted, but the request was not cancelled")
        return result
