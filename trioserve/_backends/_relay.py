"""Talking to one upstream server: a streamed ``POST /v1/completions`` relayed into a
request's channel, a ``POST /v1/embeddings`` (read whole: nothing reaches the client
before all the vectors), ``GET /v1/models`` (and llama-server's ``/props``) to describe
it, and every way an upstream can answer mapped to trioserve's errors. Promises:

* text goes into the channel (``await channel.send()``) before more bytes are read, over
  a socket with a small receive buffer: a client that stops reading stops the upstream;
* a cancel closes the upstream connection (HTTP/1.1, never pooled) before ``Cancelled``
  propagates; the time left on the request's deadline goes upstream as
  ``X-Request-Timeout``;
* :class:`UpstreamUnavailable`: the upstream is not serving (unreachable, 502/503/504, a
  stream broken off); :class:`Retry`: this attempt failed (429, other 5xx, a mid-stream
  error; for embeddings also a 501: not an embedding model), another upstream may do; a
  4xx is the client's :class:`InvalidRequestError` (:class:`ContextLengthError`) with the
  upstream's message.

Why: ``docs/deployment.md``, "What each layer cancels".
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import trio

from .._core._backend import GenerationProgress
from .._core._channel import PieceChannel
from .._core._exceptions import (
    BackendError,
    ContextLengthError,
    InvalidRequestError,
    NotSupportedError,
    OverloadedError,
    TrioserveError,
)
from .._core._types import GenerationEnd, GenerationRequest
from .._wire._sse import SSEDecoder
from ._balancer import UpstreamState

__all__ = ["Retry", "Sink", "UpstreamClient", "UpstreamUnavailable", "base_url", "completion_payload"]

logger = logging.getLogger("trioserve.upstream")

#: closing a response after a cancel: shielded, and bounded by this
_CLOSE_TIMEOUT = 1.0
#: reading an error body, or the end of a stream after ``[DONE]``
_TAIL_TIMEOUT = 2.0
_MAX_ERROR_BODY = 64 * 1024
#: stop sequences forwarded upstream (OpenAI and trioserve accept at most 4; the engine
#: applies all of them anyway, so forwarding only saves the upstream some tokens)
_MAX_FORWARDED_STOPS = 4
#: statuses that say "this upstream is not serving": cooldown, retry elsewhere
_UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
#: an embeddings answer longer than this is decoded in a worker thread
_INLINE_DECODE_BYTES = 1 << 20

_decode_json = msgspec.json.decode


class UpstreamUnavailable(Exception):
    """The upstream is not serving: put it in its cooldown, try another."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Retry(Exception):
    """This attempt failed in a way another upstream may not: try the next one (if no
    byte has reached the client yet)."""

    def __init__(self, error: TrioserveError) -> None:
        super().__init__(error.message)
        self.error = error


