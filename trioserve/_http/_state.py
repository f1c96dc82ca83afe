"""What the HTTP layer shares with the server: :class:`HTTPSettings`, and
:class:`ServerState` (the engine once loaded, and every
:class:`~trioserve._http._request.InFlightRequest`, so that shutdown can reach each one)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from .._core._engine import Engine
from .._core._exceptions import ServiceUnavailableError
from .._core._types import EndCause
from .._wire._chat import ChatFormat, chat_format_for
from ._metrics import Metrics
from ._request import InFlightRequest

__all__ = ["HTTPSettings", "ServerState"]


@dataclass(kw_only=True)
class HTTPSettings:
    """Limits and defaults of the HTTP surface.

    Attributes:
        max_body_bytes: request bodies larger than this get 413.
        max_header_bytes: requests whose headers add up to more get 431.
        max_prompt_tokens: prompts longer than this get 400 (``None``: the context).
        max_tokens_limit: ``max_tokens`` above this gets 400 (``None``: the context).
        default_timeout: seconds a request may take (queue + prefill + decode) when it
            does not say; ``None``: no limit.
        max_timeout: the cap on ``X-Request-Timeout``; ``None``: no cap.
        heartbeat_interval: a stream silent this long (queued, in a long prefill) gets
            an SSE comment line; ``None`` or 0: no heartbeats.
        model_aliases: other names accepted in the ``model`` field.
        keep_billing_header: keep Claude Code's ``x-anthropic-billing-header`` system
            block in the prompt (by default it is removed: it changes every request and
            would defeat the prompt cache; docs/dialects.md).
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    heartbeat_interval: float | None = 15.0
    default_timeout: float | None = None
    max_timeout: float | None = 600.0
    model_aliases: tuple[str, ...] = ()
    keep_billing_header: bool = False


@dataclass(kw_only=True)
class ServerState:
    """What the HTTP layer shares with the server: the engine once loaded, and the
    in-flight requests (so that shutdown can reach each one)."""

    settings: HTTPSettings = field(default_factory=HTTPSettings)
    engine: Engine | None = None
    chat_format: ChatFormat | None = None
    load_error: str | None = None
    shutting_down: bool = False
    #: the server's stall timeout: a send blocked this long ends the request (cause ``stall``)
    stall_timeout: float | None = None
    requests: set[InFlightRequest] = field(default_factory=set[InFlightRequest])
    metrics: Metrics = field(default_factory=Metrics)
    _idle: trio.Event = field(default_factory=trio.Event)
    #: when the model was loaded (Unix seconds): ``/v1/models``' ``created``
    loaded_at: int = 0

    def add_request(self, request: InFlightRequest) -> None:
        self.requests.add(request)
        if self._idle.is_set():
            self._idle = trio.Event()

    def remove_request(self, request: InFlightRequest) -> None:
        self.requests.discard(request)
        if not self.requests:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        if self.requests:
            await self._idle.wait()

    def serving_engine(self) -> Engine:
        """The engine, or the 503 a request gets while the model loads, after a load
        failure, or during shutdown."""
        if self.shutting_down:
            raise ServiceUnavailableError(
                "the server is shutting down; retry on another instance", retry_after=1
            )
        if self.engine is None:
            if self.load_error:
                raise ServiceUnavailableError(f"the model failed to load: {self.load_error}")
            raise ServiceUnavailableError(
                "the model is still loading; retry shortly", retry_after=1, code="loading"
            )
        return self.engine

    def set_engine(self, engine: Engine) -> None:
        info = engine.backend.info
        self.chat_format = chat_format_for(
            template=info.chat_template,
            architecture=info.architecture,
            bos_token=info.bos_token,
            eos_token=info.eos_token,
        )
        self.engine = engine
        self.loaded_at = int(time.time())
        self.metrics.bind_engine(engine)

    def model_names(self) -> tuple[str, ...]:
        if self.engine is None:
            return ()
        return (self.engine.backend.info.id, *self.settings.model_aliases)

    def cancel_all(self, cause: EndCause) -> None:
        for request in list(self.requests):
            request.cancel(cause)
