"""The ASGI app: the generation endpoints at the ASGI level, everything else in
quart-trio, behind the access policy."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import (
    HeadersTooLargeError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
)
from ._access import AccessPolicy, with_access_control
from ._control_routes import add_control_routes
from ._embeddings import EMBEDDINGS_PATH, EmbeddingsHandler
from ._errors import render_for_path
from ._exchange import Exchange, Receive, Scope, Send, body_timeout_error, headers_too_large
from ._generation import GENERATION_PATHS, GenerationHandler
from ._health_routes import add_health_routes
from ._lifecycle import completing
from ._lora_routes import add_lora_routes
from ._model_routes import add_model_routes
from ._ollama_asgi import OLLAMA_ASGI_PATHS, OllamaAsgi
from ._ollama_routes import add_ollama_routes
from ._openapi import needs_key, openapi_document, openapi_path
from ._props import add_props_route
from ._replay import STREAM_PATH, ReplayHandler, ResponsesReplay, response_stream_id
from ._requests_routes import add_request_routes
from ._rerank import RERANK_PATHS, RerankHandler
from ._route_io import error_response, json_body
from ._speech import SPEECH_PATH, SpeechHandler
from ._state import ServerState
from ._stored_routes import add_stored_routes
from ._stream_routes import add_stream_routes
from ._token_routes import add_token_routes
from ._transcriptions import TRANSCRIPTIONS_PATH, TranscriptionsHandler

__all__ = ["create_app", "served_routes"]

#: the methods every route answers that the document does not list one by one
_IMPLICIT_METHODS = frozenset({"HEAD", "OPTIONS"})


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


def _create_quart_app(state: ServerState, access: AccessPolicy | None = None) -> QuartTrio:
    # (no static folder: the page is served at /, and every route is in /openapi.json)
    app = QuartTrio("trioserve", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = state.settings.max_body_bytes
    # trioserve's own timeout (_route_io.body_bytes: 408 with an OpenAI body) comes first
    body_timeout = app.config["TRIOSERVE_BODY_TIMEOUT"] = state.settings.body_timeout
    app.config["BODY_TIMEOUT"] = None if body_timeout is None else body_timeout + 1

    add_health_routes(app, state, access)

    page = (resources.files("trioserve") / "static" / "index.html").read_bytes()

    @app.get("/")
    async def index() -> Response:
        return Response(page, content_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    add_model_routes(app, state)
    add_token_routes(app, state, access)

    add_stored_routes(app, state, access)
    add_stream_routes(app, state, access)
    add_request_routes(app, state, access)
    add_control_routes(app, state, access, json_body)
    add_props_route(app, state)
    add_lora_routes(app, state, json_body)
    add_ollama_routes(app, state, access, json_body)

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
        return error_response(NotFoundError(f"no route for {request.method} {request.path}"), render)

    @app.errorhandler(405)
    async def method_not_allowed(_error: Exception) -> Response:
        from quart import request

        render = functools.partial(render_for_path, path=request.path)
        return error_response(
            MethodNotAllowedError(f"{request.path} does not accept {request.method}"), render
        )

    @app.errorhandler(408)
    async def body_too_slow(_error: Exception) -> Response:
        # (quart's own BODY_TIMEOUT: a backstop behind body_bytes's)
        from quart import request

        render = functools.partial(render_for_path, path=request.path)
        return error_response(body_timeout_error(app.config["BODY_TIMEOUT"]), render)

    @app.errorhandler(413)
    async def too_large(_error: Exception) -> Response:
        from quart import request

        render = functools.partial(render_for_path, path=request.path)
        return error_response(PayloadTooLargeError("the request body is too large"), render)

    return app
