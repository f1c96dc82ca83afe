"""The heart: one generation request's life, inside one nursery.

::

    engine.stream(request)                         ← caller's cancel scopes around all of it
      admission.slot()                             queued: a Trio wait, FIFO, bounded
        nursery ──────────────────────────────────────────────────────────────┐
          producer task:  backend.generate(prompt, send)                      │
                            └─ to_thread.run_sync(infer)   token bytes ──┐    │
                               abort callback + check_cancelled()        │    │
          consumer (the caller's body):                    channel (cap 0)    │
            async for event in stream  ◀── receive ◀─────────────────────┘    │
              UTF-8 assembly → stop sequences → TextDelta / Finished          │
        ◀─────────────────────────────────────────────────────────────────────┘
      slot released

Leaving the ``async with`` — normally, by ``break``, by an exception or by a cancel of
any enclosing scope — cancels the producer and waits for its thread to return. So when
``stream()`` has exited, no thread, task or slot of the request is left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

import trio

from ._admission import Admission, Reservation, SlotLease
from ._backends._base import Backend, GenerationProgress, PreparedPrompt
from ._exceptions import BackendError, TrioserveError
from ._text import TextAssembler
from ._types import Finished, GenerationRequest, TextDelta, Usage

__all__ = ["Engine", "EventStream", "StreamTimings"]

logger = logging.getLogger("trioserve.engine")

Event = TextDelta | Finished


@dataclass(kw_only=True, slots=True)
class StreamTimings:
    """Monotonic timestamps (``time.perf_counter``) of one stream's milestones."""

    created: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_seconds(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.created

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.created


class EventStream:
    """The events of one generation: :class:`TextDelta` … then one :class:`Finished`.

    Iterate it with ``async for`` inside ``engine.stream(...)``. Iteration ends after
    the :class:`Finished` event. If the block is left before that, the generation is
    cancelled and torn down when the block exits.
    """

    def __init__(
        self,
        prompt: PreparedPrompt,
        receive: trio.MemoryReceiveChannel[bytes],
        progress: GenerationProgress,
        producer_scope: trio.CancelScope,
        timings: StreamTimings,
    ) -> None:
        self._prompt = prompt
        self._receive = receive
        self._progress = progress
        self._producer_scope = producer_scope
        self._assembler = TextAssembler(prompt.request.stop)
        self._final: Finished | None = None
        self._done = False
        self._stopped_by_sequence = False
        self.timings = timings
        # set by the producer before it closes the channel
        self.backend_result: Literal["stop", "length"] | None = None
        self.backend_error: BaseException | None = None

    @property
    def usage(self) -> Usage:
        """Token usage so far (final once the stream has finished or been torn down)."""
        return Usage(
            prompt_tokens=self._progress.prompt_tokens,
            completion_tokens=self._progress.completion_tokens,
        )

    @property
    def progress(self) -> GenerationProgress:
        return self._progress

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        if self._final is not None:
            final, self._final = self._final, None
            self._done = True
            return final
        if self._done:
            raise StopAsyncIteration
        if self._stopped_by_sequence:
            return await self._finish()
        receive = self._receive.receive
        assembler = self._assembler
        while True:
            try:
                piece = await receive()
            except trio.EndOfChannel:
                return await self._finish()
            text = assembler.feed(piece)
            if assembler.stopped:
                # A stop sequence: the rest of the generation is unwanted. Cancel the
                # producer now; _finish() waits for it to be gone.
                self._stopped_by_sequence = True
                self._producer_scope.cancel()
                if text:
                    return self._delta(text)
                return await self._finish()
            if text:
                return self._delta(text)

    def _delta(self, text: str) -> TextDelta:
        if self.timings.first_token is None:
            self.timings.first_token = time.perf_counter()
        return TextDelta(text=text)

    async def _finish(self) -> Event:
        # Wait until the producer has closed the channel: its thread has returned and
        # the usage counters are final. Nothing sent after a stop sequence is shown.
        async for _ in self._receive:
            pass
        tail = ""
        if not self._stopped_by_sequence and self.backend_error is None:
            tail = self._assembler.flush()
            self._stopped_by_sequence = self._assembler.stopped
        self.timings.finished = time.perf_counter()
        if self.backend_error is not None:
            final = Finished(reason="error", usage=self.usage, message=str(self.backend_error))
        elif self._stopped_by_sequence:
            final = Finished(reason="stop", usage=self.usage)
        else:
            assert self.backend_result is not None
            final = Finished(reason=self.backend_result, usage=self.usage)
        if tail:
            self._final = final
            return self._delta(tail)
        self._done = True
        return final


class Engine:
    """Runs generation requests against one backend, with admission control.

    Use it as an async context manager; it closes the backend on exit::

        async with Engine(backend) as engine:
            async with engine.stream(GenerationRequest(prompt="Hi")) as events:
                async for event in events:
                    ...

    Args:
        backend: what makes the tokens.
        max_queue: how many requests may wait for a slot before new ones are refused
            with :class:`OverloadedError`.
    """

    @property
    def active_streams(self) -> int:
        return len(self.streams)

    def __init__(self, backend: Backend, *, max_queue: int = 16) -> None:
        self.backend = backend
        self.admission = Admission(backend.slots, max_queue)
        #: streams between admission and teardown (for health checks, metrics, tests)
        self.streams: set[EventStream] = set()
        self._ewma_service_seconds: float | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with trio.CancelScope(shield=True):
            await self.backend.aclose()

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenize and validate ``request``; raises :class:`InvalidRequestError` and
        subclasses. Cancellation: nothing is left behind."""
        return await self.backend.prepare(request)

    @asynccontextmanager
    async def stream(
        self, request: GenerationRequest | PreparedPrompt, *, reservation: Reservation | None = None
    ) -> AsyncIterator[EventStream]:
        """Run one generation; the body consumes its events.

        Args:
            request: what to generate.
            reservation: a place taken earlier with ``engine.admission.reserve()``.

        Raises:
            InvalidRequestError: (and subclasses) the request cannot be served.
            OverloadedError: the queue is full or the deadline cannot be met.

        Cancellation: cancelling any scope around this block — while queued, during
        prefill, during decode, or while the body is slow to read — cancels the
        generation. When the block exits, the inference thread has returned, the slot
        is free and the model state is reset; the ``Cancelled`` then propagates as usual.
        """
        timings = StreamTimings(created=time.perf_counter())
        prepared = request if isinstance(request, PreparedPrompt) else await self.prepare(request)
        async with self.admission.slot(reservation) as lease:
            timings.admitted = time.perf_counter()
            send, receive = trio.open_memory_channel[bytes](0)
            progress = GenerationProgress(len(prepared.tokens))
            producer_scope = trio.CancelScope()
            events = EventStream(prepared, receive, progress, producer_scope, timings)
            self.streams.add(events)
            try:
                async with trio.open_nursery() as nursery, receive:
                    nursery.start_soon(self._produce, prepared, send, progress, producer_scope, events, lease)
                    try:
                        yield events
                    finally:
                        # However the body ended, the producer has no reader any more.
                        producer_scope.cancel()
            finally:
                self.streams.discard(events)
                self._record_service_time(timings)

    async def _produce(
        self,
        prompt: PreparedPrompt,
        send: trio.MemorySendChannel[bytes],
        progress: GenerationProgress,
        producer_scope: trio.CancelScope,
        events: EventStream,
        lease: SlotLease,
    ) -> None:
        # The slot is inference capacity: it is given back the moment inference ends,
        # even if the consumer is still stuck sending to a client that stopped reading.
        async with send:  # closing it is how the consumer learns the end: no sentinel
            with producer_scope:
                try:
                    events.backend_result = await self.backend.generate(prompt, send, progress)
                except trio.BrokenResourceError:
                    # the consumer closed its end: it is leaving; nothing to report
                    pass
                except Exception as exc:
                    logger.exception("backend failed")
                    # our own errors keep their type (an upstream's 400 stays a 400)
                    events.backend_error = (
                        exc if isinstance(exc, TrioserveError) else BackendError(f"inference failed: {exc}")
                    )
                finally:
                    lease.release()

    def _record_service_time(self, timings: StreamTimings) -> None:
        if timings.admitted is None:
            return
        seconds = time.perf_counter() - timings.admitted
        previous = self._ewma_service_seconds
        self._ewma_service_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        self.admission.expected_service_time = self._ewma_service_seconds
