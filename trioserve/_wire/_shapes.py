"""The answers' shapes, as types: what each route's successful body holds, for the
OpenAPI document (``GET /openapi.json``, :mod:`trioserve._http._openapi`) — its schemas are
generated from these with ``msgspec.json.schema_components``, next to the request structs
the decoders use. The writers build their bodies as dicts, for speed; these types say
what those dicts hold (the fields always sent are required, the rest optional, and an
unknown field is allowed: extensions such as ``trioserve`` may be added), and the
schemathesis run against a live server (``tests/e2e/test_openapi_fuzz.py``) checks every
answer it gets against them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "AnthropicError",
    "AnthropicMessage",
    "ChatCompletion",
    "CountTokens",
    "Deleted",
    "Detokenized",
    "Embeddings",
    "Health",
    "InfillResult",
    "InputItems",
    "InputTokens",
    "Loads",
    "LoraAdapter",
    "Model",
    "ModelList",
    "OllamaChatResponse",
    "OllamaError",
    "OllamaGenerateResponse",
    "OpenAIError",
    "Props",
    "RequestCancelled",
    "RequestList",
    "RerankList",
    "RerankResult",
    "Response",
    "RouterAction",
    "RouterModelList",
    "TextCompletion",
    "Tokenized",
]

#: any JSON object
Object = dict[str, Any]


class _ListOf[Item](msgspec.Struct, kw_only=True):
    """A list object (``"object": "list"``), its items in ``data``."""

    object: Literal["list"]
    data: list[Item]


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct, kw_only=True):
    """The error body of every route but Anthropic's (``docs/api.md``, "Errors")."""

    error: ErrorDetail


class AnthropicErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicError(msgspec.Struct, kw_only=True):
    """The error body of ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaError(msgspec.Struct, kw_only=True):
    """Ollama's error body (its routes under ``/api/``)."""

    error: str


class _OllamaDone(msgspec.Struct, kw_only=True):
    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[Object] | None = None
    trioserve: Object | None = None


class OllamaChatResponse(_OllamaDone, kw_only=True):
    """``POST /api/chat`` (not streamed; streamed, each NDJSON line is one)."""

    message: Object


class OllamaGenerateResponse(_OllamaDone, kw_only=True):
    """``POST /api/generate`` (not streamed; streamed, each NDJSON line is one)."""

    response: str
    thinking: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Object | None = None


class TextChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: Object | None
    finish_reason: str | None


class TextCompletion(msgspec.Struct, kw_only=True):
    """``POST /v1/completions`` (not streamed)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    trioserve: Object | None = None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[Object] | None = None
    reasoning_content: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: Object | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """``POST /v1/chat/completions`` (not streamed)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    trioserve: Object | None = None


class AnthropicUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class AnthropicMessage(msgspec.Struct, kw_only=True):
    """``POST /v1/messages`` (not streamed)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[Object]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage
    trioserve: Object | None = None


class Response(msgspec.Struct, kw_only=True):
    """A Responses object: ``POST /v1/responses`` (not streamed), a stored one read back
    or cancelled."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[Object]
    error: Object | None = None
    incomplete_details: Object | None = None
    usage: Object | None = None
    background: bool | None = None
    trioserve: Object | None = None


class InfillResult(msgspec.Struct, kw_only=True):
    """``POST /infill`` (not streamed): llama-server's answer (``response_fields`` may
    pick some of its fields only)."""

    content: str | None = None
    model: str | None = None
    stop: bool | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    trioserve: Object | None = None


class Embedding(msgspec.Struct, kw_only=True):
    object: Literal["embedding"]
    index: int
    #: floats, or their little-endian float32 bytes in base64 (``encoding_format``)
    embedding: list[float] | str


class Embeddings(_ListOf[Embedding], kw_only=True):
    """``POST /v1/embeddings``."""

    model: str
    usage: Object


class RerankResult(msgspec.Struct, kw_only=True):
    index: int
    relevance_score: float
    document: Object | None = None


class RerankList(msgspec.Struct, kw_only=True):
    """``POST /v1/rerank`` and its aliases (Cohere's and Jina's shape)."""

    id: str
    object: Literal["list"]
    model: str
    results: list[RerankResult]
    usage: Object
    meta: Object | None = None
    trioserve: Object | None = None


class TeiRerankResult(msgspec.Struct, kw_only=True):
    """One of ``POST /rerank``'s answers in Hugging Face TEI's shape (a body with
    ``texts``)."""

    index: int
    score: float
    text: str | None = None


class TokenPiece(msgspec.Struct, kw_only=True):
    id: int
    #: the piece's text, or its bytes where they are not UTF-8 on their own
    piece: str | list[int]


