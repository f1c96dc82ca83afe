"""Every dialect's next turn reuses the whole previous prompt (issue 23): chat completions,
Anthropic Messages and Responses, with a long tool result in the middle. The canonical cut
ends every rendered prompt on a cut (the generation header), and each dialect renders a
conversation so that the next turn starts with the previous prompt; so a turn costs only
what it adds — a tool's output once, never again. (What a turn reuses of the *reply*
depends on the tokens this CPU drew and how the reply's text tokenizes again; the
benchmark measures it: docs/benchmarks.md, "Conversations and the prompt cache".)"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from .._helpers import ServerProcess

pytestmark = pytest.mark.model

#: a tool's output: long (several pieces), appended once
OUTPUT = "\n".join(
    f"line {i}: the harbour log records ship {i} arriving with grain and salt." for i in range(40)
)
TOOLS_CHAT = [
    {
        "type": "function",
        "function": {
            "name": "read_log",
            "description": "Read the harbour log.",
            "parameters": {"type": "object"},
        },
    }
]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with ServerProcess("--threads", "2", "--slots", "2") as server:
        url = server.wait_ready()
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client
        assert server.stop() == 0


def _chat(http: httpx.Client, messages: list[dict[str, Any]]) -> tuple[int, int]:
    body = {"messages": messages, "tools": TOOLS_CHAT, "max_tokens": 8, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _messages(http: httpx.Client, messages: list[dict[str, Any]]) -> tuple[int, int]:
    tools = [{"name": "read_log", "description": "Read the harbour log.", "input_schema": {"type": "object"}}]
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "tools": tools, "max_tokens": 8, "temperature": 0}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"], usage["cache_read_input_tokens"]


def _responses(http: httpx.Client, items: list[dict[str, Any]]) -> tuple[int, int]:
    tools = [
        {"type": "function", "name": "read_log", "description": "Read the harbour log.", "parameters": {}}
    ]
    body = {"input": items, "tools": tools, "max_output_tokens": 16, "temperature": 0}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


def _chat_turns(tag: str) -> list[list[dict[str, Any]]]:
    ask = {"role": "user", "content": f"[{tag}] What arrived in the harbour this week? Read the log."}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_log", "arguments": "{}"}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": OUTPUT}
    answer = {"role": "assistant", "content": "Grain and salt, on forty ships."}
    follow = {"role": "user", "content": "Which ship came first?"}
    return [[ask], [ask, call, result], [ask, call, result, answer, follow]]


def _anthropic_turns(tag: str) -> list[list[dict[str, Any]]]:
    ask = {"role": "user", "content": f"[{tag}] What arrived in the harbour this week? Read the log."}
    call = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_log", "input": {}}],
    }
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": OUTPUT}],
    }
    answer = {"role": "assistant", "content": "Grain and salt, on forty ships."}
    follow = {"role": "user", "content": "Which ship came first?"}
    return [[ask], [ask, call, result], [ask, call, result, answer, follow]]


def _responses_turns(tag: str) -> list[list[dict[str, Any]]]:
    ask = {"role": "user", "content": f"[{tag}] What arrived in the harbour this week? Read the log."}
    call = {"type": "function_call", "call_id": "call_1", "name": "read_log", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": OUTPUT}
    answer = {"role": "assistant", "content": "Grain and salt, on forty ships."}
    follow = {"role": "user", "content": "Which ship came first?"}
    return [[ask], [ask, call, result], [ask, call, result, answer, follow]]


DIALECTS: dict[str, tuple[Callable[..., tuple[int, int]], Callable[[str], list[list[dict[str, Any]]]]]] = {
    "chat": (_chat, _chat_turns),
    "messages": (_messages, _anthropic_turns),
    "responses": (_responses, _responses_turns),
}


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_each_turn_reuses_the_whole_previous_prompt_and_a_tool_output_costs_once(
    http: httpx.Client, dialect: str
) -> None:
    send, turns = DIALECTS[dialect]
    figures = [send(http, messages) for messages in turns(uuid.uuid4().hex)]
    (first, _), (second, second_cached), (third, third_cached) = figures
    print(f"\n{dialect}: prompt/cached per turn {figures}")
    # turn 2 reuses all of turn 1's prompt: it evaluates the call and the tool output
    assert second_cached >= first
    # turn 3 reuses all of turn 2's — the long tool output is never evaluated again
    assert second - first > 400  # (the output: several pieces)
    assert third_cached >= second
    assert third - third_cached < 60  # the answer and the question only
