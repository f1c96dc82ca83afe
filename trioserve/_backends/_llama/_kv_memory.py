"""The KV cache's memory (docs/models.md, "KV cache types"): computed once a context
exists, from the model's shape and the cache's types, as llama.cpp sizes it — every
layer keeps, for each of the context's cells, a K row of ``key_length × head_count_kv``
values and a V row of ``value_length × head_count_kv`` values, each row
``ggml_row_size(type, n)`` bytes. (``llama_state_seq_get_size`` is not it: that is a
sequence's used cells, serialized. llama.cpp's own breakdown,
``llama_get_memory_breakdown``, is C++ only.) Sliding-window layers kept to their window
(the default) hold fewer cells: :func:`kv_memory` reads llama.cpp's figure for them.

Models whose cache has another layout — a recurrent or hybrid state, multi-head latent
attention — get no figure (``None``) rather than a wrong one."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._settings import KV_CACHE_TYPES

if TYPE_CHECKING:
    from ._model import LlamaModel

__all__ = ["KvMemory", "cell_bytes", "kv_memory"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class KvMemory:
    """The bytes of one context's KV cache, K and V, and what they hold."""

    k_bytes: int
    v_bytes: int
    #: sequences (slots), and cells per sequence
    slots: int
    ctx_per_slot: int
    type_k: str
    type_v: str
    #: a sliding-window model's window layers keep about the window only (llama.cpp's
    #: figures, to 0.01 MiB)
    window: bool = False

    @property
    def bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    def describe(self) -> str:
        """The load's log line."""
        return (
            f"KV cache: {self.bytes / _MIB:.1f} MiB for {self.slots} slot(s) × {self.ctx_per_slot} "
            f"tokens, K type {self.type_k}, V type {self.type_v}"
            + (", window layers to their window (--no-swa-full)" if self.window else "")
        )

    def as_dict(self) -> dict[str, object]:
        """``/health``'s ``kv_cache`` object."""
        return {
            "bytes": self.bytes,
            "mib": round(self.bytes / _MIB, 2),
            "k_bytes": self.k_bytes,
            "v_bytes": self.v_bytes,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "slots": self.slots,
            "ctx_per_slot": self.ctx_per_slot,
            "swa_full": not self.window,
        }


@functools.cache
def _row_size() -> Any:
    """ggml's ``ggml_row_size(type, n)``: the bytes of ``n`` values of ``type``
    (``ggml_type_size`` per block of ``ggml_blck_size`` values)."""
    from llama_cpp._ggml import libggml

    row_size = libggml.ggml_row_size
    row_size.restype = ctypes.c_size_t
    row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return row_size


def _per_layer(text: str | None, layers: int) -> list[int] | None:
    """A GGUF value that is one integer or one per layer (``head_count_kv`` of a model
    whose layers differ), as ``llama_model_meta_val_str`` writes it."""
    if text is None:
        return None
    values = [int(v) for v in re.findall(r"-?\d+", text)]
    if len(values) == 1:
        return values * layers
    return values if len(values) == layers else None


_SAID = re.compile(r"K \([^)]*\):\s*([\d.]+) MiB, V \([^)]*\):\s*([\d.]+) MiB")


def kv_memory(model: LlamaModel, ctx: Any, *, slots: int, said: list[str] | None = None) -> KvMemory | None:
    """The KV cache of ``ctx`` (a generation context of ``slots`` sequences), or
    ``None`` for a model whose cache is not plain attention K/V. A sliding-window
    model's cells kept to the window (``--no-swa-full``) hold fewer cells in some
    layers than the API tells which: there, llama.cpp's own figures (``said``, its
    ``llama_kv_cache: size = …`` lines, one per cache)."""
    lib, settings = model.lib, model.settings
    if not settings.swa_full and int(lib.llama_model_n_swa(model.model)) > 0:
        found = [_SAID.search(line) for line in said or ()]
        if not found or not all(found):
            return None
        mib = [(float(m.group(1)), float(m.group(2))) for m in found if m is not None]
        return KvMemory(
            k_bytes=int(sum(k for k, _ in mib) * _MIB),
            v_bytes=int(sum(v for _, v in mib) * _MIB),
            slots=slots,
            ctx_per_slot=int(lib.llama_n_ctx(ctx)) // slots,
            type_k=settings.cache_type_k,
            type_v=settings.cache_type_v,
            window=True,
        )
    per_cell = cell_bytes(
        lib,
        model.model,
        model.meta,
        model.architecture,
        settings.cache_type_k,
        settings.cache_type_v,
        layers=int(lib.llama_model_n_layer(model.model)),
        n_embd=int(lib.llama_model_n_embd(model.model)),
    )
    if per_cell is None:
        return None
    cells = int(lib.llama_n_ctx(ctx))
    k_bytes, v_bytes = per_cell[0] * cells, per_cell[1] * cells
    return KvMemory(
        k_bytes=int(k_bytes),
        v_bytes=int(v_bytes),
        slots=slots,
        ctx_per_slot=cells // slots,
        type_k=settings.cache_type_k,
        type_v=settings.cache_type_v,
    )


def cell_bytes(
    lib: Any,
    model: Any,
    meta: Callable[[str], str | None],
    arch: str,
    cache_type_k: str,
    cache_type_v: str,
    *,
    layers: int,
    n_embd: int,
) -> tuple[int, int] | None:
    """The bytes one cell of context takes in every layer's cache, K and V, for a
    loaded ``model`` of ``layers`` layers and ``n_embd`` dimensions (its weights, or only
    its vocabulary: the shape is in its metadata); ``None`` for a cache that is not
    plain attention K/V."""
    if lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model):
        return None
    if meta(f"{arch}.attention.kv_lora_rank") is not None:  # (MLA: a latent cache)
        return None
    head_count = _per_layer(meta(f"{arch}.attention.head_count"), layers)
    heads_kv = _per_layer(meta(f"{arch}.attention.head_count_kv"), layers) or head_count
    if heads_kv is None:
        return None
    default_head = n_embd // max(1, head_count[0]) if head_count else 0
    key = _per_layer(meta(f"{arch}.attention.key_length"), 1)
    value = _per_layer(meta(f"{arch}.attention.value_length"), 1)
    key_length = key[0] if key else default_head
    value_length = value[0] if value else key_length
    # layers that reuse an earlier layer's cache (Gemma 3n) keep none of their own
    shared = _per_layer(meta(f"{arch}.attention.shared_kv_layers"), 1)
    own = layers - (shared[0] if shared else 0)
    type_k, type_v = KV_CACHE_TYPES[cache_type_k], KV_CACHE_TYPES[cache_type_v]
    row_size = _row_size()
    k = sum(row_size(type_k, key_length * heads_kv[il]) for il in range(own))
    v = sum(row_size(type_v, value_length * heads_kv[il]) for il in range(own))
    return int(k), int(v)
