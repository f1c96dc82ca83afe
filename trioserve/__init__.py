"""trioserve: a streaming LLM inference server and library on Trio.

The public API is everything listed in ``__all__``; modules starting with ``_`` are
private. Its promise: when a generation returns or raises — by a cancel of one of your
scopes too — its inference has stopped, and its slot and model state are free. The
library API with each call's cancellation behaviour: ``docs/embedding.md``; the
architecture: ``docs/architecture.md``.
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
from ._backends._sources import LlamaSource
from ._core._admission import Ticket
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
    NotSupportedError,
    OverloadedError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    TrioserveError,
    UnsupportedMediaTypeError,
)
from ._core._registry import (
    BackendSource,
    Lease,
    ModelEntry,
    ModelRegistry,
    ModelSnapshot,
    ModelSource,
    ModelSpec,
    RegistrySnapshot,
)
from ._core._types import (
    Constraint,
    EndCause,
    Finished,
    GenerationRequest,
    SamplingParams,
    TextDelta,
    TokenLogprob,
    Usage,
)
from ._http import HTTPSettings, ServerState, create_app
from ._http._server import Server, ServerSettings, serve_until_signalled
from ._wire._limits import RequestLimits

__all__ = [
    "Aborted",
    "AuthenticationError",
    "Backend",
    "BackendError",
    "BackendSource",
    "Constraint",
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
    "Lease",
    "LlamaBackend",
    "LlamaSettings",
    "LlamaSource",
    "MethodNotAllowedError",
    "ModelEntry",
    "ModelInfo",
    "ModelRegistry",
    "ModelSnapshot",
    "ModelSource",
    "ModelSpec",
    "NotFoundError",
    "NotSupportedError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "PieceChannel",
    "PreparedPrompt",
    "RateLimitError",
    "RegistrySnapshot",
    "RequestLimits",
    "SamplingParams",
    "ScriptedBackend",
    "Server",
    "ServerSettings",
    "ServerState",
    "ServiceUnavailableError",
    "StreamTimings",
    "TextDelta",
    "ThreadedBackend",
    "Ticket",
    "TokenLogprob",
    "TrioserveError",
    "UnsupportedMediaTypeError",
    "UpstreamBackend",
    "UpstreamState",
    "Usage",
    "create_app",
    "default_model_path",
    "serve_until_signalled",
]
