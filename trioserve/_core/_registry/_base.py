"""The registry's state and the few things every part of it uses: the models by name,
the one change event every waiter waits on, and the nursery its own tasks run in.

Every operation runs on the Trio thread; the state changes between checkpoints only,
so no lock is needed. Every waiter waits on the one change event (``_changed``,
renewed by each change) and checks its condition again after each wake-up: no waiter
depends on one particular transition happening, so none can miss the one that
concerns it."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import trio

from .._admission import PauseBudget
from .._engine import Engine
from .._exceptions import NotFoundError, ServiceUnavailableError
from ._entry import ModelEntry, _Load, _Ticket
from ._spec import ModelSpec


class _RegistryBase:
    """The state :class:`~._facade.ModelRegistry`'s parts share (its arguments are
    documented there), lookup by name, and the change event."""

    def __init__(
        self,
        specs: Sequence[ModelSpec],
        *,
        max_loaded: int | None = None,
        memory_budget: int | None = None,
        keep_alive: float = math.inf,
        unload_grace: float = 10.0,
        max_queue: int = 16,
        pause_ram: int | None = None,
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
        #: one budget for every model's paused requests' saved states
        self.pause_budget = PauseBudget(pause_ram) if pause_ram is not None else None
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

    def resolve_adapter(self, name: str | None) -> tuple[ModelEntry, str | None]:
        """The entry ``name`` means and the LoRA adapter it names, if any (docs/lora.md):
        a model's name (no adapter); ``BASE:ADAPTER``; an adapter's own name, when one
        model has it. Anything else: :meth:`resolve`'s answer."""
        if name is None or name in self._by_name:
            return self.resolve(name), None
        base, colon, adapter = name.rpartition(":")
        if colon and base in self._by_name:
            entry = self._by_name[base]
            if adapter in entry.adapter_names():
                return entry, adapter
        having = [entry for entry in self.entries if name in entry.adapter_names()]
        if len(having) == 1:
            return having[0], name
        if len(having) > 1:
            raise NotFoundError(
                f"the LoRA adapter {name!r} belongs to several models: name one, as "
                + " or ".join(repr(f"{entry.name}:{name}") for entry in having),
                param="model",
                code="model_not_found",
            )
        return self.resolve(name), None

    def loaded(self) -> list[ModelEntry]:
        return [entry for entry in self.entries if entry.state == "loaded"]

    # --------------------------------------------------------------- changes

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
