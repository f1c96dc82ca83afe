"""The generation endpoints (``POST /v1/completions``, ``/v1/chat/completions``), served
at the ASGI level: one request's whole life in one cancel scope.

:class:`GenerationHandler` runs each request inside its
:class:`~trioserve._http._request.InFlightRequest`'s scope, with a disconnect watcher, a
stall timer (shielded until the body is done) and, for streams, a heartbeat until the
first event. Every cause cancels that scope (the first recorded wins); when the handler
returns, the request's inference has returned and its slot is free. A response that
ended on its own is sent in full (shielded, bounded by the stall timeout); a deadline or
shutdown gets a final event within ``FINAL_EVENT_TIMEOUT``. Why the ASGI level, and
every bound: ``docs/architecture.md``, ``docs/cancellation.md``.
"""

import dataclasses
import functools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated

import msgspec
import trio

from .._core._backend import PreparedPrompt
from .._core._engine import Engine
from .._core._errors import unwrap_group
from .._core._exceptions import (
    ContextLengthError,
    HeadersTooLargeError,
    InvalidRequestError,
    MethodNotAllowedError,
    OverloadedError,
    PermissionDeniedError,
    ServiceUnavailableError,
    TrioserveError,
)
from .._core._media import RemoteImage
from .._core._registry import ModelEntry
from .._core._tracing import TRACEPARENT
from .._core._types import EndCause, GenerationRequest
from .._wire import (
    SPECS,
    ChatFormat,
    Dialect,
    DialectSpec,
    ParsedRequest,
    ReadOptions,
    StoredAsk,
    StoredContext,
    decode,
    encode_json,
    responses_reply,
)
from ._access import AccessPolicy, key_salt, presented_key
from ._accounting import ENDPOINTS as ENDPOINT_PATHS
from ._accounting import log_request
from ._detach import DetachController, DetachedStream, log_sink
from ._errors import renderer
from ._event_store import EventRecorder
from ._exchange import (
    Exchange,
    Receive,
    Scope,
    Send,
    _check_content_type,
    _ClientGone,
    _header,
    _keep_alive,
    _peek_head,
    _read_body,
    _request_timeout,
    headers_too_large,
)
from ._fetch import resolve_images
from ._following import follow
from ._lifecycle import (
    FINAL_EVENT_TIMEOUT,
    INLINE_PARSE_BYTES,
    Heartbeat,
    off_the_loop_if,
    send_last,
    watch_disconnect,
    watch_stall,
)
from ._overflow import prepare_fitting
from ._request import InFlightRequest, Kind, Phase
from ._settings import HTTPSettings
from ._state import ServerState
from ._stored import BackgroundJob
from ._writing import ResponseWriter

__all__ = [
    "FINAL_EVENT_TIMEOUT",
    "GENERATION_PATHS",
    "GenerationHandler",
    "cache_salt",
    "key_salt",
    "presented_key",
    "valid_id",
]

logger = logging.getLogger("trioserve.http")

GENERATION_PATHS: dict[str, Kind] = {
    "/v1/completions": "text",
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    "/infill": "infill",
    "/api/chat": "ollama_chat",
    "/api/generate": "ollama_generate",
}

#: each generation route's dialect, picked once per request at the route
_SPECS: dict[Kind, DialectSpec] = {kind: SPECS[path] for path, kind in GENERATION_PATHS.items()}
_SPECS["transcription"] = SPECS["/v1/audio/transcriptions"]  # (reached through its form's reader)

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def stream_headers(spec: DialectSpec) -> list[tuple[bytes, bytes]]:
    """A streamed answer's headers: its dialect's media type (SSE; Ollama's NDJSON),
    never cached, never buffered by a proxy."""
    return [(b"content-type", spec.media_type.encode()), *SSE_HEADERS[1:]]


class _CacheSaltField(msgspec.Struct):
    #: vLLM's field, top level in every dialect's body (docs/operations.md)
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None


_salt_decoder = msgspec.json.Decoder(_CacheSaltField)


class _StreamField(msgspec.Struct):
    stream: bool | None = None


