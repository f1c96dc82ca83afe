"""What the HTTP layer shares with the server: settings, the engine once loaded, and
one cancel handle per in-flight request (so that shutdown can reach each one)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from .._core._backend import GenerationProgress
from .._core._engine import Engine
from .._core._types import EndCause
from .._wire._chat import ChatFormat, chat_format_for
from ._metrics import Metrics

__all__ = ["HTTPSettings", "RequestControl", "ServerState"]


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
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    heartbeat_interval: float | None = 15.0
    default_timeout: float | None = None
    max_timeout: float | None = 600.0
    model_aliases: tuple[str, ...] = ()


class RequestControl:
    """The cancel handle of one in-flight request: its scope and why it was cancelled."""

    __slots__ = (
        "cancelled",
        "cancelled_at",
        "cause",
        "connection_cut",
        "progress",
        "scope",
        "tokens_at_cancel",
    )

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope
        self.cause: EndCause | None = None
        #: the generation's counters, once it has started (for "wasted" tokens)
        self.progress: GenerationProgress | None = None
        self.tokens_at_cancel: int | None = None
        #: ``time.perf_counter()`` when the cancel was requested
        self.cancelled_at: float | None = None
        #: set by :meth:`cancel` (a deadline shows as ``scope.deadline`` passing instead)
        self.cancelled = trio.Event()
        #: trioserve ended the connection (a stalled client): the response did not get through
        self.connection_cut = False

    def cancel(self, cause: EndCause) -> None:
        if self.cause is None and trio.current_time() >= self.scope.deadline:
            self.note_deadline()  # the deadline came first; this cancel is its echo
        if self.cause is None:
            self.cause = cause
            self.cancelled_at = time.perf_counter()
            if self.progress is not None:
                self.tokens_at_cancel = self.progress.completion_tokens
        self.cancelled.set()
        self.scope.cancel()

    def note_deadline(self) -> None:
        """The scope's deadline fired: record it as the cause, dated when it passed."""
        if self.cause is None:
            self.cause = "deadline"
            late = max(0.0, trio.current_time() - self.scope.deadline)
            self.cancelled_at = time.perf_counter() - late


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
    requests: set[RequestControl] = field(default_factory=set[RequestControl])
    metrics: Metrics = field(default_factory=Metrics)
    _idle: trio.Event = field(default_factory=trio.Event)

    def add_request(self, control: RequestControl) -> None:
        self.requests.add(control)
        if self._idle.is_set():
            self._idle = trio.Event()

    def remove_request(self, control: RequestControl) -> None:
        self.requests.discard(control)
        if not self.requests:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        if self.requests:
            await self._idle.wait()

    def set_engine(self, engine: Engine) -> None:
        info = engine.backend.info
        self.chat_format = chat_format_for(
            template=info.chat_template,
            architecture=info.architecture,
            bos_token=info.bos_token,
            eos_token=info.eos_token,
        )
        self.engine = engine
        self.metrics.bind_engine(engine)

    def model_names(self) -> tuple[str, ...]:
        if self.engine is None:
            return ()
        return (self.engine.backend.info.id, *self.settings.model_aliases)

    def cancel_all(self, cause: EndCause) -> None:
        for control in list(self.requests):
            control.cancel(cause)
