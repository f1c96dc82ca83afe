"""Anthropic's Messages API, sans-IO: ``POST /v1/messages`` (and ``count_tokens``)
bodies in, a :class:`~trioserve._wire._conversation.Conversation` out. The response
(Anthropic's events or ``Message`` body) and its error bodies: :mod:`._anthropic_writer`.
The bodies' structs, their decoding and checks: :mod:`._anthropic_request`.

Requests are decoded by msgspec in one pass (unknown fields ignored, as Anthropic's
clients expect); a known field trioserve cannot honour is a 400 naming it. How the
request maps onto a chat, and every choice: ``docs/dialects.md``; the field table:
``docs/api.md``, "Anthropic Messages".
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .._core._exceptions import InvalidRequestError
from .._core._types import Constraint, SamplingParams
from ._anthropic_request import (
    AnthropicTool,
    Block,
    CountTokensRequest,
    Message,
    MessagesRequest,
    ToolChoice,
    _check_common,
    _check_sizes,
    _MessagesFields,
    decode_count_tokens_request,
    decode_messages_request,
)
from ._constraints import json_schema_constraint
from ._conversation import Conversation, fold_system_messages, take_prefill
from ._limits import RequestLimits
from ._media import MediaCollector, join_parts
from ._messages import CallFunction, ChatMessage, MessageToolCall, flatten_text
from ._openai import DEFAULT_LIMITS
from ._tools import FunctionDef, Tool, check_tool_name, check_tool_schemas, chosen_tool

__all__ = [
    "BILLING_HEADER_PREFIX",
    "CountTokensRequest",
    "MessagesRequest",
    "decode_count_tokens_request",
    "decode_messages_request",
    "messages_conversation",
]

#: the text Claude Code's per-request system block starts with
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


def _text_of(blocks: str | list[Block] | None, where: str, *, images: str = "go in user messages") -> str:
    """Text blocks' text; any other block a 400 naming it (``images``: where an image
    goes instead, for the message of one that came here)."""

    def refuse(i: int, type_: str) -> InvalidRequestError:
        hint = f"images {images}" if type_ == "image" else "images go in user messages"
        return InvalidRequestError(
            f"{where}[{i}] is a {type_!r} block; only text is read here ({hint})", param=f"{where}[{i}]"
        )

    return flatten_text(blocks, text_types=("text",), joiner="\n", refuse=refuse)


def _system_text(system: str | list[Block] | None, keep_billing_header: bool) -> str:
    if isinstance(system, list) and not keep_billing_header:
        system = [
            b for b in system if not (b.type == "text" and (b.text or "").startswith(BILLING_HEADER_PREFIX))
        ]
    return _text_of(system, "system")


def _image(block: Block, where: str, media: MediaCollector) -> str:
    """An ``image`` block: its marker (the image read into ``media``)."""
    source = block.source
    if source is None:
        raise InvalidRequestError(f"{where} (image) needs a source", param=f"{where}.source")
    if source.type == "base64":
        if not source.data:
            raise InvalidRequestError(
                f"{where} (image) needs source.data: the image's base64",
                param=f"{where}.source.data",
                code="invalid_image",
            )
        return media.add_base64(source.data, source.media_type, param=f"{where}.source")
    if source.type == "url":
        return media.add(source.url or "", param=f"{where}.source.url")
    raise InvalidRequestError(
        f"{where} is an image with a {source.type!r} source; this server reads base64 and url sources "
        "(it keeps no files: send the image itself, as base64)",
        param=f"{where}.source.type",
    )


def _chat_messages(messages: Sequence[Message], media: MediaCollector) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}].content"
        content = message.content
        if message.role in ("system", "developer"):
            out.append(ChatMessage(role=message.role, content=_text_of(content, where)))
            continue
        if isinstance(content, str):
            out.append(ChatMessage(role=message.role, content=content))
            continue
        if message.role == "user":
            texts: list[str] = []
            for j, block in enumerate(content):
                if block.type == "tool_result":
                    if texts:
                        out.append(ChatMessage(role="user", content=join_parts(texts, "\n")))
                        texts = []
                    if not block.tool_use_id:
                        raise InvalidRequestError(
                            f"{where}[{j}] (tool_result) needs tool_use_id", param=f"{where}[{j}].tool_use_id"
                        )
                    result = _text_of(
                        block.content,
                        f"{where}[{j}].content",
                        images="in a tool_result are not read here: put the image in the user message "
                        "beside the tool_result",
                    )
                    out.append(
                        ChatMessage(
                            role="tool",
                            content=f"error: {result}" if block.is_error else result,
                            tool_call_id=block.tool_use_id,
                        )
                    )
                elif block.type == "text" and block.text is not None:
                    texts.append(block.text)
                elif block.type == "image":
                    texts.append(_image(block, f"{where}[{j}]", media))
                else:
                    raise InvalidRequestError(
                        f"{where}[{j}] is a {block.type!r} block; a user message holds text, image and "
                        "tool_result blocks here",
                        param=f"{where}[{j}]",
                    )
            if texts:
                out.append(ChatMessage(role="user", content=join_parts(texts, "\n")))
            continue
        texts, calls = [], []
        for j, block in enumerate(content):
            if block.type == "text" and block.text is not None:
                texts.append(block.text)
            elif block.type == "tool_use":
                if not block.id or not block.name:
                    raise InvalidRequestError(
                        f"{where}[{j}] (tool_use) needs id and name", param=f"{where}[{j}]"
                    )
                arguments = json.dumps(block.input if block.input is not None else {}, separators=(",", ":"))
                calls.append(
                    MessageToolCall(id=block.id, function=CallFunction(name=block.name, arguments=arguments))
                )
            elif block.type in ("thinking", "redacted_thinking"):
                continue  # earlier turns' reasoning is not part of the prompt (as Anthropic does)
            else:
                images = " (images go in user messages)" if block.type == "image" else ""
                raise InvalidRequestError(
                    f"{where}[{j}] is a {block.type!r} block; an assistant message holds text and "
                    f"tool_use blocks here{images}",
                    param=f"{where}[{j}]",
                )
        if texts or calls:
            out.append(ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None))
    return out


def _tools(tools: Sequence[AnthropicTool] | None) -> list[Tool]:
    out: list[Tool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(
                f"tools[{i}] is Anthropic's server tool {tool.type!r}; this server runs custom tools only "
                "(name, description, input_schema), executed by the client",
                param=f"tools[{i}].type",
            )
        if tool.defer_loading:
            raise InvalidRequestError(
                f"tools[{i}].defer_loading is not supported: every tool is in the prompt here",
                param=f"tools[{i}].defer_loading",
            )
        if tool.input_examples:
            raise InvalidRequestError(
                f"tools[{i}].input_examples is not supported: put examples in the description",
                param=f"tools[{i}].input_examples",
            )
        check_tool_name(tool.name, f"tools[{i}].name", longest=128)
        if tool.name in seen:
            raise InvalidRequestError(f"two tools are named {tool.name!r}", param="tools")
        seen.add(tool.name)
        schema = tool.input_schema
        if schema is None:
            raise InvalidRequestError(f"tools[{i}] needs input_schema", param=f"tools[{i}].input_schema")
        if schema.get("type", "object") != "object":
            raise InvalidRequestError(
                f"tools[{i}].input_schema must describe an object (type: object)",
                param=f"tools[{i}].input_schema.type",
            )
        out.append(
            Tool(
                type="function",
                function=FunctionDef(name=tool.name, description=tool.description, parameters=schema),
            )
        )
    return out


def _tool_choice(choice: ToolChoice | None, tools: list[Tool]) -> str:
    if choice is None:
        return "auto" if tools else "none"
    if choice.type == "none":
        return "none"
    if not tools:
        raise InvalidRequestError(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "auto":
        return "auto"
    if choice.type == "any":
        return "required"
    return chosen_tool(choice.name, tools, noun="tool", param="tool_choice.name")


def _constraint(request: _MessagesFields, limits: RequestLimits) -> Constraint | None:
    formats = [
        f for f in (request.output_config and request.output_config.format, request.output_format) if f
    ]
    if len(formats) > 1:
        raise InvalidRequestError(
            "send output_config.format or output_format, not both", param="output_format"
        )
    if not formats:
        return None
    return json_schema_constraint(json.dumps(formats[0].schema_), "output_config.format.schema", limits)


def messages_conversation(
    request: _MessagesFields,
    *,
    keep_billing_header: bool = False,
    limits: RequestLimits = DEFAULT_LIMITS,
    media: MediaCollector | None = None,
) -> Conversation:
    """The conversation a Messages (or count_tokens) request asks for, within ``limits``;
    its images read into ``media`` (a collector of its own when none is given)."""
    if media is None:
        media = MediaCollector(limits)
    full = request if isinstance(request, MessagesRequest) else None
    _check_common(request, full.max_tokens if full else None)
    _check_sizes(request, limits)
    messages = _chat_messages(request.messages, media)
    system = _system_text(request.system, keep_billing_header)
    if system:
        messages.insert(0, ChatMessage(role="system", content=system))
    prefill = take_prefill(
        messages, "the last message is an assistant tool_use; send its tool_result in a user message"
    )
    if prefill != prefill.rstrip():
        raise InvalidRequestError(
            "final assistant content cannot end with trailing whitespace", param="messages"
        )
    tools = _tools(request.tools)
    check_tool_schemas(tools, limits, schema_field="input_schema")
    choice = _tool_choice(request.tool_choice, tools)
    constraint = _constraint(request, limits)
    if constraint is not None and choice not in ("none", "auto"):
        raise InvalidRequestError(
            "a forced tool call cannot also follow output_config.format; send one of them",
            param="tool_choice",
        )
    sampling = SamplingParams()
    stops: tuple[str, ...] = ()
    max_tokens = None
    if full is not None and full.stop_sequences and choice not in ("none", "auto"):
        raise InvalidRequestError(
            "stop_sequences cannot cut a forced tool call (its input would be cut short); send one of them",
            param="stop_sequences",
        )
    if full is not None:
        sampling = SamplingParams(
            temperature=1.0 if full.temperature is None else full.temperature,
            top_p=full.top_p or 1.0,
            top_k=full.top_k or 0,
        )
        stops = tuple(s for s in full.stop_sequences or () if s)
        max_tokens = full.max_tokens
    return Conversation(
        messages=fold_system_messages(messages),
        tools=tools,
        tool_choice=choice,
        parallel_calls=not (request.tool_choice and request.tool_choice.disable_parallel_tool_use),
        max_tokens=max_tokens,
        sampling=sampling,
        stops=stops,
        constraint=constraint,
        prefill=prefill,
        # Claude Code asks for 32,000 tokens whatever the context: generate until it is
        # full, and say so (stop_reason model_context_window_exceeded)
        clamp_max_tokens=True,
        thinking=None if request.thinking is None or request.thinking.type != "disabled" else False,
        omit_thinking=request.thinking is not None and request.thinking.display == "omitted",
        thinking_budget=request.thinking.budget_tokens
        if request.thinking is not None and request.thinking.type == "enabled"
        else None,
        images=media.images,
    )
