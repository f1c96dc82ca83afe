"""The official ``openai`` SDK against ``trioserve serve`` running as a user runs it:
a subprocess on the default model, on a real socket."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess("--threads", "2") as server:
        url = server.wait_ready()
        yield url
        assert server.stop() == 0


@pytest.fixture
def client(server_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_sdk_streams_completions_incrementally_and_matches_non_stream(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    arrivals: list[float] = []
    parts: list[str] = []
    usage = None
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=50,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=50, temperature=0)
    assert "".join(parts) == whole.choices[0].text
    assert len(arrivals) > 10
    assert arrivals[-1] - arrivals[0] > 0.2  # incremental, not one burst
    assert usage is not None
    assert whole.usage is not None
    assert usage.completion_tokens == 50 == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens == 5  # <bos> Once upon a time
    assert usage.total_tokens == 55


def test_sdk_streams_chat_and_matches_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    roles, parts, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            roles.append(delta.role)
            parts.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    whole = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=40,
        temperature=0,  # type: ignore[arg-type]
    )
    assert roles[0] == "assistant"
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None
    assert whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_sdk_sees_clear_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="best_of is not supported") as refused:
        client.completions.create(model=client.models.list().data[0].id, prompt="x", best_of=2)
    assert refused.value.param == "best_of"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="x")


def test_sdk_accepts_a_deadline_final_event(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="Once upon a time",
        max_tokens=2000,
        stream=True,
        extra_headers={"X-Request-Timeout": "1.5"},
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"  # OpenAI's value: the SDK's type holds it
    assert (chunks[-1].model_extra or {})["trioserve"]["end_cause"] == "deadline"
    assert sum(len(c.choices[0].text) for c in chunks if c.choices) > 0
