"""The prompt cache (docs/prompt-cache.md): a request pays only for what is new, and the
cache never changes a text — every text here is compared with the same request's text
on a backend with the cache off."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio

from trioserve import (
    Constraint,
    Engine,
    GenerationRequest,
    LlamaBackend,
    LlamaSettings,
    SamplingParams,
    TextDelta,
    Usage,
)
from trioserve._backends._cache._prompt_cache import shared_prefix

from .._helpers import RunningServer, start_server, wait_for
from ..conftest import THREADS

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)


@contextlib.asynccontextmanager
async def _engine(backend: LlamaBackend) -> AsyncIterator[Engine]:
    """An engine over a session-wide backend (which it leaves open)."""
    engine = Engine(backend)
    try:
        yield engine
    finally:
        await engine.aclose(close_backend=False)


async def _complete(
    engine: Engine, prompt: str, *, max_tokens: int = 24, cache: bool = True
) -> tuple[str, Usage]:
    request = GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, cache_prompt=cache)
    return await _complete_request(engine, request)


async def _complete_request(engine: Engine, request: GenerationRequest) -> tuple[str, Usage]:
    prepared = await engine.prepare(request)
    parts: list[str] = []
    async with engine.stream(prepared) as events:
        async for event in events:
            if type(event) is TextDelta:
                parts.append(event.text)
        return "".join(parts), events.usage


def _turn(topic: str, i: int) -> str:
    return f"\nUser: question {i}: what do you know about {topic}? Say it in detail, with examples. " * 4


async def test_a_conversation_served_from_the_cache_equals_the_cache_off_text(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without the idle recompute of replies (tested below), what is reused is exactly
    # what the previous prompt left in whole pieces and this one shares
    monkeypatch.setattr(llama_backend, "idle_recompute", False)
    # long enough to pass Gemma 3's 512-token sliding window: every layer's cells count
    tag = uuid.uuid4().hex
    prompts: list[str] = []
    cached: list[int] = []
    async with _engine(llama_backend) as on, _engine(uncached_backend) as off:
        prompt = f"[{tag}] A long conversation about the sea."
        for i in range(6):
            prompt += _turn("the sea", i) + "\nAssistant:"
            text, usage = await _complete(on, prompt)
            reference, reference_usage = await _complete(off, prompt)
            assert text == reference, f"turn {i}: the cached answer differs"
            assert reference_usage.cached_tokens == 0
            prompts.append(prompt)
            cached.append(usage.cached_tokens)
            prompt += text
    rule = llama_backend.piece_rule
    assert usage.prompt_tokens > 600  # (the last turn's: past the 512-token window)
    assert cached[0] == 0
    for i in range(1, 6):
        # what the previous turn left (its prompt's whole pieces) and this prompt shares
        before, now = llama_backend.tokenize(prompts[i - 1]), llama_backend.tokenize(prompts[i])
        kept = max(rule.cuts(before), default=0)
        limit = max((c for c in rule.cuts(now) if c < len(now)), default=0)
        assert cached[i] == shared_prefix(before[:kept], now, rule.cuts(now), min(kept, limit))
    assert cached[-1] >= 384


async def test_a_conversation_past_where_deep_pieces_start_equals_the_cache_off_text(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``deep_from`` (1,024 tokens) a piece ends only at a turn header or after
    ``deep_chunk`` (512) tokens (docs/prompt-cache.md, "Deep pieces"): a conversation
    that grows past it is cut so on a fresh server and from the cache alike, and every
    answer is the cache-off answer."""
    monkeypatch.setattr(llama_backend, "idle_recompute", False)
    rule = llama_backend.piece_rule
    assert (rule.deep_from, rule.deep_piece) == (1024, 512)
    shown = llama_backend.cache_stats()  # (what /health says of them)
    assert shown["deep_pieces"] == {"from": 1024, "piece": 512}
    assert shown["piece_rule_key"] == rule.key
    assert str(shown["piece_rule_key"]).endswith("/deep1024:512")
    tag = uuid.uuid4().hex
    sentence = "The harbour master counted the ships that came in from the north. "
    prompt = f"[{tag}] "
    cached: list[int] = []
    async with _engine(llama_backend) as on, _engine(uncached_backend) as off:
        for i in range(3):
            prompt += _gemma_turn("user", f"Part {i}. " + sentence * 45) + "<start_of_turn>model\n"
            text, usage = await _complete(on, prompt)
            reference, _ = await _complete(off, prompt)
            assert text == reference, f"turn {i}: the cached answer differs"
            cached.append(usage.cached_tokens)
            prompt += text + "<end_of_turn>\n"
    tokens = llama_backend.tokenize(prompt)
    cuts = rule.cuts(tokens)
    assert len(tokens) > 1800  # (the three turns' own text: the replies add what they drew)
    deep = [(a, b) for a, b in itertools.pairwise([0, *cuts]) if a >= 1024]
    # the deep pieces: whole 512-token ones inside the long turn, header-ended ones else
    assert any(b - a == 512 for a, b in deep)
    assert all(b - a == 512 or rule.after_header(tokens, b) for a, b in deep)
    # and each turn reused the whole of the turn before it (its prompt ends on a header)
    assert cached[0] == 0
    assert cached[1] > 600
    assert cached[2] > 1200


