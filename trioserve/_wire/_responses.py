"""OpenAI's Responses API, sans-IO: ``POST /v1/responses`` (and
``/v1/responses/input_tokens``) bodies in, a
:class:`~trioserve._wire._conversation.Conversation` out. The response (Responses events
or a ``Response`` body): :mod:`._responses_writer`.

Stored responses (``store``, ``previous_response_id``, ``background``) need the server's
response store: the HTTP layer reads the stored conversation a request continues and
hands it in (:class:`~trioserve._wire._spec.StoredContext`); without a store they are
refused by name. The mapping and choices: ``docs/dialects.md``; the field table:
``docs/api.md``, "OpenAI Responses".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._types import Constraint, SamplingParams
from ._codec import decode as _decode
from ._constraints import ANY_OBJECT, json_schema_constraint
from ._conversation import Conversation, fold_system_messages, new_id
from ._limits import RequestLimits
from ._media import MediaCollector, join_parts
from ._messages import CallFunction, ChatMessage, MessageToolCall, flatten_text
from ._openai import (
    DEFAULT_LIMITS,
    Priority,
)
from ._refusals import Refusal, check_refused
from ._tools import FunctionDef, Tool, check_tool_name, check_tool_schemas, check_tools

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


@dataclass(frozen=True, slots=True)
class StoredContext:
    """What the server's response store gives a Responses request (docs/dialects.md,
    "Stored responses"): the conversation a ``previous_response_id`` continues, and a
    background response's id (given before it runs)."""

    #: the earlier turns, oldest first: each stored response's input items, then its
    #: output items, as a client would have sent them back
    history: tuple[dict[str, Any], ...] = ()
    #: a background response's id; ``None``: a foreground request
    response_id: str | None = None
    #: the ``previous_response_id`` whose conversation ``history`` is (the body must
    #: name the same one: else 400, never a prompt without its history)
    previous_id: str | None = None


@dataclass(frozen=True, slots=True)
class StoredAsk:
    """What a Responses body asks of the store, read before the body is decoded in
    full: the response it continues, whether it runs in the background (and, then,
    whether it streams: a resumable stream, docs/resumable-streams.md)."""

    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    background: bool | None = None
    stream: bool | None = None


