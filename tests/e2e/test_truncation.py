"""Overflow as a policy (docs/dialects.md, "Truncation"), through the official ``openai``
SDK against ``trioserve serve`` in a subprocess on a real socket: the default model with
a 256-token context, so that an eight-turn conversation does not fit.
``truncation: "auto"`` drops the fewest oldest whole turns that make it fit and says how
many (checked against the server's own token counts: one turn fewer would not have
fit); ``disabled`` is the 400 with the counts; what can never be dropped, too long, is a
400 naming it; a generation that reaches the context's end stops with ``length``. The
server's default (``--truncation``) on the scripted backend. No verdict depends on which
tokens a sampler draws."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .._helpers import ServerProcess

CONTEXT = 256
INSTRUCTIONS = "You are terse."
LAST = "Which fact was the most surprising?"
#: Gemma's end of text and end of turn: banned, a generation runs to the context's end
NO_END = {"1": -100, "106": -100}


def turns(count: int = 8) -> list[dict[str, Any]]:
    """``count`` question-and-answer turns (about 52 tokens each), then the last question."""
    items: list[dict[str, Any]] = []
    for i in range(count):
        items.append(
            {"role": "user", "content": f"Tell me fact number {i} about the ocean and its creatures, please."}
        )
        items.append(
            {
                "role": "assistant",
                "content": f"Fact {i}: the ocean covers most of the planet and holds whales.",
            }
        )
    items.append({"role": "user", "content": LAST})
    return items


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess("--threads", "2", "--ctx-size", str(CONTEXT), "--slots", "1") as server:
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


def input_tokens(url: str, items: list[dict[str, Any]]) -> int:
    """The server's count of the Responses prompt of ``items`` (instructions first)."""
    body = {"instructions": INSTRUCTIONS, "input": items}
    counted = httpx.post(url + "/v1/responses/input_tokens", json=body, timeout=60)
    assert counted.status_code == 200, counted.text
    return int(counted.json()["input_tokens"])


@pytest.mark.model
def test_responses_truncation_auto_drops_the_fewest_oldest_turns_and_says_how_many(
    model: str, client: openai.OpenAI, server_url: str
) -> None:
    conversation = turns()
    assert input_tokens(server_url, conversation) > CONTEXT
    raw = client.responses.with_raw_response.create(
        model=model,
        instructions=INSTRUCTIONS,
        input=conversation,  # type: ignore[arg-type]
        truncation="auto",
        max_output_tokens=20,
        temperature=0,
        store=False,
    )
    response = raw.parse()
    assert response.status in ("completed", "incomplete")
    assert response.truncation == "auto"
    extension = (response.model_extra or {})["trioserve"]["truncation"]
    dropped = extension["dropped_turns"]
    assert extension == {"dropped_turns": dropped, "dropped_messages": 2 * dropped}
    assert raw.headers["x-truncated-turns"] == str(dropped)
    assert response.usage is not None
    # what was evaluated is the conversation without its `dropped` oldest turns (the
    # instructions and the last question kept), and it fits with max_output_tokens;
    # with one turn fewer dropped it would not have
    kept = input_tokens(server_url, conversation[2 * dropped :])
    assert response.usage.input_tokens == kept
    assert kept + 20 <= CONTEXT
    assert input_tokens(server_url, conversation[2 * (dropped - 1) :]) + 20 > CONTEXT
    # streamed: the same cut, said from the first event on
    with client.responses.stream(
        model=model,
        instructions=INSTRUCTIONS,
        input=conversation,  # type: ignore[arg-type]
        truncation="auto",
        max_output_tokens=20,
        temperature=0,
        store=False,
    ) as stream:
        events = list(stream)
    for event in (events[0], events[-1]):
        assert event.response.model_extra["trioserve"]["truncation"] == extension  # type: ignore[attr-defined]
    assert events[-1].response.usage.input_tokens == kept  # type: ignore[attr-defined]


@pytest.mark.model
@pytest.mark.parametrize("truncation", ["disabled", None])
def test_responses_truncation_disabled_is_the_400_with_the_counts(
    model: str, client: openai.OpenAI, server_url: str, truncation: str | None
) -> None:
    conversation = turns()
    fields: dict[str, Any] = {} if truncation is None else {"truncation": truncation}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=model,
            instructions=INSTRUCTIONS,
            input=conversation,  # type: ignore[arg-type]
            max_output_tokens=20,
            store=False,
            **fields,
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    full = input_tokens(server_url, conversation)
    assert f"the prompt has {full} tokens but the context holds {CONTEXT}" in error["message"]
    # and it says how to have the server fit it
    assert 'truncation: "auto"' in error["message"]


