"""The HTTP surface's limits and defaults: :class:`HTTPSettings`. A module of its own (it
imports nothing of ``_http``), so the exchange can read them without the server state."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .._wire import RequestLimits, TruncationMode
from ._fetch import FetchPolicy

__all__ = ["HTTPSettings", "ModelFileSettings"]


@dataclass(kw_only=True)
class HTTPSettings:
    """Limits and defaults of the HTTP surface.

    Attributes:
        max_body_bytes: request bodies larger than this get 413.
        max_header_bytes: requests whose headers add up to more get 431.
        max_prompt_tokens: prompts longer than this get 400 (``None``: the context).
        max_tokens_limit: ``max_tokens`` above this gets 400 (``None``: the context).
        default_timeout: seconds a request may take (queue + prefill + decode) when it
            does not say; ``None``: no limit.
        max_timeout: the cap on ``X-Request-Timeout``; ``None``: no cap.
        heartbeat_interval: a stream silent this long (queued, in a long prefill) gets
            an SSE comment line; ``None`` or 0: no heartbeats.
        stream_interval: seconds (``--stream-interval-ms``): text deltas that arrive
            within this long of a stream's last sent event are held and go out as one
            event when it has passed; the first delta and the end go out at once. 0:
            every delta is its own event (docs/api.md, "Streaming format").
        model_aliases: other names accepted in the ``model`` field.
        keep_billing_header: keep Claude Code's ``x-anthropic-billing-header`` system
            block in the prompt (by default it is removed: it changes every request and
            would defeat the prompt cache; docs/dialects.md).
        body_timeout: seconds a request's body may take to arrive in full (from the
            headers); past it, 408 ``request_timeout``. ``None``: no limit.
        max_embedding_tokens: the most tokens one ``/v1/embeddings`` request's inputs
            may hold together (400 beyond, naming both); ``None``: no limit.
        request_limits: what one request may ask for: stop sequences, ``logit_bias``
            entries, tools, schema sizes, messages, images (docs/api.md, "Limits").
        media: whether and how image URLs are fetched (``--media-fetch``…) and local
            image files read (``--media-dir``): docs/vision.md.
        responses_db: where stored Responses are kept: a SQLite file, ``"memory"``
            (lost at exit) or ``None`` (none are stored: ``store: true``,
            ``previous_response_id`` and ``background`` are refused).
        responses_max_age: seconds a stored response is kept.
        responses_max_bytes: the stored responses' JSON, at most, all keys together
            (a write past it removes the writing key's oldest; another key's never).
        responses_max_key_bytes: the stored responses' JSON one API key may keep (its
            oldest out first); a server without keys has one owner, bounded by
            ``responses_max_bytes`` alone.
        otlp_endpoint: an OTLP/HTTP traces URL to export a span per request to (the
            ``otel`` extra); ``None``: no spans (a client's ``traceparent`` still goes
            on to upstreams).
        service_name: the ``service.name`` of the spans.
        truncation: what a conversation too long for the context gets when its request
            does not say (``truncation``): ``"disabled"``, a 400
            ``context_length_exceeded``; ``"auto"``, its oldest whole turns dropped until
            it fits (docs/dialects.md, "Truncation").
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    heartbeat_interval: float | None = 15.0
    stream_interval: float = 0.0
    default_timeout: float | None = None
    max_timeout: float | None = 600.0
    model_aliases: tuple[str, ...] = ()
    keep_billing_header: bool = False
    body_timeout: float | None = 30.0
    max_embedding_tokens: int | None = 65536
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    #: how image URLs are fetched and local image files read (docs/vision.md)
    media: FetchPolicy = field(default_factory=FetchPolicy)
    responses_db: str | None = None
    responses_max_age: float = 30 * 86400.0
    responses_max_bytes: int = 512 << 20
    responses_max_key_bytes: int = 64 << 20
    otlp_endpoint: str | None = None
    service_name: str = "trioserve"
    truncation: TruncationMode = "disabled"
    #: where Ollama's uploaded blobs go, and what may be deleted (docs/models.md)
    model_files: ModelFileSettings = field(default_factory=lambda: ModelFileSettings())


@dataclass(frozen=True, kw_only=True)
class ModelFileSettings:
    """Ollama's model files (docs/models.md, "Ollama's model routes").

    Attributes:
        blobs_dir: where ``POST /api/blobs/:digest`` writes uploads (``None``: uploads
            are refused, 501).
        max_blob_bytes: the largest upload (413 beyond, naming ``--max-blob-bytes``).
        delete_files: ``DELETE /api/delete`` of a model's last name deletes its file
            too, if it lies in ``model_dirs`` or ``blobs_dir`` (``--delete-model-files``);
            otherwise no file is ever deleted.
        model_dirs: the ``--models-dir`` directories.
    """

    blobs_dir: Path | None = None
    max_blob_bytes: int = 64 << 30
    delete_files: bool = False
    model_dirs: tuple[Path, ...] = ()
