"""What the API's document says of each route: :data:`OPERATIONS`, one
:class:`Operation` per route and method — the struct its body is decoded with, the type
of its answer (:mod:`trioserve._wire._shapes`), its statuses, whether it streams, its
query and header parameters. :func:`~trioserve._http._openapi.openapi_document` turns
it into the OpenAPI document and checks it against the app's routes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._wire import _ollama_models as ollama
from .._wire import _shapes as shapes
from .._wire._anthropic import CountTokensRequest, MessagesRequest
from .._wire._control import ChatControlRequest, ControlAnswer, RequestControlRequest
from .._wire._embeddings import EmbeddingsRequest
from .._wire._infill import InfillRequest
from .._wire._lora import LoadLoraRequest, LoraScale, LoraScalesSet, UnloadLoraRequest
from .._wire._models import RouterModelRequest
from .._wire._ollama import OllamaChatRequest, OllamaGenerateRequest
from .._wire._openai import ChatCompletionRequest, CompletionRequest
from .._wire._rerank import RerankRequest
from .._wire._responses import InputTokensRequest, ResponsesRequest
from .._wire._speech import SpeechRequest
from .._wire._tokenize import DetokenizeRequest, TokenizeRequest

__all__ = ["JSON", "NDJSON", "OPERATIONS", "SSE", "TEXT", "Operation", "Param"]


JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


@dataclass(frozen=True, slots=True)
class Param:
    """A query or header parameter (a path's parameters come from its template)."""

    name: str
    where: str  # "query" | "header"
    schema: Mapping[str, Any]
    description: str


@dataclass(frozen=True, slots=True)
class Operation:
    """One route and method, as the document describes it."""

    summary: str
    tag: str
    #: the body's struct (the one its decoder reads); ``None``: no body
    body: object | None = None
    #: the successful answer's type (``None``: not JSON, see ``media``)
    answer: object | None = None
    #: the successful answer's status and media type
    status: int = 200
    media: str = JSON
    #: ``True``: with ``"stream": true`` the answer is a stream, of ``stream_media``
    stream: bool = False
    #: ``True``: unless ``"stream": false`` the answer is NDJSON lines (Ollama's)
    ndjson: bool = False
    stream_media: str = SSE
    #: the error statuses it may answer with (with the error body)
    errors: tuple[int, ...] = ()
    #: error statuses whose body is another shape: each one's types (several: any of
    #: them), in place of the error body
    error_answers: tuple[tuple[int, tuple[object, ...]], ...] = ()
    #: ``True``: its errors are in Anthropic's shape
    anthropic: bool = False
    #: ``True``: its errors are in Ollama's shape (``{"error": "…"}``)
    ollama: bool = False
    params: tuple[Param, ...] = ()
    #: the operations that take an id its answer holds: (method, path, path parameter)
    #: for its ``id`` (OpenAPI links: schemathesis's stateful phase follows them)
    links: tuple[tuple[str, str, str], ...] = ()


# -- the parameters ---------------------------------------------------------------------

_ID = {"type": "string"}
_HEADERS = (
    Param(
        "X-Request-Id", "header", _ID, "the request's id (1-128 of [A-Za-z0-9._:-]); one is made if absent"
    ),
    Param("X-Session-Id", "header", _ID, "a session: a new request of it supersedes the one in flight"),
    Param("X-Request-Timeout", "header", _ID, "seconds the whole request may take (queueing included)"),
    Param("X-Keep-Alive", "header", _ID, "how long the model stays loaded after it (an admin's, with keys)"),
)
_RETRIEVAL_HEADERS = (_HEADERS[0], _HEADERS[2])
_INCLUDE = Param("include", "query", {"type": "array", "items": {"type": "string"}}, "fields to include")
_STORED_QUERY = (
    Param(
        "stream",
        "query",
        {"type": "string"},
        "true: the events of a background + stream response, live until its end (server-sent events)",
    ),
    Param(
        "starting_after",
        "query",
        {"type": "integer", "minimum": 0},
        "with stream: the events whose sequence_number is greater",
    ),
    Param("include_obfuscation", "query", {"type": "string"}, "accepted: nothing is obfuscated"),
    Param("Last-Event-ID", "header", _ID, "with stream: the events after this one (wins)"),
    _INCLUDE,
)
_CONVERSATION = Param("conv_id", "query", _ID, "the stream's X-Conversation-Id")
_STREAM_QUERY = (
    _CONVERSATION,
    Param("from", "query", {"type": "integer", "minimum": 0}, "the byte offset of its body to read from (0)"),
    Param("Last-Event-ID", "header", _ID, "read the events after this one (wins over from)"),
)
_ITEMS_QUERY = (
    Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100}, "items per page (20)"),
    Param("order", "query", {"enum": ["asc", "desc"]}, "the items' order (desc)"),
    Param("after", "query", {"type": "string"}, "the item id the page starts after"),
    _INCLUDE,
)
_MODEL_QUERY = (Param("model", "query", {"type": "string"}, "the model (default: the default one)"),)

