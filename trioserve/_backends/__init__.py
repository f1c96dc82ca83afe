"""Backends: what makes tokens. The engine sees only :class:`~trioserve._core._backend.Backend`.

Imports :mod:`trioserve._core` and :mod:`trioserve._wire`, never :mod:`trioserve._http`.
"""

from .._core._backend import Backend, GenerationProgress, ModelInfo, PreparedPrompt
from ._llama import LlamaBackend, LlamaSettings
from ._scripted import ScriptedBackend
from ._threaded import ThreadedBackend
from ._upstream import UpstreamBackend, UpstreamState

__all__ = [
    "Backend",
    "GenerationProgress",
    "LlamaBackend",
    "LlamaSettings",
    "ModelInfo",
    "PreparedPrompt",
    "ScriptedBackend",
    "ThreadedBackend",
    "UpstreamBackend",
    "UpstreamState",
]