@pytest.mark.model
def test_chat_completions_truncation_auto_cuts_as_responses_does(
    model: str, client: openai.OpenAI, server_url: str
) -> None:
    conversation = turns()
    messages: Any = [{"role": "system", "content": INSTRUCTIONS}, *conversation]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=20, temperature=0, extra_body={"truncation": "auto"}
    )
    completion = raw.parse()
    assert completion.choices[0].finish_reason in ("stop", "length")
    extension = (completion.model_extra or {})["trioserve"]["truncation"]
    dropped = extension["dropped_turns"]
    assert raw.headers["x-truncated-turns"] == str(dropped)
    # the same conversation, the same template: the same cut as the Responses API's
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == input_tokens(server_url, conversation[2 * dropped :])
    assert (
        completion.usage.prompt_tokens + 20
        <= CONTEXT
        < input_tokens(server_url, conversation[2 * (dropped - 1) :]) + 20
    )
    # streamed: the finish chunk says it
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            extra_body={"truncation": "auto"},
        )
    )
    finish = next(chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason)
    assert (finish.model_extra or {})["trioserve"]["truncation"] == extension
    # without the field (the server's default): the 400 with the counts
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, max_tokens=20)
    assert caught.value.code == "context_length_exceeded"


@pytest.mark.model
def test_a_tool_call_and_its_result_are_dropped_together(model: str, client: openai.OpenAI) -> None:
    conversation = turns()
    # the second turn calls a tool: its call and result go (or stay) with it
    conversation[3:3] = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "depth", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "The ocean is 3,688 m deep on average."},
    ]
    messages: Any = [{"role": "system", "content": INSTRUCTIONS}, *conversation]
    completion = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0, extra_body={"truncation": "auto"}
    )
    extension = (completion.model_extra or {})["trioserve"]["truncation"]
    dropped = extension["dropped_turns"]
    assert dropped >= 2  # (the turn with the tool call among them)
    assert extension["dropped_messages"] == 2 * dropped + 2
    assert completion.usage is not None
    assert completion.usage.prompt_tokens + 20 <= CONTEXT


@pytest.mark.model
def test_anthropic_messages_truncation_auto(server_url: str) -> None:
    body = {"system": INSTRUCTIONS, "messages": turns(), "max_tokens": 20, "temperature": 0}
    refused = httpx.post(server_url + "/v1/messages", json=body, timeout=60)
    assert refused.status_code == 400
    assert "the context holds 256" in refused.json()["error"]["message"]
    answered = httpx.post(server_url + "/v1/messages", json={**body, "truncation": "auto"}, timeout=60)
    assert answered.status_code == 200, answered.text
    dropped = answered.json()["trioserve"]["truncation"]["dropped_turns"]
    assert dropped >= 1
    assert answered.headers["x-truncated-turns"] == str(dropped)


@pytest.mark.model
def test_a_last_user_turn_too_long_alone_is_a_400_naming_it(model: str, client: openai.OpenAI) -> None:
    conversation = turns()
    conversation[-1] = {"role": "user", "content": "Tell me about the ocean. " * 60}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=model,
            instructions=INSTRUCTIONS,
            input=conversation,  # type: ignore[arg-type]
            truncation="auto",
            max_output_tokens=20,
            store=False,
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "input"
    message = error["message"]
    assert "with all 8 earlier turn(s) dropped" in message
    assert "the last user turn (about" in message
    assert "max_output_tokens 20" in message  # (the Responses name of the field)


@pytest.mark.model
def test_a_generation_that_reaches_the_context_end_stops_with_length(
    model: str, client: openai.OpenAI, server_url: str
) -> None:
    """Without max_tokens, with the end of text banned: the reply fills the context and
    stops there with ``length``, never an error (streamed or not)."""
    messages: Any = [{"role": "user", "content": "Count from one to a thousand."}]
    completion = client.chat.completions.create(
        model=model, messages=messages, temperature=0, logit_bias=NO_END
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens + completion.usage.completion_tokens == CONTEXT
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            logit_bias=NO_END,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == CONTEXT


def test_the_server_default_truncation_auto_and_a_request_that_disables_it() -> None:
    """``--truncation auto`` (the scripted backend: a byte is a token): a conversation
    that does not say is fitted; one that says ``disabled`` is the 400."""
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "x" * 100},
        {"role": "assistant", "content": "y" * 100},
    ]
    items = items * 3 + [{"role": "user", "content": "z"}]
    with ServerProcess(
        "--scripted", "--scripted-interval", "0", "--ctx-size", "300", "--truncation", "auto"
    ) as server:
        url = server.wait_ready()
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as sdk:
            raw = sdk.responses.with_raw_response.create(
                model="scripted",
                input=items,  # type: ignore[arg-type]
                max_output_tokens=5,
                store=False,
            )
            response = raw.parse()
            assert response.truncation == "auto"
            assert (response.model_extra or {})["trioserve"]["truncation"]["dropped_turns"] >= 1
            assert response.usage is not None
            assert response.usage.input_tokens + 5 <= 300
            with pytest.raises(openai.BadRequestError) as caught:
                sdk.responses.create(
                    model="scripted", input=items, max_output_tokens=5, store=False, truncation="disabled"
                )  # type: ignore[arg-type]
            assert caught.value.code == "context_length_exceeded"
        assert server.stop() == 0
    logged = [line for line in server.log if "trioserve.truncation" in line]
    assert len(logged) == 1
    assert f"request {raw.headers['x-request-id']}: truncation auto dropped" in logged[0]
