"""The one inbound conversion, per dialect: a request body to the engine's
:class:`~trioserve._core._types.GenerationRequest` and the dialect that answers it — and
the specs (:class:`~trioserve._wire._spec.DialectSpec`) that carry these decoders, one
per generation route. Anthropic Messages and OpenAI Responses are the same chat,
rendered by the same template, as a chat completion (docs/dialects.md)."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from .._core._media import Media
from .._core._types import GenerationRequest
from ._anthropic import decode_count_tokens_request, decode_messages_request, messages_conversation
from ._anthropic_writer import AnthropicDialect, anthropic_error
from ._chat import ChatFormat, ChatPrompt
from ._choices import ToolMode
from ._conversation import Conversation, armed_generation
from ._conversation import armed as _armed
from ._dialect import OpenAIDialect
from ._infill import InfillDialect, decode_infill_request
from ._limits import RequestLimits
from ._media import MediaCollector
from ._messages import ChatMessage
from ._ollama_inbound import OLLAMA, OLLAMA_CHAT, OLLAMA_GENERATE
from ._openai import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_generation,
    decode_chat_request,
    decode_completion_prompts,
)
from ._responses import (
    decode_input_tokens_request,
    decode_responses_request,
    peek_stored,
    responses_conversation,
    turn_input_items,
)
from ._responses_request import ResponsesRequest
from ._responses_writer import ResponsesDialect, StoredTurn
from ._spec import (
    DialectSpec,
    ParsedRequest,
    ReadOptions,
    ToolsAndReasoning,
    conversation_request,
    openai_error_body,
    tools_and_reasoning,
)
from ._transcriptions import TranscriptionDialect, read_transcription_body
from ._truncation import Truncation, TruncationMode

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "INFILL",
    "MESSAGES",
    "OLLAMA",
    "OLLAMA_CHAT",
    "OLLAMA_GENERATE",
    "OPENAI",
    "RESPONSES",
    "SPECS",
    "responses_reply",
    "spec_for_path",
]


def _chat_for(
    chat: ChatCompletionRequest,
    rendered: ChatPrompt,
    limits: RequestLimits,
    images: tuple[Media, ...],
) -> GenerationRequest:
    """A chat completion's generation, for its messages rendered to ``rendered``."""
    stops, bos = rendered.stops, not rendered.has_bos
    return chat_generation(chat, rendered.text, stops, add_bos=bos, limits=limits, images=images)


