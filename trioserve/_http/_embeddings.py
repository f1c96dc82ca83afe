"""``POST /v1/embeddings``, at the ASGI level like the generation endpoints: the request
in one cancel scope (its deadline), a disconnect watcher, shutdown reaching it through
:class:`~trioserve._http._state.ServerState`, admitted through its model's embeddings
queue (429 when full), at most ``--max-embedding-tokens`` per request
(docs/embeddings.md)."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

import trio

from .._core._admission import DEFAULT_TICKET, Admission, Ticket
from .._core._backend import Backend
from .._core._exceptions import DeadlineExceededError, ServiceUnavailableError
from .._core._registry import ModelEntry
from .._wire import decode_embeddings_request, embeddings_inputs, embeddings_response
from ._access import AccessPolicy, key_salt
from ._accounting import log_request_counts
from ._direct_route import errors_answered, read_json_body, refuse_large_headers, refuse_unless_post
from ._errors import ErrorRenderer, render_error
from ._exchange import (
    Exchange,
    Receive,
    Scope,
    Send,
    _header,
    _keep_alive,
    _request_timeout,
)
from ._lifecycle import INLINE_PARSE_BYTES, watched
from ._request import InFlightRequest, Kind, Phase
from ._state import ServerState

__all__ = ["EMBEDDINGS_PATH", "EmbeddingsHandler", "RetrievalHandler"]

EMBEDDINGS_PATH = "/v1/embeddings"
#: responses of more numbers than this are JSON-encoded in a worker thread (about 1 MB
#: of JSON: tens of milliseconds of the event loop otherwise)
_INLINE_ENCODE_FLOATS = 64 * 1024


class RetrievalHandler:
    """One retrieval request (embeddings, rerank) from parse to final byte: the body,
    the model's lease, the model's retrieval queue, the backend's work and the answer,
    all in the request's one cancel scope. Subclasses say how to read, compute and
    answer."""

    #: the endpoint, as the log line and the metrics name it
    path = EMBEDDINGS_PATH
    #: the request's kind (``GET /v1/requests``)
    kind: Kind = "embeddings"
    #: what the request computes, for the 504/503 messages
    noun = "the embeddings"

    def __init__(self, state: ServerState, access: AccessPolicy | None = None) -> None:
        self.state = state
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(send, _header(scope, b"x-request-id") or uuid.uuid4().hex, self.renderer())
        request = InFlightRequest(scope, exchange, self.kind)
        request.owner = key_salt(scope, self.access)
        inputs_count = tokens_count = 0
        try:
            async with errors_answered(request):
                refuse_large_headers(scope, self.state.settings.max_header_bytes)
                refuse_unless_post(scope)
                inputs_count, tokens_count = await self._serve(request, receive)
        finally:
            self._log(request, inputs_count, tokens_count)

    # what a subclass says

    def parse(self, body: bytes, path: str) -> Any:
        """The body, read and checked (400s); it may run in a worker thread."""
        return decode_embeddings_request(body)

    def model_of(self, parsed: Any) -> str | None:
        model: str | None = parsed.model
        return model

    def resolve(self, parsed: Any) -> ModelEntry:
        """The model the request names (404 naming the models there are)."""
        return self.state.resolve(self.model_of(parsed))

    def keep_alive(self, scope: Scope, parsed: Any) -> float | None:
        """How long the model stays loaded after this request (``X-Keep-Alive``)."""
        return _keep_alive(scope)

    def renderer(self) -> ErrorRenderer:
        """How the route's errors are written (OpenAI's body)."""
        return render_error

    def count(self, parsed: Any) -> int:
        """Inputs (or documents) in the request, for the log line."""
        return len(embeddings_inputs(parsed))

    def ticket(self, request: InFlightRequest, parsed: Any) -> Ticket:
        return DEFAULT_TICKET

    async def compute(self, backend: Backend, parsed: Any) -> tuple[Any, int]:
        """The work: ``(result, tokens evaluated)``; cancelled with the request."""
        return await backend.embed_inputs(
            embeddings_inputs(parsed),
            dimensions=parsed.dimensions,
            max_tokens=self.state.settings.max_embedding_tokens,
        )

    def charge(self, request: InFlightRequest, tokens: int) -> None:
        """Count the tokens evaluated against the request's API key (none here)."""

    def encode(self, request: InFlightRequest, parsed: Any, result: Any, tokens: int) -> bytes:
        return embeddings_response(
            result, model=request.model or "", prompt_tokens=tokens, encoding=parsed.encoding_format
        )

    def path_of(self, request: InFlightRequest) -> str:
        """The endpoint as the log line and the metrics name it (one of a few)."""
        return self.path

    def encode_inline(self, result: Any) -> bool:
        """Whether the answer is small enough to encode on the event loop."""
        return sum(len(vector) for vector in result) <= _INLINE_ENCODE_FLOATS

    # the flow

    async def _serve(self, request: InFlightRequest, receive: Receive) -> tuple[int, int]:
        state = self.state
        scope, exchange = request.asgi, request.exchange
        body = await read_json_body(scope, receive, state.settings)
        if len(body) > INLINE_PARSE_BYTES:
            parsed = await trio.to_thread.run_sync(self.parse, body, scope["path"])
        else:
            parsed = self.parse(body, scope["path"])
        entry = self.resolve(parsed)
        request.model = entry.name
        inputs = self.count(parsed)
        ticket = request.ticket = self.ticket(request, parsed)
        keep_alive = self.keep_alive(scope, parsed)
        request.set_timeout(_request_timeout(scope, state.settings))
        result: Any = None
        count = 0
        with request.cancel_scope:
            request.advance(Phase.LOADING if entry.state != "loaded" else Phase.QUEUED)
            state.add_request(request)
            try:
                async with watched(request, receive, None):
                    lease = await state.lease(entry, request, keep_alive)
                    try:
                        request.advance(Phase.QUEUED)
                        admission = state.embeddings_admission(lease.engine)
                        # 429 when the queue is full or the deadline cannot be met
                        async with admission.slot(ticket=ticket):
                            started = time.perf_counter()
                            # the backend tokenizes, checks the limits before
                            # anything is evaluated, and computes — or forwards
                            # the inputs (the upstream relay)
                            result, count = await self.compute(lease.engine.backend, parsed)
                            _note_service_time(admission, time.perf_counter() - started)
                            self.charge(request, count)
                    finally:
                        lease.release()
            finally:
                state.remove_request(request)
        if request.cancel_scope.cancelled_caught or request.cause is not None:
            request.note_deadline()
            if request.cause == "deadline":
                raise DeadlineExceededError(f"the request's deadline passed before {self.noun} were done")
            if request.cause == "shutdown":
                raise ServiceUnavailableError("the server is shutting down; retry on another instance")
            if request.cause == "unload":
                raise ServiceUnavailableError(
                    f"the model {request.model!r} was unloaded before {self.noun} were done",
                    code="model_unloaded",
                )
            return inputs, 0  # the client has gone
        request.advance(Phase.FINISHING)
        encode = functools.partial(self.encode, request, parsed, result, count)
        if self.encode_inline(result):
            response = encode()
        else:
            response = await trio.to_thread.run_sync(encode)  # (millions of floats: off the loop)
        request.end("stop")
        request.delivered = True
        request.watch_scope.cancel()
        await exchange.json(200, response)
        return inputs, count

    def _log(self, request: InFlightRequest, inputs: int, tokens: int) -> None:
        path = self.path_of(request)
        log_request_counts(self.state.metrics, request, path, "inputs=%d prompt_tokens=%d", inputs, tokens)


class EmbeddingsHandler(RetrievalHandler):
    """``POST /v1/embeddings`` (the base's defaults)."""


def _note_service_time(admission: Admission, seconds: float) -> None:
    """Keep the embeddings queue's service-time estimate (an exponential average, as
    generation's engine keeps its own): what ``Retry-After`` and the refusal of a
    deadline that cannot be met are computed from."""
    previous = admission.expected_service_time
    admission.expected_service_time = seconds if previous == 0 else 0.8 * previous + 0.2 * seconds
