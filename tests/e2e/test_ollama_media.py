"""Ollama's images and fill in the middle go through the paths the other dialects use
(docs/dialects.md, "Ollama"): ``images`` on a vision model (the default model with a tiny
random projector, ``tests/_vision_model.py``) give the text and prompt the same chat
completion with the image gives; ``/api/generate`` with ``suffix`` on a model with FIM
tokens gives the text and prompt of ``/v1/completions``' ``suffix`` (``/infill``'s
layout). Greedy texts compared with texts of the same server: no verdict depends on
which tokens a sampler draws."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import ollama
import pytest
import trio

from trioserve import LlamaBackend, LlamaSettings, default_model_path

from .._helpers import start_server
from .._models import fim_model
from .._vision_model import png_bytes, tiny_gemma3_projector

pytestmark = pytest.mark.model

#: greedy, and no repetition penalty (Ollama's default is 1.1; /v1's is 1.0)
GREEDY = {"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0}


@pytest.fixture(scope="module")
def vision_backend() -> Iterator[LlamaBackend]:
    settings = LlamaSettings(
        default_model_path(), n_ctx=1024, n_threads=2, slots=1, mmproj=tiny_gemma3_projector()
    )
    backend = LlamaBackend.load(settings)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def fim_backend() -> Iterator[LlamaBackend]:
    backend = LlamaBackend.load(LlamaSettings(str(fim_model("plain")), n_ctx=2048, n_threads=2, slots=1))
    yield backend
    backend.close()


async def test_images_give_the_chat_completions_text(
    vision_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, vision_backend)
    image = png_bytes(48, 64, (200, 30, 30))
    model = vision_backend.info.id
    question = "What is in the picture?"
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    async with running.client() as client:
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": [
                    {
                        "role": "user",
                        # (Ollama puts a message's images before its text)
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_url}},
                            {"type": "text", "text": question},
                        ],
                    }
                ],
                "max_tokens": 12,
                "temperature": 0,
            },
        )
    assert chat.status_code == 200, chat.text
    expected = chat.json()

    def calls() -> tuple[Any, Any]:
        with ollama.Client(host=running.url) as sdk:
            messages = [{"role": "user", "content": question, "images": [image]}]
            whole = sdk.chat(model=model, messages=messages, options=GREEDY)
            generated = sdk.generate(model=model, prompt=question, images=[image], options=GREEDY)
        return whole, generated

    whole, generated = await trio.to_thread.run_sync(calls)
    running.server.shutdown()
    assert whole.message.content == expected["choices"][0]["message"]["content"]
    assert whole.prompt_eval_count == expected["usage"]["prompt_tokens"]  # the image's tokens included
    assert generated.response == whole.message.content


async def test_suffix_is_fill_in_the_middle_as_on_v1_completions(
    fim_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, fim_backend)
    before, after = "def area(radius):\n    return ", "\n\n\ndef diameter(radius):\n    return 2 * radius\n"
    model = fim_backend.info.id
    async with running.client() as client:
        completion = await client.post(
            "/v1/completions",
            json={"model": model, "prompt": before, "suffix": after, "max_tokens": 16, "temperature": 0},
        )
        generated = await client.post(
            "/api/generate",
            json={
                "model": model,
                "prompt": before,
                "suffix": after,
                "stream": False,
                "options": {"temperature": 0, "num_predict": 16, "repeat_penalty": 1.0},
            },
        )
    running.server.shutdown()
    assert completion.status_code == 200, completion.text
    assert generated.status_code == 200, generated.text
    expected, answer = completion.json(), generated.json()
    assert answer["response"] == expected["choices"][0]["text"]
    assert answer["prompt_eval_count"] == expected["usage"]["prompt_tokens"]
