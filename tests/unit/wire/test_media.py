"""Images on the wire (``_wire/_media.py``, docs/vision.md): every dialect's image parts
become markers in place, the images in order; every refusal names its field."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from trioserve._core._exceptions import InvalidRequestError
from trioserve._core._media import RemoteImage, image_marker, marker_indices, split_at_markers
from trioserve._wire._anthropic import decode_messages_request, messages_conversation
from trioserve._wire._chat import GemmaFormat
from trioserve._wire._conversation import generation_for
from trioserve._wire._inbound import CHAT, ReadOptions
from trioserve._wire._limits import RequestLimits
from trioserve._wire._media import Marker, MediaCollector, join_parts
from trioserve._wire._responses import decode_responses_request, responses_conversation

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
        ("ftp://example.com/a.png", "invalid_image_url"),
        ("https:///no-host.png", "invalid_image_url"),
        ("just some text", "invalid_image_url"),
    ],
)
def test_a_bad_image_reference_is_refused_by_code(url: str, code: str) -> None:
    error = refused(MediaCollector(RequestLimits()).add, url, param="messages[0].content[1].image_url.url")
    assert error.code == code
    assert error.param == "messages[0].content[1].image_url.url"


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
    # a huge data URL is refused by its length, before it is decoded
    huge = "data:image/png;base64," + "A" * 4000
    assert (
        refused(MediaCollector(RequestLimits(max_image_bytes=100)).add, huge, param="p").code
        == "image_too_large"
    )


def test_detail_low_is_refused_and_says_why() -> None:
    error = refused(MediaCollector(RequestLimits()).add, URL, param="u", detail="low", detail_param="d")
    assert (error.code, error.param) == ("unsupported_detail", "d")
    assert "fixed resolution" in error.message
    assert refused(MediaCollector(RequestLimits()).add, URL, param="u", detail="tiny").param == "u"


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
