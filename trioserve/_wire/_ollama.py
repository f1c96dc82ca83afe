"""Ollama's native generation API, sans-IO: ``POST /api/chat`` and ``POST /api/generate``
bodies in, a :class:`~trioserve._wire._conversation.Conversation` (or, for a raw prompt
and fill in the middle, a :class:`~trioserve._core._types.GenerationRequest`) out. The
answer (NDJSON lines or one body) and Ollama's error body: :mod:`._ollama_writer`.

Bodies are decoded by msgspec in one pass (unknown top-level fields ignored, as Ollama
does); ``options`` is closed: an option neither Ollama nor trioserve knows is a 400
naming it, and a known one trioserve cannot honour is refused by name. How each field
maps, and why: ``docs/dialects.md``, "Ollama"; the field table: ``docs/api.md``, "Ollama".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

import msgspec

from .._core._exceptions import InvalidRequestError, NotFoundError
from .._core._types import Constraint, GenerationRequest, Infill, SamplingParams
from ._codec import decode as _decode
from ._constraints import ANY_OBJECT, json_schema_constraint
from ._conversation import Conversation, fold_system_messages, take_prefill
from ._limits import RequestLimits
from ._media import MediaCollector, join_parts
from ._messages import CallFunction, ChatMessage, MessageToolCall
from ._ollama_names import ollama_model_name
from ._ollama_options import OllamaOptions, max_tokens_of, sampling_of, stops_of
from ._openai import Priority
from ._refusals import Refusal, check_refused
from ._tools import (
    FunctionDef,
    Tool,
    ToolChoiceObject,
    check_tool_choice,
    check_tools,
    chosen_tool,
    new_call_id,
)

__all__ = [
    "OllamaChatRequest",
    "OllamaGenerateRequest",
    "OllamaOptions",
    "chat_conversation",
    "decode_ollama_chat",
    "decode_ollama_generate",
    "generate_conversation",
    "logprobs_of",
    "raw_generation",
    "resolve_ollama_model",
    "thinking_of",
]


class OllamaFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    #: an object (Ollama's); a JSON string is read too
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)
    index: int | None = None


class OllamaToolCall(msgspec.Struct, kw_only=True):
    function: OllamaFunctionCall
    id: str | None = None
    type: str | None = None


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    #: base64 images (no data: URL prefix), in a user message
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    #: a tool message: the tool that was run (Ollama's) and the call it answers
    tool_name: str | None = None
    tool_call_id: str | None = None
    #: an earlier assistant turn's reasoning: not put back in the prompt
    thinking: str | None = None


class OllamaFunction(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OllamaTool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: OllamaFunction


Think = bool | Literal["low", "medium", "high"]


class _OllamaFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    #: Ollama's default: streamed
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    #: trioserve's (vLLM's meaning): the request's priority, lower first
    priority: Priority | None = None


class OllamaChatRequest(_OllamaFields, kw_only=True):
    messages: list[OllamaMessage] = msgspec.field(default_factory=list)
    tools: list[OllamaTool] | None = None
    #: trioserve's (OpenAI's values): Ollama has none; ``required`` or a function forces a call
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    #: trioserve's (the Responses API's field): Ollama's own behaviour, ``auto``, when absent
    truncation: Literal["auto", "disabled"] | None = None


class OllamaGenerateRequest(_OllamaFields, kw_only=True):
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    # refused unless "not asked for" (_REFUSED_GENERATE)
    template: str | None = None
    context: list[int] | None = None


_REFUSED_GENERATE: tuple[Refusal, ...] = (
    (
        "template",
        (None, ""),
        "this server renders the model's own chat template; format the prompt yourself and send raw: true",
    ),
    ("context", (None, []), "it is deprecated (as in Ollama): send the conversation to /api/chat"),
)

_chat_decoder = msgspec.json.Decoder(OllamaChatRequest)
_generate_decoder = msgspec.json.Decoder(OllamaGenerateRequest)


def decode_ollama_chat(body: bytes) -> OllamaChatRequest:
    return _decode(_chat_decoder, body)


def decode_ollama_generate(body: bytes) -> OllamaGenerateRequest:
    request = _decode(_generate_decoder, body)
    check_refused(request, _REFUSED_GENERATE)
    return request


# -- model names --------------------------------------------------------------------------


class _Resolve[T](Protocol):
    def __call__(self, name: str | None, /) -> T: ...


def resolve_ollama_model[T](requested: str | None, resolve: _Resolve[T]) -> T:
    """What ``resolve`` gives for the served model an Ollama client's name means
    (``name:latest`` is the served ``name``); an unknown name is 404 in Ollama's words,
    and how to add a model to trioserve (it pulls nothing)."""
    if not requested:
        raise InvalidRequestError("model is required", param="model")

    def known(name: str) -> bool:
        try:
            resolve(name)
        except NotFoundError:
            return False
        return True

    try:
        return resolve(ollama_model_name(requested, known))
    except NotFoundError as exc:
        raise NotFoundError(
            f'model "{requested}" not found: trioserve pulls no models; {exc.message}. Serve a GGUF with '
            "--model NAME=PATH (or a [models] entry of the models file, docs/models.md) and restart, "
            "or POST /api/create from a local GGUF",
            param="model",
            code="model_not_found",
        ) from None


# -- the conversion -----------------------------------------------------------------------


def _constraint(fmt: str | dict[str, Any] | None, limits: RequestLimits) -> Constraint | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json_schema_constraint(ANY_OBJECT, "format", limits)
    if isinstance(fmt, str):
        raise InvalidRequestError(
            f'format must be "json" or a JSON Schema object; got {fmt!r}', param="format"
        )
    return json_schema_constraint(json.dumps(fmt), "format", limits)


def thinking_of(think: Think | None, reasons: bool) -> bool | None:
    """``think`` as a reasoning template's ``enable_thinking`` (``None``: its default);
    ``reasons``: the model's template has reasoning markers."""
    if isinstance(think, str):
        raise InvalidRequestError(
            f"think {think!r} sets a reasoning effort, which this server does not control; "
            "send think: true (or false)",
            param="think",
        )
    if think is True and not reasons:
        raise InvalidRequestError(
            "think: true cannot be honoured: this model does not think (its chat template has no "
            "reasoning); leave think out",
            param="think",
        )
    return think


