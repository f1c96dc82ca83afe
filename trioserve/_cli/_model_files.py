"""Which models ``trioserve serve`` serves, with several: ``--model NAME=PATH``, the
models a ``--models-dir`` holds (:func:`discover`), and a TOML preset file's
(:func:`read_preset`: its keys, each key's type and values, checked as the file is read)."""

from __future__ import annotations

import argparse
import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._backends._llama._auto_context import AUTO
from .._backends._llama._settings import KV_CACHE_TYPES
from .._backends._media import find_projector, is_projector_file

__all__ = ["PRESET_KEYS", "PRESET_TYPES", "discover", "is_registry", "read_preset"]

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
    "deep_chunk": "--deep-chunk",
    "deep_from": "--deep-from",
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
    "deep_chunk": (int,),
    "deep_from": (int,),
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
        from .._backends._retrieval import YesNoTemplate

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
