"""How a generation response is written, whichever its dialect: a plain stream (the hot
path), a stream of several choices or with tool calls, a collected body; its end (sent
whole, or cut short): :mod:`._writing_end`. The dialect (:class:`~trioserve._wire.Dialect`)
supplies the bytes; this module only decides when they go and how the last of them is
bounded."""

from __future__ import annotations

import math
import time

import trio

from .._core._engine import EventStream
from .._core._exceptions import TrioserveError
from .._core._types import Finished, TextDelta, TokenLogprob, Usage
from .._wire import Dialect, ParsedRequest, finished_choice
from ._lifecycle import Heartbeat
from ._request import InFlightRequest, Phase
from ._writing_end import ResponseEnd, usage_of

__all__ = ["BackendFailed", "ResponseWriter", "failure", "usage_of"]


class ResponseWriter(ResponseEnd):
    """Writes each generation response of a server, from its first event to its last byte."""

    async def stream(
        self, request: InFlightRequest, events: EventStream, heartbeat: Heartbeat | None
    ) -> None:
        if self.state.settings.stream_interval:
            return await self._stream_coalesced(request, events, heartbeat)
        dialect = request.dialect
        assert dialect is not None
        body = request.exchange.body
        delta = dialect.plain_delta
        observe_gap = self.state.metrics.inter_token_latency.observe
        perf_counter = time.perf_counter
        previous = 0.0
        async for event in events:
            if request.phase is Phase.QUEUED:  # the first event
                await _begin_streaming(request, heartbeat)
            if type(event) is TextDelta:
                now = perf_counter()
                if previous:
                    observe_gap(now - previous)
                previous = now
                await body(delta(event.text))
            else:
                assert isinstance(event, Finished)
                await self._end(request, _one_choice_end(dialect, events, event), event)

    async def _stream_coalesced(
        self, request: InFlightRequest, events: EventStream, heartbeat: Heartbeat | None
    ) -> None:
        """:meth:`stream` with ``--stream-interval-ms``: a delta that arrives within the
        interval of the last event sent is held, with those after it, until the interval
        has passed; then they go as one event. Never delayed: the first delta (nothing
        sent yet) and the end (held text goes out with the final event, in one send). A
        cancel hands held text to whatever ends the response (``Exchange.unsent``), as a
        send that a cancel stopped does."""
        dialect = request.dialect
        assert dialect is not None
        exchange = request.exchange
        delta = dialect.plain_delta
        interval = self.state.settings.stream_interval
        observe_gap = self.state.metrics.inter_token_latency.observe
        now = trio.current_time
        held: list[str] = []
        last = -math.inf  # when the last text event went out
        try:
            while True:
                event: TextDelta | Finished | None = None
                if held:
                    with trio.move_on_at(last + interval):
                        event = await anext(events)  # (a cancel while waiting loses nothing)
                    if event is None:  # the interval has passed: what is held goes
                        text, held = "".join(held), []
                        await exchange.body(delta(text))
                        at = now()
                        observe_gap(at - last)
                        last = at
                        continue
                else:
                    event = await anext(events)
                if request.phase is Phase.QUEUED:  # the first event
                    await _begin_streaming(request, heartbeat)
                if type(event) is TextDelta:
                    at = now()
                    if held or at < last + interval:
                        held.append(event.text)
                        continue
                    await exchange.body(delta(event.text))
                    if last > -math.inf:
                        observe_gap(at - last)
                    last = at
                    continue
                assert isinstance(event, Finished)
                text, held = "".join(held), []
                start = delta(text) if text else b""
                await self._end(request, start + _one_choice_end(dialect, events, event), event)
                return
        except trio.Cancelled:
            if held:
                exchange.unsent += delta("".join(held))
            raise

    async def stream_choices(
        self, request: InFlightRequest, parsed: ParsedRequest, heartbeat: Heartbeat | None
    ) -> None:
        """A stream that needs more than text deltas (log-probabilities, tool calls) or
        has several choices: one reader per choice, one writer (this task)."""
        body = request.exchange.body
        choices = request.choices
        dialect = parsed.dialect
        # (a deadline or shutdown finishes the writers too: text they hold goes out)
        writers = dialect.writers
        send, receive = trio.open_memory_channel[tuple[int, TextDelta | Finished]](0)

        async def read(
            index: int, events: EventStream, out: trio.MemorySendChannel[tuple[int, TextDelta | Finished]]
        ) -> None:
            async with out:
                async for event in events:
                    await out.send((index, event))

        async with trio.open_nursery() as nursery:
            async with send:
                for index, events in enumerate(choices):
                    nursery.start_soon(read, index, events, send.clone())
            left = len(choices)
            async for index, event in receive:
                if request.phase is Phase.QUEUED:  # the first event
                    await _begin_streaming(request, heartbeat)
                if type(event) is TextDelta:
                    data = writers[index].delta(event.text, event.logprobs)
                    if data:
                        await body(data)
                    continue
                assert isinstance(event, Finished)
                if event.reason == "error":
                    # one choice failed: the response has failed (the SDKs raise on the
                    # error event); the other choices' readers stop here
                    nursery.cancel_scope.cancel()
                    request.ended_choices.update(range(len(choices)))
                    await self._end(request, dialect.stream_error(failure(choices[index], event)), event)
                    return
                data = writers[index].finish(event.reason, event.message, event.stop_sequence)
                request.ended_choices.add(index)
                left -= 1
                if left:
                    await body(data)
                else:
                    # (every choice's producer has returned: the usage is final)
                    end = data + dialect.end(usage_of(choices))
                    await self._end(request, end, event)

    async def collect(self, request: InFlightRequest, parsed: ParsedRequest) -> None:
        choices = request.choices
        finals: list[Finished | None] = [None] * len(choices)
        texts: list[list[str]] = [[] for _ in choices]
        logprobs: list[list[TokenLogprob] | None] = [
            [] if parsed.generation.logprobs is not None else None for _ in choices
        ]

        async def collect(index: int, events: EventStream) -> None:
            parts, entries = texts[index], logprobs[index]
            async for event in events:
                if request.phase is Phase.QUEUED:  # the first event
                    request.advance(Phase.STREAMING)
                if type(event) is TextDelta:
                    parts.append(event.text)
                    if entries is not None and event.logprobs:
                        entries.extend(event.logprobs)
                else:
                    assert isinstance(event, Finished)
                    finals[index] = event

        async with trio.open_nursery() as nursery:
            for index, events in enumerate(choices):
                nursery.start_soon(collect, index, events)
        for index, final in enumerate(finals):
            assert final is not None
            if final.reason == "error":
                request.end(final.reason)
                raise failure(choices[index], final)  # (an upstream's 400 stays a 400)
        last = finals[-1]
        assert last is not None
        assert request.model is not None
        results = [
            finished_choice(
                "".join(parts),
                final.reason,
                parsed.tool_mode,
                parsed.tool_names,
                entries,
                final.stop_sequence,
                reasoning=parsed.reasoning,
                inside=parsed.inside,
                parallel_calls=parsed.parallel_calls,
            )
            for parts, final, entries in zip(texts, finals, logprobs, strict=True)
            if final is not None
        ]
        response = parsed.dialect.body(results, usage_of(choices))
        await self._end(request, response, last, json=True)

    async def loaded(self, request: InFlightRequest, parsed: ParsedRequest) -> None:
        """A request that only loaded its model (Ollama's empty prompt): its dialect's
        body of no choice, as one JSON body (Ollama's, streamed or not)."""
        request.advance(Phase.STREAMING)
        usage = Usage(prompt_tokens=0, completion_tokens=0)
        body = parsed.dialect.body((), usage)
        await self._end(request, body, Finished(reason="stop", usage=usage), json=True)


async def _begin_streaming(request: InFlightRequest, heartbeat: Heartbeat | None) -> None:
    """At a stream's first event: the heartbeat hands its writing over (from here on,
    the calling task is the only writer) and the request is streaming."""
    if heartbeat is not None:
        await heartbeat.hand_over()
    request.advance(Phase.STREAMING)


def _one_choice_end(dialect: Dialect, events: EventStream, event: Finished) -> bytes:
    """The last bytes of a one-choice text stream: a failed choice's error event, else
    the choice's finish and the dialect's end (the usage)."""
    if event.reason == "error":
        return dialect.stream_error(failure(events, event))
    final = dialect.writers[0].finish(event.reason, event.message, event.stop_sequence)
    return final + dialect.end(event.usage)


def failure(events: EventStream, event: Finished) -> TrioserveError:
    """The error a failed choice reports to the client (a backend's own error keeps
    its status: an upstream's 400 stays a 400)."""
    failure = events.backend_error
    if isinstance(failure, TrioserveError):
        return failure
    return BackendFailed(event.message or "inference failed")


class BackendFailed(TrioserveError):
    status = 500
    error_type = "server_error"
    default_code = "backend_error"
