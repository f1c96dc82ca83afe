"""``--ctx-size auto`` (the command line's default): each sequence's context sized to
the model's training length and the memory the machine has (docs/long-context.md,
"The default context"). The model's shape is read from a vocabulary-only load (its
metadata, no weights); the KV cache may take at most a quarter of the memory available
at start; the context is the training length when ``slots`` sequences of it fit,
else the most that fits (a multiple of 256), never below 4,096 (the old default)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..._core._exceptions import BackendError
from ._kv_memory import cell_bytes
from ._native import LoadLog, make_log_callback, meta_value

__all__ = ["AUTO", "FLOOR", "AutoContext", "auto_context", "memory_available"]

AUTO = "auto"
#: the smallest context ``auto`` picks (the model's training length if shorter)
FLOOR = 4096
_STEP = 256
#: the share of the available memory the KV cache may take
_SHARE = 4
_GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class AutoContext:
    """The context ``auto`` picked, and why (said at start)."""

    n_ctx: int
    reason: str


def memory_available() -> int | None:
    """The bytes of memory available to a new process now (Linux's ``MemAvailable``;
    elsewhere the free physical pages), or ``None``."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def auto_context(
    path: Path,
    *,
    slots: int,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    available: int | None = None,
) -> AutoContext:
    """The context per sequence for ``slots`` sequences of the model at ``path``
    (blocking: reads its metadata and vocabulary). ``available``: the memory to size
    against (default: :func:`memory_available`)."""
    import llama_cpp

    if LoadLog.callback is None:  # (llama.cpp's lines go to the log, as at a load)
        LoadLog.callback = make_log_callback()
    llama_cpp.llama_log_set(LoadLog.callback, None)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise BackendError(f"llama.cpp could not read {path} to size its context")
    try:
        # (a vocabulary-only load reads no hyperparameters: the metadata says them)
        def meta(key: str) -> str | None:
            return meta_value(llama_cpp, model, key)

        def number(key: str) -> int:
            value = meta(key)
            return int(value) if value is not None and value.strip().isdigit() else 0

        arch = meta("general.architecture") or ""
        train = number(f"{arch}.context_length")
        layers, n_embd = number(f"{arch}.block_count"), number(f"{arch}.embedding_length")
        per_cell = (
            cell_bytes(llama_cpp, model, meta, arch, cache_type_k, cache_type_v, layers=layers, n_embd=n_embd)
            if layers
            else None
        )
    finally:
        llama_cpp.llama_model_free(model)
    return pick(train, per_cell, slots, memory_available() if available is None else available)


def pick(train: int, per_cell: tuple[int, int] | None, slots: int, available: int | None) -> AutoContext:
    """:func:`auto_context`'s choice, from the model's training length, the bytes of
    one cell (K, V), the sequences and the memory available."""
    if train <= 0:
        return AutoContext(FLOOR, f"{FLOOR} tokens per sequence (the model states no training length)")
    floor = min(train, FLOOR)
    if per_cell is None or available is None:
        why = "its cache's size cannot be computed" if per_cell is None else "the memory available is unknown"
        return AutoContext(
            floor, f"{floor} tokens per sequence ({why}; the model's training length: {train})"
        )
    cell = sum(per_cell)
    budget = available // _SHARE
    need = slots * train * cell
    said = (
        f"{slots} × {{n}} cells of KV cache take {{gib:.2f}} GiB "
        f"of a quarter of the {available / _GIB:.1f} GiB available"
    )
    if need <= budget:
        return AutoContext(
            train,
            f"{train} tokens per sequence, the model's training length ("
            + said.format(n=train, gib=need / _GIB)
            + ")",
        )
    fit = budget // (slots * cell) // _STEP * _STEP
    if fit >= floor:
        return AutoContext(
            fit,
            f"{fit} tokens per sequence, the most that fits (the training length {train} would need "
            f"{need / _GIB:.2f} GiB; " + said.format(n=fit, gib=slots * fit * cell / _GIB) + ")",
        )
    return AutoContext(
        floor,
        f"{floor} tokens per sequence, the least auto picks ({slots} × {floor} cells of KV cache take "
        f"{slots * floor * cell / _GIB:.2f} GiB, more than a quarter of the {available / _GIB:.1f} GiB "
        "available: pass --ctx-size or fewer --slots)",
    )
