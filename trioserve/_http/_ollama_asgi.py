"""Ollama's routes served at the ASGI level (docs/models.md, "Ollama's model routes"):
``POST /api/embed`` and ``POST /api/embeddings`` — the ``/v1/embeddings`` flow
(:class:`~._embeddings.RetrievalHandler`: the request's scope and deadline, the
model's lease and embeddings queue, a disconnect that stops the work, the key's
``keep_alive`` rule), in Ollama's shapes — and ``POST``/``HEAD /api/blobs/:digest``: an
upload streamed to disk, bounded by ``--max-blob-bytes`` and verified against its
digest, without ever holding more than :data:`_FLUSH` bytes of it in memory."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import trio

from .._core._backend import Backend
from .._core._exceptions import (
    InvalidRequestError,
    MethodNotAllowedError,
    NotSupportedError,
    PayloadTooLargeError,
    TrioserveError,
)
from .._core._registry import ModelEntry
from .._wire import encode_json
from .._wire._ollama_models import EmbeddingsRequest, EmbedRequest, decode_ollama, embed_inputs
from ._access import AccessPolicy, check_keep_alive_key
from ._embeddings import RetrievalHandler
from ._errors import ErrorRenderer, render_ollama
from ._exchange import (
    Exchange,
    Receive,
    Scope,
    Send,
    _ClientGone,
    _header,
    body_timeout_error,
    parse_keep_alive,
)
from ._lifecycle import off_the_loop_if
from ._ollama_facts import resolve_ollama
from ._ollama_routes import blob_path
from ._request import InFlightRequest
from ._state import ServerState

__all__ = ["BLOBS_PREFIX", "OLLAMA_ASGI_PATHS", "OllamaAsgi"]

EMBED_PATHS = frozenset({"/api/embed", "/api/embeddings"})
BLOBS_PREFIX = "/api/blobs/"
#: the ``POST`` routes served here, as the OpenAPI document names them
OLLAMA_ASGI_PATHS = (*sorted(EMBED_PATHS), BLOBS_PREFIX + "{digest}")
#: vectors of more numbers than this are cut to ``dimensions`` in a worker thread
_INLINE_FLOATS = 64 * 1024
#: an upload's bytes are written (and hashed) in a worker thread this many at a time
_FLUSH = 8 << 20
logger = logging.getLogger("trioserve.models")


class _Parsed:
    __slots__ = ("inputs", "request")

    def __init__(self, request: EmbedRequest | EmbeddingsRequest, inputs: list[str]) -> None:
        self.request = request
        self.inputs = inputs


class OllamaEmbedHandler(RetrievalHandler):
    """``/api/embed`` (``input`` → ``embeddings``) and the legacy ``/api/embeddings``
    (``prompt`` → ``embedding``)."""

    def renderer(self) -> ErrorRenderer:
        return render_ollama

    def path_of(self, request: InFlightRequest) -> str:
        return str(request.asgi["path"]).rstrip("/")

    def parse(self, body: bytes, path: str) -> _Parsed:
        request: EmbedRequest | EmbeddingsRequest
        if path.rstrip("/") == "/api/embed":
            request = decode_ollama(EmbedRequest, body)
        else:
            request = decode_ollama(EmbeddingsRequest, body)
        return _Parsed(request, embed_inputs(request))

    def model_of(self, parsed: Any) -> str | None:
        model: str = parsed.request.model
        return model

    def resolve(self, parsed: Any) -> ModelEntry:
        return resolve_ollama(self.state, parsed.request.model)

    def count(self, parsed: Any) -> int:
        return len(parsed.inputs)

    def keep_alive(self, scope: Scope, parsed: Any) -> float | None:
        """The body's ``keep_alive`` (as ``X-Keep-Alive``: with keys configured, an
        admin key's only — it sets how long the model stays for every client)."""
        raw = parsed.request.keep_alive
        if raw is None:
            return super().keep_alive(scope, parsed)
        check_keep_alive_key(scope, self.access)
        return parse_keep_alive(str(raw))

    async def compute(self, backend: Backend, parsed: Any) -> tuple[Any, int]:
        inputs: Sequence[str | Sequence[int]] = parsed.inputs
        if not inputs:  # (an empty input loads the model, as Ollama's does)
            return [], 0
        request = parsed.request
        if request.truncate is not False:
            inputs = await self._truncated(backend, parsed.inputs)
        dimensions = request.dimensions if isinstance(request, EmbedRequest) else None
        size = backend.embedding_size
        if dimensions is not None and size is not None and not 1 <= dimensions <= size:
            raise InvalidRequestError(
                f"dimensions must be between 1 and {size} (this model's embedding length), got {dimensions}",
                param="dimensions",
            )
        vectors, tokens = await backend.embed_inputs(
            inputs, max_tokens=self.state.settings.max_embedding_tokens
        )
        if dimensions is not None and dimensions != size:
            # Ollama's dimensions: each vector cut to its first ones, then normalized again
            large = dimensions * len(vectors) > _INLINE_FLOATS
            vectors = await off_the_loop_if(large, _shortened, vectors, dimensions)
        return vectors, tokens

    @staticmethod
    async def _truncated(backend: Backend, texts: list[str]) -> Sequence[str | Sequence[int]]:
        """``truncate`` (Ollama's default): each text's tokens cut to what one input may
        hold (the model's batch, within its context); a backend that does not say
        (an upstream relay) gets the texts."""
        settings = getattr(backend, "settings", None)
        batch = getattr(settings, "n_batch", None)
        if not isinstance(batch, int):
            return texts
        limit = min(batch, backend.info.context_length)
        out: list[Sequence[int]] = []
        for text in texts:
            tokens = await backend.tokenize_text(text, add_special=True, parse_special=True)
            out.append(tokens[:limit])
        return out

    def encode(self, request: InFlightRequest, parsed: Any, result: Any, tokens: int) -> bytes:
        if isinstance(parsed.request, EmbeddingsRequest):
            return encode_json({"embedding": result[0] if result else []})
        return encode_json(
            {
                "model": parsed.request.model,
                "embeddings": result,
                "total_duration": int((time.perf_counter() - request.started) * 1e9),
                "load_duration": int((request.load_wait or 0.0) * 1e9),
                "prompt_eval_count": tokens,
            }
        )