async def test_the_same_prompt_again_reevaluates_only_its_last_piece(llama_backend: LlamaBackend) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + "The history of the city is long and varied. " * 40
    async with _engine(llama_backend) as engine:
        first, cold = await _complete(engine, prompt)
        again, warm = await _complete(engine, prompt)
    tokens = llama_backend.tokenize(prompt)
    assert first == again
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == max(c for c in llama_backend.piece_rule.cuts(tokens) if c < len(tokens))


async def test_cache_prompt_false_neither_reuses_nor_leaves_a_prefix(llama_backend: LlamaBackend) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + "Once upon a time, a fox and a crow met by the river. " * 30
    async with _engine(llama_backend) as engine:
        _, first = await _complete(engine, prompt, cache=False)
        _, second = await _complete(engine, prompt)  # nothing was left behind
        _, third = await _complete(engine, prompt, cache=False)  # and nothing is reused
    assert (first.cached_tokens, second.cached_tokens, third.cached_tokens) == (0, 0, 0)


async def test_a_prompt_cancelled_mid_prefill_keeps_the_chunks_it_finished(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + "The history of the city is long and varied. " * 150
    chunk = llama_backend.settings.prefill_chunk
    async with _engine(llama_backend) as engine:
        prepared = await engine.prepare(GenerationRequest(prompt=prompt, max_tokens=24, sampling=GREEDY))
        total = len(prepared.tokens)
        done_at_cancel = 0
        with trio.CancelScope() as scope:
            async with engine.stream(prepared) as events:
                progress = events.progress
                # inside llama.cpp, evaluating a chunk, with at least 3 chunks finished
                await wait_for(
                    lambda: (
                        progress.prefilled_tokens >= 3 * chunk
                        and llama_backend.in_flight(progress) == "prefill"
                    ),
                    limit=60,
                )
                done_at_cancel = progress.prefilled_tokens
                assert done_at_cancel < total - chunk  # cancelled mid-prefill
                scope.cancel()
                async for _ in events:
                    pass
        assert scope.cancelled_caught
        assert llama_backend.generations.running == 0
        text, usage = await _complete(engine, prompt)
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete(off, prompt)
    assert usage.cached_tokens >= done_at_cancel  # the retry evaluated only the rest
    assert text == reference


async def test_a_cancelled_decode_leaves_nothing_that_changes_the_next_answer(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    prompt = f"[{uuid.uuid4().hex}] Write a long story about a lighthouse keeper." + " And then?" * 60
    async with _engine(llama_backend) as engine:
        prepared = await engine.prepare(GenerationRequest(prompt=prompt, max_tokens=200, sampling=GREEDY))
        with trio.CancelScope() as scope:
            async with engine.stream(prepared) as events:
                seen = 0
                async for event in events:
                    seen += type(event) is TextDelta
                    if seen == 5:
                        scope.cancel()
        text, usage = await _complete(engine, prompt + " The keeper")
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete(off, prompt + " The keeper")
    assert usage.cached_tokens > 0
    assert text == reference


async def test_interleaved_conversations_in_batch_invariant_mode_equal_their_texts_alone(
    invariant_backend: LlamaBackend,
) -> None:
    """Three conversations at once, turn by turn, on the batch-invariant backend with
    the cache: each turn's text equals the same prompt alone with ``cache_prompt``
    false (a fresh server's answer: batch-invariant mode has its own kernels)."""
    tag = uuid.uuid4().hex
    topics = ("the sea", "mountains", "old trains")
    prompts = {topic: f"[{tag}] A conversation about {topic}." for topic in topics}
    results: dict[str, list[tuple[str, Usage]]] = {topic: [] for topic in topics}
    async with _engine(invariant_backend) as engine:
        for i in range(3):

            async def turn(topic: str, i: int = i) -> None:
                prompts[topic] += _turn(topic, i) + "\nAssistant:"
                text, usage = await _complete(engine, prompts[topic])
                results[topic].append((text, usage))

            async with trio.open_nursery() as nursery:
                for topic in topics:
                    nursery.start_soon(turn, topic)
            for topic in topics:
                prompts[topic] += results[topic][-1][0]
    async with _engine(invariant_backend) as alone:
        for topic in topics:
            prompt = f"[{tag}] A conversation about {topic}."
            for i, (text, usage) in enumerate(results[topic]):
                prompt += _turn(topic, i) + "\nAssistant:"
                reference, _ = await _complete(alone, prompt, cache=False)
                assert text == reference, f"{topic}, turn {i}: the cached answer differs"
                if i:
                    assert usage.cached_tokens > 0
                prompt += text


async def test_cached_tokens_reach_the_openai_sdk_the_metrics_and_health(llama_server: RunningServer) -> None:
    model = llama_server.engine.backend.info.id
    prompt = f"[{uuid.uuid4().hex}] " + "Water boils at 100 degrees Celsius at sea level. " * 30
    url = llama_server.url + "/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
        first = await client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        second = await client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage is not None
    assert second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert cached > 0

    # the final usage chunk of a stream (httpx: the SDK's async stream leaves generators open)
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with llama_server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}

    async with llama_server.client() as http:
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    cache = health["batch"]["cache"]
    assert cache["enabled"] is True
    assert cache["tokens"] >= cached
    assert cache["kv_bytes"] > 0
    assert f"trioserve_prompt_tokens_cached_total {float(2 * cached)}" in metrics
    budget = re.search(r"^trioserve_prompt_cache_ram_budget_bytes (\S+)$", metrics, re.M)
    assert budget is not None
    assert float(budget.group(1)) == cache["ram"]["budget_bytes"]
    for name in ("ram_bytes", "saves_total", "restores_total", "evictions_total", "idle_chunks_total"):
        assert f"\ntrioserve_prompt_cache_{name} " in metrics
    # which speculation path the model runs (the default: auto, no pad rows)
    speculation = health["batch"]["speculation"]
    assert speculation["mode"] == "auto"
    assert speculation["pad_context"] is None
    assert 'trioserve_speculation_models{mode="auto",padded="no"} 1.0' in metrics
    assert "\ntrioserve_speculation_padded_steps_total 0.0" in metrics

    body = {"prompt": prompt, "max_tokens": 2, "cache_prompt": False}
    async with llama_server.client() as http:
        response = (await http.post("/v1/completions", json=body)).json()
    assert response["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    await wait_for(lambda: llama_server.engine.active_streams == 0)


async def test_a_prefix_evicted_to_host_memory_is_restored_exactly(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """One sequence: a second conversation evicts the first one's cells; its prefix
    goes to host memory and comes back for the first conversation's next turn."""
    first = f"[{uuid.uuid4().hex}] " + "The history of the city is long and varied. " * 40
    other = f"[{uuid.uuid4().hex}] " + "Once upon a time, a fox and a crow met by the river. " * 30
    host = llama_backend.host_tier
    async with _engine(llama_backend) as engine:
        text, _ = await _complete(engine, first)
        saves, restores = host.saves, host.restores
        await _complete(engine, other)  # evicts the first prefix from the cells
        assert host.saves == saves + 1
        follow_up = first + text + " And then?"
        answer, usage = await _complete(engine, follow_up)
        assert host.restores == restores + 1
    chunk = llama_backend.settings.prefill_chunk
    assert usage.cached_tokens >= len(llama_backend.tokenize(first)) // chunk * chunk - chunk
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete(off, follow_up)
    assert answer == reference
    stats = llama_backend.cache_stats()["ram"]
    assert isinstance(stats, dict)
    assert 0 < stats["bytes"] <= stats["budget_bytes"]


async def test_a_saved_prefix_past_the_sliding_window_is_never_restored_short(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """A saved sequence state keeps a sliding-window layer's cells only for its last
    ``n_swa`` positions (Gemma 3: 512). So an entry longer than that cannot give back a
    much shorter prefix: the tokens after it would attend to cells the state dropped
    (measured before this was handled: max |Δlogit| 22.6, and another text). The prefix
    is then evaluated, and the text is the cache-off text."""
    host = llama_backend.host_tier
    assert host.window == 512  # (Gemma 3's; the model of these tests)
    head = f"[{uuid.uuid4().hex}] " + "The history of the city is long and varied. " * 12
    long = head + "The harbour was rebuilt in stone, and the market grew around it. " * 50
    assert len(llama_backend.tokenize(long)) > 700
    other = f"[{uuid.uuid4().hex}] " + "Once upon a time, a fox and a crow met by the river. " * 30
    short = head + " What happened to the walls?"
    rule = llama_backend.piece_rule
    async with _engine(llama_backend) as engine:
        await _complete(engine, long, max_tokens=1)
        saves, restores = host.saves, host.restores
        await _complete(engine, other, max_tokens=1)  # evicts the long prefix to host memory
        await _complete(engine, other + " And?", max_tokens=1)
        assert host.saves > saves
        tokens = llama_backend.tokenize(short)
        # the host tier shares some pieces with the short prompt, but cannot serve them
        assert host.best(tokens, rule.cuts(tokens), len(tokens) - 1) is None
        answer, _ = await _complete(engine, short)
        assert host.restores == restores
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete(off, short)
    assert answer == reference


async def test_a_prompt_whose_reply_pushed_it_past_the_window_comes_back_from_host_memory(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """The same long prompt asked again after it was evicted (regenerate, a repeated
    question): the idle recompute had extended its cells with the reply, past the
    sliding window, and a state of all of them cannot give back the prompt alone (the
    test above). So the eviction also saves a checkpoint at the prompt's end (its cells
    alone, then their state): the prompt comes back from host memory, and the text is
    the cache-off text."""
    host = llama_backend.host_tier
    rule = llama_backend.piece_rule
    prompt = (
        f"[{uuid.uuid4().hex}] " + "The harbour was rebuilt in stone, and the market grew around it. " * 30
    )
    tokens = llama_backend.tokenize(prompt)
    assert 400 < len(tokens) < host.window
    prompt_end = max(c for c in rule.cuts(tokens) if c < len(tokens))
    other = f"[{uuid.uuid4().hex}] " + "Once upon a time, a fox and a crow met by the river. " * 10
    async with _engine(llama_backend) as engine:
        before = llama_backend.snapshot().idle_chunks
        # the end tokens banned: 160 tokens, whatever this CPU draws
        no_end = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 106: -100.0})
        _, usage = await _complete_request(
            engine, GenerationRequest(prompt=prompt, max_tokens=160, sampling=no_end)
        )
        assert usage.completion_tokens == 160
        await wait_for(
            lambda: (snap := llama_backend.snapshot()).idle_chunks > before and not snap.idle_pending,
            limit=60,
        )
        kept = next(c for c in llama_backend.snapshot().cached if list(c[: len(tokens)]) == tokens)
        # (what this test is about: a state of all the cells cannot give back the prompt)
        assert not host.usable(len(kept), prompt_end)
        saves, restores = host.saves, host.restores
        await _complete(engine, other, max_tokens=1)  # evicts it to host memory
        assert host.saves == saves + 2  # the whole and the checkpoint
        answer, usage = await _complete(engine, prompt)
        assert host.restores == restores + 1
        assert usage.cached_tokens == prompt_end
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete(off, prompt)
    assert answer == reference


def _gemma_turn(role: str, text: str) -> str:
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


async def test_a_finished_reply_is_recomputed_while_idle_and_the_next_turn_evaluates_only_its_own_text(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """The reply was decoded a token at a time, so as it is its cells are not reusable.
    While the server is idle it evaluates the reply again — with the end of the turn and
    the next user header, guessed from the prompt's own turns — in the pieces the next
    prompt will be cut into; the next turn then evaluates only its new text, and its
    text is the cache-off text. (Token prompts: the next turn holds the very tokens the
    server generated, whatever this CPU drew.)"""
    rule = llama_backend.piece_rule
    question = " Tell me about the keeper, the stairs, the lamp and the storms." * 3
    first = llama_backend.tokenize(
        f"[{uuid.uuid4().hex}] " + _gemma_turn("user", question) + "<start_of_turn>model\n"
    )
    assert len(first) in rule.cuts(first)  # the prompt ends on a cut: its last piece is kept
    guess = rule.continuation(first)
    assert guess == llama_backend.tokenize("<end_of_turn>\n<start_of_turn>user\n", add_bos=False)
    idle = llama_backend
    async with _engine(llama_backend) as engine:
        before = idle.snapshot().idle_chunks
        # the end tokens banned: 24 tokens, whatever this CPU draws
        no_end = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 106: -100.0})
        request = GenerationRequest(prompt=first, max_tokens=24, sampling=no_end)
        _, usage = await _complete_request(engine, request)
        assert usage.completion_tokens == 24
        # the user reads; the server recomputes the reply and the guessed header
        await wait_for(
            lambda: idle.snapshot().idle_chunks > before and not idle.snapshot().idle_pending, limit=60
        )
        kept = next(list(tokens) for tokens in idle.snapshot().cached if list(tokens[: len(first)]) == first)
        assert len(kept) == len(first) + 24 + len(guess)  # the reply and the guess, whole
        assert kept[-len(guess) :] == guess
        follow_up = kept + llama_backend.tokenize(
            " What happens in a storm?<end_of_turn>\n<start_of_turn>model\n", add_bos=False
        )
        answer, usage = await _complete_request(
            engine, GenerationRequest(prompt=follow_up, max_tokens=24, sampling=GREEDY)
        )
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete_request(
            off, GenerationRequest(prompt=follow_up, max_tokens=24, sampling=GREEDY)
        )
    # evaluated: the new text only — what llama-server evaluates, and exact
    assert usage.cached_tokens == len(kept)
    assert answer == reference


async def test_a_request_aborts_the_idle_recompute_in_flight_and_stays_exact(
    batched_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """A request that arrives while a reply is being recomputed aborts that call (the
        abort flag, inside llama.cpp), the aborted piece's cells go, the request's text is
        the cache-off text, and the recompute ends later, when idle (two sequences: the
    request takes the other one). (The phase is reached by
        waiting for the call to be in flight; the submit lands inside one of the reply's
        ~128-token calls, ~240 ms each — a few conversations are tried until one does.)"""
    idle = batched_backend
    no_end = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 106: -100.0})
    aborted = idle.snapshot().idle_aborted
    async with _engine(batched_backend) as engine:
        for attempt in range(5):
            first = batched_backend.tokenize(
                f"[{uuid.uuid4().hex}] "
                + _gemma_turn("user", "Write a long story about a lighthouse.")
                + "<start_of_turn>model\n"
            )
            await _complete_request(engine, GenerationRequest(prompt=first, max_tokens=400, sampling=no_end))
            await wait_for(lambda: idle.snapshot().idle_in_flight, limit=30)
            question = f"[{attempt}] What do you know about storms at sea? " * 3
            answer, _ = await _complete_request(engine, GenerationRequest(prompt=question, sampling=GREEDY))
            async with _engine(uncached_backend) as off:
                reference, _ = await _complete_request(
                    off, GenerationRequest(prompt=question, sampling=GREEDY)
                )
            assert answer == reference
            if idle.snapshot().idle_aborted > aborted:
                break
        assert idle.snapshot().idle_aborted > aborted  # a recompute call was aborted by the request
        await wait_for(lambda: not idle.snapshot().idle_pending, limit=60)  # and finished when idle


async def test_the_next_turn_sent_at_once_lets_the_recompute_of_its_own_reply_finish(
    batched_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """An agent sends the next turn as soon as the reply ends: the recompute of that
    reply is then the next turn's own first piece, so it is not aborted (it would be
    evaluated again at once) — the turn reuses it, and its text is the cache-off text."""
    idle = batched_backend
    no_end = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 106: -100.0})
    first = batched_backend.tokenize(
        f"[{uuid.uuid4().hex}] "
        + _gemma_turn("user", "Write a long story about a lighthouse.")
        + "<start_of_turn>model\n"
    )
    aborted = idle.snapshot().idle_aborted
    async with _engine(batched_backend) as engine:
        await _complete_request(engine, GenerationRequest(prompt=first, max_tokens=60, sampling=no_end))
        await wait_for(lambda: idle.snapshot().idle_in_flight, limit=30)
        kept = list(idle.snapshot().idle_call_tokens)  # the piece in flight: the reply and the guessed header
        # (60 tokens and the guess: shorter than any break in running text, one piece)
        assert len(kept) == len(first) + 60 + len(batched_backend.piece_rule.continuation(first))
        follow_up = kept + batched_backend.tokenize(
            " And then?<end_of_turn>\n<start_of_turn>model\n", add_bos=False
        )
        answer, usage = await _complete_request(engine, GenerationRequest(prompt=follow_up, sampling=GREEDY))
    assert idle.snapshot().idle_aborted == aborted
    assert usage.cached_tokens == len(kept)
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete_request(off, GenerationRequest(prompt=follow_up, sampling=GREEDY))
    assert answer == reference


