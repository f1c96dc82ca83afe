"""Stored Responses (docs/dialects.md, "Stored responses") against ``trioserve serve`` in
a subprocess, with the official ``openai`` SDK and openai-agents: a five-turn
conversation with a function tool chained by ``previous_response_id`` across a restart,
each turn's text equal to the same turn sent statelessly; what another API key may see;
reading, listing and deleting; openai-agents keeping its state server-side. No verdict
depends on which tokens a sampler draws: texts are compared with texts of the same
server at temperature 0."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

KEY, OTHER = "key-one", "key-two"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
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
#: each turn's settings (the same for the chained and the stateless request)
SETTINGS: dict[str, Any] = {"tools": TOOLS, "temperature": 0, "instructions": "Answer briefly."}


def _sdk(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _items(response: Any) -> list[dict[str, Any]]:
    """A response's output, as a client sends it back in ``input``."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def _turn(
    client: openai.OpenAI,
    model: str,
    history: list[dict[str, Any]],
    previous: str | None,
    own: list[Any],
    **extra: Any,
) -> Any:
    """One turn, chained on ``previous`` (storing it), and the same turn sent whole
    (``history`` + ``own``, not stored): their texts and calls must be equal."""
    chained = client.responses.create(
        model=model, input=own, previous_response_id=previous, **SETTINGS, **extra
    )
    whole = client.responses.create(model=model, input=[*history, *own], store=False, **SETTINGS, **extra)
    assert chained.store is True
    assert whole.store is False
    assert chained.previous_response_id == previous
    assert chained.output_text == whole.output_text
    assert [(i.type, getattr(i, "arguments", None)) for i in chained.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output
    ]
    assert chained.usage is not None
    assert whole.usage is not None
    assert chained.usage.input_tokens == whole.usage.input_tokens
    return chained


def test_five_turns_with_a_function_tool_across_a_restart(tmp_path: Path) -> None:
    """Turns 1–3 on one server, 4–5 after a SIGTERM restart on the same database and
    cache directory: every turn's text equals the stateless turn's; after the restart
    the stored turns are read back and the chain continues, its prefix restored from
    the disk tier rather than evaluated."""
    args = ("--threads", "2", "--api-key", KEY, "--responses-db", str(tmp_path / "responses.sqlite3"))
    args += ("--cache-dir", str(tmp_path / "cache"))
    question = {"role": "user", "content": "What is the weather in Rome?"}
    history: list[dict[str, Any]] = []
    with ServerProcess(*args) as server:
        url = server.wait_ready()
        with _sdk(url) as client:
            model = client.models.list().data[0].id
            # 1: a forced call (its arguments follow the schema, whatever the model)
            forced = {"type": "function", "name": "get_weather"}
            first = _turn(client, model, history, None, [question], tool_choice=forced)
            (call,) = first.output
            assert call.type == "function_call"
            jsonschema.validate(json.loads(call.arguments), WEATHER)
            history += [question, *_items(first)]
            # 2: the call's result, answered
            output = "21 degrees and sunny"
            result = {"type": "function_call_output", "call_id": call.call_id, "output": output}
            second = _turn(
                client, model, history, first.id, [result], tool_choice="none", max_output_tokens=16
            )
            history += [result, *_items(second)]
            # 3: a user turn
            ask = {"role": "user", "content": "And tomorrow?"}
            third = _turn(client, model, history, second.id, [ask], tool_choice="none", max_output_tokens=16)
            history += [ask, *_items(third)]
        assert server.stop() == 0
    with ServerProcess(*args) as server:
        url = server.wait_ready()
        with _sdk(url) as client:
            read = client.responses.retrieve(third.id)
            assert read.output_text == third.output_text
            assert read.previous_response_id == second.id
            ask = {"role": "user", "content": "Should I take an umbrella?"}
            fourth = _turn(client, model, history, third.id, [ask], tool_choice="none", max_output_tokens=16)
            assert fourth.usage is not None
            # the conversation's prefix came from the disk tier, not a new evaluation
            assert fourth.usage.input_tokens_details.cached_tokens > 0
            history += [ask, *_items(fourth)]
            ask = {"role": "user", "content": "Thanks."}
            _turn(client, model, history, fourth.id, [ask], tool_choice="none", max_output_tokens=16)
        assert server.stop() == 0


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess("--threads", "2", "--api-key", KEY, "--api-key", OTHER) as server:
        url = server.wait_ready()
        yield url
        assert server.stop() == 0


@pytest.fixture(scope="module")
def model(server_url: str) -> str:
    with _sdk(server_url) as sdk:
        return sdk.models.list().data[0].id


