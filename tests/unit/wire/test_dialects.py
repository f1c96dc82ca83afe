"""The Anthropic Messages and OpenAI Responses dialects, sans-IO: requests → the chat a
chat completion would render, and the events and bodies they write (docs/dialects.md).
No model: the renders use the Gemma fallback format, the events are parsed back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic.types
import msgspec
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from trioserve._core._exceptions import InvalidRequestError, OverloadedError
from trioserve._core._types import Usage
from trioserve._wire._anthropic import (
    decode_count_tokens_request,
    decode_messages_request,
    messages_conversation,
)
from trioserve._wire._anthropic_writer import AnthropicDialect, anthropic_error
from trioserve._wire._chat import GemmaFormat
from trioserve._wire._conversation import fold_system_messages, generation_for
from trioserve._wire._limits import RequestLimits
from trioserve._wire._openai import ChatMessage, ChoiceResult, ContentPart
from trioserve._wire._responses import decode_responses_request, responses_conversation
from trioserve._wire._responses_writer import ResponsesDialect

CLAUDE_CODE = Path(__file__).parents[2] / "data" / "claude_code_request.json"
GEMMA = GemmaFormat()


def _messages(body: dict[str, Any]) -> Any:
    return messages_conversation(decode_messages_request(json.dumps(body).encode()))


def _prompt(body: dict[str, Any], **kwargs: Any) -> str:
    request = decode_messages_request(json.dumps(body).encode())
    prompt = generation_for(messages_conversation(request, **kwargs), GEMMA)[0].prompt
    assert isinstance(prompt, str)
    return prompt


def _sse(data: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    events = []
    for block in data.decode().split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        name = re.search(r"^event: (.*)$", block, re.M)
        payload = re.search(r"^data: (.*)$", block, re.M)
        assert payload is not None, block
        events.append((name.group(1) if name else None, json.loads(payload.group(1))))
    return events


# -- the Claude Code shape -------------------------------------------------------------


def test_claude_code_billing_header_is_removed_and_the_prefix_survives_a_new_hash() -> None:
    body = json.loads(CLAUDE_CODE.read_text())
    first = _prompt(body)
    assert "x-anthropic-billing-header" not in first
    assert "You are Claude Code" in first
    body["system"][0]["text"] = body["system"][0]["text"].replace("cch=8f3c2a91d4", "cch=00aa11bb22")
    assert _prompt(body) == first  # the hash changes every request: the prompt does not
    kept = _prompt(body, keep_billing_header=True)
    assert "cch=00aa11bb22" in kept  # --keep-billing-header


def test_system_messages_inside_messages_fold_causally() -> None:
    """A turn appended to the conversation never changes an earlier turn's text: the
    first turn's prompt is a prefix of the second's (Claude Code's system messages
    inside ``messages`` included)."""
    body = json.loads(CLAUDE_CODE.read_text())
    first = _prompt(body)
    assert "The user opened the file" in first  # folded into the user turn, not dropped
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "text", "text": "It describes the project."}]},
        {"role": "system", "content": "<system-reminder>Todo list is empty.</system-reminder>"},
        {"role": "user", "content": "Summarise it in one line."},
    ]
    second = _prompt(body)
    assert second.startswith(first + "It describes the project.")
    assert "Todo list is empty." in second.removeprefix(first)


def test_fold_system_messages_rules() -> None:
    def m(role: Any, text: str) -> ChatMessage:
        return ChatMessage(role=role, content=text)

    folded = fold_system_messages(
        [m("system", "S0"), m("developer", "D0"), m("user", "U1"), m("system", "S1"), m("assistant", "A1"),
         m("system", "S2"), m("user", "U2"), m("user", "U3")]
    )  # fmt: skip
    assert [(x.role, x.text()) for x in folded] == [
        ("system", "S0"),
        ("system", "D0"),  # leading: kept, as system (templates know that role)
        ("user", "U1\n\nS1"),  # appended to the user message right before it
        ("assistant", "A1"),
        ("user", "S2\n\nU2\n\nU3"),  # starts a user message the next ones join
    ]


def test_tool_use_and_tool_result_blocks_become_calls_and_results() -> None:
    conversation = _messages(
        {
            "max_tokens": 10,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "text", "text": "Let me check."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "21C"}],
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
        }
    )
    roles = [(m.role, m.text()) for m in conversation.messages]
    assert roles == [
        ("user", "Weather?"),
        ("assistant", "Let me check."),
        ("tool", "21C"),
        ("user", "Thanks"),
    ]
    call = conversation.messages[1].tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1",
        "get_weather",
        {"city": "Paris"},
    )
    assert conversation.messages[2].tool_call_id == "toolu_1"
    assert conversation.tool_mode == "auto"


@pytest.mark.parametrize(
    ("choice", "mode", "tool_choice"),
    [
        ({"type": "auto"}, "auto", "auto"),
        ({"type": "any"}, "forced", "required"),
        ({"type": "tool", "name": "b"}, "forced", "b"),
        ({"type": "none"}, "none", "none"),
        ({"type": "any", "disable_parallel_tool_use": True}, "forced", "required"),
    ],
)
def test_tool_choice(choice: dict[str, Any], mode: str, tool_choice: str) -> None:
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in ("a", "b")]
    conversation = _messages(
        {
            "max_tokens": 5,
            "tools": tools,
            "tool_choice": choice,
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    assert (conversation.tool_mode, conversation.tool_choice) == (mode, tool_choice)
    generation, _ = generation_for(conversation, GEMMA)
    assert (generation.constraint is not None) == (mode == "forced")


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"container": "c1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
        (
            {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            "context_management.edits[0].type",
        ),
        ({"compaction": {"type": "auto"}}, "compaction"),
        (
            {"tools": [{"name": "a", "input_schema": {"type": "object"}, "defer_loading": True}]},
            "tools[0].defer_loading",
        ),
        (
            {
                "tools": [{"name": "a", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any"},
                "stop_sequences": ["}"],
            },
            "stop_sequences",
        ),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"speed": "fast"}, "speed"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),  # ≥ max_tokens
        ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "tools[0].type"),
        ({"tools": [{"name": "a"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "tool", "name": "x"}}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ]
            },
            "messages[0].content[0].source.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].source",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text"}}]}]},
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y "}]},
            "messages",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(extra: dict[str, Any], named: str) -> None:
    body = {"max_tokens": 1024, "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(InvalidRequestError) as caught:
        _messages(body)
    assert caught.value.param == named or named in caught.value.message, caught.value


def test_what_claude_code_sends_with_thinking_is_accepted() -> None:
    """Claude Code 2.x sends ``clear_thinking`` context edits whenever it thinks; earlier
    thinking never reaches the prompt here, so they are honoured; ``temperature: null``
    is the default."""
    conversation = _messages(
        {
            "max_tokens": 32000,
            "temperature": None,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    assert conversation.sampling.temperature == 1.0
    assert conversation.omit_thinking


def test_thinking_budget_and_cache_control_are_accepted() -> None:
    conversation = _messages(
        {
            "max_tokens": 4096,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "cache_control": {"type": "ephemeral"},
            "metadata": {"user_id": "u"},
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
                }
            ],
        }
    )
    assert conversation.messages[0].text() == "x"


def test_prefill_continues_the_last_assistant_message() -> None:
    body = {
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}],
    }
    assert _prompt(body).endswith("<start_of_turn>model\n1, 2,")


def test_count_tokens_request_renders_like_messages() -> None:
    body = json.loads(CLAUDE_CODE.read_text())
    counted = messages_conversation(
        decode_count_tokens_request(json.dumps({**body, "max_tokens": None}).encode())
    )
    assert generation_for(counted, GEMMA)[0].prompt == _prompt(body)


# -- Anthropic output ------------------------------------------------------------------


def _check_anthropic_stream(data: bytes) -> list[dict[str, Any]]:
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    events = _sse(data)
    payloads = []
    open_index = None
    for name, payload in events:
        assert name == payload["type"]
        if name not in ("ping", "error"):
            adapter.validate_python(payload)
        if name == "content_block_start":
            assert open_index is None, "one block open at a time"
            open_index = payload["index"]
        elif name == "content_block_delta":
            assert payload["index"] == open_index
        elif name == "content_block_stop":
            assert payload["index"] == open_index
            open_index = None
        elif name == "message_delta":
            assert open_index is None
        payloads.append(payload)
    assert payloads[0]["type"] == "message_start"
    return payloads


def test_anthropic_plain_stream_and_stop_sequence() -> None:
    dialect = AnthropicDialect("m", stops=["END"], max_tokens=50)
    data = dialect.opening(7) + dialect.plain_delta("Hello") + dialect.plain_delta(" world")
    data += dialect.finish("stop", stop_sequence="END") + dialect.end(
        Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
    )
    events = _check_anthropic_stream(data)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert delta["usage"]["input_tokens"] == 3
    assert delta["usage"]["cache_read_input_tokens"] == 4
    # the template's own stop (the turn's end) is not a stop_sequence: end_turn
    other = AnthropicDialect("m", stops=["END"])
    other.opening(1)
    other.finish("stop", stop_sequence="<end_of_turn>")
    assert (
        _sse(other.end(Usage(prompt_tokens=1, completion_tokens=1)))[0][1]["delta"]["stop_reason"]
        == "end_turn"
    )


def test_anthropic_auto_tool_call_and_forced_call_streams() -> None:
    call = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    auto = AnthropicDialect("m", tool_mode="auto", tool_names=["get_weather"])
    data = auto.opening(3) + b"".join(auto.delta(c, None) for c in call) + auto.finish("stop")
    events = _check_anthropic_stream(data + auto.end(Usage(prompt_tokens=3, completion_tokens=9)))
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    forced = AnthropicDialect("m", tool_mode="forced", tool_names=["get_weather"])
    data = forced.opening(3) + b"".join(forced.delta(c, None) for c in call) + forced.finish("stop")
    events = _check_anthropic_stream(data + forced.end(Usage(prompt_tokens=3, completion_tokens=9)))
    joined = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(joined) == {"city": "Paris"}
    # auto: text that is not a call is a text block, then the call would be another block
    text = AnthropicDialect("m", tool_mode="auto", tool_names=["get_weather"], max_tokens=50)
    data = text.opening(1) + text.delta("Sunny", None) + text.finish("length")
    events = _check_anthropic_stream(data + text.end(Usage(prompt_tokens=1, completion_tokens=2)))
    assert events[-2]["delta"]["stop_reason"] == "model_context_window_exceeded"  # length before max_tokens


def test_anthropic_cut_short_says_why() -> None:
    dialect = AnthropicDialect("m", max_tokens=100)
    data = dialect.opening(1) + dialect.plain_delta("a") + dialect.finish("deadline")
    events = _check_anthropic_stream(data + dialect.end(Usage(prompt_tokens=1, completion_tokens=1)))
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["trioserve"]["end_cause"] == "deadline"


def test_anthropic_body_and_errors() -> None:
    dialect = AnthropicDialect("m", max_tokens=10)
    result = ChoiceResult(text="", cause="stop", tool_calls=[("call_1", "f", '{"a":1}')])
    message = anthropic.types.Message.model_validate_json(
        dialect.body([result], Usage(prompt_tokens=5, completion_tokens=4))
    )
    assert message.stop_reason == "tool_use"
    assert message.content[0].type == "tool_use"
    assert message.content[0].input == {"a": 1}
    assert anthropic_error(OverloadedError("full", retry_after=1))[0] == 529
    status, body = anthropic_error(InvalidRequestError("bad", param="x"))
    assert (status, body) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}},
    )


# -- OpenAI Responses --------------------------------------------------------------------


def _responses(body: dict[str, Any]) -> Any:
    request = decode_responses_request(json.dumps(body).encode())
    return request, responses_conversation(request)


def test_responses_input_items_become_a_chat() -> None:
    _, conversation = _responses(
        {
            "instructions": "Be terse",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "21C"},
                {"role": "developer", "content": "Answer in French"},
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        }
    )
    assert [(m.role, m.text()) for m in conversation.messages] == [
        ("system", "Be terse"),
        ("user", "Weather?"),
        ("assistant", ""),
        ("tool", "21C"),
        ("user", "Answer in French"),  # a developer message mid-conversation: folded
    ]
    assert conversation.messages[2].tool_calls[0].id == "c1"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"top_logprobs": 3}, "top_logprobs"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
            "input[0].content[0]",
        ),
    ],
)
def test_responses_refuses_by_name(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        _responses({"input": "x", **extra})
    assert caught.value.param == named, caught.value


def test_responses_stream_events_validate_and_number_in_sequence() -> None:
    request, _ = _responses({"input": "x", "tools": [{"type": "function", "name": "w", "parameters": {}}]})
    dialect = ResponsesDialect("m", request, tool_mode="auto", tool_names=["w"])
    data = (
        dialect.opening(4)
        + dialect.delta("Hi", None)
        + dialect.delta(" there", None)
        + dialect.finish("stop")
    )
    data += dialect.end(Usage(prompt_tokens=4, completion_tokens=2))
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    events = _sse(data)
    for number, (name, payload) in enumerate(events):
        assert name == payload["type"]
        assert payload["sequence_number"] == number
        adapter.validate_python(payload)
    assert [p["type"] for _, p in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = Response.model_validate(events[-1][1]["response"])
    assert final.output_text == "Hi there"


def test_responses_plain_stream_and_incomplete() -> None:
    request, _ = _responses({"input": "x", "max_output_tokens": 2})
    dialect = ResponsesDialect("m", request)
    data = dialect.opening(4) + dialect.plain_delta("a") + dialect.plain_delta("b") + dialect.finish("length")
    data += dialect.end(Usage(prompt_tokens=4, completion_tokens=2))
    events = _sse(data)
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    final = Response.model_validate(events[-1][1]["response"])
    assert (events[-1][0], final.status, final.output_text) == ("response.incomplete", "incomplete", "ab")
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"


# -- reasoning ---------------------------------------------------------------------------

THINK = ("<think>", "</think>")
REASONING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}"
)


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("split", [1, 3, 1000])
def test_reasoning_is_read_out_of_the_text_however_it_is_split(inside: bool, split: int) -> None:
    from trioserve._wire._choices import ChoiceReader, TextPart, ThinkingPart

    text = ("" if inside else "\n<think>") + "Let me think.\nOK.</think>\n\nThe answer is 4."
    reader = ChoiceReader("none", reasoning=THINK, inside=inside)
    parts = [p for i in range(0, len(text), split) for p in reader.feed(text[i : i + split])]
    parts += reader.finish("stop")
    assert "".join(p.text for p in parts if isinstance(p, ThinkingPart)) == "Let me think.\nOK."
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == "The answer is 4."
    assert reader.reasoned


def test_no_reasoning_when_the_model_does_not_open_it() -> None:
    from trioserve._wire._choices import ChoiceReader, TextPart

    reader = ChoiceReader("none", reasoning=THINK)
    parts = reader.feed("<th") + reader.feed("ere") + reader.finish("stop")
    assert parts == (TextPart("<there"),)
    assert not reader.reasoned
    cut = ChoiceReader("none", reasoning=THINK)
    parts = cut.feed("<think>half a thought</") + cut.finish("length")  # cut short: all of it reasoning
    assert [type(p).__name__ for p in parts] == ["ThinkingPart"] * 2
    assert "".join(p.text for p in parts) == "half a thought</"


def test_a_template_with_think_markers_reasons_and_reads_enable_thinking() -> None:
    from trioserve._wire._chat import JinjaFormat

    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
        "{% else %}<think>{% endif %}"
    )
    chat = JinjaFormat(template, bos_token="", eos_token="<|end|>")
    assert chat.reasoning == THINK
    messages = [ChatMessage(role="user", content="2+2?")]
    assert chat.render(messages).opens_reasoning
    assert not chat.render(messages, thinking=False).opens_reasoning


def test_reasoning_in_each_dialect() -> None:
    from trioserve._wire._dialect import OpenAIDialect

    pieces = ["<think>", "Two and two", ".</think>", "\n\n", "Four."]
    usage = Usage(prompt_tokens=3, completion_tokens=5)
    # Anthropic: a thinking block (its signature_delta before it closes), then the text
    anthropic_dialect = AnthropicDialect("m", reasoning=THINK, max_tokens=50)
    data = anthropic_dialect.opening(3) + b"".join(anthropic_dialect.delta(p, None) for p in pieces)
    events = _check_anthropic_stream(data + anthropic_dialect.finish("stop") + anthropic_dialect.end(usage))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert [d["type"] for d in deltas] == [
        "thinking_delta",
        "thinking_delta",
        "signature_delta",
        "text_delta",
    ]
    # OpenAI chat: reasoning_content deltas
    chat = OpenAIDialect("chat", "m", reasoning=THINK)
    (writer,) = chat.writers
    chunks = [payload for _, payload in _sse(b"".join(writer.delta(p, None) for p in pieces))]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert (reasoning, content) == ("Two and two.", "Four.")
    # Responses: a reasoning item, then the message
    request, _ = _responses({"input": "x"})
    responses_dialect = ResponsesDialect("m", request, reasoning=THINK)
    data = responses_dialect.opening(3) + b"".join(responses_dialect.delta(p, None) for p in pieces)
    data += responses_dialect.finish("stop") + responses_dialect.end(usage)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    responses_events = [adapter.validate_python(payload) for _, payload in _sse(data)]
    final = responses_events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Two and two."
    assert final.output_text == "Four."


def test_a_constrained_answer_is_never_read_as_reasoning() -> None:
    """A template that opens ``<think>``: a forced call or a JSON Schema holds from the
    first token, so the prompt is rendered with ``enable_thinking: false`` and the text
    is the answer, not reasoning."""
    from trioserve._wire._chat import JinjaFormat

    chat = JinjaFormat(REASONING_TEMPLATE, bos_token="", eos_token="<|end|>")
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    for extra in (
        {"tools": tools, "tool_choice": {"type": "any"}},
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    ):
        body = {"max_tokens": 20, "messages": [{"role": "user", "content": "x"}], **extra}
        generation, rendered = generation_for(_messages(body), chat)
        assert generation.constraint is not None
        assert rendered.reasoning is None
        assert not rendered.opens_reasoning
        assert str(generation.prompt).endswith("<think></think>")
    plain = generation_for(
        _messages({"max_tokens": 20, "messages": [{"role": "user", "content": "x"}]}), chat
    )[1]
    assert plain.opens_reasoning


async def test_bytes_a_cancel_kept_from_the_socket_are_sent_by_whatever_ends_the_response() -> None:
    """A cancel that lands as a send starts (hypercorn checks for it before writing)
    leaves the bytes unsent while the dialect's state counts them: the exchange keeps
    them for the response's end (docs/dialects.md, "Cancellation")."""
    import trio

    from trioserve._http._exchange import Exchange

    sent: list[bytes] = []

    async def send(message: Any) -> None:
        await trio.lowlevel.checkpoint()  # where hypercorn's send lock checks for a cancel
        sent.append(message.get("body", b"head"))

    exchange = Exchange(send, "r1")
    await exchange.start(200, [])
    with trio.CancelScope() as scope:
        scope.cancel()
        await exchange.body(b"event: content_block_start\n\n")
    assert sent == [b"head"]
    assert exchange.take_unsent() == b"event: content_block_start\n\n"
    assert exchange.take_unsent() == b""
    with trio.CancelScope() as scope:
        scope.cancel()
        await exchange.body(b": ping\n\n", keep_unsent=False)  # a heartbeat's are not kept
    assert exchange.take_unsent() == b""


