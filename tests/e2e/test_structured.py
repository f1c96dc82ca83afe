"""Structured outputs, tools, logprobs, penalties and ``n``, through the official
``openai`` SDK (and instructor) against ``trioserve serve`` on the default model, run
as a user runs it (docs/structured-output.md)."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Literal

import httpx
import instructor
import jsonschema
import openai
import pydantic
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int
    city: str = pydantic.Field(max_length=20)


#: the longest answer ``Person``'s schema allows, at one token a byte: a string character
#: is at most 6 bytes (``\uXXXX``), an integer at most 17 (the digit bound,
#: docs/structured-output.md): 9 + 120 + 8 + 17 + 9 + 120 + 2 = 285. So the constraint
#: finishes every answer within it, whatever tokens the sampler draws (on another CPU,
#: seeded sampling draws others: with unbounded strings 3 of 200 seeds at temperature
#: 0.7 ran a name on past 100 tokens here)
PERSON_TOKENS = 300


#: twenty different people to extract (name, age, city)
PEOPLE = [
    ("Alice", 34, "Paris"),
    ("Bob", 27, "Berlin"),
    ("Chen Wei", 45, "Shanghai"),
    ("Dana", 19, "Toronto"),
    ("Emeka", 52, "Lagos"),
    ("Fatima", 38, "Cairo"),
    ("Gustav", 61, "Stockholm"),
    ("Hana", 23, "Tokyo"),
    ("Ivan", 40, "Moscow"),
    ("Julia", 29, "Madrid"),
    ("Kofi", 33, "Accra"),
    ("Lena", 47, "Vienna"),
    ("Miguel", 36, "Lima"),
    ("Nadia", 31, "Warsaw"),
    ("Omar", 58, "Dubai"),
    ("Priya", 26, "Mumbai"),
    ("Quinn", 44, "Dublin"),
    ("Rosa", 67, "Rome"),
    ("Sven", 21, "Oslo"),
    ("Tariq", 39, "Karachi"),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 24}, "hours24": {"type": "boolean"}},
            "required": ["zone", "hours24"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
#: the longest forced call of ``TOOLS``, at one token a byte (as ``PERSON_TOKENS``):
#: ``{"name":"get_weather","arguments":{"city":"`` 42 + 144 + ``","unit":"fahrenheit"}}`` 24
TOOL_TOKENS = 240
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}  # type: ignore[index]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess("--threads", "2", "--slots", "4") as server:
        url = server.wait_ready()
        yield url
        assert server.stop() == 0


@pytest.fixture
def client(server_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(server_url: str) -> str:
    name: str = httpx.get(server_url + "/v1/models").json()["data"][0]["id"]
    return name


def _ask(name: str, age: int, city: str) -> list[openai.types.chat.ChatCompletionMessageParam]:
    return [
        {"role": "user", "content": f"{name} is {age} years old and lives in {city}. Extract the person."}
    ]


def test_parse_with_a_pydantic_model_20_of_20(client: openai.OpenAI, model: str) -> None:
    """``chat.completions.parse``: every answer parses into the model (the schema is
    enforced token by token), and the extraction is right for most."""
    right = 0
    for name, age, city in PEOPLE:
        completion = client.chat.completions.parse(
            model=model,
            messages=_ask(name, age, city),
            response_format=Person,
            temperature=0,
            max_tokens=PERSON_TOKENS,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        person = choice.message.parsed
        assert isinstance(person, Person), choice.message.content
        right += person == Person(name=name, age=age, city=city)
    assert right >= 15  # the model's doing, not the constraint's (measured: 18 of 20)


def test_parse_streamed_20_of_20(client: openai.OpenAI, model: str) -> None:
    """The same through the SDK's streaming helper, sampled at temperature 0.7: every
    answer is finished by the constraint (``stop``, never ``length``) and parses. The
    verdict holds whatever tokens are drawn: ``Person`` is a bounded grammar and
    ``PERSON_TOKENS`` covers its longest text."""
    for i, (name, age, city) in enumerate(PEOPLE):
        with client.chat.completions.stream(
            model=model,
            messages=_ask(name, age, city),
            response_format=Person,
            temperature=0.7,
            seed=i,
            max_tokens=PERSON_TOKENS,
        ) as stream:
            completion = stream.get_final_completion()
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person), choice.message.content


def _digit_runs(text: str) -> list[tuple[int, int, int]]:
    """(integral, fraction, exponent) digits of each number outside a string in ``text``."""
    runs = []
    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|-?([0-9]+)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?', text):
        if match.group(1) is not None:
            runs.append(tuple(len(g or "") for g in match.groups()))
    return runs  # type: ignore[return-value]


def test_unbounded_numbers_keep_the_digit_bound(client: openai.OpenAI, model: str) -> None:
    """A schema's numbers without bounds are written with at most 16 digits before the
    point, 16 after and 2 in the exponent, so the model finishes its object (before the
    bound, this prompt at temperature 0 wrote ``2.1111…`` until max_tokens). Checked on
    the text, whatever the sampler drew: temperature 0, then 1.0 with five seeds."""
    schema = {
        "type": "object",
        "properties": {"population_millions": {"type": "number"}, "founded": {"type": "integer"}},
        "required": ["population_millions", "founded"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {
            "role": "user",
            "content": "Paris is in France; 2.1 million people live there. It was founded long ago.",
        }
    ]
    # the longest answer: {"population_millions": 38 bytes ,"founded": 17 bytes }
    for temperature, seed in [(0.0, None), *((1.0, s) for s in range(5))]:
        completion = client.chat.completions.create(
            model=model,
            messages=messages,
            response_format=fmt,  # type: ignore[typeddict-item]
            temperature=temperature,
            seed=seed,
            max_tokens=100,
        )
        choice = completion.choices[0]
        text = choice.message.content or ""
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        runs = _digit_runs(text)
        assert len(runs) == 2, text
        assert all(i <= 16 and f <= 16 and e <= 2 for i, f, e in runs), text


def test_json_object_and_an_unenforceable_schema(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=80,
    )
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still a valid prefix of a JSON object
        assert (completion.choices[0].message.content or "").startswith("{")
    # a keyword the engine cannot enforce is refused, never ignored
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as refused:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Numbers"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]


def test_tool_choice_required_round_trip_20_of_20(client: openai.OpenAI, model: str) -> None:
    """call → tool message → answer, twenty times: every call names a tool and its
    arguments validate against that tool's schema; the answer is text."""
    for i, (_, _, city) in enumerate(PEOPLE):
        question = f"What is the weather in {city} right now?" if i % 2 else f"What time is it in {city}?"
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": question}]
        first = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=TOOL_TOKENS,
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function"
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        result = (
            {"city": city, "temperature": 21} if call.function.name == "get_weather" else {"time": "14:05"}
        )
        messages += [
            choice.message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
        ]
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
        )
        assert answer.choices[0].message.tool_calls is None
        assert answer.choices[0].message.content


