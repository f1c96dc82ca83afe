"""A sliding-window model's window layers kept to their window (``--no-swa-full``,
llama-server's default; docs/prompt-cache.md, "Window layers"), with the real model
(Gemma 3: 15 of its 18 layers see the last 512 positions): the KV memory is llama.cpp's
own figure and a fraction of the full one; a conversation's next turn still reuses
its prompt and answers the cache-off text; a prefix whose window cells are gone is not
reused (evaluated again, the text unchanged) — the trade this mode makes. Every
reuse — the cells trimmed back, a checkpoint, a state restored from host memory —
gives the cache-off server's log-probabilities to the last bit: the window's ring is
laid out as a fresh evaluation leaves it (docs/prompt-cache.md, "The window's ring,
exact")."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from trioserve import (
    Engine,
    GenerationRequest,
    LlamaBackend,
    LlamaSettings,
    SamplingParams,
    TextDelta,
    TokenLogprob,
    Usage,
)

from ..conftest import THREADS

pytestmark = pytest.mark.model

#: the end tokens (``<eos>``, ``<end_of_turn>``) banned: every text has its full length
NO_END = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 106: -100.0})
GREEDY = SamplingParams(temperature=0.0)


def _settings(model_path: str, **changes: object) -> LlamaSettings:
    options: dict[str, object] = {"n_ctx": 4096, "n_threads": THREADS, "slots": 1, "swa_full": False}
    options.update(changes)
    return LlamaSettings(model_path, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def window(model_path: str) -> Iterator[LlamaBackend]:
    backend = LlamaBackend.load(_settings(model_path, idle_recompute=False))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def window_uncached(model_path: str) -> Iterator[LlamaBackend]:
    backend = LlamaBackend.load(_settings(model_path, prompt_cache=False))
    yield backend
    backend.close()


@contextlib.asynccontextmanager
async def _engine(backend: LlamaBackend) -> AsyncIterator[Engine]:
    engine = Engine(backend)
    try:
        yield engine
    finally:
        await engine.aclose(close_backend=False)


async def _run(
    engine: Engine, prompt: list[int], max_tokens: int, sampling: SamplingParams
) -> tuple[str, Usage]:
    text, usage, _ = await _run_logprobs(engine, prompt, max_tokens, sampling)
    return text, usage


async def _run_logprobs(
    engine: Engine, prompt: list[int], max_tokens: int, sampling: SamplingParams
) -> tuple[str, Usage, list[TokenLogprob]]:
    """The text, the usage, and each token's log-probability with its 5 likeliest."""
    request = GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling, logprobs=5)
    prepared = await engine.prepare(request)
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async with engine.stream(prepared) as events:
        async for event in events:
            if type(event) is TextDelta:
                parts.append(event.text)
                logprobs.extend(event.logprobs or ())
        return "".join(parts), events.usage, logprobs


def _ring(backend: LlamaBackend) -> dict[str, int]:
    ring = backend.cache_stats()["window_ring"]
    assert isinstance(ring, dict)
    return ring


def _restores(backend: LlamaBackend) -> int:
    window = backend.cache_stats()["window_checkpoints"]
    assert isinstance(window, dict)
    restores = window["restores"]
    assert isinstance(restores, int)
    return restores


def _next_turn(backend: LlamaBackend, first: list[int], reply: str, question: str) -> list[int]:
    """``first``, its ``reply``, and a next user turn asking ``question``."""
    return (
        first
        + backend.tokenize(reply, add_bos=False)
        + backend.tokenize(
            "<end_of_turn>\n" + _turn("user", question) + "<start_of_turn>model\n", add_bos=False
        )
    )


def _turn(role: str, text: str) -> str:
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


def test_the_window_layers_hold_a_fraction_of_the_kv_memory(model_path: str) -> None:
    full = LlamaBackend.load(_settings(model_path, slots=2, n_ctx=8192, swa_full=True, warm_up=False))
    try:
        whole = full.kv_memory
    finally:
        full.close()
    kept = LlamaBackend.load(_settings(model_path, slots=2, n_ctx=8192, warm_up=False))
    try:
        windowed = kept.kv_memory
    finally:
        kept.close()
    assert whole is not None
    assert windowed is not None
    # 3 full-attention layers of 18 keep 2 × 8,192 cells; the 15 window layers about
    # the window and a batch each (llama.cpp's own figure)
    assert windowed.bytes < whole.bytes / 3
    assert windowed.as_dict()["swa_full"] is False
    assert whole.as_dict()["swa_full"] is True
    assert "--no-swa-full" in windowed.describe()


