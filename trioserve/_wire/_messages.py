"""The chat message every dialect's conversation becomes (OpenAI's shape): what the chat
templates render, whichever API the request came in by."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Literal, Protocol

import msgspec

from .._core._exceptions import InvalidRequestError

__all__ = ["CallFunction", "ChatMessage", "ContentPart", "MessageToolCall", "TextLike", "flatten_text"]


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


def _refuse_part(index: int, type_: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"content parts of type {type_!r} are not supported; send text", param="messages"
    )


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


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