# -- issue #33: nothing one client sends stalls, hangs or reads another -----------------


def test_folding_is_linear_in_consecutive_user_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """20,000 consecutive user messages become one, built once: joining each message as
    it came copied the text so far every time (a message built per join)."""
    from trioserve._wire import _conversation

    built = 0

    class Counted(ChatMessage):
        def __post_init__(self) -> None:
            nonlocal built
            built += 1

    messages = [ChatMessage(role="user", content=f"u{i}") for i in range(20_000)]
    monkeypatch.setattr(_conversation, "ChatMessage", Counted)
    folded = fold_system_messages(
        [ChatMessage(role="system", content="S"), *messages, ChatMessage(role="assistant", content="A")]
    )
    assert [(m.role, m.text()) for m in folded] == [
        ("system", "S"),
        ("user", "\n\n".join(f"u{i}" for i in range(20_000))),
        ("assistant", "A"),
    ]
    assert built == 2  # the leading system message, and the one joined user turn


def test_a_lone_message_is_passed_on_as_it_came() -> None:
    user = ChatMessage(role="user", content=[msgspec.convert({"type": "text", "text": "hi"}, ContentPart)])
    (folded,) = fold_system_messages([user])
    assert folded is user


def _refused(decode: Any, body: dict[str, Any], says: str, param: str | None, **kwargs: Any) -> None:
    with pytest.raises(InvalidRequestError, match=says) as refused:
        decode(body, **kwargs)
    assert refused.value.param == param


