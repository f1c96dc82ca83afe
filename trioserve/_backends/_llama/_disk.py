"""The disk tier a model's context opens (``cache_dir``; docs/prompt-cache.md, "On
disk"): its directory in the server's :class:`~.._cache._disk_cache.DiskStore`, named by the
fingerprint of the cells this model computes — the GGUF's content, the settings that
change cells, the llama.cpp build and the CPU features it runs with — so an entry is
offered only to a model that would compute the same cells itself. A directory where
nothing can be written (a read-only filesystem, another user's) is no reason to refuse
the model: it runs without the disk tier, said in the log and in ``/health``."""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

import llama_cpp

from .._cache import DiskStore, DiskTier, fingerprint, gguf_digest
from ._settings import KV_CACHE_TYPES

if TYPE_CHECKING:
    from ._model import LlamaModel

__all__ = ["open_disk_tier"]

logger = logging.getLogger("trioserve.cache")


def open_disk_tier(model: LlamaModel, *, rule: str, window: int) -> tuple[DiskTier | None, str | None]:
    """The model's disk tier, or ``None`` (no ``cache_dir``, or a budget of 0), and why a
    ``cache_dir`` given is not used (``None``: it is, or none is given). Hashes the GGUF
    the first time a file is seen (checking the load's abort between megabytes); later
    loads read the digest the store remembers."""
    settings = model.settings
    if settings.cache_dir is None or not settings.cache_disk_bytes:
        return None, None
    try:
        store = DiskStore.shared(settings.cache_dir, settings.cache_disk_bytes)
    except OSError as e:
        return None, _off(settings.model_id, settings.cache_dir, e)
    params = model.lib.llama_context_default_params()
    cells: dict[str, object] = {
        # what the cells of a prefix are computed with (docs/prompt-cache.md, "On disk")
        "n_ctx": settings.n_ctx,
        "n_batch": settings.n_batch,
        "prefill_chunk": settings.prefill_chunk,
        "cut": rule,
        "cache_mode": settings.cache_mode,
        # the cache's types, as the context is made (``Context``: settings.cache_type_k/_v)
        "type_k": KV_CACHE_TYPES[settings.cache_type_k],
        "type_v": KV_CACHE_TYPES[settings.cache_type_v],
        "flash_attn_type": int(params.flash_attn_type),
        "swa_full": settings.swa_full or not window,  # (no window layers: the same cells)
        "kv_unified": settings.slots == 1,
        "batch_invariant": settings.batch_invariant,
        "repacked": bool(model.repack.extra_buffers) if model.repack is not None else None,
    }
    build = f"llama-cpp-python {llama_cpp.__version__}; {model.system_info}"
    content = gguf_digest(settings.model_path, store.root, check=model.check_abort)
    print_ = fingerprint(content, cells, build)
    made_of = {"gguf_sha256": content, "file": str(settings.model_path), "cells": cells, "build": build}
    try:
        tier = store.tier(print_, window=window, made_of=made_of)
    except OSError as e:  # (its directory cannot be made: the filesystem turned read-only, full)
        return None, _off(settings.model_id, settings.cache_dir, e)
    if len(tier):
        logger.info("%s: %d cached prefix(es) on disk (%s)", settings.model_id, len(tier), tier.directory)
    for other, made in store.made_of(content):
        if other != print_:
            differ = sorted(
                key
                for key in {*cells, *made.get("cells", {})}
                if cells.get(key) != made.get("cells", {}).get(key)
            )
            if made.get("build") != build:
                differ.append("build")
            logger.info(
                "%s: the disk cache holds prefixes of this model made with other settings (%s): "
                "they are not used",
                settings.model_id,
                ", ".join(differ) or "?",
            )
    return tier, None


def _off(model_id: str, directory: object, e: OSError) -> str:
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else type(e).__name__
    why = f"{directory} is not writable: {e.strerror or e} ({code})"
    logger.warning(
        "%s: the prompt cache's disk tier is OFF (--cache-dir %s: %s); the model is served "
        "without it — fix the directory and reload the model",
        model_id,
        directory,
        e,
    )
    return why