def _images(images: Sequence[str] | None, media: MediaCollector, param: str) -> list[str]:
    """Each base64 image read into ``media``: the markers that stand for them."""
    return [media.add_bare_base64(data, param=f"{param}[{i}]") for i, data in enumerate(images or ())]


def _messages(messages: Sequence[OllamaMessage], media: MediaCollector) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.images and message.role != "user":
            raise InvalidRequestError(
                f"{where} is a {message.role} message with images; images go in user messages",
                param=f"{where}.images",
            )
        markers = _images(message.images, media, f"{where}.images")
        # (Ollama puts a message's images before its text)
        content = join_parts([*markers, message.content], "") if markers else message.content
        if message.role == "tool":
            out.append(
                ChatMessage(
                    role="tool", content=content, name=message.tool_name, tool_call_id=message.tool_call_id
                )
            )
            continue
        calls = None
        if message.tool_calls:
            if message.role != "assistant":
                raise InvalidRequestError(
                    f"{where} is a {message.role} message with tool_calls; calls are an assistant's",
                    param=f"{where}.tool_calls",
                )
            calls = [
                MessageToolCall(
                    id=call.id or new_call_id(),
                    function=CallFunction(
                        name=call.function.name,
                        arguments=call.function.arguments
                        if isinstance(call.function.arguments, str)
                        else json.dumps(call.function.arguments, separators=(",", ":")),
                    ),
                )
                for call in message.tool_calls
            ]
        out.append(ChatMessage(role=message.role, content=content, tool_calls=calls))
    return out


def _tools(request: OllamaChatRequest, limits: RequestLimits) -> tuple[list[Tool], str]:
    """The request's tools, and its tool choice (``none``, ``auto``, ``required`` or a
    function's name)."""
    tools = [
        Tool(
            type=tool.type,
            function=FunctionDef(
                name=tool.function.name,
                description=tool.function.description,
                parameters=tool.function.parameters,
            ),
        )
        for tool in request.tools or ()
    ]
    check_tools(tools, limits)
    choice = request.tool_choice
    check_tool_choice(choice)
    if choice is None:
        return tools, "auto" if tools else "none"
    name = choice if isinstance(choice, str) else choice.function.name
    if name != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {name!r} needs tools", param="tool_choice")
    if name not in ("none", "auto", "required"):
        chosen_tool(name, tools)
    return tools, name