class InputContent(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    # input_image (docs/vision.md)
    image_url: str | None = None
    detail: str | None = None
    file_id: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One ``input`` item: a message (``type`` ``message`` or absent), a
    ``function_call``, a ``function_call_output``, a ``reasoning`` item…"""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    # function_call
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output
    output: str | list[InputContent] | None = None
    id: str | None = None
    status: str | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    #: "medium" is OpenAI's default
    verbosity: Literal["low", "medium", "high"] | None = None


class _ResponsesFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Any = None
    truncation: Literal["disabled", "auto"] | None = None
    #: a stored response this one continues (needs the server's response store)
    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    background: bool | None = None
    # known, not honoured: refused (_REFUSED)
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None


class InputTokensRequest(_ResponsesFields, kw_only=True):
    pass


class ResponsesRequest(_ResponsesFields, kw_only=True):
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool | None = None
    include: list[str] | None = None
    #: echoed in the response (up to 16 string pairs, as OpenAI)
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: trioserve's (vLLM's meaning): the request's priority, lower first
    priority: Priority | None = None
    #: llama-server's: ``false``: this request's reasoning cannot be ended on request
    #: (``POST /v1/chat/completions/control``); absent or ``true``: it can
    reasoning_control: bool | None = None
    stream_options: Any = None
    # identifiers: accepted, not used
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


_responses_decoder = msgspec.json.Decoder(ResponsesRequest)
_input_tokens_decoder = msgspec.json.Decoder(InputTokensRequest)

_REFUSED: tuple[Refusal, ...] = (
    ("conversation", (None,), "conversations are not stored here; send the whole conversation in input"),
    ("prompt", (None,), "there are no stored prompt templates here; send instructions and input"),
    ("context_management", (None,), "this server does not compact the context; send the input to use"),
    ("moderation", (None,), "this server runs no moderation"),
)
#: ``include`` values that are honoured trivially: no reasoning is ever encrypted here
#: (a reasoning model's reasoning is sent as text, in a ``reasoning`` item)
_INCLUDE_NOTHING = frozenset({"reasoning.encrypted_content"})
#: ``metadata`` pairs, at most (OpenAI's limit; they are echoed in every response)
_MAX_METADATA = 16


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
        names = [tool.function.name for tool in tools]
        if choice.name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {choice.name!r}, which is not in tools ({', '.join(names)})",
                param="tool_choice.name",
            )
        return choice.name
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


#: why a stored-response field is refused on a server that stores none
_NO_STORE = "this server stores no responses (start it with --responses-db)"


def _check_stored(request: _ResponsesFields, stored: StoredContext | None) -> None:
    """``store``, ``previous_response_id`` and ``background``: each needs the store."""
    full = request if isinstance(request, ResponsesRequest) else None
    if stored is None:
        if request.previous_response_id is not None:
            raise InvalidRequestError(
                f"previous_response_id is not supported: {_NO_STORE}; send the whole conversation in input",
                param="previous_response_id",
            )
        if request.background:
            raise InvalidRequestError(
                f"background is not supported: {_NO_STORE}; stream to see progress", param="background"
            )
        if full is not None and full.store:
            raise InvalidRequestError(
                f"store is not supported: {_NO_STORE}; send store: false", param="store"
            )
        return
    if full is None or not request.background:
        return
    if full.store is False:
        raise InvalidRequestError(
            "background needs store: a background response is read back by its id (send store: true "
            "or leave it out)",
            param="store",
        )


def _check(request: _ResponsesFields, stored: StoredContext | None = None) -> None:
    check_refused(request, _REFUSED)
    _check_stored(request, stored)
    if request.reasoning is not None and request.reasoning not in ({}, {"effort": None}, {"effort": "none"}):
        raise InvalidRequestError(
            "reasoning is not supported: this server does not control reasoning effort "
            "(send reasoning: {effort: none} to ask a reasoning model not to reason)",
            param="reasoning",
        )
    text = request.text
    if text is not None and text.verbosity not in (None, "medium"):
        raise InvalidRequestError(
            "text.verbosity is not supported: the model has no verbosity control", param="text.verbosity"
        )
    if not isinstance(request, ResponsesRequest):
        return
    for value in request.include or ():
        if value not in _INCLUDE_NOTHING:
            raise InvalidRequestError(
                f"include is not supported: {value!r} cannot be included here "
                "(reasoning.encrypted_content can: nothing is encrypted)",
                param="include",
            )
    if request.top_logprobs:
        raise InvalidRequestError(
            "top_logprobs is not supported: use /v1/chat/completions for log-probabilities",
            param="top_logprobs",
        )


def _check_sizes(request: _ResponsesFields, limits: RequestLimits) -> None:
    """Refuse more input items or content parts than ``limits`` allow, and more
    ``metadata`` than OpenAI's 16 pairs."""
    items = request.input
    if isinstance(items, list):
        limits.check_count("input", len(items), limits.max_messages, "--max-messages", "input")
        parts = sum(
            len(content)
            for item in items
            for content in (item.content, item.output)
            if isinstance(content, list)
        )
        if parts > limits.max_content_parts:
            raise InvalidRequestError(
                f"input holds {parts} content parts; this server accepts at most {limits.max_content_parts} "
                "(--max-content-parts)",
                param="input",
            )
    metadata = request.metadata if isinstance(request, ResponsesRequest) else None
    if metadata is not None and len(metadata) > _MAX_METADATA:
        raise InvalidRequestError(
            f"metadata holds {len(metadata)} pairs; at most {_MAX_METADATA} are allowed (OpenAI's limit)",
            param="metadata",
        )


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


_peek_decoder = msgspec.json.Decoder(StoredAsk)


def peek_stored(body: bytes) -> StoredAsk:
    """What ``body`` asks of the response store, read before it is decoded in full
    (a body that is not JSON, or whose fields have the wrong types, asks nothing: its
    full decode reports it)."""
    if b'"previous_response_id"' not in body and b'"background"' not in body:
        return StoredAsk()
    try:
        return _peek_decoder.decode(body)
    except msgspec.DecodeError:
        return StoredAsk()


def decode_responses_request(body: bytes) -> ResponsesRequest:
    return _decode(_responses_decoder, body)


def decode_input_tokens_request(body: bytes) -> InputTokensRequest:
    return _decode(_input_tokens_decoder, body)
