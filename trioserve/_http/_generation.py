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

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import trio

from .._core._backend import PreparedPrompt
from .._core._engine import Engine, EventStream
from .._core._errors import unwrap_group
from .._core._exceptions import (
    ContextLengthError,
    DeadlineExceededError,
    HeadersTooLargeError,
    InvalidRequestError,
    MethodNotAllowedError,
    OverloadedError,
    ServiceUnavailableError,
    TrioserveError,
)
from .._core._types import EndCause, Finished, GenerationRequest, TextDelta, TokenLogprob, Usage
from .._wire._anthropic import AnthropicDialect, decode_messages_request, messages_conversation
from .._wire._chat import ChatFormat
from .._wire._choices import ToolMode, finished_choice
from .._wire._conversation import generation_for
from .._wire._dialect import Dialect, OpenAIDialect
from .._wire._openai import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_generation,
    decode_chat_request,
    decode_completion_prompts,
)
from .._wire._responses import ResponsesDialect, decode_responses_request, responses_conversation
from ._access import AccessPolicy
from ._errors import render_anthropic_error, render_error
from ._exchange import (
    Exchange,
    Receive,
    Scope,
    Send,
    _check_content_type,
    _ClientGone,
    _header,
    _keep_alive,
    _peek_model,
    _read_body,
    _request_timeout,
    headers_too_large,
)
from ._hypercorn_patches import shut_down_connection
from ._request import InFlightRequest, Kind, Phase
from ._settings import HTTPSettings
from ._state import ServerState

__all__ = ["FINAL_EVENT_TIMEOUT", "GENERATION_PATHS", "GenerationHandler", "cache_salt", "presented_key"]

logger = logging.getLogger("trioserve.http")
request_logger = logging.getLogger("trioserve.requests")

GENERATION_PATHS: dict[str, Kind] = {
    "/v1/completions": "text",
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}

_ENDPOINTS = {kind: path for path, kind in GENERATION_PATHS.items()}

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

#: how long the final event of a cancelled stream may take to send (shielded)
FINAL_EVENT_TIMEOUT = 1.0
#: request bodies larger than this (bytes) are decoded (and chats rendered) in a worker
#: thread, so one big request cannot stall every stream
_INLINE_PARSE_BYTES = 64 * 1024


class _CacheSaltField(msgspec.Struct):
    #: vLLM's field, top level in every dialect's body (docs/operations.md)
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None


_salt_decoder = msgspec.json.Decoder(_CacheSaltField)


def presented_key(scope: Scope) -> str | None:
    """The API key a request presents, read as the access layer reads it
    (``Authorization: Bearer``, else ``x-api-key``); ``None``: none."""
    authorization = _header(scope, b"authorization")
    if authorization is not None:
        scheme, _, key = authorization.partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None
    api_key = _header(scope, b"x-api-key")
    return api_key.strip() if api_key is not None else None


def cache_salt(scope: Scope, body: bytes, access: AccessPolicy | None) -> str:
    """The request's ``GenerationRequest.cache_salt``: the body's ``cache_salt``
    (``"salt:…"``: whoever sends the same one shares a cache, whatever their key); else,
    where API keys are required, one per key (``"key:…"``, a hash: the key itself is
    never kept); else empty (one shared cache). A ``cache_salt`` that is not a string of
    1 to 256 characters is refused (400)."""
    if b'"cache_salt"' in body:  # (a second decode only for the bodies that name it)
        from .._wire import decode as _decode

        given = _decode(_salt_decoder, body).cache_salt
        if given is not None:
            return "salt:" + given
    if access is None or not access.requires_key:
        return ""
    key = presented_key(scope) or ""  # (checked already: the access layer let it in)
    digest = hashlib.sha256(b"trioserve cache salt\0" + key.encode()).hexdigest()
    return "key:" + digest[:32]


