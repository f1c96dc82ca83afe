"""Parse, prepare and run one generation request on its model's engine: its dialect's
decoder (off the event loop for a large body), the server's own limits, the prompt cache's
salt, the images fetched, the prompts prepared (a conversation too long: its overflow
policy), its place in the queue, then the stream or the collected body
(:class:`~trioserve._http._writing.ResponseWriter`). The bottom of
:class:`~trioserve._http._generation.GenerationHandler`'s parts."""

import dataclasses
import functools
from typing import Annotated

import msgspec
import trio

from .._core._backend import PreparedPrompt
from .._core._engine import Engine
from .._core._errors import unwrap_group
from .._core._exceptions import ContextLengthError, InvalidRequestError
from .._core._media import RemoteImage
from .._core._types import GenerationRequest
from .._wire import ChatFormat, Dialect, DialectSpec, ParsedRequest, ReadOptions, StoredContext, decode
from ._access import AccessPolicy, key_salt, presented_key
from ._exchange import Scope
from ._fetch import resolve_images
from ._lifecycle import INLINE_PARSE_BYTES, Heartbeat, off_the_loop_if
from ._overflow import prepare_fitting
from ._request import InFlightRequest, Phase
from ._settings import HTTPSettings
from ._state import ServerState
from ._writing import ResponseWriter

__all__ = ["SSE_HEADERS", "PrepareAndRun", "cache_salt", "stream_headers"]

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


class PrepareAndRun:
    """A generation request on its model's engine, once it holds its lease: decoded,
    prepared and streamed or collected."""

    def __init__(self, state: ServerState, access: AccessPolicy | None = None) -> None:
        self.state = state
        #: the API keys: each key's prompt cache is its own (``cache_salt``)
        self.access = access
        self.writer = ResponseWriter(state)

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
