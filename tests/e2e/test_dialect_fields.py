"""Every request field of Anthropic's Messages API and OpenAI's Responses API that
trioserve declares, against ``trioserve serve`` on the default model, row by row.

Each (field, endpoint) row is a test, as in ``test_api_fields.py``: an honoured field
has its effect (shown where that is cheap and does not depend on which tokens the
sampler draws: texts compared with texts of the same server at temperature 0, counts
with counts, structured output with its schema), a refused one gets a 400 that names it
(Anthropic's error body has no ``param``: the message names it), an ignored one is
accepted and changes neither the prompt nor the text. The tables in docs/api.md,
"Anthropic Messages" and "OpenAI Responses", are checked against the rows, and the rows
against the request structs of ``_wire/_anthropic_request.py`` and ``_wire/_responses_request.py``, so
neither the documentation nor the tests can drift from the code.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

KEY = "sk-test-dialect-fields"
ALIAS = "claude-test-alias"
SLOTS = 2
MESSAGE = "Say hello."
QUESTION = "What is the weather in Paris?"
#: a field value meaning: leave the field out of the body
OMIT: Any = object()
PATHS = {
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "responses": "/v1/responses",
    "input_tokens": "/v1/responses/input_tokens",
}
GENERATING = ("messages", "responses")

CITATION = {
    "type": "char_location",
    "cited_text": "hello",
    "document_index": 0,
    "start_char_index": 4,
    "end_char_index": 9,
}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
R_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_SCHEMA,
}
R_TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def user(content: object = MESSAGE) -> dict[str, object]:
    return {"role": "user", "content": content}


def assistant(content: object) -> dict[str, object]:
    return {"role": "assistant", "content": content}


def text_block(text: str, **extra: object) -> dict[str, object]:
    return {"type": "text", "text": text, **extra}


@dataclass
class Api:
    """One endpoint of the module's server: small greedy requests by default."""

    client: httpx.Client
    endpoint: str
    model: str
    context: int
    _greedy: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def anthropic(self) -> bool:
        return self.endpoint in ("messages", "count_tokens")

    @property
    def generates(self) -> bool:
        return self.endpoint in GENERATING

    def body(self, **fields: object) -> dict[str, object]:
        base: dict[str, object]
        if self.anthropic:
            base = {"messages": [user()]}
            if self.generates:
                base |= {"max_tokens": 6, "temperature": 0}
        else:
            base = {"input": MESSAGE}
            if self.generates:
                base |= {"max_output_tokens": 6, "temperature": 0}
        body = {**base, **fields}
        return {name: value for name, value in body.items() if value is not OMIT}

    def post(self, **fields: object) -> httpx.Response:
        return self.client.post(PATHS[self.endpoint], json=self.body(**fields))

    def ok(self, **fields: object) -> dict[str, Any]:
        response = self.post(**fields)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def error(self, status: int = 400, **fields: object) -> dict[str, Any]:
        """The error of a refused request, in the endpoint's dialect: Anthropic's body
        (``{"type": "error", "error": {"type", "message"}}``, no ``param``) or OpenAI's."""
        response = self.post(**fields)
        assert response.status_code == status, response.text
        body = response.json()
        if self.anthropic:
            assert set(body) == {"type", "error"}, body
            assert body["type"] == "error"
            assert set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
        error: dict[str, Any] = body["error"]
        return error

    def prompt_tokens(self, **fields: object) -> int:
        """The tokens of the prompt the request renders: the count endpoint's answer, or
        the usage of a one-token generation."""
        if not self.generates:
            tokens: int = self.ok(**fields)["input_tokens"]
            return tokens
        if self.anthropic:
            usage = self.ok(max_tokens=1, **fields)["usage"]
            return int(usage["input_tokens"] + usage["cache_read_input_tokens"])
        return int(self.ok(max_output_tokens=1, **fields)["usage"]["input_tokens"])

    def text(self, **fields: object) -> str:
        return text_of(self.ok(**fields))

    def greedy(self, max_tokens: int = 6) -> dict[str, Any]:
        """The greedy response to the default request (generation endpoints only)."""
        if max_tokens not in self._greedy:
            limit = "max_tokens" if self.anthropic else "max_output_tokens"
            self._greedy[max_tokens] = self.ok(**{limit: max_tokens})
        return self._greedy[max_tokens]

    def events(self, **fields: object) -> list[dict[str, Any]]:
        """The events of a streamed request (each event's name checked against its type)."""
        with self.client.stream("POST", PATHS[self.endpoint], json=self.body(stream=True, **fields)) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = list(r.iter_lines())
        events, name = [], None
        for line in lines:
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name, (name, event)
                events.append(event)
        return events


def text_of(body: dict[str, Any]) -> str:
    if body.get("object") == "response":
        return "".join(
            part["text"]
            for item in body["output"]
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        )
    return "".join(block["text"] for block in body["content"] if block["type"] == "text")


