"""One llama context with its batch and abort flag (:class:`Context`), whose abort
callback (``_abort.c``) reads that flag between graph nodes without the GIL. Why the
low-level API and a C callback: ``docs/architecture.md``, "The per-token path"."""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

from ..._core._exceptions import BackendError
from ._kv_memory import KvMemory, kv_memory
from ._native import capture_errors, kv_size_lines, make_abort_callback
from ._settings import KV_CACHE_TYPES

if TYPE_CHECKING:
    from ._model import LlamaModel

__all__ = ["Context"]

logger = logging.getLogger("trioserve.llama")


class Context:
    """One llama context with its batch and abort flag. Used by one thread at a time.

    Room for ``sequences`` sequences of ``settings.n_ctx`` tokens each, in a non-unified
    KV cache (each sequence owns its cells; attention never reads another sequence's),
    of the types ``settings.cache_type_k/_v`` (flash attention stays llama.cpp's
    ``auto``, which it turns on for a quantized V)."""

    def __init__(self, model: LlamaModel, *, sequences: int = 1) -> None:
        lib = model.lib
        settings = model.settings
        params = lib.llama_context_default_params()
        params.n_ctx = settings.n_ctx * sequences
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.n_seq_max = sequences
        # sliding-window layers keep every cell too (``swa_full``; the default up to
        # four times the window and a batch: LlamaSettings.resolve_window): any
        # cached prefix's cells are there, where a fresh evaluation puts them; without
        # it (``--no-swa-full``, llama-server's default) they keep about the window and
        # a batch, and reuse is where they reach or from a checkpoint of them
        # (docs/prompt-cache.md, "Window layers")
        params.swa_full = settings.swa_full
        if sequences > 1:
            params.kv_unified = False
        params.type_k = KV_CACHE_TYPES[settings.cache_type_k]
        params.type_v = KV_CACHE_TYPES[settings.cache_type_v]
        with capture_errors() as said:
            ctx = lib.llama_init_from_model(model.model, params)
            sizes = kv_size_lines()
        if not ctx:
            types = (settings.cache_type_k, settings.cache_type_v)
            raise BackendError(_refused(*types, sequences, settings.n_ctx, said))
        self.ctx = ctx
        #: the KV cache's bytes (``None``: a cache of another layout: _kv_memory.py)
        self.kv_memory: KvMemory | None = kv_memory(model, ctx, slots=sequences, said=sizes)
        if self.kv_memory is not None:
            logger.info("%s: %s", settings.model_id, self.kv_memory.describe())
        self.memory = lib.llama_get_memory(ctx)
        self.n_batch = settings.n_batch
        self.batch = lib.llama_batch_init(settings.n_batch, 0, 1)
        for i in range(settings.n_batch):
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = 0
        #: a vision model's image calls: rows of embeddings instead of token ids
        self.embd_batch: Any = None
        if model.projector is not None:
            self.embd_batch = lib.llama_batch_init(settings.n_batch, model.n_embd, 1)
            for i in range(settings.n_batch):
                self.embd_batch.n_seq_id[i] = 1
        # The callback object and its flag must outlive the context: keep references.
        self.abort_flag = ctypes.c_ubyte(0)
        self._abort_callback, self.abort_flag_used = make_abort_callback(lib)
        lib.llama_set_abort_callback(ctx, self._abort_callback, ctypes.addressof(self.abort_flag))

    def free(self, lib: Any) -> None:
        lib.llama_batch_free(self.batch)
        if self.embd_batch is not None:
            lib.llama_batch_free(self.embd_batch)
        lib.llama_free(self.ctx)


def _refused(type_k: str, type_v: str, sequences: int, n_ctx: int, said: list[str]) -> str:
    """Why a context could not be made: llama.cpp's own words, and the flags to change
    where the cache types are not the defaults (a quantized type needs a head size its
    block divides; a quantized V needs flash attention)."""
    cause = "; ".join(line.strip() for line in said if line.strip())
    text = f"llama.cpp could not create a context for {sequences} sequence(s) of {n_ctx} tokens"
    if (type_k, type_v) != ("f16", "f16"):
        text += f" with K cache type {type_k} and V cache type {type_v}"
    if cause:
        text += f": {cause}"
    flags = [f"--cache-type-{kv} {t}" for kv, t in (("k", type_k), ("v", type_v)) if t != "f16"]
    if flags:
        text += f" ({' and '.join(flags)}: try f16, or another type llama.cpp accepts for this model)"
    return text
