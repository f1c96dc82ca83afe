"""Every request field of OpenAI's Chat Completions and (legacy) Completions APIs, and
the llama.cpp fields trioserve reads, against ``trioserve serve`` on the default model.

Each (field, endpoint) row of ROWS is a test: an honoured field has its effect (where
that is cheap and deterministic; else it is at least accepted), a refused one gets a
400 whose ``param`` is the field and whose message names it, an ignored one is
accepted. The table in docs/api.md, "Request fields", is checked against ROWS, so the
documentation cannot drift from the behaviour.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

SLOTS = 4
PROMPT = "The capital of France is"
MESSAGE = "Say hello."
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: a prompt over one 128-token cache chunk (the prompt cache reuses whole chunks)
LONG = " ".join(f"item{i}" for i in range(150))

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}


def user(content: str = MESSAGE, **extra: object) -> dict[str, object]:
    return {"role": "user", "content": content, **extra}


@dataclass
class Api:
    """One endpoint of the module's server: small greedy requests by default."""

    client: httpx.Client
    endpoint: str
    model: str
    _greedy: dict[int, str] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def body(self, **fields: object) -> dict[str, object]:
        base: dict[str, object] = {"messages": [user()]} if self.chat else {"prompt": PROMPT}
        return {**base, "max_tokens": 6, "temperature": 0, **fields}

    def post(self, **fields: object) -> httpx.Response:
        return self.client.post(PATHS[self.endpoint], json=self.body(**fields))

    def ok(self, **fields: object) -> dict[str, Any]:
        response = self.post(**fields)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def text(self, **fields: object) -> str:
        return text_of(self.ok(**fields)["choices"][0])

    def greedy(self, max_tokens: int = 6) -> str:
        if max_tokens not in self._greedy:
            self._greedy[max_tokens] = self.text(max_tokens=max_tokens)
        return self._greedy[max_tokens]

    def stream(self, **fields: object) -> list[dict[str, Any]]:
        """The chunks of a streamed request (``[DONE]`` checked and dropped)."""
        with self.client.stream("POST", PATHS[self.endpoint], json=self.body(stream=True, **fields)) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(event) for event in events[:-1]]

    def error(self, status: int, **fields: object) -> dict[str, Any]:
        response = self.post(**fields)
        assert response.status_code == status, response.text
        error: dict[str, Any] = response.json()["error"]
        return error


def text_of(choice: dict[str, Any]) -> str:
    if "message" in choice:
        return choice["message"]["content"] or ""
    return choice["text"]


def streamed_text(chunks: list[dict[str, Any]]) -> str:
    parts = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            parts.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
    return "".join(parts)


# ------------------------------------------------------------------- honoured fields


def check_model(api: Api) -> None:
    assert api.ok(model=api.model)["model"] == api.model
    assert api.ok()["model"] == api.model  # optional
    error = api.error(404, model="gpt-9")
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


def check_prompt(api: Api) -> None:
    ids = api.client.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    as_ids, as_text = api.ok(prompt=ids), api.ok(prompt=PROMPT)
    assert text_of(as_ids["choices"][0]) == text_of(as_text["choices"][0])
    assert as_ids["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"] == len(ids)
    assert text_of(api.ok(prompt=[PROMPT])["choices"][0]) == text_of(as_text["choices"][0])
    # a batch: one choice per prompt, each its own prompt's text, every prompt in the usage
    batch = api.ok(prompt=[PROMPT, PROMPT])
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [text_of(c) for c in batch["choices"]] == [text_of(as_text["choices"][0])] * 2
    assert batch["usage"]["prompt_tokens"] == 2 * len(ids)
    assert api.error(400, prompt=[PROMPT] * (SLOTS + 1))["param"] == "prompt"  # more than the slots
    assert api.error(400, prompt=["a", 5])["param"] == "prompt"  # a mix


def prompt_tokens(api: Api, messages: list[dict[str, object]]) -> int:
    tokens: int = api.ok(messages=messages, max_tokens=1)["usage"]["prompt_tokens"]
    return tokens


