"""Talking to one upstream server: a streamed ``POST /v1/completions`` or llama-server's
streamed ``POST /infill`` relayed into a request's channel, a ``POST /v1/embeddings``
and a ``POST /v1/rerank`` (read whole: nothing reaches the client before all the
vectors or scores), ``GET /v1/models`` (and llama-server's ``/props``) to describe it.
Every POST goes through one exchange (:meth:`UpstreamClient._exchange`); what the
answers mean is :mod:`._errors`', what they say is :mod:`trioserve._wire._upstream`'s.
Promises:

* text goes into the channel (``await channel.send()``) before more bytes are read, over
  a socket with a small receive buffer: a client that stops reading stops the upstream;
* a cancel closes the upstream connection (HTTP/1.1, never pooled) before ``Cancelled``
  propagates; the time left on the request's deadline goes upstream as
  ``X-Request-Timeout``, the request's trace as ``traceparent``.

Why: ``docs/deployment.md``, "What each layer cancels".
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from ..._core._backend import GenerationProgress
from ..._core._channel import PieceChannel
from ..._core._tracing import TRACEPARENT
from ..._core._types import GenerationEnd
from ..._wire._sse import SSEDecoder
from ..._wire._upstream import (
    CompletionEvent,
    ModelDescription,
    NotJSON,
    RerankAnswer,
    completion_event,
    decode_embeddings,
    decode_rerank,
    error_fields,
    infill_event,
    models_answer,
    props_answer,
)
from . import _errors
from ._balancer import UpstreamState
from ._errors import Endpoint

__all__ = ["Sink", "UpstreamClient"]

logger = logging.getLogger("trioserve.upstream")

#: closing a response after a cancel: shielded, and bounded by this
_CLOSE_TIMEOUT = 1.0
#: reading an error body, or the end of a stream after ``[DONE]``
_TAIL_TIMEOUT = 2.0
_MAX_ERROR_BODY = 64 * 1024
#: an embeddings answer longer than this is decoded in a worker thread
_INLINE_DECODE_BYTES = 1 << 20


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
    buffers, no proxies from the environment). ``transport`` replaces the network
    (tests: an ``httpx.MockTransport``)."""

    def __init__(
        self,
        *,
        connections: int,
        connect_timeout: float,
        read_timeout: float | None,
        receive_buffer_bytes: int | None,
        api_key: str | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.api_key = api_key
        socket_options = []
        if receive_buffer_bytes is not None:
            socket_options.append((socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes))
        if transport is None:
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
        traceparent = TRACEPARENT.get()
        if traceparent is not None:
            headers["traceparent"] = traceparent  # (the request's trace goes on upstream)
        deadline = trio.current_effective_deadline()
        if deadline != math.inf:
            # rounded up to the millisecond: the upstream's deadline must not come first
            remaining = max(deadline - trio.current_time(), 0.001)
            headers["X-Request-Timeout"] = f"{math.ceil(remaining * 1000) / 1000:.3f}"
        return headers

    async def describe(self, upstream: UpstreamState) -> ModelDescription | None:
        """The upstream's model from ``/v1/models`` (and llama-server's ``/props``):
        id, context length, chat template, BOS/EOS text; the fields its kind of server
        needs go to ``upstream.request_fields``. ``None`` (and ``upstream.last_error``
        set) if it did not answer with a model."""
        try:
            response = await self._client.get(upstream.url + "/v1/models", headers=self._auth_headers())
            if response.status_code != 200:
                upstream.last_error = f"GET /v1/models answered {response.status_code}"
                return None
            description = models_answer(response.json())
            if isinstance(description, str):
                upstream.last_error = description
                return None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            upstream.last_error = _errors.describe_error(exc)
            return None
        upstream.model_id = description.id
        try:  # llama-server: chat template, BOS/EOS text and the real context size
            response = await self._client.get(upstream.url + "/props", headers=self._auth_headers())
            props = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            props = {}
        props_answer(description, props)
        if description.request_fields is not None:
            upstream.request_fields = description.request_fields
        return description

    @asynccontextmanager
    async def _exchange(
        self,
        upstream: UpstreamState,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        answered: Callable[[], None],
        *,
        endpoint: Endpoint = "completions",
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """One ``POST``: the body of its 200 answer as it arrives; any other answer
        raised as :mod:`._errors` maps it. ``answered()`` is called as soon as the
        upstream has answered (it is up, whatever it answered). On the way out the
        response is closed (:func:`_body`). An answer read whole (embeddings, rerank)
        is silent until computed: a read timeout there is a busy upstream."""
        whole = endpoint in ("embeddings", "rerank")
        request = self._client.build_request("POST", upstream.url + path, json=body, headers=headers)
        try:
            try:
                response = await self._client.send(request, stream=True)
            except httpx.RemoteProtocolError:
                # A server that closes an idle keep-alive connection as the request goes
                # out on it (a race no expiry on our side can rule out: the server may
                # close at any time) answers nothing; the request did not start there.
                # Once more, on a new connection (the dropped one left the pool); a
                # second drop is the upstream's failure.
                logger.debug("upstream %s dropped a connection unanswered; sending again", upstream.url)
                response = await self._client.send(request, stream=True)
        except httpx.ReadTimeout as exc:
            if whole:
                raise _errors.silent(upstream.url) from None
            raise _errors.unreachable(upstream.url, exc) from None
        except httpx.TransportError as exc:
            raise _errors.unreachable(upstream.url, exc) from None
        async with _body(response) as chunks:
            status = response.status_code
            if status != 200:
                if whole and status == 504:
                    await _sleep_until_our_deadline()
                message, param, code = error_fields(await _error_body(chunks), status)
                error = _errors.refusal(upstream.url, status, message, param, code, endpoint=endpoint)
                if not isinstance(error, _errors.UpstreamUnavailable):
                    answered()  # it answered: it is up, whatever it thinks of the request
                raise error
            answered()
            yield chunks

    async def stream(
        self, upstream: UpstreamState, body: dict[str, Any], sink: Sink, answered: Callable[[], None]
    ) -> GenerationEnd:
        """Stream one completion from ``upstream`` into ``sink``; ``answered()`` is
        called as soon as the upstream has answered (it is up, whatever it answered).
        Cancellation: the connection is closed before ``Cancelled`` propagates."""
        headers = self._headers()
        sink.sent_at = time.perf_counter()
        async with self._exchange(upstream, "/v1/completions", body, headers, answered) as chunks:
            return await _read(upstream.url, chunks, sink, completion_event)

    async def infill(
        self, upstream: UpstreamState, body: dict[str, Any], sink: Sink, answered: Callable[[], None]
    ) -> GenerationEnd:
        """Stream one fill in the middle from llama-server's ``POST /infill`` (its
        ``/completion``-shaped events; its final object, ``"stop": true``, ends the
        stream, with no ``[DONE]``) into ``sink``. The promises of :meth:`stream`."""
        headers = self._headers()
        sink.sent_at = time.perf_counter()
        async with self._exchange(upstream, "/infill", body, headers, answered, endpoint="infill") as chunks:
            return await _read(upstream.url, chunks, sink, infill_event)

    async def embeddings(
        self, upstream: UpstreamState, body: dict[str, Any], answered: Callable[[], None]
    ) -> tuple[list[list[float]], int]:
        """``POST /v1/embeddings`` to ``upstream``: ``(vectors, prompt tokens)``, one
        vector per input of ``body``. The same promises as :meth:`stream`: the deadline
        goes upstream, a cancel (typically while the upstream computes, before it has
        sent its headers) closes the connection before ``Cancelled`` propagates, and
        the answer is mapped to the same errors."""
        data = await self._whole(upstream, "/v1/embeddings", body, answered, "embeddings")
        if len(data) > _INLINE_DECODE_BYTES:
            answer = await trio.to_thread.run_sync(decode_embeddings, data)
        else:
            answer = decode_embeddings(data)
        inputs = len(body["input"])
        result = answer.vectors(inputs) if answer is not None else None
        if result is None:
            raise _errors.malformed_embeddings(upstream.url, inputs)
        return result

    async def rerank(
        self, upstream: UpstreamState, body: dict[str, Any], answered: Callable[[], None]
    ) -> tuple[RerankAnswer, list[float], int]:
        """``POST /v1/rerank`` to ``upstream``: ``(answer, scores in the documents'
        order, prompt tokens)``. Read whole, with the promises of :meth:`embeddings`."""
        data = await self._whole(upstream, "/v1/rerank", body, answered, "rerank")
        documents: Sequence[str] = body["documents"]
        answer = decode_rerank(data)
        result = answer.scores(len(documents)) if answer is not None else None
        if answer is None or result is None:
            raise _errors.malformed_rerank(upstream.url, len(documents))
        return answer, *result

    async def _whole(
        self,
        upstream: UpstreamState,
        path: str,
        body: dict[str, Any],
        answered: Callable[[], None],
        endpoint: Endpoint,
    ) -> bytes:
        """A 200 answer's whole body (embeddings, rerank)."""
        headers = {**self._headers("application/json"), "Accept-Encoding": "identity"}
        parts: list[bytes] = []
        async with self._exchange(upstream, path, body, headers, answered, endpoint=endpoint) as chunks:
            try:
                async for chunk in chunks:
                    parts.append(chunk)
            except httpx.TransportError as exc:
                raise _errors.broken_off(upstream.url, f"its {endpoint} answer", exc) from None
        return b"".join(parts)


async def _sleep_until_our_deadline() -> None:
    """An upstream that answered at its deadline (504, or an upstream trioserve's
    ``deadline`` end): ours, forwarded (rounded up), so ours is due now; let it fire
    (the client's 504 or "deadline" then comes from this server, and the upstream is
    not put in cooldown)."""
    deadline = trio.current_effective_deadline()
    if deadline - trio.current_time() < _TAIL_TIMEOUT:
        await trio.sleep_until(deadline)


async def _read(
    url: str, chunks: AsyncIterator[bytes], sink: Sink, parse: Callable[[str], CompletionEvent]
) -> GenerationEnd:
    """Relay a stream's text into ``sink`` (``parse`` reads one event's data) until
    ``[DONE]``, an event that says it is the last, or the body's end."""
    decoder = SSEDecoder()
    state = _StreamState()
    try:
        async for chunk in chunks:
            for event in decoder.feed(chunk):
                if event.data == "[DONE]":
                    state.done = True
                    break
                await _event(url, parse, event.data, state, sink)
                if state.done:
                    break
            if state.done:
                # read the (empty) rest, so the connection can be reused
                with trio.move_on_after(_TAIL_TIMEOUT):
                    async for _ in chunks:
                        pass
                break
    except httpx.TransportError as exc:
        if state.finish_reason is None:
            raise _errors.broken_off(url, "the stream", exc) from None
        logger.debug("upstream %s: error after the end of the stream: %r", url, exc)
    if state.finish_reason is None:
        raise _errors.unfinished(url)
    if state.usage is not None:
        sink.progress.prompt_tokens = state.usage[0]
        sink.progress.completion_tokens = state.usage[1]
    return await _finish(url, state)


async def _event(
    url: str, parse: Callable[[str], CompletionEvent], data: str, state: _StreamState, sink: Sink
) -> None:
    try:
        event = parse(data)
    except NotJSON:
        raise _errors.not_json(url) from None
    if event.error is not None:
        raise _errors.failed_mid_stream(url, event.error)
    if event.usage is not None:
        state.usage = event.usage
    if event.has_extension:
        state.message = event.message
    for text in event.texts:
        await sink.send(text)
    if event.finish_reason is not None:
        state.finish_reason = event.finish_reason
    if event.last:
        state.done = True


async def _finish(url: str, state: _StreamState) -> GenerationEnd:
    reason = state.finish_reason
    assert reason is not None  # (checked by _read)
    if reason in ("stop", "length"):
        return reason  # type: ignore[return-value]
    if reason == "deadline":
        # An upstream trioserve's deadline: ours, forwarded (rounded up), so ours is
        # due now; let it fire, so the client sees "deadline" from this server.
        await _sleep_until_our_deadline()
    error = _errors.ended(url, reason, state.message)
    if error is not None:
        raise error
    logger.warning("upstream %s ended a stream with finish_reason %r; reporting 'stop'", url, reason)
    return "stop"


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
