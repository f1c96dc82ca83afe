"""Tool calls and choices, sans-IO: the forced call's constraint, reading calls back
out of text (whole and streamed), and one choice's chunks."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve._core._exceptions import InvalidRequestError
from trioserve._core._types import TokenLogprob
from trioserve._wire._choices import ChoiceReader, ChoiceStream, finished_choice
from trioserve._wire._openai import ChunkEncoder, decode_chat_request
from trioserve._wire._tools import StreamedCallParser, Tool, call_constraint, parse_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '{"name":"get_weather","arguments":{"city":"Paris, \\"FR\\""}}'


def _tools(*specs: dict[str, object]) -> list[Tool]:
    return [msgspec.convert(spec, Tool) for spec in specs]


def test_the_forced_call_schema_accepts_only_calls_of_the_tools() -> None:
    other = {"type": "function", "function": {"name": "get_time"}}
    schema = json.loads(call_constraint(_tools(WEATHER, other)).source)
    jsonschema.validate(json.loads(CALL), schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    for bad in (
        {"name": "get_weather", "arguments": {}},  # a required argument missing
        {"name": "launch", "arguments": {}},  # no such tool
        {"name": "get_time", "arguments": {}, "extra": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_parse_calls_reads_a_call_and_nothing_else() -> None:
    (call,) = parse_calls(CALL, ["get_weather"]) or []
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": 'Paris, "FR"'}
    assert parse_calls(f"<tool_call>\n{CALL}\n</tool_call>", ["get_weather"]) is not None
    for text in (
        "It is sunny.",
        CALL + " and more",
        '{"name":"launch","arguments":{}}',
        '{"name":"get_weather","arguments":"city"}',
        '{"name":"get_weather"}',
        "{not json",
    ):
        assert parse_calls(text, ["get_weather"]) is None, text


@given(st.lists(st.integers(min_value=1, max_value=len(CALL) - 1), max_size=12))
def test_a_streamed_call_joins_to_the_whole_call(cuts: list[int]) -> None:
    """However the text is split, the name comes once and the fragments join to the
    arguments."""
    bounds = [0, *sorted(set(cuts)), len(CALL)]
    parser = StreamedCallParser()
    names, fragments = [], []
    for start, end in itertools.pairwise(bounds):
        name, fragment = parser.feed(CALL[start:end])
        if name is not None:
            names.append(name)
        fragments.append(fragment)
    fragments.append(parser.finish())
    assert names == ["get_weather"]
    assert "".join(fragments) == '{"city":"Paris, \\"FR\\""}'


def _chunks(data: bytes) -> list[dict[str, object]]:
    return [json.loads(m) for m in re.findall(rb"data: (\{.*?\})\n\n", data)]


def test_a_forced_call_streams_as_openai_streams_it() -> None:
    stream = ChoiceStream(ChunkEncoder("chat", "m"), ChoiceReader("forced", ["get_weather"]))
    data = b"".join(stream.delta(CALL[i : i + 5], None) for i in range(0, len(CALL), 5))
    data += stream.finish("stop")
    deltas = [c["choices"][0]["delta"] for c in _chunks(data)]  # type: ignore[index]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Paris, \\"FR\\""}'
    assert _chunks(data)[-1]["choices"][0]["finish_reason"] == "tool_calls"  # type: ignore[index]


@pytest.mark.parametrize(
    ("text", "reason"), [(CALL, "tool_calls"), ('{"a": 1} is JSON', "stop"), ("Sunny.", "stop")]
)
def test_auto_holds_what_may_be_a_call_and_sends_content_otherwise(text: str, reason: str) -> None:
    entry = TokenLogprob(token=1, piece=b"x", logprob=-0.5)
    stream = ChoiceStream(ChunkEncoder("chat", "m"), ChoiceReader("auto", ["get_weather"]))
    data = b"".join(stream.delta(ch, (entry,)) for ch in text) + stream.finish("stop")
    chunks = _chunks(data)
    assert chunks[-1]["choices"][0]["finish_reason"] == reason  # type: ignore[index]
    content = "".join(
        c["choices"][0]["delta"].get("content") or ""  # type: ignore[index,union-attr]
        for c in chunks
    )
    if reason == "tool_calls":
        assert content == ""
    else:
        assert content == text
        # the held text keeps the logprobs of its tokens
        logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]  # type: ignore[index,union-attr]
        assert sum(len(lp["content"]) for lp in logprobs) == len(text)  # type: ignore[index]


def test_finished_choices() -> None:
    forced = finished_choice(CALL, "stop", "forced", ["get_weather"])
    assert forced.tool_calls is not None
    assert forced.tool_calls[0][1:] == ("get_weather", '{"city":"Paris, \\"FR\\""}')
    assert finished_choice(CALL, "stop", "auto", ["get_weather"]).tool_calls is not None
    assert finished_choice(CALL, "length", "auto", ["get_weather"]).tool_calls is None
    assert finished_choice("hi", "stop", "auto", ["get_weather"]).text == "hi"


def _chat(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "x"}], **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "only 'function'"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "other", "function": {"name": "get_weather"}}},
            "tool_choice.type",
            "only 'function'",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot also follow response_format",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ],
)
def test_bad_tool_requests(fields: dict[str, object], param: str, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says) as refused:
        decode_chat_request(_chat(**fields))
    assert refused.value.param == param


# -- parallel calls (issue #33) ---------------------------------------------------------

TIME = '{"name":"get_time","arguments":{"zone":"CET"}}'
NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "text",
    [
        f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        f"<tool_call>{CALL}</tool_call><tool_call>{TIME}</tool_call>\n",
        f"{CALL}\n{TIME}",  # one per line: how earlier turns' calls are rendered (_chat.call_text)
        f"  {CALL} {TIME}  ",
    ],
)
def test_parallel_calls_are_read_as_separate_calls_in_order(text: str) -> None:
    calls = parse_calls(text, NAMES)
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris, "FR"'}),
        ("get_time", {"zone": "CET"}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        f"<tool_call>{CALL}</tool_call> and then <tool_call>{TIME}</tool_call>",  # text between
        f"<tool_call>{CALL}</tool_call><tool_call>{TIME}",  # a block left open
        f"<tool_call>{CALL}</tool_call>{{not json",
        f"{CALL}\n" + '{"name":"launch","arguments":{}}',  # one of them names no tool
        f"{CALL}</tool_call>",
        "",
        "<tool_call></tool_call>",
    ],
)
def test_parallel_calls_are_all_calls_or_the_text_is_content(text: str) -> None:
    assert parse_calls(text, NAMES) is None


def test_a_call_nested_deeper_than_python_recurses_is_content_not_an_error() -> None:
    deep = '{"name":"get_weather","arguments":{"a":' + "[" * 100_000 + "]" * 100_000 + "}}"
    assert parse_calls(deep, NAMES) is None
    assert finished_choice(deep, "stop", "auto", NAMES).text == deep


def test_parallel_calls_stream_and_finish_as_separate_openai_calls() -> None:
    text = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    stream = ChoiceStream(ChunkEncoder("chat", "m"), ChoiceReader("auto", NAMES))
    data = b"".join(stream.delta(ch, None) for ch in text) + stream.finish("stop")
    chunks = _chunks(data)
    calls = [
        call
        for c in chunks
        for call in c["choices"][0]["delta"].get("tool_calls") or ()  # type: ignore[index,union-attr]
    ]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert len({c["id"] for c in calls}) == 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"  # type: ignore[index]
    finished = finished_choice(text, "stop", "auto", NAMES)
    assert finished.tool_calls is not None
    assert [(name, json.loads(arguments)) for _, name, arguments in finished.tool_calls] == [
        ("get_weather", {"city": 'Paris, "FR"'}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({call_id for call_id, _, _ in finished.tool_calls}) == 2


# -- parallel calls turned off: one call (issue #33) -----------------------------------

TWO_CALLS = [
    f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
    f"{CALL}\n{TIME}",
    f"{CALL}\n{CALL}",  # the same call twice: still one
]


@pytest.mark.parametrize("text", TWO_CALLS)
def test_with_parallel_calls_off_only_the_first_call_is_read(text: str) -> None:
    calls = parse_calls(text, NAMES, parallel_calls=False)
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": 'Paris, "FR"'})]
    # the same rule otherwise: a text that is not only calls is content
    assert parse_calls(f"{CALL}\nand then the time", NAMES, parallel_calls=False) is None


@pytest.mark.parametrize("text", TWO_CALLS)
def test_with_parallel_calls_off_a_choice_holds_exactly_one_call(text: str) -> None:
    stream = ChoiceStream(ChunkEncoder("chat", "m"), ChoiceReader("auto", NAMES, parallel_calls=False))
    data = b"".join(stream.delta(ch, None) for ch in text) + stream.finish("stop")
    chunks = _chunks(data)
    deltas = [c["choices"][0]["delta"] for c in chunks]  # type: ignore[index]
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]  # type: ignore[attr-defined]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris, "FR"'}
    assert not any(d.get("content") for d in deltas)  # type: ignore[attr-defined]  # the second: dropped
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"  # type: ignore[index]
    finished = finished_choice(text, "stop", "auto", NAMES, parallel_calls=False)
    assert finished.tool_calls is not None
    assert [(name, json.loads(arguments)) for _, name, arguments in finished.tool_calls] == [
        ("get_weather", {"city": 'Paris, "FR"'})
    ]
    assert not finished.text
    # turned on (the default), the same text is every call
    assert len(finished_choice(text, "stop", "auto", NAMES).tool_calls or ()) == 2


def test_with_parallel_calls_off_a_reasoning_choice_holds_one_call() -> None:
    text = f"<think>the weather, then the time</think>\n{TWO_CALLS[0]}"
    finished = finished_choice(
        text, "stop", "auto", NAMES, reasoning=("<think>", "</think>"), parallel_calls=False
    )
    assert [name for _, name, _ in finished.tool_calls or ()] == ["get_weather"]
    assert finished.reasoning == "the weather, then the time"


# -- limits on tools (issue #33) --------------------------------------------------------


def test_tools_count_and_schema_size_are_bounded() -> None:
    from trioserve._wire._limits import RequestLimits

    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    with pytest.raises(
        InvalidRequestError, match=r"tools holds 129 entries; .* at most 128 \(--max-tools\)"
    ) as e:
        decode_chat_request(_chat(tools=many))
    assert e.value.param == "tools"
    decode_chat_request(_chat(tools=many), RequestLimits(max_tools=129))  # raised: accepted
    big = {"type": "object", "description": "x" * 70_000}
    tool = {"type": "function", "function": {"name": "big", "parameters": big}}
    with pytest.raises(
        InvalidRequestError, match=r"bytes of JSON Schema; .* at most 65536 \(--max-schema-bytes\)"
    ) as e:
        decode_chat_request(_chat(tools=[tool]))
    assert e.value.param == "tools[0].function.parameters"
    decode_chat_request(_chat(tools=[tool]), RequestLimits(max_schema_bytes=80_000))
