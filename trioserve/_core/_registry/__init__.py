"""Many models on one server: :class:`ModelRegistry` (docs/models.md).

Each known model is a :class:`ModelEntry`; its states and every transition between them
are one table in ``docs/models.md`` ("States and transitions"), and each edge has a test
in ``tests/unit/core/test_registry*.py``. A request holds a :class:`Lease` on its model from before
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

The package, one job per module (siblings import this face, not its modules):

- ``_state``: the states an entry can be in (:data:`ModelState`);
- ``_spec``: what the registry is told (:class:`ModelSpec`, :class:`ModelSource`);
- ``_entry``: one model's entry, its load in flight and the :class:`Lease` on it;
- ``_snapshot``: the frozen snapshots (pure data);
- ``_base``: the shared state, lookup by name, the change event;
- ``_draining``: releases, keep-alive, eviction, unloads, the close;
- ``_loading``: shared, cancellable loads in bounded, arrival-ordered slots;
- ``_room``: the claims for room (``max_loaded``, the memory budget) and the victims;
- ``_leasing``: :meth:`ModelRegistry.lease` and :meth:`ModelRegistry.acquire`;
- ``_catalog``: names added and taken away while it serves (Ollama's create, copy,
  delete);
- ``_facade``: :class:`ModelRegistry`, its lifecycle and its snapshot.
"""

from ._entry import Lease, ModelEntry
from ._facade import ModelRegistry
from ._snapshot import ModelSnapshot, RegistrySnapshot
from ._spec import BackendSource, ModelSource, ModelSpec
from ._state import ModelState

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
