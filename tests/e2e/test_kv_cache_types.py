"""KV cache types (``--cache-type-k/-v``; docs/models.md, "KV cache types") with the
real model: the cache's memory is llama.cpp's own figure and q8_0 takes 34/64 of f16's;
a q8_0 cache keeps the prompt cache's promise within its type (a cached answer equals
the q8_0 cache-off server's); a type a model's heads cannot take is a start-up error
naming the flag; and the context length where clients read it — ``/v1/models``
(``context_length``, vLLM's ``max_model_len``), ``/props`` (llama-server's
``default_generation_settings.n_ctx``) — with ``/health``'s ``kv_cache``."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from trioserve import (
    Engine,
    GenerationRequest,
    LlamaBackend,
    LlamaSettings,
    LlamaSource,
    ModelRegistry,
    ModelSpec,
    SamplingParams,
    Server,
    ServerSettings,
    TextDelta,
    Usage,
)
from trioserve._core._exceptions import BackendError

from .._models import tiny_reranker
from ..conftest import THREADS

pytestmark = pytest.mark.model

#: the end tokens (``<eos>``, ``<end_of_turn>``) banned: every text has its full length
NO_END = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 106: -100.0})
_NOTES = "".join(
    f"Note {i}: the keeper of lighthouse {i} logged the weather, trimmed the wick and repaired the lens.\n"
    for i in range(8)
)
#: prompts of whole pieces (lines and sentences: docs/prompt-cache.md, "The cut"), so
#: the same prompt again is a cache hit
PROMPTS = [
    _NOTES + "Summarize the keepers' work in one sentence.\n",
    _NOTES.replace("lighthouse", "mill") + "Write a short recipe for bread.\n1.",
    _NOTES.replace("keeper", "engineer") + "def fibonacci(n):\n",
    _NOTES.replace("weather", "tides") + "Q: Why is the sky blue?\nA:",
]


def _settings(model_path: str, **changes: object) -> LlamaSettings:
    options: dict[str, object] = {"n_ctx": 2048, "n_threads": THREADS, "slots": 1, "warm_up": False}
    options.update(changes)
    return LlamaSettings(model_path, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def q8_backend(model_path: str) -> Iterator[LlamaBackend]:
    backend = LlamaBackend.load(_settings(model_path, cache_type_k="q8_0", cache_type_v="q8_0"))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def q8_uncached_backend(model_path: str) -> Iterator[LlamaBackend]:
    """The q8_0 reference: a fresh evaluation of every prompt."""
    backend = LlamaBackend.load(
        _settings(model_path, cache_type_k="q8_0", cache_type_v="q8_0", prompt_cache=False)
    )
    yield backend
    backend.close()


async def _complete(backend: LlamaBackend, prompt: str, max_tokens: int = 16) -> tuple[str, Usage]:
    engine = Engine(backend)
    try:
        prepared = await engine.prepare(
            GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=NO_END)
        )
        parts: list[str] = []
        async with engine.stream(prepared) as events:
            async for event in events:
                if type(event) is TextDelta:
                    parts.append(event.text)
            return "".join(parts), events.usage
    finally:
        await engine.aclose(close_backend=False)


def _llama_cpp_kv_mib(text: str) -> float:
    """The KV cache llama.cpp says it allocated (its ``llama_kv_cache: size = … MiB``
    lines: one per cache, the sliding-window layers' and the others')."""
    return sum(float(m) for m in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", text))


@pytest.mark.parametrize(("type_k", "type_v"), [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "f16")])
async def test_the_kv_memory_at_load_is_llama_cpp_s_own_figure(
    model_path: str, type_k: str, type_v: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trioserve.llama_cpp")
    caplog.set_level(logging.DEBUG, logger="trioserve.llama")
    # 3 slots of 1000 tokens: llama.cpp rounds each sequence's cells up (to 1024)
    backend = await LlamaBackend.aload(
        _settings(model_path, slots=3, n_ctx=1000, cache_type_k=type_k, cache_type_v=type_v)
    )
    try:
        memory = backend.kv_memory
        stats = backend.stats()
    finally:
        await backend.aclose()
    assert memory is not None
    assert (memory.type_k, memory.type_v, memory.slots, memory.ctx_per_slot) == (type_k, type_v, 3, 1024)
    said = _llama_cpp_kv_mib(caplog.text)
    assert said > 0
    assert abs(memory.bytes / (1 << 20) - said) < 0.011  # (llama.cpp prints two decimals)
    assert stats["kv_cache"] == memory.as_dict()
    mib = memory.bytes / (1 << 20)
    line = f"KV cache: {mib:.1f} MiB for 3 slot(s) × 1024 tokens, K type {type_k}, V type {type_v}"
    assert line in caplog.text


async def test_q8_0_takes_34_64ths_of_f16_s_memory(model_path: str) -> None:
    sizes = {}
    for kind in ("f16", "q8_0"):
        # (every layer's cells: the computed figure, exact to the byte — kept to the
        # window, the figure is llama.cpp's, printed in MiB to two decimals)
        backend = await LlamaBackend.aload(
            _settings(model_path, slots=2, n_ctx=4096, cache_type_k=kind, cache_type_v=kind, swa_full=True)
        )
        try:
            assert backend.kv_memory is not None
            sizes[kind] = backend.kv_memory.bytes
        finally:
            await backend.aclose()
    # a q8_0 block: 32 values in 34 bytes (a f16 scale and 32 int8); f16: 64 bytes
    assert sizes["q8_0"] * 64 == sizes["f16"] * 34


async def test_a_q8_0_cache_hit_gives_the_q8_0_fresh_text(
    q8_backend: LlamaBackend, q8_uncached_backend: LlamaBackend
) -> None:
    """The exactness promise holds within one cache type: the same prompt again (a
    whole hit) and a next turn (a prefix hit) answer as a fresh q8_0 evaluation."""
    q8_backend.clear_cache()
    for prompt in PROMPTS:
        fresh, _ = await _complete(q8_uncached_backend, prompt)
        first, usage = await _complete(q8_backend, prompt)
        again, hit = await _complete(q8_backend, prompt)
        assert usage.completion_tokens == hit.completion_tokens == 16
        assert hit.cached_tokens > 0
        assert first == again == fresh
    conversation = PROMPTS[3] + " Because of the way air scatters light.\nQ: And why are sunsets red?\nA:"
    fresh, _ = await _complete(q8_uncached_backend, conversation)
    turn, usage = await _complete(q8_backend, conversation)
    assert usage.cached_tokens > 0
    assert turn == fresh


async def test_a_cache_type_the_model_s_heads_cannot_take_is_a_start_up_error_naming_the_flag() -> None:
    # the tiny reranker's heads are 16 values: q8_0's 32-value blocks do not divide them
    model = tiny_reranker()
    for changes, flag in (
        ({"cache_type_k": "q8_0"}, "--cache-type-k q8_0"),
        ({"cache_type_v": "q4_0"}, "--cache-type-v q4_0"),
    ):
        with pytest.raises(BackendError) as refused:
            await LlamaBackend.aload(_settings(str(model), **changes))
        message = str(refused.value)
        assert flag in message
        assert "does not divide n_embd_head" in message  # (llama.cpp's own reason)


def test_an_unknown_cache_type_is_refused_listing_the_accepted_ones(model_path: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"cache_type_v must be one of f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, got 'q3'",
    ):
        LlamaSettings(model_path, cache_type_v="q3")


def test_a_source_s_host_tier_is_not_reused_by_a_load_of_other_cache_types(model_path: str) -> None:
    source = LlamaSource(_settings(model_path))
    host = source.host_cache()
    assert host is not None
    assert source.host_cache() is host
    source.settings = _settings(model_path, cache_type_k="q8_0", cache_type_v="q8_0")
    other = source.host_cache()
    assert other is not None
    assert other is not host
    assert other.kv_types == "q8_0/q8_0"


@pytest.fixture(scope="module")
def model_copies(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("models")
    copies = {}
    for name in ("plain", "small"):
        target = directory / f"{name}.gguf"
        os.link(model_path, target)
        copies[name] = target
    return copies


async def test_clients_read_the_context_in_v1_models_props_and_health(
    nursery: trio.Nursery, model_copies: dict[str, Path]
) -> None:
    plain = LlamaSource(_settings(str(model_copies["plain"]), n_ctx=1024, slots=2))
    small = LlamaSource(
        _settings(str(model_copies["small"]), n_ctx=512, slots=1, cache_type_k="q8_0", cache_type_v="q8_0")
    )
    registry = ModelRegistry([ModelSpec(name="plain", source=plain), ModelSpec(name="small", source=small)])
    server = Server(registry, ServerSettings(host="127.0.0.1", port=0, shutdown_grace=0.0))
    binds = await nursery.start(server.run)
    await server.ready.wait()
    async with httpx.AsyncClient(base_url=binds[0], timeout=120) as client:
        # before any load: what each will load with
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert {name: (m["context_length"], m["max_model_len"]) for name, m in listed.items()} == {
            "plain": (1024, 1024),
            "small": (512, 512),
        }
        props = (await client.get("/props", params={"model": "small"})).json()
        assert props["default_generation_settings"]["n_ctx"] == 512
        assert props["total_slots"] == 1
        assert props["is_sleeping"] is True
        body = {"model": "small", "prompt": "Once upon a time", "max_tokens": 2, "logit_bias": {"1": -100}}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        one = (await client.get("/v1/models/small")).json()
        assert (one["context_length"], one["max_model_len"]) == (512, 512)
        props = (await client.get("/props", params={"model": "small"})).json()
        assert props["is_sleeping"] is False
        assert props["default_generation_settings"]["n_ctx"] == 512
        assert props["eos_token"] == "<eos>"
        assert isinstance(props["chat_template"], str)  # (the GGUF's; this one has none)
        assert props["build_info"].startswith("trioserve")
        default = (await client.get("/props")).json()
        assert (default["model_alias"], default["default_generation_settings"]["n_ctx"]) == ("plain", 1024)
        missing = await client.get("/props", params={"model": "nowhere"})
        assert missing.status_code == 404
        assert "available: plain, small" in missing.json()["error"]["message"]
        health = (await client.get("/health")).json()
        kv = health["models"]["small"]["batch"]["kv_cache"]
        assert (kv["type_k"], kv["type_v"], kv["slots"], kv["ctx_per_slot"]) == ("q8_0", "q8_0", 1, 512)
        assert kv["bytes"] == kv["k_bytes"] + kv["v_bytes"] > 0
    server.shutdown()
