"""Ollama's model API, sans-IO (docs/models.md, "Ollama's model routes"; the fields:
docs/api.md): the request bodies of ``/api/show``, ``/api/copy``, ``/api/delete``,
``/api/create``, ``/api/pull``, ``/api/push``, ``/api/embed`` and ``/api/embeddings``,
what is refused in them by name, the error body (``{"error": "…"}``), and the shapes of
the answers (for the OpenAPI document)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import msgspec

from .._core._exceptions import InvalidRequestError, TrioserveError
from ._codec import decode as _decode
from ._gguf import GGUFHeader, format_parameters, quantization_name

__all__ = [
    "OLLAMA_VERSION",
    "CopyRequest",
    "CreateRequest",
    "DeleteRequest",
    "EmbedRequest",
    "EmbeddingsRequest",
    "PullRequest",
    "ShowRequest",
    "check_model_name",
    "create_settings",
    "decode_ollama",
    "embed_inputs",
    "file_details",
    "model_info",
    "ollama_error_body",
    "ollama_time",
]

#: the Ollama API release whose routes and fields are served (``GET /api/version``):
#: numeric, as clients compare it (VS Code Copilot Chat refuses a server below 0.6.4,
#: and any version it cannot read as numbers)
OLLAMA_VERSION = "0.12.0"

#: ``[host/][namespace/]model[:tag]``, as Ollama's names are made
_NAME = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*){0,2}(?::[A-Za-z0-9_][A-Za-z0-9._-]*)?$"
)
_MAX_NAME = 256


def check_model_name(name: str, param: str) -> None:
    """400 naming ``param`` unless ``name`` is a model name Ollama would accept."""
    if len(name) > _MAX_NAME or not _NAME.match(name):
        raise InvalidRequestError(
            f"{param}: {name!r} is not a valid model name ([namespace/]model[:tag] of letters, digits, "
            "'.', '_' and '-')",
            param=param,
        )


def ollama_error_body(exc: TrioserveError) -> tuple[int, dict[str, object]]:
    """Ollama's error body: ``{"error": message}``, with the error's own status."""
    return exc.status, {"error": exc.message}


def ollama_time(seconds: float) -> str:
    """A Unix time as Ollama writes it (RFC 3339, with the offset)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat()


# -- the requests ------------------------------------------------------------------------


class ShowRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    #: the name's old field (Ollama reads either)
    name: str | None = None
    verbose: bool | None = None


class CopyRequest(msgspec.Struct, kw_only=True):
    source: str
    destination: str


class DeleteRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None


class PullRequest(msgspec.Struct, kw_only=True):
    """``/api/pull`` and ``/api/push``: answered with how to add a model (no registry)."""

    model: str | None = None
    name: str | None = None
    insecure: bool | None = None
    stream: bool | None = None


class CreateRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None
    #: a GGUF file's path on the server, or a served model's name
    from_: str | None = msgspec.field(default=None, name="from")
    #: file name → ``sha256:<hex>`` of a blob uploaded with ``POST /api/blobs/:digest``
    files: dict[str, str] | None = None
    #: load settings: ``num_ctx``, ``num_batch``, ``num_thread`` (others refused)
    parameters: dict[str, Any] | None = None
    license: str | list[str] | None = None
    stream: bool | None = None
    # refused by name (create_settings says why)
    template: str | None = None
    system: str | None = None
    messages: list[Any] | None = None
    adapters: dict[str, str] | None = None
    quantize: str | None = None
    modelfile: str | None = None
    path: str | None = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str] = ""
    truncate: bool | None = None
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """The legacy ``/api/embeddings``: one ``prompt``, one ``embedding``."""

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    truncate: bool | None = None


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind)
    for kind in (
        ShowRequest,
        CopyRequest,
        DeleteRequest,
        PullRequest,
        CreateRequest,
        EmbedRequest,
        EmbeddingsRequest,
    )
}


def decode_ollama[T](kind: type[T], body: bytes) -> T:
    """``body`` as ``kind`` (one of this module's requests); 400 naming the field."""
    decoded: T = _decode(_DECODERS[kind], body)
    return decoded


# -- what a request may set ---------------------------------------------------------------

#: Ollama's load options that a created model keeps, and the preset key each becomes
_LOAD_PARAMETERS = {"num_ctx": "ctx_size", "num_batch": "batch_size", "num_thread": "threads"}
#: options that only change how text is sampled: they do not change an embedding
_SAMPLING_OPTIONS = frozenset(
    {
        "temperature", "top_k", "top_p", "min_p", "typical_p", "seed", "stop", "num_predict",
        "num_keep", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
        "penalize_newline", "mirostat", "mirostat_tau", "mirostat_eta", "tfs_z",
    }
)  # fmt: skip