def _anthropic(body: dict[str, Any], **kwargs: Any) -> Any:
    return messages_conversation(decode_messages_request(json.dumps(body).encode()), **kwargs)


def _responses_limited(body: dict[str, Any], **kwargs: Any) -> Any:
    return responses_conversation(decode_responses_request(json.dumps(body).encode()), **kwargs)


HI = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "description": "x" * 70_000}


@pytest.mark.parametrize(
    ("extra", "says", "param"),
    [
        (
            {"stop_sequences": ["x"] * 100_000},
            r"^stop_sequences holds 100000 entries; this server accepts at most 16 \(--max-stop-sequences\)$",
            "stop_sequences",
        ),
        (
            {"stop_sequences": ["é" * 600, "b" * 900]},
            r"^stop_sequences add up to 2100 bytes; .* at most 2048 \(--max-stop-bytes\)$",
            "stop_sequences",
        ),
        (
            {"tools": [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(129)]},
            r"tools holds 129 entries; .* at most 128 \(--max-tools\)",
            "tools",
        ),
        (
            {"tools": [{"name": "t", "input_schema": SCHEMA}]},
            r"at most 65536 \(--max-schema-bytes\)",
            "tools[0].input_schema",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
            r"at most 65536 \(--max-schema-bytes\)",
            "output_config.format.schema",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}] * 4097},
            r"messages holds 4097 entries; .* at most 4096 \(--max-messages\)",
            "messages",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 16385}]},
            r"16385 content blocks; .* at most 16384 \(--max-content-parts\)",
            "messages",
        ),
    ],
)
def test_anthropic_request_sizes_are_bounded(extra: dict[str, Any], says: str, param: str) -> None:
    _refused(_anthropic, {**HI, **extra}, says, param)
    # each is a limit of the server's: raised, the same request is served
    roomy = RequestLimits(
        max_stop_sequences=100_000,
        max_stop_bytes=100_000,
        max_tools=200,
        max_schema_bytes=100_000,
        max_messages=5000,
        max_content_parts=20_000,
    )
    _anthropic({**HI, **extra}, limits=roomy)


