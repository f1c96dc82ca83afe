"""trioserve: a streaming LLM inference server and library on Trio.

Each request opens a nursery with a producer (inference in a scheduler or worker
thread, with an abort flag that reaches into llama.cpp) and a consumer, linked by a
small bounded channel (:class:`PieceChannel`); cancelling that one scope — client
disconnect, deadline, shutdown, or your own cancel scope — tears every layer down
deterministically.

The public API is everything listed in ``__all__``; modules starting with ``_`` are
private.
"""

from ._backends import (
    Backend,
    GenerationProgress,
    LlamaBackend,
    LlamaSettings,
    ModelInfo,
    PreparedPrompt,
    ScriptedBackend,
    ThreadedBackend,
    UpstreamBackend,
    UpstreamState,
)
from ._backends._models import default_model_path
from ._core._channel import Aborted, PieceChannel
from ._core._engine import Engine, EventStream, StreamTimings
from ._core._exceptions import (
    AuthenticationError,
    BackendError,
    ContextLengthError,
    DeadlineExceededError,
    HeadersTooLargeError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    TrioserveError,
    UnsupportedMediaTypeError,
)
from ._core._types import EndCause, Finished, GenerationRequest, SamplingParams, TextDelta, Usage
from ._http import HTTPSettings, ServerState, create_app
from ._http._server import Server, ServerSettings, serve_until_signalled

__all__ = [
    "Aborted",
    "AuthenticationError",
    "Backend",
    "BackendError",
    "ContextLengthError",
    "DeadlineExceededError",
    "EndCause",
    "Engine",
    "EventStream",
    "Finished",
    "GenerationProgress",
    "GenerationRequest",
    "HTTPSettings",
    "HeadersTooLargeError",
    "InvalidRequestError",
    "LlamaBackend",
    "LlamaSettings",
    "MethodNotAllowedError",
    "ModelInfo",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PieceChannel",
    "PreparedPrompt",
    "SamplingParams",
    "ScriptedBackend",
    "Server",
    "ServerSettings",
    "ServerState",
    "ServiceUnavailableError",
    "StreamTimings",
    "TextDelta",
    "ThreadedBackend",
    "TrioserveError",
    "UnsupportedMediaTypeError",
    "UpstreamBackend",
    "UpstreamState",
    "Usage",
    "create_app",
    "default_model_path",
    "serve_until_signalled",
]
