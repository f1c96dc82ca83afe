"""Anthropic's Messages API's request bodies, sans-IO: ``POST /v1/messages`` and
``/v1/messages/count_tokens`` decoded, and checked — the fields refused by name, the
thinking budget, the sizes. The conversation they ask for: :mod:`._anthropic`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from ._codec import decode as _decode
from ._limits import RequestLimits
from ._openai import Priority
from ._refusals import Refusal, check_refused

__all__ = [
    "AnthropicTool",
    "Block",
    "ContextEdit",
    "ContextManagement",
    "CountTokensRequest",
    "ImageSource",
    "Message",
    "MessagesRequest",
    "OutputConfig",
    "OutputFormat",
    "Thinking",
    "ToolChoice",
    "decode_count_tokens_request",
    "decode_messages_request",
]


class ImageSource(msgspec.Struct, kw_only=True):
    """An ``image`` block's ``source``: ``base64`` (``media_type``, ``data``) or ``url``."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None


class Block(msgspec.Struct, kw_only=True):
    """One content block (``text``, ``tool_use``, ``tool_result``, ``thinking``, …):
    every type's fields, so that a type trioserve cannot read is refused by name."""

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    # image
    source: ImageSource | None = None
    # accepted everywhere: the prompt cache is automatic
    cache_control: Any = None
    citations: Any = None


class Message(msgspec.Struct, kw_only=True):
    #: ``system``/``developer``: Claude Code (≥ 2.1.154) sends them inside ``messages``
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Block]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    #: ``custom`` (or absent); Anthropic's server tools have other types
    type: str | None = None
    cache_control: Any = None
    strict: bool | None = None
    # known, not honoured: refused when set
    defer_loading: bool | None = None
    input_examples: Any = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    #: ``omitted``: thinking blocks carry no text (the thinking still happens)
    display: Literal["summarized", "omitted"] | None = None


class ContextEdit(msgspec.Struct, kw_only=True):
    type: str


class ContextManagement(msgspec.Struct, kw_only=True):
    edits: list[ContextEdit] = msgspec.field(default_factory=list)


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = msgspec.field(name="schema")


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None
    effort: Any = None


class _MessagesFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    #: the older name of ``output_config.format`` (structured-outputs beta)
    output_format: OutputFormat | None = None
    # accepted: the cache is automatic
    cache_control: Any = None
    # known, not honoured: refused when set (_REFUSED)
    container: Any = None
    mcp_servers: Any = None
    #: Claude Code sends ``clear_thinking_*`` edits with thinking: honoured (earlier
    #: thinking never reaches the prompt); other edits are refused
    context_management: ContextManagement | None = None
    diagnostics: Any = None
    compaction: Any = None
    fallbacks: Any = None
    thread: Any = None
    inference_geo: Any = None
    speed: Any = None


class CountTokensRequest(_MessagesFields, kw_only=True):
    pass


class MessagesRequest(_MessagesFields, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: ``{"user_id": …}``: accepted, not used (an identifier)
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    #: trioserve's (vLLM's meaning): the request's priority, lower first
    priority: Priority | None = None
    #: llama-server's: ``false``: this request's reasoning cannot be ended on request
    #: (``POST /v1/chat/completions/control``); absent or ``true``: it can
    reasoning_control: bool | None = None
    #: trioserve's (the Responses API's field): ``auto`` drops whole oldest turns until
    #: the prompt fits the context; absent: the server's ``--truncation``
    truncation: Literal["auto", "disabled"] | None = None
    # identifiers: accepted, not used
    user_profile_id: str | None = None
    workspace_id: str | None = None


_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)

#: (field, why it is refused); any value but ``null`` is a 400 naming the field
_REFUSED: tuple[Refusal, ...] = (
    ("container", (None,), "this server runs no code-execution containers"),
    ("mcp_servers", (None,), "this server connects to no MCP servers; run the tools on the client"),
    ("diagnostics", (None,), "this server reports no prompt-cache diagnostics (usage shows what was reused)"),
    ("inference_geo", (None,), "this server runs where it runs"),
    ("compaction", (None,), "this server does not compact conversations; send the messages to use"),
    ("fallbacks", (None,), "there is no other model to fall back to here"),
    ("thread", (None,), "this server keeps no threads; send the whole conversation"),
)


def _check_sizes(request: _MessagesFields, limits: RequestLimits) -> None:
    """Refuse more messages, blocks or stop sequences than ``limits`` allow."""
    limits.check_count("messages", len(request.messages), limits.max_messages, "--max-messages", "messages")
    blocks = sum(len(m.content) for m in request.messages if isinstance(m.content, list))
    if isinstance(request.system, list):
        blocks += len(request.system)
    if blocks > limits.max_content_parts:
        raise InvalidRequestError(
            f"messages and system hold {blocks} content blocks; this server accepts at most "
            f"{limits.max_content_parts} (--max-content-parts)",
            param="messages",
        )
    if isinstance(request, MessagesRequest) and request.stop_sequences:
        limits.check_stops(request.stop_sequences, "stop_sequences")
    limits.check_count("tools", len(request.tools or ()), limits.max_tools, "--max-tools", "tools")


def _check_common(request: _MessagesFields, max_tokens: int | None) -> None:
    check_refused(request, _REFUSED)
    if request.context_management is not None:
        for i, edit in enumerate(request.context_management.edits):
            if not edit.type.startswith("clear_thinking_"):
                raise InvalidRequestError(
                    f"context_management.edits[{i}] ({edit.type!r}) is not supported: this server does not "
                    "edit the context (clear_thinking edits are: earlier thinking never reaches the prompt)",
                    param=f"context_management.edits[{i}].type",
                )
    if request.speed not in (None, "standard"):
        raise InvalidRequestError(
            "speed is not supported: only the standard speed exists here", param="speed"
        )
    config = request.output_config
    if config is not None and config.effort is not None:
        raise InvalidRequestError(
            "output_config.effort is not supported: the model has no effort control",
            param="output_config.effort",
        )
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled":
        budget = thinking.budget_tokens
        if budget is None:
            raise InvalidRequestError("thinking.enabled needs budget_tokens", param="thinking.budget_tokens")
        if budget < 1024:
            raise InvalidRequestError(
                f"thinking.budget_tokens must be at least 1024; got {budget}", param="thinking.budget_tokens"
            )
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequestError(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                param="thinking.budget_tokens",
            )
    if not request.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")


def decode_messages_request(body: bytes) -> MessagesRequest:
    return _decode(_messages_decoder, body)


def decode_count_tokens_request(body: bytes) -> CountTokensRequest:
    return _decode(_count_decoder, body)
