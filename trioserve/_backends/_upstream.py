"""The upstream backend: trioserve in front of OpenAI-compatible servers.

The model runs elsewhere — vLLM, llama.cpp's ``llama-server``, llama-cpp-python's
server, another trioserve — and this backend streams ``POST {upstream}/v1/completions``
into the request's channel, with the same semantics as a local model:

* **Backpressure passes through.** Each text delta is handed to the engine with
  ``await send.send(...)`` on the request's small channel before the next bytes are read
  from the upstream, and the upstream socket's receive buffer is kept small
  (``receive_buffer_bytes``), so a client that stops reading stops the upstream's
  stream after a few KiB: its server blocks on a full socket and pauses inference.
* **A cancel closes the upstream request at once.** When the request's scope is
  cancelled (client disconnect, deadline, shutdown, a stop sequence, the caller's own
  scope), the read raises ``Cancelled`` and the TCP connection is *closed*, not returned
  to the pool (httpcore closes an HTTP/1.1 connection whose response was not read to
  the end; the ``finally`` closes the response again, shielded and bounded). Closing the
  connection is the one cancel signal every OpenAI-compatible server understands; over
  HTTP/2, httpx sends no RST_STREAM when a response is closed, so the upstream would
  keep generating: upstreams are always spoken to over HTTP/1.1.
* **The deadline travels.** The time left on the request's deadline goes upstream as
  ``X-Request-Timeout`` (trioserve honours it; other servers ignore it, and the
  connection close at our deadline stops them).
* **Errors are mapped once, here.** An upstream 4xx becomes
  :class:`InvalidRequestError` (:class:`ContextLengthError` for
  ``context_length_exceeded``) with the upstream's own message; connection errors,
  5xx, and a stream broken off mid-way become :class:`BackendError` naming the upstream.

Several upstreams: each request goes to the available upstream with the fewest
requests outstanding. An upstream that cannot be reached, answers 502/503/504, or breaks
a stream off is skipped for ``cooldown`` seconds; then one request at a time probes it
(a passive health check: no background traffic). A request whose upstream fails before
a byte reached the client is retried on another upstream; after the first byte it ends
with an error (a generation cannot be resumed elsewhere token-exactly).

Token counts: there is no local tokenizer. The backend asks for
``stream_options.include_usage`` and takes ``prompt_tokens`` and
``completion_tokens`` from the upstream's usage chunk when it sends one (vLLM,
llama-server, trioserve). Otherwise (llama-cpp-python's server) ``prompt_tokens`` stays
0 and ``completion_tokens`` counts the streamed chunks with text — one per token on
the servers above, but an estimate in general.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import msgspec
import trio

from .._core._backend import Backend, GenerationProgress, ModelInfo, PreparedPrompt
from .._core._channel import PieceChannel
from .._core._exceptions import (
    BackendError,
    ContextLengthError,
    InvalidRequestError,
    OverloadedError,
    ServiceUnavailableError,
    TrioserveError,
)
from .._core._types import GenerationRequest
from .._wire._sse import SSEDecoder

__all__ = ["UpstreamBackend", "UpstreamState"]

logger = logging.getLogger("trioserve.upstream")

#: the context length reported when no upstream says what it is
UNKNOWN_CONTEXT_LENGTH = 1 << 20
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

_decode_json = msgspec.json.decode


@dataclass(kw_only=True, eq=False)
class UpstreamState:
    """One upstream server as the balancer sees it (read it for health pages, tests)."""

    url: str
    #: the model name this upstream serves (``None``: unknown; the backend's id is sent)
    model_id: str | None = None
    #: requests on this upstream right now
    outstanding: int = 0
    #: requests sent, and attempts that failed (connect error, 502/503/504, broken stream)
    requests: int = 0
    failures: int = 0
    #: ``trio.current_time()`` until which the upstream is skipped; ``None``: healthy
    failed_until: float | None = None
    #: a request is probing it after its cooldown
    probing: bool = False
    last_error: str | None = None

    def available(self, now: float) -> bool:
        if self.failed_until is None:
            return True
        return now >= self.failed_until and not self.probing


class _Retry(Exception):
    """This attempt failed in a way another upstream may not: try the next one (if no
    byte has reached the client yet)."""

    def __init__(self, error: TrioserveError) -> None:
        super().__init__(error.message)
        self.error = error


class UpstreamBackend(Backend):
    """Generates by streaming from OpenAI-compatible upstream servers.

    Create it with :meth:`aload`, which asks the upstreams for their model. Use the
    constructor to skip that (``info`` then says what to report).

    Args:
        urls: base URLs of the upstreams (``http://host:port``; a trailing ``/v1`` is
            accepted).
        info: the model as clients see it (the id goes in each upstream request's
            ``model`` when the upstream's own id is unknown).
        slots_per_upstream: the capacity each upstream adds: ``slots`` (what runs at
            once; trioserve queues the rest, ``--max-queue``) is this times the number
            of upstreams. Not a per-upstream cap: while one upstream is down, the others
            take its share (their own queues absorb it).
        cooldown: seconds a failed upstream is skipped before one request probes it.
        connect_timeout: seconds to open a connection to an upstream.
        read_timeout: seconds an upstream may stay silent mid-request (queueing and
            prefill included: trioserve upstreams send heartbeats every 15 s). The
            request's own deadline, if any, applies too.
        receive_buffer_bytes: ``SO_RCVBUF`` of upstream connections: how much of an
            upstream's stream the kernel holds for a client that is not reading. Small,
            so a slow client slows the upstream soon.
        api_key: sent upstream as ``Authorization: Bearer …``.
        extra_body: fields merged into every upstream request (e.g.
            ``{"repeat_penalty": 1.0}`` for llama-cpp-python, whose default is 1.1).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        info: ModelInfo,
        slots_per_upstream: int = 8,
        cooldown: float = 5.0,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 300.0,
        receive_buffer_bytes: int | None = 16 * 1024,
        api_key: str | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("UpstreamBackend needs at least one upstream URL")
        if slots_per_upstream < 1:
            raise ValueError(f"slots_per_upstream must be at least 1, got {slots_per_upstream}")
        self.upstreams = [UpstreamState(url=_base_url(url)) for url in urls]
        self._info = info
        self.slots_per_upstream = slots_per_upstream
        self.cooldown = cooldown
        self.api_key = api_key
        self.extra_body = dict(extra_body or {})
        self._turn = 0
        socket_options = []
        if receive_buffer_bytes is not None:
            socket_options.append((socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes))
        transport = httpx.AsyncHTTPTransport(
            http1=True,
            http2=False,  # closing an HTTP/2 response sends no RST_STREAM: see the module doc
            limits=httpx.Limits(
                max_connections=None,  # admission bounds concurrency, not the pool
                max_keepalive_connections=slots_per_upstream * len(urls),
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
            # no HTTP_PROXY from the environment: a proxy that buffers SSE would break
            # backpressure, and one that keeps upstream connections open, cancellation
            trust_env=False,
        )
        self._closed = False

    # ----------------------------------------------------------------- loading

    @classmethod
    async def aload(
        cls,
        urls: Sequence[str],
        *,
        model_id: str | None = None,
        chat_template: str | None = None,
        architecture: str | None = None,
        load_timeout: float = 60.0,
        **settings: Any,
    ) -> UpstreamBackend:
        """Ask each upstream for its model (``GET /v1/models``, first model) and
        build the backend. Waits, retrying once a second for up to ``load_timeout``
        seconds, until at least one upstream answers (an upstream still loading its
        model answers 503); those that do not are put in cooldown.

        llama-server's ``GET /props`` is read too when it exists, for the chat template
        and the context size. Args: ``model_id`` (the name clients use; default: the
        first upstream's), ``chat_template`` and ``architecture`` (override what the
        upstream reports, for chat rendering), and the constructor's keyword arguments.

        Raises:
            BackendError: no upstream answered within ``load_timeout``.
        """
        backend = cls(
            urls, info=ModelInfo(id=model_id or "upstream", context_length=UNKNOWN_CONTEXT_LENGTH), **settings
        )
        try:
            found: dict[int, dict[str, Any]] = {}
            with trio.move_on_after(load_timeout):
                while True:
                    async with trio.open_nursery() as nursery:
                        for index, upstream in enumerate(backend.upstreams):
                            if index not in found:
                                nursery.start_soon(backend._describe, index, upstream, found)
                    if found:
                        break
                    await trio.sleep(1.0)
            if not found:
                raise BackendError(
                    f"no upstream answered GET /v1/models within {load_timeout:g} s: "
                    + "; ".join(f"{u.url}: {u.last_error}" for u in backend.upstreams)
                )
            now = trio.current_time()
            for index, upstream in enumerate(backend.upstreams):
                if index not in found:
                    upstream.failed_until = now + backend.cooldown
                    logger.warning(
                        "upstream %s did not answer (%s); will retry it", upstream.url, upstream.last_error
                    )
            first = found[min(found)]
            ids = {u.model_id for u in backend.upstreams if u.model_id is not None}
            if len(ids) > 1:
                logger.warning("the upstreams serve different models: %s", ", ".join(sorted(ids)))
            backend._info = ModelInfo(
                id=model_id or first["id"],
                context_length=first["context_length"] or UNKNOWN_CONTEXT_LENGTH,
                chat_template=chat_template or first["chat_template"],
                architecture=architecture,
                bos_token=first["bos_token"],
                eos_token=first["eos_token"],
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await backend.aclose()
            raise
        logger.info(
            "upstream model %s via %s (%d slot(s) each)",
            backend._info.id,
            ", ".join(u.url for u in backend.upstreams),
            backend.slots_per_upstream,
        )
        return backend

    async def _describe(self, index: int, upstream: UpstreamState, found: dict[int, dict[str, Any]]) -> None:
        """Fill ``found[index]`` from the upstream's ``/v1/models`` (and ``/props``)."""
        try:
            response = await self._client.get(upstream.url + "/v1/models", headers=self._auth_headers())
            if response.status_code != 200:
                upstream.last_error = f"GET /v1/models answered {response.status_code}"
                return
            models = response.json().get("data") or []
            if not models or not isinstance(models[0], dict) or "id" not in models[0]:
                upstream.last_error = "GET /v1/models listed no model"
                return
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            upstream.last_error = _describe_error(exc)
            return
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
            settings = props.get("default_generation_settings")
            n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
            if isinstance(n_ctx, int) and description["context_length"] is None:
                description["context_length"] = n_ctx
            for key in ("chat_template", "bos_token", "eos_token"):
                if isinstance(props.get(key), str) and props[key]:
                    description[key] = props[key]
        found[index] = description

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    # ---------------------------------------------------------------- properties

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def slots(self) -> int:
        """``slots_per_upstream`` × the number of upstreams."""
        return self.slots_per_upstream * len(self.upstreams)

    # ----------------------------------------------------------------- requests

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Check what can be checked without the model: a text prompt, and an upstream
        to send it to. The prompt's token count is unknown (0) until the upstream says.

        Raises:
            InvalidRequestError: a token-id prompt (there is no local tokenizer to
                check the ids against, and not every upstream accepts them).
            ServiceUnavailableError: every upstream is in its cooldown (503 with
                ``Retry-After``).
        """
        if not isinstance(request.prompt, str):
            raise InvalidRequestError(
                "token-id prompts are not supported by this server (it forwards text to an "
                "upstream server and has no tokenizer of its own); send the prompt as text",
                param="prompt",
            )
        if not request.prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        now = trio.current_time()
        waits = [u.failed_until - now for u in self.upstreams if u.failed_until is not None]
        if len(waits) == len(self.upstreams) and min(waits) > 0:
            raise ServiceUnavailableError(
                f"every upstream failed recently; the next is retried in {min(waits):.1f} s",
                retry_after=min(waits),
                code="upstream_unavailable",
            )
        max_new = request.max_tokens if request.max_tokens is not None else self._info.context_length
        return PreparedPrompt(request=request, tokens=(), max_new_tokens=max_new)

    async def generate(
        self,
        prompt: PreparedPrompt,
        send: PieceChannel,
        progress: GenerationProgress,
    ) -> Literal["stop", "length"]:
        """Stream from the least busy available upstream; retry on another while no
        byte has been sent. Cancellation: the upstream connection is closed before
        this raises ``Cancelled``."""
        with self.generations:
            try:
                return await self._generate(prompt, send, progress)
            finally:
                progress.inference_ended = time.perf_counter()

    async def _generate(
        self,
        prompt: PreparedPrompt,
        send: PieceChannel,
        progress: GenerationProgress,
    ) -> Literal["stop", "length"]:
        payload = self._payload(prompt.request)
        relay = _Relay(send, progress)
        tried: set[int] = set()
        errors: list[str] = []
        while True:
            picked = self._pick(tried)
            if picked is None:
                if errors:
                    raise BackendError("; ".join(errors))
                raise BackendError(
                    "no upstream is available: "
                    + "; ".join(f"{u.url}: {u.last_error or 'cooling down'}" for u in self.upstreams)
                )
            index, upstream, probing = picked
            tried.add(index)
            try:
                return await self._attempt(upstream, probing, payload, relay)
            except _Retry as retry:
                if relay.sent:
                    raise retry.error from None
                errors.append(retry.error.message)
                if len(tried) < len(self.upstreams):
                    logger.warning("%s; retrying on another upstream", retry.error.message)
                if isinstance(retry.error, OverloadedError) and len(tried) == len(self.upstreams):
                    raise retry.error from None

    def _pick(self, tried: set[int]) -> tuple[int, UpstreamState, bool] | None:
        """The available upstream with the fewest outstanding requests (ties: in turn)."""
        now = trio.current_time()
        count = len(self.upstreams)
        self._turn = (self._turn + 1) % count
        best: tuple[int, int, int] | None = None
        for index, upstream in enumerate(self.upstreams):
            if index in tried or not upstream.available(now):
                continue
            key = (upstream.outstanding, (index - self._turn) % count, index)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        upstream = self.upstreams[best[2]]
        probing = upstream.failed_until is not None
        if probing:
            upstream.probing = True
        return best[2], upstream, probing

    def _payload(self, request: GenerationRequest) -> dict[str, Any]:
        text = request.prompt
        assert isinstance(text, str)  # (prepare refuses token ids)
        bos = self._info.bos_token
        if not request.add_bos and bos and text.startswith(bos):
            # the text was rendered with the BOS already in it; the upstream's completion
            # endpoint adds one itself
            text = text[len(bos) :]
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
        payload.update(self.extra_body)
        return payload

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream", **self._auth_headers()}
        deadline = trio.current_effective_deadline()
        if deadline != math.inf:
            # rounded up to the millisecond: the upstream's deadline must not come first
            remaining = max(deadline - trio.current_time(), 0.001)
            headers["X-Request-Timeout"] = f"{math.ceil(remaining * 1000) / 1000:.3f}"
        return headers

    async def _attempt(
        self, upstream: UpstreamState, probing: bool, payload: dict[str, Any], relay: _Relay
    ) -> Literal["stop", "length"]:
        upstream.outstanding += 1
        upstream.requests += 1
        try:
            body = {**payload, "model": upstream.model_id or self._info.id}
            request = self._client.build_request(
                "POST", upstream.url + "/v1/completions", json=body, headers=self._headers()
            )
            relay.sent_at = time.perf_counter()
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                message = f"cannot reach upstream {upstream.url}: {_describe_error(exc)}"
                raise self._failed(upstream, message) from None
            async with _body(response) as chunks:
                if response.status_code != 200:
                    await self._refused(upstream, response.status_code, chunks)
                self._healthy(upstream)
                return await self._relay(upstream, chunks, relay)
        finally:
            upstream.outstanding -= 1
            if probing:
                upstream.probing = False

    async def _relay(
        self, upstream: UpstreamState, chunks: AsyncIterator[bytes], relay: _Relay
    ) -> Literal["stop", "length"]:
        decoder = SSEDecoder()
        state = _StreamState()
        try:
            async for chunk in chunks:
                for event in decoder.feed(chunk):
                    if event.data == "[DONE]":
                        state.done = True
                        break
                    await self._event(upstream, event.data, state, relay)
                if state.done:
                    # read the (empty) rest, so the connection can be reused
                    with trio.move_on_after(_TAIL_TIMEOUT):
                        async for _ in chunks:
                            pass
                    break
        except httpx.TransportError as exc:
            if state.finish_reason is None:
                raise self._failed(
                    upstream, f"upstream {upstream.url} broke off the stream: {_describe_error(exc)}"
                ) from None
            logger.debug("upstream %s: error after the end of the stream: %r", upstream.url, exc)
        if state.finish_reason is None:
            raise self._failed(upstream, f"upstream {upstream.url} ended the stream without a finish reason")
        if state.usage is not None:
            relay.progress.prompt_tokens = state.usage[0]
            relay.progress.completion_tokens = state.usage[1]
        return await self._finish(upstream, state)

    async def _event(self, upstream: UpstreamState, data: str, state: _StreamState, relay: _Relay) -> None:
        try:
            chunk = _decode_json(data)
        except msgspec.DecodeError:
            raise self._failed(upstream, f"upstream {upstream.url} sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            return
        error = chunk.get("error")
        if error is not None:  # vLLM and llama-server report mid-stream errors so
            raise _Retry(BackendError(f"upstream {upstream.url} failed: {_error_text(error)}"))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt_tokens, completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
                state.usage = (prompt_tokens, completion_tokens)
        extension = chunk.get("trioserve")
        if isinstance(extension, dict):
            state.message = extension.get("message")
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            text = choice.get("text")
            if text:
                await relay.send(text)
            reason = choice.get("finish_reason")
            if reason:
                state.finish_reason = str(reason)

    async def _finish(self, upstream: UpstreamState, state: _StreamState) -> Literal["stop", "length"]:
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
            raise self._failed(upstream, f"upstream {upstream.url} is shutting down{detail}")
        if reason == "error":
            raise _Retry(BackendError(f"upstream {upstream.url} failed{detail}"))
        logger.warning(
            "upstream %s ended a stream with finish_reason %r; reporting 'stop'", upstream.url, reason
        )
        return "stop"

    async def _refused(self, upstream: UpstreamState, status: int, chunks: AsyncIterator[bytes]) -> None:
        """Map a non-200 answer to our error (always raises)."""
        data = b""
        try:
            with trio.move_on_after(_TAIL_TIMEOUT):
                async for chunk in chunks:
                    data += chunk
                    if len(data) >= _MAX_ERROR_BODY:
                        break
        except httpx.TransportError:
            pass
        message, param, code = _error_fields(data, status)
        if status in _UNAVAILABLE_STATUSES:
            raise self._failed(upstream, f"upstream {upstream.url} answered {status}: {message}")
        self._healthy(upstream)  # it answered: it is up, whatever it thinks of the request
        if status == 429:
            raise _Retry(OverloadedError(f"the upstream servers are overloaded: {message}"))
        if status >= 500 or status in (401, 403, 404, 405):
            # its failure, or our configuration (key, URL, model): not the client's fault
            raise _Retry(BackendError(f"upstream {upstream.url} answered {status}: {message}"))
        if code == "context_length_exceeded":
            raise ContextLengthError(message, param=param)
        raise InvalidRequestError(message, param=param, code=code)

    def _healthy(self, upstream: UpstreamState) -> None:
        if upstream.failed_until is not None:
            logger.info("upstream %s is back", upstream.url)
        upstream.failed_until = None
        upstream.last_error = None

    def _failed(self, upstream: UpstreamState, message: str) -> _Retry:
        """Put the upstream in its cooldown; return the error to raise."""
        upstream.failures += 1
        upstream.last_error = message
        if upstream.failed_until is None:
            logger.warning("%s; skipping it for %g s", message, self.cooldown)
        upstream.failed_until = trio.current_time() + self.cooldown
        return _Retry(BackendError(message))


@dataclass(kw_only=True, slots=True)
class _StreamState:
    done: bool = False
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None
    message: str | None = None


class _Relay:
    """Hands text to the engine's channel; remembers whether any reached the client."""

    __slots__ = ("progress", "send_channel", "sent", "sent_at")

    def __init__(self, send: PieceChannel, progress: GenerationProgress) -> None:
        self.send_channel = send
        self.progress = progress
        self.sent = False
        self.sent_at = 0.0

    async def send(self, text: str) -> None:
        progress = self.progress
        if not self.sent:
            # time to the first token, upstream queueing included
            progress.prefill_seconds = time.perf_counter() - self.sent_at
        progress.completion_tokens += 1  # one chunk ≈ one token, until the usage chunk
        await self.send_channel.send(text.encode())
        self.sent = True


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


def _base_url(url: str) -> str:
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