def _read_openai(kind: str, body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    """``/v1/completions`` (``kind="text"``) or ``/v1/chat/completions`` (``"chat"``)."""
    request: CompletionRequest | ChatCompletionRequest
    tool_mode: ToolMode = "none"
    names: tuple[str, ...] = ()
    parallel_calls = True
    reasoning: tuple[str, str] | None = None
    inside = False
    limits = options.limits
    truncation: Truncation | None = None
    if kind == "text":
        request, generations = decode_completion_prompts(body, limits)
        if request.reasoning_control is False:  # (a raw prompt: no reasoning markers known)
            generations = [_armed(g, None, False, False) for g in generations]
    else:
        media = MediaCollector(limits)
        chat = decode_chat_request(body, limits, media)
        mode = chat.tool_mode()
        tools = chat.tools if mode != "none" else None
        images = media.images

        def build(messages: list[ChatMessage]) -> tuple[GenerationRequest, ChatPrompt, bool]:
            """The generation for ``messages``, its rendered prompt, and whether the
            model may reason in it."""
            rendered = chat_format.render(messages, tools=tools)
            generation = _chat_for(chat, rendered, limits, images)
            if generation.constraint is None or rendered.reasoning is None:
                return generation, rendered, True
            # the constraint holds from the first token: the answer is never reasoning
            rendered = chat_format.render(messages, tools=tools, thinking=False)
            return _chat_for(chat, rendered, limits, images), rendered, False

        generation, rendered, reasons = build(chat.messages)
        if reasons:
            reasoning, inside = rendered.reasoning, rendered.opens_reasoning
        generations = [_armed(generation, reasoning, inside, chat.reasoning_control)]
        request = chat
        armed = (reasoning, inside, chat.reasoning_control)
        truncation = Truncation(
            chat.truncation or options.truncation,
            chat.messages,
            lambda messages: _armed(build(messages)[0], *armed),
            note=lambda dropped: dialect.note_truncation(dropped),
        )
        if mode != "none":
            tool_mode = "auto" if mode == "auto" else "forced"
            names = tuple(tool.function.name for tool in chat.tools or ())
            parallel_calls = chat.parallel_tool_calls is not False
    model = options.model_name(request.model)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    facts = ToolsAndReasoning(
        tool_mode=tool_mode,
        tool_names=names,
        parallel_calls=parallel_calls,
        reasoning=reasoning,
        inside=inside,
    )
    dialect = OpenAIDialect(
        "text" if kind == "text" else "chat",
        model,
        include_usage=include_usage,
        choices=request.n * len(generations),
        **facts,
    )
    return ParsedRequest(
        stream=request.stream,
        generations=tuple(generations),
        model=model,
        dialect=dialect,
        truncation=truncation,
        n=request.n,
        priority=request.priority,
        **facts,
    )


def _read_completions(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    return _read_openai("text", body, chat_format, options)


def _read_chat(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    return _read_openai("chat", body, chat_format, options)


def _read_messages(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    """An Anthropic Messages request."""
    messages = decode_messages_request(body)
    conversation = messages_conversation(
        messages, keep_billing_header=options.keep_billing_header, limits=options.limits
    )
    model = options.model_name(messages.model)
    generation, rendered = armed_generation(conversation, chat_format, messages.reasoning_control)
    dialect = AnthropicDialect(
        model,
        stops=conversation.stops,
        max_tokens=conversation.max_tokens,
        omit_thinking=conversation.omit_thinking,
        **tools_and_reasoning(conversation, rendered),
    )
    mode = messages.truncation or options.truncation
    truncation = _truncation(mode, conversation, chat_format, messages.reasoning_control, dialect)
    return conversation_request(
        messages.stream,
        generation,
        model,
        dialect,
        conversation,
        rendered,
        priority=messages.priority,
        truncation=truncation,
    )


def _truncation(
    mode: TruncationMode,
    conversation: Conversation,
    chat_format: ChatFormat,
    control: bool | None,
    dialect: AnthropicDialect | ResponsesDialect,
    param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> Truncation:
    """How a conversation dialect's generation is built again from fewer messages
    (``truncation: "auto"``; docs/dialects.md, "Truncation")."""

    def build(messages: list[ChatMessage]) -> GenerationRequest:
        shorter = dataclasses.replace(conversation, messages=messages)
        return armed_generation(shorter, chat_format, control)[0]

    return Truncation(
        mode,
        conversation.messages,
        build,
        note=dialect.note_truncation,
        param=param,
        max_tokens_param=max_tokens_param,
    )


def _read_responses(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    """An OpenAI Responses request."""
    responses = decode_responses_request(body)
    stored = options.stored
    conversation = responses_conversation(responses, limits=options.limits, stored=stored)
    model = options.model_name(responses.model)
    generation, rendered = armed_generation(conversation, chat_format, responses.reasoning_control)
    # stored: OpenAI's default, where the server has a store
    storing = stored is not None and responses.store is not False
    dialect = ResponsesDialect(
        model,
        responses,
        stored=storing,
        response_id=stored.response_id if stored is not None else None,
        **tools_and_reasoning(conversation, rendered),
    )
    mode = dialect.truncation = responses.truncation or options.truncation
    truncation = _truncation(
        mode,
        conversation,
        chat_format,
        responses.reasoning_control,
        dialect,
        param="input",
        max_tokens_param="max_output_tokens",
    )
    turn = _stored_turn(dialect, responses, model, bool(responses.background)) if storing else None
    return conversation_request(
        responses.stream,
        generation,
        model,
        dialect,
        conversation,
        rendered,
        turn=turn,
        priority=responses.priority,
        truncation=truncation,
    )


def responses_reply(body: bytes, options: ReadOptions) -> tuple[StoredTurn, dict[str, object]]:
    """A background Responses request, checked before it runs (every check that needs
    no model: a bad request is a 400 now, not a failed response later): the turn to
    store, and the response object it answers at once (``status: "queued"``)."""
    responses = decode_responses_request(body)
    stored = options.stored
    assert stored is not None
    assert stored.response_id is not None
    responses_conversation(responses, limits=options.limits, stored=stored)
    model = options.model_name(responses.model)
    dialect = ResponsesDialect(model, responses, stored=True, response_id=stored.response_id)
    dialect.truncation = responses.truncation or options.truncation
    return _stored_turn(dialect, responses, model, True), dialect.snapshot("queued")


def _stored_turn(
    dialect: ResponsesDialect, responses: ResponsesRequest, model: str, background: bool
) -> StoredTurn:
    """The turn a stored Responses request keeps: its input items, the response it
    continues and its instructions."""
    return StoredTurn(
        dialect,
        turn_input_items(responses),
        previous_id=responses.previous_response_id,
        instructions=responses.instructions,
        background=background,
        model=model,
    )


def _read_infill(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    """llama-server's ``/infill``: code completion (the backend lays out the prompt)."""
    request, generation = decode_infill_request(body, options.limits)
    model = options.model_name(request.model)
    return ParsedRequest(
        stream=request.stream,
        generations=(generation,),
        model=model,
        dialect=InfillDialect(model, request),
        priority=request.priority,
    )


def _count_messages(body: bytes, options: ReadOptions) -> tuple[str | None, Conversation]:
    """``/v1/messages/count_tokens``: the model it names, the conversation it counts."""
    request = decode_count_tokens_request(body)
    return request.model, messages_conversation(
        request, keep_billing_header=options.keep_billing_header, limits=options.limits
    )


def _count_responses(body: bytes, options: ReadOptions) -> tuple[str | None, Conversation]:
    """``/v1/responses/input_tokens``: the model it names, the conversation it counts."""
    request = decode_input_tokens_request(body)
    return request.model, responses_conversation(request, limits=options.limits, stored=options.stored)


#: every other route of the OpenAI API (models, embeddings, tokenize, errors): its error body
OPENAI = DialectSpec(kind="openai", error_body=openai_error_body)
COMPLETIONS = DialectSpec(
    kind="text",
    error_body=openai_error_body,
    read=_read_completions,
    # (fill in the middle: what the backend calls the text before the cursor)
    param_names=MappingProxyType({"input_prefix": "suffix"}),
)
CHAT = DialectSpec(kind="chat", error_body=openai_error_body, read=_read_chat)


def read_transcription(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    """``/v1/audio/transcriptions`` (docs/audio.md): the chat its form became, answered as
    a transcript."""
    response_format, chat = read_transcription_body(body)
    parsed = _read_chat(chat, chat_format, options)
    return ParsedRequest(
        stream=parsed.stream,
        generations=parsed.generations,
        model=parsed.model,
        dialect=TranscriptionDialect(response_format),
        priority=parsed.priority,
    )


#: ``/v1/audio/transcriptions`` (docs/audio.md): a chat, answered as a transcript
TRANSCRIPTION = DialectSpec(
    kind="transcription", error_body=openai_error_body, read=read_transcription, resumable=False
)
MESSAGES = DialectSpec(
    kind="messages", error_body=anthropic_error, read=_read_messages, count=_count_messages
)
RESPONSES = DialectSpec(
    kind="responses",
    error_body=openai_error_body,
    read=_read_responses,
    param_names=MappingProxyType({"max_tokens": "max_output_tokens"}),
    count=_count_responses,
    peek_stored=peek_stored,
)

#: llama-server's code completion (its /completion-shaped answer; OpenAI's error body)
INFILL = DialectSpec(kind="infill", error_body=openai_error_body, read=_read_infill)

#: the generation routes, each its dialect's spec
SPECS: dict[str, DialectSpec] = {
    "/v1/completions": COMPLETIONS,
    "/v1/chat/completions": CHAT,
    "/v1/messages": MESSAGES,
    "/v1/responses": RESPONSES,
    "/infill": INFILL,
    "/api/chat": OLLAMA_CHAT,
    "/api/generate": OLLAMA_GENERATE,
    "/v1/audio/transcriptions": TRANSCRIPTION,
}


def spec_for_path(path: str) -> DialectSpec:
    """The dialect that answers ``path``'s errors: Anthropic's for ``/v1/messages`` and
    below (``count_tokens``, a 404 under it), Ollama's under ``/api/``, OpenAI's
    everywhere else."""
    if path.startswith("/api/"):
        return OLLAMA
    return MESSAGES if path.startswith("/v1/messages") else OPENAI