def create_settings(request: CreateRequest) -> dict[str, int]:
    """The new model's preset (load settings) from ``parameters``; each field a created
    model cannot keep is refused by name (400), never dropped."""
    refusals = {
        "template": "an Ollama template is a Go template; trioserve renders the GGUF's own Jinja chat "
        "template (or its architecture's format): serve a GGUF whose tokenizer.chat_template is the one "
        "you want",
        "system": "a created model keeps no system prompt here: send it as the first message of each chat",
        "messages": "a created model keeps no messages here: send them with each chat",
        "adapters": "LoRA adapters are not served",
        "quantize": "models are not quantized here: quantize the GGUF with llama.cpp's llama-quantize",
        "modelfile": "Modelfiles are not read (Ollama's older create): send from or files",
        "path": "Modelfile paths are not read (Ollama's older create): send from or files",
    }
    for field, why in refusals.items():
        if getattr(request, field) not in (None, "", [], {}):
            raise InvalidRequestError(f"{field} is not supported by /api/create here: {why}", param=field)
    settings: dict[str, int] = {}
    for key, value in (request.parameters or {}).items():
        preset = _LOAD_PARAMETERS.get(key)
        if preset is None:
            why = (
                "a created model keeps no sampling defaults here: send it in each request's options"
                if key in _SAMPLING_OPTIONS
                else f"it is not one a created model keeps (those are {', '.join(sorted(_LOAD_PARAMETERS))})"
            )
            raise InvalidRequestError(f"parameters.{key} is not supported: {why}", param=f"parameters.{key}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidRequestError(
                f"parameters.{key} must be a positive integer, got {value!r}", param=f"parameters.{key}"
            )
        settings[preset] = value
    return settings


def embed_inputs(request: EmbedRequest | EmbeddingsRequest) -> list[str]:
    """The texts to embed (an empty ``input`` or ``prompt``: none — the model is only
    loaded, as Ollama does); the request's ``options`` checked: sampling options are
    accepted (they do not change an embedding), a load option is refused by name (the
    model's load settings are the server's: docs/api.md)."""
    for key, value in (request.options or {}).items():
        if value is None or key in _SAMPLING_OPTIONS:
            continue
        raise InvalidRequestError(
            f"options.{key} is not supported on embeddings: the model's load settings (context, batch, "
            "threads) are the server's (--ctx-size, --batch-size, a preset); send the request without it",
            param=f"options.{key}",
        )
    if isinstance(request, EmbeddingsRequest):
        return [request.prompt] if request.prompt else []
    if isinstance(request.input, str):
        return [request.input] if request.input else []
    for i, text in enumerate(request.input):
        if not text:
            raise InvalidRequestError(f"input[{i}] is empty", param="input")
    return list(request.input)


# -- what a model's file says ------------------------------------------------------------


def file_details(header: GGUFHeader | None) -> dict[str, object]:
    """Ollama's ``details`` of a model from its GGUF header (``None``: no file: the
    scripted backend, an upstream relay)."""
    if header is None:
        return {"parent_model": "", "format": "", "family": "", "families": None,
                "parameter_size": "", "quantization_level": ""}  # fmt: skip
    family = header.architecture or ""
    return {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": format_parameters(header.parameters),
        "quantization_level": quantization_name(header.get_int("general.file_type")) or "",
    }


def model_info(header: GGUFHeader, context_length: int | None) -> dict[str, object]:
    """``model_info``: the GGUF's metadata (its long arrays as ``null``, the chat template
    left out: it is ``template``), ``general.parameter_count``, and
    ``<arch>.context_length`` as the context a request gets here (clients size prompts
    by it: Copilot Chat does), the file's own as ``trioserve.training_context_length``."""
    info: dict[str, object] = {k: v for k, v in header.metadata.items() if k != "tokenizer.chat_template"}
    info["general.parameter_count"] = header.parameters
    arch = header.architecture
    if arch is not None:
        key = f"{arch}.context_length"
        trained = header.get_int(key)
        info["trioserve.training_context_length"] = trained
        if context_length is not None:
            info[key] = context_length if trained is None else min(trained, context_length)
    return dict(sorted(info.items()))


# -- the answers' shapes (the OpenAPI document) --------------------------------------------


class OllamaError(msgspec.Struct, kw_only=True):
    """Ollama's error body, on every ``/api/*`` route."""

    error: str


class OllamaVersion(msgspec.Struct, kw_only=True):
    version: str


class OllamaStatus(msgspec.Struct, kw_only=True):
    status: str


class OllamaDetails(msgspec.Struct, kw_only=True):
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str
    parent_model: str = ""


class OllamaListed(msgspec.Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaDetails


class OllamaTags(msgspec.Struct, kw_only=True):
    models: list[OllamaListed]


class OllamaRunning(msgspec.Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: OllamaDetails
    expires_at: str
    size_vram: int
    context_length: int | None


class OllamaPs(msgspec.Struct, kw_only=True):
    models: list[OllamaRunning]


class OllamaShow(msgspec.Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str
    license: str = ""


class OllamaEmbed(msgspec.Struct, kw_only=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbedding(msgspec.Struct, kw_only=True):
    embedding: list[float]