def usage_of(body: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = body["usage"]
    return usage


def output_tokens(body: dict[str, Any]) -> int:
    return int(usage_of(body)["output_tokens"])


def greedy_text(api: Api, max_tokens: int = 6) -> str:
    return text_of(api.greedy(max_tokens))


# ------------------------------------------------------------ Anthropic: honoured


def a_model(api: Api) -> None:
    assert api.prompt_tokens(model=api.model) == api.prompt_tokens(model=ALIAS) == api.prompt_tokens()
    if api.generates:
        assert api.ok(model=api.model)["model"] == api.model
    error = api.error(404, model="claude-nonexistent")
    assert error["type"] == "not_found_error"
    assert "claude-nonexistent" in error["message"]
    assert api.model in error["message"]  # the names it could have used


def a_messages(api: Api) -> None:
    alone = api.prompt_tokens()
    # a string is one text block; text blocks are joined with a newline
    assert api.prompt_tokens(messages=[user([text_block(MESSAGE)])]) == alone
    assert api.prompt_tokens(messages=[user([text_block("Say"), text_block("hello.")])]) == api.prompt_tokens(
        messages=[user("Say\nhello.")]
    )
    # consecutive user turns join with a blank line; a system message inside messages
    # is folded into the user text before it (causally)
    joined = api.prompt_tokens(messages=[user(f"{MESSAGE}\n\nBe brief.")])
    assert api.prompt_tokens(messages=[user(), user("Be brief.")]) == joined
    assert api.prompt_tokens(messages=[user(), {"role": "system", "content": "Be brief."}]) == joined
    assert api.prompt_tokens(messages=[user(), {"role": "developer", "content": "Be brief."}]) == joined
    # a leading one is a system message, as the top-level system is
    leading = [{"role": "developer", "content": "Be brief."}, user()]
    assert api.prompt_tokens(messages=leading) == api.prompt_tokens(system="Be brief.")
    # a last assistant message is a prefill: the answer continues it
    assert api.prompt_tokens(messages=[user(), assistant("Hello")]) > alone
    error = api.error(messages=[user(), assistant("Hello ")])
    assert "trailing whitespace" in error["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert "does not take images" in api.error(messages=[user([image])])["message"]  # (no --mmproj)
    image = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
    assert "messages[0].content[0]" in api.error(messages=[user([image])])["message"]
    assert "messages" in api.error(messages=[])["message"]
    assert "messages" in api.error(messages=OMIT)["message"]


def tool_use(call_id: str = "toolu_1", **extra: object) -> dict[str, object]:
    return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": "Paris"}, **extra}


def a_tool_use_blocks(api: Api) -> None:
    without = [user(QUESTION), assistant([text_block("Let me see.")]), user("Thanks.")]
    called = [user(QUESTION), assistant([text_block("Let me see."), tool_use()]), user("Thanks.")]
    # an earlier call is written into the prompt, the way the model writes calls
    assert api.prompt_tokens(messages=called) > api.prompt_tokens(messages=without)
    nameless = [user(QUESTION), assistant([{"type": "tool_use", "id": "toolu_1", "input": {}}]), user("x")]
    assert "messages[1].content[0]" in api.error(messages=nameless)["message"]
    last = [user(QUESTION), assistant([tool_use()])]
    assert "tool_result" in api.error(messages=last)["message"]


def tool_result(call_id: str = "toolu_1", **extra: object) -> dict[str, object]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": "sunny", **extra}


def a_tool_result_blocks(api: Api) -> None:
    def conversation(result: dict[str, object]) -> list[dict[str, object]]:
        return [user(QUESTION), assistant([tool_use()]), user([result])]

    plain = api.prompt_tokens(messages=conversation(tool_result()))
    # the id finds the call, and with it the function's name, for the result's turn
    assert api.prompt_tokens(messages=conversation(tool_result("toolu_other"))) != plain
    # is_error: the result is prefixed "error: "
    assert api.prompt_tokens(messages=conversation(tool_result(is_error=True))) > plain
    assert api.prompt_tokens(messages=conversation(tool_result(is_error=False))) == plain
    # content as text blocks is the same result
    blocks = tool_result(content=[text_block("sunny")])
    assert api.prompt_tokens(messages=conversation(blocks)) == plain
    missing = {"type": "tool_result", "content": "sunny"}
    assert "tool_use_id" in api.error(messages=conversation(missing))["message"]


def a_thinking_blocks(api: Api) -> None:
    thought = {"type": "thinking", "thinking": "The user wants a greeting.", "signature": "sig"}
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    plain = [user(), assistant([text_block("Hello!")]), user("Again.")]
    for block in (thought, redacted):
        thinking = [user(), assistant([block, text_block("Hello!")]), user("Again.")]
        # earlier turns' reasoning is dropped from the prompt, as Anthropic does
        assert api.prompt_tokens(messages=thinking) == api.prompt_tokens(messages=plain)


def a_system(api: Api) -> None:
    alone = api.prompt_tokens()
    brief = api.prompt_tokens(system="Be brief.")
    assert brief > alone
    assert api.prompt_tokens(system=[text_block("Be brief.")]) == brief
    assert api.prompt_tokens(system=[text_block("Be"), text_block("brief.")]) == api.prompt_tokens(
        system="Be\nbrief."
    )
    # Claude Code's per-request billing block is removed before rendering
    billing = text_block("x-anthropic-billing-header: cc_version=2.1.160; cch=0a1b2;")
    assert api.prompt_tokens(system=[billing, text_block("Be brief.")]) == brief
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert "system[0]" in api.error(system=[image])["message"]


def long_prompt(api: Api, room: int) -> str:
    """A user message whose prompt leaves ``room`` tokens of the context, give or take
    a few (measured with count_tokens, which counts past the context too)."""

    def tokens(words: int) -> int:
        body = {"messages": [user("word " * words)]}
        counted: int = api.client.post(PATHS["count_tokens"], json=body).json()["input_tokens"]
        return counted

    base = tokens(100)
    per_word = (tokens(200) - base) / 100
    words = 100 + int((api.context - room - base) / per_word)
    for _ in range(4):
        short = api.context - room - tokens(words)
        if abs(short) <= 4:
            break
        words += int(short / per_word) or (1 if short > 0 else -1)
    assert abs(short) <= 4, (words, short)
    return "word " * words


def a_max_tokens(api: Api) -> None:
    body = api.ok(max_tokens=3)
    if body["stop_reason"] == "max_tokens":
        assert output_tokens(body) == 3
    else:
        assert body["stop_reason"] == "end_turn"
        assert output_tokens(body) <= 3
    assert "max_tokens" in api.error(max_tokens=0)["message"]
    assert "max_tokens" in api.error(max_tokens=OMIT)["message"]  # required, as Anthropic's
    # an upper bound: more than the context has room for generates until it is full
    body = api.ok(messages=[user(long_prompt(api, room=40))], max_tokens=32000)
    prompt = usage_of(body)["input_tokens"] + usage_of(body)["cache_read_input_tokens"]
    assert api.context - 44 <= prompt <= api.context - 36
    if body["stop_reason"] == "model_context_window_exceeded":
        assert prompt + output_tokens(body) == api.context
    else:
        assert body["stop_reason"] == "end_turn", body
        assert prompt + output_tokens(body) <= api.context


def a_stop_sequences(api: Api) -> None:
    text = greedy_text(api, 12)
    stop = text.split()[1]
    body = api.ok(max_tokens=12, stop_sequences=[stop, "never-in-the-text-xyz"])
    assert body["stop_reason"] == "stop_sequence", body
    assert body["stop_sequence"] == stop
    assert text_of(body) == text[: text.index(stop)]
    events = api.events(max_tokens=12, stop_sequences=[stop])
    (end,) = [event for event in events if event["type"] == "message_delta"]
    assert end["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    # an empty sequence is no sequence
    assert text_of(api.ok(max_tokens=12, stop_sequences=[""])) == text
    # a forced call is not cut short
    forced = {"tools": [WEATHER], "tool_choice": {"type": "any"}}
    assert "stop_sequences" in api.error(stop_sequences=[stop], **forced)["message"]


def a_stream(api: Api) -> None:
    events = api.events()
    kinds = [event["type"] for event in events if event["type"] != "ping"]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    deltas = [event["delta"]["text"] for event in events if event["type"] == "content_block_delta"]
    greedy = api.greedy()
    assert "".join(deltas) == text_of(greedy)
    (end,) = [event for event in events if event["type"] == "message_delta"]
    assert end["delta"]["stop_reason"] == greedy["stop_reason"]
    assert end["usage"]["output_tokens"] == output_tokens(greedy)


def a_temperature(api: Api) -> None:
    assert api.text(temperature=0) == api.text(temperature=0) == greedy_text(api)
    api.ok(temperature=None)  # Anthropic's default, 1
    # Anthropic's range: 0 to 1
    assert "temperature" in api.error(temperature=1.5)["message"]
    assert "temperature" in api.error(temperature=-0.1)["message"]


def truncation(api: Api) -> None:
    # trioserve's on Messages, OpenAI's on Responses (docs/dialects.md, "Truncation"; the
    # cut itself: tests/e2e/test_truncation.py): a first turn longer than the context
    key = "messages" if api.anthropic else "input"
    long = [user("ocean " * api.context), assistant("Noted."), user(MESSAGE)]
    if not api.generates:
        # a count is of the conversation as sent: truncation fits a generation's prompt
        counted = api.prompt_tokens(**{key: long}, truncation="auto")
        assert counted == api.prompt_tokens(**{key: long}) > api.context
        return
    for fields in ({}, {"truncation": "disabled"}, {"truncation": None}):
        assert "the context holds" in api.error(**{key: long}, **fields)["message"]
    body = api.ok(**{key: long}, truncation="auto")
    assert body["trioserve"]["truncation"] == {"dropped_turns": 1, "dropped_messages": 2}
    # what was evaluated is the last question alone: the default request's prompt
    assert text_of(body) == greedy_text(api)
    if not api.anthropic:
        assert body["truncation"] == "auto"
        assert api.ok()["truncation"] == "disabled"  # (the server's default, echoed)
    assert "truncation" in api.error(truncation="sometimes")["message"]


def a_priority(api: Api) -> None:
    # the order it gives under load: tests/e2e/test_priorities.py; here its range, and
    # that it changes no text
    assert api.text(temperature=0, priority=7) == greedy_text(api)  # (--api-key: 0 at best)
    assert "priority" in api.error(priority=10**7)["message"]


def reasoning_control(api: Api) -> None:
    # llama-server's: false refuses the reasoning_end control for this request (the
    # default model does not reason: true is answered so); the text is the same either way
    limit = "max_tokens" if api.anthropic else "max_output_tokens"
    for value, message in (
        (False, "reasoning control not enabled"),
        (True, "this completion is not reasoning"),
    ):
        request_id = f"control-{api.endpoint}-{value}"
        body = api.body(stream=True, reasoning_control=value, **{limit: 500})
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
    assert api.text(reasoning_control=False) == text_of(api.greedy())
    assert "reasoning_control" in api.error(reasoning_control="no")["message"]


def greedy_at_temperature_1(name: str, value: float, bad: float) -> Callable[[Api], None]:
    def check(api: Api) -> None:
        # only the most likely token survives the truncation: the draw is the greedy one
        assert api.text(temperature=1, **{name: value}) == greedy_text(api)
        assert name in api.error(**{name: bad})["message"]

    return check


def a_tools(api: Api) -> None:
    assert api.prompt_tokens(tools=[WEATHER]) > api.prompt_tokens()
    # strict is accepted: a forced call follows the schema anyway
    strict = {**WEATHER, "strict": True, "type": "custom"}
    assert api.prompt_tokens(tools=[strict]) == api.prompt_tokens(tools=[WEATHER])
    if api.generates:
        body = api.ok(
            messages=[user(QUESTION)],
            tools=[WEATHER, TIME],
            tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=40,
        )
        assert body["stop_reason"] == "tool_use", body
        (block,) = body["content"]
        assert block["type"] == "tool_use"
        assert block["name"] == "get_weather"
        assert block["id"].startswith("toolu_")
        jsonschema.validate(block["input"], WEATHER_SCHEMA)
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    assert "tools[0]" in api.error(tools=[server_tool])["message"]
    assert "input_schema" in api.error(tools=[{"name": "get_weather"}])["message"]
    assert "get_weather" in api.error(tools=[WEATHER, WEATHER])["message"]


def a_tool_choice(api: Api) -> None:
    asked: dict[str, object] = {"messages": [user(QUESTION)], "tools": [WEATHER]}
    # none: the tools are not shown to the model
    none = {"type": "none"}
    assert api.prompt_tokens(tool_choice=none, **asked) == api.prompt_tokens(messages=[user(QUESTION)])
    assert api.prompt_tokens(tool_choice={"type": "auto"}, **asked) == api.prompt_tokens(**asked)
    if api.generates:
        plain = api.ok(tool_choice=none, max_tokens=3, **asked)
        assert [block["type"] for block in plain["content"]] == ["text"]
        assert plain["stop_reason"] in ("max_tokens", "end_turn")
        forced = api.ok(tool_choice={"type": "any"}, max_tokens=40, **asked)
        assert forced["stop_reason"] == "tool_use"
        assert [block["name"] for block in forced["content"]] == ["get_weather"]
        api.ok(tool_choice={"type": "auto"}, max_tokens=3, **asked)
    missing = api.error(tool_choice={"type": "tool", "name": "get_time"}, **asked)
    assert "get_time" in missing["message"]
    assert "tool_choice" in missing["message"]
    assert "tool_choice" in api.error(tool_choice={"type": "any"})["message"]  # without tools


def a_disable_parallel_tool_use(api: Api) -> None:
    asked: dict[str, object] = {"messages": [user(QUESTION)], "tools": [WEATHER, TIME]}
    for disable in (True, False):
        choice = {"type": "any", "disable_parallel_tool_use": disable}
        if api.generates:
            body = api.ok(tool_choice=choice, max_tokens=40, **asked)
            assert [block["type"] for block in body["content"]] == ["tool_use"]
        else:
            assert api.prompt_tokens(tool_choice=choice, **asked) == api.prompt_tokens(**asked)


def a_thinking(api: Api) -> None:
    # the default model does not reason: disabled and adaptive change nothing
    alone = api.prompt_tokens()
    for kind in ("disabled", "adaptive"):
        assert api.prompt_tokens(thinking={"type": kind}) == alone
    # display: what thinking blocks show (there are none here)
    for display in ("omitted", "summarized"):
        assert api.prompt_tokens(thinking={"type": "adaptive", "display": display}) == alone
    if api.generates:
        assert api.text(thinking={"type": "disabled"}) == greedy_text(api)
        # a budget is checked against max_tokens, as Anthropic checks it
        error = api.error(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1024)
        assert "thinking.budget_tokens" in error["message"]
        assert "max_tokens" in error["message"]
        # a model that does not reason keeps any budget (it produces no thinking):
        # the stream starts, with a text block
        enabled = {"type": "enabled", "budget_tokens": 1024}
        body = api.body(stream=True, thinking=enabled, max_tokens=1025)
        with api.client.stream("POST", PATHS[api.endpoint], json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content_block_start"' in line:
                    assert json.loads(line[6:])["content_block"]["type"] == "text"
                    break
    else:
        assert api.prompt_tokens(thinking={"type": "enabled", "budget_tokens": 1024}) == alone
    error = api.error(thinking={"type": "enabled", "budget_tokens": 1000})
    assert "thinking.budget_tokens" in error["message"]
    assert "1024" in error["message"]
    assert "budget_tokens" in api.error(thinking={"type": "enabled"})["message"]


def output_format(name: str) -> Callable[[Api], None]:
    def check(api: Api) -> None:
        fmt = {"type": "json_schema", "schema": SCHEMA}
        asked = {"output_config": {"format": fmt}} if name == "output_config" else {"output_format": fmt}
        # the schema is not shown to the model: it is enforced
        assert api.prompt_tokens(**asked) == api.prompt_tokens()
        if api.generates:
            value = json.loads(api.text(max_tokens=16, **asked))
            jsonschema.validate(value, SCHEMA)
        both = api.error(output_config={"format": fmt}, output_format=fmt)
        assert "output_format" in both["message"]
        forced = api.error(tools=[WEATHER], tool_choice={"type": "any"}, **asked)
        assert "forced tool call" in forced["message"]
        assert "output_config.format" in forced["message"]
        schemaless = {"type": "json_schema"}
        missing = {"output_config": {"format": schemaless}} if name == "output_config" else {name: schemaless}
        assert "schema" in api.error(**missing)["message"]

    return check


ANTHROPIC_HONOURED: dict[str, Callable[[Api], None]] = {
    "model": a_model,
    "messages": a_messages,
    "tool_use blocks": a_tool_use_blocks,
    "tool_result blocks": a_tool_result_blocks,
    "thinking blocks": a_thinking_blocks,
    "system": a_system,
    "max_tokens": a_max_tokens,
    "stop_sequences": a_stop_sequences,
    "stream": a_stream,
    "temperature": a_temperature,
    "priority": a_priority,
    "reasoning_control": reasoning_control,
    "truncation": truncation,
    "top_p": greedy_at_temperature_1("top_p", 1e-6, 0.0),
    "top_k": greedy_at_temperature_1("top_k", 1, -1),
    "tools": a_tools,
    "tool_choice": a_tool_choice,
    "tool_choice.disable_parallel_tool_use": a_disable_parallel_tool_use,
    "thinking": a_thinking,
    "output_config": output_format("output_config"),
    "output_format": output_format("output_format"),
}
#: refused: (fields that ask for it, field sets that mean "not asked for": accepted)
ANTHROPIC_REFUSED: dict[str, tuple[dict[str, object], tuple[dict[str, object], ...]]] = {
    "container": ({"container": "container_011CPR5CNjB747bTd36fQLFk"}, ({"container": None},)),
    "mcp_servers": (
        {"mcp_servers": [{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}]},
        ({"mcp_servers": None},),
    ),
    "context_management": (
        {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        (
            {"context_management": None},
            {"context_management": {"edits": []}},
            # Claude Code's, with thinking: earlier thinking never reaches the prompt anyway
            {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
        ),
    ),
    "compaction": ({"compaction": {"type": "auto"}}, ({"compaction": None},)),
    "fallbacks": ({"fallbacks": [{"model": "claude-haiku-4-5"}]}, ({"fallbacks": None},)),
    "thread": ({"thread": {"id": "thread_1"}}, ({"thread": None},)),
    "tools[].defer_loading": (
        {"tools": [{**WEATHER, "defer_loading": True}]},
        ({"tools": [{**WEATHER, "defer_loading": False}]}, {"tools": [{**WEATHER, "defer_loading": None}]}),
    ),
    "tools[].input_examples": (
        {"tools": [{**WEATHER, "input_examples": [{"city": "Paris"}]}]},
        ({"tools": [{**WEATHER, "input_examples": None}]}, {"tools": [{**WEATHER, "input_examples": []}]}),
    ),
    "diagnostics": ({"diagnostics": {"prompt_cache": True}}, ({"diagnostics": None},)),
    "inference_geo": ({"inference_geo": "us"}, ({"inference_geo": None},)),
    "speed": ({"speed": "fast"}, ({"speed": None}, {"speed": "standard"})),
    "output_config.effort": (
        {"output_config": {"effort": "low"}},
        ({"output_config": {"effort": None}}, {"output_config": {}}, {"output_config": None}),
    ),
}
#: ignored: (fields that are accepted, the fields they must give the same prompt and text as)
ANTHROPIC_IGNORED: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "cache_control": (
        {
            "cache_control": {"type": "ephemeral"},
            "system": [text_block("Be brief.", cache_control={"type": "ephemeral", "ttl": "1h"})],
            "messages": [user([text_block(MESSAGE, cache_control={"type": "ephemeral"})])],
            "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}}],
            "tool_choice": {"type": "none"},
        },
        {"system": "Be brief.", "tools": [WEATHER], "tool_choice": {"type": "none"}},
    ),
    "citations": (
        {"messages": [user([text_block(MESSAGE, citations=[CITATION])])]},
        {"messages": [user(MESSAGE)]},
    ),
    "metadata": ({"metadata": {"user_id": "user-hash-1"}}, {}),
    "service_tier": ({"service_tier": "standard_only"}, {}),
    "user_profile_id": ({"user_profile_id": "profile-1"}, {}),
    "workspace_id": ({"workspace_id": "wrkspc_1"}, {}),
}

BOTH_A, MESSAGES = ("messages", "count_tokens"), ("messages",)
ANTHROPIC_ENDPOINTS: dict[str, tuple[str, ...]] = {
    "model": BOTH_A,
    "messages": BOTH_A,
    "tool_use blocks": BOTH_A,
    "tool_result blocks": BOTH_A,
    "thinking blocks": BOTH_A,
    "citations": BOTH_A,
    "system": BOTH_A,
    "max_tokens": MESSAGES,
    "stop_sequences": MESSAGES,
    "stream": MESSAGES,
    "temperature": MESSAGES,
    "top_p": MESSAGES,
    "top_k": MESSAGES,
    "priority": MESSAGES,
    "reasoning_control": MESSAGES,
    "truncation": MESSAGES,
    "tools": BOTH_A,
    "tools[].defer_loading": BOTH_A,
    "tools[].input_examples": BOTH_A,
    "tool_choice": BOTH_A,
    "tool_choice.disable_parallel_tool_use": BOTH_A,
    "thinking": BOTH_A,
    "output_config": BOTH_A,
    "output_config.effort": BOTH_A,
    "output_format": BOTH_A,
    "cache_control": BOTH_A,
    "metadata": MESSAGES,
    "service_tier": MESSAGES,
    "user_profile_id": MESSAGES,
    "workspace_id": MESSAGES,
    "container": BOTH_A,
    "mcp_servers": BOTH_A,
    "context_management": BOTH_A,
    "diagnostics": BOTH_A,
    "compaction": BOTH_A,
    "fallbacks": BOTH_A,
    "thread": BOTH_A,
    "inference_geo": BOTH_A,
    "speed": BOTH_A,
}


# ------------------------------------------------------------ Responses: honoured


def r_model(api: Api) -> None:
    assert api.prompt_tokens(model=api.model) == api.prompt_tokens()
    if api.generates:
        assert api.ok(model=api.model)["model"] == api.model
    error = api.error(404, model="gpt-9")
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


def message_item(role: str, text: str, part: str = "input_text", **extra: object) -> dict[str, object]:
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}], **extra}


def r_input(api: Api) -> None:
    alone = api.prompt_tokens()
    assert api.prompt_tokens(input=[message_item("user", MESSAGE)]) == alone
    assert api.prompt_tokens(input=[{"role": "user", "content": MESSAGE}]) == alone  # type optional
    parts = [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hello."}]
    assert api.prompt_tokens(input=[{"role": "user", "content": parts}]) == alone
    turns = [
        message_item("user", MESSAGE),
        message_item("assistant", "Hello!", "output_text"),
        user("Again."),
    ]
    assert api.prompt_tokens(input=turns) > alone
    # a system/developer message after the first other one is folded into user text
    joined = api.prompt_tokens(input=f"{MESSAGE}\n\nBe brief.")
    assert api.prompt_tokens(input=[user(), {"role": "developer", "content": "Be brief."}]) == joined
    error = api.error(input=[{"type": "web_search_call", "id": "ws_1"}])
    assert error["param"] == "input[0].type"
    assert api.error(input=[{"type": "message", "content": MESSAGE}])["param"] == "input[0].role"
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}
    assert api.error(input=[image])["code"] == "images_not_supported"  # (a model without --mmproj)
    image = {"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}
    assert api.error(input=[image])["param"] == "input[0].content[0].file_id"
    assert api.error(input=[])["param"] == "input"
    assert api.error(input="")["param"] == "input"
    assert api.error(input=OMIT)["param"] == "input"  # required
    assert api.error(input=[{"role": "system", "content": "Be brief."}])["param"] == "input"


def function_call(call_id: str = "call_1") -> dict[str, object]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }


def r_function_call_items(api: Api) -> None:
    without = [user(QUESTION), message_item("assistant", "Let me see.", "output_text"), user("Thanks.")]
    called = [
        user(QUESTION),
        message_item("assistant", "Let me see.", "output_text"),
        function_call(),
        user("Thanks."),
    ]
    assert api.prompt_tokens(input=called) > api.prompt_tokens(input=without)
    nameless = [user(QUESTION), {"type": "function_call", "call_id": "call_1", "arguments": "{}"}]
    assert api.error(input=nameless)["param"] == "input[1]"


def r_function_call_output_items(api: Api) -> None:
    def conversation(call_id: str) -> list[dict[str, object]]:
        return [
            user(QUESTION),
            function_call(),
            {"type": "function_call_output", "call_id": call_id, "output": "sunny"},
        ]

    # the id finds the call, and with it the function's name, for the result's turn
    assert api.prompt_tokens(input=conversation("call_1")) != api.prompt_tokens(input=conversation("call_x"))
    missing = [user(QUESTION), function_call(), {"type": "function_call_output", "output": "sunny"}]
    assert api.error(input=missing)["param"] == "input[2].call_id"


def r_reasoning_items(api: Api) -> None:
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}
    plain = [user(), message_item("assistant", "Hello!", "output_text"), user("Again.")]
    thinking = [user(), item, message_item("assistant", "Hello!", "output_text"), user("Again.")]
    # another model's reasoning is dropped from the prompt
    assert api.prompt_tokens(input=thinking) == api.prompt_tokens(input=plain)


def r_instructions(api: Api) -> None:
    brief = api.prompt_tokens(instructions="Be brief.")
    assert brief > api.prompt_tokens()
    assert brief == api.prompt_tokens(input=[{"role": "system", "content": "Be brief."}, user()])
    if api.generates:
        assert api.ok(instructions="Be brief.")["instructions"] == "Be brief."
        assert api.ok()["instructions"] is None


def r_tools(api: Api) -> None:
    assert api.prompt_tokens(tools=[R_WEATHER]) > api.prompt_tokens()
    if api.generates:
        body = api.ok(
            input=QUESTION,
            tools=[R_WEATHER, R_TIME],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=40,
        )
        assert body["status"] == "completed", body
        (item,) = body["output"]
        assert item["type"] == "function_call"
        assert item["name"] == "get_weather"
        assert item["call_id"].startswith("call_")
        jsonschema.validate(json.loads(item["arguments"]), WEATHER_SCHEMA)
        assert [tool["name"] for tool in body["tools"]] == ["get_weather", "get_time"]
    assert api.error(tools=[{"type": "web_search"}])["param"] == "tools[0].type"
    assert api.error(tools=[{"type": "function"}])["param"] == "tools[0].name"
    assert api.error(tools=[R_WEATHER, R_WEATHER])["param"] == "tools"


def r_tool_choice(api: Api) -> None:
    asked: dict[str, object] = {"input": QUESTION, "tools": [R_WEATHER]}
    # none: the tools are not shown to the model
    assert api.prompt_tokens(tool_choice="none", **asked) == api.prompt_tokens(input=QUESTION)
    assert api.prompt_tokens(tool_choice="auto", **asked) == api.prompt_tokens(**asked)
    if api.generates:
        plain = api.ok(tool_choice="none", max_output_tokens=3, **asked)
        assert [item["type"] for item in plain["output"]] == ["message"]
        assert plain["tool_choice"] == "none"
        forced = api.ok(tool_choice="required", max_output_tokens=40, **asked)
        assert [item["type"] for item in forced["output"]] == ["function_call"]
        assert forced["tool_choice"] == "required"
    missing = api.error(tool_choice={"type": "function", "name": "get_time"}, **asked)
    assert missing["param"] == "tool_choice.name"
    assert api.error(tool_choice="required")["param"] == "tool_choice"  # without tools
    assert api.error(tool_choice={"type": "file_search"}, **asked)["param"] == "tool_choice"


def r_text(api: Api) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    # the schema is not shown to the model: it is enforced
    assert api.prompt_tokens(text={"format": fmt}) == api.prompt_tokens()
    if api.generates:
        body = api.ok(text={"format": fmt}, max_output_tokens=16)
        jsonschema.validate(json.loads(text_of(body)), SCHEMA)
        assert body["text"]["format"]["name"] == "answer"
        assert body["text"]["format"]["schema"] == SCHEMA
        value = json.loads(api.text(text={"format": {"type": "json_object"}}, max_output_tokens=16))
        assert isinstance(value, dict)
        assert api.text(text={"format": {"type": "text"}}) == greedy_text(api)
    assert api.error(text={"format": {"type": "json_schema"}})["param"] == "text.format.schema"
    forced = api.error(text={"format": fmt}, tools=[R_WEATHER], tool_choice="required")
    assert forced["param"] == "tool_choice"


def r_parallel_tool_calls(api: Api) -> None:
    asked: dict[str, object] = {"input": QUESTION, "tools": [R_WEATHER, R_TIME], "tool_choice": "required"}
    for parallel in (False, True):
        if api.generates:
            body = api.ok(parallel_tool_calls=parallel, max_output_tokens=40, **asked)
            assert [item["type"] for item in body["output"]] == ["function_call"]
            assert body["parallel_tool_calls"] is parallel
        else:
            assert api.prompt_tokens(parallel_tool_calls=parallel, **asked) == api.prompt_tokens(**asked)


def r_max_output_tokens(api: Api) -> None:
    body = api.ok(max_output_tokens=3)
    assert body["max_output_tokens"] == 3
    if body["status"] == "incomplete":
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert output_tokens(body) == 3
    else:
        assert body["status"] == "completed"
        assert body["incomplete_details"] is None
        assert output_tokens(body) <= 3
    assert api.error(max_output_tokens=0)["param"] == "max_output_tokens"
    # more than fits after the prompt: OpenAI's rule, as on the chat endpoints
    error = api.error(max_output_tokens=api.context)
    assert error["code"] == "context_length_exceeded"
    assert "tokens fit after the" in error["message"]


def r_temperature(api: Api) -> None:
    assert api.text(temperature=0) == api.text(temperature=0) == greedy_text(api)
    assert api.ok()["temperature"] == 0
    assert api.ok(temperature=None)["temperature"] == 1  # OpenAI's default
    assert api.error(temperature=2.5)["param"] == "temperature"


def r_priority(api: Api) -> None:
    assert api.text(temperature=0, priority=7) == greedy_text(api)  # (--api-key: 0 at best)
    assert api.error(priority=10**7)["param"] == "priority"


def r_top_p(api: Api) -> None:
    # only the most likely token survives the truncation: the draw is the greedy one
    body = api.ok(temperature=1, top_p=1e-6)
    assert text_of(body) == greedy_text(api)
    assert body["top_p"] == 1e-6
    assert api.error(top_p=0)["param"] == "top_p"


def r_stream(api: Api) -> None:
    events = api.events()
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    kinds = [event["type"] for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{api.greedy()['status']}",
    ]
    deltas = [event["delta"] for event in events if event["type"] == "response.output_text.delta"]
    assert "".join(deltas) == greedy_text(api)
    final = events[-1]["response"]
    assert text_of(final) == greedy_text(api)
    assert output_tokens(final) == output_tokens(api.greedy())


def r_metadata(api: Api) -> None:
    assert api.ok(metadata={"tenant": "t-1", "run": "7"})["metadata"] == {"tenant": "t-1", "run": "7"}
    assert api.ok()["metadata"] == {}
    assert api.error(metadata={"count": 7})["param"].startswith("metadata")


def r_max_tool_calls(api: Api) -> None:
    asked: dict[str, object] = {"input": QUESTION, "tools": [R_WEATHER, R_TIME], "tool_choice": "required"}
    body = api.ok(max_tool_calls=1, max_output_tokens=40, **asked)
    assert [item["type"] for item in body["output"]] == ["function_call"]
    assert api.error(max_tool_calls=0, **asked)["param"] == "max_tool_calls"


def _create(api: Api, **fields: object) -> dict[str, Any]:
    """A response created on the module's server (whichever endpoint ``api`` is)."""
    body = {"model": api.model, "input": MESSAGE, "max_output_tokens": 6, "temperature": 0, **fields}
    response = api.client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    created: dict[str, Any] = response.json()
    return created


def r_previous_response_id(api: Api) -> None:
    first = _create(api, input=QUESTION)
    assert first["store"] is True
    follow = [{"role": "user", "content": "And tomorrow?"}]
    whole = [{"role": "user", "content": QUESTION}, *first["output"], *follow]
    continued = {"input": follow, "previous_response_id": first["id"]}
    # the stored conversation, then this input: the prompt of the whole conversation
    assert api.prompt_tokens(**continued) == api.prompt_tokens(input=whole)
    if api.generates:
        body = api.ok(**continued)
        assert body["previous_response_id"] == first["id"]
        assert text_of(body) == api.text(input=whole)
    missing = api.error(previous_response_id="resp_0123456789abcdef0123456789abcdef")
    assert missing["param"] == "previous_response_id"


def r_store(api: Api) -> None:
    stored = api.ok()
    assert stored["store"] is True  # OpenAI's default
    read = api.client.get(f"/v1/responses/{stored['id']}")
    assert read.status_code == 200, read.text
    assert read.json() == stored
    unstored = api.ok(store=False)
    assert unstored["store"] is False
    assert api.client.get(f"/v1/responses/{unstored['id']}").status_code == 404


def r_background(api: Api) -> None:
    if not api.generates:  # (input_tokens: counted as it would run)
        assert api.prompt_tokens(background=True) == api.prompt_tokens()
        return
    queued = api.ok(background=True)
    assert queued["status"] in ("queued", "in_progress")
    assert queued["background"] is True
    assert queued["output"] == []
    deadline = time.monotonic() + 120
    body = queued
    while body["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline, body
        time.sleep(0.05)  # (polled: GET is how a client learns a background response ended)
        body = api.client.get(f"/v1/responses/{queued['id']}").json()
    assert body["status"] == api.greedy()["status"]
    assert text_of(body) == greedy_text(api)
    assert api.error(background=True, store=False)["param"] == "store"
    # with stream: its events on the POST (a resumable stream, docs/resumable-streams.md)
    events = api.events(background=True)
    assert events[0]["response"]["background"] is True
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == greedy_text(api)


RESPONSES_HONOURED: dict[str, Callable[[Api], None]] = {
    "model": r_model,
    "input": r_input,
    "function_call items": r_function_call_items,
    "function_call_output items": r_function_call_output_items,
    "reasoning items": r_reasoning_items,
    "instructions": r_instructions,
    "tools": r_tools,
    "tool_choice": r_tool_choice,
    "text.format": r_text,
    "parallel_tool_calls": r_parallel_tool_calls,
    "max_output_tokens": r_max_output_tokens,
    "temperature": r_temperature,
    "priority": r_priority,
    "reasoning_control": reasoning_control,
    "truncation": truncation,
    "top_p": r_top_p,
    "stream": r_stream,
    "metadata": r_metadata,
    "max_tool_calls": r_max_tool_calls,
    "previous_response_id": r_previous_response_id,
    "store": r_store,
    "background": r_background,
}
RESPONSES_REFUSED: dict[str, tuple[dict[str, object], tuple[dict[str, object], ...]]] = {
    "conversation": ({"conversation": "conv_123"}, ({"conversation": None},)),
    "prompt": ({"prompt": {"id": "pmpt_123"}}, ({"prompt": None},)),
    "context_management": (
        {"context_management": [{"type": "compaction", "compact_threshold": 200000}]},
        ({"context_management": None},),
    ),
    "moderation": ({"moderation": {"model": "omni-moderation-latest"}}, ({"moderation": None},)),
    "reasoning": (
        {"reasoning": {"effort": "low"}},
        ({"reasoning": None}, {"reasoning": {}}, {"reasoning": {"effort": "none"}}),
    ),
    "text.verbosity": (
        {"text": {"verbosity": "low"}},
        ({"text": {"verbosity": None}}, {"text": {"verbosity": "medium"}}),
    ),
    "include": (
        {"include": ["message.output_text.logprobs"]},
        ({"include": None}, {"include": []}, {"include": ["reasoning.encrypted_content"]}),
    ),
    "service_tier": (
        {"service_tier": "flex"},
        ({"service_tier": None}, {"service_tier": "auto"}, {"service_tier": "default"}),
    ),
    "top_logprobs": ({"top_logprobs": 2}, ({"top_logprobs": None}, {"top_logprobs": 0})),
}
RESPONSES_IGNORED: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "stream_options": ({"stream_options": {"include_obfuscation": False}}, {}),
    "user": ({"user": "user-1"}, {}),
    "safety_identifier": ({"safety_identifier": "user-hash-1"}, {}),
    "prompt_cache_key": ({"prompt_cache_key": "tenant-1"}, {}),
    "prompt_cache_retention": ({"prompt_cache_retention": "24h"}, {}),
}

BOTH_R, RESPONSES = ("responses", "input_tokens"), ("responses",)
RESPONSES_ENDPOINTS: dict[str, tuple[str, ...]] = {
    "model": BOTH_R,
    "input": BOTH_R,
    "function_call items": BOTH_R,
    "function_call_output items": BOTH_R,
    "reasoning items": BOTH_R,
    "instructions": BOTH_R,
    "tools": BOTH_R,
    "tool_choice": BOTH_R,
    "text.format": BOTH_R,
    "text.verbosity": BOTH_R,
    "parallel_tool_calls": BOTH_R,
    "reasoning": BOTH_R,
    "truncation": BOTH_R,
    "previous_response_id": BOTH_R,
    "conversation": BOTH_R,
    "prompt": BOTH_R,
    "background": BOTH_R,
    "context_management": BOTH_R,
    "moderation": BOTH_R,
    "max_output_tokens": RESPONSES,
    "temperature": RESPONSES,
    "top_p": RESPONSES,
    "stream": RESPONSES,
    "store": RESPONSES,
    "include": RESPONSES,
    "metadata": RESPONSES,
    "service_tier": RESPONSES,
    "top_logprobs": RESPONSES,
    "max_tool_calls": RESPONSES,
    "priority": RESPONSES,
    "reasoning_control": RESPONSES,
    "stream_options": RESPONSES,
    "user": RESPONSES,
    "safety_identifier": RESPONSES,
    "prompt_cache_key": RESPONSES,
    "prompt_cache_retention": RESPONSES,
}


@dataclass(frozen=True)
class Table:
    dialect: str
    section: str
    honoured: dict[str, Callable[[Api], None]]
    refused: dict[str, tuple[dict[str, object], tuple[dict[str, object], ...]]]
    ignored: dict[str, tuple[dict[str, object], dict[str, object]]]
    endpoints: dict[str, tuple[str, ...]]

    def status(self, name: str) -> str:
        return "honoured" if name in self.honoured else "refused" if name in self.refused else "ignored"

    @property
    def rows(self) -> list[tuple[str, str, str]]:
        return [
            (name, endpoint, self.status(name))
            for name, endpoints in self.endpoints.items()
            for endpoint in endpoints
        ]


TABLES = {
    "anthropic": Table(
        "anthropic",
        "Anthropic Messages",
        ANTHROPIC_HONOURED,
        ANTHROPIC_REFUSED,
        ANTHROPIC_IGNORED,
        ANTHROPIC_ENDPOINTS,
    ),
    "responses": Table(
        "responses",
        "OpenAI Responses",
        RESPONSES_HONOURED,
        RESPONSES_REFUSED,
        RESPONSES_IGNORED,
        RESPONSES_ENDPOINTS,
    ),
}
ROWS = [(table.dialect, *row) for table in TABLES.values() for row in table.rows]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerProcess(
        "--threads", "2", "--slots", str(SLOTS), "--api-key", KEY, "--model-alias", ALIAS
    ) as s:
        url = s.wait_ready()
        yield url
        assert s.stop() == 0


@pytest.fixture(scope="module")
def apis(server_url: str) -> Iterator[dict[str, Api]]:
    with (
        httpx.Client(base_url=server_url, timeout=120, headers={"x-api-key": KEY}) as anthropic,
        httpx.Client(base_url=server_url, timeout=120, headers={"authorization": f"Bearer {KEY}"}) as openai,
    ):
        served = openai.get("/v1/models").json()["data"][0]
        model, context = served["id"], served["context_length"]
        yield {
            endpoint: Api(anthropic if endpoint in BOTH_A else openai, endpoint, model, context)
            for endpoint in PATHS
        }


@pytest.mark.parametrize("row", [pytest.param(row, id="-".join(row).replace(" ", "_")) for row in ROWS])
def test_field(apis: dict[str, Api], row: tuple[str, str, str, str]) -> None:
    dialect, name, endpoint, status = row
    table, api = TABLES[dialect], apis[endpoint]
    if status == "honoured":
        table.honoured[name](api)
    elif status == "refused":
        asking, accepted = table.refused[name]
        error = api.error(**asking)
        assert error["type"] == "invalid_request_error"
        # (a nested field by its path: tools[0].defer_loading)
        path = name.replace("[]", "[0]")
        assert path in error["message"], error["message"]
        if api.anthropic:
            # the message is all an Anthropic client shows: it names the field and says why
            assert error["message"].startswith(path), error["message"]
            assert " is not supported: " in error["message"], error["message"]
        else:
            assert error["param"] == path
        for fields in accepted:
            api.ok(**fields)
    else:
        fields, baseline = table.ignored[name]
        assert api.prompt_tokens(**fields) == api.prompt_tokens(**baseline)
        if api.generates:
            limit = "max_tokens" if api.anthropic else "max_output_tokens"
            assert api.text(**{limit: 3, **fields}) == api.text(**{limit: 3, **baseline})


@pytest.mark.parametrize("endpoint", PATHS)
def test_an_unknown_field_is_ignored(apis: dict[str, Api], endpoint: str) -> None:
    api = apis[endpoint]
    unknown = {"frobnicate": 1, "x_trioserve_wish": {"a": [1]}}
    assert api.prompt_tokens(**unknown) == api.prompt_tokens()
    if api.generates:
        assert api.text(**unknown) == greedy_text(api)


def test_the_anthropic_headers_are_accepted_and_change_nothing(server_url: str, apis: dict[str, Api]) -> None:
    api = apis["messages"]
    body = api.body()
    claude = {
        "x-api-key": KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }
    for path in ("/v1/messages", "/v1/messages?beta=true"):
        response = httpx.post(server_url + path, json=body, headers=claude, timeout=120)
        assert response.status_code == 200, response.text
        assert text_of(response.json()) == greedy_text(api)
        counted = httpx.post(
            server_url + path.replace("/v1/messages", "/v1/messages/count_tokens"),
            json={"messages": body["messages"]},
            headers=claude,
            timeout=60,
        )
        assert counted.json() == {"input_tokens": apis["count_tokens"].prompt_tokens()}
    # the key as a bearer token works here too; none, or a wrong one, is Anthropic's 401
    bearer = httpx.post(
        server_url + "/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert bearer.status_code == 200, bearer.text
    for headers in ({}, {"x-api-key": "wrong"}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            refused = httpx.post(server_url + path, json=body, headers=headers, timeout=60)
            assert refused.status_code == 401
            error = refused.json()
            assert error["type"] == "error"
            assert error["error"]["type"] == "authentication_error"
            assert set(error["error"]) == {"type", "message"}
    # the Responses endpoints take either header, and answer in OpenAI's shape
    responses = httpx.post(
        server_url + "/v1/responses/input_tokens", json={"input": MESSAGE}, headers=claude, timeout=60
    )
    assert responses.json() == {
        "object": "response.input_tokens",
        "input_tokens": apis["input_tokens"].prompt_tokens(),
    }
    unkeyed = httpx.post(server_url + "/v1/responses", json={"input": MESSAGE}, timeout=60)
    assert unkeyed.status_code == 401
    assert unkeyed.json()["error"]["code"] == "invalid_api_key"


def test_the_token_counts_are_the_prompt_generation_reports(apis: dict[str, Api]) -> None:
    messages, responses = apis["messages"], apis["responses"]
    request = {"system": "Be brief.", "messages": [user(QUESTION)], "tools": [WEATHER]}
    counted = apis["count_tokens"].ok(**request)
    assert set(counted) == {"input_tokens"}
    assert counted["input_tokens"] == messages.prompt_tokens(**request)
    asked = {"instructions": "Be brief.", "input": QUESTION, "tools": [R_WEATHER]}
    counted = apis["input_tokens"].ok(**asked)
    assert set(counted) == {"object", "input_tokens"}
    assert counted["input_tokens"] == responses.prompt_tokens(**asked)
    # the same conversation renders the same prompt in every dialect
    assert apis["count_tokens"].prompt_tokens(**request) == apis["input_tokens"].prompt_tokens(**asked)


def test_the_anthropic_error_body(apis: dict[str, Api]) -> None:
    api = apis["messages"]
    for status, fields, kind in (
        (400, {"max_tokens": "many"}, "invalid_request_error"),
        (400, {"container": "c"}, "invalid_request_error"),
        (404, {"model": "nope"}, "not_found_error"),
    ):
        assert api.error(status, **fields)["type"] == kind
    response = api.client.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def _struct_fields(struct: type[msgspec.Struct]) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


#: rows for parts of a field's value (block and item types), not fields of the request
PART_ROWS = frozenset(
    {
        "tool_use blocks",
        "tool_result blocks",
        "thinking blocks",
        "citations",
        "function_call items",
        "function_call_output items",
        "reasoning items",
    }
)


def _top_level(endpoints: dict[str, tuple[str, ...]], endpoint: str) -> set[str]:
    return {
        name.split(".")[0].removesuffix("[]")
        for name, on in endpoints.items()
        if endpoint in on and name not in PART_ROWS
    }


def test_every_request_field_has_a_row() -> None:
    """The rows name every field the request structs declare (a nested field in its
    parent's row, unless it has a status of its own), on the endpoints that read it, and
    every field the code refuses."""
    from trioserve._wire import _anthropic_request as _anthropic
    from trioserve._wire import _responses_request as _responses

    assert _top_level(ANTHROPIC_ENDPOINTS, "messages") == _struct_fields(_anthropic.MessagesRequest)
    assert _top_level(ANTHROPIC_ENDPOINTS, "count_tokens") == _struct_fields(_anthropic.CountTokensRequest)
    assert {name for name, _defaults, _why in _anthropic._REFUSED} <= set(ANTHROPIC_REFUSED)
    assert _top_level(RESPONSES_ENDPOINTS, "responses") == _struct_fields(_responses.ResponsesRequest)
    assert _top_level(RESPONSES_ENDPOINTS, "input_tokens") == _struct_fields(_responses.InputTokensRequest)
    assert {name for name, _defaults, _why in _responses._REFUSED} <= set(RESPONSES_REFUSED)


@pytest.mark.parametrize("dialect", TABLES)
def test_the_documented_table_matches(dialect: str) -> None:
    table = TABLES[dialect]
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    start = doc.index(f"## {table.section}")
    end = doc.find("\n## ", start + 1)
    section = doc[start : end if end != -1 else len(doc)]
    cells = re.findall(r"^\| ([^|]+?) \| (✓|—) \| (✓|—) \| (honoured|refused|ignored) \|", section, re.M)
    first, second = ("messages", "count_tokens") if dialect == "anthropic" else ("responses", "input_tokens")
    documented = set()
    for cell, one, two, status in cells:
        name = cell.replace("`", "")
        for endpoint, mark in ((first, one), (second, two)):
            if mark == "✓":
                documented.add((name, endpoint, status))
    assert len(cells) == len(table.endpoints)
    assert documented == set(table.rows)
