"""The ASGI app: the generation endpoints at the ASGI level, everything else in
quart-trio, behind the access policy."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import uuid
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, cast

import trio
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response
from quart_trio import QuartTrio

from .._core._backend import Backend
from .._core._exceptions import (
    HeadersTooLargeError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    TrioserveError,
)
from .._core._registry import ModelEntry
from .._wire import (
    MESSAGES,
    RESPONSES,
    Conversation,
    DialectSpec,
    ReadOptions,
    RouterModelRequest,
    StoredContext,
    decode_detokenize_request,
    decode_router_request,
    decode_tokenize_request,
    detokenize_response,
    encode_json,
    generation_for,
    tokenize_response,
)
from ._access import AccessPolicy, with_access_control
from ._control_routes import add_control_routes
from ._embeddings import EMBEDDINGS_PATH, EmbeddingsHandler
from ._errors import ErrorRenderer, render_error, render_for_path, renderer
from ._exchange import (
    Exchange,
    Receive,
    Scope,
    Send,
    _check_content_type,
    body_timeout_error,
    headers_too_large,
)
from ._fetch import resolve_images
from ._generation import GENERATION_PATHS, GenerationHandler, key_salt, presented_key
from ._lifecycle import INLINE_PARSE_BYTES, completing, off_the_loop_if
from ._lora_routes import add_lora_routes
from ._ollama_asgi import OLLAMA_ASGI_PATHS, OllamaAsgi
from ._ollama_routes import add_ollama_routes
from ._openapi import needs_key, openapi_document, openapi_path
from ._props import add_props_route, context_length
from ._replay import STREAM_PATH, ReplayHandler, ResponsesReplay, response_stream_id
from ._requests_routes import add_request_routes
from ._rerank import RERANK_PATHS, RerankHandler
from ._speech import SPEECH_PATH, SpeechHandler
from ._state import ServerState
from ._stored_routes import add_stored_routes
from ._stream_routes import add_stream_routes
from ._transcriptions import TRANSCRIPTIONS_PATH, TranscriptionsHandler

__all__ = ["create_app", "served_routes"]

#: the methods every route answers that the document does not list one by one
_IMPLICIT_METHODS = frozenset({"HEAD", "OPTIONS"})

#: /tokenize and /detokenize answers of more tokens than this are JSON-encoded in a
#: worker thread
_INLINE_ENCODE_TOKENS = 16 * 1024


def create_app(
    state: ServerState, access: AccessPolicy | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app: generation endpoints at the ASGI level, the rest in quart-trio,
    behind the access policy (API keys, CORS) if one is given."""
    quart: Any = _create_quart_app(state, access)  # its ASGI types are narrower than ours
    generation = GenerationHandler(state, access)
    embeddings = EmbeddingsHandler(state, access)
    rerank = RerankHandler(state, access)
    replay = ReplayHandler(state, access)
    responses_replay = ResponsesReplay(state, access)
    ollama = OllamaAsgi(state, access)

    header_limit = state.settings.max_header_bytes

    transcriptions = TranscriptionsHandler(state, generation)
    speech = SpeechHandler(state, access)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            audio = scope["path"].rstrip("/")
            if audio == TRANSCRIPTIONS_PATH:
                await transcriptions(scope, receive, send)
                return
            if audio == SPEECH_PATH:
                await speech(scope, receive, send)
                return
            kind = GENERATION_PATHS.get(scope["path"].rstrip("/") or "/")
            if kind is not None:
                await generation(scope, receive, send, kind)  # checks headers, logs, counts
                return
            path = scope["path"].rstrip("/") or "/"
            if path == EMBEDDINGS_PATH:
                await embeddings(scope, receive, send)
                return
            if path in RERANK_PATHS:
                await rerank(scope, receive, send)
                return
            if ollama.handles(path):
                await ollama(scope, receive, send)
                return
            if path == STREAM_PATH and scope["method"] == "GET":
                await replay(scope, receive, send)
                return
            response_id = response_stream_id(scope)
            if response_id is not None:
                await responses_replay(scope, receive, send, response_id)
                return
            if headers_too_large(scope, header_limit):
                error = HeadersTooLargeError(f"the request headers exceed the limit of {header_limit} bytes")
                await Exchange(send, uuid.uuid4().hex).error(error)
                return
        await quart(scope, receive, send)

    served: Callable[[Scope, Receive, Send], Awaitable[None]] = app
    if access is not None and (access.requires_key or access.cors_origins):
        served = with_access_control(app, access)

    async def shielded(scope: Scope, receive: Receive, send: Send) -> None:
        # every HTTP/1.x answer's sends are shielded (completing), the access layer's
        # own too (a 401, a 403, a CORS preflight's 204): it is outside this
        if scope["type"] == "http" and scope.get("http_version") != "2":
            send = completing(send)
        await served(scope, receive, send)

    return shielded


