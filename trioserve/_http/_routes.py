"""The ASGI app: the generation endpoints at the ASGI level, everything else in
quart-trio, behind the access policy."""

from __future__ import annotations

import time
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
    ServiceUnavailableError,
    TrioserveError,
)
from .._wire._openai import encode_json
from ._access import AccessPolicy, with_access_control
from ._errors import render_error
from ._exchange import Exchange, Receive, Scope, Send, headers_too_large
from ._generation import GENERATION_PATHS, GenerationHandler
from ._state import ServerState

__all__ = ["create_app"]


def create_app(
    state: ServerState, access: AccessPolicy | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app: generation endpoints at the ASGI level, the rest in quart-trio,
    behind the access policy (API keys, CORS) if one is given."""
    quart: Any = _create_quart_app(state)  # its ASGI types are narrower than ours
    generation = GenerationHandler(state)

    header_limit = state.settings.max_header_bytes

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            kind = GENERATION_PATHS.get(scope["path"].rstrip("/") or "/")
            if kind is not None:
                await generation(scope, receive, send, kind)  # checks headers, logs, counts
                return
            if headers_too_large(scope, header_limit):
                error = HeadersTooLargeError(f"the request headers exceed the limit of {header_limit} bytes")
                await Exchange(send, uuid.uuid4().hex).error(error)
                return
        await quart(scope, receive, send)

    if access is not None and (access.requires_key or access.cors_origins):
        return with_access_control(app, access)
    return app


def _json_response(
    body: dict[str, object], status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(encode_json(body), status=status, content_type="application/json", headers=headers)


def _error_response(exc: TrioserveError) -> Response:
    status, headers, body = render_error(exc)
    return Response(body, status=status, headers={k.decode(): v.decode() for k, v in headers})


def _create_quart_app(state: ServerState) -> QuartTrio:
    app = QuartTrio("trioserve")
    app.config["MAX_CONTENT_LENGTH"] = state.settings.max_body_bytes

    @app.get("/health")
    async def health() -> Response:
        if state.shutting_down:
            return _json_response({"status": "shutting_down"}, 503, {"Retry-After": "1"})
        if state.engine is None:
            status = "error" if state.load_error else "loading"
            return _json_response({"status": status, "error": state.load_error}, 503, {"Retry-After": "1"})
        engine = state.engine
        failure = engine.backend.failure
        if failure is not None:  # e.g. the llama backend's scheduler thread died
            return _json_response({"status": "error", "error": str(failure)}, 503)
        body: dict[str, object] = {}
        stats = engine.backend.stats()
        if stats is not None:
            body["batch"] = stats
        return _json_response(
            {
                **body,
                "status": "ok",
                "model": engine.backend.info.id,
                "slots": engine.admission.slots,
                "slots_in_use": engine.admission.in_use,
                "queued": engine.admission.queued,
                "active_streams": engine.active_streams,
                "generations_running": engine.backend.generations.running,
                "requests_in_flight": len(state.requests),
            }
        )

    page = (resources.files("trioserve") / "static" / "index.html").read_bytes()

    @app.get("/")
    async def index() -> Response:
        return Response(page, content_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        engine = state.engine
        if engine is None:
            return _error_response(ServiceUnavailableError("the model is still loading", code="loading"))
        info = engine.backend.info
        created = int(time.time())
        return _json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "trioserve",
                        "context_length": info.context_length,
                    }
                    for name in state.model_names()
                ],
            }
        )

    @app.errorhandler(404)
    async def not_found(_error: Exception) -> Response:
        from quart import request

        return _error_response(NotFoundError(f"no route for {request.method} {request.path}"))

    @app.errorhandler(405)
    async def method_not_allowed(_error: Exception) -> Response:
        from quart import request

        return _error_response(MethodNotAllowedError(f"{request.path} does not accept {request.method}"))

    @app.errorhandler(413)
    async def too_large(_error: Exception) -> Response:
        return _error_response(PayloadTooLargeError("the request body is too large"))

    return app