def test_named_function_and_streamed_tool_calls(client: openai.OpenAI, model: str) -> None:
    """A named function is the one called; streamed, the call comes as OpenAI streams
    it (id and name first, then argument fragments), and joins to the non-streamed call."""
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "Weather in Oslo, please."}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": TOOL_TOKENS,
    }
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id
    assert deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2  # the arguments came in fragments
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_instructor_gets_a_validated_object(server_url: str, model: str) -> None:
    """instructor in its default mode (a forced tool call whose arguments follow the
    response model's schema) returns a validated object."""

    class City(pydantic.BaseModel):
        name: str
        country: str
        population_millions: float = pydantic.Field(ge=0)

    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as sdk:
        patched = instructor.from_openai(sdk)
        city, completion = patched.chat.completions.create_with_completion(
            model=model,
            response_model=City,
            messages=[{"role": "user", "content": "Paris is in France; 2.1 million people live there."}],
            temperature=0,
            max_tokens=80,
            max_retries=0,
        )
    assert isinstance(city, City)
    assert city.country == "France"
    assert completion.choices[0].finish_reason == "tool_calls"


def test_logprobs_are_consistent(client: openai.OpenAI, model: str) -> None:
    """At temperature 0 the sampled token is the top alternative, its logprob equals the
    top entry's, and streamed logprobs are the non-streamed ones."""
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "temperature": 0,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in entries).decode()
    assert text == whole.choices[0].message.content
    for entry in entries:
        assert entry.logprob <= 0
        top = entry.top_logprobs
        assert len(top) == 3
        assert top[0].token == entry.token
        assert top[0].logprob == pytest.approx(entry.logprob)
        assert top[0].logprob >= top[1].logprob >= top[2].logprob
    streamed = [
        e
        for chunk in client.chat.completions.create(**request, stream=True)  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    # completions: OpenAI's legacy shape
    legacy = client.completions.create(
        model=model, prompt="One, two,", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None
    assert "".join(logprobs.tokens or []) == legacy.choices[0].text
    for token, top in zip(logprobs.tokens or [], logprobs.top_logprobs or [], strict=True):
        assert max(top, key=top.__getitem__) == token


def _repeats(text: str) -> int:
    words = re.findall(r"\w+", text.lower())
    return sum(n - 1 for n in Counter(words).values())


def test_presence_penalty_reduces_repeated_tokens(client: openai.OpenAI, model: str) -> None:
    """A base model left to run repeats itself; a high presence_penalty makes it use
    new words instead (at temperature 0, so both texts are deterministic)."""
    prompt = "I like cats. I like dogs. I like"

    def text(penalty: float) -> str:
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=60, temperature=0, presence_penalty=penalty
        )
        return completion.choices[0].text

    plain, penalised = text(0.0), text(2.0)
    assert _repeats(penalised) < _repeats(plain) / 2, (plain, penalised)  # measured: 8 against 41
    assert text(2.0) == penalised  # deterministic


def _evaluated(server_url: str) -> float:
    metrics = httpx.get(server_url + "/metrics").text
    match = re.search(r"^trioserve_prompt_tokens_evaluated_total (\S+)$", metrics, re.M)
    assert match is not None
    return float(match.group(1))


def test_n_4_shares_one_prompt_evaluation(client: openai.OpenAI, model: str, server_url: str) -> None:
    """n=4: the prompt is evaluated once (the metric rises by its length once), four
    different samples at temperature 1, four equal ones at temperature 0."""
    prompt = "Write a short story opening about a lighthouse keeper named " + "Marguerite " * 40
    before = _evaluated(server_url)
    sampled = client.completions.create(
        model=model,
        prompt=prompt,
        n=4,
        temperature=1.0,
        seed=11,
        max_tokens=20,
        extra_body={"cache_prompt": False},
    )
    evaluated = _evaluated(server_url) - before
    assert evaluated == sampled.usage.prompt_tokens  # once, not four times
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert len({c.text for c in sampled.choices}) == 4
    assert sampled.usage.completion_tokens == 4 * 20
    greedy = client.completions.create(model=model, prompt=prompt, n=4, temperature=0, max_tokens=20)
    texts = {c.text for c in greedy.choices}
    assert len(texts) == 1
    alone = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=20)
    assert texts == {alone.choices[0].text}
    # streamed: every chunk names its choice; each choice's text is the non-streamed one
    parts: dict[int, list[str]] = {}
    finished: list[int] = []
    for chunk in client.completions.create(
        model=model, prompt=prompt, n=4, temperature=1.0, seed=11, max_tokens=20, stream=True
    ):
        for choice in chunk.choices:
            parts.setdefault(choice.index, []).append(choice.text)
            if choice.finish_reason is not None:
                finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2, 3]
    assert ["".join(parts[i]) for i in range(4)] == [c.text for c in sampled.choices]


