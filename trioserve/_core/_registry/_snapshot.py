"""What a snapshot of the registry says: frozen copies of its state at one moment,
for tests, ``/health`` and metrics (pure data: no Trio)."""

from __future__ import annotations

from dataclasses import dataclass

from ._state import ModelState

__all__ = ["ModelSnapshot", "RegistrySnapshot"]


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
        load_in_flight: a load of it is under way (waiting for a slot or running).
        load_aborted: that load has been told to stop (its last waiter left, an
            unload, the registry closing): it ends soon.
        idle_deadline: when its idle timer unloads it (``trio.current_time()``;
            ``None``: no timer is set).
    """

    name: str
    state: ModelState
    draining: bool
    leases: int
    load_waiters: int
    load_queued: bool
    idle_timer: bool
    evicting: bool
    load_in_flight: bool = False
    load_aborted: bool = False
    idle_deadline: float | None = None


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
