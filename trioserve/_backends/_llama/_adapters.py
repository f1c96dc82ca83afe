"""A model's LoRA adapters (docs/lora.md): loaded after its weights or at run time,
chosen per request as an *adapter set* — ``((name, scale), …)``, sorted by name, no zero
scale: the canonical form — and applied to the generation context before each call.

A request's set names adapters; a running sequence's set names *loaded files*: each
name is bound, when its sequence is submitted (:meth:`LoraAdapters.acquire`), to the
key of the file loaded under it now (``NAME@DIGEST``: the file's SHA-256). Keys group
sequences into calls, salt their caches (an adapter reloaded under its name from
another file shares no cell, host or disk entry with the old one) and pick the
pointers the executor applies. An adapter unloaded while sequences use it leaves the
list at once and is freed when its last sequence is done (:meth:`LoraAdapters.release`)."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..._core._exceptions import BackendError, InvalidRequestError
from .._cache import final_salt
from ._native import capture_errors
from ._settings import check_adapter_name

__all__ = [
    "AdapterSet",
    "LoraAdapter",
    "LoraAdapters",
    "adapter_salt",
    "adapters_of_salt",
    "check_adapter_name",
    "read_adapter_file",
]

#: an adapter set: ``((name or key, scale), …)``, sorted, every scale non-zero
AdapterSet = tuple[tuple[str, float], ...]

#: where a salt's adapter set starts (no key salt or ``cache_salt`` holds a NUL: the
#: body's ``cache_salt`` is JSON text, checked as a string of at most 256 characters)
_MARK = "\0lora:"
#: the hex digits of a file's SHA-256 its key holds
_DIGEST_CHARS = 16
#: bytes hashed between two looks at the abort flag
_CHUNK = 1 << 20


def canonical(pairs: Sequence[tuple[str, float]]) -> AdapterSet:
    """The adapter set of ``pairs``: sorted by name, zero scales dropped (scale 0 is
    the base model: no extra work in its graph), a name given twice refused."""
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise InvalidRequestError("lora: an adapter is named twice", param="lora")
    return tuple(sorted((name, float(scale)) for name, scale in pairs if scale != 0.0))


def adapter_salt(salt: str, adapters: AdapterSet) -> str:
    """The cache salt of a request of ``salt`` run with ``adapters`` (a sequence's:
    keys, so the files themselves): cells and states of one set serve only that set
    (llama.cpp #26207)."""
    if not adapters:
        return salt
    return salt + _MARK + ";".join(f"{name}={scale!r}" for name, scale in adapters)


def adapters_of_salt(salt: str) -> AdapterSet:
    """The adapter set a salt made by :func:`adapter_salt` holds (an aLoRA request's:
    the set of its cells past the switch, its reply's)."""
    _, mark, listed = final_salt(salt).partition(_MARK)
    if not mark:
        return ()
    pairs = (item.split("=", 1) for item in listed.split(";"))
    return tuple((name, float(scale)) for name, scale in pairs)


def read_adapter_file(path: Path, aborted: Callable[[], bool] = lambda: False) -> tuple[str, int]:
    """``(digest, size)`` of the adapter file at ``path`` (blocking: it reads the whole
    file, which also brings it into the page cache for llama.cpp's read). Refuses a
    path that is no file or no GGUF; ``aborted()`` true: :class:`LoadCancelled`."""
    if not path.is_file():
        raise BackendError(f"LoRA adapter file not found: {path}")
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        head = file.read(4)
        if head != b"GGUF":
            raise BackendError(
                f"{path} is not a GGUF file (a LoRA adapter is one: llama.cpp's convert_lora_to_gguf.py)"
            )
        digest.update(head)
        size = len(head)
        while chunk := file.read(_CHUNK):
            if aborted():
                raise LoadCancelled
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest()[:_DIGEST_CHARS], size


class LoadCancelled(Exception):
    """A run-time load's client left before llama.cpp started reading the file."""


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One loaded adapter file, under a name."""

    name: str
    path: Path
    #: its scale when a request names it without one
    scale: float
    #: ``llama_adapter_lora *``
    pointer: Any
    #: its ``adapter.lora.alpha``
    alpha: float
    #: the first hex digits of its file's SHA-256
    digest: str = ""
    #: its file's bytes
    size: int = 0
    #: loaded at run time (``POST /v1/load_lora_adapter``): its bytes count against
    #: the model's memory
    hot: bool = False
    #: an activated LoRA's invocation tokens (``adapter.alora.invocation_tokens``): it
    #: applies from where they last occur in the prompt on; empty: a plain LoRA
    invocation: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """What a running sequence's set names it by (and its cache salt holds)."""
        return f"{self.name}@{self.digest}"


class LoraAdapters:
    """The adapters of one model: the listed ones in their ``id`` order (the Trio
    thread's), and every loaded file by key with the sequences that use it (under a
    lock: the scheduler thread reads the pointers)."""

    def __init__(self, lib: Any, model: Any) -> None:
        self._lib = lib
        self._model = model
        self._by_name: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()
        #: every loaded file (listed, or unloaded and still in use), by key
        self._by_key: dict[str, LoraAdapter] = {}
        #: the sequences using each key
        self._users: dict[str, int] = {}
        #: the set applied to each context last (by the context's address)
        self._applied: dict[int, AdapterSet] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def listed(self) -> list[LoraAdapter]:
        """The adapters, in their ``id`` order."""
        return list(self._by_name.values())

    def get(self, name: str) -> LoraAdapter | None:
        return self._by_name.get(name)

    @property
    def in_use(self) -> dict[str, int]:
        """The sequences using each loaded file, by key (tests and ``/health``)."""
        with self._lock:
            return {key: n for key, n in self._users.items() if n}

    @property
    def hot_bytes(self) -> int:
        """The bytes of the files loaded at run time still allocated (listed, or
        unloaded and in use)."""
        with self._lock:
            return sum(a.size for a in self._by_key.values() if a.hot)

    # ------------------------------------------------------------------ loading

    def load(self, name: str, path: Path, scale: float = 1.0) -> LoraAdapter:
        """Load the adapter at ``path`` as ``name`` (blocking: a model's load)."""
        check_adapter_name(name)
        if name in self._by_name:
            raise BackendError(f"an adapter named {name!r} is already loaded")
        digest, size = read_adapter_file(path)
        adapter = self.open(name, path, scale, digest, size)
        self.add(adapter)
        return adapter

    def reusable(self, name: str, digest: str) -> LoraAdapter | None:
        """The file ``name@digest`` if it is still allocated (unloaded, still in use):
        a reload of the same file under the same name takes it back."""
        with self._lock:
            return self._by_key.get(f"{name}@{digest}")

    def open(
        self, name: str, path: Path, scale: float, digest: str, size: int, *, hot: bool = False
    ) -> LoraAdapter:
        """``llama_adapter_lora_init`` (blocking; the caller holds the cores' turn at run
        time: llama.cpp registers the adapter in the model's list, which a context's
        graph reservation reads). llama.cpp checks it against the base (architecture,
        every tensor's shape): its reason is the error."""
        lib = self._lib
        with capture_errors() as said:
            pointer = lib.llama_adapter_lora_init(self._model, str(path).encode())
        if not pointer:
            cause = "; ".join(line.strip() for line in said if line.strip())
            said_why = f": {cause}" if cause else ""
            raise BackendError(f"llama.cpp could not load the LoRA adapter {path} for this model{said_why}")
        # an activated LoRA (aLoRA): its invocation tokens (docs/lora.md, "Activated LoRA")
        n = lib.llama_adapter_get_alora_n_invocation_tokens(pointer)
        invocation = tuple(lib.llama_adapter_get_alora_invocation_tokens(pointer)[:n]) if n else ()
        alpha_text = ctypes.create_string_buffer(64)
        found = lib.llama_adapter_meta_val_str(pointer, b"adapter.lora.alpha", alpha_text, 64)
        alpha = float(alpha_text.value or 0) if found >= 0 else 0.0
        return LoraAdapter(name, path, float(scale), pointer, alpha, digest, size, hot, invocation)

    def add(self, adapter: LoraAdapter) -> None:
        """List ``adapter`` under its name (last in the ``id`` order)."""
        if adapter.name in self._by_name:
            raise BackendError(f"an adapter named {adapter.name!r} is already loaded")
        with self._lock:
            self._by_key.setdefault(adapter.key, adapter)
            self._users.setdefault(adapter.key, 0)
        self._by_name[adapter.name] = adapter

    def remove(self, name: str) -> LoraAdapter | None:
        """Take ``name`` off the list: requests can no longer name it. Its file, if no
        sequence uses it: to be freed (:meth:`free`); else freed by the last
        :meth:`release`."""
        adapter = self._by_name.pop(name)
        with self._lock:
            if self._users.get(adapter.key, 0):
                return None
            self._users.pop(adapter.key, None)
            return self._by_key.pop(adapter.key)

    def set_scale(self, name: str, scale: float) -> None:
        """``name``'s default scale (llama-server's ``POST /lora-adapters``)."""
        self._by_name[name] = dataclasses.replace(self._by_name[name], scale=float(scale))

    # ------------------------------------------------------------------ requests

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

    def invocation(self, name: str) -> tuple[int, ...]:
        """The invocation tokens of the listed adapter ``name`` (empty: a plain LoRA)."""
        adapter = self._by_name.get(name)
        return adapter.invocation if adapter is not None else ()

    def key_invocation(self, key: str) -> tuple[int, ...]:
        """The invocation tokens of the loaded file ``key`` (empty: a plain LoRA)."""
        with self._lock:
            adapter = self._by_key.get(key)
        return adapter.invocation if adapter is not None else ()

    def listed_keys(self, keyed: AdapterSet) -> bool:
        """Whether each key of ``keyed`` is a listed adapter's file (an idle recompute
        of a conversation whose adapter was unloaded is not made)."""
        listed = {a.key for a in list(self._by_name.values())}
        return all(key in listed for key, _ in keyed)

    def acquire(self, named: AdapterSet) -> AdapterSet:
        """A submitted sequence's set: each name bound to the file loaded under it now
        (its key), held until :meth:`release`. An adapter unloaded since the request
        was prepared: 400 naming it."""
        keyed = []
        for name, scale in named:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise InvalidRequestError(f"the LoRA adapter {name!r} was unloaded", param="lora")
            keyed.append((adapter.key, scale))
        with self._lock:
            for key, _ in keyed:
                self._users[key] += 1
        return tuple(sorted(keyed))

    def release(self, keyed: AdapterSet) -> list[LoraAdapter]:
        """A sequence is done with ``keyed``: the files no longer listed that no
        sequence uses now, to be freed (:meth:`free`)."""
        doomed = []
        with self._lock:
            for key, _ in keyed:
                self._users[key] -= 1
                adapter = self._by_key[key]
                listed = self._by_name.get(adapter.name)
                if not self._users[key] and (listed is None or listed.key != key):
                    del self._users[key], self._by_key[key]
                    doomed.append(adapter)
        return doomed

    def free(self, doomed: Sequence[LoraAdapter], turn: Callable[[], AbstractContextManager[None]]) -> None:
        """Free files no sequence uses (blocking), holding the cores' turn: no call runs
        with them, and a context that had them set forgets them first."""
        if not doomed:
            return
        keys = {a.key for a in doomed}
        with turn():
            for address, applied in list(self._applied.items()):
                if any(key in keys for key, _ in applied):
                    self._lib.llama_set_adapters_lora(ctypes.c_void_p(address), None, 0, None)
                    self._applied[address] = ()
            for adapter in doomed:
                self._lib.llama_adapter_lora_free(adapter.pointer)

    def apply(self, ctx: Any, adapters: AdapterSet) -> None:
        """Set ``adapters`` (keys) on ``ctx`` for its next call (nothing when they are
        set). The scheduler thread, holding the cores' turn."""
        key = ctypes.cast(ctx, ctypes.c_void_p).value or 0
        if self._applied.get(key, ()) == adapters:
            return
        n = len(adapters)
        pointers = (self._lib.llama_adapter_lora_p_ctypes * max(n, 1))()
        scales = (ctypes.c_float * max(n, 1))()
        with self._lock:
            for i, (name, scale) in enumerate(adapters):
                pointers[i] = self._by_key[name].pointer
                scales[i] = scale
        self._lib.llama_set_adapters_lora(ctx, pointers, n, scales)
        self._applied[key] = adapters