def completion_payload(
    request: GenerationRequest, *, bos_token: str, extra_body: Mapping[str, object]
) -> dict[str, Any]:
    """The streamed ``/v1/completions`` body for ``request`` (without ``model``)."""
    text = request.prompt
    assert isinstance(text, str)  # (the backend refuses token ids)
    if not request.add_bos and bos_token and text.startswith(bos_token):
        # the text was rendered with the BOS already in it; the upstream's completion
        # endpoint adds one itself
        text = text[len(bos_token) :]
    sampling = request.sampling
    payload: dict[str, Any] = {
        "prompt": text,
        "max_tokens": request.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.seed is not None:
        payload["seed"] = sampling.seed
    if request.stop:
        payload["stop"] = list(request.stop[:_MAX_FORWARDED_STOPS])
    if sampling.logit_bias:
        payload["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias.items()}
    # the penalties and llama.cpp's extras: sent only when asked for (every peer
    # accepts OpenAI's two; llama-server and llama-cpp-python the others)
    for name, value, default in (
        ("frequency_penalty", sampling.frequency_penalty, 0.0),
        ("presence_penalty", sampling.presence_penalty, 0.0),
        ("top_k", sampling.top_k, 0),
        ("min_p", sampling.min_p, 0.0),
        ("repeat_penalty", sampling.repeat_penalty, 1.0),
    ):
        if value != default:
            payload[name] = value
    if sampling.repeat_penalty != 1.0 and sampling.repeat_last_n != 64:
        payload["repeat_last_n"] = sampling.repeat_last_n
    payload.update(extra_body)
    return payload


class Sink:
    """Hands text to the engine's channel; remembers whether any reached the client."""

    __slots__ = ("channel", "progress", "sent", "sent_at")

    def __init__(self, channel: PieceChannel, progress: GenerationProgress) -> None:
        self.channel = channel
        self.progress = progress
        self.sent = False
        self.sent_at = 0.0

    async def send(self, text: str) -> None:
        progress = self.progress
        if not self.sent:
            # time to the first token, upstream queueing included
            progress.prefill_seconds = time.perf_counter() - self.sent_at
        progress.completion_tokens += 1  # one chunk ≈ one token, until the usage chunk
        await self.channel.send(text.encode())
        self.sent = True


@dataclass(kw_only=True, slots=True)
class _StreamState:
    done: bool = False
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None
    message: str | None = None


class UpstreamClient:
    """The HTTP client every upstream request goes through (HTTP/1.1, small receive
    buffers, no proxies from the environment)."""

    def __init__(
        self,
        *,
        connections: int,
        connect_timeout: float,
        read_timeout: float | None,
        receive_buffer_bytes: int | None,
        api_key: str | None,
    ) -> None:
        self.api_key = api_key
        socket_options = []
        if receive_buffer_bytes is not None:
            socket_options.append((socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes))
        transport = httpx.AsyncHTTPTransport(
            http1=True,
            http2=False,  # closing an HTTP/2 response sends no RST_STREAM
            limits=httpx.Limits(
                max_connections=None,  # admission bounds concurrency, not the pool
                max_keepalive_connections=connections,
                # below the upstreams' own idle timeout (uvicorn's, so vLLM's and
                # llama-cpp-python's: 5 s), so a request does not race a server closing an
                # idle connection (which would look like a failed upstream)
                keepalive_expiry=4.0,
            ),
            socket_options=socket_options,
        )
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(
                connect=connect_timeout, read=read_timeout, write=connect_timeout, pool=connect_timeout
            ),
            follow_redirects=False,
            # a proxy that buffers SSE would break backpressure, and one that keeps
            # upstream connections open, cancellation
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _headers(self, accept: str = "text/event-stream") -> dict[str, str]:
        headers = {"Accept": accept, **self._auth_headers()}
        deadline = trio.current_effective_deadline()
        if deadline != math.inf:
            # rounded up to the millisecond: the upstream's deadline must not come first
            remaining = max(deadline - trio.current_time(), 0.001)
            headers["X-Request-Timeout"] = f"{math.ceil(remaining * 1000) / 1000:.3f}"
        return headers

    async def describe(self, upstream: UpstreamState) -> dict[str, Any] | None:
        """The upstream's model from ``/v1/models`` (and llama-server's ``/props``):
        id, context length, chat template, BOS/EOS text. ``None`` (and
        ``upstream.last_error`` set) if it did not answer with a model."""
        try:
            response = await self._client.get(upstream.url + "/v1/models", headers=self._auth_headers())
            if response.status_code != 200:
                upstream.last_error = f"GET /v1/models answered {response.status_code}"
                return None
            models = response.json().get("data") or []
            if not models or not isinstance(models[0], dict) or "id" not in models[0]:
                upstream.last_error = "GET /v1/models listed no model"
                return None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            upstream.last_error = _describe_error(exc)
            return None
        model = models[0]
        upstream.model_id = str(model["id"])
        context = model.get("context_length") or model.get("max_model_len")  # trioserve, vLLM
        description: dict[str, Any] = {
            "id": upstream.model_id,
            "context_length": context if isinstance(context, int) else None,
            "chat_template": None,
            "bos_token": "",
            "eos_token": "",
        }
        try:  # llama-server: chat template, BOS/EOS text and the real context size
            response = await self._client.get(upstream.url + "/props", headers=self._auth_headers())
            props = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            props = {}
        if isinstance(props, dict):
            if isinstance(props.get("default_generation_settings"), dict):  # llama-server
                # a prompt-progress event (empty text) after every batch: its HTTP thread
                # checks for a closed connection only when a result arrives, else once a
                # second, so without them a client that leaves mid-prompt keeps it
                # computing for up to 1 s more (docs/deployment.md)
                upstream.request_fields = {"return_progress": True}
            settings = props.get("default_generation_settings")
            n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
            if isinstance(n_ctx, int) and description["context_length"] is None:
                description["context_length"] = n_ctx
            for key in ("chat_template", "bos_token", "eos_token"):
                if isinstance(props.get(key), str) and props[key]:
                    description[key] = props[key]
        return description

    async def stream(
        self, upstream: UpstreamState, body: dict[str, Any], sink: Sink, answered: Callable[[], None]
    ) -> GenerationEnd:
        """Stream one completion from ``upstream`` into ``sink``; ``answered()`` is
        called as soon as the upstream has answered (it is up, whatever it answered)."""
        request = self._client.build_request(
            "POST", upstream.url + "/v1/completions", json=body, headers=self._headers()
        )
        sink.sent_at = time.perf_counter()
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise UpstreamUnavailable(
                f"cannot reach upstream {upstream.url}: {_describe_error(exc)}"
            ) from None
        async with _body(response) as chunks:
            if response.status_code != 200:
                await _refused(upstream, response.status_code, chunks, answered)
            answered()
            return await _read(upstream, chunks, sink)

    async def embeddings(
        self, upstream: UpstreamState, body: dict[str, Any], answered: Callable[[], None]
    ) -> tuple[list[list[float]], int]:
        """``POST /v1/embeddings`` to ``upstream``: ``(vectors, prompt tokens)``, one
        vector per input of ``body``. The same promises as :meth:`stream`: the deadline
        goes upstream, a cancel (typically while the upstream computes, before it has
        sent its headers) closes the connection before ``Cancelled`` propagates, and
        the answer is mapped to the same errors."""
        headers = {**self._headers("application/json"), "Accept-Encoding": "identity"}
        request = self._client.build_request(
            "POST", upstream.url + "/v1/embeddings", json=body, headers=headers
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.ReadTimeout:
            # the answer is silent until all of it is computed: a long batch on a busy
            # upstream, not a dead one (no cooldown)
            raise Retry(
                BackendError(f"upstream {upstream.url} did not answer within its read timeout")
            ) from None
        except httpx.TransportError as exc:
            raise UpstreamUnavailable(
                f"cannot reach upstream {upstream.url}: {_describe_error(exc)}"
            ) from None
        async with _body(response) as chunks:
            if response.status_code != 200:
                if response.status_code == 504:
                    await _sleep_until_our_deadline()
                if response.status_code == 501:  # not an embedding model; up, though
                    answered()
                    message = _error_fields(await _error_body(chunks), 501)[0]
                    raise Retry(
                        NotSupportedError(
                            f"upstream {upstream.url} computes no embeddings: {message}", code="no_embeddings"
                        )
                    )
                await _refused(upstream, response.status_code, chunks, answered)
            answered()
            parts: list[bytes] = []
            try:
                async for chunk in chunks:
                    parts.append(chunk)
            except httpx.TransportError as exc:
                raise UpstreamUnavailable(
                    f"upstream {upstream.url} broke off its embeddings answer: {_describe_error(exc)}"
                ) from None
        data = b"".join(parts)
        if len(data) > _INLINE_DECODE_BYTES:
            answer = await trio.to_thread.run_sync(_decode_embeddings, data)
        else:
            answer = _decode_embeddings(data)
        if answer is None or sorted(item.index for item in answer.data) != list(range(len(body["input"]))):
            raise Retry(
                BackendError(
                    f"upstream {upstream.url} answered POST /v1/embeddings with something other than "
                    f"one embedding per input ({len(body['input'])})"
                )
            )
        vectors = [item.embedding for item in sorted(answer.data, key=lambda item: item.index)]
        usage = answer.usage
        return vectors, usage.prompt_tokens if usage is not None else 0


class _Embedding(msgspec.Struct):
    index: int
    embedding: list[float]


class _EmbeddingsUsage(msgspec.Struct):
    prompt_tokens: int = 0


class _EmbeddingsAnswer(msgspec.Struct):
    data: list[_Embedding]
    usage: _EmbeddingsUsage | None = None


_embeddings_decoder = msgspec.json.Decoder(_EmbeddingsAnswer)


def _decode_embeddings(data: bytes) -> _EmbeddingsAnswer | None:
    try:
        return _embeddings_decoder.decode(data)
    except msgspec.DecodeError:  # (ValidationError included)
        return None


async def _sleep_until_our_deadline() -> None:
    """An upstream that answered at its deadline (504): ours, forwarded (rounded up),
    so ours is due now; let it fire (the client's 504 then comes from this server, and
    the upstream is not put in cooldown)."""
    deadline = trio.current_effective_deadline()
    if deadline - trio.current_time() < _TAIL_TIMEOUT:
        await trio.sleep_until(deadline)


async def _read(upstream: UpstreamState, chunks: AsyncIterator[bytes], sink: Sink) -> GenerationEnd:
    decoder = SSEDecoder()
    state = _StreamState()
    try:
        async for chunk in chunks:
            for event in decoder.feed(chunk):
                if event.data == "[DONE]":
                    state.done = True
                    break
                await _event(upstream, event.data, state, sink)
            if state.done:
                # read the (empty) rest, so the connection can be reused
                with trio.move_on_after(_TAIL_TIMEOUT):
                    async for _ in chunks:
                        pass
                break
    except httpx.TransportError as exc:
        if state.finish_reason is None:
            raise UpstreamUnavailable(
                f"upstream {upstream.url} broke off the stream: {_describe_error(exc)}"
            ) from None
        logger.debug("upstream %s: error after the end of the stream: %r", upstream.url, exc)
    if state.finish_reason is None:
        raise UpstreamUnavailable(f"upstream {upstream.url} ended the stream without a finish reason")
    if state.usage is not None:
        sink.progress.prompt_tokens = state.usage[0]
        sink.progress.completion_tokens = state.usage[1]
    return await _finish(upstream, state)


async def _event(upstream: UpstreamState, data: str, state: _StreamState, sink: Sink) -> None:
    try:
        chunk = _decode_json(data)
    except msgspec.DecodeError:
        raise UpstreamUnavailable(f"upstream {upstream.url} sent an event that is not JSON") from None
    if not isinstance(chunk, dict):
        return
    error = chunk.get("error")
    if error is not None:  # vLLM and llama-server report mid-stream errors so
        raise Retry(BackendError(f"upstream {upstream.url} failed: {_error_text(error)}"))
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
            state.usage = (prompt_tokens, completion_tokens)
    extension = chunk.get("trioserve")
    cause = None
    if isinstance(extension, dict):
        state.message = extension.get("message")
        # an upstream trioserve: finish_reason is OpenAI's ("length" for a stream it cut
        # short); why it ended is here
        if isinstance(extension.get("end_cause"), str):
            cause = extension["end_cause"]
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        text = choice.get("text")
        if text:
            await sink.send(text)
        reason = choice.get("finish_reason")
        if reason:
            state.finish_reason = cause or str(reason)


async def _finish(upstream: UpstreamState, state: _StreamState) -> GenerationEnd:
    reason = state.finish_reason
    if reason in ("stop", "length"):
        return reason  # type: ignore[return-value]
    detail = f": {state.message}" if state.message else ""
    if reason == "deadline":
        # An upstream trioserve's deadline: ours, forwarded (rounded up), so ours is
        # due now; let it fire, so the client sees "deadline" from this server.
        deadline = trio.current_effective_deadline()
        if deadline - trio.current_time() < _TAIL_TIMEOUT:
            await trio.sleep_until(deadline)
        raise BackendError(f"upstream {upstream.url} ended the stream at its own deadline{detail}")
    if reason == "shutdown":
        raise UpstreamUnavailable(f"upstream {upstream.url} is shutting down{detail}")
    if reason == "error":
        raise Retry(BackendError(f"upstream {upstream.url} failed{detail}"))
    logger.warning("upstream %s ended a stream with finish_reason %r; reporting 'stop'", upstream.url, reason)
    return "stop"


async def _refused(
    upstream: UpstreamState, status: int, chunks: AsyncIterator[bytes], answered: Callable[[], None]
) -> None:
    """Map a non-200 answer to our error (always raises)."""
    message, param, code = _error_fields(await _error_body(chunks), status)
    if status in _UNAVAILABLE_STATUSES:
        raise UpstreamUnavailable(f"upstream {upstream.url} answered {status}: {message}")
    answered()  # it answered: it is up, whatever it thinks of the request
    if status == 429:
        raise Retry(OverloadedError(f"the upstream servers are overloaded: {message}"))
    if status >= 500 or status in (401, 403, 404, 405):
        # its failure, or our configuration (key, URL, model): not the client's fault
        raise Retry(BackendError(f"upstream {upstream.url} answered {status}: {message}"))
    if code == "context_length_exceeded":
        raise ContextLengthError(message, param=param)
    raise InvalidRequestError(message, param=param, code=code)


async def _error_body(chunks: AsyncIterator[bytes]) -> bytes:
    """An error answer's body: what arrives within ``_TAIL_TIMEOUT``, at most
    ``_MAX_ERROR_BODY`` bytes."""
    data = b""
    try:
        with trio.move_on_after(_TAIL_TIMEOUT):
            async for chunk in chunks:
                data += chunk
                if len(data) >= _MAX_ERROR_BODY:
                    break
    except httpx.TransportError:
        pass
    return data


@asynccontextmanager
async def _body(response: httpx.Response) -> AsyncIterator[AsyncIterator[bytes]]:
    """The response body as it arrives (one chunk per read, nothing read ahead); on the
    way out, however it is left, the response is closed.

    A response left unfinished (a cancel, an error) has its connection closed by
    httpcore, never pooled: that close is what tells the upstream to stop. httpx's body
    iterator is a chain of nested async generators that are not closed when iteration
    stops early (encode/httpx#3686), and Trio warns when such a generator is collected;
    so after closing the response, the chain is run to its end: on a closed connection
    it raises at once (or ends with the bytes already buffered)."""
    chunks = response.aiter_raw()
    try:
        yield chunks
    finally:
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            await response.aclose()
            try:
                async for _ in chunks:
                    pass
            except Exception:  # the expected end: a read on a closed stream
                pass


def base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def _describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _error_fields(data: bytes, status: int) -> tuple[str, str | None, str | None]:
    """(message, param, code) from an error body: OpenAI's ``{"error": {...}}``
    (vLLM, llama-server, trioserve), vLLM's older ``{"message": ...}``, FastAPI's
    ``{"detail": ...}`` (llama-cpp-python's validation errors), or plain text."""
    text = data.decode("utf-8", errors="replace").strip()
    try:
        body = _decode_json(data)
    except msgspec.DecodeError:
        return text[:1000] or f"HTTP {status}", None, None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            param, code = error.get("param"), error.get("code")
            return (
                str(error["message"]),
                str(param) if param is not None else None,
                str(code) if isinstance(code, str) else None,
            )
        if isinstance(error, str):
            return error, None, None
        if isinstance(body.get("message"), str):
            return body["message"], None, None
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail, None, None
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            first = detail[0]
            location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
            return str(first.get("msg", detail)), location or None, None
    return text[:1000] or f"HTTP {status}", None, None