class OllamaAsgi:
    """Dispatches the Ollama routes served before quart."""

    def __init__(self, state: ServerState, access: AccessPolicy | None) -> None:
        self.state = state
        self.embed = OllamaEmbedHandler(state, access)

    @staticmethod
    def handles(path: str) -> bool:
        return path in EMBED_PATHS or path.startswith(BLOBS_PREFIX)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/")
        if path in EMBED_PATHS:
            await self.embed(scope, receive, send)
            return
        exchange = Exchange(send, _header(scope, b"x-request-id") or uuid.uuid4().hex, render_ollama)
        try:
            await self._blob(scope, receive, exchange, path.removeprefix(BLOBS_PREFIX))
        except _ClientGone:
            pass
        except TrioserveError as exc:
            if not exchange.started:
                await exchange.error(exc)

    async def _blob(self, scope: Scope, receive: Receive, exchange: Exchange, digest: str) -> None:
        files = self.state.settings.model_files
        method = scope["method"]
        if method not in ("POST", "HEAD"):
            raise MethodNotAllowedError(f"/api/blobs/:digest accepts POST and HEAD, not {method}")
        if files.blobs_dir is None:
            raise NotSupportedError("this server keeps no blobs (no blob directory)", code="no_blobs")
        path = blob_path(files.blobs_dir, digest)
        exists = await trio.to_thread.run_sync(path.is_file)
        if method == "HEAD":
            await exchange.start(200 if exists else 404, [])
            await exchange.body(b"", more=False)
            return
        if exists:  # (Ollama's answer too: the body is not read)
            await exchange.json(200, b"{}")
            return
        limit = files.max_blob_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(
                f"the blob is {declared} bytes; this server takes blobs of at most {limit} bytes "
                "(--max-blob-bytes)"
            )
        await _receive_blob(receive, path, digest, limit, self.state.settings.body_timeout)
        logger.info("blob %s: stored (%s)", digest, path)
        await exchange.json(201, b"{}")


def _shortened(vectors: list[list[float]], dimensions: int) -> list[list[float]]:
    out = []
    for vector in vectors:
        cut = vector[:dimensions]
        norm = math.sqrt(math.fsum(x * x for x in cut))
        out.append([x / norm for x in cut] if norm > 0 else cut)
    return out


def _write(file: IO[bytes], hasher: Any, data: bytes) -> None:
    hasher.update(data)
    file.write(data)


async def _receive_blob(receive: Receive, path: Path, digest: str, limit: int, idle: float | None) -> None:
    """Stream the body into a temporary file beside ``path``, hashing it; move it there
    once whole and verified. A body over ``limit`` is 413, a digest that does not match
    400, a body that stops arriving for ``idle`` seconds 408 (``--body-timeout``: the
    time between pieces here, not the whole upload's); the temporary file never
    outlives the request, however it ends."""
    await trio.to_thread.run_sync(lambda: path.parent.mkdir(parents=True, exist_ok=True))
    temporary = path.with_name(f".upload-{uuid.uuid4().hex}")
    hasher = hashlib.sha256()
    file = await trio.to_thread.run_sync(open, temporary, "wb")
    try:
        pending = bytearray()
        size = 0
        while True:
            with trio.move_on_after(math.inf if idle is None else idle) as waited:
                message = await receive()
            if waited.cancelled_caught:
                assert idle is not None
                raise body_timeout_error(idle)
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(
                    f"the blob exceeds {limit} bytes, the most this server takes (--max-blob-bytes)"
                )
            pending += chunk
            more = message.get("more_body", False)
            if len(pending) >= _FLUSH or not more:
                data, pending = bytes(pending), bytearray()
                await trio.to_thread.run_sync(_write, file, hasher, data)
            if not more:
                break
        await trio.to_thread.run_sync(file.close)
        got = hasher.hexdigest()
        if blob_path(path.parent, digest).name != f"sha256-{got}":
            raise _mismatch(digest, got)
        await trio.to_thread.run_sync(temporary.replace, path)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_discard, file, temporary)


def _discard(file: IO[bytes], temporary: Path) -> None:
    file.close()
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()


def _mismatch(digest: str, got: str) -> TrioserveError:
    return InvalidRequestError(
        f"digest mismatch: the body's SHA-256 is sha256:{got}, the path names {digest}; nothing was stored",
        param="digest",
    )