async def test_a_changed_early_message_reuses_up_to_the_cut_before_the_change(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """A client edits an earlier message of its conversation: what comes back from the
    cache is the prefix up to the last cut before the first changed token — the turn
    header of the changed message, here — never a cell after it; the text is the
    cache-off text."""
    tag = uuid.uuid4().hex
    turns = [
        f"[{tag}] Question {i}: tell me about the harbour, the ships and the trade. " * 3 for i in range(3)
    ]

    def render(texts: list[str]) -> str:
        replies = "".join(
            _gemma_turn("user", t) + _gemma_turn("model", f"Answer {i}.") for i, t in enumerate(texts[:-1])
        )
        return replies + _gemma_turn("user", texts[-1]) + "<start_of_turn>model\n"

    rule = llama_backend.piece_rule
    async with _engine(llama_backend) as engine:
        await _complete(engine, render(turns), max_tokens=4)
        edited = [turns[0], turns[1].replace("harbour", "market"), turns[2]]
        text, usage = await _complete(engine, render(edited))
    before, after = llama_backend.tokenize(render(turns)), llama_backend.tokenize(render(edited))
    changed = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    header = max(c for c in rule.cuts(after) if c <= changed)
    assert llama_backend.detokenize(after[header - 2 : header]) == b"user\n"  # the edited turn's header
    assert usage.cached_tokens == header
    async with _engine(uncached_backend) as off:
        reference, _ = await _complete(off, render(edited))
    assert text == reference


async def test_fast_mode_reuses_the_reply_and_the_partial_chunk(model_path: str) -> None:
    """``cache_mode="fast"`` keeps every computed cell and reuses any matching prefix
    (as llama-server does; its answers may differ from a fresh server's, so only the
    reuse is checked here)."""
    backend = await LlamaBackend.aload(
        LlamaSettings(model_path, n_ctx=2048, n_threads=THREADS, slots=1, cache_mode="fast")
    )
    async with _engine(backend) as engine:
        prompt = f"[{uuid.uuid4().hex}] " + "The history of the city is long and varied. " * 20
        reply, first = await _complete(engine, prompt, max_tokens=16)
        _, second = await _complete(engine, prompt + reply + " Go on.")
    await backend.aclose()
    assert backend.cache_stats()["mode"] == "fast"
    assert first.cached_tokens == 0
    # the whole first prompt and most of the reply's cells (not a multiple of the chunk)
    assert second.cached_tokens >= first.prompt_tokens + 8


async def _choices(engine: Engine, prompt: str, n: int, max_tokens: int) -> list[str]:
    request = GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY)
    texts: list[list[str]] = [[] for _ in range(n)]

    async def read(index: int, events: Any) -> None:
        async for event in events:
            if type(event) is TextDelta:
                texts[index].append(event.text)

    async with (
        engine.stream_choices(await engine.prepare(request), n) as streams,
        trio.open_nursery() as nursery,
    ):
        for index, events in enumerate(streams):
            nursery.start_soon(read, index, events)
    return ["".join(parts) for parts in texts]