def check_messages(api: Api) -> None:
    alone = prompt_tokens(api, [user()])
    assert prompt_tokens(api, [{"role": "system", "content": "Be brief."}, user()]) > alone
    # developer is system's newer name
    assert prompt_tokens(api, [{"role": "developer", "content": "Be brief."}, user()]) > alone
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]
    assert prompt_tokens(api, [user(parts)]) == alone  # type: ignore[arg-type]


def check_message_name(api: Api) -> None:
    assert prompt_tokens(api, [user(name="bob")]) > prompt_tokens(api, [user()])


def check_message_tool_calls(api: Api) -> None:
    without = [user("Weather in Paris?"), {"role": "assistant", "content": "Let me see."}]
    called = [
        user("Weather in Paris?"),
        {"role": "assistant", "content": "Let me see.", "tool_calls": [CALL]},
    ]
    assert prompt_tokens(api, called) > prompt_tokens(api, without)


def check_message_tool_call_id(api: Api) -> None:
    def conversation(call_id: str) -> list[dict[str, object]]:
        return [
            user("Weather in Paris?"),
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        ]

    # the id finds the call, and with it the function's name, for the result's turn
    assert prompt_tokens(api, conversation("call_1")) != prompt_tokens(api, conversation("call_other"))


def check_cache_prompt(api: Api) -> None:
    long: dict[str, object] = {"messages": [user(LONG)]} if api.chat else {"prompt": LONG}
    api.ok(max_tokens=1, **long)  # leaves the prompt's whole chunks in the cache
    assert api.ok(max_tokens=1, **long)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    assert (
        api.ok(max_tokens=1, cache_prompt=False, **long)["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
    )


def _verified(api: Api) -> int:
    speculation = api.client.get("/health").json()["batch"]["speculation"]
    assert speculation["mode"] == "auto"
    return int(speculation["verify_calls"])


def check_speculate(api: Api) -> None:
    # a text that invites a copy of itself: with speculate (the default) the server
    # verifies guesses; false decodes one token per call; the text is the same
    copy: dict[str, object] = (
        {"messages": [user("Say: one two three, one two three, one two three")]}
        if api.chat
        else {"prompt": "one two three, one two three, one two three, one two"}
    )
    before = _verified(api)
    plain = text_of(api.ok(max_tokens=24, speculate=False, **copy)["choices"][0])
    assert _verified(api) == before
    assert text_of(api.ok(max_tokens=24, **copy)["choices"][0]) == plain


def check_truncation(api: Api) -> None:
    # trioserve's (the Responses API's field; docs/dialects.md, "Truncation"; the cut
    # itself: tests/e2e/test_truncation.py): a first turn longer than the context
    long = [user("ocean " * 4096), {"role": "assistant", "content": "Noted."}, user()]
    for fields in ({}, {"truncation": "disabled"}, {"truncation": None}):
        error = api.error(400, messages=long, **fields)
        assert error["code"] == "context_length_exceeded"
        assert 'truncation: "auto"' in error["message"]
    body = api.ok(messages=long, truncation="auto")
    assert body["trioserve"]["truncation"] == {"dropped_turns": 1, "dropped_messages": 2}
    # what was evaluated is the last question alone: the default request's prompt
    assert text_of(body["choices"][0]) == api.greedy()
    assert api.error(400, truncation="sometimes")["param"] == "truncation"


def check_reasoning_control(api: Api) -> None:
    # llama-server's: false refuses the reasoning_end control for this request (the
    # default model does not reason: true is answered so); the text is the same either way
    for value, message in (
        (False, "reasoning control not enabled"),
        (True, "this completion is not reasoning"),
    ):
        request_id = f"control-{api.endpoint}-{value}"
        body = api.body(stream=True, max_tokens=500, reasoning_control=value)
        with api.client.stream(
            "POST", PATHS[api.endpoint], json=body, headers={"X-Request-Id": request_id}
        ) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            control = api.client.post(f"/v1/requests/{request_id}/control", json={"action": "reasoning_end"})
            assert api.client.post(f"/v1/requests/{request_id}/cancel").json()["cancelled"]
            for _ in lines:
                pass
        assert control.json()["success"] is False
        assert control.json()["message"].startswith(message)
    assert api.text(max_tokens=3, reasoning_control=False) == api.greedy(3)


def check_lora(api: Api) -> None:
    # llama-server's: this model has no adapters (tests/e2e/test_lora_http.py serves
    # some): an adapter asked for is a 400 naming the field; none asked for, the base model
    response = api.post(max_tokens=1, lora=[{"id": 0, "scale": 1.0}])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "lora"
    assert "has no LoRA adapters" in response.json()["error"]["message"]
    assert api.text(max_tokens=3, lora=[]) == api.greedy(3)


def check_penalty(name: str) -> Callable[[Api], None]:
    def check(api: Api) -> None:
        # greedy, and the text repeats itself: a penalty changes it
        assert api.text(max_tokens=20, **{name: 2.0}) != api.greedy(20)
        assert api.text(max_tokens=20, **{name: 0.0}) == api.greedy(20)

    return check


def check_repeat_penalty(api: Api) -> None:
    assert api.text(max_tokens=20, repeat_penalty=1.5) != api.greedy(20)


def check_repeat_last_n(api: Api) -> None:
    # a window of 0 tokens: nothing is penalized
    assert api.text(max_tokens=20, repeat_penalty=1.5, repeat_last_n=0) == api.greedy(20)
    assert api.text(max_tokens=20, repeat_penalty=1.5, repeat_last_n=64) != api.greedy(20)
    assert api.error(400, repeat_last_n=-2)["param"] == "repeat_last_n"


def check_grammar(api: Api) -> None:
    body = api.ok(grammar='root ::= "yes" | "no"', max_tokens=8)
    assert text_of(body["choices"][0]) in ("yes", "no")
    assert body["choices"][0]["finish_reason"] == "stop"


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def check_json_schema(api: Api) -> None:
    value = json.loads(api.text(json_schema=SCHEMA, max_tokens=12))
    assert isinstance(value, dict)
    assert set(value) == {"ok"}
    assert isinstance(value["ok"], bool)


def check_response_format(api: Api) -> None:
    assert isinstance(json.loads(api.text(response_format={"type": "json_object"}, max_tokens=12)), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    assert set(json.loads(api.text(response_format=fmt, max_tokens=12))) == {"ok"}
    assert api.text(response_format={"type": "text"}) == api.greedy()
    error = api.error(400, response_format={"type": "json_object"}, grammar='root ::= "x"')
    assert "one constraint" in error["message"]


def first_token(api: Api) -> int:
    piece = api.greedy(1)
    tokens = api.client.post("/tokenize", json={"content": piece}).json()["tokens"]
    assert len(tokens) == 1, (piece, tokens)
    token: int = tokens[0]
    return token


def check_logit_bias(api: Api) -> None:
    banned = first_token(api)
    assert api.text(max_tokens=1, logit_bias={str(banned): -100}) != api.greedy(1)
    assert api.text(max_tokens=1, logit_bias={str(banned): 0}) == api.greedy(1)
    assert api.error(400, logit_bias={"999999": 1})["param"] == "logit_bias"


def check_logprobs(api: Api) -> None:
    if api.chat:
        body = api.ok(logprobs=True, max_tokens=4)
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"] == 4
        assert "".join(entry["token"] for entry in content) == text_of(body["choices"][0])
        assert all(entry["logprob"] <= 0 and entry["top_logprobs"] == [] for entry in content)
        assert api.ok(max_tokens=1)["choices"][0]["logprobs"] is None
    else:
        body = api.ok(logprobs=2, max_tokens=4)
        logprobs = body["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
        assert "".join(logprobs["tokens"]) == text_of(body["choices"][0])
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
        assert logprobs["text_offset"][0] == 0
        assert all(lp <= 0 for lp in logprobs["token_logprobs"])
        assert api.error(400, logprobs=21)["param"] == "logprobs"


def check_top_logprobs(api: Api) -> None:
    content = api.ok(logprobs=True, top_logprobs=3, max_tokens=3)["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)
    # greedy: the token drawn is the most likely one
    assert all(entry["top_logprobs"][0]["token"] == entry["token"] for entry in content)
    error = api.error(400, top_logprobs=3)
    assert error["param"] == "top_logprobs"
    assert "needs logprobs" in error["message"]


def check_max_tokens(api: Api) -> None:
    body = api.ok(max_tokens=3)
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    assert api.error(400, max_tokens=0)["param"] == "max_tokens"


def check_max_completion_tokens(api: Api) -> None:
    body = api.ok(max_tokens=10, max_completion_tokens=3)  # preferred over max_tokens
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def check_n(api: Api) -> None:
    body = api.ok(n=2, max_tokens=3, temperature=1, seed=5)
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6
    error = api.error(400, n=SLOTS + 1)
    assert error["param"] == "n"
    assert f"n may be at most {SLOTS} on this server" in error["message"]
    assert "<= 16" in api.error(400, n=17)["message"]


def check_seed(api: Api) -> None:
    texts = [api.text(temperature=1, seed=seed) for seed in (1, 1, 2, 3)]
    assert texts[0] == texts[1]
    assert len(set(texts)) > 1


def check_suffix(api: Api) -> None:
    # fill in the middle needs a model with FIM tokens: its effect (the same prompt
    # tokens and text as /infill, on a FIM model, beside llama-server) is
    # tests/e2e/test_infill.py's; here, the default model says why it cannot
    error = api.error(400, max_tokens=1, suffix=" and that is all.")
    assert error["param"] == "suffix"
    assert error["code"] == "infill_not_supported"
    assert "FIM" in error["message"]
    assert api.text(max_tokens=3, suffix="") == api.greedy(3)


def check_priority(api: Api) -> None:
    # the order it gives under load: tests/e2e/test_priorities.py; here its range, and
    # that it changes no text
    assert api.text(max_tokens=3, priority=-5) == api.text(max_tokens=3, priority=7) == api.greedy(3)
    for bad in (10**7, "high"):
        assert api.error(400, max_tokens=1, priority=bad)["param"] == "priority"


def check_temperature(api: Api) -> None:
    assert api.text(temperature=0) == api.text(temperature=0) == api.greedy()
    assert any(api.text(temperature=2, seed=seed) != api.greedy() for seed in (1, 2, 3))
    assert api.error(400, temperature=2.5)["param"] == "temperature"


def check_greedy_at_temperature_1(name: str, value: float) -> Callable[[Api], None]:
    def check(api: Api) -> None:
        # only the most likely token survives the truncation: the draw is the greedy one
        assert api.text(temperature=1, seed=7, **{name: value}) == api.greedy()

    return check


def check_stop(api: Api) -> None:
    text = api.greedy(8)
    stop = text.split()[1]
    body = api.ok(max_tokens=8, stop=[stop])
    assert text_of(body["choices"][0]) == text[: text.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert text_of(api.ok(max_tokens=8, stop=stop)["choices"][0]) == text[: text.index(stop)]


def check_stream(api: Api) -> None:
    chunks = api.stream()
    assert streamed_text(chunks) == api.greedy()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    if api.chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    else:
        assert {chunk["object"] for chunk in chunks} == {"text_completion"}


def check_stream_options(api: Api) -> None:
    chunks = api.stream(stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert all("usage" not in chunk for chunk in api.stream(stream_options={"include_usage": False}))


def check_tools(api: Api) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = api.ok(
        messages=[user("Weather in Paris?")], tools=[WEATHER, TIME], tool_choice=named, max_tokens=24
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"}
    assert isinstance(arguments["city"], str)
    assert (
        api.error(400, tools=[{"type": "retrieval", "function": {"name": "x"}}])["param"] == "tools[0].type"
    )


def check_tool_choice(api: Api) -> None:
    asked = {"messages": [user("Weather in Paris?")], "tools": [WEATHER], "max_tokens": 24}
    forced = api.ok(tool_choice="required", **asked)["choices"][0]
    assert forced["finish_reason"] == "tool_calls"
    assert forced["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    plain = api.ok(tool_choice="none", **{**asked, "max_tokens": 3})["choices"][0]
    assert "tool_calls" not in plain["message"]
    assert plain["message"]["content"]
    api.ok(tool_choice="auto", **{**asked, "max_tokens": 3})
    missing = {"type": "function", "function": {"name": "get_time"}}
    assert api.error(400, tool_choice=missing, **asked)["param"] == "tool_choice"


def check_parallel_tool_calls(api: Api) -> None:
    asked = {"messages": [user("Weather in Paris?")], "tools": [WEATHER, TIME], "tool_choice": "required"}
    for parallel in (False, True):
        body = api.ok(parallel_tool_calls=parallel, max_tokens=24, **asked)
        assert len(body["choices"][0]["message"]["tool_calls"]) == 1


HONOURED: dict[str, Callable[[Api], None]] = {
    "model": check_model,
    "prompt": check_prompt,
    "messages": check_messages,
    "messages[].name": check_message_name,
    "messages[].tool_calls": check_message_tool_calls,
    "messages[].tool_call_id": check_message_tool_call_id,
    "frequency_penalty": check_penalty("frequency_penalty"),
    "logit_bias": check_logit_bias,
    "logprobs": check_logprobs,
    "max_completion_tokens": check_max_completion_tokens,
    "max_tokens": check_max_tokens,
    "n": check_n,
    "parallel_tool_calls": check_parallel_tool_calls,
    "presence_penalty": check_penalty("presence_penalty"),
    "response_format": check_response_format,
    "seed": check_seed,
    "stop": check_stop,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "temperature": check_temperature,
    "tool_choice": check_tool_choice,
    "tools": check_tools,
    "top_logprobs": check_top_logprobs,
    "top_p": check_greedy_at_temperature_1("top_p", 1e-6),
    "top_k": check_greedy_at_temperature_1("top_k", 1),
    "min_p": check_greedy_at_temperature_1("min_p", 1.0),
    "repeat_penalty": check_repeat_penalty,
    "repeat_last_n": check_repeat_last_n,
    "cache_prompt": check_cache_prompt,
    "speculate": check_speculate,
    "reasoning_control": check_reasoning_control,
    "lora": check_lora,
    "truncation": check_truncation,
    "priority": check_priority,
    "suffix": check_suffix,
    "json_schema": check_json_schema,
    "grammar": check_grammar,
}
#: refused: (a value that asks for it, the values that mean "not asked for": accepted)
REFUSED: dict[str, tuple[object, tuple[object, ...]]] = {
    "audio": ({"voice": "alloy", "format": "wav"}, (None,)),
    "best_of": (2, (None, 1)),
    "echo": (True, (None, False)),
    "function_call": ("auto", (None,)),
    "functions": ([{"name": "get_weather", "parameters": {"type": "object"}}], (None, [])),
    "metadata": ({"user": "u1"}, (None, {})),
    "modalities": (["text", "audio"], (None, ["text"])),
    "prediction": ({"type": "content", "content": "The capital"}, (None,)),
    "reasoning_effort": ("low", (None, "none")),
    "service_tier": ("flex", (None, "auto", "default")),
    "store": (True, (None, False)),
    "verbosity": ("low", (None, "medium")),
    "web_search_options": ({}, (None,)),
}

#: ignored: a value that is accepted and changes nothing
IGNORED: dict[str, object] = {
    "prompt_cache_key": "tenant-1",
    "safety_identifier": "user-hash-1",
    "user": "user-1",
}

BOTH, COMPLETIONS, CHAT = ("completions", "chat"), ("completions",), ("chat",)
ENDPOINTS: dict[str, tuple[str, ...]] = {
    "model": BOTH,
    "prompt": COMPLETIONS,
    "messages": CHAT,
    "messages[].name": CHAT,
    "messages[].tool_calls": CHAT,
    "messages[].tool_call_id": CHAT,
    "audio": CHAT,
    "best_of": COMPLETIONS,
    "echo": COMPLETIONS,
    "frequency_penalty": BOTH,
    "function_call": CHAT,
    "functions": CHAT,
    "logit_bias": BOTH,
    "logprobs": BOTH,
    "max_completion_tokens": CHAT,
    "max_tokens": BOTH,
    "metadata": CHAT,
    "modalities": CHAT,
    "n": BOTH,
    "parallel_tool_calls": CHAT,
    "prediction": CHAT,
    "presence_penalty": BOTH,
    "prompt_cache_key": CHAT,
    "reasoning_effort": CHAT,
    "response_format": BOTH,
    "safety_identifier": CHAT,
    "seed": BOTH,
    "service_tier": CHAT,
    "stop": BOTH,
    "store": CHAT,
    "stream": BOTH,
    "stream_options": BOTH,
    "suffix": COMPLETIONS,
    "temperature": BOTH,
    "tool_choice": CHAT,
    "tools": CHAT,
    "top_logprobs": CHAT,
    "top_p": BOTH,
    "user": BOTH,
    "verbosity": CHAT,
    "web_search_options": CHAT,
    # llama.cpp's
    "top_k": BOTH,
    "min_p": BOTH,
    "repeat_penalty": BOTH,
    "repeat_last_n": BOTH,
    "cache_prompt": BOTH,
    "speculate": BOTH,
    "reasoning_control": BOTH,
    "lora": BOTH,
    "truncation": CHAT,
    "priority": BOTH,
    "json_schema": BOTH,
    "grammar": BOTH,
}


def _status(name: str) -> str:
    return "honoured" if name in HONOURED else "refused" if name in REFUSED else "ignored"


ROWS = [(name, endpoint, _status(name)) for name, endpoints in ENDPOINTS.items() for endpoint in endpoints]


def _param(row: tuple[str, str, str]) -> Any:
    name, endpoint, status = row
    return pytest.param(row, id=f"{name}-{endpoint}-{status}")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess("--threads", "2", "--slots", str(SLOTS)) as server:
        url = server.wait_ready()
        yield url
        assert server.stop() == 0


@pytest.fixture(scope="module")
def apis(server_url: str) -> Iterator[dict[str, Api]]:
    with httpx.Client(base_url=server_url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        yield {endpoint: Api(client, endpoint, model) for endpoint in PATHS}


@pytest.mark.parametrize("row", [_param(row) for row in ROWS])
def test_field(apis: dict[str, Api], row: tuple[str, str, str]) -> None:
    name, endpoint, status = row
    api = apis[endpoint]
    if status == "honoured":
        HONOURED[name](api)
    elif status == "refused":
        value, accepted = REFUSED[name]
        response = api.post(max_tokens=1, **{name: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{name} is not supported: "), error["message"]
        for default in accepted:
            api.ok(max_tokens=1, **{name: default})
    else:
        assert api.text(max_tokens=3, **{name: IGNORED[name]}) == api.greedy(3)


@pytest.mark.parametrize("endpoint", PATHS)
def test_an_unknown_field_is_ignored(apis: dict[str, Api], endpoint: str) -> None:
    api = apis[endpoint]
    assert api.text(max_tokens=3, frobnicate=1, x_trioserve_wish={"a": [1]}) == api.greedy(3)


def test_every_refused_field_is_in_the_wire_table() -> None:
    from trioserve._wire._openai import _REFUSED

    assert {name: tuple(defaults) for name, defaults, _why in _REFUSED} == {
        name: accepted for name, (_value, accepted) in REFUSED.items()
    }


def test_the_documented_table_matches() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    section = doc[doc.index("## Request fields") : doc.index("### Headers")]
    cells = re.findall(r"^\| `([^`|]+)` \| (✓|—) \| (✓|—) \| (honoured|refused|ignored) \|", section, re.M)
    documented = set()
    for name, completions, chat, status in cells:
        for endpoint, mark in (("completions", completions), ("chat", chat)):
            if mark == "✓":
                documented.add((name, endpoint, status))
    assert len(cells) == len(ENDPOINTS)
    assert documented == set(ROWS)


@pytest.mark.parametrize(
    ("path", "field", "value", "hint"),
    [
        ("/v1/completions", "max_completion_tokens", 3, "send max_tokens"),
        ("/v1/completions", "tools", [], "chat completions field"),
        ("/v1/completions", "messages", [{"role": "user", "content": "x"}], "send prompt"),
        ("/v1/chat/completions", "prompt", "x", "send messages"),
        ("/v1/chat/completions", "echo", True, "completions field"),
    ],
)
def test_the_other_endpoints_field_is_refused(
    server_url: str, path: str, field: str, value: object, hint: str
) -> None:
    """A field of the other endpoint is not silently dropped: 400 naming it."""
    body: dict[str, object] = {"max_tokens": 1, field: value}
    if path == "/v1/completions":
        body.setdefault("prompt", "x")
    else:
        body.setdefault("messages", [{"role": "user", "content": "x"}])
    response = httpx.post(server_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert f"has no field {field}" in error["message"]
    assert hint in error["message"]
