"""What the Anthropic and Responses dialects share on the way in: a conversation's
mid-stream ``system`` messages folded so its rendered prefix stays stable, and one
prompt for a request (docs/dialects.md)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from .._core._exceptions import InvalidRequestError
from .._core._media import Media
from .._core._types import Constraint, GenerationRequest, ReasoningMarkers, SamplingParams
from ._chat import ChatFormat, ChatPrompt
from ._choices import ToolMode
from ._messages import ChatMessage
from ._tools import Tool, call_constraint

__all__ = [
    "Conversation",
    "armed",
    "armed_generation",
    "fold_system_messages",
    "generation_for",
    "new_id",
    "take_prefill",
]


def new_id(prefix: str) -> str:
    """An id for a message, block, item or call: ``prefix`` and 24 hex digits."""
    return prefix + uuid.uuid4().hex[:24]


class _UserTurn:
    """Consecutive user texts, joined once when the turn ends (joining each as it comes
    would copy the text so far every time: quadratic in the turn's messages)."""

    __slots__ = ("first", "texts")

    def __init__(self, first: ChatMessage) -> None:
        self.first = first
        self.texts = [first.text()]

    def add(self, text: str) -> None:
        # (a blank line between texts; a turn with no text yet starts with this one)
        if self.texts == [""]:
            self.texts[0] = text
        else:
            self.texts.append(text)

    def message(self, joined: bool) -> ChatMessage:
        if not joined:
            return self.first  # (as it came: one message, nothing folded into it)
        return ChatMessage(role="user", content="\n\n".join(self.texts), name=self.first.name)


def take_prefill(messages: list[ChatMessage], refusal: str) -> str:
    """The text of a last assistant message, taken off ``messages``: the reply continues
    it (``""``: the last message is not the assistant's). One that calls tools is refused
    with ``refusal`` (its results must come first)."""
    if not messages or messages[-1].role != "assistant":
        return ""
    last = messages.pop()
    if last.tool_calls:
        raise InvalidRequestError(refusal, param="messages")
    return last.text()


def fold_system_messages(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The messages with every ``system``/``developer`` message after the first other
    one folded into user text, causally (what a message becomes depends only on the
    messages before it, so appending turns never changes an earlier turn's text):
    appended to the user message right before it, or starting a user message that the
    next user message joins. Consecutive user messages join with a blank line (as
    Anthropic combines consecutive turns). Leading system messages stay as they are.
    Linear in the messages and their text."""
    out: list[ChatMessage] = []
    turn: _UserTurn | None = None
    joined = False
    leading = True
    for message in messages:
        system = message.role in ("system", "developer")
        if system and leading:
            # (as system: chat templates know that role; some render nothing for developer)
            out.append(ChatMessage(role="system", content=message.text()))
            continue
        if system or message.role == "user":
            leading = False
            if turn is not None:
                turn.add(message.text())
                joined = True
            else:
                turn = _UserTurn(ChatMessage(role="user", content=message.text()) if system else message)
                joined = False
            continue
        leading = False
        if turn is not None:
            out.append(turn.message(joined))
            turn = None
        out.append(message)
    if turn is not None:
        out.append(turn.message(joined))
    return out


@dataclass(frozen=True, slots=True)
class Conversation:
    """A request of either dialect, read: what to render and how to generate."""

    messages: list[ChatMessage]
    tools: list[Tool]
    #: ``none``, ``auto``, ``required``, or the name of the one tool to call
    tool_choice: str
    max_tokens: int | None
    sampling: SamplingParams
    stops: tuple[str, ...]
    #: ``False``: at most one call per reply (Responses ``parallel_tool_calls: false``,
    #: Anthropic ``tool_choice.disable_parallel_tool_use: true``)
    parallel_calls: bool = True
    #: a JSON Schema the text must follow (Anthropic's ``output_config.format``, the
    #: Responses ``text.format``)
    constraint: Constraint | None = None
    #: Anthropic's prefill: the answer continues this text
    prefill: str = ""
    #: ``max_tokens`` is an upper bound, clamped to the room the context has left
    clamp_max_tokens: bool = False
    #: ``False``: asked not to reason (a reasoning template's ``enable_thinking``);
    #: ``None``: the template's default
    thinking: bool | None = None
    #: a bound on the reasoning's tokens that was asked for
    thinking_budget: int | None = None
    #: Anthropic's ``thinking.display: omitted``: thinking blocks without their text
    omit_thinking: bool = False
    #: the images its messages' markers name (docs/vision.md)
    images: tuple[Media, ...] = ()

    @property
    def tool_mode(self) -> ToolMode:
        if not self.tools or self.tool_choice == "none":
            return "none"
        return "auto" if self.tool_choice == "auto" else "forced"

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(tool.function.name for tool in self.tools)


def generation_for(
    conversation: Conversation, chat_format: ChatFormat
) -> tuple[GenerationRequest, ChatPrompt]:
    """The generation a conversation asks for, and its rendered prompt: its messages
    rendered by the model's chat format, exactly as ``/v1/chat/completions`` renders
    them."""
    if conversation.thinking_budget is not None and chat_format.reasoning is not None:
        raise InvalidRequestError(
            "thinking.budget_tokens cannot be honoured: this server does not bound the length of "
            "this model's reasoning; send thinking {type: adaptive} (or disabled)",
            param="thinking.budget_tokens",
        )
    mode = conversation.tool_mode
    tools = conversation.tools if mode != "none" else None
    constrained = mode == "forced" or conversation.constraint is not None
    thinking = conversation.thinking
    if constrained and chat_format.reasoning is not None:
        thinking = False  # the constraint holds from the first token: no room to think
    rendered = chat_format.render(conversation.messages, tools=tools, thinking=thinking)
    if constrained and rendered.reasoning is not None:
        # the answer is the constrained text, never reasoning (even where the template
        # still opened <think>: the grammar writes the answer in it)
        rendered = dataclasses.replace(rendered, reasoning=None, opens_reasoning=False)
    constraint = conversation.constraint
    if mode == "forced":
        choice = conversation.tool_choice
        chosen = (
            conversation.tools
            if choice == "required"
            else [tool for tool in conversation.tools if tool.function.name == choice]
        )
        constraint = call_constraint(chosen)
    generation = GenerationRequest(
        prompt=rendered.text + conversation.prefill,
        max_tokens=conversation.max_tokens,
        sampling=conversation.sampling,
        stop=conversation.stops + rendered.stops,
        add_bos=not rendered.has_bos,
        constraint=constraint,
        clamp_max_tokens=conversation.clamp_max_tokens,
        images=conversation.images,
    )
    return generation, rendered


def armed(
    generation: GenerationRequest, reasoning: tuple[str, str] | None, inside: bool, control: bool | None
) -> GenerationRequest:
    """``generation`` with what ending its reasoning on request needs: the model's
    markers where it reasons (``reasoning``; ``inside``: the prompt opened it), and
    whether the request allows it (llama-server's ``reasoning_control``: only ``false``
    refuses; docs/dialects.md, "Ending the reasoning")."""
    markers = None
    if reasoning is not None:
        markers = ReasoningMarkers(start=reasoning[0], end=reasoning[1], opened=inside)
    if markers is None and control is not False:
        return generation
    return dataclasses.replace(generation, reasoning=markers, reasoning_control=control is not False)


def armed_generation(
    conversation: Conversation, chat_format: ChatFormat, control: bool | None
) -> tuple[GenerationRequest, ChatPrompt]:
    """The generation a conversation asks for (:func:`generation_for`), :func:`armed`
    with its rendered prompt's reasoning markers, and that prompt: what a conversation
    dialect generates, and builds again from fewer messages when it truncates."""
    generation, rendered = generation_for(conversation, chat_format)
    return armed(generation, rendered.reasoning, rendered.opens_reasoning, control), rendered
