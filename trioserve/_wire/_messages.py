"""The chat message every dialect's conversation becomes (OpenAI's shape): what the chat
templates render, whichever API the request came in by."""

from __future__ import annotations

from typing import Literal

import msgspec

from .._core._exceptions import InvalidRequestError

__all__ = ["CallFunction", "ChatMessage", "ContentPart", "MessageToolCall"]


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
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported; send text",
                    param="messages",
                )
            parts.append(part.text)
        return "".join(parts)
