"""One generation request's state, from its first byte to its log line.

:class:`InFlightRequest` is the only per-request state the generation handler keeps: its
exchange, its one cancel scope (``cancel_scope``, with the deadline) and why it ended.
Its :class:`Phase` only moves forward (:meth:`InFlightRequest.advance` raises
otherwise)::

    RECEIVING ─▶ QUEUED ─▶ STREAMING ─▶ FINISHING ─▶ DONE
        └──────────┴───────────┴──────────▲ (an error or a cancel skips ahead)

The first cause recorded wins (:meth:`InFlightRequest.cancel`); a deadline is recorded
as the cause dated when it passed. What each phase holds: ``docs/architecture.md``,
"One request's state".
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import trio

from .._core._types import EndCause

if TYPE_CHECKING:
    from .._core._admission import Reservation, Ticket
    from .._core._engine import EventStream
    from .._wire import Dialect
    from ._accounts import Account
    from ._exchange import Exchange, Scope

__all__ = ["InFlightRequest", "Kind", "Phase"]

#: the generation endpoints: ``/v1/completions``, ``/v1/chat/completions``,
#: ``/v1/messages`` (Anthropic), ``/v1/responses`` (OpenAI Responses)
#: ``stream``: a reader of a detachable stream (docs/resumable-streams.md)
#: ``ollama_chat``, ``ollama_generate``: Ollama's ``/api/chat`` and ``/api/generate``
Kind = Literal[
    "text",
    "chat",
    "messages",
    "responses",
    "infill",
    "ollama_chat",
    "ollama_generate",
    "embeddings",
    "rerank",
    "stream",
    "transcription",
    "speech",
]


class Phase(enum.IntEnum):
    RECEIVING = 0
    #: waiting for its model to load (or for room to load it: docs/models.md)
    LOADING = 1
    QUEUED = 2
    STREAMING = 3
    FINISHING = 4
    DONE = 5


class InFlightRequest:
    """One generation request: its exchange, its cancel scope and why it ended."""

    __slots__ = (
        "_choices",
        "_full_deadline",
        "account",
        "asgi",
        "cancel_scope",
        "cancelled",
        "cancelled_at",
        "cause",
        "connection_cut",
        "created_at",
        "delivered",
        "dialect",
        "done",
        "ended_choices",
        "error",
        "events",
        "exchange",
        "kind",
        "load_wait",
        "model",
        "on_end",
        "owner",
        "phase",
        "phase_at",
        "reasoning_end_asked",
        "reservation",
        "session",
        "span",
        "started",
        "ticket",
        "tokens_at_cancel",
        "trace_id",
        "traceparent",
        "watch_scope",
    )

    def __init__(self, asgi: Scope, exchange: Exchange, kind: Kind) -> None:
        self.asgi = asgi
        self.exchange = exchange
        self.kind: Kind = kind
        self.phase = Phase.RECEIVING
        #: ``time.perf_counter()`` when each phase began (0.0: not reached)
        self.phase_at = [0.0] * len(Phase)
        #: ``time.perf_counter()`` when the request arrived (and the wall clock's time)
        self.started = time.perf_counter()
        self.created_at = time.time()
        #: whose request it is: its API key's salt (``""`` without keys): who may list
        #: and cancel it besides an admin key
        self.owner = ""
        #: its key's entry in the keys file (the defaults without one), and its place
        #: in the queue (priority, share), once parsed
        self.account: Account | None = None
        self.ticket: Ticket | None = None
        #: its ``X-Session-Id``: a newer request of the same owner and session
        #: supersedes it (cancels it, cause ``superseded``)
        self.session: str | None = None
        #: set once the request is done (its log line written)
        self.done = trio.Event()
        #: its server span (tracing on: ``_tracing.Tracing``), the ``traceparent`` its
        #: upstream calls carry, and its trace id (for the log line)
        self.span: Any = None
        self.traceparent: str | None = None
        self.trace_id: str | None = None
        #: the one scope every cause cancels; its deadline is set when the request is parsed
        self.cancel_scope = trio.CancelScope()
        #: the deadline to go back to once the first token is out (a time limit on the
        #: prompt: :meth:`limit_first_token`)
        self._full_deadline: float | None = None
        #: why the request ended (``None`` while nothing has ended it)
        self.cause: EndCause | None = None
        #: the message of the error that ended it, for the log line
        self.error: str | None = None
        #: the model name the response carries
        self.model: str | None = None
        #: seconds it waited for its model to load (``None``: it never got that far)
        self.load_wait: float | None = None
        #: how the response is written (its API dialect), once the request is parsed
        self.dialect: Dialect | None = None
        #: the admission place held for a streamed request before its headers go out
        self.reservation: Reservation | None = None
        #: the engine's event stream, once it is open (usage, timings, progress); the
        #: first choice's when ``n`` > 1
        self.events: EventStream | None = None
        #: every choice's event stream (``n`` > 1: several): :attr:`choices`
        self._choices: list[EventStream] = []
        #: its reasoning was asked to end before its streams opened (queued): asked of
        #: each as they open (``_control_routes.py``)
        self.reasoning_end_asked = False
        #: the choices whose finish chunk went out (a cancel ends only the others)
        self.ended_choices: set[int] = set()
        #: the disconnect watcher's scope: stopped before the last send
        self.watch_scope = trio.CancelScope()
        #: ``time.perf_counter()`` when a cancel was requested
        self.cancelled_at: float | None = None
        self.tokens_at_cancel: int | None = None
        #: set by :meth:`cancel` (a deadline shows as ``cancel_scope.deadline`` passing instead)
        self.cancelled = trio.Event()
        #: trioserve ended the connection (a stalled client): the response did not get through
        self.connection_cut = False
        #: the last byte of a response that ended on its own went out
        self.delivered = False
        #: awaited before the last bytes of a response that ended on its own are sent
        #: (a stored response is written to the store first: a client that sends the
        #: next turn as soon as it has this one finds it)
        self.on_end: Callable[[], Awaitable[None]] | None = None

    @property
    def choices(self) -> list[EventStream]:
        """Every choice's event stream, once they are open."""
        return self._choices

    @choices.setter
    def choices(self, streams: list[EventStream]) -> None:
        self._choices = streams
        if self.reasoning_end_asked:
            for events in streams:
                events.end_reasoning()

    def advance(self, phase: Phase) -> None:
        """Move to ``phase``; never back."""
        if phase < self.phase:
            raise RuntimeError(f"a request cannot go back from {self.phase.name} to {phase.name}")
        if phase != self.phase:
            self.phase_at[phase] = time.perf_counter()
        self.phase = phase
        if phase >= Phase.STREAMING and self._full_deadline is not None:
            # the first token is out: the prompt's time limit no longer applies
            self.cancel_scope.deadline, self._full_deadline = self._full_deadline, None

    def limit_first_token(self, seconds: float) -> None:
        """A time limit on the way to the first token (queue, prompt): past it the
        request ends as at its deadline; the first token lifts it (an editor's
        ``t_max_prompt_ms``)."""
        self._full_deadline = self.cancel_scope.deadline
        self.cancel_scope.deadline = min(self._full_deadline, trio.current_time() + seconds)

    def set_timeout(self, timeout: float | None) -> None:
        self.cancel_scope.deadline = math.inf if timeout is None else trio.current_time() + timeout

    @property
    def deadline_passed(self) -> bool:
        return trio.current_time() >= self.cancel_scope.deadline

    def cancel(self, cause: EndCause) -> None:
        """Cancel the request's scope for ``cause`` (recorded unless a cause came first)."""
        if self.cause is None and self.deadline_passed:
            self.note_deadline()  # the deadline came first; this cancel is its echo
        if self.cause is None:
            self.cause = cause
            self.cancelled_at = time.perf_counter()
            if self.events is not None:
                self.tokens_at_cancel = self.events.progress.completion_tokens
        self.cancelled.set()
        self.cancel_scope.cancel()

    def note_deadline(self) -> None:
        """The scope's deadline fired: record it as the cause, dated when it passed."""
        if self.cause is None:
            self.cause = "deadline"
            late = max(0.0, trio.current_time() - self.cancel_scope.deadline)
            self.cancelled_at = time.perf_counter() - late

    def end(self, cause: EndCause, error: str | None = None) -> None:
        """Record how a request that was not cancelled ended (stop, length, error, …)."""
        self.cause = cause
        if error is not None:
            self.error = error