@pytest.mark.parametrize(
    ("extra", "says", "param"),
    [
        (
            {"tools": [{"type": "function", "name": f"t{i}"} for i in range(129)]},
            r"tools holds 129 entries",
            "tools",
        ),
        (
            {"tools": [{"type": "function", "name": "t", "parameters": SCHEMA}]},
            "--max-schema-bytes",
            "tools[0].parameters",
        ),
        (
            {"text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
            "--max-schema-bytes",
            "text.format.schema",
        ),
        ({"input": [{"role": "user", "content": "hi"}] * 4097}, r"input holds 4097 entries", "input"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, r"metadata holds 17 pairs; at most 16", "metadata"),
    ],
)
def test_responses_request_sizes_are_bounded(extra: dict[str, Any], says: str, param: str) -> None:
    _refused(_responses_limited, {"input": "hi", **extra}, says, param)


def test_function_calls_join_one_assistant_message_in_linear_time() -> None:
    calls = [
        {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(3000)
    ]
    _, conversation = _responses({"input": [{"role": "user", "content": "hi"}, *calls]})
    (_, assistant) = conversation.messages
    assert [call.id for call in assistant.tool_calls] == [f"c{i}" for i in range(3000)]


DEEP = b"[" * 50_000 + b"]" * 50_000


@pytest.mark.parametrize(
    "decode",
    [decode_messages_request, decode_count_tokens_request, decode_responses_request],
)
@pytest.mark.parametrize(
    "body",
    [
        b'{"max_tokens": 5, "messages": ' + DEEP + b"}",
        b'{"max_tokens": 5, "metadata": {"a": ' + DEEP + b"}}",  # a field typed Any
        b'{"max_tokens": 5, "tools": [{"name": "t", "input_schema": {"a": ' + DEEP + b"}}]}",
        b"[" * 50_000,  # never closed
    ],
)
def test_a_body_nested_50000_deep_is_refused_before_it_is_parsed(decode: Any, body: bytes) -> None:
    with pytest.raises(InvalidRequestError, match=r"nests arrays and objects 500\d\d deep; .* at most 128"):
        decode(body)


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    from trioserve._wire._limits import json_depth

    for value in (
        {"a": "[[[[[[[[", "b": [{"c": "]]]]]]]]]"}]},
        {"a": 'say \\"[[[[[\\" and "', "b": [[[1]]]},
        {"a": "\\\\", "b": [[['\\\\\\"[[[']]]},
        [[[[[[]]]]], {"k": [[[[[[[{}]]]]]]]}],
    ):
        text = json.dumps(value)
        assert json_depth(text.encode(), limit=0) == _depth(value), text


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def test_tool_call_arguments_nested_too_deep_are_refused() -> None:
    from trioserve._wire._openai import decode_chat_request

    arguments = "[" * 50_000 + "]" * 50_000
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ]
    }
    chat = decode_chat_request(json.dumps(body).encode())  # (a string: the body is shallow)
    with pytest.raises(InvalidRequestError, match="nests arrays and objects too deeply") as refused:
        GEMMA.render(chat.messages)
    assert refused.value.param == "messages"