@pytest.mark.parametrize("repeats", [100, 125], ids=["holes-inside-the-ring", "holes-round-its-end"])
async def test_a_next_turn_past_the_window_reuses_its_prompt_and_answers_the_cache_off_text(
    window: LlamaBackend, window_uncached: LlamaBackend, repeats: int
) -> None:
    """A ~1,500- or ~1,900-token prompt (past the window and a batch: its first cells'
    window rows are gone), a 200-token reply decoded a token at a time, then the next
    turn: it reuses the previous prompt (its window cells still reach), and its
    log-probabilities are the cache-off server's. The reply's cells, trimmed off, are
    holes in the ring of 1,024 cells: inside it (left as they are) or round its end
    (the ring laid out again)."""
    first = window.tokenize(
        f"[{uuid.uuid4().hex}] "
        + _turn("user", "Tell me about the harbour, its stones, its people and the long years. " * repeats)
        + "<start_of_turn>model\n"
    )
    ring = _ring(window)["cells"]
    assert 1500 < len(first) < 2 * ring
    around = len(first) % ring + 200 >= ring  # (the reply's cells reach the ring's last one)
    assert around == (repeats == 125)
    async with _engine(window) as engine:
        relays = _ring(window)["relays"]
        reply, usage = await _run(engine, first, 200, NO_END)
        assert usage.completion_tokens == 200
        # (the reply's cells go when it ends: the trim that may lay the ring out)
        assert _ring(window)["relays"] == relays + around
        follow_up = _next_turn(window, first, reply, "And what about its future?")
        answer, usage, logprobs = await _run_logprobs(engine, follow_up, 24, GREEDY)
    async with _engine(window_uncached) as off:
        reference, _, fresh = await _run_logprobs(off, follow_up, 24, GREEDY)
    assert usage.cached_tokens == len(first)  # the previous prompt, whole
    assert answer == reference
    assert logprobs == fresh  # every token's log-probabilities, to the last bit


@pytest.fixture(scope="module")
def unmarked(model_path: str) -> Iterator[LlamaBackend]:
    backend = LlamaBackend.load(_settings(model_path, idle_recompute=False, ctx_checkpoints=0))
    yield backend
    backend.close()


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "no-checkpoints"])
async def test_a_shared_head_past_the_window_comes_back_from_a_checkpoint_with_the_same_text(
    window: LlamaBackend, unmarked: LlamaBackend, window_uncached: LlamaBackend, checkpoints: bool
) -> None:
    """Two prompts sharing a ~600-token head; the first runs on ~1,800 tokens past it.
    The window layers' cells of the head's last 512 positions are gone from the cells
    (what ``--swa-full`` keeps). With checkpoints (``--ctx-checkpoints``, the default),
    the one taken where the head's turn starts gives them back: the second prompt
    reuses the whole head. Without, it evaluates the head again. Both answer the
    cache-off text."""
    backend = window if checkpoints else unmarked
    head = window.tokenize(
        f"[{uuid.uuid4().hex}] "
        + _turn("user", "The rules of the game are these: move, wait, and count. " * 40)
        + "<start_of_turn>user\n"
    )
    tail = window.tokenize(
        "Now a long story about the sea and the ships that sail it. " * 140
        + "<end_of_turn>\n<start_of_turn>model\n",
        add_bos=False,
    )
    other = window.tokenize("Who wins?<end_of_turn>\n<start_of_turn>model\n", add_bos=False)
    rule = window.piece_rule
    # (the head ends on a cut of both prompts: a turn's header)
    assert len(head) in rule.cuts(head + tail)
    assert len(head) in rule.cuts(head + other)
    async with _engine(backend) as engine:
        restores = _restores(backend) if checkpoints else 0
        await _run(engine, head + tail, 4, NO_END)
        assert len(tail) > 1500
        answer, usage, logprobs = await _run_logprobs(engine, head + other, 24, GREEDY)
    async with _engine(window_uncached) as off:
        reference, _, fresh = await _run_logprobs(off, head + other, 24, GREEDY)
    if checkpoints:
        assert usage.cached_tokens == len(head)  # the whole head, its window cells restored
        assert _restores(backend) == restores + 1
    else:
        assert usage.cached_tokens < len(head) - 512  # the head's window cells were not there
        assert backend.cache_stats()["window_checkpoints"] is None
    assert answer == reference
    assert logprobs == fresh


async def test_a_conversation_restored_from_host_memory_gives_the_cache_off_bits(
    window: LlamaBackend, window_uncached: LlamaBackend
) -> None:
    """One id: a ~1,500-token conversation and its 200-token reply, then another prompt
    takes the id (the conversation's cells saved to host memory), then the
    conversation's next turn restores them — a state whose window cells sat in a ring
    gone round, laid out again as they go in. Its log-probabilities are the cache-off
    server's; the same state restored as saved gives other bits
    (``scripts/probes/ring_exact.py``: "restored, as saved")."""
    first = window.tokenize(
        f"[{uuid.uuid4().hex}] "
        + _turn("user", "The lighthouse keeper counted the ships and the storms. " * 110)
        + "<start_of_turn>model\n"
    )
    assert len(first) > 1100
    async with _engine(window) as engine:
        reply, _ = await _run(engine, first, 200, NO_END)
        other = window.tokenize(f"[{uuid.uuid4().hex}] " + _turn("user", "Hello.") + "<start_of_turn>model\n")
        restores = window.cache_stats()["ram"]["restores"]  # type: ignore[index]
        await _run(engine, other, 4, NO_END)
        follow_up = _next_turn(window, first, reply, "Which storm was the worst?")
        answer, usage, logprobs = await _run_logprobs(engine, follow_up, 24, GREEDY)
    async with _engine(window_uncached) as off:
        reference, _, fresh = await _run_logprobs(off, follow_up, 24, GREEDY)
    assert usage.cached_tokens == len(first)
    assert window.cache_stats()["ram"]["restores"] == restores + 1  # type: ignore[index]
    assert answer == reference
    assert logprobs == fresh
