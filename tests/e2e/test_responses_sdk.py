"""The official ``openai`` SDK's Responses API, and the openai-agents SDK with its default
(Responses) model, against ``trioserve serve`` on the default model, in a subprocess on
a real socket (docs/dialects.md). No verdict depends on which tokens a sampler draws:
texts are compared with texts of the same server, structured outputs with their
schemas."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pydantic
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


@pytest.fixture(scope="module")
def model(server_url: str) -> str:
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused") as sdk:
        return sdk.models.list().data[0].id


def test_create_and_stream_give_the_same_text(client: openai.OpenAI, model: str) -> None:
    request: dict[str, Any] = {
        "model": model,
        "instructions": "Answer in one sentence.",
        "input": "Why is the sky blue?",
        "max_output_tokens": 40,
        "temperature": 0,
        "store": False,
    }
    response = client.responses.create(**request)
    assert response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    assert response.usage is not None
    with client.responses.stream(**request) as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert kinds[0] == "response.created"
    # streamed, not one piece (unless the greedy answer, which differs by CPU, is a token or two)
    assert len(deltas) > 1 or response.usage.output_tokens <= 2
    assert "".join(deltas) == response.output_text
    assert final.output_text == response.output_text
    assert final.status == response.status
    assert final.usage is not None
    assert final.usage.output_tokens == response.usage.output_tokens


class City(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=30)]
    country: Annotated[str, pydantic.Field(max_length=30)]


def test_parse_with_a_pydantic_model_and_the_sdk_accumulator(client: openai.OpenAI, model: str) -> None:
    """``responses.parse``: the constraint engine makes the text a City; ``responses.stream``
    with the same format: the SDK's own accumulator (``get_final_response``) gets it."""
    for city, country in (("Paris", "France"), ("Lima", "Peru"), ("Oslo", "Norway")):
        prompt = f"{city} is the capital of {country}. Extract the city."
        parsed = client.responses.parse(model=model, input=prompt, text_format=City, max_output_tokens=80)
        assert isinstance(parsed.output_parsed, City)
        with client.responses.stream(
            model=model, input=prompt, text_format=City, max_output_tokens=80
        ) as stream:
            final = stream.get_final_response()
        assert final.status == "completed"
        assert isinstance(final.output_parsed, City)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER,
    }
]


def test_function_call_round_trip(client: openai.OpenAI, model: str) -> None:
    question = {"role": "user", "content": "What is the weather in Rome?"}
    first = client.responses.create(
        model=model,
        input=[question],
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=80,  # type: ignore[list-item]
    )
    (call,) = first.output
    assert call.type == "function_call"
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(
        model=model,
        input=[question],  # type: ignore[list-item]
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
    ) as stream:
        argument_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    (streamed_call,) = streamed.output
    assert streamed_call.type == "function_call"
    assert "".join(argument_deltas) == streamed_call.arguments
    history: list[Any] = [
        question,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees and sunny"},
    ]
    answer = client.responses.create(
        model=model, input=history, tools=TOOLS, tool_choice="none", max_output_tokens=20, temperature=0
    )
    assert answer.output[0].type == "message"
    assert answer.output_text
    counted = client.responses.input_tokens.count(model=model, input=history, tools=TOOLS, tool_choice="none")
    assert answer.usage is not None
    assert counted.input_tokens == answer.usage.input_tokens


def test_refusals_name_the_field(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="x", previous_response_id="resp_123")
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="x", conversation="conv_123")
    assert caught.value.body["param"] == "conversation"  # type: ignore[index]


def test_openai_agents_default_responses_model_runs_an_agent_with_a_tool(server_url: str, model: str) -> None:
    """openai-agents with its default model (``OpenAIResponsesModel``): an agent calls its
    tool with valid arguments three times, each run ending with the tool's result."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[dict[str, str]] = []

    @function_tool
    def get_weather(
        city: Annotated[str, pydantic.Field(max_length=24)], unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """Get the current weather in a city."""
        calls.append({"city": city, "unit": unit})
        return f"21 degrees {unit} in {city}"

    async def runs() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as client:
            agent = Agent(
                name="weather",
                instructions="Answer with the get_weather tool.",
                model=OpenAIResponsesModel(model=model, openai_client=client),
                tools=[get_weather],
                model_settings=ModelSettings(tool_choice="required", max_tokens=80),
                tool_use_behavior="stop_on_first_tool",
            )
            return [
                (await Runner.run(agent, f"What is the weather in {city} right now?")).final_output
                for city in ("Paris", "Tokyo", "Lima")
            ]

    finals = asyncio.run(runs())
    assert len(calls) == 3
    for call, final in zip(calls, finals, strict=True):
        assert final == f"21 degrees {call['unit']} in {call['city']}"
