"""A reasoning model's thinking, through every dialect with the official SDKs, on a
real socket: the scripted backend plays a model whose chat template opens ``<think>``
(there is no reasoning GGUF here; the split is the same code whatever makes the text).
Anthropic: a ``thinking`` block before the text; OpenAI chat: ``reasoning_content``;
Responses: a ``reasoning`` item (docs/dialects.md, "Reasoning")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import trio

from trioserve import ScriptedBackend

from .._helpers import RunningServer, start_server

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
)
#: what the model writes after the prompt opened its reasoning
SCRIPT = [b"Two", b" and two", b".</thi", b"nk>", b"\n\n", b"Four", b"."]


@pytest.fixture
async def server(nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, ScriptedBackend(SCRIPT, chat_template=TEMPLATE), close_backend=True)
    yield running
    running.server.shutdown()


async def test_anthropic_thinking_blocks(server: RunningServer) -> None:
    request = {"model": "scripted", "max_tokens": 50, "messages": [{"role": "user", "content": "2+2?"}]}
    budgeted = {**request, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0) as sdk:
        message = await sdk.messages.create(**request)  # type: ignore[call-overload]
        async with sdk.messages.stream(**request) as stream:  # type: ignore[arg-type]
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
        with pytest.raises(anthropic.BadRequestError) as caught:
            await sdk.messages.create(**budgeted)  # type: ignore[call-overload]
    assert "thinking.budget_tokens" in str(caught.value)  # a reasoning model's budget: refused
    for result in (message, streamed):
        assert [block.type for block in result.content] == ["thinking", "text"]
        assert result.content[0].thinking == "Two and two."
        assert result.content[1].text == "Four."
    assert "thinking" in kinds  # the SDK's event for thinking_delta
    assert "signature" in kinds  # and for the signature_delta before the block closes


async def test_openai_chat_reasoning_content_and_responses_reasoning_item(server: RunningServer) -> None:
    """(The sync SDK in a thread: the async one's streams leave async generators for
    Trio's finalizer, which warns.)"""
    messages: list[Any] = [{"role": "user", "content": "2+2?"}]

    def calls() -> tuple[Any, str, str, Any, Any]:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as sdk:
            chat = sdk.chat.completions.create(model="scripted", messages=messages)
            reasoning, content = "", ""
            with sdk.chat.completions.create(model="scripted", messages=messages, stream=True) as chunks:
                for chunk in chunks:
                    if chunk.choices:
                        delta = chunk.choices[0].delta
                        reasoning += getattr(delta, "reasoning_content", None) or ""
                        content += delta.content or ""
            response = sdk.responses.create(model="scripted", input="2+2?")
            with sdk.responses.stream(model="scripted", input="2+2?") as stream:
                streamed = stream.get_final_response()
        return chat, reasoning, content, response, streamed

    chat, reasoning, content, response, streamed = await trio.to_thread.run_sync(calls)
    assert chat.choices[0].message.content == "Four."
    assert getattr(chat.choices[0].message, "reasoning_content", None) == "Two and two."
    assert (reasoning, content) == ("Two and two.", "Four.")
    for result in (response, streamed):
        assert [item.type for item in result.output] == ["reasoning", "message"]
        assert result.output[0].content[0].text == "Two and two."
        assert result.output_text == "Four."
