"""LoRA adapters loaded, unloaded and rescaled at run time (docs/lora.md, "Hot load
and unload"): vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(200 with vLLM's plain-text success line; errors as OpenAI-style JSON), and
llama-server's ``POST /lora-adapters`` (each adapter's default scale). An admin's, with
keys (``_access.ADMIN_PATHS``). Each holds a lease on its model: it is not unloaded
meanwhile (and is loaded first if it was not)."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any

from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import InvalidRequestError, TrioserveError
from .._core._registry import ModelEntry
from .._wire import encode_json
from .._wire._lora import decode_load_lora, decode_lora_scales, decode_unload_lora
from ._route_io import error_response
from ._state import ServerState

__all__ = ["LORA_PATHS", "add_lora_routes"]

#: the routes this module adds (all ``POST``)
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/lora-adapters")

ReadBody = Callable[[Callable[[bytes], Any]], Awaitable[Any]]


def _text(line: str) -> Response:
    return Response(line, content_type="text/plain; charset=utf-8")


def add_lora_routes(app: QuartTrio, state: ServerState, read_body: ReadBody) -> None:
    """Add the three routes to ``app`` (``read_body``: how a route reads its JSON body)."""

    def base(name: str | None) -> ModelEntry:
        return state.resolve(name) if name else state.serving_registry().default

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter() -> Response:
        """Load a GGUF LoRA from a path on this server (vLLM's route)."""
        try:
            registry = state.serving_registry()
            body = await read_body(decode_load_lora)
            if not body.lora_name or not body.lora_path:
                raise InvalidRequestError(
                    "Both 'lora_name' and 'lora_path' must be provided.",
                    param="lora_path" if body.lora_name else "lora_name",
                )
            if not math.isfinite(body.scale):
                raise InvalidRequestError("scale must be a finite number", param="scale")
            if body.lora_name in registry.names():
                raise InvalidRequestError(
                    f"lora_name {body.lora_name!r} is a model's name on this server: a request naming it "
                    "would get the model; choose another",
                    param="lora_name",
                )
            entry = base(body.model)
            async with registry.lease(entry) as lease:
                await lease.engine.backend.load_adapter(
                    body.lora_name,
                    body.lora_path,
                    scale=body.scale,
                    check_room=functools.partial(registry.check_adapter_room, entry),
                )
        except TrioserveError as exc:
            return error_response(exc)
        return _text(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter() -> Response:
        """Unload an adapter: new requests can no longer name it; streams using it
        finish unchanged, and its file is freed after the last (vLLM's route)."""
        try:
            registry = state.serving_registry()
            body = await read_body(decode_unload_lora)
            if not body.lora_name:
                raise InvalidRequestError("'lora_name' must be provided.", param="lora_name")
            async with registry.lease(base(body.model)) as lease:
                await lease.engine.backend.unload_adapter(body.lora_name)
        except TrioserveError as exc:
            return error_response(exc)
        return _text(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/lora-adapters")
    async def set_lora_scales() -> Response:
        """Each adapter's default scale, by id (llama-server's route: an adapter the
        list leaves out gets 0, as there; ``?model=``: which model)."""
        from quart import request

        try:
            registry = state.serving_registry()
            name = request.args.get("model")
            scales = await read_body(decode_lora_scales)
            async with registry.lease(base(name)) as lease:
                backend = lease.engine.backend
                if not all(math.isfinite(entry.scale) for entry in scales):
                    raise InvalidRequestError("scale must be a finite number", param="scale")
                given = {entry.id: entry.scale for entry in scales}
                if len(given) != len(scales):
                    raise InvalidRequestError("an adapter's id is given twice", param="id")
                listed = len(backend.info.adapters)
                for index in given:
                    if not 0 <= index < listed:
                        raise InvalidRequestError(
                            f"no adapter with id {index} (ids 0 to {listed - 1})"
                            if listed
                            else "this model has no LoRA adapters",
                            param="id",
                        )
                backend.set_adapter_scales([(i, given.get(i, 0.0)) for i in range(listed)])
        except TrioserveError as exc:
            return error_response(exc)
        return Response(encode_json({"success": True}), content_type="application/json")