async def test_the_cells_shared_between_choices_are_exact_in_host_memory(
    model_path: str, uncached_backend: LlamaBackend
) -> None:
    """``n`` = 2 shares the prompt's cells; those cells, saved to host memory when the
    follower's id is taken again and restored later, give the fresh-server text. (A
    copy that llama.cpp applies only at the next decode — ``llama_memory_seq_cp``
    between streams — saved stale cells here: the restored prompt answered otherwise.)"""
    topic = uuid.uuid4().hex
    prompt = _turn(topic, 1) * 3  # > 2 chunks
    others = [_turn(uuid.uuid4().hex, 2) * 3 for _ in range(2)]
    async with _engine(uncached_backend) as fresh:
        reference, _ = await _complete(fresh, prompt, max_tokens=16)
    # no idle recompute: its decode would apply a copy llama.cpp had left pending, and
    # hide it
    settings = LlamaSettings(model_path, n_ctx=2048, n_threads=THREADS, slots=2, idle_recompute=False)
    batched_backend = await LlamaBackend.aload(settings)
    async with Engine(batched_backend) as engine:
        for other in others:  # both ids hold other cells: nothing of the prompt is left
            await _complete(engine, other, max_tokens=1)
        assert await _choices(engine, prompt, 2, 1)  # both ids keep the prompt's chunks
        # (the prompt's length depends on how its random topic tokenizes: whole pieces of it)
        tokens = list((await engine.prepare(GenerationRequest(prompt=prompt))).tokens)
        chunks = max(batched_backend.piece_rule.cuts(tokens))
        assert chunks >= 256
        assert batched_backend.cache_stats()["sequences"] == [chunks, chunks]
        assert await _choices(engine, prompt, 2, 1)  # the follower's id: its prefix saved
        for other in others:  # both ids taken by other prompts
            await _complete(engine, other, max_tokens=1)
        restores = batched_backend.cache_stats()["ram"]["restores"]  # type: ignore[index]
        text, usage = await _complete(engine, prompt, max_tokens=16)
        assert batched_backend.cache_stats()["ram"]["restores"] == restores + 1  # type: ignore[index]
        assert usage.cached_tokens > 0
        assert text == reference
        assert await _choices(engine, prompt, 2, 16) == [reference, reference]


