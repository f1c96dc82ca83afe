"""The context length where clients read it (docs/api.md, "The context length"):
``GET /props`` in llama-server's shape (``default_generation_settings.n_ctx``,
``total_slots``, the chat template, BOS/EOS text; ``?model=`` picks a model, as
llama-server's router does), and :func:`context_length` — a model's context per
sequence, loaded or not — which ``/v1/models`` lists as ``context_length`` and vLLM's
``max_model_len``."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import TrioserveError
from .._core._registry import ModelEntry
from .._wire import encode_json
from ._route_io import error_response
from ._state import ServerState

__all__ = ["add_props_route", "context_length", "lora_adapters"]

#: ``build_info``'s prefix: an upstream relay reads it to tell trioserve from llama-server
BUILD_PREFIX = "trioserve"


def context_length(entry: ModelEntry) -> int | None:
    """The model's context per sequence: the loaded backend's, else what its source
    will load with (``--ctx-size``, a preset's ``ctx_size``); ``None``: not known until
    it loads (an upstream's)."""
    engine = entry.engine
    if engine is not None:
        return engine.backend.info.context_length
    known = getattr(entry.spec.source, "context_length", None)
    return known if isinstance(known, int) else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trioserve")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "0"


def props(entry: ModelEntry, name: str) -> dict[str, object]:
    """``GET /props`` for ``entry`` (named ``name``)."""
    engine = entry.engine
    info = engine.backend.info if engine is not None else None
    source = entry.spec.source
    settings = getattr(source, "settings", None)
    path = getattr(settings, "model_path", None)
    slots = engine.admission.slots if engine is not None else getattr(settings, "slots", None)
    return {
        "default_generation_settings": {"n_ctx": context_length(entry)},
        "total_slots": slots,
        "model_alias": name,
        "model_path": str(path) if path is not None else None,
        "modalities": {
            "vision": bool(info.vision) if info is not None else False,
            "audio": bool(info.audio) if info is not None else False,
        },
        "chat_template": (info.chat_template or "") if info is not None else "",
        "bos_token": info.bos_token if info is not None else "",
        "eos_token": info.eos_token if info is not None else "",
        "build_info": f"{BUILD_PREFIX} {_version()}",
        # llama-server's word for a model not in memory (the router's unloaded one)
        "is_sleeping": engine is None,
    }


def lora_adapters(entry: ModelEntry) -> list[dict[str, object]]:
    """``GET /lora-adapters`` for ``entry``: llama-server's list (``id``, ``path``,
    ``scale``) with each adapter's ``name`` (docs/lora.md); a model not loaded: what it
    will load."""
    settings = getattr(entry.spec.source, "settings", None)
    engine = entry.engine
    listed = (
        engine.backend.info.adapters
        if engine is not None
        else tuple((name, scale, str(path)) for name, path, scale in getattr(settings, "lora", ()))
    )
    entries: list[dict[str, object]] = [
        {"id": i, "name": n, "path": path, "scale": scale} for i, (n, scale, path) in enumerate(listed)
    ]
    # an activated LoRA's invocation, under llama-server's keys (known once loaded)
    invocations = {name: (tokens, text) for name, tokens, text in engine.backend.info.alora} if engine else {}
    for item in entries:
        if item["name"] in invocations:
            tokens, text = invocations[str(item["name"])]
            item["alora_invocation_string"] = text
            item["alora_invocation_tokens"] = list(tokens)
    return entries


def add_props_route(app: QuartTrio, state: ServerState) -> None:
    def entry_of(name: str | None) -> ModelEntry:
        return state.resolve(name) if name else state.serving_registry().default

    @app.get("/lora-adapters")
    async def get_lora_adapters() -> Response:
        """The model's LoRA adapters in llama-server's shape (``?model=``: which one)."""
        from quart import request

        try:
            entry = entry_of(request.args.get("model"))
        except TrioserveError as exc:
            return error_response(exc)
        return Response(encode_json(lora_adapters(entry)), content_type="application/json")

    @app.get("/props")
    async def get_props() -> Response:
        """The model's properties in llama-server's shape (``?model=``: which one;
        default: the default model). A model not loaded is not loaded for it: its
        context is what it will load with, ``is_sleeping`` true."""
        from quart import request

        name = request.args.get("model")
        try:
            entry = state.resolve(name) if name else state.serving_registry().default
        except TrioserveError as exc:
            return error_response(exc)
        return Response(encode_json(props(entry, name or entry.name)), content_type="application/json")
