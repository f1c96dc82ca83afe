"""Backends whose inference is blocking code run in a Trio worker thread.

The bridge is deliberately thin:

* the blocking ``infer`` function runs under ``trio.to_thread.run_sync`` *without*
  ``abandon_on_cancel``: a cancelled request waits for its thread to return, so nothing
  outlives the request;
* ``emit(piece)`` is ``trio.from_thread.run(send.send, piece)``: it blocks the thread
  while the consumer is not reading (backpressure), and — because ``from_thread.run``
  inherits the cancel status of the task that started the thread — raises
  ``trio.Cancelled`` the moment the request is cancelled;
* ``abort_check()`` is ``trio.from_thread.check_cancelled()``: no round trip to the
  Trio thread, cheap enough to call between tokens and from llama.cpp's abort callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import trio

from ._base import ActiveThreads, Backend, GenerationProgress, PreparedPrompt

__all__ = ["Emit", "Infer", "ThreadedBackend"]

Emit = Callable[[bytes], None]
Infer = Callable[[PreparedPrompt, Emit, GenerationProgress], Literal["stop", "length"]]


class ThreadedBackend(Backend):
    """Base for backends whose inference blocks: see :meth:`run_in_thread`."""

    def __init__(self) -> None:
        #: inference threads inside a generation right now
        self.active_threads = ActiveThreads()

    async def run_in_thread(
        self,
        infer: Infer,
        prompt: PreparedPrompt,
        send: trio.MemorySendChannel[bytes],
        progress: GenerationProgress,
    ) -> Literal["stop", "length"]:
        """Run ``infer(prompt, emit, progress)`` in a worker thread.

        Cancellation: not abandoned. A cancel reaches ``infer`` through
        ``check_cancelled()`` and ``emit``; this returns only once ``infer`` has.
        """
        send_piece = send.send
        run = trio.from_thread.run

        def emit(piece: bytes) -> None:
            run(send_piece, piece)

        def in_thread() -> Literal["stop", "length"]:
            with self.active_threads:
                try:
                    return infer(prompt, emit, progress)
                finally:
                    progress.inference_ended = time.perf_counter()

        return await trio.to_thread.run_sync(in_thread)
