"""Many models on one server: :class:`ModelRegistry` (docs/models.md).

Each known model is a :class:`ModelEntry`; its states and every transition between them
are one table in ``docs/models.md`` ("States and transitions"), and each edge has a test
in ``tests/test_registry.py``. A request holds a :class:`Lease` on its model from before
its prompt is prepared to after its last byte; a model with a lease is never evicted
nor freed. The first request for an unloaded model starts its load, a task in the
registry's own nursery shared by every request that waits for it; each waits inside its
own scope, and when the last waiter has gone the load is cancelled (the source aborts
it: for llama.cpp, its progress callback returns false). Loads run one at a time (by
default) in arrival order, so each load's measured footprint is its own. Room
(``max_loaded`` models and a memory budget) is taken in arrival order; the least
recently used idle model is evicted to make it; if none is idle, the claim waits for a
lease to end — never a cut stream. An explicit unload gives running streams a grace
period, then ends each with cause ``unload``.

Every operation here runs on the Trio thread; the state changes between checkpoints
only, so no lock is needed. Every waiter waits on the registry's one change event
(``_changed``, renewed by each change) and checks its condition again after each
wake-up: no waiter depends on one particular transition happening, so none can miss
the one that concerns it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Protocol, Self

import trio

from ._backend import Backend
from ._engine import Engine
from ._exceptions import InvalidRequestError, NotFoundError, OverloadedError, ServiceUnavailableError

__all__ = [
    "BackendSource",
    "Lease",
    "ModelEntry",
    "ModelRegistry",
    "ModelSnapshot",
    "ModelSource",
    "ModelSpec",
    "ModelState",
    "RegistrySnapshot",
]

logger = logging.getLogger("trioserve.models")

ModelState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]


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

    def footprint(self) -> int:
        """Bytes it counts against the memory budget: the larger of what its load was
        measured to add (RSS) and its source's estimate (the weights' files)."""
        estimate = self.spec.source.footprint()
        return estimate if self.measured_bytes is None else max(self.measured_bytes, estimate)

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


@dataclass(frozen=True, kw_only=True)
class ModelSnapshot:
    """One model's state at one moment (:meth:`ModelRegistry.snapshot`).

    Attributes:
        name: its name.
        state: ``unloaded``, ``loading``, ``loaded``, ``unloading`` or ``failed``.
        draining: chosen to make room (or being unloaded): takes no new lease.
        leases: leases held.
        load_waiters: requests waiting for its load in progress.
        load_queued: its load waits for a load slot (``max_concurrent_loads``).
        idle_timer: its idle timer (keep-alive) is running.
        evicting: its eviction (drained, last lease ended) is under way.
    """

    name: str
    state: ModelState
    draining: bool
    leases: int
    load_waiters: int
    load_queued: bool
    idle_timer: bool
    evicting: bool


@dataclass(frozen=True, kw_only=True)
class RegistrySnapshot:
    """The registry at one moment, for tests, ``/health`` and metrics.

    Attributes:
        models: each model's snapshot, in the registry's order.
        claims: requests waiting for room (the arrival-order queue).
        waiting_for_model: requests waiting for a draining or unloading model.
        loads_running: loads that hold a load slot.
        loads_queued: loads waiting for a load slot.
        tasks: the registry's own tasks still running (loads, idle timers, evictions):
            bounded by the models, whatever the history.
    """

    models: tuple[ModelSnapshot, ...]
    claims: int
    waiting_for_model: int
    loads_running: int
    loads_queued: int
    tasks: int

    def model(self, name: str) -> ModelSnapshot:
        """The snapshot of model ``name``."""
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)


class Lease:
    """A request's hold on a loaded model: its ``engine`` stays loaded until the lease
    is released. ``load_wait`` is how long the request waited for the model (seconds)."""

    def __init__(self, registry: ModelRegistry, entry: ModelEntry, load_wait: float) -> None:
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


class ModelRegistry:
    """The models a server knows, loaded on demand within a budget.

    Use it as an async context manager (it owns the nursery its loads and idle timers
    run in); leaving it aborts loads in flight and unloads every model::

        async with ModelRegistry([spec_a, spec_b], max_loaded=1) as registry:
            async with registry.lease("a") as lease:
                async with lease.engine.stream(request) as events:
                    ...

    Args:
        specs: the models (the first is the default for requests that name none).
        max_loaded: at most this many models loaded (or loading) at once (``None``: no
            bound).
        memory_budget: bytes the loaded models may take together (``None``: no bound).
        keep_alive: seconds an idle model stays loaded (``math.inf``: until evicted).
        unload_grace: seconds an explicit unload gives running streams.
        max_queue: requests that may wait for room at once (more get 429), and each
            model's engine's admission queue.
        max_concurrent_loads: loads that may run at once (of different models); the
            others wait, in arrival order. With 1 (the default) each load's measured
            memory growth is its own.
    """

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        *,
        max_loaded: int | None = None,
        memory_budget: int | None = None,
        keep_alive: float = math.inf,
        unload_grace: float = 10.0,
        max_queue: int = 16,
        max_concurrent_loads: int = 1,
        close_backends: bool = True,
    ) -> None:
        if not specs:
            raise ValueError("a registry needs at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive bytes, got {memory_budget}")
        if not unload_grace >= 0:
            raise ValueError(f"unload_grace must be 0 or more seconds, got {unload_grace}")
        if max_concurrent_loads < 1:
            raise ValueError(f"max_concurrent_loads must be at least 1, got {max_concurrent_loads}")
        self.entries: list[ModelEntry] = []
        self._by_name: dict[str, ModelEntry] = {}
        for spec in specs:
            entry = ModelEntry(spec)
            for name in entry.names:
                if not name:
                    continue
                if name in self._by_name:
                    raise ValueError(f"two models are named {name!r}")
                self._by_name[name] = entry
            self.entries.append(entry)
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.keep_alive = keep_alive
        self.unload_grace = unload_grace
        self.max_queue = max_queue
        self.max_concurrent_loads = max_concurrent_loads
        self._close_backends = close_backends
        self._queue: deque[_Ticket] = deque()
        self._loads_queued: deque[_Load] = deque()
        self._loads_running: set[_Load] = set()
        self._waiting_for_model = 0
        self._tasks = 0
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        #: listeners told when a model is loaded or unloaded (metrics, logs)
        self.on_loaded: list[Callable[[ModelEntry], None]] = []
        self.on_unloaded: list[Callable[[ModelEntry, Engine], None]] = []

    @classmethod
    def of_engine(cls, engine: Engine, *, aliases: tuple[str, ...] = ()) -> ModelRegistry:
        """A registry of one model already loaded (pinned): for an engine built by hand.
        It needs no ``async with`` (nothing loads or unloads by itself)."""

        async def loaded() -> Backend:  # pragma: no cover - never called: already loaded
            return engine.backend

        spec = ModelSpec(
            name=engine.backend.info.id, source=BackendSource(loaded), aliases=aliases, pinned=True
        )
        registry = cls([spec])
        entry = registry.entries[0]
        entry.engine, entry.state, entry.loads = engine, "loaded", 1
        entry.loaded_at = int(time.time())
        return registry

    # ------------------------------------------------------------ lifecycle

    @property
    def running(self) -> bool:
        """Whether it has been entered (``async with``) and not left."""
        return self._nursery is not None

    async def __aenter__(self) -> Self:
        if self._nursery is not None:
            raise RuntimeError("this registry is already running (entered once: by you or by its Server)")
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        for entry in self.entries:
            if entry.spec.preload:
                if not self._fits(entry):
                    logger.warning(
                        "model %s: not loaded at startup: it does not fit beside the models loaded "
                        "before it (--models-max / --models-memory); it loads on demand",
                        entry.name,
                    )
                    continue
                self._start_load(entry)
                assert entry._load is not None
                entry._load.keep = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        try:
            await self.aclose()
        finally:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            result = await self._nursery_manager.__aexit__(exc_type, exc, tb)
            self._nursery = None
        return result

    async def aclose(self) -> None:
        """Refuse new leases, abort every load, end every stream, tell every other lease
        holder to stop (its ``on_unload``: :meth:`lease`'s block is cancelled), wait
        until every lease is released, then free every model. Idempotent.

        A model is never freed while a lease is held (a ``/tokenize`` thread, say): the
        wait is as long as the holders take to release theirs — bounded when each is
        cancelled by its ``on_unload``; a lease taken with :meth:`acquire` and no
        ``on_unload`` must be released by its holder.

        Cancellation: the aborts and the streams' ends are shielded. The wait for lease
        holders is not: a cancel (a second signal) cuts it short, and a model still
        leased then is left allocated (logged), never freed under its holder; the
        others are freed (shielded)."""
        self._closing = True
        self._notify()
        with trio.CancelScope(shield=True):
            for entry in self.entries:
                if entry._load is not None:
                    entry._load.scope.cancel()
            # streams end (``engine_closed``) and their inference returns; the backends
            # stay open until every lease is released
            for entry in self.entries:
                if entry.engine is not None:
                    await entry.engine.aclose(close_backend=False)
        try:
            told: set[Lease] = set()
            while True:
                for entry in self.entries:
                    for lease in entry._holders - told:
                        told.add(lease)
                        if lease.on_unload is not None:
                            lease.on_unload()
                busy = [
                    entry
                    for entry in self.entries
                    if entry.leases > 0 or entry._load is not None or entry.state == "unloading"
                ]
                if not busy:
                    break
                logger.info(
                    "closing: waiting for %s",
                    ", ".join(f"{entry.name} ({entry.state}, {entry.leases} lease(s))" for entry in busy),
                )
                await self._wait_for_change()
        finally:
            with trio.CancelScope(shield=True):
                for entry in self.entries:
                    if entry.engine is None or entry.state == "unloading":
                        continue
                    if entry.leases > 0:
                        logger.error(
                            "model %s: left allocated at close: %d lease(s) still held",
                            entry.name,
                            entry.leases,
                        )
                        continue
                    await self._close(entry)

    # --------------------------------------------------------------- lookup

    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    def names(self) -> list[str]:
        return [name for entry in self.entries for name in entry.names if name]

    def resolve(self, name: str | None) -> ModelEntry:
        """The entry for ``name`` (``None``: the default); :class:`NotFoundError` names
        the models there are."""
        if name is None:
            return self.default
        entry = self._by_name.get(name)
        if entry is None:
            unnamed = [e for e in self.entries if not e.spec.name]
            if unnamed:  # its name is known once it has loaded
                if unnamed[0].state == "failed":
                    raise ServiceUnavailableError(f"the model failed to load: {unnamed[0].error}")
                raise ServiceUnavailableError(
                    "the model is still loading; retry shortly", retry_after=1, code="loading"
                )
            raise NotFoundError(
                f"the model {name!r} does not exist on this server; available: {', '.join(self.names())}",
                param="model",
                code="model_not_found",
            )
        return entry

    def loaded(self) -> list[ModelEntry]:
        return [entry for entry in self.entries if entry.state == "loaded"]

    def snapshot(self) -> RegistrySnapshot:
        """The registry's state now (a copy: it does not change afterwards)."""
        models = tuple(
            ModelSnapshot(
                name=entry.name,
                state=entry.state,
                draining=entry.draining,
                leases=entry.leases,
                load_waiters=entry._load.waiters if entry._load is not None else 0,
                load_queued=entry._load is not None and not entry._load.may_start.is_set(),
                idle_timer=entry._timer_running,
                evicting=entry._evicting,
            )
            for entry in self.entries
        )
        return RegistrySnapshot(
            models=models,
            claims=len(self._queue),
            waiting_for_model=self._waiting_for_model,
            loads_running=len(self._loads_running),
            loads_queued=len(self._loads_queued),
            tasks=self._tasks,
        )

    # ---------------------------------------------------------------- leases

    @asynccontextmanager
    async def lease(
        self,
        name: str | ModelEntry | None = None,
        *,
        keep_alive: float | None = None,
        on_unload: Callable[[], None] | None = None,
    ) -> AsyncIterator[Lease]:
        """Hold model ``name`` loaded for the body of the block (loading it first, and
        making room for it, if need be).

        ``keep_alive`` overrides how long it stays loaded after this request (Ollama's
        ``keep_alive``: 0 unloads it as soon as it is idle). ``on_unload`` is what an
        unload whose grace has run out, or the registry closing, calls (default: cancel
        the body, which then raises :class:`ServiceUnavailableError`, code
        ``model_unloaded``, or ``shutting_down`` when the registry closes).

        Raises:
            NotFoundError: no model of that name.
            OverloadedError: too many requests already wait for room.
            ServiceUnavailableError: the load failed (the message names the file and
                the cause), the registry is closing, or the model can never fit.

        Cancellation: a cancel while waiting leaves only this request's place; a load
        nobody waits for any more is aborted. The lease is released when the block is
        left, however it is left (after a worker thread the body waits for has returned).
        """
        lease = await self.acquire(name, keep_alive=keep_alive)
        scope = trio.CancelScope()
        lease.on_unload = on_unload or scope.cancel
        try:
            with scope:
                yield lease
        finally:
            lease.release()
        if scope.cancelled_caught:
            if self._closing:
                raise ServiceUnavailableError(
                    "the server is shutting down; retry on another instance", code="shutting_down"
                )
            raise ServiceUnavailableError(
                f"the model {lease.entry.name!r} was unloaded while this request ran", code="model_unloaded"
            )

    async def acquire(
        self, name: str | ModelEntry | None = None, *, keep_alive: float | None = None
    ) -> Lease:
        """:meth:`lease` without the block: the caller must :meth:`Lease.release` it
        (and should set its ``on_unload``: the registry's :meth:`aclose` waits for it)."""
        entry = name if isinstance(name, ModelEntry) else self.resolve(name)
        started = time.monotonic()
        ticket = _Ticket(entry)
        try:
            while True:
                if self._closing:
                    raise ServiceUnavailableError(
                        "the server is shutting down; retry on another instance", code="shutting_down"
                    )
                if ticket.granted:
                    break
                if entry.state == "loaded" and not entry.draining:
                    entry.leases += 1
                    ticket.granted = True
                    break
                if entry.state == "loading":
                    if entry.spec.ready_gate and entry.loads == 0:
                        raise ServiceUnavailableError(
                            "the model is still loading; retry shortly", retry_after=1, code="loading"
                        )
                    await self._wait_for_load(entry, ticket)
                    continue
                if entry.state == "unloading" or entry.draining:
                    # on its way out — or not: it stays if every claim that wanted its
                    # room leaves. Any change may be the one: look again after each.
                    self._waiting_for_model += 1
                    self._notify()
                    try:
                        await self._wait_for_change()
                    finally:
                        self._waiting_for_model -= 1
                        self._notify()
                    continue
                if entry.state == "failed" and entry.spec.ready_gate and entry.loads == 1:
                    raise ServiceUnavailableError(f"the model failed to load: {entry.error}")
                # unloaded or failed (a later request retries): take room, in order
                await self._claim_room(ticket)
                if entry.state in ("unloaded", "failed"):
                    self._start_load(entry)
        except BaseException:
            if ticket.granted:
                self._release_entry(entry)
            raise
        entry._idle_deadline = None  # in use: its idle timer (if any) stops
        lease = Lease(self, entry, time.monotonic() - started)
        lease.keep_alive = keep_alive
        entry._holders.add(lease)
        return lease

    async def _wait_for_load(self, entry: ModelEntry, ticket: _Ticket) -> None:
        load = entry._load
        assert load is not None
        load.waiters += 1
        self._notify()
        try:
            await load.done.wait()
        finally:
            self._notify()
            if load.succeeded:
                ticket.granted = True  # the load counted this waiter's lease already
            else:
                load.waiters -= 1
                if load.waiters == 0 and not load.done.is_set() and not load.keep:
                    logger.info("model %s: every request waiting for its load has gone: abort", entry.name)
                    load.scope.cancel()
        if entry.state == "failed" and not ticket.granted:
            raise ServiceUnavailableError(f"the model {entry.name!r} failed to load: {entry.error}")

    def _release(self, lease: Lease) -> None:
        lease.entry._holders.discard(lease)
        self._release_entry(lease.entry, lease.keep_alive)

    def _release_entry(self, entry: ModelEntry, keep_alive: float | None = None) -> None:
        entry.leases -= 1
        entry.last_used = time.monotonic()
        if entry.leases == 0 and entry.state == "loaded" and not self._closing:
            if entry.draining:
                # chosen to make room, and now idle: it goes (one eviction per model)
                if not entry._evicting:
                    entry._evicting = True
                    self._spawn(self._evict, entry)
            elif not entry.spec.pinned:
                # the last request's X-Keep-Alive, else the model's, else the server's
                keep = keep_alive if keep_alive is not None else entry.spec.keep_alive
                if keep is None:
                    keep = self.keep_alive
                if math.isfinite(keep):
                    entry._idle_deadline = trio.current_time() + max(0.0, keep)
                    if not entry._timer_running:  # one timer per model, its deadline moved
                        entry._timer_running = True
                        self._spawn(self._idle_timer, entry)
        self._notify()

    # ------------------------------------------------------------------ room

    def _used(self, *, excluding: ModelEntry | None = None) -> tuple[int, int]:
        count = memory = 0
        for entry in self.entries:
            if entry is not excluding and entry.state in ("loading", "loaded", "unloading"):
                count += 1
                memory += entry.footprint()
        return count, memory

    def _fits(self, entry: ModelEntry) -> bool:
        count, memory = self._used(excluding=entry)
        if self.max_loaded is not None and count >= self.max_loaded:
            return False
        return self.memory_budget is None or memory + entry.footprint() <= self.memory_budget

    def _could_ever_fit(self, entry: ModelEntry) -> bool:
        pinned = [
            e for e in self.entries if e.spec.pinned and e is not entry and e.state in ("loading", "loaded")
        ]
        if self.max_loaded is not None and len(pinned) >= self.max_loaded:
            return False
        if self.memory_budget is None:
            return True
        return sum(e.footprint() for e in pinned) + entry.footprint() <= self.memory_budget

    async def _claim_room(self, ticket: _Ticket) -> None:
        """Wait, in arrival order, until ``ticket``'s model fits; evict idle models (least
        recently used first) to make room; mark busy ones to drain if none is idle.
        Returns when the model fits, or when its state is no longer unloaded or failed
        (another request started its load): the caller looks again."""
        entry = ticket.entry
        if not self._could_ever_fit(entry):
            raise ServiceUnavailableError(
                f"the model {entry.name!r} cannot fit beside the pinned models "
                f"(--models-max {self.max_loaded}, memory budget {self.memory_budget} bytes)",
                code="model_does_not_fit",
            )
        if len(self._queue) >= self.max_queue:
            raise OverloadedError(
                f"{len(self._queue)} requests already wait for a model to load; retry shortly",
                retry_after=max(1.0, entry.load_seconds or 1.0),
            )
        self._queue.append(ticket)
        self._notify()
        try:
            while True:
                if self._closing:
                    raise ServiceUnavailableError(
                        "the server is shutting down; retry on another instance", code="shutting_down"
                    )
                if entry.state not in ("unloaded", "failed"):
                    return  # another request started its load meanwhile
                if self._queue[0] is ticket:
                    if self._fits(entry):
                        return
                    victim = self._victim(entry)
                    if victim is not None:
                        victim.draining = True
                        if victim.leases == 0:
                            await self._unload(victim, grace=0.0, why="evicted (least recently used)")
                            continue
                        logger.info(
                            "model %s: waiting for %d request(s) on %s to finish before it is evicted",
                            entry.name,
                            victim.leases,
                            victim.name,
                        )
                        self._notify()  # (requests for the victim now wait)
                await self._wait_for_change()
        finally:
            self._queue.remove(ticket)
            if not self._queue:
                # nobody waits for room any more: a model marked to go (and not yet
                # unloading) stays, and the requests waiting for it get their leases
                for e in self.entries:
                    if e.draining and e.state == "loaded":
                        e.draining = False
            self._notify()

    def _victim(self, entry: ModelEntry) -> ModelEntry | None:
        """The model to evict for ``entry``: one already draining, else the least
        recently used loaded model that is not pinned (idle ones first)."""
        if any(e.draining and e.state in ("loaded", "unloading") for e in self.entries):
            return None  # one is on its way out: wait for it
        candidates = [e for e in self.entries if e is not entry and e.state == "loaded" and not e.spec.pinned]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (e.leases > 0, e.last_used))

    async def _evict(self, victim: ModelEntry) -> None:
        """A draining model's last lease has ended: unload it — unless it stopped
        draining meanwhile (every claim that wanted its room left)."""
        try:
            if victim.state == "loaded" and victim.draining and victim.leases == 0 and not self._closing:
                await self._unload(victim, grace=0.0, why="evicted (least recently used)")
        finally:
            victim._evicting = False

    async def changed(self) -> None:
        """Wait until something :meth:`snapshot` shows changes: a model's state, a
        lease, a waiter, the room queue, a load slot, a task of the registry's."""
        await self._wait_for_change()

    async def _wait_for_change(self) -> None:
        changed = self._changed
        await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _spawn(self, fn: Callable[[ModelEntry], Awaitable[None]], entry: ModelEntry) -> None:
        """Run ``fn(entry)`` in the registry's nursery, counted in :meth:`snapshot`'s
        ``tasks``."""
        if self._nursery is None:
            raise RuntimeError("use the registry inside 'async with registry:'")

        async def counted() -> None:
            try:
                await fn(entry)
            finally:
                self._tasks -= 1
                self._notify()

        self._tasks += 1
        self._nursery.start_soon(counted)

    # ----------------------------------------------------------------- loads

    def _start_load(self, entry: ModelEntry) -> None:
        entry.state = "loading"
        entry.progress = 0.0
        entry.error = None
        load = entry._load = _Load()
        self._loads_queued.append(load)
        self._admit_loads()
        self._spawn(self._run_load, entry)
        self._notify()

    def _admit_loads(self) -> None:
        """Give load slots to the loads that wait for one, in arrival order."""
        while self._loads_queued and len(self._loads_running) < self.max_concurrent_loads:
            load = self._loads_queued.popleft()
            if self._loads_running:  # (only with max_concurrent_loads > 1)
                load.overlapped = True
                for running in self._loads_running:
                    running.overlapped = True
            self._loads_running.add(load)
            load.may_start.set()

    def _end_load(self, load: _Load) -> None:
        """``load`` is over (or never started): its slot goes to the next."""
        if load in self._loads_running:
            self._loads_running.discard(load)
        else:
            self._loads_queued.remove(load)
        self._admit_loads()

    async def _run_load(self, entry: ModelEntry) -> None:
        load = entry._load
        assert load is not None

        def progress(value: float) -> None:
            entry.progress = value  # (a float store, from the loading thread)

        backend: Backend | None = None
        before = after = None
        try:
            with load.scope:
                await load.may_start.wait()  # a load slot, in arrival order
                load.started = time.monotonic()
                before = _rss_bytes()
                if entry.spec.source.description:
                    logger.info(
                        "model %s: loading %s", entry.name or "(default)", entry.spec.source.description
                    )
                backend = await entry.spec.source.load(progress)
                after = _rss_bytes()
        except Exception as exc:
            described = entry.spec.source.description
            entry.error = str(exc) if not described or described in str(exc) else f"{described}: {exc}"
            logger.error("model %s: the load failed: %s", entry.name, entry.error)
        finally:
            self._end_load(load)
        entry.loads += 1
        entry._load = None
        seconds = time.monotonic() - load.started
        if backend is None:
            if load.scope.cancelled_caught and entry.error is None:
                logger.info("model %s: load aborted after %.2f s (nobody waits for it)", entry.name, seconds)
                entry.state = "unloaded"
            else:
                entry.state = "failed"
                if entry.error is None:
                    entry.error = f"{entry.spec.source.description}: the load was cancelled"
            load.done.set()
            self._notify()
            return
        if before is not None and after is not None and after > before and not load.overlapped:
            entry.measured_bytes = max(after - before, 1)
        if not entry.spec.name:
            entry.spec.name = backend.info.id
            self._by_name.setdefault(entry.spec.name, entry)
        entry.engine = Engine(backend, max_queue=self.max_queue)
        entry.state = "loaded"
        entry.draining = False
        entry.loaded_at = int(time.time())
        entry.load_seconds = seconds
        entry.last_used = time.monotonic()
        # the waiters hold their leases from now: nothing can evict it before they run
        entry.leases += load.waiters
        load.succeeded = True
        logger.info("model %s: loaded in %.2f s (%d request(s) waiting)", entry.name, seconds, load.waiters)
        for listener in self.on_loaded:
            listener(entry)
        load.done.set()
        self._notify()
        if load.waiters == 0 and entry.leases == 0:
            self._release_idle(entry)

    def _release_idle(self, entry: ModelEntry) -> None:
        """A model loaded with nobody waiting (preload, ``POST /models/load``): its idle
        timer starts now."""
        entry.leases += 1
        self._release_entry(entry)

    async def load(self, name: str) -> ModelEntry:
        """Load ``name`` if it is not (``POST /models/load``), making room for it, and
        wait for the load. Cancellation: as a request waiting for it."""
        lease = await self.acquire(name)
        lease.release()
        return lease.entry

    # --------------------------------------------------------------- unloads

    async def unload(self, name: str, *, grace: float | None = None, force: bool = False) -> ModelEntry:
        """Unload ``name`` (``POST /models/unload``): no new leases; running streams get
        ``grace`` seconds (default: ``unload_grace``), then each is ended (its lease's
        ``on_unload``: cause ``unload``); then the model is freed. Requests that arrive
        meanwhile wait, and load it again afterwards.

        Raises:
            InvalidRequestError: (code ``model_pinned``) the model is pinned — the
                single-model server's model among them — and ``force`` is not set.

        Cancellation: the unload is the server's own; it goes on (shielded) once begun."""
        entry = self.resolve(name)
        if grace is not None and not grace >= 0:
            raise ValueError(f"grace must be 0 or more seconds, got {grace}")
        if entry.spec.pinned and not force:
            if entry.spec.ready_gate:
                why = "it is this server's only model, loaded at startup (/health reports on it)"
            else:
                why = "it is pinned (the preset's pinned = true)"
            raise InvalidRequestError(
                f"the model {entry.name!r} cannot be unloaded: {why}; stop the server instead",
                param="model",
                code="model_pinned",
            )
        if entry.state == "loading" and entry._load is not None:
            load = entry._load
            load.scope.cancel()
            await load.done.wait()
            return entry
        if entry.state not in ("loaded", "unloading"):
            return entry
        grace = self.unload_grace if grace is None else grace
        await self._unload(entry, grace=grace, why="unloaded on request")
        return entry

    async def _idle_timer(self, entry: ModelEntry) -> None:
        """Unload ``entry`` at its idle deadline, unless a lease came first (which clears
        the deadline) or a later release moved it."""
        try:
            while True:
                deadline = entry._idle_deadline
                if deadline is None:
                    return
                if trio.current_time() >= deadline:
                    break
                await trio.sleep_until(deadline)
        finally:
            entry._timer_running = False
        entry._idle_deadline = None
        if entry.state == "loaded" and entry.leases == 0 and not entry.draining and not self._closing:
            await self._unload(entry, grace=0.0, why="idle (keep_alive)")

    async def _unload(self, entry: ModelEntry, *, grace: float, why: str) -> None:
        """Unload ``entry`` (or, if another unload has begun, wait for that one)."""
        with trio.CancelScope(shield=True):
            if entry.state != "loaded":
                while entry.state == "unloading":
                    await self._wait_for_change()
                return
            entry.draining = True
            entry.state = "unloading"
            self._notify()
            with trio.move_on_after(grace):
                while entry.leases > 0:
                    await self._wait_for_change()
            if entry.leases:
                logger.info("model %s: ending %d stream(s) (cause unload)", entry.name, entry.leases)
                for lease in list(entry._holders):
                    if lease.on_unload is not None:
                        lease.on_unload()
                # (never freed under a lease: each request's teardown is bounded by
                # its own, cancelled scope)
                while entry.leases > 0:
                    await self._wait_for_change()
            await self._close(entry)
            logger.info("model %s: unloaded (%s)", entry.name, why)

    async def _close(self, entry: ModelEntry) -> None:
        engine, entry.engine = entry.engine, None
        try:
            if engine is not None:
                await engine.aclose(close_backend=self._close_backends)
        except Exception:  # the model is gone either way: never stuck "unloading"
            logger.exception("model %s: closing it failed", entry.name)
        finally:
            entry.state = "unloaded"
            entry.draining = False
            entry._idle_deadline = None
            self._notify()
        if engine is not None:
            for listener in self.on_unloaded:
                try:
                    listener(entry, engine)
                except Exception:
                    logger.exception("an unload listener failed")


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux), for the measured footprint of a load."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return None
