"""The model routes: ``GET /v1/models`` and ``/v1/models/{id}`` (every known model,
loaded or not, its LoRA adapters as vLLM lists them), and llama-server's router endpoints
(``GET /models``, ``POST /models/load``, ``POST /models/unload``: docs/models.md)."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from .._core._backend import Backend
from .._core._exceptions import InvalidRequestError, ServiceUnavailableError, TrioserveError
from .._core._registry import ModelEntry
from .._wire import RouterModelRequest, decode_router_request
from ._props import context_length
from ._route_io import error_response, json_body, json_response
from ._state import ServerState

__all__ = ["add_model_routes"]


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


def add_model_routes(app: QuartTrio, state: ServerState) -> None:
    """Add the model routes and the router's to ``app``."""

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
            return error_response(ServiceUnavailableError("the model is still loading", code="loading"))
        default = registry.default
        if default.spec.ready_gate and default.state == "failed":
            return error_response(ServiceUnavailableError(f"the model failed to load: {default.error}"))
        return json_response(
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
            return error_response(exc)
        return json_response(model_object(entry, model_id))

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
        return json_response({"object": "list", "data": data})

    def router_model_name(request: RouterModelRequest) -> str:
        if not request.model:
            raise InvalidRequestError('name the model: {"model": "NAME"}', param="model")
        return request.model

    @app.post("/models/load")
    async def router_load() -> Response:
        """Load a model (making room for it) and answer once it is loaded."""
        try:
            request = await json_body(decode_router_request)
            entry = await state.serving_registry().load(router_model_name(request))
        except TrioserveError as exc:
            return error_response(exc)
        return json_response({"success": True, "model": entry.name, "status": entry.describe()})

    @app.post("/models/unload")
    async def router_unload() -> Response:
        """Unload a model: running streams get the grace period (``--unload-grace``, or
        ``grace_seconds`` in the body), then end with cause ``unload``."""
        try:
            request = await json_body(decode_router_request)
            if request.grace_seconds is not None and not request.grace_seconds >= 0:
                raise InvalidRequestError("grace_seconds must be 0 or more", param="grace_seconds")
            entry = await state.serving_registry().unload(
                router_model_name(request), grace=request.grace_seconds
            )
        except TrioserveError as exc:
            return error_response(exc)
        return json_response({"success": True, "model": entry.name, "status": entry.describe()})