def test_thinking_display_omitted_streams_thinking_blocks_without_their_text() -> None:
    pieces = ["<think>", "Two and two", ".</think>", "\n\n", "Four."]
    usage = Usage(prompt_tokens=3, completion_tokens=5)
    for omit in (False, True):
        dialect = AnthropicDialect("m", reasoning=THINK, max_tokens=50, omit_thinking=omit)
        data = dialect.opening(3) + b"".join(dialect.delta(p, None) for p in pieces)
        events = _check_anthropic_stream(data + dialect.finish("stop") + dialect.end(usage))
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["thinking", "text"]
        deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
        if omit:
            assert deltas == ["signature_delta", "text_delta"]
            assert b"Two and two" not in data
        else:
            assert deltas == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta"]
        # the non-streamed body agrees
        body = json.loads(
            AnthropicDialect("m", reasoning=THINK, omit_thinking=omit).body(
                [ChoiceResult(text="Four.", cause="stop", reasoning="Two and two.")], usage
            )
        )
        assert body["content"][0] == {
            "type": "thinking",
            "thinking": "" if omit else "Two and two.",
            "signature": "",
        }


def test_parallel_tool_calls_in_every_dialect() -> None:
    from trioserve._wire._dialect import OpenAIDialect

    text = (
        '<tool_call>\n{"name":"a","arguments":{"x":1}}\n</tool_call>\n'
        '<tool_call>\n{"name":"b","arguments":{"y":2}}\n</tool_call>'
    )
    usage = Usage(prompt_tokens=3, completion_tokens=9)
    expected = [("a", {"x": 1}), ("b", {"y": 2})]
    # Anthropic: two tool_use blocks, streamed and not
    anthropic_dialect = AnthropicDialect("m", tool_mode="auto", tool_names=["a", "b"])
    data = anthropic_dialect.opening(3) + b"".join(anthropic_dialect.delta(c, None) for c in text)
    events = _check_anthropic_stream(data + anthropic_dialect.finish("stop") + anthropic_dialect.end(usage))
    blocks: list[tuple[str, str]] = []
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append((event["content_block"]["name"], ""))
        elif event["type"] == "content_block_delta":
            name, so_far = blocks[-1]
            blocks[-1] = (name, so_far + event["delta"]["partial_json"])
    assert [(name, json.loads(arguments)) for name, arguments in blocks] == expected
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    from trioserve._wire._choices import finished_choice

    result = finished_choice(text, "stop", "auto", ["a", "b"])
    body = json.loads(AnthropicDialect("m", tool_mode="auto", tool_names=["a", "b"]).body([result], usage))
    assert [(b["name"], b["input"]) for b in body["content"]] == expected
    # Responses: two function_call items, streamed and not
    request, _ = _responses({"input": "x", "tools": [{"type": "function", "name": n} for n in "ab"]})
    responses_dialect = ResponsesDialect("m", request, tool_mode="auto", tool_names=["a", "b"])
    data = responses_dialect.opening(3) + b"".join(responses_dialect.delta(c, None) for c in text)
    data += responses_dialect.finish("stop") + responses_dialect.end(usage)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    final = [adapter.validate_python(payload) for _, payload in _sse(data)][-1].response
    assert [(item.name, json.loads(item.arguments)) for item in final.output] == expected
    assert len({item.call_id for item in final.output}) == 2
    other = ResponsesDialect("m", request, tool_mode="auto", tool_names=["a", "b"])
    not_streamed = Response.model_validate_json(other.body([result], usage))
    assert [(item.name, json.loads(item.arguments)) for item in not_streamed.output] == expected
    # OpenAI chat: two tool_calls, indexes 0 and 1
    chat = OpenAIDialect("chat", "m", tool_mode="auto", tool_names=["a", "b"])
    (writer,) = chat.writers
    chunks = [
        payload for _, payload in _sse(b"".join(writer.delta(c, None) for c in text) + writer.finish("stop"))
    ]
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "a", {"x": 1}),
        (1, "b", {"y": 2}),
    ]


