"""The chat message every dialect's conversation becomes (OpenAI's shape): what the chat
templates render, whichever API the request came in by."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Literal, Protocol

import msgspec

from .._core._exceptions import InvalidRequestError
from ._media import MediaCollector

__all__ = [
    "CallFunction",
    "ChatMessage",
    "ContentPart",
    "ImageUrl",
    "MessageToolCall",
    "TextLike",
    "flatten_text",
    "take_images",
]


class TextLike(Protocol):
    """A content part of any dialect: its type, and its text if it has one."""

    type: str
    text: str | None


def flatten_text[P: TextLike](
    content: str | Sequence[P] | None,
    *,
    text_types: Collection[str],
    joiner: str,
    refuse: Callable[[int, str], InvalidRequestError],
) -> str:
    """The one content-part flattener of every dialect: a message's content as the one
    text this model reads (a string as it is; parts of ``text_types`` joined by
    ``joiner``); any other part raises ``refuse(its index, its type)``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for i, part in enumerate(content):
        if part.type not in text_types or part.text is None:
            raise refuse(i, part.type)
        parts.append(part.text)
    return joiner.join(parts)


def _unsupported(type_: str) -> str:
    return (
        f"content parts of type {type_!r} are not supported; send text (images as image_url, "
        "audio as input_audio)"
    )


def _refuse_part(index: int, type_: str) -> InvalidRequestError:
    return InvalidRequestError(_unsupported(type_), param="messages")


class ImageUrl(msgspec.Struct, kw_only=True):
    """OpenAI's ``image_url`` object: a data URL or an http(s) URL, and ``detail``."""

    url: str
    detail: str | None = None


class InputAudio(msgspec.Struct, kw_only=True):
    """OpenAI's ``input_audio`` object: a base64 clip and its format (docs/audio.md)."""

    data: str | None = None
    format: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    #: an ``input_audio`` part's clip (replaced by its marker as an image is)
    input_audio: InputAudio | None = None
    #: an ``image_url`` part's image (docs/vision.md: replaced by a text part holding its
    #: marker once the request's images are collected: :func:`take_images`)
    image_url: ImageUrl | None = None


def take_images(messages: Sequence[ChatMessage], media: MediaCollector, param: str = "messages") -> None:
    """Each ``image_url`` part of ``messages`` read into ``media`` and replaced, in
    place, by a text part holding its marker (images go in user messages only); a part
    of any other type than ``text`` a 400 naming it."""
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"{param}[{i}].content[{j}]"
            if part.type == "text":
                if part.text is None:
                    raise InvalidRequestError(f"{where} (text) needs text", param=f"{where}.text")
                if part.image_url is not None:
                    raise InvalidRequestError(
                        f"{where} is a text part with an image_url; send the image as a part of its own "
                        "(type image_url)",
                        param=f"{where}.image_url",
                    )
                continue
            if part.type == "input_audio":
                _refuse_outside_user(message.role, where, "audio", "audio goes")
                if part.input_audio is None:
                    raise InvalidRequestError(
                        f"{where} (input_audio) needs an input_audio object with data and format",
                        param=f"{where}.input_audio",
                    )
                given = part.input_audio
                marker = media.add_audio(given.data, given.format, param=f"{where}.input_audio")
                content[j] = ContentPart(type="text", text=marker)
                continue
            if part.type != "image_url":
                raise InvalidRequestError(_unsupported(part.type), param=where)
            _refuse_outside_user(message.role, where, "an image", "images go")
            if part.image_url is None:
                raise InvalidRequestError(
                    f"{where} (image_url) needs an image_url object with a url", param=f"{where}.image_url"
                )
            marker = media.add(
                part.image_url.url,
                param=f"{where}.image_url.url",
                detail=part.image_url.detail,
                detail_param=f"{where}.image_url.detail",
            )
            content[j] = ContentPart(type="text", text=marker)


def _refuse_outside_user(role: str, where: str, what: str, rule: str) -> None:
    """A 400 naming the part at ``where`` if its message is not a user's: images and
    audio go in user messages only (``what``: the part, ``rule``: the sentence's subject
    and verb, as in "images go")."""
    if role != "user":
        raise InvalidRequestError(
            f"{where} is {what} in a {role} message; {rule} in user messages", param=where
        )


class CallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: CallFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: an assistant's calls, earlier in the conversation
    tool_calls: list[MessageToolCall] | None = None
    #: a ``tool`` message: the call it answers
    tool_call_id: str | None = None

    def text(self) -> str:
        return flatten_text(self.content, text_types=("text",), joiner="", refuse=_refuse_part)
