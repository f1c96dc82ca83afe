"""The llama backend: many sequences decoded together in one llama.cpp context.

Real inference on the default model. What these tests prove (the cancellation matrix in
``test_cancellation.py`` runs against it with one and two sequences):

* at temperature 0, in batch-invariant mode, eight concurrent streams each give exactly
  the text the same request gives alone — and keep giving it when one of the eight is
  cancelled mid-decode (over HTTP, by closing its socket);
* in throughput mode the eight streams really share decode steps (far fewer steps than
  tokens) and all run at once in the scheduler;
* a sequence whose client stops reading is paused after a few tokens while another one
  runs to its end, and leaves the batch (KV cells cleared) when it is cancelled.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import trio

from trioserve import (
    Engine,
    Finished,
    GenerationProgress,
    GenerationRequest,
    LlamaBackend,
    SamplingParams,
    TextDelta,
)
from trioserve._core._engine import WINDOW as _WINDOW

from .._helpers import RawStream, start_server, wait_for

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three laws of robotics are",
    "In 1969, the first",
    "My favourite recipe for pancakes:",
    "Water boils at",
    "The quick brown fox",
]
MAX_TOKENS = 40


def _request(prompt: str, max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0))


async def _generate(engine: Engine, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, Finished]:
    parts: list[str] = []
    async with engine.stream(_request(prompt, max_tokens)) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            else:
                return "".join(parts), event
    raise AssertionError("the stream ended without a Finished event")


async def _concurrently(engine: Engine, prompts: list[str]) -> list[tuple[str, Finished]]:
    results: dict[int, tuple[str, Finished]] = {}

    async def one(index: int, prompt: str) -> None:
        results[index] = await _generate(engine, prompt)

    async with trio.open_nursery() as nursery:
        for index, prompt in enumerate(prompts):
            nursery.start_soon(one, index, prompt)
    return [results[i] for i in range(len(prompts))]


async def test_eight_streams_equal_their_solo_texts_in_batch_invariant_mode(
    invariant_backend: LlamaBackend,
) -> None:
    engine = Engine(invariant_backend, max_queue=8)
    solo = [await _generate(engine, prompt) for prompt in PROMPTS]
    steps = invariant_backend.steps
    together = await _concurrently(engine, PROMPTS)
    for (text, final), (solo_text, solo_final) in zip(together, solo, strict=True):
        assert text == solo_text
        assert final.reason == solo_final.reason
        assert final.usage == solo_final.usage
    tokens = sum(final.usage.completion_tokens for _, final in together)
    # batched for real: a step decodes several sequences (calls of at most max_call_width)
    assert invariant_backend.steps - steps < tokens / 3
    assert invariant_backend.generations.running == 0


async def test_throughput_mode_decodes_all_eight_in_shared_steps(
    batched8_backend: LlamaBackend,
) -> None:
    engine = Engine(batched8_backend, max_queue=8)
    steps = batched8_backend.steps
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, batched8_backend.generations.running)
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        together = await _concurrently(engine, PROMPTS)
        nursery.cancel_scope.cancel()
    assert peak == 8, "all eight sequences were in the scheduler at once"
    for text, final in together:
        assert final.reason in ("length", "stop")
        assert text
        if final.reason == "length":
            assert final.usage.completion_tokens == MAX_TOKENS
    tokens = sum(final.usage.completion_tokens for _, final in together)
    assert batched8_backend.steps - steps < tokens / 4
    assert batched8_backend.generations.running == 0
    assert engine.admission.in_use == 0


async def test_a_paused_sequence_does_not_hold_back_the_others(batched8_backend: LlamaBackend) -> None:
    engine = Engine(batched8_backend, max_queue=8)
    reader_done = trio.Event()
    stalled_tokens: list[int] = []

    async def stalled_client() -> None:
        async with engine.stream(_request("Once upon a time", max_tokens=900)) as events:
            async for _ in events:
                # read one event, then stop reading until the other stream has finished
                await reader_done.wait()
                stalled_tokens.append(events.progress.completion_tokens)
                break  # leaving the block cancels this generation

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stalled_client)
        await wait_for(lambda: batched8_backend.generations.running == 1)
        _, final = await _generate(engine, "The capital of France is", max_tokens=120)
        reader_done.set()
    assert final.usage.completion_tokens == 120 or final.reason == "stop"
    # the stalled one ran at most its window ahead of its reader, plus the pieces in hand
    assert stalled_tokens
    assert stalled_tokens[0] <= _WINDOW + 3
    assert batched8_backend.generations.running == 0
    assert engine.admission.in_use == 0


def _text_of(data: bytes) -> str:
    text = []
    for match in re.finditer(rb"data: (.*?)\n\n", data, re.S):
        payload = match.group(1)
        if payload != b"[DONE]":
            event = json.loads(payload)
            if event.get("choices"):
                text.append(event["choices"][0]["text"])
    return "".join(text)


async def test_cancelling_one_of_eight_mid_decode_leaves_the_others_unchanged(
    invariant_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, invariant_backend, max_queue=8)
    others = PROMPTS[1:]
    async with running.client() as client:
        solo = []
        for prompt in others:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            solo.append((await client.post("/v1/completions", json=body)).json()["choices"][0]["text"])

    results: dict[int, str] = {}

    async def reader(index: int, prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        stream = await RawStream.post(running.url, "/v1/completions", body)
        with trio.fail_after(60):
            data = await stream.read_to_eof_or(b"0\r\n\r\n")
        await stream.aclose()
        results[index] = _text_of(data)

    async with trio.open_nursery() as clients:
        victim = await RawStream.post(
            running.url,
            "/v1/completions",
            {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True},
        )
        for index, prompt in enumerate(others):
            clients.start_soon(reader, index, prompt)
        await wait_for(lambda: invariant_backend.generations.running == 8)
        await victim.read_until(b"data: ", 5)  # mid-decode, the others decoding beside it
        await victim.aclose()
        await wait_for(lambda: invariant_backend.generations.running <= 7)
    assert [results[i] for i in range(len(others))] == solo
    health = await running.wait_idle(limit=5.0)
    assert health["generations_running"] == 0
    batch = health["batch"]
    assert isinstance(batch, dict)
    assert batch["sequences"] == 0
    assert batch["batch_invariant"] is True
    assert batch["max_call_width"] == invariant_backend.max_call_width
    async with running.client() as client:
        metrics = (await client.get("/metrics")).text
    assert "trioserve_batch_sequences 0.0" in metrics
    steps = re.search(r"^trioserve_batch_steps (\S+)$", metrics, re.M)
    assert steps is not None
    assert float(steps.group(1)) == invariant_backend.steps > 0
    running.server.shutdown()


def test_batch_invariant_mode_measured_its_call_width(invariant_backend: LlamaBackend) -> None:
    # the probe found the widest call whose numerics equal a lone sequence's (7 on the
    # development machine: llama.cpp switches to another matmul kernel at 8 columns)
    assert 1 <= invariant_backend.max_call_width <= invariant_backend.slots


async def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_steps(
    batched8_backend: LlamaBackend,
) -> None:
    """A ~800-token prompt arriving while a stream decodes: the running stream keeps
    getting tokens during the new prompt's prefill (one 64-token chunk per step),
    instead of waiting ~1 s for the whole prompt."""
    engine = Engine(batched8_backend, max_queue=8)
    long_prompt = "The history of the city is long and varied. " * 80
    progress_during: list[int] = []

    async with trio.open_nursery() as nursery:
        running = trio.Event()

        async def runner() -> None:
            async with engine.stream(_request("Once upon a time", max_tokens=900)) as events:
                async for _ in events:
                    running.set()
                    if len(progress_during) == 2:
                        break

        nursery.start_soon(runner)
        await running.wait()
        (stream,) = engine.streams
        async with engine.stream(_request(long_prompt, max_tokens=3)) as events:
            progress_during.append(stream.progress.completion_tokens)
            async for event in events:
                if isinstance(event, TextDelta):
                    progress_during.append(stream.progress.completion_tokens)
                    break
    assert len(progress_during) == 2
    # ~13 chunks of 64 tokens: the running stream got a token after (nearly) each
    assert progress_during[1] - progress_during[0] >= 8, progress_during
    assert batched8_backend.generations.running == 0


async def test_a_cancel_that_aborts_a_shared_call_leaves_the_other_sequence_unchanged(
    invariant_backend: LlamaBackend,
) -> None:
    """Two streams decode in one call; cancelling one owns half of it, so the call is
    aborted mid-graph. The survivor's cells written by the aborted call are removed and
    its entry decoded again: its text must equal its solo text. The cancel comes while a
    call of both is in flight; the call can still end first, so this is repeated until a
    cancel has landed inside a call (the abort counter moves), at most 10 times."""
    engine = Engine(invariant_backend, max_queue=8)
    survivor_prompt = "The capital of France is"

    def _both_in_flight(progress: GenerationProgress) -> bool:
        in_flight = invariant_backend.snapshot().in_flight
        return invariant_backend.in_flight(progress) == "decode" and in_flight == 2

    solo, _ = await _generate(engine, survivor_prompt, max_tokens=60)
    aborted = invariant_backend.aborted_calls
    texts: list[str] = []

    async def survivor() -> None:
        text, _ = await _generate(engine, survivor_prompt, max_tokens=60)
        texts.append(text)

    for _ in range(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(survivor)
            with trio.CancelScope() as victim_scope:
                async with engine.stream(_request("Once upon a time", max_tokens=900)) as events:
                    seen = 0
                    async for event in events:
                        seen += isinstance(event, TextDelta)
                        if seen == 5:
                            # cancel while a decode call of both is inside llama.cpp
                            await wait_for(functools.partial(_both_in_flight, events.progress), step=0.001)
                            victim_scope.cancel()
        if invariant_backend.aborted_calls > aborted:
            break
    assert invariant_backend.aborted_calls > aborted, "no cancel landed inside a shared call"
    assert texts
    assert all(text == solo for text in texts)
    assert invariant_backend.generations.running == 0


async def test_health_is_503_once_the_scheduler_has_failed(
    batched8_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, batched8_backend)
    batched8_backend.simulate_failure(RuntimeError("llama_decode crashed"))  # what the loop records
    try:
        async with running.client() as client:
            response = await client.get("/health")
            body = {"prompt": "Hi", "max_tokens": 2}
            completion = await client.post("/v1/completions", json=body)
    finally:
        batched8_backend.simulate_failure(None)
    assert response.status_code == 503
    body = response.json()
    assert (body["status"], body["error"]) == ("error", "llama_decode crashed")
    assert [m["error"] for m in body["models"].values()] == ["llama_decode crashed"]  # which model
    assert completion.status_code >= 500  # every request would fail: it is refused
    running.server.shutdown()
