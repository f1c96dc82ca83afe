"""What ``trioserve serve`` serves: one backend (a model, the scripted backend, upstream
servers) or a model registry (``--model NAME=PATH``, ``--models-dir``,
``--models-preset``), built from the flags (docs/models.md)."""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._backends import Backend, LlamaBackend, LlamaSettings, ScriptedBackend, UpstreamBackend
from .._backends._llama._auto_context import AUTO, auto_context
from .._backends._llama._settings import KV_CACHE_TYPES
from .._backends._prompt_cache import HostBudget
from .._backends._sources import LlamaSource
from .._backends._vision import find_projector, is_projector_file
from .._core._exceptions import InvalidRequestError
from .._core._media import ImageBudget
from .._core._registry import ModelRegistry, ModelSpec
from .._http._exchange import parse_keep_alive

__all__ = ["blobs_dir", "discover", "is_registry", "loader", "model_maker", "read_preset", "registry"]

logger = logging.getLogger("trioserve")

#: the per-model keys of a preset file, and the flag each overrides
PRESET_KEYS = {
    "path": None,
    "aliases": None,
    "pinned": None,
    "keep_alive": "--keep-alive",
    "load_on_startup": None,
    "ctx_size": "--ctx-size",
    "cache_type_k": "--cache-type-k",
    "cache_type_v": "--cache-type-v",
    "swa_full": "--swa-full",
    "ctx_checkpoints": "--ctx-checkpoints",
    "slots": "--slots",
    "threads": "--threads",
    "batch_size": "--batch-size",
    "prefill_chunk": "--prefill-chunk",
    "piece_rule": "--piece-rule",
    "prompt_cache": "--no-prompt-cache",
    "cache_mode": "--cache-mode",
    "cache_ram": "--cache-ram",
    "batch_invariant": "--batch-invariant",
    "repack": "--repack",
    "pooling": "--pooling",
    "speculate": "--speculate",
    "rerank": "--rerank",
    "rerank_template": "--rerank-template",
    "mmproj": "--mmproj",
    "lora": "--lora",
    "lora_max": "--lora-max",
    "max_image_tokens": "--max-image-tokens",
    "max_audio_seconds": "--max-audio-seconds",
}


#: each preset key's type (checked: TOML's types, never coerced)
PRESET_TYPES: dict[str, tuple[type, ...]] = {
    "path": (str,),
    "aliases": (list,),
    "pinned": (bool,),
    "keep_alive": (str, int, float),
    "load_on_startup": (bool,),
    "ctx_size": (int, str),
    "cache_type_k": (str,),
    "cache_type_v": (str,),
    "swa_full": (bool,),
    "ctx_checkpoints": (int,),
    "slots": (int,),
    "threads": (int,),
    "batch_size": (int,),
    "prefill_chunk": (int,),
    "piece_rule": (str,),
    "prompt_cache": (bool,),
    "cache_mode": (str,),
    "cache_ram": (int,),
    "batch_invariant": (bool,),
    "repack": (str,),
    "pooling": (str,),
    "speculate": (str,),
    "rerank": (str,),
    "rerank_template": (str,),
    "mmproj": (str,),
    "lora": (dict,),
    "lora_max": (int,),
    "max_image_tokens": (int,),
    "max_audio_seconds": (int,),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "cache_type_k": tuple(KV_CACHE_TYPES),
    "cache_type_v": tuple(KV_CACHE_TYPES),
    "cache_mode": ("exact", "fast"),
    "piece_rule": ("text", "aligned"),
    "repack": ("auto", "on", "off"),
    "pooling": ("mean", "cls", "last"),
    "speculate": ("off", "auto", "exact", "fast"),
    "rerank": ("yes-no", "off"),
}