# ---------------------------------------------------------------- isolation between API keys (issue 33)

KEYS = ("sk-key-a", "sk-key-b", "sk-key-c")


def _evaluated(metrics: str) -> float:
    found = re.search(r"^trioserve_prompt_tokens_evaluated_total (\S+)$", metrics, re.M)
    assert found is not None
    return float(found.group(1))


async def test_each_api_key_has_a_prompt_cache_of_its_own(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """Two keys, the same system prompt: key B's first request reuses nothing of key A's
    (``cached_tokens`` 0, the whole prompt evaluated), its second reuses its own; key A's
    prefix, moved to host memory when B took the one sequence, comes back for A alone;
    the Anthropic dialect (``x-api-key``) is keyed the same way; and a ``cache_salt`` in
    the body shares deliberately, across keys."""
    server = await start_server(nursery, llama_backend, api_keys=KEYS)
    # (shorter than Gemma 3's 512-token sliding window, with the reply: a saved state of
    # it gives back any prefix, so key A's comes back from host memory below)
    system = f"[{uuid.uuid4().hex}] You are a guide to the history of the sea. " * 6

    def chat(question: str, **extra: object) -> dict[str, object]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return {"messages": messages, "max_tokens": 6, "temperature": 0, **extra}

    async def ask(key: str, body: dict[str, object], path: str = "/v1/chat/completions") -> dict[str, Any]:
        headers = {"x-api-key": key} if path == "/v1/messages" else {"Authorization": f"Bearer {key}"}
        async with server.client() as http:
            response = await http.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        reply: dict[str, Any] = response.json()
        return reply

    def evaluated() -> float:
        return _evaluated(server.server.state.metrics.render().decode())

    def cached(reply: dict[str, Any]) -> int:
        details: int = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        return details

    a1 = await ask(KEYS[0], chat("Name one ocean."))
    a2 = await ask(KEYS[0], chat("Name one sea."))
    assert cached(a1) == 0
    assert cached(a2) > 0  # key A's own system prompt

    b1 = await ask(KEYS[1], chat("Name one sea."))
    assert cached(b1) == 0  # nothing of key A's
    # the whole prompt evaluated: the server's counter (a fresh server's; written once
    # each response is sent) holds what A's two prompts evaluated, then all of B's
    total = sum(r["usage"]["prompt_tokens"] - cached(r) for r in (a1, a2)) + b1["usage"]["prompt_tokens"]
    await wait_for(lambda: evaluated() >= total)
    assert evaluated() == total
    assert b1["choices"][0]["message"] == a2["choices"][0]["message"]  # the same text, computed again
    b2 = await ask(KEYS[1], chat("Name one ocean."))
    assert cached(b2) == cached(a2)  # its own, now
    a3 = await ask(KEYS[0], chat("Name one river."))
    assert cached(a3) == cached(a2)  # key A's prefix, back from host memory (saved under A's salt)

    # the Anthropic dialect: the key comes as x-api-key; key C shares nothing either
    messages = {
        "system": system,
        "messages": [{"role": "user", "content": "Name one sea."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    c1 = await ask(KEYS[2], messages, "/v1/messages")
    c2 = await ask(KEYS[2], messages, "/v1/messages")
    assert c1["usage"]["cache_read_input_tokens"] == 0
    assert c2["usage"]["cache_read_input_tokens"] > 0

    # a cache_salt in the body: whoever sends the same one shares (here: keys A and B)
    salt = uuid.uuid4().hex
    shared_a = await ask(KEYS[0], chat("Name one bay.", cache_salt=salt))
    shared_b = await ask(KEYS[1], chat("Name one gulf.", cache_salt=salt))
    assert cached(shared_a) == 0  # (a salt of its own: not key A's cache)
    assert cached(shared_b) == cached(a2)
    async with server.client(headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
        response = await http.post("/v1/chat/completions", json=chat("x", cache_salt=""))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"

    # the host tier's bytes against the server's one budget (--cache-ram), in /metrics
    metrics = server.server.state.metrics.render().decode()
    budget = re.search(r"^trioserve_prompt_cache_host_budget_bytes (\S+)$", metrics, re.M)
    held = re.search(r"^trioserve_prompt_cache_host_bytes (\S+)$", metrics, re.M)
    assert budget is not None
    assert held is not None
    assert float(budget.group(1)) == llama_backend.settings.cache_ram_bytes
    assert 0 < float(held.group(1)) <= float(budget.group(1))  # (key A's and B's prefixes at least)
    server.server.shutdown()


async def test_health_without_a_key_says_only_the_status(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """With API keys, ``/health`` stays open for load balancers, but tells a caller
    without a valid key only the status: no models, paths, slots, cache or system info."""
    server = await start_server(nursery, llama_backend, api_keys=KEYS)
    async with server.client() as http:
        anonymous = await http.get("/health")
        wrong = await http.get("/health", headers={"Authorization": "Bearer sk-not-a-key"})
        bearer = await http.get("/health", headers={"Authorization": f"Bearer {KEYS[1]}"})
        anthropic = await http.get("/health", headers={"x-api-key": KEYS[2]})
    assert anonymous.status_code == wrong.status_code == bearer.status_code == 200
    assert anonymous.json() == {"status": "ok"}
    assert wrong.json() == {"status": "ok"}
    assert len(anonymous.content) < 32
    for full in (bearer.json(), anthropic.json()):
        assert full["status"] == "ok"
        assert set(full) >= {"models", "batch", "platform", "slots"}
        assert "sequences" in full["batch"]["cache"]
    server.server.shutdown()


async def _stream_all(engine: Engine, request: GenerationRequest) -> tuple[str, list[Any], Usage]:
    """The text, the log-probabilities (each delta's) and the usage of ``request``."""
    prepared = await engine.prepare(request)
    parts: list[str] = []
    logprobs: list[Any] = []
    async with engine.stream(prepared) as events:
        async for event in events:
            if type(event) is TextDelta:
                parts.append(event.text)
                logprobs.extend(event.logprobs or ())
        return "".join(parts), logprobs, events.usage


async def test_the_same_chat_prompt_again_is_a_full_hit_drawn_from_the_kept_row_with_the_same_text(
    llama_backend: LlamaBackend, uncached_backend: LlamaBackend
) -> None:
    """A prompt that ends on a cut (a chat prompt ends on its model header) keeps every
    cell and its last logits: the same prompt again evaluates nothing — its first token
    is drawn from the kept row — and every draw equals the fresh evaluation's: greedy, a
    seeded sampler chain (llama.cpp's chain applied to the kept row as
    ``llama_sampler_sample`` applies it to the context's), a constraint's mask (applied
    to a copy: the kept row stays as computed) with log-probabilities."""
    prompt = llama_backend.tokenize(
        f"[{uuid.uuid4().hex}] "
        + _gemma_turn("user", "Describe the harbour at dawn, the boats and the gulls. " * 12)
        + "<start_of_turn>model\n"
    )
    assert len(prompt) in llama_backend.piece_rule.cuts(prompt)  # it ends on a cut
    no_end = {1: -100.0, 106: -100.0}  # the end tokens banned: every run is 24 tokens long
    asks = [
        GenerationRequest(
            prompt=prompt, max_tokens=24, sampling=SamplingParams(temperature=0.0, logit_bias=no_end)
        ),
        GenerationRequest(
            prompt=prompt,
            max_tokens=24,
            sampling=SamplingParams(temperature=0.9, top_k=40, seed=1234, logit_bias=no_end),
        ),
        GenerationRequest(
            prompt=prompt,
            max_tokens=24,
            sampling=GREEDY,
            constraint=Constraint(
                kind="json_schema",
                source=json.dumps({"type": "object", "properties": {"harbour": {"type": "string"}}}),
            ),
            logprobs=3,
        ),
    ]
    async with _engine(uncached_backend) as off:
        fresh = [await _stream_all(off, ask) for ask in asks]
    async with _engine(llama_backend) as engine:
        first = await _stream_all(engine, asks[0])  # a new prompt: its last piece evaluated
        hits_before = llama_backend.cache_stats()["whole_hits"]
        again = [await _stream_all(engine, ask) for ask in asks]
        # and the plain greedy once more, after a mask was applied to a copy of the row
        last = await _stream_all(engine, asks[0])
    assert first[2].cached_tokens < len(prompt)
    assert first[0] == fresh[0][0]
    assert llama_backend.cache_stats()["whole_hits"] == hits_before + 4  # type: ignore[operator]
    for (text, logprobs, _), (text_again, logprobs_again, usage_again) in zip(fresh, again, strict=True):
        assert usage_again.cached_tokens == len(prompt)  # nothing was evaluated
        assert text_again == text
        assert logprobs_again == logprobs
    assert fresh[2][1]  # (log-probabilities were reported)
    assert last[0] == fresh[0][0]


async def test_choices_of_a_constrained_request_keep_their_rows_unmasked(
    model_path: str, uncached_backend: LlamaBackend
) -> None:
    """``n`` = 2 with a JSON schema: the choices share the leader's output row, and the
    leader's draw masks that row in place. Each id keeps the row as computed (kept
    before any draw), so the same prompt unconstrained, a full hit on either id,
    answers the cache-off text."""
    prompt = (
        f"[{uuid.uuid4().hex}] "
        + _gemma_turn("user", "List the colours of the harbour's boats. " * 10)
        + "<start_of_turn>model\n"
    )
    async with _engine(uncached_backend) as fresh:
        reference, _ = await _complete(fresh, prompt, max_tokens=16)
    settings = LlamaSettings(model_path, n_ctx=2048, n_threads=THREADS, slots=2, idle_recompute=False)
    backend = await LlamaBackend.aload(settings)
    async with Engine(backend) as engine:
        tokens = list((await engine.prepare(GenerationRequest(prompt=prompt))).tokens)
        assert len(tokens) in backend.piece_rule.cuts(tokens)  # it ends on a cut
        schema = json.dumps({"type": "object", "properties": {"colour": {"type": "string"}}})
        constrained = GenerationRequest(
            prompt=prompt,
            max_tokens=4,
            sampling=GREEDY,
            constraint=Constraint(kind="json_schema", source=schema),
        )

        async def drain(events: Any) -> None:
            async for _ in events:
                pass

        async with (
            engine.stream_choices(await engine.prepare(constrained), 2) as streams,
            trio.open_nursery() as nursery,
        ):
            for events in streams:
                nursery.start_soon(drain, events)
        assert backend.cache_stats()["sequences"] == [len(tokens), len(tokens)]
        hits = backend.cache_stats()["whole_hits"]
        # both ids at once: each a full hit from its own row
        texts: list[str] = []

        async def one() -> None:
            texts.append((await _complete(engine, prompt, max_tokens=16))[0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
        assert backend.cache_stats()["whole_hits"] == hits + 2  # type: ignore[operator]
    assert texts == [reference, reference]