def test_chat_n_with_tool_calls_each_choice(client: openai.OpenAI, model: str) -> None:
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=TOOLS,
        tool_choice="required",
        n=3,
        temperature=1.0,
        seed=3,
        max_tokens=TOOL_TOKENS,
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        (call,) = choice.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("kind", ["constrained", "plain"])
def test_deadline_on_a_constrained_stream(
    server_url: str, model: str, kind: Literal["constrained", "plain"]
) -> None:
    """X-Request-Timeout: 0.5 on a stream under a JSON Schema's mask: the deadline event
    and [DONE] come as soon after 0.5 s as on an unconstrained stream (the figures:
    docs/benchmarks.md)."""
    body: dict[str, object] = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }
    if kind == "constrained":
        schema = {"type": "array", "items": {"type": "string"}, "minItems": 1000}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}
    # first, once, so the grammar engine's vocabulary is built and this is not timed
    httpx.post(server_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 1}, timeout=60)
    sent = time.perf_counter()
    events = []
    with httpx.stream(
        "POST", server_url + "/v1/completions", json=body, headers={"X-Request-Timeout": "0.5"}, timeout=10
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    elapsed = time.perf_counter() - sent
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "length"  # OpenAI's value
    assert final["trioserve"]["end_cause"] == "deadline"
    assert len(events) > 5  # it streamed before the deadline
    assert 0.5 <= elapsed < 1.0  # generous: the benchmark reports the real figure