# -- parallel calls turned off: one call (issue #33) -----------------------------------

PARALLEL_TEXT = (
    '<tool_call>\n{"name":"a","arguments":{"x":1}}\n</tool_call>\n'
    '<tool_call>\n{"name":"b","arguments":{"y":2}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        (None, True),
        ({"type": "auto"}, True),
        ({"type": "auto", "disable_parallel_tool_use": False}, True),
        ({"type": "auto", "disable_parallel_tool_use": True}, False),
        ({"type": "any", "disable_parallel_tool_use": True}, False),
    ],
)
def test_anthropic_disable_parallel_tool_use_reaches_the_conversation(
    choice: dict[str, Any] | None, parallel: bool
) -> None:
    body: dict[str, Any] = {
        "max_tokens": 5,
        "tools": [{"name": n, "input_schema": {"type": "object"}} for n in "ab"],
        "messages": [{"role": "user", "content": "x"}],
    }
    if choice is not None:
        body["tool_choice"] = choice
    assert _messages(body).parallel_calls is parallel


@pytest.mark.parametrize(
    ("field", "parallel"),
    [({}, True), ({"parallel_tool_calls": True}, True), ({"parallel_tool_calls": False}, False)],
)
def test_responses_parallel_tool_calls_reaches_the_conversation(
    field: dict[str, Any], parallel: bool
) -> None:
    _, conversation = _responses(
        {"input": "x", "tools": [{"type": "function", "name": n} for n in "ab"], **field}
    )
    assert conversation.parallel_calls is parallel


