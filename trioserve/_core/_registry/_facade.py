"""The face of the registry: :class:`ModelRegistry`, its lifecycle (``async with``)
and its snapshot. The work is done by the parts it is built from, one module each and
each a layer above the next (the import-linter contract ``registry-layers``): the
names (``_catalog``) on leasing (``_leasing``) on room (``_room``) on loading (``_loading``) on draining
(``_draining``) on the shared state and the change event (``_base``)."""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Self

import trio

from .._backend import Backend
from .._engine import Engine
from ._catalog import _Catalog
from ._snapshot import ModelSnapshot, RegistrySnapshot
from ._spec import BackendSource, ModelSpec

logger = logging.getLogger("trioserve.models")


class ModelRegistry(_Catalog):
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
        pause_ram: bytes the saved states of paused requests (preemption) may hold at
            once, all models together; a pause beyond it is not asked (``None``: no
            bound).
        max_concurrent_loads: loads that may run at once (of different models); the
            others wait, in arrival order. With 1 (the default) each load's measured
            memory growth is its own.
    """

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

    # -------------------------------------------------------------- snapshot

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
                load_in_flight=entry._load is not None,
                load_aborted=entry._load is not None and entry._load.scope.cancel_called,
                idle_deadline=entry._idle_deadline,
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
