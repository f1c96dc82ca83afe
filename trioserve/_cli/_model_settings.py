"""One model's :class:`LlamaSettings`, from the flags and its preset table (a preset's
value wins over its flag): the context (``auto``'s said in the log), its adapters;
and how a model added while the server runs is made (:func:`model_maker`)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._backends import LlamaSettings
from .._backends._cache import HostBudget
from .._backends._llama._auto_context import AUTO, auto_context
from .._backends._sources import LlamaSource
from .._core._exceptions import InvalidRequestError
from .._core._media import ImageBudget
from ._model_files import _check_value
from ._paths import cache_dir

__all__ = ["model_maker"]

logger = logging.getLogger("trioserve")


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
        swa_full=_optional_bool(get("swa_full", args.swa_full)),
        ctx_checkpoints=int(get("ctx_checkpoints", args.ctx_checkpoints)),
        n_threads=get("threads", args.threads),
        n_batch=int(get("batch_size", args.batch_size)),
        slots=slots,
        prefill_chunk=int(get("prefill_chunk", args.prefill_chunk)),
        piece_rule=get("piece_rule", args.piece_rule),
        deep_chunk=None if (deep := get("deep_chunk", args.deep_chunk)) is None else int(deep),
        deep_from=int(get("deep_from", args.deep_from)),
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


def _optional_bool(value: object) -> bool | None:
    """A flag or preset value that may be left to the default (``None``)."""
    return None if value is None else bool(value)