def test_with_parallel_calls_off_every_dialect_writes_one_call() -> None:
    from trioserve._wire._choices import finished_choice
    from trioserve._wire._dialect import OpenAIDialect

    usage = Usage(prompt_tokens=3, completion_tokens=9)
    one = [("a", {"x": 1})]
    result = finished_choice(PARALLEL_TEXT, "stop", "auto", ["a", "b"], parallel_calls=False)
    # Anthropic: one tool_use block, streamed and not; stop_reason tool_use
    anthropic_dialect = AnthropicDialect("m", tool_mode="auto", tool_names=["a", "b"], parallel_calls=False)
    data = anthropic_dialect.opening(3) + b"".join(anthropic_dialect.delta(c, None) for c in PARALLEL_TEXT)
    events = _check_anthropic_stream(data + anthropic_dialect.finish("stop") + anthropic_dialect.end(usage))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "a")]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"x": 1}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    other = AnthropicDialect("m", tool_mode="auto", tool_names=["a", "b"], parallel_calls=False)
    body = json.loads(other.body([result], usage))
    assert [(b["type"], b["name"], b["input"]) for b in body["content"]] == [("tool_use", "a", {"x": 1})]
    # Responses: one function_call item, streamed and not
    request, _ = _responses(
        {"input": "x", "tools": [{"type": "function", "name": n} for n in "ab"], "parallel_tool_calls": False}
    )
    responses_dialect = ResponsesDialect(
        "m", request, tool_mode="auto", tool_names=["a", "b"], parallel_calls=False
    )
    data = responses_dialect.opening(3) + b"".join(responses_dialect.delta(c, None) for c in PARALLEL_TEXT)
    data += responses_dialect.finish("stop") + responses_dialect.end(usage)
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    final = [adapter.validate_python(payload) for _, payload in _sse(data)][-1].response
    assert [(item.type, item.name, json.loads(item.arguments)) for item in final.output] == [
        ("function_call", "a", {"x": 1})
    ]
    assert final.parallel_tool_calls is False
    again = ResponsesDialect("m", request, tool_mode="auto", tool_names=["a", "b"], parallel_calls=False)
    not_streamed = Response.model_validate_json(again.body([result], usage))
    assert [(item.name, json.loads(item.arguments)) for item in not_streamed.output] == one
    # OpenAI chat: one tool call, index 0, no content
    chat = OpenAIDialect("chat", "m", tool_mode="auto", tool_names=["a", "b"], parallel_calls=False)
    (writer,) = chat.writers
    chunks = [
        payload
        for _, payload in _sse(b"".join(writer.delta(c, None) for c in PARALLEL_TEXT) + writer.finish("stop"))
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "a", {"x": 1})
    ]
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _calls_and_text(kind: str, stream: bool, data: bytes) -> tuple[list[str], str]:
    """The tool calls' names a response holds, in order, and its text."""
    if not stream:
        body = json.loads(data)
        if kind == "chat":
            message = body["choices"][0]["message"]
            return [c["function"]["name"] for c in message.get("tool_calls") or ()], message["content"] or ""
        if kind == "messages":
            blocks = body["content"]
            return [b["name"] for b in blocks if b["type"] == "tool_use"], "".join(
                b["text"] for b in blocks if b["type"] == "text"
            )
        items = body["output"]
        return [i["name"] for i in items if i["type"] == "function_call"], "".join(
            part["text"] for i in items if i["type"] == "message" for part in i["content"]
        )
    events = [payload for _, payload in _sse(data.replace(b"data: [DONE]\n\n", b""))]
    if kind == "chat":
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        calls = [c for d in deltas for c in d.get("tool_calls") or () if "name" in c.get("function", {})]
        return [c["function"]["name"] for c in calls], "".join(d.get("content") or "" for d in deltas)
    if kind == "messages":
        starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
        text = "".join(
            e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and "text" in e["delta"]
        )
        return [b["name"] for b in starts if b["type"] == "tool_use"], text
    return _calls_and_text(kind, False, json.dumps(events[-1]["response"]).encode())


