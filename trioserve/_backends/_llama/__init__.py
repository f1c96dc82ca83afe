"""The llama.cpp backend, as a package of small parts (the module map:
``docs/architecture.md``, "The llama engine").

The face: :class:`LlamaBackend` (what the rest of trioserve runs), its
:class:`LlamaSettings`, the loaded model (:class:`LlamaModel`), one context
(:class:`Context`), and the pure parts a test or a probe may use on their own — the
planner (:func:`plan_step`, :func:`split`) and the cells (:class:`Cells`). Siblings
import from here, not from the private modules.
"""

from ._backend import LlamaBackend
from ._capabilities import Capabilities
from ._cells import Cells
from ._context import Context
from ._model import LlamaModel
from ._native import LoadAborted, make_abort_callback
from ._planner import Candidate, Limits, StepPlan, next_cut, plan_step, split
from ._settings import LlamaSettings
from ._stats import Snapshot
from ._tiers import StateTier

__all__ = [
    "Candidate",
    "Capabilities",
    "Cells",
    "Context",
    "Limits",
    "LlamaBackend",
    "LlamaModel",
    "LlamaSettings",
    "LoadAborted",
    "Snapshot",
    "StateTier",
    "StepPlan",
    "make_abort_callback",
    "next_cut",
    "plan_step",
    "split",
]
