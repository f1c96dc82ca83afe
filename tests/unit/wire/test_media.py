"""Images on the wire (``_wire/_media.py``, docs/vision.md): every dialect's image parts
become markers in place, the images in order; every refusal names its field."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from trioserve._core._exceptions import InvalidRequestError
from trioserve._core._media import AudioClip, RemoteImage, image_marker, marker_indices, split_at_markers
from trioserve._wire._anthropic import decode_messages_request, messages_conversation
from trioserve._wire._chat import GemmaFormat
from trioserve._wire._conversation import generation_for
from trioserve._wire._inbound import CHAT, MESSAGES, RESPONSES
from trioserve._wire._limits import RequestLimits
from trioserve._wire._media import Marker, MediaCollector, join_parts
from trioserve._wire._responses import StoredContext, decode_responses_request, responses_conversation
from trioserve._wire._spec import ReadOptions

PNG = b"\x89PNG\r\n\x1a\n fake but fine for the wire"
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def refused(call: Any, *args: Any, **kwargs: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        call(*args, **kwargs)
    assert caught.value.to_dict()["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    return caught.value


# ------------------------------------------------------------------ the collector


def test_a_data_url_is_decoded_and_a_url_is_left_to_fetch() -> None:
    media = MediaCollector(RequestLimits())
    first = media.add(URL, param="p0")
    second = media.add("https://images.example/cat.png", param="p1", detail="high")
    third = media.add("file:///srv/images/dog.png", param="p2", detail="auto")
    assert (first, second, third) == (image_marker(0), image_marker(1), image_marker(2))
    assert media.images == (
        PNG,
        RemoteImage("https://images.example/cat.png", "p1"),
        RemoteImage("file:///srv/images/dog.png", "p2"),
    )


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("data:text/plain;base64,aGVsbG8=", "invalid_image"),
        ("data:image/png,rawbytes", "invalid_image"),
        ("data:image/png;base64", "invalid_image"),
        ("data:image/png;base64,not base64!!", "invalid_image"),
        ("data:image/png;base64,", "invalid_image"),
        ("data:image/;base64,aGVsbG8=", "invalid_image"),
        ("data:;base64,aGVsbG8=", "invalid_image"),
        ("data:image/png;base64,aGVsbG8", "invalid_image"),  # (padding missing: strict)
        ("data:image/png;base64,aGVs\nbG8=", "invalid_image"),
        ("ftp://example.com/a.png", "invalid_image_url"),
        ("https:///no-host.png", "invalid_image_url"),
        ("http://[::1/a.png", "invalid_image_url"),
        ("http://example.com:99999/a.png", "invalid_image_url"),
        ("https://exa mple.com/a.png", "invalid_image_url"),
        ("https://example.com/a\x00.png", "invalid_image_url"),
        ("just some text", "invalid_image_url"),
        ("", "invalid_image_url"),
    ],
)
def test_a_bad_image_reference_is_refused_by_code(url: str, code: str) -> None:
    error = refused(MediaCollector(RequestLimits()).add, url, param="messages[0].content[1].image_url.url")
    assert error.code == code
    assert error.param == "messages[0].content[1].image_url.url"


def test_scheme_and_media_type_case_do_not_matter() -> None:
    media = MediaCollector(RequestLimits())
    media.add("DATA:Image/PNG;BASE64," + URL.partition(",")[2], param="p")
    media.add("HTTPS://x.example/a.png", param="q")
    assert media.images == (PNG, RemoteImage("HTTPS://x.example/a.png", "q"))


def test_the_limits_name_their_flags() -> None:
    media = MediaCollector(RequestLimits(max_images=2, max_image_bytes=16))
    media.add("https://a.example/1.png", param="p")
    error = refused(media.add, URL, param="p")  # PNG is longer than 16 bytes
    assert error.code == "image_too_large"
    assert "--max-image-bytes" in error.message
    media.add("https://a.example/2.png", param="p")
    error = refused(media.add, "https://a.example/3.png", param="p3")
    assert (error.code, error.param) == ("too_many_images", "p3")
    assert "--max-images" in error.message
    assert "2" in error.message
    # a huge data URL is refused by its length, before it is decoded (it is not even base64)
    huge = "data:image/png;base64," + "!" * 4000
    error = refused(MediaCollector(RequestLimits(max_image_bytes=100)).add, huge, param="p")
    assert error.code == "image_too_large"
    assert "100 bytes" in error.message
    # exactly the limit is accepted
    exact = MediaCollector(RequestLimits(max_image_bytes=len(PNG)))
    exact.add(URL, param="p")
    assert exact.images == (PNG,)


def test_detail_low_is_refused_and_says_why() -> None:
    error = refused(MediaCollector(RequestLimits()).add, URL, param="u", detail="low", detail_param="d")
    assert (error.code, error.param) == ("unsupported_detail", "d")
    assert "fixed resolution" in error.message
    error = refused(MediaCollector(RequestLimits()).add, URL, param="u", detail="tiny")
    assert error.param == "u"
    assert "'tiny'" in error.message
    media = MediaCollector(RequestLimits())
    for detail in (None, "auto", "high"):
        media.add(URL, param="u", detail=detail)
    assert media.images == (PNG, PNG, PNG)


def test_markers_are_joined_without_separators_and_found_again() -> None:
    parts = ["Look:", Marker(image_marker(0)), "and", "this", Marker(image_marker(1))]
    text = join_parts(parts, "\n")
    assert text == f"Look:{image_marker(0)}and\nthis{image_marker(1)}"
    assert marker_indices(text) == [0, 1]
    assert split_at_markers(text) == ["Look:", 0, "and\nthis", 1, ""]
    # a client cannot write a marker: the nonce is this process's secret
    assert marker_indices("<__image_0_0__> <__media__>") == []


# -------------------------------------------------------------------- dialects


def _chat(messages: list[dict[str, Any]]) -> Any:
    body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
    assert CHAT.read is not None
    return CHAT.read(body, GemmaFormat(), ReadOptions(limits=RequestLimits(), model_name=lambda name: "m"))


def test_openai_image_parts_become_markers_in_place() -> None:
    parsed = _chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in"},
                    {"type": "image_url", "image_url": {"url": URL}},
                    {"type": "text", "text": "and in"},
                    {"type": "image_url", "image_url": {"url": "https://x.example/b.png", "detail": "auto"}},
                ],
            }
        ]
    )
    generation = parsed.generations[0]
    assert f"What is in{image_marker(0)}and in{image_marker(1)}<end_of_turn>" in generation.prompt
    assert generation.images == (
        PNG,
        RemoteImage("https://x.example/b.png", "messages[0].content[3].image_url.url"),
    )


def test_openai_images_only_in_user_messages() -> None:
    error = refused(
        _chat,
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": URL}}]},
        ],
    )
    assert error.param == "messages[1].content[0]"
    assert "user messages" in error.message


def _anthropic(content: Any, **extra: Any) -> Any:
    body = json.dumps({"max_tokens": 4, "messages": [{"role": "user", "content": content}], **extra})
    return messages_conversation(decode_messages_request(body.encode()))


def test_anthropic_image_blocks_base64_and_url() -> None:
    data = base64.b64encode(PNG).decode()
    conversation = _anthropic(
        [
            {"type": "text", "text": "Compare"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": "with"},
            {"type": "text", "text": "this"},
            {"type": "image", "source": {"type": "url", "url": "https://x.example/c.png"}},
        ]
    )
    assert conversation.messages[0].content == f"Compare{image_marker(0)}with\nthis{image_marker(1)}"
    assert conversation.images == (
        PNG,
        RemoteImage("https://x.example/c.png", "messages[0].content[4].source.url"),
    )
    generation, _ = generation_for(conversation, GemmaFormat())
    assert generation.images == conversation.images
    # the media type is checked, as OpenAI's data URL's is
    bad = {"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": data}}
    assert refused(_anthropic, [bad]).code == "invalid_image"
    # not in the system prompt, nor in a tool result
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    assert refused(_anthropic, "hi", system=[image]).param == "system[0]"
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [image]}
    assert refused(_anthropic, [result]).param == "messages[0].content[0].content[0]"


def test_responses_input_image() -> None:
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is"},
                    {"type": "input_image", "image_url": URL, "detail": "high"},
                ],
            }
        ]
    }
    conversation = responses_conversation(decode_responses_request(json.dumps(body).encode()))
    assert conversation.messages[0].content == f"What is{image_marker(0)}"
    assert conversation.images == (PNG,)
    low = json.loads(json.dumps(body))
    low["input"][0]["content"][1]["detail"] = "low"
    error = refused(responses_conversation, decode_responses_request(json.dumps(low).encode()))
    assert (error.code, error.param) == ("unsupported_detail", "input[0].content[1].detail")


# ------------------------------------------------------------ OpenAI chat, more


def _image_part(url: str = URL, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_openai_images_keep_their_order_across_messages_and_system_text() -> None:
    parsed = _chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [_image_part("https://x.example/1.png")]},
            {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": [{"type": "text", "text": "And"}, _image_part(), _image_part()]},
        ]
    )
    generation = parsed.generations[0]
    assert marker_indices(generation.prompt) == [0, 1, 2]
    assert f"<start_of_turn>user\nBe brief.\n\n{image_marker(0)}<end_of_turn>" in generation.prompt
    assert f"And{image_marker(1)}{image_marker(2)}<end_of_turn>" in generation.prompt
    assert generation.images == (
        RemoteImage("https://x.example/1.png", "messages[1].content[0].image_url.url"),
        PNG,
        PNG,
    )


def test_a_text_only_chat_has_no_images() -> None:
    parsed = _chat(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert parsed.generations[0].images == ()
    assert "ab<end_of_turn>" in parsed.generations[0].prompt


@pytest.mark.parametrize(
    ("messages", "param", "code", "says"),
    [
        # an image part without its image_url object, or without its url
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "messages[0].content[0].image_url",
            None,
            "url",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].image_url",
            None,
            "url",
        ),
        (
            [{"role": "user", "content": [_image_part("not a url")]}],
            "messages[0].content[0].image_url.url",
            "invalid_image_url",
            "data: URL",
        ),
        (
            [{"role": "user", "content": [_image_part(detail="low")]}],
            "messages[0].content[0].image_url.detail",
            "unsupported_detail",
            "fixed resolution",
        ),
        (
            [{"role": "system", "content": [_image_part()]}, {"role": "user", "content": "hi"}],
            "messages[0].content[0]",
            None,
            "images go in user messages",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "c", "content": [_image_part()]},
            ],
            "messages[1].content[0]",
            None,
            "images go in user messages",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x", "image_url": {"url": URL}}]}],
            "messages[0].content[0].image_url",
            None,
            "part of its own",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "input_audio"}]}],
            "messages[0].content[1].input_audio",
            None,
            "needs an input_audio object",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "messages[0].content[0].text",
            None,
            "needs text",
        ),
    ],
)
def test_openai_image_refusals(
    messages: list[dict[str, Any]], param: str, code: str | None, says: str
) -> None:
    error = refused(_chat, messages)
    assert (error.param, error.code) == (param, code)
    assert says in error.message


def test_openai_too_many_images_counts_the_whole_request() -> None:
    body = json.dumps(
        {
            "messages": [
                {"role": "user", "content": [_image_part(), _image_part()]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [_image_part()]},
            ]
        }
    ).encode()
    options = ReadOptions(limits=RequestLimits(max_images=2), model_name=lambda name: "m")
    assert CHAT.read is not None
    error = refused(CHAT.read, body, GemmaFormat(), options)
    assert (error.code, error.param) == ("too_many_images", "messages[2].content[0].image_url.url")


# --------------------------------------------------------------- audio (docs/audio.md)

WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40)


def _audio_part(data: bytes | str = WAV, audio_format: str | None = "wav") -> dict[str, Any]:
    encoded = base64.b64encode(data).decode() if isinstance(data, bytes) else data
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": audio_format}}


def test_openai_audio_parts_become_markers_in_place() -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hear:"}, _audio_part()]}]}
    ).encode()
    options = ReadOptions(limits=RequestLimits(), model_name=lambda name: "m")
    assert CHAT.read is not None
    generation = CHAT.read(body, GemmaFormat(), options).generation
    (clip,) = generation.images
    assert isinstance(clip, AudioClip)
    assert (clip.data, clip.format) == (WAV, "wav")
    assert f"Hear:{image_marker(0)}" in str(generation.prompt)


@pytest.mark.parametrize(
    ("part", "limits", "param", "code", "says"),
    [
        (_audio_part(audio_format="ogg"), RequestLimits(), "input_audio.format", "invalid_audio", "one of"),
        (_audio_part(audio_format=None), RequestLimits(), "input_audio.format", "invalid_audio", "one of"),
        (_audio_part("not base64!"), RequestLimits(), "input_audio.data", "invalid_audio", "base64"),
        (_audio_part(b"ID3" + bytes(20)), RequestLimits(), "input_audio.data", "invalid_audio", "not a wav"),
        (_audio_part(PNG), RequestLimits(), "input_audio.data", "invalid_audio", "not a wav"),
        (
            _audio_part(),
            RequestLimits(max_audio_bytes=10),
            "input_audio.data",
            "audio_too_large",
            "--max-audio-bytes",
        ),
    ],
)
def test_openai_audio_refusals(
    part: dict[str, Any], limits: RequestLimits, param: str, code: str, says: str
) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": [part]}]}).encode()
    options = ReadOptions(limits=limits, model_name=lambda name: "m")
    assert CHAT.read is not None
    error = refused(CHAT.read, body, GemmaFormat(), options)
    assert (error.code, error.param) == (code, f"messages[0].content[0].{param}")
    assert says in error.message


def test_openai_audio_parts_are_counted_apart_from_images() -> None:
    parts = [_image_part(), _audio_part(), _audio_part(), _image_part(), _audio_part()]
    body = json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()
    options = ReadOptions(limits=RequestLimits(max_images=2, max_audio_parts=2), model_name=lambda name: "m")
    assert CHAT.read is not None
    error = refused(CHAT.read, body, GemmaFormat(), options)
    assert (error.code, error.param) == ("too_many_audio_parts", "messages[0].content[4].input_audio")
    assert "--max-audio-parts" in error.message


# --------------------------------------------------------------- Anthropic, more


def _b64_block(data: str | None = None, media_type: str | None = "image/png") -> dict[str, Any]:
    source: dict[str, Any] = {
        "type": "base64",
        "data": base64.b64encode(PNG).decode() if data is None else data,
    }
    if media_type is not None:
        source["media_type"] = media_type
    return {"type": "image", "source": source}


def test_anthropic_images_around_tool_results_keep_their_places() -> None:
    body = {
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": [_b64_block(), {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "a cat"},
                    {"type": "image", "source": {"type": "url", "url": "https://x.example/2.png"}},
                ],
            },
        ],
        "tools": [{"name": "look", "input_schema": {"type": "object"}}],
    }
    conversation = messages_conversation(decode_messages_request(json.dumps(body).encode()))
    contents = [(m.role, m.content) for m in conversation.messages]
    assert contents[0] == ("user", f"{image_marker(0)}What is it?")
    assert contents[2] == ("tool", "a cat")
    assert contents[3] == ("user", image_marker(1))
    assert conversation.images == (
        PNG,
        RemoteImage("https://x.example/2.png", "messages[2].content[1].source.url"),
    )


@pytest.mark.parametrize(
    ("content", "system", "param", "code", "says"),
    [
        (
            [_b64_block(media_type="text/plain")],
            None,
            "messages[0].content[0].source.media_type",
            "invalid_image",
            "image type",
        ),
        (
            [_b64_block(media_type=None)],
            None,
            "messages[0].content[0].source.media_type",
            "invalid_image",
            "image type",
        ),
        (
            [_b64_block(data="not base64!")],
            None,
            "messages[0].content[0].source.data",
            "invalid_image",
            "base64",
        ),
        ([_b64_block(data="")], None, "messages[0].content[0].source.data", "invalid_image", "source.data"),
        (
            [{"type": "image", "source": {"type": "url", "url": "gopher://x.example/a.png"}}],
            None,
            "messages[0].content[0].source.url",
            "invalid_image_url",
            "http(s)",
        ),
        (
            [{"type": "image", "source": {"type": "file", "file_id": "file_1"}}],
            None,
            "messages[0].content[0].source.type",
            None,
            "'file' source",
        ),
        (
            [{"type": "image", "source": {"type": "text", "data": "x"}}],
            None,
            "messages[0].content[0].source.type",
            None,
            "'text' source",
        ),
        ([{"type": "image"}], None, "messages[0].content[0].source", None, "needs a source"),
        ("hi", [_b64_block()], "system[0]", None, "images go in user messages"),
        (
            [{"type": "tool_result", "tool_use_id": "t1", "content": [_b64_block()]}],
            None,
            "messages[0].content[0].content[0]",
            None,
            "beside the tool_result",
        ),
    ],
)
def test_anthropic_image_refusals(content: Any, system: Any, param: str, code: str | None, says: str) -> None:
    extra = {"system": system} if system is not None else {}
    error = refused(_anthropic, content, **extra)
    assert (error.param, error.code) == (param, code)
    assert says in error.message


def test_anthropic_images_in_an_assistant_message_are_refused() -> None:
    body = {
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [_b64_block()]},
            {"role": "user", "content": "well?"},
        ],
    }
    error = refused(messages_conversation, decode_messages_request(json.dumps(body).encode()))
    assert error.param == "messages[1].content[0]"
    assert "images go in user messages" in error.message


def test_anthropic_image_limits() -> None:
    body = json.dumps(
        {"max_tokens": 4, "messages": [{"role": "user", "content": [_b64_block(), _b64_block()]}]}
    )
    request = decode_messages_request(body.encode())
    error = refused(messages_conversation, request, limits=RequestLimits(max_images=1))
    assert (error.code, error.param) == ("too_many_images", "messages[0].content[1].source")
    error = refused(messages_conversation, request, limits=RequestLimits(max_image_bytes=4))
    assert (error.code, error.param) == ("image_too_large", "messages[0].content[0].source.data")


def test_count_tokens_carries_the_images() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Count"}, _b64_block()]}]}
    assert MESSAGES.count is not None
    _, conversation = MESSAGES.count(
        json.dumps(body).encode(), ReadOptions(limits=RequestLimits(), model_name=lambda name: "m")
    )
    assert conversation.images == (PNG,)
    generation, _ = generation_for(conversation, GemmaFormat())
    assert f"Count{image_marker(0)}<end_of_turn>" in generation.prompt
    assert generation.images == (PNG,)


# --------------------------------------------------------------- Responses, more


def test_responses_images_in_order_across_items_and_the_stored_conversation() -> None:
    earlier = {"role": "user", "content": [{"type": "input_image", "image_url": "https://x.example/0.png"}]}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A dog."}]}
    body = {
        "previous_response_id": "resp_1",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": URL, "detail": "auto"},
                    {"type": "input_text", "text": "and"},
                    {"type": "input_image", "image_url": "https://x.example/2.png"},
                ],
            }
        ],
    }
    conversation = responses_conversation(
        decode_responses_request(json.dumps(body).encode()),
        stored=StoredContext(history=(earlier, answer), previous_id="resp_1"),
    )
    assert [m.content for m in conversation.messages] == [
        image_marker(0),
        "A dog.",
        f"{image_marker(1)}and{image_marker(2)}",
    ]
    assert conversation.images == (
        RemoteImage("https://x.example/0.png", "the stored conversation's item 0.content[0].image_url"),
        PNG,
        RemoteImage("https://x.example/2.png", "input[0].content[2].image_url"),
    )


def test_input_tokens_carries_the_images() -> None:
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": URL}]}]}
    assert RESPONSES.count is not None
    _, conversation = RESPONSES.count(
        json.dumps(body).encode(), ReadOptions(limits=RequestLimits(), model_name=lambda name: "m")
    )
    assert conversation.images == (PNG,)


@pytest.mark.parametrize(
    ("part", "role", "param", "code", "says"),
    [
        (
            {"type": "input_image", "file_id": "file_1"},
            "user",
            "input[0].content[0].file_id",
            None,
            "file_id",
        ),
        (
            {"type": "input_image"},
            "user",
            "input[0].content[0].image_url",
            "invalid_image_url",
            "needs a URL",
        ),
        (
            {"type": "input_image", "image_url": "data:image/png;base64,%%%"},
            "user",
            "input[0].content[0].image_url",
            "invalid_image",
            "base64",
        ),
        (
            {"type": "input_image", "image_url": URL, "detail": "medium"},
            "user",
            "input[0].content[0].detail",
            None,
            "'medium'",
        ),
        ({"type": "input_image", "image_url": URL}, "system", "input[0].content[0]", None, "user messages"),
        (
            {"type": "input_image", "image_url": URL},
            "assistant",
            "input[0].content[0]",
            None,
            "user messages",
        ),
    ],
)
def test_responses_image_refusals(
    part: dict[str, Any], role: str, param: str, code: str | None, says: str
) -> None:
    body = {"input": [{"role": role, "content": [part]}, {"role": "user", "content": "hi"}]}
    error = refused(responses_conversation, decode_responses_request(json.dumps(body).encode()))
    assert (error.param, error.code) == (param, code)
    assert says in error.message


def test_responses_images_in_a_function_call_output_are_refused() -> None:
    body = {
        "input": [
            {"role": "user", "content": "look"},
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_image", "image_url": URL}],
            },
        ]
    }
    error = refused(responses_conversation, decode_responses_request(json.dumps(body).encode()))
    assert error.param == "input[2].output[0]"