def _asgi_paths() -> list[str]:
    """The paths served at the ASGI level, before quart (``POST`` only)."""
    return [
        *GENERATION_PATHS,
        EMBEDDINGS_PATH,
        *sorted(RERANK_PATHS),
        *OLLAMA_ASGI_PATHS,
        TRANSCRIPTIONS_PATH,
        SPEECH_PATH,
    ]


def served_routes(app: QuartTrio) -> set[tuple[str, str]]:
    """Every ``(method, OpenAPI path)`` the app serves: the quart app's rules (``HEAD``
    and ``OPTIONS`` aside) and the paths served before it."""
    routes = {("POST", path) for path in _asgi_paths()} | {("GET", STREAM_PATH)}
    for rule in app.url_map.iter_rules():
        for method in (rule.methods or set()) - _IMPLICIT_METHODS:
            routes.add((method, openapi_path(rule.rule)))
    return routes


def _json_response(
    body: dict[str, object], status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(encode_json(body), status=status, content_type="application/json", headers=headers)


def _health(
    body: dict[str, object], status: int = 200, headers: dict[str, str] | None = None
) -> tuple[dict[str, object], int, dict[str, str] | None]:
    return body, status, headers


def _error_response(exc: TrioserveError, render: ErrorRenderer = render_error) -> Response:
    status, headers, body = render(exc)
    return Response(body, status=status, headers={k.decode(): v.decode() for k, v in headers})


def _embeds(backend: Backend) -> bool:
    """Whether ``backend`` serves ``/v1/embeddings``: it computes vectors, or it forwards
    the request (the upstream relay)."""
    return backend.embedding_size is not None or type(backend).embed_inputs is not Backend.embed_inputs


def _model_object(name: str, created: int, context_length: int | None) -> dict[str, object]:
    """One model as ``/v1/models`` lists it and ``/v1/models/{id}`` answers it."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "trioserve",
        # the context per sequence, by trioserve's (and Ollama's) name and vLLM's
        # (docs/api.md, "The context length")
        "context_length": context_length,
        "max_model_len": context_length,
    }


async def _body_bytes() -> bytes:
    """The request's body. The body limit is quart's ``MAX_CONTENT_LENGTH`` (413); a
    Content-Type other than JSON is 415; a body not all there within
    ``--body-timeout`` seconds (the app's ``TRIOSERVE_BODY_TIMEOUT``) is 408
    ``request_timeout``."""
    from quart import current_app, request

    _check_content_type(cast("Scope", request.scope))
    timeout: float | None = current_app.config["TRIOSERVE_BODY_TIMEOUT"]
    with trio.move_on_after(math.inf if timeout is None else timeout):
        body = await request.get_data(as_text=False)
        assert isinstance(body, bytes)
        return body
    assert timeout is not None
    raise body_timeout_error(timeout)


async def _json_body[T](decode: Callable[[bytes], T]) -> T:
    """The request's body (:func:`_body_bytes`), decoded by ``decode`` (bodies over
    64 KiB: in a worker thread, as the generation endpoints do)."""
    body = await _body_bytes()
    return await off_the_loop_if(len(body) > INLINE_PARSE_BYTES, decode, body)


def _create_quart_app(state: ServerState, access: AccessPolicy | None = None) -> QuartTrio:
    # (no static folder: the page is served at /, and every route is in /openapi.json)
    app = QuartTrio("trioserve", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = state.settings.max_body_bytes
    # trioserve's own timeout (_body_bytes: 408 with an OpenAI body) comes first
    body_timeout = app.config["TRIOSERVE_BODY_TIMEOUT"] = state.settings.body_timeout
    app.config["BODY_TIMEOUT"] = None if body_timeout is None else body_timeout + 1

    def model_health(entry: ModelEntry) -> dict[str, object]:
        body: dict[str, object] = {"model": entry.name, **entry.describe()}
        engine = entry.engine
        if engine is None:
            return body
        backend = engine.backend
        failure = backend.failure
        if failure is not None:  # e.g. the llama backend's scheduler thread died
            body["state"] = "error"
            body["error"] = str(failure)
            return body
        stats = backend.stats()
        if stats is not None:
            body["batch"] = stats
        body.update(
            slots=engine.admission.slots,
            slots_in_use=engine.admission.in_use,
            queued=engine.admission.queued,
            paused=engine.admission.paused,
            preemptions=engine.admission.preemptions,
            active_streams=engine.active_streams,
            generations_running=backend.generations.running,
        )
        return body

    @app.get("/health")
    async def health() -> Response:
        """The server's health: ``ok`` once the startup model has loaded (503 while it
        loads, or after it failed), with each model's state (``models``); the default
        model's figures at the top level, as before there were several. Where API keys
        are required, a request without a valid one gets the status alone (open for
        load balancers: no models, paths, errors, slots or cache figures)."""
        from quart import request

        body, status, headers = full_health()
        if access is not None and access.requires_key:
            key = presented_key(cast("Scope", request.scope))
            if key is None or not access.key_is_valid(key):
                body = {"status": body["status"]}
        return _json_response(body, status, headers)

    def full_health() -> tuple[dict[str, object], int, dict[str, str] | None]:
        if state.shutting_down:
            return _health({"status": "shutting_down"}, 503, {"Retry-After": "1"})
        registry = state.registry
        if registry is None:
            return _health({"status": "loading", "error": None}, 503, {"Retry-After": "1"})
        default = registry.default
        models = {entry.name or "(loading)": model_health(entry) for entry in registry.entries}
        if default.spec.ready_gate and default.state != "loaded":
            if default.state == "failed":
                return _health(
                    {"status": "error", "error": default.error, "models": models}, 503, {"Retry-After": "1"}
                )
            if default.loads == 0:
                return _health(
                    {"status": "loading", "error": None, "models": models}, 503, {"Retry-After": "1"}
                )
        for entry in registry.entries:
            failure = entry.engine.backend.failure if entry.engine is not None else None
            if failure is not None:  # e.g. the llama backend's scheduler thread died
                return _health({"status": "error", "error": str(failure), "models": models}, 503)
        body: dict[str, object] = {}
        engine = default.engine
        if engine is not None:
            stats = engine.backend.stats()
            if stats is not None:
                body["batch"] = stats
            platform = engine.backend.platform()
            if platform is not None:
                body["platform"] = platform
            body.update(
                model=default.name,
                slots=engine.admission.slots,
                slots_in_use=engine.admission.in_use,
                queued=engine.admission.queued,
                paused=engine.admission.paused,
                parked=engine.admission.parked,
                preemptions=engine.admission.preemptions,
                active_streams=engine.active_streams,
                generations_running=engine.backend.generations.running,
            )
        if state.responses is not None:
            # a store that cannot write is degraded, not down: answers are still sent
            body["responses_store"] = state.responses.health()
        if state.detached is not None:
            body["detached"] = state.detached.counts()
        return _health({**body, "status": "ok", "requests_in_flight": len(state.requests), "models": models})

    @app.get("/v1/loads")
    @app.get("/loads")
    async def loads() -> Response:
        """A gateway's load poll (the Shepherd Model Gateway's ``/v1/loads`` schema,
        sglang's: docs/deployment.md, "Many workers behind a gateway"): one rank with
        the named model's (``?model=``; default: the default model's) running and
        queued requests and its slots, from the admission state itself. 503 while
        shutting down (a gateway then takes no load figure from a draining worker)."""
        from quart import request

        if state.shutting_down or state.registry is None:
            return _json_response({"error": "not serving"}, 503, {"Retry-After": "1"})
        registry = state.registry
        name = request.args.get("model")
        try:
            entry = state.resolve(name) if name else registry.default
        except TrioserveError as exc:
            return _error_response(exc)
        engine = entry.engine
        running = waiting = in_use = used = 0
        slots = total = 1
        if engine is not None:
            admission = engine.admission
            running, waiting, in_use, slots = (
                engine.backend.generations.running,
                admission.queued,
                admission.in_use,
                admission.slots,
            )
            kv_usage = getattr(engine.backend, "kv_usage", None)
            if kv_usage is not None:
                used, total = kv_usage()
        rank = {
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            # KV cells the running requests hold, of every slot's (a busy slot is not a
            # full cache: a request beyond the slots queues, it is not refused)
            "num_used_tokens": used,
            "max_total_num_tokens": total,
            "token_usage": used / total,
            "utilization": in_use / slots,
            "max_running_requests": slots,
        }
        stamp = datetime.datetime.now(datetime.UTC).isoformat()
        return _json_response({"timestamp": stamp, "dp_rank_count": 1, "loads": [rank]})

    page = (resources.files("trioserve") / "static" / "index.html").read_bytes()

    @app.get("/")
    async def index() -> Response:
        return Response(page, content_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    def model_object(entry: ModelEntry, name: str) -> dict[str, object]:
        engine = entry.engine
        body = _model_object(name, entry.loaded_at, context_length(entry))
        body["status"] = entry.describe()
        # what it can do, once loaded (None: not known until it is)
        info = engine.backend.info if engine is not None else None
        body["capabilities"] = (
            {
                "completion": info.generates,
                "chat": info.generates,
                "infill": info.infill,
                "embeddings": _embeds(engine.backend),
                "rerank": info.rerank,
                "vision": info.vision,
                "audio": info.audio,
            }
            if engine is not None and info is not None
            else None
        )
        # what it reads, loaded or not (docs/vision.md)
        if info is not None:
            body["input_modalities"] = ["text"] + ["image"] * info.vision + ["audio"] * info.audio
        else:
            known = getattr(entry.spec.source, "input_modalities", None)
            body["input_modalities"] = list(known) if known is not None else None
        return body

    def adapter_object(entry: ModelEntry, adapter: str) -> dict[str, object]:
        """A LoRA adapter as vLLM lists one: its base in ``parent`` (docs/lora.md)."""
        body = model_object(entry, adapter)
        body["parent"] = entry.name
        body["root"] = entry.name
        engine = entry.engine
        for name, tokens, text in engine.backend.info.alora if engine is not None else ():
            if name == adapter:  # (an activated LoRA: what turns it on, as /lora-adapters says)
                body["alora_invocation_string"] = text
                body["alora_invocation_tokens"] = list(tokens)
        return body

    @app.get("/v1/models")
    async def models() -> Response:
        """Every known model, loaded or not, with its state (docs/models.md)."""
        registry = state.registry
        if registry is None or (registry.default.spec.ready_gate and registry.default.loads == 0):
            return _error_response(ServiceUnavailableError("the model is still loading", code="loading"))
        default = registry.default
        if default.spec.ready_gate and default.state == "failed":
            return _error_response(ServiceUnavailableError(f"the model failed to load: {default.error}"))
        return _json_response(
            {
                "object": "list",
                "data": [
                    model_object(entry, name) for entry in registry.entries for name in entry.names if name
                ]
                + [adapter_object(entry, a) for entry in registry.entries for a in entry.adapter_names()],
            }
        )

    # ids may hold slashes (``--model-id org/name``, an upstream's id): ``path``
    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        try:
            entry = state.resolve(model_id)
        except TrioserveError as exc:
            return _error_response(exc)
        return _json_response(model_object(entry, model_id))

    # llama-server's router endpoints (docs/models.md, "Endpoints")
    @app.get("/models")
    async def router_models() -> Response:
        registry = state.serving_registry()
        data = []
        for entry in registry.entries:
            status: dict[str, object] = {"value": entry.state}
            if entry.state == "failed":
                status.update(value="unloaded", failed=True, error=entry.error)
            if entry.state == "loading":
                status["progress"] = round(entry.progress, 3)
            data.append(
                {
                    "id": entry.name,
                    "aliases": list(entry.spec.aliases),
                    "path": entry.spec.source.description,
                    "in_cache": True,
                    "pinned": entry.spec.pinned,
                    "status": status,
                }
            )
        return _json_response({"object": "list", "data": data})

    def router_model_name(request: RouterModelRequest) -> str:
        if not request.model:
            raise InvalidRequestError('name the model: {"model": "NAME"}', param="model")
        return request.model

    @app.post("/models/load")
    async def router_load() -> Response:
        """Load a model (making room for it) and answer once it is loaded."""
        try:
            request = await _json_body(decode_router_request)
            entry = await state.serving_registry().load(router_model_name(request))
        except TrioserveError as exc:
            return _error_response(exc)
        return _json_response({"success": True, "model": entry.name, "status": entry.describe()})

    @app.post("/models/unload")
    async def router_unload() -> Response:
        """Unload a model: running streams get the grace period (``--unload-grace``, or
        ``grace_seconds`` in the body), then end with cause ``unload``."""
        try:
            request = await _json_body(decode_router_request)
            if request.grace_seconds is not None and not request.grace_seconds >= 0:
                raise InvalidRequestError("grace_seconds must be 0 or more", param="grace_seconds")
            entry = await state.serving_registry().unload(
                router_model_name(request), grace=request.grace_seconds
            )
        except TrioserveError as exc:
            return _error_response(exc)
        return _json_response({"success": True, "model": entry.name, "status": entry.describe()})

    # llama-server's tokenizer endpoints (docs/api.md, "Tokenizing")
    @app.post("/tokenize")
    async def tokenize() -> Response:
        try:
            registry = state.serving_registry()  # (503 before reading the body)
            request = await _json_body(decode_tokenize_request)
            # a lease: the model is not unloaded while its tokenizer runs (in a thread
            # for long texts: the backend's rule)
            async with registry.lease(state.resolve(request.model)) as lease:
                backend = lease.engine.backend
                tokens = await backend.tokenize_text(
                    request.content, add_special=request.add_special, parse_special=request.parse_special
                )
                pieces = await backend.token_pieces(tokens) if request.with_pieces else None
        except TrioserveError as exc:
            return _error_response(exc)
        body = await off_the_loop_if(len(tokens) > _INLINE_ENCODE_TOKENS, tokenize_response, tokens, pieces)
        return Response(body, content_type="application/json")

    @app.post("/detokenize")
    async def detokenize() -> Response:
        try:
            registry = state.serving_registry()
            request = await _json_body(decode_detokenize_request)
            async with registry.lease(state.resolve(request.model)) as lease:
                pieces = await lease.engine.backend.token_pieces(request.tokens)
        except TrioserveError as exc:
            return _error_response(exc)
        body = await off_the_loop_if(len(pieces) > _INLINE_ENCODE_TOKENS, detokenize_response, pieces)
        return Response(body, content_type="application/json")

    # token counting (docs/dialects.md, "Token counting"): the prompt generation would
    # render, counted by the model's tokenizer; nothing is evaluated, and nothing is
    # queued but a request with images, which holds a queue place while they are
    # fetched and decoded
    def admit_count() -> list[tuple[bytes, bytes]]:
        """The key's rate limits, as generation takes them (``GenerationHandler._admit``):
        429 with ``x-ratelimit-*`` before any work (a stored conversation's read, a
        model load, an image's fetch); a count takes a request, never tokens (nothing
        is evaluated). Its ``x-ratelimit-*`` headers."""
        from quart import request

        scope = cast("Scope", request.scope)
        key = presented_key(scope) if access is not None and access.requires_key else None
        accounts = state.accounts
        return accounts.admit(key_salt(scope, access), accounts.account(key))

    async def count(spec: DialectSpec, limits: list[tuple[bytes, bytes]]) -> int:
        """The prompt's tokens, by the named model's template and tokenizer (loading
        the model if it is not: the count is its tokenizer's). A body over 64 KiB is
        decoded and its chat rendered in a worker thread (the tokenizer's own rule puts
        a long prompt in one too), as the generation endpoints do; a cancel waits for
        the thread, inside the lease. A Responses body that continues a stored response
        is counted with the stored conversation before it. ``limits`` gets the key's
        ``x-ratelimit-*`` headers."""
        from quart import request

        registry = state.serving_registry()
        body = await _body_bytes()
        limits += admit_count()
        large = len(body) > INLINE_PARSE_BYTES
        stored = None
        if state.responses is not None and spec.peek_stored is not None:
            ask = await off_the_loop_if(large, spec.peek_stored, body)
            owner = key_salt(cast("Scope", request.scope), access)
            stored = await state.responses.context(ask.previous_response_id, owner)
        model, conversation = await off_the_loop_if(large, counter(spec, stored), body)
        async with registry.lease(state.resolve(model)) as lease:
            engine = lease.engine
            generation, _ = await off_the_loop_if(
                large, generation_for, conversation, state.chat_format(engine)
            )
            assert isinstance(generation.prompt, str)
            if generation.images:
                # images count as the tokens they take (docs/vision.md): laid out as for
                # generation, their URLs fetched under the same rules (a model that
                # cannot see images refuses them in prepare, before any fetch). As for
                # generation, a queue place is held first: a full server refuses (429)
                # before any fetch or decode, and at most slots + --max-queue requests
                # fetch and decode images at once
                images = generation.images
                media = engine.backend.info.vision or engine.backend.info.audio
                reservation = engine.admission.reserve() if media else None
                try:
                    if reservation is not None:
                        images = await resolve_images(images, state.settings.media)
                    asked = dataclasses.replace(
                        generation, images=images, max_tokens=1, clamp_max_tokens=True
                    )
                    return len((await engine.backend.prepare(asked)).tokens)
                finally:
                    if reservation is not None:
                        reservation.release()
            return await engine.backend.count_text_tokens(
                generation.prompt, add_special=generation.add_bos, parse_special=True
            )

    def counter(
        spec: DialectSpec, stored: StoredContext | None
    ) -> Callable[[bytes], tuple[str | None, Conversation]]:
        """``spec``'s token-counting decoder, with this server's limits."""
        count = spec.count
        assert count is not None
        keep_billing_header = state.settings.keep_billing_header

        def read(body: bytes) -> tuple[str | None, Conversation]:
            options = ReadOptions(
                limits=state.settings.request_limits,
                model_name=lambda requested: state.resolve(requested).name,
                keep_billing_header=keep_billing_header,
                stored=stored,
            )
            return count(body, options)

        return read

    async def counted(spec: DialectSpec, answer: Callable[[int], dict[str, object]]) -> Response:
        """A token count's answer, or its error in ``spec``'s dialect; the key's
        ``x-ratelimit-*`` headers on either, once its limits were taken."""
        limits: list[tuple[bytes, bytes]] = []
        try:
            tokens = await count(spec, limits)
        except TrioserveError as exc:
            response = _error_response(exc, renderer(spec))
        else:
            response = _json_response(answer(tokens))
        for name, value in limits:
            response.headers[name.decode()] = value.decode()
        return response

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        return await counted(MESSAGES, lambda tokens: {"input_tokens": tokens})

    @app.post("/v1/responses/input_tokens")
    async def input_tokens() -> Response:
        return await counted(
            RESPONSES, lambda tokens: {"object": "response.input_tokens", "input_tokens": tokens}
        )

    add_stored_routes(app, state, access)
    add_stream_routes(app, state, access)
    add_request_routes(app, state, access)
    add_control_routes(app, state, access, _json_body)
    add_props_route(app, state)
    add_lora_routes(app, state, _json_body)
    add_ollama_routes(app, state, access, _json_body)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        """This API's OpenAPI 3.1 document (docs/api.md, "The API's description"),
        generated when the app is made from the structs its routes decode with."""
        return Response(document, content_type="application/json")

    routes = served_routes(app)
    keys = access is not None and access.requires_key
    keyed = [path for _, path in routes if keys and access is not None and needs_key(access, path)]
    document = openapi_document(routes, keys=keys, keyed=keyed)

    @app.errorhandler(404)
    async def not_found(_error: Exception) -> Response:
        from quart import request

        render = functools.partial(render_for_path, path=request.path)
        return _error_response(NotFoundError(f"no route for {request.method} {request.path}"), render)

    @app.errorhandler(405)
    async def method_not_allowed(_error: Exception) -> Response:
        from quart import request

        render = functools.partial(render_for_path, path=request.path)
        return _error_response(
            MethodNotAllowedError(f"{request.path} does not accept {request.method}"), render
        )

    @app.errorhandler(408)
    async def body_too_slow(_error: Exception) -> Response:
        # (quart's own BODY_TIMEOUT: a backstop behind _body_bytes's)
        from quart import request

        render = functools.partial(render_for_path, path=request.path)
        return _error_response(body_timeout_error(app.config["BODY_TIMEOUT"]), render)

    @app.errorhandler(413)
    async def too_large(_error: Exception) -> Response:
        from quart import request

        render = functools.partial(render_for_path, path=request.path)
        return _error_response(PayloadTooLargeError("the request body is too large"), render)

    return app