async def _watch_disconnect(receive: Receive, request: InFlightRequest) -> None:
    """Wait for the client to go away, then cancel the request. No polling: after the
    body, the next ASGI message is ``http.disconnect``. (If trioserve's stall timer
    ended the connection, the cause is already ``stall``; the first cause wins.)"""
    with request.watch_scope:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                request.cancel("disconnect")
                return


def _end_connection(scope: Scope) -> None:
    if scope.get("http_version") != "2":  # HTTP/2: cancelling ends just this stream
        shut_down_connection(scope.get("client"), scope.get("server"))


async def _send_last(
    request: InFlightRequest, bound: float, send: Callable[[], Awaitable[None]], *, watch_cancel: bool = False
) -> bool:
    """Run ``send()`` (the last bytes of a response) shielded from every cancel, and
    bounded: if it has not returned after ``bound`` seconds — or, with ``watch_cancel``,
    ``FINAL_EVENT_TIMEOUT`` after the request is cancelled — the connection is ended
    (HTTP/1.1: hypercorn's shielded send fails at once; HTTP/2: the send is cancelled).
    Returns whether the bytes went out."""
    cut = False
    with trio.CancelScope(shield=True) as shield:
        async with trio.open_nursery() as nursery:

            async def guard() -> None:
                nonlocal cut
                with trio.move_on_after(bound):
                    if watch_cancel:
                        with trio.move_on_at(request.cancel_scope.deadline):
                            await request.cancelled.wait()  # or the deadline passes
                        await trio.sleep(FINAL_EVENT_TIMEOUT)
                    else:
                        await trio.sleep_forever()
                cut = True
                request.connection_cut = True
                _end_connection(request.asgi)
                shield.cancel()

            nursery.start_soon(guard)
            await send()
            nursery.cancel_scope.cancel()
    return not cut and not (watch_cancel and request.connection_cut)


async def _watch_stall(request: InFlightRequest, stall_timeout: float, stall_scope: trio.CancelScope) -> None:
    """trioserve's stall timer: a send to this client that has been blocked for
    ``stall_timeout`` seconds ends the request with cause ``stall`` and the connection
    (shut down: the blocked send — shielded inside hypercorn — fails at once). Once the
    request is cancelled (any cause, the deadline included) a blocked send gets only
    ``FINAL_EVENT_TIMEOUT``: a client that is not reading cannot be told why anyway, and
    a cancelled request must not wait a whole stall timeout to let go.

    A timer, not a poll: it wakes when the send in progress would have stalled, when the
    request is cancelled or its deadline passes, or one timeout from now when nothing is
    sending (no send starting later can stall sooner)."""
    exchange = request.exchange
    with stall_scope:
        while True:
            now = time.perf_counter()
            left = request.cancel_scope.deadline - trio.current_time()
            cancelled = request.cause is not None or left <= 0
            limit = min(stall_timeout, FINAL_EVENT_TIMEOUT) if cancelled else stall_timeout
            since = exchange.sending_since
            if since is not None and now - since >= limit:
                request.cancel("stall")  # (a cause that came first is kept)
                request.connection_cut = True
                _end_connection(request.asgi)
                return
            wait = (since if since is not None else now) + limit - now
            if cancelled:
                await trio.sleep(wait)
            else:
                with trio.move_on_after(min(wait, left)):
                    await request.cancelled.wait()


def _check_limits(prepared: PreparedPrompt, settings: HTTPSettings, dialect: Dialect) -> PreparedPrompt:
    """The server's own limits, on top of what fits the context (a request whose
    ``max_tokens`` is only an upper bound, Anthropic's, is held to the limit instead)."""
    limit = settings.max_prompt_tokens
    if limit is not None and len(prepared.tokens) > limit:
        raise ContextLengthError(
            f"the prompt has {len(prepared.tokens)} tokens; this server accepts at most {limit}",
            param="prompt",
        )
    limit = settings.max_tokens_limit
    if limit is not None and prepared.max_new_tokens > limit and prepared.request.clamp_max_tokens:
        if isinstance(dialect, AnthropicDialect):
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


