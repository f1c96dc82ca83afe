"""One known model (:class:`ModelEntry`), the load it may have in flight, a request's
place in line, and the :class:`Lease` a request holds on it.

An entry's state moves only along the edges of the table in ``docs/models.md``
("States and transitions"); the registry's parts make each move (loading, draining,
room), and the entry only holds the state."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import trio

from .._engine import Engine
from ._spec import ModelSpec
from ._state import ModelState

__all__ = ["Lease", "ModelEntry"]


class _Load:
    """One load, shared by every request waiting for it; it waits for a load slot
    (``max_concurrent_loads``) in arrival order before it starts."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        #: set when it has a load slot: the source's load may start
        self.may_start = trio.Event()
        self.done = trio.Event()
        self.waiters = 0
        self.started = time.monotonic()
        #: set when the model has loaded: each waiter still there holds a lease from then
        self.succeeded = False
        #: a load nobody asked for by waiting (a preload): not aborted when waiters leave
        self.keep = False
        #: another load ran beside it at some point: its RSS growth is not its own
        self.overlapped = False


class _Ticket:
    """A request's place: waiting for room (in the registry's queue), for a load, or
    holding a lease."""

    __slots__ = ("entry", "granted")

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.granted = False


@dataclass(eq=False)
class ModelEntry:
    """One known model and its state."""

    spec: ModelSpec
    state: ModelState = "unloaded"
    engine: Engine | None = None
    #: 0…1 while loading
    progress: float = 0.0
    #: why the last load failed (``state == "failed"``)
    error: str | None = None
    #: leases held (requests between lease and their last byte)
    leases: int = 0
    #: when its last lease ended (monotonic), for least-recently-used eviction
    last_used: float = 0.0
    #: when it finished loading (Unix seconds): ``/v1/models``' ``created``
    loaded_at: int = 0
    #: seconds its last load took (from the moment it had a load slot)
    load_seconds: float | None = None
    #: measured bytes (RSS growth over a load that ran alone), else the source's estimate
    measured_bytes: int | None = None
    #: chosen for eviction (or being unloaded): no new leases until it is unloaded, or
    #: until no claim wants its room any more (then it stays)
    draining: bool = False
    loads: int = 0
    #: its last name was taken away (``remove_name``): requests that found it before
    #: get 404, and it is forgotten once unloaded
    removed: bool = False
    _load: _Load | None = None
    _holders: set[Lease] = field(default_factory=set["Lease"])
    #: when its idle timer unloads it (``trio.current_time()``; ``None``: no timer)
    _idle_deadline: float | None = None
    _timer_running: bool = False
    #: its eviction (drained: the last lease ended) is under way: at most one per model
    _evicting: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def names(self) -> tuple[str, ...]:
        return (self.spec.name, *self.spec.aliases)

    def adapter_names(self) -> tuple[str, ...]:
        """Its LoRA adapters' names: the loaded backend's own (those loaded at run time
        included), else the spec's."""
        engine = self.engine
        if engine is None:
            return self.spec.adapters
        return tuple(adapter[0] for adapter in engine.backend.info.adapters)

    def footprint(self) -> int:
        """Bytes it counts against the memory budget: the larger of what its load was
        measured to add (RSS) and its source's estimate (the weights' files), and the
        LoRA adapter files loaded at run time."""
        estimate = self.spec.source.footprint()
        weights = estimate if self.measured_bytes is None else max(self.measured_bytes, estimate)
        engine = self.engine
        return weights + (engine.backend.adapter_bytes if engine is not None else 0)

    def describe(self) -> dict[str, object]:
        """What ``/v1/models`` and ``GET /models`` say about it."""
        body: dict[str, object] = {"state": self.state}
        if self.state == "loading":
            body["progress"] = round(self.progress, 3)
        if self.state == "failed":
            body["error"] = self.error
        body["pinned"] = self.spec.pinned
        body["in_use"] = self.leases
        if self.load_seconds is not None:
            body["load_seconds"] = round(self.load_seconds, 3)
        return body


class _Releases(Protocol):
    """What a lease gives itself back to (the registry)."""

    def _release(self, lease: Lease) -> None: ...


class Lease:
    """A request's hold on a loaded model: its ``engine`` stays loaded until the lease
    is released. ``load_wait`` is how long the request waited for the model (seconds)."""

    def __init__(self, registry: _Releases, entry: ModelEntry, load_wait: float) -> None:
        self._registry = registry
        self.entry = entry
        assert entry.engine is not None
        self.engine: Engine = entry.engine
        self.load_wait = load_wait
        #: called when an unload's grace period ends, or the registry closes, with this
        #: lease still held: it must make the holder release the lease soon (a cancel)
        self.on_unload: Callable[[], None] | None = None
        #: this request's keep-alive (``X-Keep-Alive``): applies if it is the last to release
        self.keep_alive: float | None = None
        self._released = False

    def release(self) -> None:
        """Give the model back (idempotent)."""
        if not self._released:
            self._released = True
            self._registry._release(self)
