"""What the registry's unit tests share: a scripted loader whose load a test holds at a
gate, a registry built of such loaders, a client that holds a lease in a task of its
own, and a wait for what the registry's snapshot shows (never a sleep)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
import trio.testing

from trioserve import Backend, BackendSource, ModelRegistry, ModelSpec, ScriptedBackend
from trioserve._core._exceptions import TrioserveError

#: how long any phase may take to come (fake time under autojump_clock: far beyond the
#: tests' own timers)
LIMIT = 1000.0


class Loader:
    """Loads a scripted backend once its gate is open; logs each load's start and end in
    ``log`` (shared between models), so tests see which loads overlapped."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log
        #: ``None``: open; else the load waits until it is set
        self.gate: trio.Event | None = None
        #: a load raises this
        self.failure: str | None = None
        #: set once a load has begun (reset by the test with a new event)
        self.started = trio.Event()
        #: each backend loaded, with how many leases its model held when it was closed
        self.closed_with_leases: list[int] = []
        self.registry: ModelRegistry | None = None

    async def __call__(self) -> Backend:
        self.log.append(("start", self.name))
        self.started.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.failure is not None:
                raise RuntimeError(self.failure)
            return _RecordingBackend(self)
        finally:
            self.log.append(("end", self.name))


class _RecordingBackend(ScriptedBackend):
    def __init__(self, loader: Loader) -> None:
        super().__init__([b"ok"], model_id=loader.name)
        self.loader = loader

    async def aclose(self) -> None:
        registry = self.loader.registry
        assert registry is not None
        self.loader.closed_with_leases.append(registry.snapshot().model(self.loader.name).leases)


def make_registry(
    *names: str, pinned: tuple[str, ...] = (), preload: tuple[str, ...] = (), **settings: Any
) -> tuple[ModelRegistry, dict[str, Loader], list[tuple[str, str]]]:
    log: list[tuple[str, str]] = []
    loaders = {name: Loader(name, log) for name in names}
    specs = [
        ModelSpec(
            name=name,
            source=BackendSource(loaders[name], description=f"{name}.gguf"),
            pinned=name in pinned,
            preload=name in preload,
        )
        for name in names
    ]
    registry = ModelRegistry(specs, **settings)
    for loader in loaders.values():
        loader.registry = registry
    return registry, loaders, log


async def until(registry: ModelRegistry, predicate: Callable[[Any], bool]) -> None:
    """Wait until ``predicate(registry.snapshot())`` holds: re-checked at each change."""
    with trio.fail_after(LIMIT):
        while not predicate(registry.snapshot()):
            await registry.changed()


class Client:
    """A request in a task of its own: takes a lease on ``name`` (waiting as a request
    does), holds it until :meth:`leave` or a cancel; what it got is recorded."""

    def __init__(self, nursery: trio.Nursery, registry: ModelRegistry, name: str, **lease: Any) -> None:
        self.scope = trio.CancelScope()
        self.leased = trio.Event()
        self.finished = trio.Event()
        self.error: TrioserveError | None = None
        self._leave = trio.Event()
        nursery.start_soon(self._run, registry, name, lease)

    async def _run(self, registry: ModelRegistry, name: str, lease: dict[str, Any]) -> None:
        try:
            with self.scope:
                async with registry.lease(name, **lease):
                    self.leased.set()
                    await self._leave.wait()
        except TrioserveError as exc:
            self.error = exc
        finally:
            self.finished.set()

    def leave(self) -> None:
        self._leave.set()

    def cancel(self) -> None:
        self.scope.cancel()

    async def done(self) -> None:
        with trio.fail_after(LIMIT):
            await self.finished.wait()

    async def has_lease(self) -> None:
        with trio.fail_after(LIMIT):
            await self.leased.wait()


def state(snapshot: Any, name: str) -> str:
    return str(snapshot.model(name).state)
