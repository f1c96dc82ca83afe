"""A model's LoRA adapters (docs/lora.md): loaded after its weights, chosen per request
as an *adapter set* — ``((name, scale), …)``, sorted by name, no zero scale: the
canonical form that groups sequences into calls and salts their caches — and applied to
the generation context before each call."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..._core._exceptions import BackendError, InvalidRequestError
from ._native import capture_errors
from ._settings import check_adapter_name

__all__ = [
    "AdapterSet",
    "LoraAdapter",
    "LoraAdapters",
    "adapter_salt",
    "adapters_of_salt",
    "check_adapter_name",
]

#: an adapter set: ``((name, scale), …)``, sorted by name, every scale non-zero
AdapterSet = tuple[tuple[str, float], ...]

#: where a salt's adapter set starts (no key salt or ``cache_salt`` holds a NUL: the
#: body's ``cache_salt`` is JSON text, checked as a string of at most 256 characters)
_MARK = "\0lora:"


def canonical(pairs: Sequence[tuple[str, float]]) -> AdapterSet:
    """The adapter set of ``pairs``: sorted by name, zero scales dropped (scale 0 is
    the base model: no extra work in its graph), a name given twice refused."""
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise InvalidRequestError("lora: an adapter is named twice", param="lora")
    return tuple(sorted((name, float(scale)) for name, scale in pairs if scale != 0.0))


def adapter_salt(salt: str, adapters: AdapterSet) -> str:
    """The cache salt of a request of ``salt`` run with ``adapters``: cells and states
    of one adapter set serve only that set (llama.cpp #26207)."""
    if not adapters:
        return salt
    return salt + _MARK + ";".join(f"{name}={scale!r}" for name, scale in adapters)


def adapters_of_salt(salt: str) -> AdapterSet:
    """The adapter set a salt made by :func:`adapter_salt` holds."""
    _, mark, listed = salt.partition(_MARK)
    if not mark:
        return ()
    pairs = (item.split("=", 1) for item in listed.split(";"))
    return tuple((name, float(scale)) for name, scale in pairs)


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One loaded adapter."""

    name: str
    path: Path
    #: its scale when a request names it without one
    scale: float
    #: ``llama_adapter_lora *``
    pointer: Any
    #: its ``adapter.lora.alpha``
    alpha: float


class LoraAdapters:
    """The adapters of one model, in the order they were given (their ``id``s)."""

    def __init__(self, lib: Any, model: Any) -> None:
        self._lib = lib
        self._model = model
        self._by_name: dict[str, LoraAdapter] = {}
        #: the set applied to each context last (by the context's address)
        self._applied: dict[int, AdapterSet] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def listed(self) -> list[LoraAdapter]:
        """The adapters, in their ``id`` order."""
        return list(self._by_name.values())

    def load(self, name: str, path: Path, scale: float = 1.0) -> LoraAdapter:
        """Load the adapter at ``path`` as ``name`` (blocking). llama.cpp checks it
        against the base (architecture, every tensor's shape): its reason is the error."""
        check_adapter_name(name)
        if name in self._by_name:
            raise BackendError(f"an adapter named {name!r} is already loaded")
        if not path.is_file():
            raise BackendError(f"LoRA adapter file not found: {path}")
        lib = self._lib
        with capture_errors() as said:
            pointer = lib.llama_adapter_lora_init(self._model, str(path).encode())
        if not pointer:
            cause = "; ".join(line.strip() for line in said if line.strip())
            said_why = f": {cause}" if cause else ""
            raise BackendError(f"llama.cpp could not load the LoRA adapter {path} for this model{said_why}")
        if lib.llama_adapter_get_alora_n_invocation_tokens(pointer):
            lib.llama_adapter_lora_free(pointer)
            raise BackendError(f"{path} is an activated LoRA (aLoRA): not served yet (docs/lora.md)")
        alpha_text = ctypes.create_string_buffer(64)
        found = lib.llama_adapter_meta_val_str(pointer, b"adapter.lora.alpha", alpha_text, 64)
        alpha = float(alpha_text.value or 0) if found >= 0 else 0.0
        adapter = LoraAdapter(name, path, float(scale), pointer, alpha)
        self._by_name[name] = adapter
        return adapter

    def select(self, pairs: Sequence[tuple[str, float | None]]) -> AdapterSet:
        """The adapter set of a request's ``(name, scale)`` pairs (``None``: the
        adapter's own scale); an unknown name: 400 naming those there are."""
        resolved = []
        for name, scale in pairs:
            adapter = self._by_name.get(name)
            if adapter is None:
                there = ", ".join(self._by_name) or "none"
                raise InvalidRequestError(f"no LoRA adapter named {name!r} (adapters: {there})", param="lora")
            resolved.append((name, adapter.scale if scale is None else scale))
        return canonical(resolved)

    def by_id(self, index: int) -> str:
        """The name of the adapter llama-server's ``lora: [{"id": …}]`` means."""
        listed = self.listed
        if not 0 <= index < len(listed):
            raise InvalidRequestError(
                f"lora: no adapter with id {index} (ids 0 to {len(listed) - 1})"
                if listed
                else "lora: this model has no LoRA adapters (--lora NAME=PATH)",
                param="lora",
            )
        return listed[index].name

    def apply(self, ctx: Any, adapters: AdapterSet) -> None:
        """Set ``adapters`` on ``ctx`` for its next call (nothing when they are set)."""
        key = ctypes.cast(ctx, ctypes.c_void_p).value or 0
        if self._applied.get(key, ()) == adapters:
            return
        n = len(adapters)
        pointers = (self._lib.llama_adapter_lora_p_ctypes * max(n, 1))()
        scales = (ctypes.c_float * max(n, 1))()
        for i, (name, scale) in enumerate(adapters):
            pointers[i] = self._by_name[name].pointer
            scales[i] = scale
        self._lib.llama_set_adapters_lora(ctx, pointers, n, scales)
        self._applied[key] = adapters
