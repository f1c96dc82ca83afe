"""What ``trioserve serve`` serves: one backend (a model, the scripted backend, upstream
servers) or a model registry (``--model NAME=PATH``, ``--models-dir``,
``--models-preset``), built from the flags (docs/models.md). Which models:
``_model_files``; each one's settings: ``_model_settings``; where files go: ``_paths``."""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from .._backends import Backend, LlamaBackend, ScriptedBackend, UpstreamBackend
from .._backends._cache import HostBudget
from .._backends._llama._auto_context import AUTO
from .._backends._sources import LlamaSource
from .._core._exceptions import InvalidRequestError
from .._core._media import ImageBudget
from .._core._registry import ModelRegistry, ModelSpec
from .._http._exchange import parse_keep_alive
from ._model_files import _models, discover, is_registry, read_preset
from ._model_settings import _settings, model_maker
from ._paths import blobs_dir

__all__ = ["blobs_dir", "discover", "is_registry", "loader", "model_maker", "read_preset", "registry"]

logger = logging.getLogger("trioserve")


def _keep_alive(value: object, origin: str) -> float | None:
    if value is None:
        return None
    try:
        return parse_keep_alive(str(value))
    except InvalidRequestError as exc:
        raise RuntimeError(f"{origin}: {exc.message}") from None


def registry(args: argparse.Namespace, *, max_queue: int) -> tuple[str, ModelRegistry]:
    """The registry the flags describe, and a line for the log."""
    if args.scripted or args.upstream:
        raise RuntimeError(
            "--scripted and --upstream serve one backend: drop --models-dir / NAME=PATH / presets"
        )
    models, defaults = _models(args)
    if args.models_max is not None and args.models_max < 1:
        raise RuntimeError(f"--models-max must be at least 1, got {args.models_max}")
    if args.models_memory is not None and args.models_memory <= 0:
        raise RuntimeError(f"--models-memory must be positive MiB, got {args.models_memory}")
    if not args.unload_grace >= 0:
        raise RuntimeError(f"--unload-grace must be 0 or more seconds, got {args.unload_grace}")
    server_keep_alive = _keep_alive(args.keep_alive, "--keep-alive")
    if args.cache_ram < 0:
        raise RuntimeError(f"--cache-ram must be 0 or more MiB, got {args.cache_ram}")
    # --cache-ram: one host-memory budget for every model's prompt cache (a model's
    # cache_ram caps its share of it): unloaded models' prefixes go first
    host_pool = HostBudget(args.cache_ram * 1024 * 1024)
    # --image-decode-budget: one for every model's images
    image_budget = ImageBudget(args.image_decode_budget << 20)
    if args.mmproj:
        raise RuntimeError(
            "--mmproj is for one model; with several, give a model its projector with a preset's "
            "mmproj key, or put it beside the model in --models-dir (mmproj-NAME.gguf)"
        )
    if args.lora:
        raise RuntimeError(
            "--lora is for one model; with several, give a model its adapters with a preset's lora "
            'table ([models.NAME.lora] ADAPTER = "PATH")'
        )
    specs = []
    for index, model in enumerate(models):
        assert model.path is not None
        table = {**defaults, **model.settings}
        keep_alive = _keep_alive(table.get("keep_alive"), f"keep_alive of {model.name}")
        aliases = tuple(table.get("aliases", ()))
        if index == 0:
            aliases += tuple(args.model_alias)  # --model-alias: the default model's
        settings = _settings(args, model.name, model.path, table, model.projector, image_budget=image_budget)
        specs.append(
            ModelSpec(
                name=model.name,
                source=LlamaSource(settings, host_pool=host_pool),
                adapters=tuple(name for name, _, _ in settings.lora),
                aliases=aliases,
                pinned=bool(table.get("pinned", False)),
                keep_alive=keep_alive,
                preload=bool(table.get("load_on_startup", False)),
            )
        )
    models_memory = None if args.models_memory is None else args.models_memory * 1024 * 1024
    built = ModelRegistry(
        specs,
        max_loaded=args.models_max,
        memory_budget=models_memory,
        keep_alive=math.inf if server_keep_alive is None else server_keep_alive,
        unload_grace=args.unload_grace,
        max_queue=max_queue,
        pause_ram=args.pause_ram * 1024 * 1024,
    )
    bound = f", at most {args.models_max} loaded" if args.models_max else ""
    names = ", ".join(spec.name for spec in specs)
    return f"{len(specs)} model(s) on demand{bound}: {names}", built


def loader(args: argparse.Namespace) -> tuple[str, Callable[[], Awaitable[Backend]]]:
    """The single backend the flags describe (one model, scripted, upstreams)."""
    ignored = [
        flag
        for flag, value in (
            ("--models-max", args.models_max),
            ("--models-memory", args.models_memory),
            ("--keep-alive", args.keep_alive),
        )
        if value is not None
    ]
    if ignored:
        raise RuntimeError(
            f"{', '.join(ignored)}: for several models (--model NAME=PATH, --models-dir); "
            "one model is loaded at startup and stays"
        )
    if args.upstream:
        if args.scripted or args.model:
            raise RuntimeError("--upstream serves a model that runs elsewhere: drop --model / --scripted")
        slots = args.slots or 8
        load = functools.partial(
            UpstreamBackend.aload,
            args.upstream,
            model_id=args.model_id,
            slots_per_upstream=slots,
            cooldown=args.upstream_cooldown,
            extra_body=args.upstream_body,
            api_key=os.environ.get("TRIOSERVE_UPSTREAM_API_KEY") or None,
        )
        return f"upstream(s) {', '.join(args.upstream)} ({slots} slot(s) each)", load
    if args.batch:
        logger.warning("--batch is the default now (and the only llama backend); the flag does nothing")
    if args.slots is None:
        args.slots = 8
    if args.slots < 1:
        raise RuntimeError(f"--slots must be at least 1, got {args.slots}")
    if args.scripted:
        backend = ScriptedBackend(
            token_interval=args.scripted_interval,
            slots=args.slots,
            context_length=4096 if args.ctx_size == AUTO else args.ctx_size,
        )

        async def scripted() -> Backend:
            return backend

        return "scripted backend", functools.partial(scripted)
    if not args.model:
        from .._backends._models import default_model_path

        path = default_model_path(progress=sys.stderr.isatty())
    else:
        path = Path(args.model[0])
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
    projector = Path(args.mmproj) if args.mmproj else None
    if projector is not None and not projector.is_file():
        raise FileNotFoundError(f"--mmproj: projector file not found: {projector}")
    settings = _settings(args, args.model_id or path.name.removesuffix(".gguf"), path, {}, projector)
    description = (
        f"model {path} ({settings.slots} sequences of {settings.n_ctx} tokens, "
        f"{settings.n_threads} threads{', batch-invariant' if settings.batch_invariant else ''})"
    )
    return description, functools.partial(LlamaBackend.aload, settings)
