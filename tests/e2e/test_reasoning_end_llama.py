"""Ending the reasoning on the llama backend: the end marker's tokens go through the
real scheduler as forced tokens (``Outputs.emit``) — sampler, channel, pieces — and
the wire closes the reasoning block, on a real socket (docs/dialects.md, "Ending
the reasoning").

The model is the default one with a chat template that opens ``<think>``
(``tests/_models.py``, :func:`reasoning_model`). Which tokens it draws never decides
the outcome: every token whose text holds ``<`` (its end-of-turn tokens included) or
is only whitespace is banned by ``logit_bias``, so it can neither write ``</think>``
nor stop, and every token it draws after the marker is visible answer text. A forced
token is never drawn, so the ban does not touch it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import gguf
import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend, LlamaSettings
from trioserve._wire._limits import RequestLimits

from .._helpers import RunningServer, start_server
from .._models import reasoning_model
from ..conftest import THREADS

pytestmark = pytest.mark.model

#: the reasoning lasts until the control: at most this many tokens (never reached)
MAX_TOKENS = 2000


@pytest.fixture(scope="module")
def model() -> str:
    return str(reasoning_model())


@pytest.fixture(scope="module")
def backend(model: str) -> Iterator[LlamaBackend]:
    loaded = LlamaBackend.load(LlamaSettings(model, n_ctx=4096, n_threads=THREADS, slots=1))
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def banned(model: str) -> dict[str, float]:
    """``logit_bias`` banning every token whose text holds ``<`` or is only whitespace."""
    reader = gguf.GGUFReader(model)
    field = reader.fields["tokenizer.ggml.tokens"]
    texts = (bytes(field.parts[i]).decode("utf-8", "replace").replace("\u2581", " ") for i in field.data)
    return {str(token): -100.0 for token, text in enumerate(texts) if "<" in text or not text.strip()}


@pytest.fixture
async def server(
    backend: LlamaBackend, banned: dict[str, float], nursery: trio.Nursery
) -> AsyncIterator[RunningServer]:
    limits = RequestLimits(max_logit_bias=len(banned))
    running = await start_server(nursery, backend, http=HTTPSettings(request_limits=limits))
    yield running
    running.server.shutdown()


async def test_the_forced_marker_closes_the_block(server: RunningServer, banned: dict[str, float]) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count from one to twenty."}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "logit_bias": banned,
        "stream": True,
    }
    reasoning, content, answers = "", "", []
    async with server.client() as client, server.client() as controls:
        marker = (await client.post("/tokenize", json={"content": "</think>"})).json()["tokens"]
        with trio.fail_after(120):
            headers = {"X-Request-Id": "thinker"}
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk: dict[str, Any] = json.loads(line[6:])
                    if len(answers) == 2 or not chunk["choices"]:
                        continue  # (cancelled: its last chunks)
                    assert chunk["choices"][0]["finish_reason"] is None  # (it cannot end by itself)
                    delta = chunk["choices"][0]["delta"]
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""
                    control = {"id": chunk["id"], "action": "reasoning_end"}
                    if reasoning and not answers:
                        answers.append(
                            (await controls.post("/v1/chat/completions/control", json=control)).json()
                        )
                    if content:
                        # the block closed: a second ask finds it ended (one marker)
                        answers.append(
                            (await controls.post("/v1/chat/completions/control", json=control)).json()
                        )
                        assert (await controls.post("/v1/requests/thinker/cancel")).json()["cancelled"]
        await server.wait_idle()
    assert len(marker) > 1  # (the marker is text to this model: several forced tokens)
    assert answers == [{"success": True}, {"success": False, "message": "reasoning already ended"}]
    assert reasoning
    # the marker went whole into the text, once, and was read as the reasoning's end
    assert "<" not in reasoning + content