_stream_decoder = msgspec.json.Decoder(_StreamField)


def cache_salt(scope: Scope, body: bytes, access: AccessPolicy | None) -> str:
    """The request's ``GenerationRequest.cache_salt``: the body's ``cache_salt``
    (``"salt:…"``: whoever sends the same one shares a cache, whatever their key); else,
    where API keys are required, one per key (``"key:…"``, a hash: the key itself is
    never kept); else empty (one shared cache). A ``cache_salt`` that is not a string of
    1 to 256 characters is refused (400)."""
    if b'"cache_salt"' in body:  # (a second decode only for the bodies that name it)
        given = decode(_salt_decoder, body).cache_salt
        if given is not None:
            return "salt:" + given
    return key_salt(scope, access)


#: a client's request and session ids: what they may hold
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")
_ID_RULE = "{name} must be 1 to 128 letters, digits, '.', '_', ':' or '-'"


def valid_id(value: str) -> bool:
    """Whether ``value`` may be a request's or a session's id."""
    return 0 < len(value) <= 128 and set(value) <= _ID_CHARS


async def _nowhere(_message: object) -> None:
    """The ``send`` of a background response: no connection holds it."""


async def _never_disconnects() -> dict[str, object]:
    """The ``receive`` of a background response: nobody leaves (cancel it by id)."""
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def _check_limits(prepared: PreparedPrompt, settings: HTTPSettings, dialect: Dialect) -> PreparedPrompt:
    """The server's own limits, on top of what fits the context (a request whose
    ``max_tokens`` is only an upper bound, Anthropic's, is held to the limit instead, and
    its dialect told)."""
    limit = settings.max_prompt_tokens
    if limit is not None and len(prepared.tokens) > limit:
        raise ContextLengthError(
            f"the prompt has {len(prepared.tokens)} tokens; this server accepts at most {limit}",
            param="prompt",
        )
    limit = settings.max_tokens_limit
    if limit is not None and prepared.max_new_tokens > limit and prepared.request.clamp_max_tokens:
        dialect.limit_max_tokens(limit)
        return dataclasses.replace(prepared, max_new_tokens=limit)
    if limit is not None and prepared.max_new_tokens > limit:
        asked = prepared.request.max_tokens
        raise InvalidRequestError(
            f"max_tokens may be at most {limit} on this server"
            + (f"; got {asked}" if asked is not None else "; set max_tokens"),
            param="max_tokens",
        )
    return prepared


