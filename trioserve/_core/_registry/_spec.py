"""What the registry is told about a model: its :class:`ModelSpec` and the
:class:`ModelSource` that loads it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from .._backend import Backend

__all__ = ["BackendSource", "ModelSource", "ModelSpec"]


class ModelSource(Protocol):
    """How one model is loaded."""

    #: what a log line or ``/v1/models`` says it is (a file path, say)
    description: str

    def footprint(self) -> int:
        """Bytes the model is expected to take once loaded (for the memory budget; the
        registry uses the measured figure once it has loaded it)."""
        ...

    async def load(self, progress: Callable[[float], None]) -> Backend:
        """Load the model. ``progress`` may be called from any thread with 0…1.

        Cancellation: a cancel must stop the load promptly (llama.cpp's progress
        callback returns false) and free what it allocated before raising."""
        ...


class BackendSource:
    """Any backend from an async loader (the scripted backend, an upstream relay, a
    backend a library user built). Cancellation: as the loader's."""

    def __init__(self, load: Callable[[], Awaitable[Backend]], *, description: str = "a backend") -> None:
        self._load = load
        self.description = description

    def footprint(self) -> int:
        return 0

    async def load(self, progress: Callable[[float], None]) -> Backend:
        backend = await self._load()
        progress(1.0)
        return backend


@dataclass(kw_only=True)
class ModelSpec:
    """A model the registry knows.

    Attributes:
        name: the name clients send in ``model`` (empty: the backend's own id, once
            loaded — for a single model whose name only its file knows).
        source: how to load it.
        aliases: other names for it.
        pinned: never evicted nor unloaded by an idle timer; ``POST /models/unload``
            refuses it (:meth:`ModelRegistry.unload` with ``force``: a library may).
        keep_alive: seconds it stays loaded after its last request (``None``: the
            registry's default; ``math.inf``: forever; 0: unloaded right after).
        preload: loaded when the registry starts (requests for it wait for that load).
        adapters: its LoRA adapters' names (``model`` may name one).
        ready_gate: (with ``preload``) requests that come during that first load are
            refused with 503 ``loading`` instead of waiting, and a failed first load is
            final: the single-model server's readiness signal, as llama-server's.
    """

    name: str
    source: ModelSource
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    keep_alive: float | None = None
    preload: bool = False
    ready_gate: bool = False
    #: the names of its LoRA adapters, known before it loads (a request's ``model`` may
    #: name one: docs/lora.md); a loaded model's own list counts too
    adapters: tuple[str, ...] = ()
