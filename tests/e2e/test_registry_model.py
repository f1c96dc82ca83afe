"""The registry with a real model (llama.cpp): a close never frees a model under a
worker thread that still uses it."""

from __future__ import annotations

import threading
from typing import Any

import trio
import trio.testing

from trioserve import LlamaSettings, LlamaSource, ModelRegistry, ModelSpec


async def test_aclose_never_frees_a_model_under_a_running_tokenizer_thread(model_path: str) -> None:
    """SIGTERM during a large /tokenize: the registry closes while a worker thread
    tokenizes ~4 MiB with the model; it waits for that lease, then frees the model —
    no crash, and the tokens are whole."""
    spec = ModelSpec(name="m", source=LlamaSource(LlamaSettings(model_path, n_ctx=512, n_threads=2, slots=1)))
    registry = ModelRegistry([spec])
    text = "The quick brown fox jumps over the lazy dog. " * (4 * 1024 * 1024 // 45)
    in_thread = threading.Event()
    freed_after: list[bool] = []
    tokens: list[int] = []
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery, registry:
            async with registry.lease("m") as lease:
                # the tokenizer the backend's tokenize_text runs in its worker thread:
                # the loaded model's (the backend holds it: LlamaBackend.llama_model)
                model: Any = lease.engine.backend.llama_model
                original = model.tokenize

                def tokenize(*args: Any, **kwargs: Any) -> list[int]:
                    in_thread.set()
                    return list(original(*args, **kwargs))

                model.tokenize = tokenize
            registry.on_unloaded.append(lambda _entry, _engine: freed_after.append(bool(tokens)))

            async def tokenizer() -> None:
                # what POST /tokenize does: a lease around the tokenizer's thread (the
                # close cancels the block; the thread is waited for, never abandoned)
                async with registry.lease("m") as held:
                    tokens.extend(await held.engine.backend.tokenize_text(text))

            nursery.start_soon(tokenizer)
            assert await trio.to_thread.run_sync(in_thread.wait, 120), "the tokenizer thread never started"
            # the registry is closed: the thread had returned before the model was freed
    assert freed_after == [True]
    assert len(tokens) > 100_000
    assert registry.snapshot().model("m").state == "unloaded"