class GenerationHandler:
    """Serves one generation request from parse to final byte."""

    def __init__(self, state: ServerState, access: AccessPolicy | None = None) -> None:
        self.state = state
        #: the API keys: each key's prompt cache is its own (``cache_salt``)
        self.access = access
        self.writer = ResponseWriter(state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        spec = _SPECS[kind]
        given = _header(scope, b"x-request-id")
        valid = given is not None and valid_id(given)
        exchange = Exchange(send, given if given is not None and valid else uuid.uuid4().hex, renderer(spec))
        request = InFlightRequest(scope, exchange, kind)
        request.owner = self.owner(scope)

        async def serve() -> None:
            limit = self.state.settings.max_header_bytes
            if headers_too_large(scope, limit):
                raise HeadersTooLargeError(f"the request headers exceed the limit of {limit} bytes")
            if given is not None and not valid:
                raise InvalidRequestError(_ID_RULE.format(name="X-Request-Id"), param="X-Request-Id")
            session = _header(scope, b"x-session-id")
            if session is not None and not valid_id(session):
                raise InvalidRequestError(_ID_RULE.format(name="X-Session-Id"), param="X-Session-Id")
            request.session = session
            if scope["method"] != "POST":
                raise MethodNotAllowedError(f"{scope['path']} accepts POST only, not {scope['method']}")
            await self._serve(request, receive, spec)

        await self._handle(request, serve)

    async def _handle(self, request: InFlightRequest, serve: Callable[[], Awaitable[None]]) -> None:
        """Run ``serve`` as ``request``'s life: an error answered (or, once its stream
        began, its final event), the cause recorded, its log line, charge and span."""
        exchange = request.exchange
        tracing = self.state.tracing
        tracing.begin(request, ENDPOINT_PATHS[request.kind])
        # (the request's child tasks inherit it: its upstream calls carry the trace)
        traced = TRACEPARENT.set(request.traceparent)
        try:
            await serve()
        except _ClientGone:
            request.end("disconnect")
        except TrioserveError as exc:
            if isinstance(exc, OverloadedError):
                cause: EndCause = "overloaded"
            elif isinstance(exc, ServiceUnavailableError) and self.state.shutting_down:
                cause = "shutdown"
            else:
                cause = "error"
            request.end(request.cause or cause, exc.message)
            request.advance(Phase.FINISHING)
            if not exchange.started:
                await exchange.error(exc)
            elif request.dialect is not None and not exchange.ended:
                # the stream had started (e.g. refused by a race for the last queue place)
                final = exchange.take_unsent() + request.dialect.stream_error(exc)
                await send_last(request, FINAL_EVENT_TIMEOUT, lambda: exchange.body(final, more=False))
        except BaseException as exc:
            # Cancelled from outside the request's scope (hypercorn closing connections
            # at the end of a shutdown: a group of Cancelled), or a bug: record, re-raise.
            if request.cause is None:
                request.end("error" if isinstance(exc, Exception) else "shutdown")
            raise
        finally:
            TRACEPARENT.reset(traced)
            request.advance(Phase.DONE)
            usage = log_request(self.state.metrics, request)
            if usage is not None and request.account is not None:
                self.state.accounts.charge(request.owner, request.account, usage.completion_tokens)
            tracing.end(request, usage)
            request.done.set()

    async def _serve(self, request: InFlightRequest, receive: Receive, spec: DialectSpec) -> None:
        state = self.state
        scope = request.asgi
        _check_content_type(scope)
        # (a transcription's form, read and bounded already: its own limit)
        limit = scope.get("trioserve.body_limit", state.settings.max_body_bytes)
        body = await _read_body(scope, receive, limit, state.settings.body_timeout)
        # which model: refused (404, 503 shutting down) before any work
        # (a large body's depth check and decode: off the event loop)
        large = len(body) > INLINE_PARSE_BYTES
        head = await off_the_loop_if(large, _peek_head, body)
        resolve_model = spec.resolve_model
        if resolve_model is None:
            entry, _ = state.resolve_adapter(head.model)  # (a LoRA adapter's name: its base's)
        else:  # (the dialect's names: Ollama's name:latest)
            entry = resolve_model(head.model, state.resolve)
        request.model = entry.name
        request.set_timeout(_request_timeout(scope, state.settings))
        conversation = self._conversation_id(request, body, spec)
        self._admit(request, entry, head.priority)
        ask = None
        if state.responses is not None and spec.peek_stored is not None:
            peek = spec.peek_stored
            ask = await off_the_loop_if(large, peek, body)
            if ask.background and conversation is not None:
                raise InvalidRequestError(
                    "a background response is resumed by its id (GET /v1/responses/{id}?stream=true): "
                    "send it without X-Conversation-Id",
                    param="X-Conversation-Id",
                )
            if ask.background:
                await self._start_background(request, receive, spec, body, entry, ask)
                return
        if conversation is not None:
            await self._start_detached(request, receive, spec, body, entry, ask, conversation)
            return
        await self._run(request, receive, spec, body, entry, ask)

    def _conversation_id(self, request: InFlightRequest, body: bytes, spec: DialectSpec) -> str | None:
        """A detachable stream's id (llama-server's ``X-Conversation-Id``), checked:
        a valid id, on a streaming request, on a server that keeps them (400s naming
        the header)."""
        scope = request.asgi
        if _header(scope, b"last-event-id") is not None:
            raise InvalidRequestError(
                "Last-Event-ID resumes a stream on GET /v1/stream or GET /v1/responses/{id}?stream=true; "
                "a POST starts a new one",
                param="Last-Event-ID",
            )
        conversation = _header(scope, b"x-conversation-id")
        if conversation is None:
            return None
        if not valid_id(conversation):
            raise InvalidRequestError(_ID_RULE.format(name="X-Conversation-Id"), param="X-Conversation-Id")
        if not spec.resumable:
            raise InvalidRequestError(
                f"X-Conversation-Id makes a server-sent-events stream resumable; {request.asgi['path']} "
                "streams NDJSON, which cannot be resumed: send the request without it",
                param="X-Conversation-Id",
            )
        if self.state.detached is None:
            raise InvalidRequestError(
                "this server keeps no detachable streams (--detach-max 0): send the request without "
                "X-Conversation-Id",
                param="X-Conversation-Id",
            )
        if not decode(_stream_decoder, body).stream:
            raise InvalidRequestError(
                'X-Conversation-Id makes a stream resumable: it needs "stream": true (a whole answer '
                "cannot be resumed; send it without the header)",
                param="X-Conversation-Id",
            )
        return conversation

    async def _start_detached(
        self,
        request: InFlightRequest,
        receive: Receive,
        spec: DialectSpec,
        body: bytes,
        entry: ModelEntry,
        ask: StoredAsk | None,
        conversation: str,
    ) -> None:
        """A detachable stream (docs/resumable-streams.md): its job starts in the
        detached streams' nursery, writing into the stream's log; this request's
        connection becomes its first reader. Its end (a disconnect, a stall) ends the
        reading, never the job."""
        detached = self.state.detached
        assert detached is not None
        stream = detached.open(request.owner, conversation, request.account)
        exchange = Exchange(log_sink(stream.log), request.exchange.request_id, request.exchange.render)
        # (the key's x-ratelimit-* go out on the reader's own exchange, once)
        exchange.extra_headers = [(b"x-conversation-id", conversation.encode())]
        job = InFlightRequest(request.asgi, exchange, request.kind)
        job.owner, job.account, job.session = request.owner, request.account, request.session
        job.model = request.model
        job.cancel_scope.deadline = request.cancel_scope.deadline
        stream.job = job
        request.model = entry.name
        await self._detach(request, receive, stream, spec, body, entry, ask)

    async def _detach(
        self,
        request: InFlightRequest,
        receive: Receive,
        stream: DetachedStream,
        spec: DialectSpec,
        body: bytes,
        entry: ModelEntry,
        ask: StoredAsk | None,
        background: BackgroundJob | None = None,
    ) -> None:
        """Start ``stream``'s job in the detached streams' nursery; ``request``'s
        connection follows its log, its first reader."""
        detached = self.state.detached
        assert detached is not None
        assert stream.job is not None
        cursor = stream.log.attach(0)
        detached.nursery.start_soon(self._detached_job, stream, spec, body, entry, ask, background)
        await follow(
            request,
            stream.log,
            cursor,
            receive,
            stall_timeout=self.state.stall_timeout,
            job_id=stream.job.exchange.request_id,
        )

    async def _detached_job(
        self,
        stream: DetachedStream,
        spec: DialectSpec,
        body: bytes,
        entry: ModelEntry,
        ask: StoredAsk | None,
        background: BackgroundJob | None,
    ) -> None:
        """A detachable stream's job, to its end (a background response's: its end
        stored); then its log is kept for readers."""
        detached = self.state.detached
        assert detached is not None
        job = stream.job
        assert job is not None
        log = stream.log
        service = self.state.responses
        recorder = None
        if background is not None and service is not None:
            # (its events kept in the store as they come, in batches: _event_store)
            recorder = EventRecorder(service, background.turn.id, background.owner)
            log.on_event = recorder.add

        async def serve() -> None:
            with unwrap_group():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(DetachController(detached, stream).run)
                    if recorder is not None:
                        nursery.start_soon(recorder.run)
                    try:
                        await self._run(job, _never_disconnects, spec, body, entry, ask, detached=True)
                    finally:
                        nursery.cancel_scope.cancel()

        try:
            await self._handle(job, serve)
        except Exception:
            logger.exception("detached stream %s failed", job.exchange.request_id)
        finally:
            with trio.CancelScope(shield=True):
                if recorder is not None:
                    log.on_event = None
                    await recorder.close()  # (its last events, before its end is stored)
                if background is not None and service is not None:
                    await service.settle(background)
                    background.done.set()
            if not log.closed:  # (readers wait for the end: it is always written)
                if not log.head_set.is_set():
                    log.set_head(500, [])
                if not log.finished:
                    log.append_nowait(b"", last=True)
        await detached.keep(stream)

    async def _run(
        self,
        request: InFlightRequest,
        receive: Receive,
        spec: DialectSpec,
        body: bytes,
        entry: ModelEntry,
        ask: StoredAsk | None,
        *,
        detached: bool = False,
    ) -> None:
        """The request's life in its scope, from the model's lease to its last byte
        (``detached``: a detachable stream's job, whose sends go to its log: a full log
        is the designed pause, never a stall)."""
        state = self.state
        scope = request.asgi
        keep_alive = self._keep_alive(scope, spec, body)

        with request.cancel_scope:
            state.add_request(request)
            try:
                with unwrap_group():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(watch_disconnect, receive, request)
                        # The stall timer outlives a cancel of the request: a cancelled
                        # consumer stuck in hypercorn's (shielded) send is freed only by
                        # ending the connection. Stopped when the body is done.
                        stall_scope = trio.CancelScope(shield=True)
                        stall_timeout = (
                            math.inf if state.stall_timeout is None or detached else state.stall_timeout
                        )
                        nursery.start_soon(watch_stall, request, stall_timeout, stall_scope)
                        try:
                            # the stored conversation it continues (a thread's read)
                            stored = None
                            if ask is not None and state.responses is not None:
                                stored = await state.responses.context(
                                    ask.previous_response_id,
                                    self.owner(scope),
                                    request.exchange.request_id if ask.background else None,
                                )
                            # the model, loaded (a load waits inside this request's
                            # deadline; a disconnect leaves it: docs/models.md)
                            if entry.state != "loaded":
                                request.advance(Phase.LOADING)
                            lease = await state.lease(entry, request, keep_alive)
                            try:
                                # (a pinned model stays whatever the request asks)
                                ttl = None if entry.spec.pinned else keep_alive
                                await self._generate(request, lease.engine, body, spec, stored, ttl)
                            finally:
                                lease.release()
                            nursery.cancel_scope.cancel()  # the watcher: this request is done
                        finally:
                            stall_scope.cancel()
            finally:
                state.remove_request(request)
                if request.reservation is not None:
                    request.reservation.release()  # never reached the queue (idempotent)

        if request.delivered:
            return  # the last byte went out before any cancel could matter
        if request.cancel_scope.cancelled_caught or request.cause is not None:
            request.note_deadline()  # no-op if another cause came first
            await self.writer.cancelled(request)

    def _keep_alive(self, scope: Scope, spec: DialectSpec, body: bytes) -> float | None:
        """The model's TTL after this request: the body's (Ollama's ``keep_alive``), else
        ``X-Keep-Alive``'s. Like the header (checked by the access layer), a body's
        needs an admin key where keys are required (403 naming it)."""
        peek = spec.peek_keep_alive
        given = None if peek is None else peek(body)
        if given is None:
            return _keep_alive(scope)
        access = self.access
        if access is not None and access.requires_key and not access.key_is_admin(presented_key(scope) or ""):
            raise PermissionDeniedError(
                "keep_alive sets how long the model stays loaded for every client: it needs an admin "
                "key (--admin-key); send the request without it",
                param="keep_alive",
            )
        return given

    def _admit(self, request: InFlightRequest, entry: ModelEntry, priority: int | None) -> None:
        """Its key's bound on priorities (403), its rate limits (429 with
        ``x-ratelimit-*``) and, where the model is loaded, its queue (429 at capacity):
        before any expensive work — a stored conversation's read, a model load, the
        full parse, a background response's record. (The queue is checked again after
        the parse, inside the request's deadline.)"""
        accounts = self.state.accounts
        account = request.account = accounts.account(self._key(request.asgi))
        accounts.ticket(account, request.owner, priority)  # (403 before a rate token is taken)
        request.exchange.extra_headers = accounts.admit(request.owner, account)
        engine = entry.engine
        if engine is not None:
            engine.admission.check()

    def _key(self, scope: Scope) -> str | None:
        """The API key the request presented, where keys are required (checked by the
        access layer already); ``None`` otherwise."""
        if self.access is None or not self.access.requires_key:
            return None
        return presented_key(scope)

    def owner(self, scope: Scope) -> str:
        """Whose stored responses a request may read: its API key's (a hash), or
        everyone's (``""``) where no keys are required."""
        return key_salt(scope, self.access)

    async def _start_background(
        self,
        request: InFlightRequest,
        receive: Receive,
        spec: DialectSpec,
        body: bytes,
        entry: ModelEntry,
        ask: StoredAsk,
    ) -> None:
        """A background response: checked, stored as ``queued`` and started as a
        request no connection holds. Without ``stream`` (in the store's nursery) this
        request answers with the queued response object at once (docs/dialects.md,
        "Stored responses"); with it, its job writes into a detachable stream keyed by
        the response id, and this request's connection is its first reader
        (docs/resumable-streams.md)."""
        service = self.state.responses
        assert service is not None
        detached = self.state.detached if ask.stream else None
        if ask.stream and detached is None:
            raise InvalidRequestError(
                "background with stream needs resumable streams, and this server keeps none "
                "(--detach-max 0): poll GET /v1/responses/{id}, or send stream without background",
                param="stream",
            )
        owner = self.owner(request.asgi)
        response_id = "resp_" + uuid.uuid4().hex
        stored = await service.context(ask.previous_response_id, owner, response_id)
        options = self._options(stored)
        large = len(body) > INLINE_PARSE_BYTES
        turn, queued = await off_the_loop_if(large, responses_reply, body, options)
        # (its bounds: a 429 before anything is stored)
        account = request.account
        stream = None if detached is None else detached.open(owner, response_id, account, param="stream")
        # its own request: its own scope, deadline and log line; nothing to send to,
        # or its stream's log
        send = _nowhere if stream is None else log_sink(stream.log)
        exchange = Exchange(send, response_id, renderer(spec))
        job_request = InFlightRequest(request.asgi, exchange, "responses")
        job_request.owner = owner
        job_request.account = request.account  # (its limits were taken by this request)
        if stream is None:
            self.state.tracing.begin(job_request, "/v1/responses")
        job_request.model = entry.name
        job_request.cancel_scope.deadline = request.cancel_scope.deadline
        job = BackgroundJob(turn, owner, queued, job_request)
        if not await service.record(turn, owner, queued, streamed=stream is not None):
            if stream is not None and detached is not None:
                detached.drop(stream)
            # nothing could be polled: refused before any generation (the log says why)
            raise ServiceUnavailableError(
                "the response store cannot keep a background response now (see /health); "
                "retry later, or send it without background",
                code="store_unavailable",
            )
        service.jobs[response_id] = job
        if stream is not None:
            stream.background = True
            stream.job = job_request
            request.model = entry.name
            ask = StoredAsk(turn.previous_id, background=True, stream=True)
            await self._detach(request, receive, stream, spec, body, entry, ask, job)
            return
        service.nursery.start_soon(self._background, job, spec, body, entry)
        request.end("stop")
        request.delivered = True
        request.watch_scope.cancel()
        await request.exchange.json(200, encode_json(queued))

    async def _background(
        self, job: BackgroundJob, spec: DialectSpec, body: bytes, entry: ModelEntry
    ) -> None:
        """Run a background response to its end, then store how it ended. Never raises
        into the server's nursery but to stop (a bug is logged and stored as a failure)."""
        service = self.state.responses
        assert service is not None
        assert job.request is not None
        request = job.request
        TRACEPARENT.set(request.traceparent)  # (this task's own context: the job's trace)
        try:
            ask = StoredAsk(job.turn.previous_id, background=True)
            await self._run(request, _never_disconnects, spec, body, entry, ask)
        except TrioserveError as exc:
            request.end(request.cause or "error", exc.message)
        except Exception as exc:
            logger.exception("background response %s failed", job.turn.id)
            request.end("error", f"{type(exc).__name__}: {exc}")
        except BaseException:  # cancelled from outside its scope: the server is stopping
            if request.cause is None:
                request.end("shutdown")
            raise
        finally:
            request.advance(Phase.DONE)
            with trio.CancelScope(shield=True):
                # (a store, log or export failure is logged: never the server's nursery's)
                await service.settle(job)
                try:
                    usage = log_request(self.state.metrics, request)
                    account = request.account
                    if usage is not None and account is not None:
                        # its reply, against its key's tokens per minute (its prompt
                        # was charged when prepared), as in the foreground
                        self.state.accounts.charge(request.owner, account, usage.completion_tokens)
                    self.state.tracing.end(request, usage)
                except Exception:
                    logger.exception("background response %s: its log line failed", job.turn.id)
                request.done.set()
                job.done.set()

    async def _generate(
        self,
        request: InFlightRequest,
        engine: Engine,
        body: bytes,
        spec: DialectSpec,
        stored: StoredContext | None = None,
        keep_alive: float | None = None,
    ) -> None:
        """Parse, prepare and run the request on its model's engine."""
        state = self.state
        exchange = request.exchange
        chat_format = state.chat_format(engine)
        # decoding a large body, rendering a long chat: off the event loop
        large = len(body) > INLINE_PARSE_BYTES
        options = dataclasses.replace(
            self._options(stored),
            arrived=request.started,
            load_seconds=request.load_wait or 0.0,
            context_length=engine.backend.info.context_length,
            keep_alive=keep_alive,
        )
        parsed = await off_the_loop_if(large, self._parse, spec, body, chat_format, options)
        stream, request.model = parsed.stream, parsed.model
        turn, service = parsed.turn, state.responses
        if turn is not None and service is not None:
            # stored before its last bytes go out (ResponseWriter._end); a failed
            # write is logged and counted, the answer sent all the same
            request.on_end = functools.partial(service.record_end, turn, self.owner(request.asgi))
            job = service.jobs.get(turn.id)
            if job is not None:
                job.turn = turn  # (the dialect that writes it: its final state is stored)
        slots = engine.admission.slots
        if parsed.choices > slots:
            if len(parsed.generations) == 1:
                raise InvalidRequestError(
                    f"n may be at most {slots} on this server (its number of slots); got {parsed.n}",
                    param="n",
                )
            raise InvalidRequestError(
                f"a batch of {len(parsed.generations)} prompts × n={parsed.n} needs "
                f"{parsed.choices} slots at once; this server has {slots}: send fewer prompts per request",
                param="prompt",
            )
        dialect = request.dialect = parsed.dialect
        dialect.request_id = exchange.request_id
        if parsed.loads_only:  # (Ollama's empty prompt: the model is loaded, nothing runs)
            await self.writer.loaded(request, parsed)
            return
        first_token = parsed.generation.first_token_timeout
        if first_token is not None:
            request.limit_first_token(first_token)
        # its place in the queue (its key's rate limits were taken before any work)
        accounts = state.accounts
        account = request.account
        assert account is not None  # (GenerationHandler._admit)
        ticket = request.ticket = accounts.ticket(account, request.owner, parsed.priority)
        salt = cache_salt(request.asgi, body, self.access)
        generations = [dataclasses.replace(g, cache_salt=salt) if salt else g for g in parsed.generations]
        named = parsed.model if spec.resolve_model is None else None  # (Ollama's names: no adapters)
        adapter = state.resolve_adapter(named)[1] if named else None
        if adapter is not None:  # (``model`` names a LoRA adapter: docs/lora.md)
            generations = [dataclasses.replace(g, lora=((adapter, None), *g.lora)) for g in generations]
        request.advance(Phase.QUEUED)
        # a server at capacity refuses before tokenizing or compiling a constraint
        engine.admission.check()
        info = engine.backend.info
        if any(g.images for g in generations) and (info.vision or info.audio):
            # image URLs fetched, local files read: inside the request's scope (a client
            # that leaves cancels them), before the prompt is laid out (docs/vision.md);
            # never for a model that cannot see them (its prepare refuses them). Its
            # place in the queue is held first: at most slots + --max-queue requests
            # fetch and decode images at once, and a full server refuses before any.
            request.reservation = engine.admission.reserve()
            generations = [await self._with_images(g) for g in generations]
        settings = state.settings

        async def prepare(generation: GenerationRequest) -> PreparedPrompt:
            return _check_limits(await engine.prepare(generation), settings, parsed.dialect)

        try:
            if len(generations) == 1:
                # (a conversation too long for the context: its overflow policy)
                prompt, dropped = await prepare_fitting(
                    engine.backend,
                    prepare,
                    generations[0],
                    parsed.truncation,
                    settings.max_prompt_tokens,
                    exchange.request_id,
                )
                prompts = [prompt]
                if dropped is not None:
                    exchange.extra_headers.append((b"x-truncated-turns", str(dropped.turns).encode()))
            else:
                prompts = [await prepare(generation) for generation in generations]
        except InvalidRequestError as exc:
            spec.rename(exc)  # (the engine's names, as the dialect calls them)
            raise
        accounts.charge(request.owner, account, sum(len(p.tokens) for p in prompts))
        with unwrap_group():
            async with trio.open_nursery() as nursery:
                heartbeat = None
                if stream:
                    # Refuse (429) while a status code can still say so, and hold the
                    # place; then start the stream, so heartbeats can flow while queued
                    # and in prefill.
                    if request.reservation is None:
                        request.reservation = engine.admission.reserve()
                    await exchange.start(200, stream_headers(spec))
                    opening = dialect.opening(sum(len(p.tokens) for p in prompts))
                    if opening:
                        await exchange.body(opening)
                    interval = state.settings.heartbeat_interval
                    if interval:
                        # (read at each beat: a dialect may stamp it, Ollama's line its time)
                        heartbeat = Heartbeat(exchange, interval, lambda: dialect.heartbeat)
                        nursery.start_soon(heartbeat.run)
                async with engine.stream_choices(
                    prompts if len(prompts) > 1 else prompts[0],
                    parsed.n,
                    reservation=request.reservation,
                    ticket=ticket,
                ) as choices:
                    request.events, request.choices = choices[0], choices
                    if stream and parsed.plain:
                        await self.writer.stream(request, choices[0], heartbeat)
                    elif stream:
                        await self.writer.stream_choices(request, parsed, heartbeat)
                    else:
                        await self.writer.collect(request, parsed)
                nursery.cancel_scope.cancel()  # the heartbeat

    async def _with_images(self, generation: GenerationRequest) -> GenerationRequest:
        if not any(isinstance(image, RemoteImage) for image in generation.images):
            return generation
        images = await resolve_images(generation.images, self.state.settings.media)
        return dataclasses.replace(generation, images=images)

    def _options(self, stored: StoredContext | None) -> ReadOptions:
        settings = self.state.settings
        return ReadOptions(
            limits=settings.request_limits,
            model_name=self._model,
            keep_billing_header=settings.keep_billing_header,
            stored=stored,
            truncation=settings.truncation,
        )

    def _parse(
        self, spec: DialectSpec, body: bytes, chat_format: ChatFormat, options: ReadOptions
    ) -> ParsedRequest:
        """The request, decoded by its route's dialect."""
        read = spec.read
        assert read is not None  # (every generation route has a decoder)
        return read(body, chat_format, options)

    def _model(self, requested: str | None) -> str:
        """The name the response carries: the model's own (an alias resolves to it), or
        the LoRA adapter's as it was asked for (vLLM's answer)."""
        entry, adapter = self.state.resolve_adapter(requested)
        return entry.name if adapter is None else str(requested)
