"""LoRA adapters (docs/lora.md) on the engine: chosen per request, batched by adapter
set, and never sharing a cache entry across sets (llama.cpp #26207)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from trioserve import Engine, GenerationRequest, LlamaBackend, LlamaSettings, SamplingParams, TextDelta
from trioserve._backends._llama._adapters import adapter_salt, adapters_of_salt
from trioserve._core._exceptions import BackendError, InvalidRequestError

from .._lora import tiny_lora
from ..conftest import THREADS

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, logit_bias={1: -100.0, 106: -100.0})  # (no early end)
#: long enough for whole pieces (cached, reusable) and ending on a cut (its row kept)
PROMPT = "".join(f"In year {1200 + 7 * i} the town built bridge {i} of stone.\n" for i in range(30))


def _settings(model_path: str, lora: tuple[tuple[str, Path, float], ...], **changes: object) -> LlamaSettings:
    options: dict[str, object] = {"n_ctx": 1024, "n_threads": THREADS, "slots": 4, "lora": lora}
    options.update(changes)
    return LlamaSettings(model_path, **options)  # type: ignore[arg-type]


ADAPTERS = (("a", 1), ("b", 2))


@pytest.fixture(scope="module")
def adapted(model_path: str) -> Iterator[LlamaBackend]:
    lora = tuple((name, tiny_lora(seed), 1.0) for name, seed in ADAPTERS)
    backend = LlamaBackend.load(_settings(model_path, lora))
    yield backend
    backend.close()


@asynccontextmanager
async def _engine(backend: LlamaBackend) -> AsyncIterator[Engine]:
    engine = Engine(backend)
    try:
        yield engine
    finally:
        await engine.aclose(close_backend=False)


Lora = tuple[tuple[str | int, float | None], ...]


async def _text(engine: Engine, lora: Lora, max_tokens: int = 16) -> str:
    request = GenerationRequest(prompt=PROMPT, max_tokens=max_tokens, sampling=GREEDY, lora=lora)
    prepared = await engine.prepare(request)
    parts: list[str] = []
    async with engine.stream(prepared) as events:
        async for event in events:
            if type(event) is TextDelta:
                parts.append(event.text)
    return "".join(parts)


async def _fresh(model_path: str, lora: Lora) -> str:
    """The text of one request on a fresh backend that loads only what it needs."""
    names = {name if isinstance(name, str) else ADAPTERS[name][0] for name, _ in lora}
    files = tuple((name, tiny_lora(seed), 1.0) for name, seed in ADAPTERS if name in names)
    backend = await LlamaBackend.aload(_settings(model_path, files, slots=1))
    try:
        async with _engine(backend) as engine:
            return await _text(engine, lora)
    finally:
        await backend.aclose()


async def test_each_adapter_set_answers_as_a_fresh_backend_and_no_cache_entry_is_shared(
    adapted: LlamaBackend, model_path: str
) -> None:
    # the #26207 case: the same prompt with a, then b, then none, then a again — each
    # the text a fresh backend gives for that set (a shared cached prompt would give
    # the previous set's cells to the next request)
    asks: list[Lora] = [(("a", None),), (("b", None),), (), (("a", None),)]
    async with _engine(adapted) as engine:
        texts = [await _text(engine, lora) for lora in asks]
    fresh = {lora: await _fresh(model_path, lora) for lora in asks[:3]}
    assert texts == [fresh[asks[0]], fresh[asks[1]], fresh[()], fresh[asks[0]]]
    assert len({fresh[asks[0]], fresh[asks[1]], fresh[()]}) == 3  # (the adapters change the text)


async def test_scale_zero_is_the_base_model_and_ids_name_adapters_as_llama_server_lists_them(
    adapted: LlamaBackend,
) -> None:
    async with _engine(adapted) as engine:
        base = await _text(engine, ())
        assert await _text(engine, (("a", 0.0),)) == base
        assert await _text(engine, ((1, None),)) == await _text(engine, (("b", 1.0),))
        assert await _text(engine, (("a", 0.0), (1, None))) == await _text(engine, (("b", None),))
        # (another scale is another set: its cells are not the scale 1.0 request's)
        half = GenerationRequest(prompt="", lora=(("a", 0.5),))
        assert adapted.llama_model.adapter_set(half) == (("a", 0.5),)
        assert adapter_salt("key:k", (("a", 0.5),)) != adapter_salt("key:k", (("a", 1.0),))
        assert adapters_of_salt(adapter_salt("key:k", (("a", 0.5), ("b", 2.0)))) == (("a", 0.5), ("b", 2.0))
        assert adapter_salt("key:k", ()) == "key:k"


async def test_unknown_adapters_and_ids_are_refused_naming_those_there_are(adapted: LlamaBackend) -> None:
    async with _engine(adapted) as engine:
        for lora, message in (
            ((("c", None),), "no LoRA adapter named 'c' (adapters: a, b)"),
            (((2, None),), "lora: no adapter with id 2 (ids 0 to 1)"),
            ((("a", None), ("a", 0.5)), "lora: an adapter is named twice"),
        ):
            with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
                await engine.prepare(GenerationRequest(prompt=PROMPT, lora=lora))


async def test_a_model_without_adapters_refuses_lora(llama_backend: LlamaBackend) -> None:
    async with _engine(llama_backend) as engine:
        with pytest.raises(InvalidRequestError, match="has no LoRA adapters"):
            await engine.prepare(GenerationRequest(prompt=PROMPT, lora=(("a", None),)))


def test_an_adapter_of_another_model_or_no_adapter_fails_the_load_with_llama_cpps_reason(
    model_path: str, tmp_path: Path
) -> None:
    with pytest.raises(BackendError, match="LoRA adapter file not found"):
        LlamaBackend.load(_settings(model_path, (("x", tmp_path / "none.gguf", 1.0),), warm_up=False))
    # the base model itself is no adapter
    with pytest.raises(BackendError, match=r"could not load the LoRA adapter .*general.type"):
        LlamaBackend.load(_settings(model_path, (("x", Path(model_path), 1.0),), warm_up=False))
    with pytest.raises(ValueError, match="an adapter's name"):
        _settings(model_path, (("base:x", Path(model_path), 1.0),))


async def test_two_adapters_and_the_base_decoding_together_each_give_their_text_alone(
    model_path: str,
) -> None:
    # batch-invariant: a call's width changes no numerics, so each stream's text in a
    # step shared with the other sets (each set in calls of its own) is its text alone
    lora = tuple((name, tiny_lora(seed), 1.0) for name, seed in ADAPTERS)
    backend = await LlamaBackend.aload(_settings(model_path, lora, slots=6, batch_invariant=True))
    asks: list[tuple[str, Lora]] = [
        (f"Note {i}: the {word} of the river town.\n", set_)
        for i, (word, set_) in enumerate(
            [
                ("bells", (("a", None),)),
                ("ships", (("b", None),)),
                ("roads", ()),
                ("songs", (("a", None),)),
                ("walls", (("b", None),)),
                ("mills", ()),
            ]
        )
    ]
    try:
        async with _engine(backend) as engine:

            async def run(prompt: str, set_: Lora, times: list[float] | None = None) -> str:
                request = GenerationRequest(
                    prompt=prompt, max_tokens=24, sampling=GREEDY, lora=set_, cache_prompt=False
                )
                parts: list[str] = []
                async with engine.stream(await engine.prepare(request)) as events:
                    async for event in events:
                        if type(event) is TextDelta:
                            if not parts and times is not None:
                                times.append(trio.current_time())
                            parts.append(event.text)
                if times is not None:
                    times.append(-trio.current_time())
                return "".join(parts)

            alone = [await run(prompt, set_) for prompt, set_ in asks]
            together: list[str] = [""] * len(asks)
            times: list[float] = []

            async def one(i: int) -> None:
                together[i] = await run(*asks[i], times)

            async with trio.open_nursery() as nursery:
                for i in range(len(asks)):
                    nursery.start_soon(one, i)
        firsts, ends = [t for t in times if t > 0], [-t for t in times if t < 0]
        assert max(firsts) < min(ends)  # (every stream decoded while every other did)
        assert together == alone
    finally:
        await backend.aclose()
