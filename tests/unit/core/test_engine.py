"""The engine with the scripted backend: events, text correctness, and teardown.

These tests assert resources, not timings: after ``engine.stream`` exits, however it
exits, no inference thread runs, the slot is free and no stream is counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio
import trio.testing

from trioserve import (
    Engine,
    Finished,
    GenerationRequest,
    OverloadedError,
    ScriptedBackend,
    TextDelta,
)
from trioserve._core._engine import WINDOW

from ..._helpers import wait_for


def assert_torn_down(engine: Engine) -> None:
    backend = engine.backend
    assert isinstance(backend, ScriptedBackend)
    assert backend.generations.running == 0, "an inference thread is still running"
    assert engine.admission.in_use == 0, "a slot is still held"
    assert engine.admission.queued == 0, "a queue place is still held"
    assert engine.active_streams == 0


async def collect(engine: Engine, request: GenerationRequest) -> tuple[list[str], Finished]:
    texts: list[str] = []
    final: Finished | None = None
    async with engine.stream(request) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                texts.append(event.text)
            else:
                final = event
    assert final is not None
    return texts, final


async def occupy(engine: Engine, nursery: trio.Nursery) -> None:
    """Start a long generation in ``nursery`` and return once it streams (its slot is held)."""
    running = trio.Event()

    async def hold() -> None:
        async with engine.stream(GenerationRequest(prompt="p", max_tokens=4000)) as events:
            async for _ in events:
                running.set()

    nursery.start_soon(hold)
    await running.wait()


def scripted(script: Sequence[bytes] | None = None, **kwargs: object) -> Engine:
    return Engine(ScriptedBackend(script, **kwargs))  # type: ignore[arg-type]


async def test_stream_yields_deltas_then_one_finished() -> None:
    engine = scripted([b"a", b"b", b"c"])
    texts, final = await collect(engine, GenerationRequest(prompt="p", max_tokens=10))
    # one delta per read: several pieces when the reader is behind, never an empty one
    assert "".join(texts) == "abc"
    assert all(texts)
    assert final.reason == "stop"
    assert final.usage.prompt_tokens == 1
    assert final.usage.completion_tokens == 3
    assert_torn_down(engine)


async def test_max_tokens_gives_length() -> None:
    engine = scripted()
    texts, final = await collect(engine, GenerationRequest(prompt="p", max_tokens=5))
    assert "".join(texts) == " tok0 tok1 tok2 tok3 tok4"
    assert final.reason == "length"
    assert final.usage.completion_tokens == 5


async def test_utf8_split_across_pieces_is_never_broken() -> None:
    data = "ok 你好🎉鼃".encode()
    engine = scripted([data[i : i + 1] for i in range(len(data))])
    texts, _ = await collect(engine, GenerationRequest(prompt="p", max_tokens=100))
    assert "".join(texts) == "ok 你好🎉鼃"
    assert all("\ufffd" not in t for t in texts)


async def test_stop_sequence_across_pieces_is_not_leaked_and_generation_stops() -> None:
    backend = ScriptedBackend(
        [b"one ", b"tw", b"o S", b"TO", b"P three", *[b" more"] * 1000], token_interval=0.001
    )
    engine = Engine(backend)
    texts, final = await collect(engine, GenerationRequest(prompt="p", max_tokens=2000, stop=["STOP"]))
    assert "".join(texts) == "one two "
    assert final.reason == "stop"
    # the producer was cancelled right after the stop: it never ran through the script
    assert backend.completed_runs[-1] < 10
    # usage counts the tokens up to the one that completes the stop sequence
    assert final.usage.completion_tokens == 5
    assert_torn_down(engine)


async def test_a_stop_sequence_found_in_a_batch_of_pieces_counts_the_tokens_up_to_it() -> None:
    # the producer runs ahead (a full channel; a verify call's run): the tokens it made
    # past the stop sequence are neither shown nor counted
    engine = Engine(ScriptedBackend([b"a", b"b", b"c", b"STOP", *[b"x"] * 100], token_interval=0))
    async with engine.stream(GenerationRequest(prompt="p", max_tokens=200, stop=["STOP"])) as events:
        await wait_for(lambda: events.progress.completion_tokens >= WINDOW + 1)
        produced = events.progress.completion_tokens
        deltas = [event async for event in events]
    final = deltas[-1]
    assert isinstance(final, Finished)
    assert final.reason == "stop"
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "abc"
    assert produced > 4  # the producer made tokens past the stop …
    assert final.usage.completion_tokens == 4  # … which are not counted
    assert_torn_down(engine)


async def test_concatenated_stream_equals_whole_text_with_stops() -> None:
    pieces = [b"ab", b"c\n", b"\nde", b"f"]
    for stop in (["\n\n"], ["cd"], ["zz"], []):
        engine = scripted(pieces)
        texts, _ = await collect(engine, GenerationRequest(prompt="p", max_tokens=10, stop=stop))
        whole = b"".join(pieces).decode()
        cut = min((whole.find(s) for s in stop if s in whole), default=len(whole))
        assert "".join(texts) == whole[:cut]


async def test_caller_cancel_during_decode_tears_down() -> None:
    engine = scripted(token_interval=0.005)
    with trio.move_on_after(0.1) as scope:
        async with engine.stream(GenerationRequest(prompt="p", max_tokens=4000)) as events:
            async for _ in events:
                pass
    assert scope.cancelled_caught
    assert_torn_down(engine)


async def test_caller_cancel_during_prefill_tears_down() -> None:
    backend = ScriptedBackend(prefill_seconds_per_token=0.01)  # 100 "tokens" → 1 s
    engine = Engine(backend)
    with trio.move_on_after(0.1) as scope:
        async with engine.stream(GenerationRequest(prompt="x" * 100, max_tokens=5)) as events:
            async for _ in events:
                pytest.fail("no token can arrive during prefill")
    assert scope.cancelled_caught
    assert backend.completed_runs == [0]
    assert_torn_down(engine)


async def test_caller_cancel_while_blocked_on_slow_consumer_tears_down() -> None:
    backend = ScriptedBackend()
    engine = Engine(backend)
    with trio.move_on_after(0.2):
        async with engine.stream(GenerationRequest(prompt="p", max_tokens=4000)) as events:
            async for _ in events:
                await trio.sleep_forever()  # a consumer that stopped reading
    # one read taken; the producer then fills the channel (WINDOW pieces) and blocks
    assert len(backend.completed_runs) == 1
    assert backend.completed_runs[0] <= 2 * WINDOW + 1
    assert_torn_down(engine)


async def test_slow_consumer_pauses_the_producer() -> None:
    backend = ScriptedBackend()
    engine = Engine(backend)
    consumed = 0
    async with engine.stream(GenerationRequest(prompt="p", max_tokens=1000)) as events:
        async for event in events:
            assert isinstance(event, TextDelta)
            consumed += event.text.count(" tok")
            # wait until the producer is blocked on the full channel: it can be at most
            # the channel's capacity (+ the piece in its hand) ahead of the reader
            await wait_for(lambda: events.progress.completion_tokens >= consumed + WINDOW + 1)  # noqa: B023
            assert events.progress.completion_tokens == consumed + WINDOW + 1
            if consumed >= 5 * WINDOW:
                break
    assert_torn_down(engine)


async def test_caller_cancel_while_queued_frees_the_place() -> None:
    engine = Engine(ScriptedBackend(token_interval=0.001), max_queue=4)
    async with trio.open_nursery() as nursery:
        await occupy(engine, nursery)
        # a cancel with no deadline (like a client disconnect) while queued
        with trio.CancelScope() as scope:

            async def cancel_when_queued() -> None:
                await wait_for(lambda: engine.admission.queued == 1)
                scope.cancel()

            nursery.start_soon(cancel_when_queued)
            async with engine.stream(GenerationRequest(prompt="q", max_tokens=5)):
                pytest.fail("should still be queued")
        assert scope.cancelled_caught
        assert engine.admission.queued == 0
        nursery.cancel_scope.cancel()
    assert_torn_down(engine)


async def test_queue_full_raises_overloaded() -> None:
    engine = Engine(ScriptedBackend(token_interval=0.001), max_queue=0)
    async with trio.open_nursery() as nursery:
        await occupy(engine, nursery)
        with pytest.raises(OverloadedError):
            async with engine.stream(GenerationRequest(prompt="q", max_tokens=5)):
                pass  # pragma: no cover
        nursery.cancel_scope.cancel()
    assert_torn_down(engine)


async def test_break_out_early_tears_down() -> None:
    backend = ScriptedBackend(token_interval=0.001)
    engine = Engine(backend)
    async with engine.stream(GenerationRequest(prompt="p", max_tokens=4000)) as events:
        async for event in events:
            assert isinstance(event, TextDelta)
            break
    assert backend.completed_runs[-1] <= 2
    assert_torn_down(engine)


class _Failing(ScriptedBackend):
    def _infer(self, prompt, emit, aborted, progress):  # type: ignore[no-untyped-def]
        emit(b"partial")
        raise RuntimeError("the GPU caught fire")


async def test_backend_failure_becomes_a_finished_error_event() -> None:
    engine = Engine(_Failing())
    texts, final = await collect(engine, GenerationRequest(prompt="p", max_tokens=5))
    assert texts == ["partial"]
    assert final.reason == "error"
    assert final.message is not None
    assert "GPU caught fire" in final.message
    assert engine.admission.in_use == 0