def test_reading_listing_and_deleting(server_url: str, model: str) -> None:
    with _sdk(server_url) as client:
        items = [{"role": "user", "content": f"Line {i}."} for i in range(5)]
        created = client.responses.create(model=model, input=items, max_output_tokens=4, temperature=0)
        assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
        listed = client.responses.input_items.list(created.id, order="asc", limit=2)
        ids = [item.id for item in listed.data]
        assert len(ids) == 2
        assert listed.has_more
        texts = []
        for page in client.responses.input_items.list(created.id, order="asc", limit=2).iter_pages():
            texts += [item.content[0].text for item in page.data]  # type: ignore[union-attr]
        assert texts == [f"Line {i}." for i in range(5)]
        newest = client.responses.input_items.list(created.id).data
        assert [item.content[0].text for item in newest] == [f"Line {i}." for i in reversed(range(5))]  # type: ignore[union-attr]
        raw = httpx.get(
            f"{server_url}/v1/responses/{created.id}/input_items",
            params={"limit": 101},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert raw.status_code == 400
        assert raw.json()["error"]["param"] == "limit"
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.retrieve(created.id, stream=True)  # type: ignore[call-overload]
        assert caught.value.body["param"] == "stream"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.cancel(created.id)  # a foreground response
        assert caught.value.body["param"] == "response_id"  # type: ignore[index]
        client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(created.id)


def test_another_key_sees_nothing(server_url: str, model: str) -> None:
    with _sdk(server_url) as mine, _sdk(server_url, OTHER) as theirs:
        created = mine.responses.create(model=model, input="A secret.", max_output_tokens=4, temperature=0)
        for call in (theirs.responses.retrieve, theirs.responses.delete, theirs.responses.input_items.list):
            with pytest.raises(openai.NotFoundError):
                call(created.id)
        with pytest.raises(openai.BadRequestError) as caught:
            theirs.responses.create(model=model, input="What was it?", previous_response_id=created.id)
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as caught:
            theirs.responses.input_tokens.count(model=model, input="x", previous_response_id=created.id)
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert mine.responses.retrieve(created.id).id == created.id  # still there for its owner


def test_counting_a_continuation_counts_the_stored_conversation(server_url: str, model: str) -> None:
    with _sdk(server_url) as client:
        first = client.responses.create(model=model, input="Hello there.", max_output_tokens=4, temperature=0)
        follow = [{"role": "user", "content": "Again?"}]
        whole = [{"role": "user", "content": "Hello there."}, *_items(first), *follow]
        chained = client.responses.input_tokens.count(
            model=model,
            input=follow,  # type: ignore[arg-type]
            previous_response_id=first.id,
        )
        stateless = client.responses.input_tokens.count(model=model, input=whole)  # type: ignore[arg-type]
        assert chained.input_tokens == stateless.input_tokens


class Verdict(pydantic.BaseModel):
    warm: bool


def test_openai_agents_keeps_its_state_on_the_server(server_url: str, model: str) -> None:
    """openai-agents with its default model (``OpenAIResponsesModel``) chaining its runs
    by ``previous_response_id``: the second run sends only its new items, the server
    holds the rest (the stored chain says so)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(
        city: Annotated[str, pydantic.Field(max_length=24)], unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"21 degrees {unit} in {city}"

    async def runs() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key=KEY, max_retries=0) as client:
            responses_model = OpenAIResponsesModel(model=model, openai_client=client)
            weather = Agent(
                name="weather",
                instructions="Answer with the get_weather tool.",
                model=responses_model,
                tools=[get_weather],
                model_settings=ModelSettings(tool_choice="required", max_tokens=80),
                tool_use_behavior="stop_on_first_tool",
            )
            first = await Runner.run(weather, "What is the weather in Oslo?", auto_previous_response_id=True)
            # (a structured answer: it ends whatever the model draws, and agents
            # refuses a response cut short)
            chat = Agent(
                name="chat",
                instructions="Answer briefly.",
                model=responses_model,
                model_settings=ModelSettings(max_tokens=40, temperature=0),
                output_type=Verdict,
            )
            second = await Runner.run(chat, "Is that warm?", previous_response_id=first.last_response_id)
            return first, second

    first, second = asyncio.run(runs())
    assert len(calls) == 1
    assert first.final_output.startswith("21 degrees")
    assert first.last_response_id is not None
    assert second.last_response_id is not None
    with _sdk(server_url) as client:
        stored = client.responses.retrieve(second.last_response_id)
        assert stored.previous_response_id == first.last_response_id
        assert Verdict.model_validate_json(stored.output_text) == second.final_output
        sent = client.responses.input_items.list(second.last_response_id, order="asc").data
        parts = [part for item in sent for part in (getattr(item, "content", None) or [])]
        texts = [getattr(part, "text", "") for part in parts]
        # only the new turn went over the wire: the first question stayed on the server
        assert not any("Oslo?" in text for text in texts)
        assert any("Is that warm?" in text for text in texts)