def _common(
    request: _OllamaFields, limits: RequestLimits, forced: bool
) -> tuple[SamplingParams, tuple[str, ...], Constraint | None]:
    sampling = sampling_of(request.options)
    stops = stops_of(request.options, limits)
    constraint = _constraint(request.format, limits)
    if forced and constraint is not None:
        raise InvalidRequestError(
            "a forced tool call cannot also follow format; send one of them", param="tool_choice"
        )
    if forced and stops:
        raise InvalidRequestError(
            "options.stop cannot cut a forced tool call (its arguments would be cut short); send one of them",
            param="options.stop",
        )
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return sampling, stops, constraint


def chat_conversation(
    request: OllamaChatRequest, limits: RequestLimits, reasons: bool, media: MediaCollector
) -> Conversation:
    """The conversation an ``/api/chat`` request (with at least one message) asks for."""
    limits.check_count("messages", len(request.messages), limits.max_messages, "--max-messages", "messages")
    messages = _messages(request.messages, media)
    # (Ollama continues a last assistant message)
    prefill = take_prefill(
        messages, "the last message is an assistant's tool call; send its result in a tool message"
    )
    tools, choice = _tools(request, limits)
    forced = choice not in ("none", "auto")
    common = _common(request, limits, forced)
    return _options_conversation(
        request,
        fold_system_messages(messages),
        common,
        reasons,
        media,
        tools=tools,
        choice=choice,
        prefill=prefill,
    )


def generate_conversation(
    request: OllamaGenerateRequest, limits: RequestLimits, reasons: bool, media: MediaCollector
) -> Conversation:
    """The one-turn conversation a templated ``/api/generate`` asks for: ``system``, then
    the prompt (after its images) as the user's turn."""
    common = _common(request, limits, False)
    markers = _images(request.images, media, "images")
    content = join_parts([*markers, request.prompt], "") if markers else request.prompt
    messages = [ChatMessage(role="user", content=content)]
    if request.system:
        messages.insert(0, ChatMessage(role="system", content=request.system))
    return _options_conversation(request, messages, common, reasons, media)


def _options_conversation(
    request: _OllamaFields,
    messages: list[ChatMessage],
    common: tuple[SamplingParams, tuple[str, ...], Constraint | None],
    reasons: bool,
    media: MediaCollector,
    *,
    tools: list[Tool] | None = None,
    choice: str = "none",
    prefill: str = "",
) -> Conversation:
    """The conversation of ``messages`` under an Ollama request's options (``common``:
    the sampling, stops and format :func:`_common` read), its ``think``, and the images
    ``media`` holds; ``tools``, ``choice`` and ``prefill``: a chat's."""
    sampling, stops, constraint = common
    return Conversation(
        messages=messages,
        tools=tools if tools is not None else [],
        tool_choice=choice,
        max_tokens=max_tokens_of(request.options),
        sampling=sampling,
        stops=stops,
        constraint=constraint,
        prefill=prefill,
        # (num_predict past the context: Ollama stops at the context's end)
        clamp_max_tokens=True,
        thinking=thinking_of(request.think, reasons),
        images=media.images,
    )


def raw_generation(request: OllamaGenerateRequest, limits: RequestLimits) -> GenerationRequest:
    """``raw: true`` (the prompt as it is, after the model's BOS, as ``/v1/completions``
    sends it) or ``suffix`` (fill in the middle, laid out by the backend as ``/infill``)."""
    what = "raw: true" if request.raw else "suffix"
    for name, given in (("system", request.system), ("images", request.images)):
        if given:
            raise InvalidRequestError(
                f"{name} cannot go with {what}: the prompt is laid out as it is, with no place for it",
                param=name,
            )
    if request.think is not None:
        raise InvalidRequestError(
            f"think cannot go with {what}: no chat template is rendered to switch reasoning", param="think"
        )
    if request.raw and request.suffix:
        raise InvalidRequestError(
            "suffix cannot go with raw: true (fill in the middle lays out the prompt itself)", param="suffix"
        )
    sampling, stops, constraint = _common(request, limits, False)
    infill = Infill(prefix=request.prompt, suffix=request.suffix) if request.suffix else None
    return GenerationRequest(
        prompt="" if infill is not None else request.prompt,
        max_tokens=max_tokens_of(request.options),
        sampling=sampling,
        stop=stops,
        add_bos=infill is None,
        constraint=constraint,
        infill=infill,
        clamp_max_tokens=True,
        logprobs=logprobs_of(request),
    )


def logprobs_of(request: _OllamaFields) -> int | None:
    """``logprobs`` / ``top_logprobs`` as the engine's (``None``: none asked)."""
    return (request.top_logprobs or 0) if request.logprobs else None
