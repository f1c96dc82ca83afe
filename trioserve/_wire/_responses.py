"""OpenAI's Responses API, sans-IO: ``POST /v1/responses`` (and
``/v1/responses/input_tokens``) bodies in, a
:class:`~trioserve._wire._conversation.Conversation` out. The response (Responses events
or a ``Response`` body): :mod:`._responses_writer`. The bodies' structs, their decoding and
checks: :mod:`._responses_request`.

Stored responses (``store``, ``previous_response_id``, ``background``) need the server's
response store: the HTTP layer reads the stored conversation a request continues and
hands it in (:class:`~trioserve._wire._spec.StoredContext`); without a store they are
refused by name. The mapping and choices: ``docs/dialects.md``; the field table:
``docs/api.md``, "OpenAI Responses".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._types import Constraint, SamplingParams
from ._constraints import ANY_OBJECT, json_schema_constraint
from ._conversation import Conversation, fold_system_messages, new_id
from ._limits import RequestLimits
from ._media import MediaCollector, join_parts
from ._messages import CallFunction, ChatMessage, MessageToolCall, flatten_text
from ._openai import DEFAULT_LIMITS
from ._responses_request import (
    InputContent,
    InputItem,
    InputTokensRequest,
    ResponsesRequest,
    ResponsesTool,
    StoredAsk,
    StoredContext,
    TextConfig,
    ToolChoiceFunction,
    _check,
    _check_sizes,
    _ResponsesFields,
    decode_input_tokens_request,
    decode_responses_request,
    peek_stored,
)
from ._tools import FunctionDef, Tool, check_tool_name, check_tool_schemas, check_tools, chosen_tool

__all__ = [
    "InputTokensRequest",
    "ResponsesRequest",
    "StoredAsk",
    "StoredContext",
    "decode_input_tokens_request",
    "decode_responses_request",
    "peek_stored",
    "responses_conversation",
    "turn_input_items",
]


#: the content parts that are text (a model's own earlier output included)
_TEXT_TYPES = ("input_text", "output_text", "text")


def _content_text(
    content: str | list[InputContent] | None, where: str, media: MediaCollector | None = None
) -> str:
    """A content's text; with ``media`` (a user message's), its ``input_image`` parts as
    their markers, in place."""

    def refuse(i: int, type_: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"{where}[{i}] is of type {type_!r}; only text is read here (input_text; images go in user "
            "messages as input_image)",
            param=f"{where}[{i}]",
        )

    if media is not None and isinstance(content, list) and any(c.type == "input_image" for c in content):
        parts: list[str] = []
        for i, part in enumerate(content):
            if part.type == "input_image":
                parts.append(_image(part, f"{where}[{i}]", media))
            elif part.type in _TEXT_TYPES and part.text is not None:
                parts.append(part.text)
            else:
                raise refuse(i, part.type)
        return join_parts(parts, "")
    return flatten_text(content, text_types=_TEXT_TYPES, joiner="", refuse=refuse)


def _image(part: InputContent, where: str, media: MediaCollector) -> str:
    if part.file_id is not None:
        raise InvalidRequestError(
            f"{where} names a file_id; this server keeps no files: send image_url (a data URL or an "
            "http(s) URL)",
            param=f"{where}.file_id",
        )
    return media.add(
        part.image_url or "", param=f"{where}.image_url", detail=part.detail, detail_param=f"{where}.detail"
    )


def _chat_messages(items: str | list[InputItem], media: MediaCollector, first: int = 0) -> list[ChatMessage]:
    """The chat of ``items``; ``first``: how many earlier (stored) items came before
    them, so that an error names the request's own ``input[i]``."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items, -first):
        where = f"input[{i}]" if i >= 0 else f"the stored conversation's item {i + first}"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise InvalidRequestError(f"{where} (a message) needs a role", param=f"{where}.role")
            images = media if item.role == "user" else None
            out.append(
                ChatMessage(role=item.role, content=_content_text(item.content, f"{where}.content", images))
            )
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise InvalidRequestError(f"{where} (function_call) needs call_id and name", param=where)
            call = MessageToolCall(
                id=item.call_id, function=CallFunction(name=item.name, arguments=item.arguments or "{}")
            )
            previous = out[-1] if out else None
            if previous is not None and previous.role == "assistant":
                # (appended in place: copying the list per call is quadratic in them)
                if previous.tool_calls is None:
                    previous.tool_calls = []
                previous.tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id:
                raise InvalidRequestError(
                    f"{where} (function_call_output) needs call_id", param=f"{where}.call_id"
                )
            out.append(
                ChatMessage(
                    role="tool",
                    content=_content_text(item.output, f"{where}.output"),
                    tool_call_id=item.call_id,
                )
            )
        elif kind == "reasoning":
            continue  # another model's reasoning: not part of the prompt (as templates drop it)
        else:
            raise InvalidRequestError(
                f"{where} is of type {kind!r}; this server reads messages, function_call and "
                "function_call_output items",
                param=f"{where}.type",
            )
    return out


