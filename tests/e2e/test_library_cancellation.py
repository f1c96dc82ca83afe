"""The caller's own cancel scope, when the engine is used as a library: every phase,
real llama.cpp inference on the default model.

Every test runs against the llama backend with one sequence and with two. Same
guarantees as over HTTP: when ``engine.stream()`` has exited, the sequence has left
llama.cpp (promptly) with its KV cells cleared, the slot and queue place are free, and
the next request gives the text a fresh engine gives.
"""

from __future__ import annotations

import time

import pytest
import trio

from trioserve import Engine, GenerationRequest, LlamaBackend, SamplingParams, TextDelta

from .._helpers import wait_for

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0)
REFERENCE = GenerationRequest(prompt="The capital of France is", max_tokens=40, sampling=GREEDY)
LONG = GenerationRequest(
    prompt="The history of the city is long and varied. " * 170, max_tokens=40, sampling=GREEDY
)
ENDLESS = GenerationRequest(prompt="Once upon a time", max_tokens=3000, sampling=GREEDY)


async def _text(engine: Engine, request: GenerationRequest) -> str:
    parts = []
    async with engine.stream(request) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
    return "".join(parts)


Backend = LlamaBackend


@pytest.fixture(scope="module", params=["one", "two"])
def llama_backend(request: pytest.FixtureRequest, llama_backend: LlamaBackend) -> Backend:
    """This module's backend: one sequence, and two."""
    if request.param == "two":
        backend: LlamaBackend = request.getfixturevalue("batched_backend")
        return backend
    return llama_backend


@pytest.fixture(scope="module")
def reference_text(llama_backend: Backend) -> str:
    return trio.run(_text, Engine(llama_backend), REFERENCE)


def _assert_released(engine: Engine, backend: Backend) -> None:
    assert backend.generations.running == 0
    assert engine.admission.in_use == 0
    assert engine.admission.queued == 0
    assert not engine.streams


@pytest.mark.parametrize("phase", ["prefill", "decode", "blocked"])
async def test_caller_cancel_scope(phase: str, llama_backend: Backend, reference_text: str) -> None:
    """Each cell puts the request in the phase it names — shown by an observable — and
    only then cancels: a prompt chunk or a token decode in flight inside llama.cpp, or
    the sequence paused on a full channel because the body stopped reading."""
    engine = Engine(llama_backend)
    request = LONG if phase == "prefill" else ENDLESS
    cancelled_at = 0.0
    progress = None
    with trio.CancelScope() as scope:
        async with engine.stream(request) as events:
            progress = events.progress
            if phase in ("prefill", "decode"):
                watched = progress

                async def cancel_inside_llama_decode() -> None:
                    nonlocal cancelled_at
                    if phase == "decode":
                        await wait_for(lambda: watched.completion_tokens >= 3)
                    await wait_for(lambda: llama_backend.in_flight(watched) == phase)
                    cancelled_at = time.perf_counter()
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_inside_llama_decode)
                    async for _ in events:  # the body keeps reading until the cancel
                        assert phase == "decode", "no token can arrive during prefill"
            else:
                async for event in events:
                    assert isinstance(event, TextDelta)
                    break
                # stop reading: the sequence fills its channel, then is paused
                await wait_for(lambda: events.buffered_room == 0)
                tokens = progress.completion_tokens
                await wait_for(lambda: llama_backend.in_flight(progress) is None)
                assert progress.completion_tokens == tokens  # paused: nothing more decoded
                cancelled_at = time.perf_counter()
                scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    _assert_released(engine, llama_backend)
    assert progress is not None
    assert progress.inference_ended is not None
    assert progress.inference_ended - cancelled_at < 0.25  # measured: ~1 ms
    if phase == "prefill":
        assert progress.completion_tokens == 0
    assert await _text(engine, REFERENCE) == reference_text


async def test_caller_cancel_scope_while_queued(llama_backend: Backend, reference_text: str) -> None:
    engine = Engine(llama_backend, max_queue=2)
    started = llama_backend.generations.started
    async with trio.open_nursery() as nursery:

        async def occupy(occupying: trio.Event) -> None:
            async with engine.stream(ENDLESS) as events:
                async for _ in events:
                    occupying.set()

        for _ in range(llama_backend.slots):  # every slot busy
            occupying = trio.Event()
            nursery.start_soon(occupy, occupying)
            await occupying.wait()
        with trio.CancelScope() as scope:

            async def cancel_when_queued() -> None:
                await wait_for(lambda: engine.admission.queued == 1)
                scope.cancel()

            nursery.start_soon(cancel_when_queued)
            async with engine.stream(REFERENCE):
                pytest.fail("the slot is busy: this request must still be queued")
        assert scope.cancelled_caught
        assert engine.admission.queued == 0  # the place was freed at once
        nursery.cancel_scope.cancel()
    _assert_released(engine, llama_backend)
    # only the occupiers ran
    assert llama_backend.generations.started == started + llama_backend.slots
    assert await _text(engine, REFERENCE) == reference_text