class Tokenized(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: ids, or ids with their pieces (``with_pieces``)."""

    tokens: list[int | TokenPiece]


class Detokenized(msgspec.Struct, kw_only=True):
    """``POST /detokenize``."""

    content: str


class CountTokens(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``."""

    input_tokens: int


class InputTokens(msgspec.Struct, kw_only=True):
    """``POST /v1/responses/input_tokens``."""

    object: Literal["response.input_tokens"]
    input_tokens: int


class Model(msgspec.Struct, kw_only=True):
    """A model as ``GET /v1/models`` lists it and ``GET /v1/models/{id}`` answers it."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    #: the context per sequence (tokens); ``max_model_len``: the same, vLLM's name
    context_length: int | None = None
    max_model_len: int | None = None
    status: Object | None = None
    capabilities: Object | None = None
    input_modalities: list[str] | None = None
    #: a LoRA adapter's base model (vLLM's fields: docs/lora.md)
    parent: str | None = None
    root: str | None = None
    #: an activated LoRA's invocation (llama-server's ``/lora-adapters`` keys)
    alora_invocation_string: str | None = None
    alora_invocation_tokens: list[int] | None = None


class ModelList(_ListOf[Model], kw_only=True):
    pass


class RouterModel(msgspec.Struct, kw_only=True):
    id: str
    aliases: list[str]
    path: str
    in_cache: bool
    pinned: bool
    status: Object


class RouterModelList(_ListOf[RouterModel], kw_only=True):
    """``GET /models``: llama-server's router list."""


class RouterAction(msgspec.Struct, kw_only=True):
    """``POST /models/load`` and ``POST /models/unload``."""

    success: bool
    model: str
    status: Object


class Props(msgspec.Struct, kw_only=True):
    """``GET /props`` (llama-server's shape): ``default_generation_settings.n_ctx`` is
    the context per sequence."""

    default_generation_settings: Object
    total_slots: int | None = None
    model_alias: str
    model_path: str | None = None
    modalities: Object
    chat_template: str
    bos_token: str
    eos_token: str
    build_info: str
    is_sleeping: bool


class LoraAdapter(msgspec.Struct, kw_only=True):
    """One entry of ``GET /lora-adapters`` (llama-server's shape, with the name)."""

    id: int
    name: str
    path: str | None = None
    scale: float
    #: an activated LoRA's invocation: its tokens' pieces and ids (llama-server's)
    alora_invocation_string: str | None = None
    alora_invocation_tokens: list[int] | None = None


class Health(msgspec.Struct, kw_only=True):
    """``GET /health``: ``status`` always; the rest where the caller may see it (with
    API keys, a request without a valid one gets the status alone)."""

    status: str
    error: str | None = None
    models: dict[str, Object] | None = None
    model: str | None = None
    requests_in_flight: int | None = None


class StreamLookup(msgspec.Struct, kw_only=True):
    """``POST /v1/streams/lookup``'s body (llama-server's)."""

    conversation_ids: Annotated[list[str], msgspec.Meta(max_length=256)] = []


class StreamStatus(msgspec.Struct, kw_only=True):
    """One stream in ``POST /v1/streams/lookup``'s answer."""

    conversation_id: str
    is_done: bool
    total_bytes: int
    started_at: int
    completed_at: int


class LlamaErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    #: (absent from a lookup's unreadable body, as in llama-server)
    code: int | None = None


class LlamaError(msgspec.Struct, kw_only=True):
    """llama-server's error body (its stream routes)."""

    error: LlamaErrorBody


class Loads(msgspec.Struct, kw_only=True):
    """``GET /loads``: a gateway's load poll (sglang's schema)."""

    timestamp: str
    dp_rank_count: int
    loads: list[Object]


class NotServing(msgspec.Struct, kw_only=True):
    """``GET /loads`` while the server is not serving (503)."""

    error: str


class RequestInFlight(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["request"]
    model: str | None
    endpoint: str
    phase: str
    paused: str | None
    #: a resumable stream's job: its id and the readers attached now (else null)
    conversation_id: str | None
    readers: int | None
    priority: int | None
    key: str | None
    session: str | None
    created: int
    elapsed_ms: float
    prompt_tokens: int | None
    completion_tokens: int


class RequestList(_ListOf[RequestInFlight], kw_only=True):
    """``GET /v1/requests``: the caller's requests in flight."""


class RequestCancelled(msgspec.Struct, kw_only=True):
    """``POST /v1/requests/{id}/cancel`` and ``DELETE /v1/requests/{id}``."""

    id: str
    object: Literal["request"]
    #: whose request it was: its API key's name (the keys file's; ``default`` for a key
    #: without an entry), ``None`` for a request no key sent
    key: str | None
    cancelled: bool
    phase: str
    model: str | None
    end_cause: str | None
    done: bool


class Deleted(msgspec.Struct, kw_only=True):
    """``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"]
    deleted: bool


class InputItems(_ListOf[Object], kw_only=True):
    """``GET /v1/responses/{id}/input_items``."""

    first_id: str | None
    last_id: str | None
    has_more: bool


class Transcription(msgspec.Struct, kw_only=True):
    """``POST /v1/audio/transcriptions`` with ``response_format`` ``json`` (OpenAI's
    shape; ``text``: the text alone; streamed: ``transcript.text.*`` events)."""

    text: str
    usage: Object