def _tools(tools: Sequence[ResponsesTool] | None, limits: RequestLimits) -> list[Tool]:
    limits.check_count("tools", len(tools or ()), limits.max_tools, "--max-tools", "tools")
    out = []
    for i, tool in enumerate(tools or ()):
        if tool.type != "function":
            raise InvalidRequestError(
                f"tools[{i}].type is {tool.type!r}; only function tools are supported "
                "(run the rest on the client)",
                param=f"tools[{i}].type",
            )
        check_tool_name(tool.name, f"tools[{i}].name")
        assert tool.name is not None  # (checked)
        out.append(
            Tool(
                type="function",
                function=FunctionDef(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.parameters,
                    strict=tool.strict,
                ),
            )
        )
    check_tools(out)
    check_tool_schemas(out, limits, schema_field="parameters")
    return out


def _tool_choice(choice: str | ToolChoiceFunction | None, tools: list[Tool]) -> str:
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, ToolChoiceFunction):
        if choice.type != "function" or not choice.name:
            raise InvalidRequestError(
                f"tool_choice of type {choice.type!r} is not supported; send a function's name",
                param="tool_choice",
            )
        return chosen_tool(choice.name, tools, param="tool_choice.name")
    if choice != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    return choice


def _constraint(text: TextConfig | None, limits: RequestLimits) -> Constraint | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(kind="json_schema", source=ANY_OBJECT)
    if fmt.schema_ is None:
        raise InvalidRequestError(
            "text.format of type json_schema needs schema (a JSON Schema object)", param="text.format.schema"
        )
    return json_schema_constraint(json.dumps(fmt.schema_), "text.format.schema", limits)


def responses_conversation(
    request: _ResponsesFields,
    *,
    limits: RequestLimits = DEFAULT_LIMITS,
    stored: StoredContext | None = None,
    media: MediaCollector | None = None,
) -> Conversation:
    """The conversation a Responses (or input_tokens) request asks for, within
    ``limits``: the stored conversation it continues (``stored.history``), then its
    own ``input``; its images (the stored ones too) read into ``media``."""
    if media is None:
        media = MediaCollector(limits)
    _check(request, stored)
    if stored is not None and request.previous_response_id != stored.previous_id:
        # (the store was read for another id than the body names: never run without it)
        raise InvalidRequestError(
            "previous_response_id could not be read; send it as a string of 1 to 256 characters",
            param="previous_response_id",
        )
    if not request.input:
        raise InvalidRequestError("input is required: a text or a list of items", param="input")
    _check_sizes(request, limits)
    history = stored.history if stored is not None else ()
    if history:
        earlier = msgspec.convert(list(history), list[InputItem])
        given = request.input
        own = [InputItem(role="user", content=given)] if isinstance(given, str) else given
        messages = _chat_messages([*earlier, *own], media, first=len(earlier))
    else:
        messages = _chat_messages(request.input, media)
    if request.instructions:
        messages.insert(0, ChatMessage(role="system", content=request.instructions))
    if not any(m.role != "system" and m.role != "developer" for m in messages):
        raise InvalidRequestError("input must hold at least one message", param="input")
    tools = _tools(request.tools, limits)
    choice = _tool_choice(request.tool_choice, tools)
    constraint = _constraint(request.text, limits)
    if constraint is not None and choice not in ("none", "auto"):
        raise InvalidRequestError(
            "a forced tool call cannot also follow text.format; send one of them", param="tool_choice"
        )
    full = request if isinstance(request, ResponsesRequest) else None
    sampling = SamplingParams()
    max_tokens = None
    if full is not None:
        sampling = SamplingParams(
            temperature=1.0 if full.temperature is None else full.temperature,
            top_p=1.0 if full.top_p is None else full.top_p,
        )
        max_tokens = full.max_output_tokens
    return Conversation(
        messages=fold_system_messages(messages),
        tools=tools,
        tool_choice=choice,
        parallel_calls=request.parallel_tool_calls is not False,
        max_tokens=max_tokens,
        sampling=sampling,
        stops=(),
        constraint=constraint,
        thinking=False if request.reasoning == {"effort": "none"} else None,
        images=media.images,
    )


def turn_input_items(request: _ResponsesFields) -> list[dict[str, Any]]:
    """This turn's ``input``, as it is stored and listed (``input_items``): items, each
    with an id (a text input is one user message)."""
    items: list[dict[str, Any]] = []
    given = request.input
    if isinstance(given, str):
        content: list[dict[str, Any]] = [{"type": "input_text", "text": given}]
        return [{"id": new_id("msg_"), "type": "message", "role": "user", "content": content}]
    for item in given:
        out: dict[str, Any] = {k: v for k, v in msgspec.to_builtins(item).items() if v is not None}
        out.setdefault("type", "message")
        parts = out.get("content")
        if out["type"] == "message" and isinstance(parts, str):
            # (as OpenAI lists it: parts; one part renders as the string did)
            kind = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": kind, "text": parts}]
        elif out["type"] == "message" and isinstance(parts, list):
            out["content"] = [{k: v for k, v in part.items() if v is not None} for part in parts]
        out.setdefault("id", new_id("msg_" if out["type"] == "message" else "item_"))
        items.append(out)
    return items