class _Heartbeat:
    """SSE comments while a started stream is silent before its first token (queued,
    long prefill), so proxies and clients see a live connection.

    One writer per response: the heartbeat task owns the response's ``send`` until the
    consumer's first write, which first calls :meth:`hand_over` — that stops the task
    and waits until it has returned, so two sends never overlap. A timer, not a poll:
    the task sleeps until the next moment a heartbeat is due."""

    def __init__(self, exchange: Exchange, interval: float, beat: bytes) -> None:
        self.exchange = exchange
        self.interval = interval
        self.beat = beat
        self.scope = trio.CancelScope()
        self.done = trio.Event()

    async def run(self) -> None:
        exchange = self.exchange
        try:
            with self.scope:
                while True:
                    await trio.sleep(max(0.0, exchange.last_sent + self.interval - time.perf_counter()))
                    await exchange.body(self.beat, keep_unsent=False)
        finally:
            self.done.set()

    async def hand_over(self) -> None:
        self.scope.cancel()
        await self.done.wait()


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A generation request, decoded: what to run and how to answer."""

    stream: bool
    #: one per prompt (``/v1/completions`` takes a batch)
    generations: tuple[GenerationRequest, ...]
    model: str
    #: how the response is written
    dialect: Dialect
    n: int = 1
    tool_mode: ToolMode = "none"
    tool_names: tuple[str, ...] = ()
    #: ``False``: at most one tool call per choice (parallel tool calls turned off)
    parallel_calls: bool = True
    #: a reasoning model's markers (its thinking is read out of the text), and whether
    #: the prompt opened its reasoning
    reasoning: tuple[str, str] | None = None
    inside: bool = False

    @property
    def generation(self) -> GenerationRequest:
        return self.generations[0]

    @property
    def choices(self) -> int:
        """The response's choices: ``n`` per prompt."""
        return self.n * len(self.generations)

    @property
    def plain(self) -> bool:
        """Text only, one choice: the hot path."""
        return (
            self.choices == 1
            and self.tool_mode == "none"
            and self.generation.logprobs is None
            and self.reasoning is None
        )


def _usage(choices: list[EventStream]) -> Usage:
    """The usage of a response: each prompt once (the first choice of each ``n``; the
    others shared its evaluation), the completions of every choice."""
    first = choices[0].usage
    if len(choices) == 1:
        return first
    prompts = [events for events in choices if events.choice_index == 0]
    return Usage(
        prompt_tokens=sum(events.usage.prompt_tokens for events in prompts),
        completion_tokens=sum(events.usage.completion_tokens for events in choices),
        cached_tokens=sum(events.usage.cached_tokens for events in prompts),
    )


