"""``truncation: "auto"`` at the wire (docs/dialects.md, "Truncation"): where a kept tail
of a conversation may start — whole turns, never the system prompt or the last user
turn, never a tool result without its call — and the generation each dialect builds
from fewer turns."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve._wire import CHAT, MESSAGES, RESPONSES, ReadOptions
from trioserve._wire._chat import GemmaFormat
from trioserve._wire._limits import RequestLimits
from trioserve._wire._messages import CallFunction, ChatMessage, MessageToolCall
from trioserve._wire._truncation import Dropped, turn_starts, without_turns

GEMMA = GemmaFormat()


def system(text: str = "Be brief.") -> ChatMessage:
    return ChatMessage(role="system", content=text)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def assistant(text: str = "", *calls: str) -> ChatMessage:
    tool_calls = [MessageToolCall(id=c, function=CallFunction(name="f", arguments="{}")) for c in calls]
    return ChatMessage(role="assistant", content=text, tool_calls=tool_calls or None)


def tool(call: str) -> ChatMessage:
    return ChatMessage(role="tool", content="42", tool_call_id=call)


def test_a_turn_is_a_user_message_and_what_follows_it() -> None:
    messages = [system(), user("a"), assistant("A"), user("b"), assistant("B"), user("c")]
    assert turn_starts(messages) == [3, 5]
    assert without_turns(messages, 3) == [system(), user("b"), assistant("B"), user("c")]
    assert without_turns(messages, 5) == [system(), user("c")]


def test_nothing_to_drop_when_the_last_user_turn_is_the_first() -> None:
    assert turn_starts([system(), user("a")]) == []
    # (an agent's loop: one user message, then calls and results: they are its last turn)
    assert turn_starts([user("a"), assistant("", "c1"), tool("c1"), assistant("", "c2"), tool("c2")]) == []


def test_a_greeting_before_the_first_user_message_is_a_turn() -> None:
    messages = [system(), assistant("Hello!"), user("a"), assistant("A"), user("b")]
    assert turn_starts(messages) == [2, 4]


def test_a_tool_result_is_never_kept_without_its_call() -> None:
    # the result of c1 comes after the user message at 3: no cut may fall there
    messages = [user("a"), assistant("", "c1"), user("also"), tool("c1"), assistant("A"), user("b")]
    assert turn_starts(messages) == [5]
    # calls answered within their turn leave every cut free
    messages = [
        user("a"),
        assistant("", "c1", "c2"),
        tool("c1"),
        tool("c2"),
        user("b"),
        assistant("B"),
        user("c"),
    ]
    assert turn_starts(messages) == [4, 6]


def test_system_messages_anywhere_are_kept() -> None:
    messages = [system(), user("a"), system("Now in French."), assistant("A"), user("b")]
    assert without_turns(messages, 4) == [system(), system("Now in French."), user("b")]


def _options() -> ReadOptions:
    return ReadOptions(limits=RequestLimits(), model_name=lambda name: name or "m", truncation="auto")


CONVERSATION = [("a", "A"), ("b", "B"), ("c", "C")]


@pytest.mark.parametrize(
    ("spec", "body"),
    [
        (
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    *[
                        m
                        for q, a in CONVERSATION
                        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
                    ],
                    {"role": "user", "content": "d"},
                ]
            },
        ),
        (
            RESPONSES,
            {
                "instructions": "Be brief.",
                "input": [
                    *[
                        m
                        for q, a in CONVERSATION
                        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
                    ],
                    {"role": "user", "content": "d"},
                ],
            },
        ),
        (
            MESSAGES,
            {
                "system": "Be brief.",
                "max_tokens": 5,
                "messages": [
                    *[
                        m
                        for q, a in CONVERSATION
                        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
                    ],
                    {"role": "user", "content": "d"},
                ],
            },
        ),
    ],
)
def test_every_conversation_dialect_builds_its_prompt_from_fewer_turns(
    spec: Any, body: dict[str, Any]
) -> None:
    read = spec.read
    parsed = read(json.dumps(body).encode(), GEMMA, _options())
    truncation = parsed.truncation
    assert truncation is not None
    assert truncation.mode == "auto"  # (the server's default, as the request did not say)
    starts = truncation.starts()
    assert len(starts) == 3
    full = parsed.generation.prompt
    assert truncation.dropping(starts, 3)[0].prompt == (
        "<start_of_turn>user\nBe brief.\n\nd<end_of_turn>\n<start_of_turn>model\n"
    )
    shorter, dropped = truncation.dropping(starts, 1)
    assert dropped == Dropped(turns=1, messages=2)
    assert shorter.prompt == full.replace(
        "a<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n<start_of_turn>user\n", ""
    )
    # the request's own field wins over the server's default
    disabled = read(json.dumps({**body, "truncation": "disabled"}).encode(), GEMMA, _options())
    assert disabled.truncation.mode == "disabled"


def test_a_response_says_what_was_dropped() -> None:
    read = RESPONSES.read
    assert read is not None
    body = {
        "input": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "b"},
        ]
    }
    parsed = read(json.dumps(body).encode(), GEMMA, _options())
    assert parsed.dialect.snapshot("in_progress")["truncation"] == "auto"
    assert "trioserve" not in parsed.dialect.snapshot("in_progress")
    parsed.truncation.note(Dropped(turns=1, messages=2))
    snapshot = parsed.dialect.snapshot("in_progress")
    assert snapshot["trioserve"]["truncation"] == {"dropped_turns": 1, "dropped_messages": 2}
