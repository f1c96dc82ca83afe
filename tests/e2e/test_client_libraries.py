"""Structured outputs and tools through the client libraries people build on — LangChain
(``langchain-openai``), the OpenAI Agents SDK (``openai-agents``) and Pydantic AI —
against ``trioserve serve`` on the default model, run as a user runs it
(docs/structured-output.md).

Each test's verdict depends on the structure of the answers only — an object that
validates against its schema, a tool called with valid arguments — never on which
tokens the sampler drew (other CPUs draw other tokens). That holds because every schema
here is a bounded grammar: each string has a ``maxLength`` and every number the digit
bound, so the constraint finishes every answer within ``MAX_TOKENS``
(:func:`test_max_tokens_covers_the_longest_answer` checks the arithmetic).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

#: longer than the longest text the schemas below allow, one token a byte
MAX_TOKENS = 512
#: each library call, three times in a row, with different inputs
PEOPLE = [("Alice", 34, "Paris"), ("Kofi", 33, "Accra"), ("Lena", 47, "Vienna")]
CITIES = [("Paris", "France", 2.1), ("Lagos", "Nigeria", 15.4), ("Oslo", "Norway", 0.7)]

Short = Annotated[str, pydantic.Field(max_length=24)]


class Person(pydantic.BaseModel):
    name: Short
    age: int
    city: Short


class City(pydantic.BaseModel):
    name: Short
    country: Short
    population_millions: float


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess("--threads", "2", "--slots", "2") as server:
        url = server.wait_ready()
        yield url
        assert server.stop() == 0


@pytest.fixture(scope="module")
def model(server_url: str) -> str:
    name: str = httpx.get(server_url + "/v1/models").json()["data"][0]["id"]
    return name


def _valid(value: pydantic.BaseModel, cls: type[pydantic.BaseModel]) -> None:
    """``value`` is a ``cls`` and its JSON validates against ``cls``'s JSON Schema."""
    assert isinstance(value, cls), value
    jsonschema.validate(json.loads(value.model_dump_json()), cls.model_json_schema())


def _longest(schema: dict[str, Any], defs: dict[str, Any]) -> int:
    """The most bytes a compact JSON text valid under ``schema`` can have under the digit
    bound (16 + 16 digits, 2 in the exponent) and the schema's ``maxLength``s: a string
    character is at most 6 bytes (``\\uXXXX``)."""
    if "$ref" in schema:
        return _longest(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return 2 + 6 * schema["maxLength"]  # (a KeyError: an unbounded string)
    if kind == "integer":
        return 1 + 16
    if kind == "number":
        return len("-") + 16 + len(".") + 16 + len("e-") + 2
    assert kind == "object", schema
    assert schema.get("additionalProperties") is False or set(schema["required"]) == set(schema["properties"])
    inner = sum(len(json.dumps(k)) + 1 + _longest(v, defs) for k, v in schema["properties"].items())
    return 2 + inner + len(schema["properties"]) - 1


def test_max_tokens_covers_the_longest_answer() -> None:
    """The schemas are bounded grammars, and their longest text (a tool call's wrapper
    included) fits in ``MAX_TOKENS`` at one token a byte, so every answer is finished by
    the constraint, whatever the sampler draws."""
    wrapper = len('{"name":"final_result","arguments":}')
    for cls in (Person, City):
        schema = cls.model_json_schema()
        assert _longest(schema, schema.get("$defs", {})) + wrapper < MAX_TOKENS
    assert _longest(WEATHER_ARGUMENTS, {}) + wrapper < MAX_TOKENS


# -- LangChain --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server_url: str, model: str, method: str) -> None:
    """``ChatOpenAI(...).with_structured_output(Person)``: through ``response_format``
    (LangChain's default, ``json_schema``) and through a forced tool call
    (``function_calling``), three answers in a row parse into the model.

    ``function_calling`` with ``strict=True``: without it LangChain sends an open object
    (no ``additionalProperties: false``), which the default model fills with invented
    properties until ``max_tokens`` (docs/structured-output.md)."""
    from langchain_openai import ChatOpenAI

    with httpx.Client(timeout=120) as http:
        llm = ChatOpenAI(
            base_url=server_url + "/v1",
            api_key=pydantic.SecretStr("unused"),
            model=model,
            temperature=0,
            max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
            max_retries=0,
            http_client=http,
        )
        structured = llm.with_structured_output(Person, method=method, strict=True)  # type: ignore[arg-type]
        for name, age, city in PEOPLE:
            person = structured.invoke(f"{name} is {age} years old and lives in {city}. Extract the person.")
            _valid(person, Person)  # type: ignore[arg-type]


# -- OpenAI Agents SDK ------------------------------------------------------------------


def _agents_model(client: openai.AsyncOpenAI, model: str) -> Any:
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled

    set_tracing_disabled(True)  # (it would post traces to OpenAI)
    return OpenAIChatCompletionsModel(model=model, openai_client=client)


def test_openai_agents_output_type(server_url: str, model: str) -> None:
    """``Agent(output_type=City)`` on the Chat Completions model: three runs in a row end
    with a ``City``."""
    from agents import Agent, ModelSettings, Runner

    async def runs() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as client:
            agent = Agent(
                name="extractor",
                instructions="Extract the city.",
                model=_agents_model(client, model),
                output_type=City,
                model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
            )
            return [
                (
                    await Runner.run(agent, f"{name} is in {country}; {people} million people live there.")
                ).final_output
                for name, country, people in CITIES
            ]

    for city in asyncio.run(runs()):
        _valid(city, City)


WEATHER_ARGUMENTS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def test_openai_agents_function_tool(server_url: str, model: str) -> None:
    """An agent with a function tool and ``tool_choice="required"``: each of three runs
    calls the tool with arguments valid against its schema, and the run ends with the
    tool's result (``stop_on_first_tool``)."""
    from agents import Agent, ModelSettings, Runner, function_tool

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
                model=_agents_model(client, model),
                tools=[get_weather],
                model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=MAX_TOKENS),
                tool_use_behavior="stop_on_first_tool",
            )
            return [
                (await Runner.run(agent, f"What is the weather in {city} right now?")).final_output
                for _, _, city in PEOPLE
            ]

    finals = asyncio.run(runs())
    assert len(calls) == 3
    for call, final in zip(calls, finals, strict=True):
        jsonschema.validate(call, WEATHER_ARGUMENTS)
        assert final == f"21 degrees {call['unit']} in {call['city']}"
    # the tool's schema, as the SDK sends it, is the one checked above (with titles)
    sent = get_weather.params_json_schema
    assert {k: {"type": v.get("type"), "enum": v.get("enum")} for k, v in sent["properties"].items()} == {
        "city": {"type": "string", "enum": None},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    }
    assert sent["properties"]["city"]["maxLength"] == 24


# -- Pydantic AI ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_output_type(server_url: str, model: str, mode: str) -> None:
    """``Agent(output_type=City)`` with Pydantic AI's OpenAI chat model pointed at the
    server: its default tool output (a forced ``final_result`` call) and
    ``NativeOutput`` (``response_format``), three runs each."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def runs() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as client:
            chat = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
            agent = Agent(
                chat,
                output_type=City if mode == "tool" else NativeOutput(City),
                model_settings={"temperature": 0, "max_tokens": MAX_TOKENS},
                retries=0,
            )
            return [
                (await agent.run(f"{name} is in {country}; {people} million people live there.")).output
                for name, country, people in CITIES
            ]

    for city in asyncio.run(runs()):
        _valid(city, City)
