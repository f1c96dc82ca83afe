"""Ollama's generation routes, inbound: ``/api/chat`` and ``/api/generate`` bodies to
the engine's :class:`~trioserve._core._types.GenerationRequest` and the
:class:`~trioserve._wire._ollama_writer.OllamaDialect` that answers, and their specs (an
NDJSON stream, Ollama's error body and names, ``keep_alive`` read before the lease).
The same chat, rendered by the same template, as a chat completion (docs/dialects.md,
"Ollama")."""

from __future__ import annotations

import dataclasses

from .._core._types import GenerationRequest
from ._chat import ChatFormat, ChatPrompt
from ._conversation import armed_generation
from ._media import MediaCollector
from ._messages import ChatMessage
from ._ollama import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    chat_conversation,
    decode_ollama_chat,
    decode_ollama_generate,
    generate_conversation,
    logprobs_of,
    raw_generation,
    resolve_ollama_model,
)
from ._ollama_options import check_num_ctx, peek_keep_alive
from ._ollama_writer import NDJSON, OllamaDialect, ollama_error
from ._spec import DialectSpec, ParsedRequest, ReadOptions, conversation_request
from ._truncation import Truncation

__all__ = ["OLLAMA", "OLLAMA_CHAT", "OLLAMA_GENERATE"]


def _ollama_load(
    request: OllamaChatRequest | OllamaGenerateRequest, kind: str, model: str, options: ReadOptions
) -> ParsedRequest:
    """An Ollama request with nothing to generate: it loads the model (``done_reason:
    "load"``; ``"unload"`` with ``keep_alive: 0``)."""
    dialect = OllamaDialect(
        "chat" if kind == "chat" else "generate",
        request.model or model,
        arrived=options.arrived,
        load_seconds=options.load_seconds,
        unloads=options.keep_alive == 0,
    )
    return ParsedRequest(stream=request.stream, generations=(), model=model, dialect=dialect)


def _read_ollama_chat(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    """Ollama's ``/api/chat``."""
    request = decode_ollama_chat(body)
    model = resolve_ollama_model(request.model, options.model_name)
    check_num_ctx(request.options, options.context_length)
    if not request.messages:
        return _ollama_load(request, "chat", model, options)
    limits = options.limits
    media = MediaCollector(limits)
    conversation = chat_conversation(request, limits, chat_format.reasoning is not None, media)
    logprobs = logprobs_of(request)

    def build(messages: list[ChatMessage]) -> tuple[GenerationRequest, ChatPrompt]:
        shorter = dataclasses.replace(conversation, messages=messages)
        generation, rendered = armed_generation(shorter, chat_format, None)
        return dataclasses.replace(generation, logprobs=logprobs), rendered

    generation, rendered = build(conversation.messages)
    dialect = OllamaDialect(
        "chat",
        request.model or model,
        tool_mode=conversation.tool_mode,
        tool_names=conversation.tool_names,
        reasoning=rendered.reasoning,
        inside=rendered.opens_reasoning,
        logprobs=request.logprobs,
        arrived=options.arrived,
        load_seconds=options.load_seconds,
    )
    # (Ollama's own behaviour for a conversation too long: its oldest turns go)
    truncation = Truncation(
        request.truncation or "auto",
        conversation.messages,
        lambda messages: build(messages)[0],
        note=dialect.note_truncation,
    )
    return conversation_request(
        request.stream,
        generation,
        model,
        dialect,
        conversation,
        rendered,
        priority=request.priority,
        truncation=truncation,
    )


def _read_ollama_generate(body: bytes, chat_format: ChatFormat, options: ReadOptions) -> ParsedRequest:
    """Ollama's ``/api/generate``: a templated prompt, a raw one, or fill in the middle."""
    request = decode_ollama_generate(body)
    model = resolve_ollama_model(request.model, options.model_name)
    check_num_ctx(request.options, options.context_length)
    if not (request.prompt or request.suffix or request.images or request.system):
        return _ollama_load(request, "generate", model, options)
    limits = options.limits
    reasoning: tuple[str, str] | None = None
    inside = False
    if request.raw or request.suffix:
        generation = raw_generation(request, limits)
    else:
        media = MediaCollector(limits)
        conversation = generate_conversation(request, limits, chat_format.reasoning is not None, media)
        generation, rendered = armed_generation(conversation, chat_format, None)
        reasoning, inside = rendered.reasoning, rendered.opens_reasoning
        generation = dataclasses.replace(generation, logprobs=logprobs_of(request))
    dialect = OllamaDialect(
        "generate",
        request.model or model,
        reasoning=reasoning,
        inside=inside,
        logprobs=request.logprobs,
        arrived=options.arrived,
        load_seconds=options.load_seconds,
    )
    return ParsedRequest(
        stream=request.stream,
        generations=(generation,),
        model=model,
        dialect=dialect,
        priority=request.priority,
        reasoning=reasoning,
        inside=inside,
    )


#: Ollama's generation routes (NDJSON streams, Ollama's error body and names, keep_alive)
OLLAMA_CHAT = DialectSpec(
    kind="ollama_chat",
    error_body=ollama_error,
    read=_read_ollama_chat,
    media_type=NDJSON,
    resumable=False,
    resolve_model=resolve_ollama_model,
    peek_keep_alive=peek_keep_alive,
)
OLLAMA_GENERATE = dataclasses.replace(OLLAMA_CHAT, kind="ollama_generate", read=_read_ollama_generate)
#: every other route under /api/ (the model routes, an unknown path): Ollama's error body
OLLAMA = DialectSpec(kind="ollama", error_body=ollama_error)