def _request_body(kind: str, stream: bool, parallel: bool) -> dict[str, Any]:
    if kind == "chat":
        tools = [{"type": "function", "function": {"name": n}} for n in "ab"]
        return {
            "messages": [{"role": "user", "content": "x"}],
            "tools": tools,
            "stream": stream,
            "max_tokens": 200,
            "parallel_tool_calls": parallel,
        }
    if kind == "messages":
        return {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": n, "input_schema": {"type": "object"}} for n in "ab"],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": not parallel},
            "stream": stream,
            "max_tokens": 200,
        }
    return {
        "input": "x",
        "tools": [{"type": "function", "name": n} for n in "ab"],
        "parallel_tool_calls": parallel,
        "stream": stream,
        "max_output_tokens": 200,
    }


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "messages", "responses"])
async def test_parallel_calls_off_is_honoured_from_the_request_to_the_response(
    kind: str, stream: bool, parallel: bool
) -> None:
    """The flag travels from each dialect's request to its reply: a scripted model's two
    calls are two calls, or one (and nothing else) with parallel calls off."""
    import trio

    from trioserve import Engine, HTTPSettings, ScriptedBackend, ServerState
    from trioserve._http._generation import GenerationHandler

    script = [PARALLEL_TEXT[i : i + 6].encode() for i in range(0, len(PARALLEL_TEXT), 6)]
    state = ServerState(settings=HTTPSettings())
    state.set_engine(Engine(ScriptedBackend(script=script)))
    body = json.dumps(_request_body(kind, stream, parallel)).encode()
    sent: list[dict[str, Any]] = []
    received: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if not received:
            received.append(body)
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()  # the client stays (no http.disconnect)
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}[kind]
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "http_version": "1.1",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await GenerationHandler(state)(scope, receive, send, kind)  # type: ignore[arg-type]
    assert sent[0]["status"] == 200, sent
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    names, text = _calls_and_text(kind, stream, data)
    assert names == (["a", "b"] if parallel else ["a"])
    assert text == ""  # the dropped call is not content either