class GenerationHandler:
    """Serves one generation request from parse to final byte."""

    def __init__(self, state: ServerState, access: AccessPolicy | None = None) -> None:
        self.state = state
        #: the API keys: each key's prompt cache is its own (``cache_salt``)
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        render = render_anthropic_error if kind == "messages" else render_error
        exchange = Exchange(send, _header(scope, b"x-request-id") or uuid.uuid4().hex, render)
        request = InFlightRequest(scope, exchange, kind)
        try:
            limit = self.state.settings.max_header_bytes
            if headers_too_large(scope, limit):
                raise HeadersTooLargeError(f"the request headers exceed the limit of {limit} bytes")
            if scope["method"] != "POST":
                raise MethodNotAllowedError(f"{scope['path']} accepts POST only, not {scope['method']}")
            await self._serve(request, receive)
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
                await _send_last(request, FINAL_EVENT_TIMEOUT, lambda: exchange.body(final, more=False))
        except BaseException as exc:
            # Cancelled from outside the request's scope (hypercorn closing connections
            # at the end of a shutdown: a group of Cancelled), or a bug: record, re-raise.
            if request.cause is None:
                request.end("error" if isinstance(exc, Exception) else "shutdown")
            raise
        finally:
            request.advance(Phase.DONE)
            self._log(request)

    async def _serve(self, request: InFlightRequest, receive: Receive) -> None:
        state = self.state
        scope = request.asgi
        _check_content_type(scope)
        body = await _read_body(scope, receive, state.settings.max_body_bytes, state.settings.body_timeout)
        # which model: refused (404, 503 shutting down) before any work
        # (a large body's depth check and decode: off the event loop)
        named = (
            await trio.to_thread.run_sync(_peek_model, body)
            if len(body) > _INLINE_PARSE_BYTES
            else _peek_model(body)
        )
        entry = state.resolve(named)
        request.model = entry.name
        keep_alive = _keep_alive(scope)
        request.set_timeout(_request_timeout(scope, state.settings))

        with request.cancel_scope:
            state.add_request(request)
            try:
                with unwrap_group():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_watch_disconnect, receive, request)
                        # The stall timer outlives a cancel of the request: a cancelled
                        # consumer stuck in hypercorn's (shielded) send is freed only by
                        # ending the connection. Stopped when the body is done.
                        stall_scope = trio.CancelScope(shield=True)
                        stall_timeout = math.inf if state.stall_timeout is None else state.stall_timeout
                        nursery.start_soon(_watch_stall, request, stall_timeout, stall_scope)
                        try:
                            # the model, loaded (a load waits inside this request's
                            # deadline; a disconnect leaves it: docs/models.md)
                            if entry.state != "loaded":
                                request.advance(Phase.LOADING)
                            lease = await state.lease(entry, request, keep_alive)
                            try:
                                await self._generate(request, lease.engine, body)
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
            await self._cancelled(request)

    async def _generate(self, request: InFlightRequest, engine: Engine, body: bytes) -> None:
        """Parse, prepare and run the request on its model's engine."""
        state = self.state
        exchange = request.exchange
        chat_format = state.chat_format(engine)
        if len(body) > _INLINE_PARSE_BYTES:
            # decoding a large body, rendering a long chat: off the event loop
            parsed = await trio.to_thread.run_sync(self._parse, request.kind, body, chat_format)
        else:
            parsed = self._parse(request.kind, body, chat_format)
        stream, request.model = parsed.stream, parsed.model
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
        salt = cache_salt(request.asgi, body, self.access)
        generations = [dataclasses.replace(g, cache_salt=salt) if salt else g for g in parsed.generations]
        request.advance(Phase.QUEUED)
        # a server at capacity refuses before tokenizing or compiling a constraint
        engine.admission.check()
        try:
            prompts = [
                _check_limits(await engine.prepare(generation), state.settings, parsed.dialect)
                for generation in generations
            ]
        except InvalidRequestError as exc:
            if request.kind == "responses" and exc.param == "max_tokens":
                # (the engine's name for it)
                exc.message = exc.message.replace("max_tokens", "max_output_tokens")
                exc.param = "max_output_tokens"
            raise
        with unwrap_group():
            async with trio.open_nursery() as nursery:
                heartbeat = None
                if stream:
                    # Refuse (429) while a status code can still say so, and hold the
                    # place; then start the stream, so heartbeats can flow while queued
                    # and in prefill.
                    request.reservation = engine.admission.reserve()
                    await exchange.start(200, SSE_HEADERS)
                    opening = dialect.opening(sum(len(p.tokens) for p in prompts))
                    if opening:
                        await exchange.body(opening)
                    interval = state.settings.heartbeat_interval
                    if interval:
                        heartbeat = _Heartbeat(exchange, interval, dialect.heartbeat)
                        nursery.start_soon(heartbeat.run)
                async with engine.stream_choices(
                    prompts if len(prompts) > 1 else prompts[0],
                    parsed.n,
                    reservation=request.reservation,
                ) as choices:
                    request.events, request.choices = choices[0], choices
                    if stream and parsed.plain:
                        await self._stream(request, choices[0], heartbeat)
                    elif stream:
                        await self._stream_choices(request, parsed, heartbeat)
                    else:
                        await self._collect(request, parsed)
                nursery.cancel_scope.cancel()  # the heartbeat

    def _parse(self, kind: Kind, body: bytes, chat_format: ChatFormat) -> _Parsed:
        if kind == "messages" or kind == "responses":
            return self._parse_conversation(kind, body, chat_format)
        assert kind == "text" or kind == "chat"  # (embeddings have their own handler)
        request: CompletionRequest | ChatCompletionRequest
        tool_mode: ToolMode = "none"
        names: tuple[str, ...] = ()
        parallel_calls = True
        reasoning: tuple[str, str] | None = None
        inside = False
        limits = self.state.settings.request_limits
        if kind == "text":
            request, generations = decode_completion_prompts(body, limits)
        else:
            chat = decode_chat_request(body, limits)
            mode = chat.tool_mode()
            tools = chat.tools if mode != "none" else None
            rendered = chat_format.render(chat.messages, tools=tools)
            generation = chat_generation(
                chat, rendered.text, rendered.stops, add_bos=not rendered.has_bos, limits=limits
            )
            if generation.constraint is not None and rendered.reasoning is not None:
                # the constraint holds from the first token: the answer is never reasoning
                rendered = chat_format.render(chat.messages, tools=tools, thinking=False)
                generation = chat_generation(
                    chat, rendered.text, rendered.stops, add_bos=not rendered.has_bos, limits=limits
                )
            else:
                reasoning, inside = rendered.reasoning, rendered.opens_reasoning
            generations = [generation]
            request = chat
            if mode != "none":
                tool_mode = "auto" if mode == "auto" else "forced"
                names = tuple(tool.function.name for tool in chat.tools or ())
                parallel_calls = chat.parallel_tool_calls is not False
        model = self._model(request.model)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return _Parsed(
            stream=request.stream,
            generations=tuple(generations),
            model=model,
            dialect=OpenAIDialect(
                kind,
                model,
                include_usage=include_usage,
                choices=request.n * len(generations),
                tool_mode=tool_mode,
                tool_names=names,
                reasoning=reasoning,
                inside=inside,
                parallel_calls=parallel_calls,
            ),
            n=request.n,
            tool_mode=tool_mode,
            tool_names=names,
            parallel_calls=parallel_calls,
            reasoning=reasoning,
            inside=inside,
        )

    def _parse_conversation(
        self, kind: Literal["messages", "responses"], body: bytes, chat_format: ChatFormat
    ) -> _Parsed:
        """An Anthropic Messages or OpenAI Responses request: the same chat, rendered by
        the same template, as a chat completion (docs/dialects.md)."""
        dialect: Dialect
        if kind == "messages":
            messages = decode_messages_request(body)
            keep = self.state.settings.keep_billing_header
            conversation = messages_conversation(
                messages, keep_billing_header=keep, limits=self.state.settings.request_limits
            )
            model = self._model(messages.model)
            generation, rendered = generation_for(conversation, chat_format)
            stream = messages.stream
            dialect = AnthropicDialect(
                model,
                tool_mode=conversation.tool_mode,
                tool_names=conversation.tool_names,
                stops=conversation.stops,
                max_tokens=conversation.max_tokens,
                reasoning=rendered.reasoning,
                inside=rendered.opens_reasoning,
                omit_thinking=conversation.omit_thinking,
                parallel_calls=conversation.parallel_calls,
            )
        else:
            responses = decode_responses_request(body)
            conversation = responses_conversation(responses, limits=self.state.settings.request_limits)
            model = self._model(responses.model)
            generation, rendered = generation_for(conversation, chat_format)
            stream = responses.stream
            dialect = ResponsesDialect(
                model,
                responses,
                tool_mode=conversation.tool_mode,
                tool_names=conversation.tool_names,
                reasoning=rendered.reasoning,
                inside=rendered.opens_reasoning,
                parallel_calls=conversation.parallel_calls,
            )
        return _Parsed(
            stream=stream,
            generations=(generation,),
            model=model,
            dialect=dialect,
            tool_mode=conversation.tool_mode,
            tool_names=conversation.tool_names,
            parallel_calls=conversation.parallel_calls,
            reasoning=rendered.reasoning,
            inside=rendered.opens_reasoning,
        )

    def _model(self, requested: str | None) -> str:
        """The name the response carries: the model's own (an alias resolves to it)."""
        return self.state.resolve(requested).name

    async def _stream(
        self, request: InFlightRequest, events: EventStream, heartbeat: _Heartbeat | None
    ) -> None:
        dialect = request.dialect
        assert dialect is not None
        body = request.exchange.body
        delta = dialect.plain_delta
        observe_gap = self.state.metrics.inter_token_latency.observe
        perf_counter = time.perf_counter
        previous = 0.0
        async for event in events:
            if request.phase is Phase.QUEUED:  # the first event
                if heartbeat is not None:
                    await heartbeat.hand_over()  # from here on, this task is the only writer
                request.advance(Phase.STREAMING)
            if type(event) is TextDelta:
                now = perf_counter()
                if previous:
                    observe_gap(now - previous)
                previous = now
                await body(delta(event.text))
            else:
                assert isinstance(event, Finished)
                if event.reason == "error":
                    final = dialect.stream_error(_failure(events, event))
                else:
                    writer = dialect.writers[0]
                    final = writer.finish(event.reason, event.message, event.stop_sequence)
                    final += dialect.end(event.usage)
                await self._end(request, final, event)

    async def _stream_choices(
        self, request: InFlightRequest, parsed: _Parsed, heartbeat: _Heartbeat | None
    ) -> None:
        """A stream that needs more than text deltas (log-probabilities, tool calls) or
        has several choices: one reader per choice, one writer (this task)."""
        body = request.exchange.body
        choices = request.choices
        dialect = parsed.dialect
        # (a deadline or shutdown finishes the writers too: text they hold goes out)
        writers = dialect.writers
        send, receive = trio.open_memory_channel[tuple[int, TextDelta | Finished]](0)

        async def read(
            index: int, events: EventStream, out: trio.MemorySendChannel[tuple[int, TextDelta | Finished]]
        ) -> None:
            async with out:
                async for event in events:
                    await out.send((index, event))

        async with trio.open_nursery() as nursery:
            async with send:
                for index, events in enumerate(choices):
                    nursery.start_soon(read, index, events, send.clone())
            left = len(choices)
            async for index, event in receive:
                if request.phase is Phase.QUEUED:  # the first event
                    if heartbeat is not None:
                        await heartbeat.hand_over()  # from here on, this task is the only writer
                    request.advance(Phase.STREAMING)
                if type(event) is TextDelta:
                    data = writers[index].delta(event.text, event.logprobs)
                    if data:
                        await body(data)
                    continue
                assert isinstance(event, Finished)
                if event.reason == "error":
                    # one choice failed: the response has failed (the SDKs raise on the
                    # error event); the other choices' readers stop here
                    nursery.cancel_scope.cancel()
                    request.ended_choices.update(range(len(choices)))
                    await self._end(request, dialect.stream_error(_failure(choices[index], event)), event)
                    return
                data = writers[index].finish(event.reason, event.message, event.stop_sequence)
                request.ended_choices.add(index)
                left -= 1
                if left:
                    await body(data)
                else:
                    # (every choice's producer has returned: the usage is final)
                    end = data + dialect.end(_usage(choices))
                    await self._end(request, end, event)

    async def _collect(self, request: InFlightRequest, parsed: _Parsed) -> None:
        choices = request.choices
        finals: list[Finished | None] = [None] * len(choices)
        texts: list[list[str]] = [[] for _ in choices]
        logprobs: list[list[TokenLogprob] | None] = [
            [] if parsed.generation.logprobs is not None else None for _ in choices
        ]

        async def collect(index: int, events: EventStream) -> None:
            parts, entries = texts[index], logprobs[index]
            async for event in events:
                if request.phase is Phase.QUEUED:  # the first event
                    request.advance(Phase.STREAMING)
                if type(event) is TextDelta:
                    parts.append(event.text)
                    if entries is not None and event.logprobs:
                        entries.extend(event.logprobs)
                else:
                    assert isinstance(event, Finished)
                    finals[index] = event

        async with trio.open_nursery() as nursery:
            for index, events in enumerate(choices):
                nursery.start_soon(collect, index, events)
        for index, final in enumerate(finals):
            assert final is not None
            if final.reason == "error":
                request.end(final.reason)
                failure = choices[index].backend_error
                if isinstance(failure, TrioserveError):
                    raise failure  # its own status: a 400 from an upstream stays a 400
                raise _BackendFailed(final.message or "inference failed")
        last = finals[-1]
        assert last is not None
        assert request.model is not None
        results = [
            finished_choice(
                "".join(parts),
                final.reason,
                parsed.tool_mode,
                parsed.tool_names,
                entries,
                final.stop_sequence,
                reasoning=parsed.reasoning,
                inside=parsed.inside,
                parallel_calls=parsed.parallel_calls,
            )
            for parts, final, entries in zip(texts, finals, logprobs, strict=True)
            if final is not None
        ]
        response = parsed.dialect.body(results, _usage(choices))
        await self._end(request, response, last, json=True)

    async def _end(
        self, request: InFlightRequest, data: bytes, event: Finished, *, json: bool = False
    ) -> None:
        """Send the end of a response that ended on its own (stop, length, error).

        The end is sent shielded — a deadline or shutdown that fires now must not cut
        the body short while the log says it ended well — and bounded by the stall
        timeout: if the client takes no bytes for that long, the connection is shut
        down and the log says ``stall``."""
        exchange = request.exchange
        request.advance(Phase.FINISHING)
        request.end(event.reason)
        # Delivered before the last send: hypercorn reports the end of the response as
        # a disconnect, and that must not rewrite why it ended.
        request.delivered = True
        # Stop watching before the last send: hypercorn delivers http.disconnect from
        # inside it, and cancelling the request then would cancel hypercorn's own
        # end-of-response work (closing HTTP/1.0 and Connection: close connections,
        # starting the keep-alive timer).
        request.watch_scope.cancel()
        bound = math.inf if self.state.stall_timeout is None else self.state.stall_timeout

        async def send() -> None:
            if json:
                await exchange.json(200, data)
            else:
                await exchange.body(data, more=False)

        if not await _send_last(request, bound, send, watch_cancel=True):
            # not delivered: the client took no bytes for the stall timeout (or, once
            # the request was cancelled, for FINAL_EVENT_TIMEOUT)
            request.end("stall")
            request.delivered = False

    async def _cancelled(self, request: InFlightRequest) -> None:
        """Tell the client why its request ended early (unless it is the one who left)."""
        exchange, cause = request.exchange, request.cause
        if cause in ("disconnect", "stall") or exchange.ended:
            return  # (or the end went out before the cancel could matter)
        assert cause is not None
        assert cause != "overloaded"
        request.advance(Phase.FINISHING)
        dialect = request.dialect if exchange.started else None
        choices = request.choices

        async def send() -> None:
            if dialect is not None:
                usage = _usage(choices) if choices else Usage(prompt_tokens=0, completion_tokens=0)
                # through the choice writers: text held in auto tool mode goes out
                # before the finish
                writers = dialect.writers
                left = [i for i in range(len(writers)) if i not in request.ended_choices]
                finals = b"".join(writers[i].finish(cause) for i in left)
                # (first what a cancel kept from going out: the writers' state counts it)
                await exchange.body(exchange.take_unsent() + finals + dialect.end(usage), more=False)
            elif cause == "deadline":
                await exchange.error(
                    DeadlineExceededError("the request's deadline passed before the response was complete")
                )
            elif cause == "unload":
                await exchange.error(
                    ServiceUnavailableError(
                        f"the model {request.model!r} was unloaded (POST /models/unload) before the "
                        "response was complete; retry to load it again",
                        code="model_unloaded",
                    )
                )
            else:
                await exchange.error(
                    ServiceUnavailableError("the server is shutting down; retry on another instance")
                )

        # (a half-sent event must not stay open: past the bound, the connection is ended)
        await _send_last(request, FINAL_EVENT_TIMEOUT, send)

    def _log(self, request: InFlightRequest) -> None:
        """The request's one log line, and its metrics."""
        metrics = self.state.metrics
        exchange = request.exchange
        duration = time.perf_counter() - request.started
        events = request.events
        usage = (_usage(request.choices) if request.choices else events.usage) if events is not None else None
        timings = events.timings if events is not None else None
        ttft = timings.ttft_seconds if timings is not None else None
        cause = request.cause
        cancel_latency = None
        cut_short = not request.delivered  # (after the end, a "disconnect" is just the end)
        if cut_short and events is not None and request.cancelled_at is not None:
            ended = events.progress.inference_ended
            if ended is not None:
                # cause → inference thread out of the model (0 if it had already ended)
                cancel_latency = max(0.0, ended - request.cancelled_at)
                metrics.cancel_latency.labels(cause=cause or "unknown").observe(cancel_latency)
            if request.tokens_at_cancel is not None:
                metrics.wasted_tokens.inc(
                    max(0, events.progress.completion_tokens - request.tokens_at_cancel)
                )
        path = request.asgi["path"]
        # the endpoint's own path, not the raw one (``/v1/completions//``): bounded labels
        endpoint = _ENDPOINTS[request.kind]
        metrics.requests.labels(endpoint=endpoint, status=str(exchange.status or 0)).inc()
        metrics.stream_ends.labels(cause=cause or "unknown").inc()
        metrics.request_duration.observe(duration)
        proposed = accepted = 0
        for choice in request.choices or ([events] if events is not None else []):
            # (the choices of n > 1 that shared the first one's prompt evaluated none of it)
            progress = choice.progress
            metrics.prompt_tokens_cached.inc(progress.cached_tokens)
            metrics.prompt_tokens_evaluated.inc(max(0, progress.prefilled_tokens - progress.cached_tokens))
            proposed += progress.draft_proposed
            accepted += progress.draft_accepted
        if proposed:
            metrics.draft_tokens_proposed.inc(proposed)
            metrics.draft_tokens_accepted.inc(accepted)
        if events is not None and usage is not None and timings is not None:
            metrics.prompt_tokens.inc(usage.prompt_tokens)
            metrics.completion_tokens.inc(usage.completion_tokens)
            if timings.queue_seconds is not None:
                metrics.queue_wait.observe(timings.queue_seconds)
            if ttft is not None:
                metrics.time_to_first_token.observe(ttft)
            if events.progress.prefill_seconds:
                metrics.prefill.observe(events.progress.prefill_seconds)
        request_logger.info(
            "request %s %s model=%s status=%s cause=%s prompt_tokens=%s cached_tokens=%s "
            "completion_tokens=%s ttft_ms=%s duration_ms=%.1f%s%s%s%s",
            exchange.request_id,
            path,
            request.model or "-",
            exchange.status or "-",
            cause,
            usage.prompt_tokens if usage else "-",
            usage.cached_tokens if usage else "-",
            usage.completion_tokens if usage else "-",
            f"{ttft * 1000:.1f}" if ttft is not None else "-",
            duration * 1000,
            f" load_wait_ms={request.load_wait * 1000:.1f}" if request.load_wait else "",
            f" draft_accepted={accepted}/{proposed}" if proposed else "",
            f" cancel_latency_ms={cancel_latency * 1000:.2f}" if cancel_latency is not None else "",
            f" error={request.error!r}" if request.error else "",
        )


def _failure(events: EventStream, event: Finished) -> TrioserveError:
    """The error a failed choice reports to the client."""
    failure = events.backend_error
    if isinstance(failure, TrioserveError):
        return failure
    return _BackendFailed(event.message or "inference failed")


class _BackendFailed(TrioserveError):
    status = 500
    error_type = "server_error"
    default_code = "backend_error"
