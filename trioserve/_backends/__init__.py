"""Backends: what makes tokens. The engine sees only :class:`Backend`."""

from ._base import Backend, GenerationProgress, ModelInfo, PreparedPrompt
from ._batched import BatchedLlamaBackend, BatchedLlamaSettings
from ._llama import LlamaBackend, LlamaSettings
from ._scripted import ScriptedBackend
from ._threaded import ThreadedBackend
from ._upstream import UpstreamBackend, UpstreamState

__all__ = [
    "Backend",
    "BatchedLlamaBackend",
    "BatchedLlamaSettings",
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
