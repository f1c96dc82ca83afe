"""OpenAI wire format: request validation and byte-exact response chunks."""

from __future__ import annotations

import json

import pytest

from trioserve import InvalidRequestError, Usage
from trioserve._wire._openai import (
    ChunkEncoder,
    decode_chat_request,
    decode_completion_prompts,
    decode_completion_request,
    non_stream_response,
)


def test_minimal_completion_request_defaults() -> None:
    _, generation = decode_completion_request(b'{"prompt": "hi"}')
    assert generation.prompt == "hi"
    assert generation.max_tokens == 16
    assert generation.sampling.temperature == 1.0
    assert generation.stop == ()


def test_fields_people_use_are_honoured_and_unknown_ignored() -> None:
    body = {
        "model": "m",
        "prompt": ["one"],
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "\n",
        "seed": 7,
        "logit_bias": {"42": -100, "7": 3.5},
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
        "frequency_penalty": 0,
        "user": "x",
    }
    request, generation = decode_completion_request(json.dumps(body).encode())
    assert request.stream
    assert request.stream_options is not None
    assert request.stream_options.include_usage
    assert generation.prompt == "one"
    assert generation.max_tokens == 5
    assert generation.stop == ("\n",)
    assert generation.sampling.top_p == 0.5
    assert generation.sampling.seed == 7
    assert dict(generation.sampling.logit_bias) == {42: -100, 7: 3.5}


def test_token_id_prompt() -> None:
    _, generation = decode_completion_request(b'{"prompt": [2, 818, 5279]}')
    assert generation.prompt == [2, 818, 5279]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b"{}", None, "missing required field `prompt`"),
        (b'{"prompt": 5}', "prompt", "Expected `str | array`"),
        (b'{"prompt": ""}', "prompt", "must not be empty"),
        (b'{"prompt": ["a", 5]}', "prompt", "not a mix"),
        (b'{"prompt": ["a", ""]}', "prompt", "prompt 1 of the batch"),
        (b'{"prompt": [[1, 2], []]}', "prompt", "must not be empty"),
        (b'{"prompt": "x", "n": 17}', "n", "<= 16"),
        (b'{"prompt": "x", "echo": true}', "echo", "echo is not supported"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens", ">= 1"),
        (b'{"prompt": "x", "max_tokens": "ten"}', "max_tokens", "Expected `int | null`, got `str`"),
        (b'{"prompt": "x", "temperature": -1}', "temperature", ">= 0.0"),
        (b'{"prompt": "x", "temperature": 1e9}', "temperature", "<= 2.0"),
        (b'{"prompt": "x", "top_p": 0}', "top_p", "> 0.0"),
        (b'{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias", "token ids"),
        (b'{"prompt": "x", "logit_bias": {"5": 1000}}', "logit_bias[...]", "<= 100.0"),
        (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop", "at most 4"),
    ],
)
def test_bad_completion_requests_name_the_problem(body: bytes, param: str | None, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_completion_request(body)
    assert fragment in info.value.message
    assert info.value.param == param
    assert info.value.to_dict()["error"]["type"] == "invalid_request_error"  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b'{"messages": []}', "at least one message"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "Invalid enum value 'wizard'"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            "needs an image_url object with a url",
        ),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}',
            "needs an input_audio object with data and format",
        ),
        (
            b'{"messages": [{"role": "system", "content": '
            b'[{"type": "image_url", "image_url": {"url": "x"}}]}]}',
            "images go in user messages",
        ),
        (b'{"messages": "hello"}', "Expected `array`, got `str`"),
    ],
)
def test_bad_chat_requests(body: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode_chat_request(body)
    assert fragment in info.value.message


def test_chat_content_parts_are_joined() -> None:
    request = decode_chat_request(
        b'{"messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}'
    )
    assert request.messages[0].text() == "ab"


def test_text_chunk_bytes_are_exact() -> None:
    encoder = ChunkEncoder("text", "m")
    prefix = (
        f'data: {{"id":"{encoder.id}","object":"text_completion","created":{encoder.created},"model":"m",'
        '"choices":[{"index":0,"text":'
    ).encode()
    assert encoder.delta('he said "hi"\n') == (
        prefix + b'"he said \\"hi\\"\\n","logprobs":null,"finish_reason":null}]}\n\n'
    )


def test_chat_chunks_role_delta_final_and_usage() -> None:
    encoder = ChunkEncoder("chat", "m", include_usage=True)
    chunks = [json.loads(c.removeprefix(b"data: ")) for c in encoder.role().split(b"\n\n") if c]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    delta = json.loads(encoder.delta("你好 🎉").removeprefix(b"data: "))
    assert delta["choices"][0]["delta"] == {"content": "你好 🎉"}
    assert delta["usage"] is None
    assert delta["object"] == "chat.completion.chunk"
    final = encoder.final("length", Usage(prompt_tokens=3, completion_tokens=4))
    events = [e for e in final.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    finish = json.loads(events[0].removeprefix(b"data: "))
    assert finish["choices"][0]["finish_reason"] == "length"
    usage = json.loads(events[1].removeprefix(b"data: "))
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_final_chunk_of_a_deadline_says_why() -> None:
    encoder = ChunkEncoder("text", "m")
    final = encoder.final("deadline", Usage(prompt_tokens=1, completion_tokens=2))
    finish = json.loads(final.split(b"\n\n")[0].removeprefix(b"data: "))
    # OpenAI's value (strict clients refuse others); the cause in trioserve's own field
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["trioserve"]["end_cause"] == "deadline"
    assert final.endswith(b"data: [DONE]\n\n")


def test_non_stream_bodies() -> None:
    usage = Usage(prompt_tokens=1, completion_tokens=2)
    text = json.loads(non_stream_response("text", model="m", text="ab", cause="stop", usage=usage))
    assert text["choices"][0]["text"] == "ab"
    assert text["usage"]["total_tokens"] == 3
    chat = json.loads(non_stream_response("chat", model="m", text="ab", cause="length", usage=usage))
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert chat["object"] == "chat.completion"


def test_a_batch_of_prompts_is_one_generation_each() -> None:
    _, generations = decode_completion_prompts(b'{"prompt": ["a", "b"], "max_tokens": 3, "stop": "x"}')
    assert [g.prompt for g in generations] == ["a", "b"]
    assert all(g.max_tokens == 3 and g.stop == ("x",) for g in generations)
    _, generations = decode_completion_prompts(b'{"prompt": [[2, 3], [4]]}')
    assert [list(g.prompt) for g in generations] == [[2, 3], [4]]
    _, generations = decode_completion_prompts(b'{"prompt": [2, 3]}')  # token ids: one prompt
    assert [list(g.prompt) for g in generations] == [[2, 3]]
    with pytest.raises(InvalidRequestError, match="at most 64 prompts"):
        decode_completion_prompts(json.dumps({"prompt": ["a"] * 65}).encode())
    with pytest.raises(InvalidRequestError, match="takes no batch"):
        decode_completion_request(b'{"prompt": ["a", "b"]}')
