"""The engine: one generation request's life inside one nursery.

``async with engine.stream(request) as events`` queues for a slot, runs the backend's
producer and the caller's body (the consumer) in one nursery, linked by a
:class:`~trioserve._core._channel.PieceChannel` of ``WINDOW`` pieces, and yields
:class:`EventStream` (``TextDelta`` … ``Finished``). Leaving the block — normally, by
``break``, an exception or a cancel of any enclosing scope — cancels the producer and
waits for its inference to return: then no thread, task or slot of the request is left.
An exception raised in the body comes out as itself
(:func:`~trioserve._core._errors.unwrap_group`). :meth:`Engine.aclose` cancels every
stream and closes the backend once they have returned. The flow and who cancels whom:
``docs/architecture.md``, ``docs/cancellation.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Self, cast

import trio

from ._admission import DEFAULT_TICKET, Admission, PauseBudget, Reservation, Ticket
from ._backend import Backend, ChoiceGroup, ControlOutcome, GenerationProgress, PreparedPrompt
from ._channel import PieceChannel
from ._errors import unwrap_group
from ._exceptions import BackendError, ServiceUnavailableError, TrioserveError
from ._text import LineRules, TextAssembler
from ._types import Finished, GenerationEnd, GenerationRequest, TextDelta, TokenLogprob, Usage

__all__ = ["WINDOW", "Engine", "EventStream", "StreamTimings"]

logger = logging.getLogger("trioserve.engine")

Event = TextDelta | Finished

#: how many pieces a producer may run ahead of its consumer (the channel's capacity)
WINDOW = 8


@dataclass(kw_only=True, slots=True)
class StreamTimings:
    """Monotonic timestamps (``time.perf_counter``) of one stream's milestones."""

    created: float
    admitted: float | None = None
    #: when the slot was given back (inference ended)
    released: float | None = None
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

    A :class:`TextDelta` carries all the text that is ready when the consumer asks: one
    token's while the consumer keeps up, several when it has fallen behind (so a slow
    client costs one write for many tokens, not one each).
    """

    def __init__(
        self,
        prompt: PreparedPrompt,
        channel: PieceChannel,
        progress: GenerationProgress,
        producer_scope: trio.CancelScope,
        timings: StreamTimings,
    ) -> None:
        self._prompt = prompt
        #: its backend can end a running reasoning (the engine sets it); its producer returned
        self._ends_reasoning = self._produced = False
        self._channel = channel
        self._progress = progress
        self._producer_scope = producer_scope
        request = prompt.request
        limits = request.lines
        lines = (
            LineRules(limits.n_indent, limits.t_max_predict)
            if limits is not None and (limits.n_indent > 0 or limits.t_max_predict is not None)
            else None
        )
        self._assembler = TextAssembler(request.stop, lines)
        #: log-probabilities: pieces come with their entries (``(bytes, TokenLogprob)``),
        #: kept until the text they are part of is given out
        self._logprobs = prompt.request.logprobs is not None
        self._pending: list[TokenLogprob] = []
        self._feed = self._feed_logged if self._logprobs else self._assembler.feed
        self._final: Finished | None = None
        self._done = False
        self._stopped_by_sequence = False
        #: pieces given to the assembler (a stop sequence: up to the one that ends it)
        self._fed = 0
        self.timings = timings
        # set by the producer before it closes the channel
        self.backend_result: GenerationEnd | None = None
        self.backend_error: BaseException | None = None

    @property
    def usage(self) -> Usage:
        """Token usage so far (final once the stream has finished or been torn down).

        A stream cut by a stop sequence counts the tokens up to the one that completes
        it, as OpenAI does, not those its producer made past it in the same decode call
        (where the producer's pieces are tokens)."""
        progress = self._progress
        completion = progress.completion_tokens
        if self._stopped_by_sequence and progress.piece_per_token:
            completion = min(completion, self._fed)
        timings = self.timings
        decode = 0.0
        if timings.first_token is not None:
            decode = (timings.finished or time.perf_counter()) - timings.first_token
        return Usage(
            prompt_tokens=progress.prompt_tokens,
            completion_tokens=completion,
            cached_tokens=progress.cached_tokens,
            cached_host_tokens=progress.host_tokens,
            cached_disk_tokens=progress.disk_tokens,
            prefill_seconds=progress.prefill_seconds,
            decode_seconds=decode,
        )

    @property
    def progress(self) -> GenerationProgress:
        return self._progress

    @property
    def choice_index(self) -> int:
        """Which of its prompt's ``n`` choices this is (0: the one whose usage counts
        the prompt)."""
        return self._prompt.choice

    @property
    def buffered_room(self) -> int:
        """Pieces its channel can still take before the producer waits (0: a consumer
        that stopped reading has paused it)."""
        return self._channel.room

    def end_reasoning(self) -> ControlOutcome:
        """Ask the backend to write the model's end-of-reasoning marker at its next token,
        as if drawn, so that it answers (llama-server's ``reasoning_end``; docs/dialects.md,
        "Ending the reasoning"). From Trio, never waits; an ask before the backend has
        started the generation is honoured from its first token."""
        request = self._prompt.request
        if not request.reasoning_control:
            return "not_enabled"
        if request.reasoning is None:
            return "not_reasoning"
        if not self._ends_reasoning:
            return "unsupported"
        if self._produced:
            return "finished"
        progress = self._progress
        control = progress.control
        if control is None:
            progress.reasoning_end_asked = True  # (the backend reads it as it starts)
            return "forced"
        return control()

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
        receive = self._channel.receive_batch
        feed = self._feed
        while True:
            try:
                pieces = await receive()
            except trio.EndOfChannel:
                return await self._finish()
            if len(pieces) == 1:
                self._fed += 1
                text = feed(pieces[0])
            else:
                parts = []
                for piece in pieces:
                    parts.append(feed(piece))
                    if self._assembler.stopped:
                        break
                self._fed += len(parts)  # (one part per piece fed: up to a stop, if any)
                text = "".join(parts)
            if self._assembler.stopped:
                # A stop sequence: the rest of the generation is unwanted. Cancel the
                # producer now; _finish() waits for it to be gone.
                self._stopped_by_sequence = True
                self._producer_scope.cancel()
                if text:
                    return self._delta(text)
                return await self._finish()
            if text:
                return self._delta(text)

    def _feed_logged(self, item: bytes) -> str:
        """``feed`` for a piece that carries its log-probability: the entry waits for
        the delta its text goes out in (a token whose text is held back — half a
        character, a possible stop sequence — comes with the text it completes)."""
        piece, entry = cast("tuple[bytes, TokenLogprob]", item)
        self._pending.append(entry)
        return self._assembler.feed(piece)

    def _delta(self, text: str) -> TextDelta:
        if self.timings.first_token is None:
            self.timings.first_token = time.perf_counter()
        if self._logprobs:
            entries, self._pending = tuple(self._pending), []
            return TextDelta(text=text, logprobs=entries)
        return TextDelta(text=text)

    async def _finish(self) -> Event:
        # Wait until the producer has closed the channel: its thread has returned and
        # the usage counters are final. Nothing sent after a stop sequence is shown.
        receive = self._channel.receive_batch
        while True:
            try:
                await receive()
            except trio.EndOfChannel:
                break
        tail = ""
        if not self._stopped_by_sequence and self.backend_error is None:
            tail = self._assembler.flush()
            self._stopped_by_sequence = self._assembler.stopped
        self.timings.finished = time.perf_counter()
        if self.backend_error is not None:
            final = Finished(reason="error", usage=self.usage, message=str(self.backend_error))
        elif self._stopped_by_sequence and self._assembler.limited:
            final = Finished(reason="length", usage=self.usage)  # (a line rule: a limit)
        elif self._stopped_by_sequence:
            final = Finished(reason="stop", usage=self.usage, stop_sequence=self._assembler.stop_sequence)
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
        backend: what makes tokens.
        max_queue: how many requests may wait for a slot before new ones are refused
            with :class:`OverloadedError` (paused requests wait too).
        pause_budget: the bytes paused requests' saved states may hold (one budget
            for a server's models; default: no bound).
    """

    @property
    def active_streams(self) -> int:
        return len(self.streams)

    def __init__(
        self, backend: Backend, *, max_queue: int = 16, pause_budget: PauseBudget | None = None
    ) -> None:
        self.backend = backend
        self.admission = Admission(backend.slots, max_queue, pause_budget=pause_budget)
        #: streams between admission and teardown (for health checks, metrics, tests)
        self.streams: set[EventStream] = set()
        self._ewma_service_seconds: float | None = None
        #: one cancel scope per stream() in progress, queued ones included
        self._scopes: set[trio.CancelScope] = set()
        self._idle = trio.Event()
        self._idle.set()
        self._closing = False
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self, *, close_backend: bool = True) -> None:
        """Stop serving: refuse new streams, cancel the running ones (also those in a
        caller's own nursery) and wait until their inference has returned; then close
        the backend. A stream cancelled this way raises :class:`ServiceUnavailableError`
        (code ``engine_closed``) out of its ``async with``. Idempotent.

        Cancellation: shielded — the model is never freed while a thread still uses it.
        """
        self._closing = True
        for scope in self._scopes:
            scope.cancel()
        with trio.CancelScope(shield=True):
            await self._idle.wait()
            if close_backend and not self._closed:
                self._closed = True
                await self.backend.aclose()

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenize and validate ``request``; raises :class:`InvalidRequestError` and
        subclasses. Cancellation: nothing is left behind."""
        return await self.backend.prepare(request)

    @asynccontextmanager
    async def stream(
        self,
        request: GenerationRequest | PreparedPrompt,
        *,
        reservation: Reservation | None = None,
        ticket: Ticket = DEFAULT_TICKET,
    ) -> AsyncIterator[EventStream]:
        """Run one generation; the body consumes its events.

        Everything :meth:`stream_choices` says holds, for ``n=1``.
        """
        async with self.stream_choices(request, 1, reservation=reservation, ticket=ticket) as streams:
            yield streams[0]

    @asynccontextmanager
    async def stream_choices(
        self,
        request: GenerationRequest | PreparedPrompt | Sequence[GenerationRequest | PreparedPrompt],
        n: int,
        *,
        reservation: Reservation | None = None,
        ticket: Ticket = DEFAULT_TICKET,
    ) -> AsyncIterator[list[EventStream]]:
        """Run ``n`` generations of one prompt (OpenAI's ``n``), holding ``n`` slots;
        the body consumes their events (one stream per choice, in a task each or in
        turn). A backend that can shares one evaluation of the prompt between them
        (``PreparedPrompt.group``); each choice is drawn with ``seed + index``.

        A sequence of requests is a batch (``/v1/completions`` with a list of prompts):
        ``n`` choices of each, ``len × n`` slots taken at once, the streams prompt by
        prompt.

        Args:
            request: what to generate.
            reservation: a place taken earlier with ``engine.admission.reserve()``;
                it is given back however this ends (an invalid request included).
            ticket: its priority and account in the queue (:class:`Ticket`); a
                request of one slot on a pausable backend may be paused for a better
                ranked one and resumed (docs/scheduling.md).

        Raises:
            InvalidRequestError: (and subclasses) the request cannot be served.
            OverloadedError: the queue is full or the deadline cannot be met.
            ServiceUnavailableError: the engine is closed, or closed during the stream.

        Exceptions raised in the body come out as themselves.

        Cancellation: cancelling any scope around this block — while queued, during
        prefill, during decode, or while the body is slow to read — cancels the
        generation. When the block exits, the inference has returned, the slot is
        free and the model state is reset; the ``Cancelled`` then propagates as usual.
        """
        timings = StreamTimings(created=time.perf_counter())
        try:
            if self._closing:
                raise ServiceUnavailableError("the engine is closed", code="engine_closed")
            scope = trio.CancelScope()
            self._scopes.add(scope)
            self._idle = trio.Event() if self._idle.is_set() else self._idle
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        try:
            with scope:
                requests = list(request) if isinstance(request, Sequence) else [request]
                try:
                    prompts = [
                        r if isinstance(r, PreparedPrompt) else await self.prepare(r) for r in requests
                    ]
                except BaseException:
                    if reservation is not None:
                        reservation.release()
                    raise
                async with self.admission.slot(reservation, count=n * len(prompts), ticket=ticket) as lease:
                    timings.admitted = time.perf_counter()
                    choices: list[tuple[PreparedPrompt, EventStream]] = []
                    for prepared in prompts:
                        group = ChoiceGroup(n) if n > 1 else None
                        for index in range(n):
                            prompt = (
                                prepared if group is None else replace(prepared, group=group, choice=index)
                            )
                            channel = PieceChannel(WINDOW)
                            progress = GenerationProgress(len(prepared.tokens), lease)
                            choice_timings = timings if not choices else replace(timings)
                            events = EventStream(
                                prompt, channel, progress, trio.CancelScope(), choice_timings
                            )
                            events._ends_reasoning = self.backend.ends_reasoning
                            choices.append((prompt, events))
                    all_events = [events for _, events in choices]
                    progresses = [events._progress for events in all_events]
                    lease.usage = lambda: sum(p.served_tokens for p in progresses)
                    if self.backend.pausable and lease.count == 1:
                        # the backend makes it pausable once its hook is installed
                        # (SlotLease.enable_pause): an ask before that would be lost
                        progresses[0].preemption = lease
                    self.streams.update(all_events)
                    remaining = [len(choices)]

                    def release_one() -> None:
                        # the slots are given back once every choice's inference has ended
                        remaining[0] -= 1
                        if remaining[0] == 0:
                            lease.release()

                    try:
                        with unwrap_group():
                            async with trio.open_nursery() as nursery:
                                for prompt, events in choices:
                                    nursery.start_soon(self._produce, prompt, events, release_one)
                                try:
                                    yield all_events
                                finally:
                                    # However the body ended, the producers have no reader any more.
                                    for events in all_events:
                                        events._producer_scope.cancel()
                                        events._channel.close_receiving()
                    finally:
                        self.streams.difference_update(all_events)
        finally:
            self._scopes.discard(scope)
            if not self._scopes:
                self._idle.set()
        if scope.cancelled_caught:
            raise ServiceUnavailableError("the engine closed while this stream ran", code="engine_closed")

    async def _produce(
        self, prompt: PreparedPrompt, events: EventStream, release: Callable[[], None]
    ) -> None:
        # The slot is inference capacity: it is given back the moment inference ends,
        # even if the consumer is still stuck sending to a client that stopped reading.
        channel, progress = events._channel, events._progress
        try:
            with events._producer_scope:
                try:
                    events.backend_result = await self.backend.generate(prompt, channel, progress)
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
                    release()
                    if events.backend_result is not None:  # a whole generation, not a cut one
                        self._record_service_time(events.timings)
        finally:
            events._produced = True
            channel.close()  # how the consumer learns the end: no sentinel

    def _record_service_time(self, timings: StreamTimings) -> None:
        """The admission estimate behind ``Retry-After`` and ``deadline_unreachable``:
        how long a slot was held (admission → inference ended), not how long the
        client took to read."""
        if timings.admitted is None:
            return
        timings.released = time.perf_counter()
        seconds = timings.released - timings.admitted
        previous = self._ewma_service_seconds
        self._ewma_service_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        self.admission.expected_service_time = self._ewma_service_seconds
