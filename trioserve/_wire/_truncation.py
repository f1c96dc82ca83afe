"""Overflow as a policy (docs/dialects.md, "Truncation"), sans-IO: which turns of a
conversation ``truncation: "auto"`` may drop, and the conversation without them. The
HTTP layer measures the prompts and picks the cut (``_http/_overflow.py``).

A *turn* is a user message and everything after it up to the next user message (the
assistant's replies, its tool calls and their results). Turns are dropped whole and
oldest first, so what is kept still starts with a user message (templates that insist
on alternating roles accept it) and never holds a tool result without its call. Never
dropped: the system and developer messages (the system prompt, Responses
``instructions``), the tool definitions (they are not messages), and the last user
turn with everything after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .._core._types import GenerationRequest
from ._messages import ChatMessage

__all__ = ["Dropped", "Truncation", "TruncationMode", "turn_starts", "without_turns"]

#: ``auto``: drop whole oldest turns until the prompt fits; ``disabled``: a prompt that
#: does not fit is a 400 ``context_length_exceeded`` (OpenAI's default)
TruncationMode = Literal["auto", "disabled"]

_KEPT_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class Dropped:
    """What ``truncation: "auto"`` dropped from one request's conversation."""

    #: whole turns (a user message and what followed it)
    turns: int
    #: the chat messages in them (an assistant message with its tool calls is one)
    messages: int

    def extension(self) -> dict[str, int]:
        """As trioserve's field of a response says it (``trioserve.truncation``)."""
        return {"dropped_turns": self.turns, "dropped_messages": self.messages}


def turn_starts(messages: Sequence[ChatMessage]) -> list[int]:
    """Where a kept tail of ``messages`` may start, ascending: the index of each user
    message after the first message that is not a system one, up to the last user
    message — less those that would separate a tool result from its call. Dropping
    ``k`` turns keeps ``messages[starts[k - 1]:]`` (and the system messages before it).
    Linear in the messages."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        return []
    first = next(i for i, m in enumerate(messages) if m.role not in _KEPT_ROLES)
    # a tool result at j answering a call made at i: no cut in (i, j]
    called: dict[str, int] = {}
    blocked = [0] * (len(messages) + 1)  # (a difference array of the blocked ranges)
    for j, message in enumerate(messages):
        for call in message.tool_calls or ():
            if call.id is not None:
                called[call.id] = j
        if message.role == "tool" and message.tool_call_id in called:
            i = called[message.tool_call_id]
            blocked[i + 1] += 1
            blocked[j + 1] -= 1
    starts, running, position = [], 0, 0
    for index in users:
        while position <= index:
            running += blocked[position]
            position += 1
        if index > first and running == 0:
            starts.append(index)
    return starts


def without_turns(messages: Sequence[ChatMessage], start: int) -> list[ChatMessage]:
    """``messages`` from ``start`` on, after the system and developer messages before
    it (never dropped), in their order."""
    kept = [m for m in messages[:start] if m.role in _KEPT_ROLES]
    kept.extend(messages[start:])
    return kept


@dataclass(frozen=True, slots=True)
class Truncation:
    """What a conversation request (chat completions, Messages, Responses) hands the
    HTTP layer so that a prompt too long for the context can be fitted: its mode, its
    messages, and how to build its generation from fewer of them."""

    #: the request's ``truncation``, else the server's ``--truncation``
    mode: TruncationMode
    #: the conversation as rendered (the leading system messages first)
    messages: Sequence[ChatMessage]
    #: the generation request for ``messages`` (rendered by the model's template, as
    #: the request's was)
    build: Callable[[list[ChatMessage]], GenerationRequest]
    #: tells the dialect what was dropped (its response says so)
    note: Callable[[Dropped], None]
    #: the request field that holds the conversation (``messages``, ``input``)
    param: str = "messages"
    #: what the dialect calls ``max_tokens`` (Responses: ``max_output_tokens``)
    max_tokens_param: str = "max_tokens"

    def starts(self) -> list[int]:
        """:func:`turn_starts` of its messages."""
        return turn_starts(self.messages)

    def dropping(self, starts: Sequence[int], turns: int) -> tuple[GenerationRequest, Dropped]:
        """The generation with its ``turns`` oldest turns dropped (``starts``: its
        :meth:`starts`), and what that drops."""
        start = starts[turns - 1]
        kept = without_turns(self.messages, start)
        return self.build(kept), Dropped(turns=turns, messages=len(self.messages) - len(kept))

    def last_turn_text(self) -> str:
        """The text of the last user turn and what follows it (what is never dropped
        besides the system prompt and tools), for the error that says it is too long."""
        users = [i for i, m in enumerate(self.messages) if m.role == "user"]
        tail = self.messages[users[-1] :] if users else self.messages
        return "\n".join(m.text() for m in tail)