# -- the statuses -----------------------------------------------------------------------

#: a body read by quart: too large, too slow, not JSON; a model by name; the server
#: loading or shutting down
_BODY = (400, 404, 408, 413, 415, 503)
#: a request that runs on a model: the above, a full queue or a rate limit, an id in
#: flight, headers too large, a deadline, a backend that cannot (501)
_RUN = (*_BODY, 409, 429, 431, 501, 504)
_STORED = (400, 404, 503)


def _generation(
    summary: str, tag: str, body: object, answer: object, *, errors: tuple[int, ...] = _RUN, **more: Any
) -> Operation:
    """A route that runs a model and may stream its answer (``"stream": true``): a
    request's statuses (:data:`_RUN`) and its headers."""
    return Operation(summary, tag, body, answer, stream=True, errors=errors, params=_HEADERS, **more)


OPERATIONS: dict[tuple[str, str], Operation] = {
    # generation: one route per dialect
    ("POST", "/v1/completions"): _generation(
        "Complete a prompt (OpenAI)", "openai", CompletionRequest, shapes.TextCompletion
    ),
    ("POST", "/v1/chat/completions"): _generation(
        "Chat (OpenAI)", "openai", ChatCompletionRequest, shapes.ChatCompletion
    ),
    ("POST", "/v1/messages"): _generation(
        "Chat (Anthropic Messages)", "anthropic", MessagesRequest, shapes.AnthropicMessage,
        errors=(*_RUN, 529), anthropic=True,
    ),
    ("POST", "/v1/responses"): _generation(
        "Chat (OpenAI Responses)", "responses", ResponsesRequest, shapes.Response,
        links=tuple(
            (method, path, "response_id")
            for method, path in (
                ("GET", "/v1/responses/{response_id}"),
                ("GET", "/v1/responses/{response_id}/input_items"),
                ("POST", "/v1/responses/{response_id}/cancel"),
                ("DELETE", "/v1/responses/{response_id}"),
            )
        ),
    ),
    ("POST", "/api/chat"): _generation(
        "Chat (Ollama; NDJSON streamed by default)", "ollama", OllamaChatRequest, shapes.OllamaChatResponse,
        stream_media=NDJSON, ollama=True,
    ),
    ("POST", "/api/generate"): _generation(
        "Generate (Ollama; NDJSON streamed by default)", "ollama", OllamaGenerateRequest,
        shapes.OllamaGenerateResponse, stream_media=NDJSON, ollama=True,
    ),
    ("POST", "/infill"): _generation(
        "Fill in the middle (llama-server)", "llama-server", InfillRequest, shapes.InfillResult
    ),
    # retrieval
    # audio (docs/audio.md): a multipart form (file, model, prompt, language, temperature,
    # response_format, stream), not JSON
    ("POST", "/v1/audio/transcriptions"): _generation(
        "Transcribe audio (OpenAI; multipart/form-data)", "openai", None, shapes.Transcription
    ),
    ("POST", "/v1/audio/speech"): Operation(
        "Speak a text (OpenAI; WAV or PCM chunked as made, or speech.audio.delta events with "
        "stream_format sse; 400 speech_not_supported on a server started without --tts-model)",
        "openai", SpeechRequest, media="audio/wav", stream=True, errors=_RUN, params=_RETRIEVAL_HEADERS,
    ),
    ("POST", "/v1/embeddings"): Operation(
        "Embed texts (OpenAI)", "retrieval", EmbeddingsRequest, shapes.Embeddings,
        errors=_RUN, params=_RETRIEVAL_HEADERS,
    ),
    **{
        ("POST", path): Operation(
            f"Rerank documents ({who})", "retrieval", RerankRequest,
            shapes.RerankList | list[shapes.TeiRerankResult] if path == "/rerank" else shapes.RerankList,
            errors=_RUN, params=_RETRIEVAL_HEADERS,
        )
        for path, who in (
            ("/v1/rerank", "Cohere, Jina"),
            ("/rerank", "llama-server; TEI's shape for a body with texts"),
            ("/v1/reranking", "llama-server"),
            ("/reranking", "llama-server"),
            ("/v2/rerank", "Cohere v2"),
        )
    },
    # token counting and tokenizing
    ("POST", "/v1/messages/count_tokens"): Operation(
        "Count a Messages request's tokens (Anthropic)", "anthropic", CountTokensRequest,
        shapes.CountTokens, errors=_RUN, anthropic=True,
    ),
    ("POST", "/v1/responses/input_tokens"): Operation(
        "Count a Responses request's tokens", "responses", InputTokensRequest, shapes.InputTokens,
        errors=_RUN,
    ),
    ("POST", "/tokenize"): Operation(
        "Tokenize a text (llama-server)", "llama-server", TokenizeRequest, shapes.Tokenized, errors=_RUN
    ),
    ("POST", "/detokenize"): Operation(
        "Detokenize ids (llama-server)", "llama-server", DetokenizeRequest, shapes.Detokenized, errors=_RUN
    ),
    # models
    ("GET", "/v1/models"): Operation("List the models", "models", answer=shapes.ModelList, errors=(503,)),
    ("GET", "/v1/models/{model_id}"): Operation(
        "One model", "models", answer=shapes.Model, errors=(400, 404, 503)
    ),
    ("GET", "/props"): Operation(
        "The model's properties (llama-server's shape: its context, slots, chat template)",
        "models", answer=shapes.Props, errors=(404, 503), params=_MODEL_QUERY,
    ),
    ("GET", "/lora-adapters"): Operation(
        "The model's LoRA adapters (llama-server's shape: id, path, scale; and the name)",
        "models", answer=list[shapes.LoraAdapter], errors=(404, 503), params=_MODEL_QUERY,
    ),
    ("POST", "/lora-adapters"): Operation(
        "Set each LoRA adapter's default scale by id (llama-server's; an admin's, with keys)",
        "models", list[LoraScale], LoraScalesSet, errors=(*_BODY, 501), params=_MODEL_QUERY,
    ),
    ("POST", "/v1/load_lora_adapter"): Operation(
        "Load a LoRA adapter from a path on the server (vLLM's; an admin's, with keys)",
        "models", LoadLoraRequest, media=TEXT, errors=(*_BODY, 501),
    ),
    ("POST", "/v1/unload_lora_adapter"): Operation(
        "Unload a LoRA adapter; streams using it finish (vLLM's; an admin's, with keys)",
        "models", UnloadLoraRequest, media=TEXT, errors=(*_BODY, 501),
    ),
    ("GET", "/models"): Operation(
        "List the models (llama-server's router)", "models", answer=shapes.RouterModelList, errors=(503,)
    ),
    ("POST", "/models/load"): Operation(
        "Load a model (an admin's, with keys)", "models", RouterModelRequest, shapes.RouterAction,
        errors=(*_BODY, 409, 429),
    ),
    ("POST", "/models/unload"): Operation(
        "Unload a model (an admin's, with keys)", "models", RouterModelRequest, shapes.RouterAction,
        errors=(*_BODY, 409),
    ),
    # stored responses
    ("GET", "/v1/responses/{response_id}"): Operation(
        "Read a stored response, or resume its stream", "responses", answer=shapes.Response, stream=True,
        errors=_STORED, params=_STORED_QUERY,
    ),
    ("DELETE", "/v1/responses/{response_id}"): Operation(
        "Delete a stored response", "responses", answer=shapes.Deleted, errors=_STORED
    ),
    ("GET", "/v1/responses/{response_id}/input_items"): Operation(
        "A stored response's input items", "responses", answer=shapes.InputItems, errors=_STORED,
        params=_ITEMS_QUERY,
    ),
    ("POST", "/v1/responses/{response_id}/cancel"): Operation(
        "Cancel a background response", "responses", answer=shapes.Response, errors=_STORED
    ),
    # requests by id
    ("GET", "/v1/requests"): Operation(
        "The caller's requests in flight", "requests", answer=shapes.RequestList
    ),
    ("POST", "/v1/requests/{request_id}/cancel"): Operation(
        "Cancel a request in flight", "requests", answer=shapes.RequestCancelled, errors=(404,)
    ),
    ("DELETE", "/v1/requests/{request_id}"): Operation(
        "Cancel a request in flight", "requests", answer=shapes.RequestCancelled, errors=(404,)
    ),
    # resumable streams (llama-server's routes; docs/resumable-streams.md)
    ("GET", "/v1/stream"): Operation(
        "Resume a detachable stream from an offset (llama-server)", "llama-server",
        media="text/event-stream; charset=utf-8", errors=(400, 404), params=_STREAM_QUERY,
        error_answers=((400, (shapes.LlamaError,)), (404, (shapes.LlamaError,))),
    ),
    ("DELETE", "/v1/stream"): Operation(
        "Stop a detachable stream (llama-server)", "llama-server", status=204, media="",
        errors=(400,), params=(_CONVERSATION,), error_answers=((400, (shapes.LlamaError,)),),
    ),
    ("POST", "/v1/streams/lookup"): Operation(
        "Which of these detachable streams are live (llama-server)", "llama-server", shapes.StreamLookup,
        list[shapes.StreamStatus], errors=(400,), error_answers=((400, (shapes.LlamaError,)),),
    ),
    ("POST", "/v1/requests/{request_id}/control"): Operation(
        "End a running request's reasoning", "requests", RequestControlRequest, ControlAnswer, errors=_BODY
    ),
    ("POST", "/v1/chat/completions/control"): Operation(
        "End a running completion's reasoning (llama-server's)", "requests", ChatControlRequest,
        ControlAnswer, errors=_BODY,
    ),
    # operations
    # (503: /health says why in its own shape; /loads says "not serving", or a model
    # named while the unnamed one loads gets the error body)
    ("GET", "/health"): Operation(
        "The server's health", "operations", answer=shapes.Health, errors=(503,),
        error_answers=((503, (shapes.Health,)),),
    ),
    **{
        ("GET", path): Operation(
            "Load figures for a gateway (sglang's schema)", "operations", answer=shapes.Loads,
            errors=(400, 404, 503), params=_MODEL_QUERY,
            error_answers=((503, (shapes.NotServing, shapes.OpenAIError)),),
        )
        for path in ("/loads", "/v1/loads")
    },
    ("GET", "/metrics"): Operation(
        "Prometheus metrics", "operations", media="text/plain; version=1.0.0; charset=utf-8"
    ),
    ("GET", "/"): Operation("The chat page", "operations", media="text/html; charset=utf-8"),
    ("GET", "/openapi.json"): Operation("This document", "operations", answer=dict[str, Any]),
    # Ollama's model routes (docs/models.md, "Ollama's model routes")
    ("GET", "/api/version"): Operation(
        "The Ollama API version served (Ollama)", "ollama", answer=ollama.OllamaVersion, ollama=True
    ),
    ("GET", "/api/tags"): Operation(
        "List the models (Ollama)", "ollama", answer=ollama.OllamaTags, errors=(503,), ollama=True
    ),
    ("POST", "/api/show"): Operation(
        "One model's details, metadata, template and capabilities (Ollama)", "ollama",
        ollama.ShowRequest, ollama.OllamaShow, errors=_BODY, ollama=True,
    ),
    ("GET", "/api/ps"): Operation(
        "The loaded models (Ollama)", "ollama", answer=ollama.OllamaPs, errors=(503,), ollama=True
    ),
    ("POST", "/api/copy"): Operation(
        "Another name for a model (Ollama; an admin's, with keys)", "ollama", ollama.CopyRequest,
        ollama.OllamaStatus, errors=_BODY, ollama=True,
    ),
    ("DELETE", "/api/delete"): Operation(
        "Take a model's name away (Ollama; an admin's, with keys)", "ollama", ollama.DeleteRequest,
        ollama.OllamaStatus, errors=_BODY, ollama=True,
    ),
    ("POST", "/api/create"): Operation(
        "Add a model from a GGUF on the server or an uploaded blob (Ollama; an admin's, with keys)",
        "ollama", ollama.CreateRequest, ollama.OllamaStatus, ndjson=True, errors=(*_BODY, 501), ollama=True,
    ),
    **{
        ("POST", path): Operation(
            f"{what} (Ollama: no registry is reachable: 501 says how to add a model)", "ollama",
            ollama.PullRequest, ollama.OllamaStatus, ndjson=True, errors=(*_BODY, 501), ollama=True,
        )
        for path, what in (("/api/pull", "Pull a model"), ("/api/push", "Push a model"))
    },
    ("POST", "/api/blobs/{digest}"): Operation(
        "Upload a blob for /api/create (Ollama; an admin's, with keys; HEAD: whether it is here)",
        "ollama", answer=dict[str, Any], status=201, errors=(400, 405, 408, 413, 501), ollama=True,
    ),
    ("POST", "/api/embed"): Operation(
        "Embed texts (Ollama)", "ollama", ollama.EmbedRequest, ollama.OllamaEmbed, errors=_RUN,
        params=_RETRIEVAL_HEADERS, ollama=True,
    ),
    ("POST", "/api/embeddings"): Operation(
        "Embed a text (Ollama's legacy route)", "ollama", ollama.EmbeddingsRequest, ollama.OllamaEmbedding,
        errors=_RUN, params=_RETRIEVAL_HEADERS, ollama=True,
    ),
}  # fmt: skip