def _check_value(origin: str, key: str, value: object) -> None:
    kinds = PRESET_TYPES[key]
    if key == "lora" and isinstance(value, dict):
        for name, adapter in value.items():
            table = adapter if isinstance(adapter, dict) else {"path": adapter}
            given, scale = table.get("path"), table.get("scale", 1.0)
            extra = set(table) - {"path", "scale"}
            if not isinstance(given, str) or extra or type(scale) not in (int, float):
                shape = '"PATH" or {path = "PATH", scale = NUMBER}'
                raise RuntimeError(f"{origin}: lora.{name} must be {shape}, got {adapter!r}")
    if key == "ctx_size" and not (value == AUTO or (type(value) is int and value > 0)):
        raise RuntimeError(f'{origin}: ctx_size must be a number of tokens or "auto", got {value!r}')
    wrong = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
    if wrong:
        names = " or ".join(k.__name__ for k in kinds)
        raise RuntimeError(f"{origin}: {key} must be {names}, got {value!r}")
    if key == "aliases" and not all(isinstance(a, str) and a for a in value):  # type: ignore[attr-defined]
        raise RuntimeError(f"{origin}: aliases must be a list of names, got {value!r}")
    if key in _CHOICES and value not in _CHOICES[key]:
        raise RuntimeError(f"{origin}: {key} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
    if int in kinds and isinstance(value, int) and value < 0:
        raise RuntimeError(f"{origin}: {key} must be 0 or more, got {value!r}")
    if key == "rerank_template":
        from .._backends._rerank_layout import YesNoTemplate

        try:
            YesNoTemplate.parse(str(value))
        except ValueError as exc:
            raise RuntimeError(f"{origin}: {exc}") from None


@dataclass
class _Model:
    name: str
    path: Path | None = None
    settings: dict[str, Any] = field(default_factory=dict[str, Any])
    #: a projector found beside it in --models-dir
    projector: Path | None = None


def is_registry(args: argparse.Namespace) -> bool:
    """Several models (or a preset): a registry; else the single-model server."""
    named = any("=" in spec and not Path(spec).is_file() for spec in args.model)
    return bool(args.models_dir or args.models_preset or named or len(args.model) > 1)


def discover(directory: Path) -> dict[str, Path]:
    """The models in ``directory``: each ``.gguf`` (named by its file name without
    ``.gguf``) and each subfolder holding one (a multi-file model, named by the folder:
    its first shard, ``*-00001-of-*.gguf``). Projector files (``mmproj`` in the name) are
    not models: each is its model's (:func:`projector_for`)."""
    if not directory.is_dir():
        raise RuntimeError(f"--models-dir {directory}: not a directory")
    found: dict[str, Path] = {}
    for item in sorted(directory.iterdir()):
        if item.is_file() and item.suffix == ".gguf" and not is_projector_file(item):
            found[item.name.removesuffix(".gguf")] = item
        elif item.is_dir():
            files = sorted(f for f in item.glob("*.gguf") if not is_projector_file(f))
            shards = [f for f in files if "-00001-of-" in f.name]
            if shards:
                found[item.name] = shards[0]
            elif len(files) == 1:
                found[item.name] = files[0]
            elif files:
                logger.warning("%s holds %d GGUF files and no shard set: skipped", item, len(files))
    return found


def read_preset(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(defaults, {name: settings})`` from a TOML preset file::

    [defaults]            # every model (any per-model key)
    ctx_size = 4096

    [models.gemma-small]  # a model: a name --models-dir found, or a new one with path
    path = "gemma.gguf"   # relative to the preset file
    ctx_size = 2048
    pinned = true
    keep_alive = "10m"
    """
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RuntimeError(f"--models-preset {path}: {exc}") from None
    unknown = set(data) - {"defaults", "models"}
    if unknown:
        raise RuntimeError(f"--models-preset {path}: unknown table(s) {sorted(unknown)} (defaults, models)")
    defaults = data.get("defaults", {})
    models = data.get("models", {})
    for name, table in [("defaults", defaults), *models.items()]:
        if not isinstance(table, dict):
            raise RuntimeError(f"--models-preset {path}: [{name}] must be a table")
        bad = set(table) - set(PRESET_KEYS)
        if bad:
            raise RuntimeError(
                f"--models-preset {path}: [{name}] has unknown key(s) {sorted(bad)}; "
                f"known: {sorted(PRESET_KEYS)}"
            )
        for key, value in table.items():
            _check_value(f"--models-preset {path}: [{name}]", key, value)
        for own in ("path", "mmproj"):
            if name == "defaults" and own in table:
                raise RuntimeError(
                    f"--models-preset {path}: [defaults] cannot have a {own} (each model has its own)"
                )
        if not name:
            raise RuntimeError(f"--models-preset {path}: a model needs a name ([models.NAME])")
        for key in ("path", "mmproj"):
            if key in table:
                table[key] = (path.parent / str(table[key])).resolve()
    return defaults, models


def _models(args: argparse.Namespace) -> tuple[list[_Model], dict[str, Any]]:
    models: dict[str, _Model] = {}

    def add(name: str, path: Path, origin: str) -> None:
        if not name:
            raise RuntimeError(f"a model needs a name ({origin}: {path})")
        if name in models:
            raise RuntimeError(f"two models are named {name!r} ({models[name].path} and {path}, {origin})")
        models[name] = _Model(name, path)

    for directory in args.models_dir:
        for name, path in discover(directory).items():
            add(name, path, f"in --models-dir {directory}")
            # a projector beside it, by name (docs/vision.md); a preset's mmproj wins
            models[name].projector = find_projector(path)
    for spec in args.model:
        if "=" in spec and not Path(spec).is_file():
            name, _, path_text = spec.partition("=")
            add(name, Path(path_text), "--model NAME=PATH")
        else:
            path = Path(spec)
            add(args.model_id or path.name.removesuffix(".gguf"), path, "--model")
    defaults: dict[str, Any] = {}
    if args.models_preset is not None:
        defaults, presets = read_preset(args.models_preset)
        for name, table in presets.items():
            model = models.get(name)
            if model is None:
                if "path" not in table:
                    raise RuntimeError(
                        f"--models-preset: [models.{name}] names no model found by --models-dir or "
                        "--model; give it a path"
                    )
                model = models[name] = _Model(name, None)
            if "path" in table:
                model.path = table["path"]
            model.settings = table
    if not models:
        raise RuntimeError("no models: --models-dir found no .gguf file, and no --model was given")
    for model in models.values():
        if model.path is None or not model.path.is_file():
            raise RuntimeError(f"model file not found: {model.path} (model {model.name!r})")
    return list(models.values()), defaults


def _settings(
    args: argparse.Namespace,
    name: str,
    path: Path,
    table: dict[str, Any],
    projector: Path | None = None,
    *,
    image_budget: ImageBudget | None = None,
) -> LlamaSettings:
    def get(key: str, default: Any) -> Any:
        return table.get(key, default)

    repack = get("repack", args.repack)
    if not args.cache_disk >= 0:
        raise RuntimeError(f"--cache-disk must be 0 or more GiB, got {args.cache_disk}")
    slots = int(get("slots", args.slots or 8))
    return LlamaSettings(
        path,
        n_ctx=_context(
            name,
            path,
            get("ctx_size", args.ctx_size),
            slots,
            (get("cache_type_k", args.cache_type_k), get("cache_type_v", args.cache_type_v)),
        ),
        cache_type_k=get("cache_type_k", args.cache_type_k),
        cache_type_v=get("cache_type_v", args.cache_type_v),
        swa_full=bool(get("swa_full", args.swa_full)),
        ctx_checkpoints=int(get("ctx_checkpoints", args.ctx_checkpoints)),
        n_threads=get("threads", args.threads),
        n_batch=int(get("batch_size", args.batch_size)),
        slots=slots,
        prefill_chunk=int(get("prefill_chunk", args.prefill_chunk)),
        piece_rule=get("piece_rule", args.piece_rule),
        prompt_cache=bool(get("prompt_cache", not args.no_prompt_cache)),
        cache_ram_bytes=int(get("cache_ram", args.cache_ram)) * 1024 * 1024,
        cache_dir=cache_dir(args.cache_dir),
        cache_disk_bytes=int(args.cache_disk * (1 << 30)),
        cache_mode=get("cache_mode", args.cache_mode),
        batch_invariant=bool(get("batch_invariant", args.batch_invariant)),
        model_id=name,
        repack={"auto": None, "on": True, "off": False}[repack],
        pooling=get("pooling", args.pooling),
        speculate=get("speculate", args.speculate),
        rerank=None if (rerank := get("rerank", args.rerank)) in (None, "off") else rerank,
        rerank_template=get("rerank_template", args.rerank_template),
        mmproj=get("mmproj", projector),
        lora=_lora_table(get("lora", None), args.lora),
        lora_max=int(get("lora_max", args.lora_max)),
        max_image_tokens=int(get("max_image_tokens", args.max_image_tokens)),
        max_audio_seconds=int(get("max_audio_seconds", args.max_audio_seconds)),
        image_budget=image_budget or ImageBudget(args.image_decode_budget << 20),
    )


def _context(name: str, path: Path, value: int | str, slots: int, types: tuple[str, str]) -> int:
    """A model's context per sequence: the number given, or ``auto``'s (said in the log)."""
    if value != AUTO:
        return int(value)
    picked = auto_context(path, slots=slots, cache_type_k=types[0], cache_type_v=types[1])
    logger.info("model %s: context %s (--ctx-size auto)", name, picked.reason)
    return picked.n_ctx


def _lora_table(table: object, flags: list[tuple[str, str, float]]) -> list[tuple[str, str, float]]:
    """A model's adapters: a preset's ``lora`` table (``NAME = "PATH"`` or
    ``NAME = {path = "PATH", scale = S}``), else ``--lora``."""
    if table is None:
        return list(flags)
    adapters = []
    for name, value in table.items():  # type: ignore[attr-defined]
        if isinstance(value, str):
            adapters.append((name, value, 1.0))
        else:
            adapters.append((name, str(value["path"]), float(value.get("scale", 1.0))))
    return adapters


def cache_dir(value: str | None) -> Path | None:
    """``--cache-dir``: a directory, ``auto`` (the per-user cache directory) or none."""
    if value is None or value in ("", "off", "none"):
        return None
    if value == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "trioserve" / "prompt-cache"
    return Path(value).expanduser()


def blobs_dir(value: str) -> Path | None:
    """``--blobs-dir``: a directory, ``auto`` (the per-user data directory) or ``off``."""
    if value in ("", "off", "none"):
        return None
    if value == "auto":
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(base) / "trioserve" / "blobs"
    return Path(value).expanduser()


def model_maker(args: argparse.Namespace) -> Callable[[str, Path, Mapping[str, int]], LlamaSource]:
    """How a model added while the server runs (Ollama's ``/api/create``) loads: the
    server's flags, and the preset its request gave (``ctx_size``, ``batch_size``,
    ``threads``: checked as a preset file's values are)."""
    host_pool = HostBudget(args.cache_ram * 1024 * 1024)
    image_budget = ImageBudget(args.image_decode_budget << 20)

    def make(name: str, path: Path, preset: Mapping[str, int]) -> LlamaSource:
        for key, value in preset.items():
            try:
                _check_value(f"the model {name!r}", key, value)
            except RuntimeError as exc:
                raise InvalidRequestError(str(exc), param="parameters") from None
        settings = _settings(args, name, path, dict(preset), image_budget=image_budget)
        return LlamaSource(settings, host_pool=host_pool)

    return make


def responses_db(value: str) -> str | None:
    """``--responses-db``: a file, ``auto`` (the per-user data directory), ``memory`` or
    ``off``."""
    if value in ("", "off", "none"):
        return None
    if value == "memory":
        return value
    if value == "auto":
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return str(Path(base) / "trioserve" / "responses.sqlite3")
    return str(Path(value).expanduser())


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
