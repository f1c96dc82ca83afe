"""The official ``anthropic`` SDK (and Claude Code's request shape) against
``trioserve serve`` on the default model, in a subprocess on a real socket: Anthropic's
Messages API, streamed and not, tools, count_tokens, keys, the prompt cache across
turns (docs/dialects.md).

The SDK no longer has a ``temperature`` parameter; greedy requests send it in the body
(``extra_body``), which trioserve honours. No verdict depends on which tokens a sampler
draws: texts are compared with other texts of the same server, a forced call is checked
against its schema, counts against counts."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

KEY = "sk-test-anthropic"
ALIAS = "claude-sonnet-4-5-20250929"
GREEDY = {"temperature": 0}
CLAUDE_CODE = Path(__file__).parents[1] / "data" / "claude_code_request.json"
#: the prompt cache keeps whole chunks of this many tokens (LlamaSettings.prefill_chunk)
CHUNK = 128


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess("--threads", "2", "--api-key", KEY, "--model-alias", ALIAS) as server:
        url = server.wait_ready()
        yield url
        assert server.stop() == 0


@pytest.fixture
def client(server_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server_url, api_key=KEY, max_retries=0) as sdk:
        yield sdk


def test_create_and_stream_give_the_same_text(client: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": ALIAS,
        "max_tokens": 40,
        "system": "You answer in one sentence.",
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "extra_body": GREEDY,
    }
    message = client.messages.create(**request)
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == ALIAS or message.model  # the server's own id
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content[0].type == "text"
    with client.messages.stream(**request) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    # streamed, not one piece (unless the greedy answer, which differs by CPU, is a token or two)
    assert len(deltas) > 1 or message.usage.output_tokens <= 2
    assert "".join(deltas) == message.content[0].text
    assert final.content[0].type == "text"
    assert final.content[0].text == message.content[0].text
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 40


WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CITIES = [
    "Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Rome", "Seoul", "Accra",
    "Hanoi", "Dakar", "Perth", "Bern", "Riga", "Doha", "Kyiv", "Lagos", "Sofia", "Minsk",
]  # fmt: skip


def test_a_forced_tool_use_validates_against_its_schema_twenty_times(client: anthropic.Anthropic) -> None:
    for i, city in enumerate(CITIES):
        forced = {"type": "any"} if i % 2 else {"type": "tool", "name": "get_weather"}
        message = client.messages.create(
            model=ALIAS,
            max_tokens=80,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=forced,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
        )
        assert message.stop_reason == "tool_use", message
        (block,) = message.content
        assert block.type == "tool_use"
        assert block.name == "get_weather"
        assert block.id.startswith("toolu_")
        jsonschema.validate(block.input, WEATHER["input_schema"])


def test_a_streamed_forced_tool_use_accumulates_to_valid_input(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=ALIAS,
        max_tokens=80,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's own event for input_json_delta
    (block,) = final.content
    assert block.type == "tool_use"
    jsonschema.validate(block.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"


def test_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    question = {"role": "user", "content": "What is the weather in Rome?"}
    first = client.messages.create(
        model=ALIAS,
        max_tokens=80,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        messages=[question],  # type: ignore[list-item]
    )
    (call,) = first.content
    assert call.type == "tool_use"
    history: list[Any] = [
        question,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees and sunny"}],
        },
    ]
    answer = client.messages.create(
        model=ALIAS,
        max_tokens=30,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "none"},
        messages=history,
        extra_body=GREEDY,
    )
    assert answer.content[0].type == "text"
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # the result is in the prompt: it counts
    without = client.messages.count_tokens(model=ALIAS, messages=history[:1])
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) > without.input_tokens


def test_count_tokens_equals_the_prompt_the_server_reports(client: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": ALIAS,
        "system": [{"type": "text", "text": "You are a careful assistant."}],
        "messages": [{"role": "user", "content": f"Tell me about {CITIES[5]} in {len(CITIES)} words."}],
        "tools": [WEATHER],
    }
    counted = client.messages.count_tokens(**request)
    message = client.messages.create(max_tokens=5, **request)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert counted.input_tokens > 20


def test_keys_and_errors_in_anthropic_shape(server_url: str) -> None:
    message = {"role": "user", "content": "hi"}
    with (
        anthropic.Anthropic(base_url=server_url, api_key="wrong", max_retries=0) as bad,
        pytest.raises(anthropic.AuthenticationError) as caught,
    ):
        bad.messages.create(model=ALIAS, max_tokens=5, messages=[message])  # type: ignore[list-item]
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "the API key is not valid for this server"},
    }
    with anthropic.Anthropic(base_url=server_url, api_key=KEY, max_retries=0) as sdk:
        with pytest.raises(anthropic.NotFoundError):
            sdk.messages.create(model="no-such-model", max_tokens=5, messages=[message])  # type: ignore[list-item]
        with pytest.raises(anthropic.BadRequestError) as bad_request:
            sdk.messages.create(
                model=ALIAS,
                max_tokens=5,
                messages=[message],  # type: ignore[list-item]
                extra_body={"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}]},
            )
        assert "mcp_servers" in str(bad_request.value)


def _claude_code_headers() -> dict[str, str]:
    """The headers Claude Code sends (its key as x-api-key)."""
    return {
        "x-api-key": KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
        "fine-grained-tool-streaming-2025-05-14",
        "anthropic-dangerous-direct-browser-access": "true",
        "user-agent": "claude-cli/2.1.160 (external, cli)",
        "x-app": "cli",
    }


def _stream_events(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def test_a_claude_code_request_as_recorded_is_answered(server_url: str) -> None:
    """The recorded body as it is (billing header in ``system[0]``, ``system`` roles
    inside ``messages``, its tools, ``?beta=true``, its headers, ``max_tokens`` 32,000 on
    a 4,096-token context: an upper bound, as Anthropic's) starts streaming text; the
    client then leaves, as Claude Code does on ESC."""
    body = json.loads(CLAUDE_CODE.read_text())
    with httpx.Client(base_url=server_url, headers=_claude_code_headers(), timeout=120) as http:
        with http.stream("POST", "/v1/messages?beta=true", json=body) as response:
            assert response.status_code == 200, response.read()
            events: list[dict[str, Any]] = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
                if events and events[-1]["type"] == "content_block_delta":
                    break
        assert events[0]["type"] == "message_start"
        assert events[0]["message"]["usage"]["input_tokens"] > 3 * CHUNK
        health = http.get("/health").json()
    assert health["status"] == "ok"


def test_a_claude_code_conversation_reuses_the_cache_on_its_next_turn(server_url: str) -> None:
    """Claude Code's shape over two turns: the second — a new billing hash, the reply
    appended, a system reminder inside ``messages``, a new question — reuses the whole
    first turn's prompt from the cache (issue 23; before it, up to a chunk less)."""
    first_body = {**json.loads(CLAUDE_CODE.read_text()), "max_tokens": 40}
    with httpx.Client(base_url=server_url, headers=_claude_code_headers(), timeout=120) as http:
        with http.stream("POST", "/v1/messages?beta=true", json=first_body) as response:
            assert response.status_code == 200, response.read()
            first = _stream_events(response)
        assert first[0]["type"] == "message_start"
        assert first[-1]["type"] == "message_stop"
        end = first[-2]
        assert end["type"] == "message_delta"
        first_prompt = end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]
        reply: list[dict[str, Any]] = []
        for event in first:
            if event["type"] == "content_block_start":
                reply.append(copy.deepcopy(event["content_block"]))
            elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                reply[-1]["text"] += event["delta"]["text"]
            elif event["type"] == "content_block_delta":
                reply[-1]["partial"] = reply[-1].get("partial", "") + event["delta"]["partial_json"]
        for block in reply:
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("partial", "{}"))
        assert reply, "the reply has content"

        second_body = copy.deepcopy(first_body)
        billing = first_body["system"][0]["text"]
        second_body["system"][0]["text"] = billing.replace("cch=8f3c2a91d4", "cch=5d1e0b7a3c")
        second_body["messages"].append({"role": "assistant", "content": reply})
        if reply[-1]["type"] == "tool_use":
            result = {"type": "tool_result", "tool_use_id": reply[-1]["id"], "content": "# Project"}
            second_body["messages"].append({"role": "user", "content": [result]})
        reminder = "<system-reminder>Todo list is empty.</system-reminder>"
        second_body["messages"].append({"role": "system", "content": reminder})
        second_body["messages"].append({"role": "user", "content": "Thanks. Now summarise it in one line."})
        second_body.update(stream=False, max_tokens=16)
        response = http.post("/v1/messages?beta=true", json=second_body)
        assert response.status_code == 200, response.text
        second = anthropic.types.Message.model_validate(response.json())
    cached = second.usage.cache_read_input_tokens or 0
    print(
        f"\nClaude Code shape: turn 1 prompt {first_prompt} tokens; "
        f"turn 2 reused {cached}, evaluated {second.usage.input_tokens}"
    )
    assert first_prompt > 3 * CHUNK  # the tools and system prompt: several chunks
    # the whole first prompt: it ends on a cut (its generation header) the second shares
    assert cached >= first_prompt, (cached, first_prompt)
    assert second.usage.input_tokens + cached > first_prompt
