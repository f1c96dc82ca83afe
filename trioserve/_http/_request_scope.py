"""A generation request's life in its one cancel scope: the disconnect watcher and
the stall timer around it, the model's lease (a load waited for inside the scope), the
end of a request cut short; and its end however it ends (an error answered, or a started
stream's final event; the cause recorded, its log line, charge and span)."""

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable

from .._core._exceptions import (
    OverloadedError,
    ServiceUnavailableError,
    TrioserveError,
)
from .._core._registry import ModelEntry
from .._core._tracing import TRACEPARENT
from .._core._types import EndCause
from .._wire import DialectSpec, StoredAsk
from ._access import check_keep_alive_key
from ._accounting import ENDPOINTS as ENDPOINT_PATHS
from ._accounting import log_request
from ._exchange import Receive, Scope, _ClientGone, _keep_alive
from ._lifecycle import FINAL_EVENT_TIMEOUT, send_last, watched
from ._prepare_run import PrepareAndRun
from ._request import InFlightRequest, Phase

__all__ = ["RequestScope", "RunPlan"]

logger = logging.getLogger("trioserve.http")


@dataclasses.dataclass(frozen=True, slots=True)
class RunPlan:
    """What a generation request runs, once read: its dialect, its body, its model and
    the stored conversation it continues (``ask``; ``None``: no store, or a dialect
    that stores nothing)."""

    spec: DialectSpec
    body: bytes
    entry: ModelEntry
    ask: StoredAsk | None


class RequestScope(PrepareAndRun):
    """One request's life, from the model's lease to its last byte, and its end."""

    async def _handle(self, request: InFlightRequest, serve: Callable[[], Awaitable[None]]) -> None:
        """Run ``serve`` as ``request``'s life: an error answered (or, once its stream
        began, its final event), the cause recorded, its log line, charge and span."""
        exchange = request.exchange
        tracing = self.state.tracing
        tracing.begin(request, ENDPOINT_PATHS[request.kind])
        # (the request's child tasks inherit it: its upstream calls carry the trace)
        traced = TRACEPARENT.set(request.traceparent)
        try:
            await serve()
        except _ClientGone:
            request.end("disconnect")
        except TrioserveError as exc:
            if isinstance(exc, OverloadedError):
                cause: EndCause = "overloaded"
            elif isinstance(exc, ServiceUnavailableError) and self.state.shutting_down:
                cause = "shutdown"
            else:
                cause = "error"
            request.end(request.cause or cause, exc.message)
            request.advance(Phase.FINISHING)
            if not exchange.started:
                await exchange.error(exc)
            elif request.dialect is not None and not exchange.ended:
                # the stream had started (e.g. refused by a race for the last queue place)
                final = exchange.take_unsent() + request.dialect.stream_error(exc)
                await send_last(request, FINAL_EVENT_TIMEOUT, lambda: exchange.body(final, more=False))
        except BaseException as exc:
            # Cancelled from outside the request's scope (hypercorn closing connections
            # at the end of a shutdown: a group of Cancelled), or a bug: record, re-raise.
            if request.cause is None:
                request.end("error" if isinstance(exc, Exception) else "shutdown")
            raise
        finally:
            TRACEPARENT.reset(traced)
            request.advance(Phase.DONE)
            usage = log_request(self.state.metrics, request)
            if usage is not None and request.account is not None:
                self.state.accounts.charge(request.owner, request.account, usage.completion_tokens)
            tracing.end(request, usage)
            request.done.set()

    async def _run(
        self,
        request: InFlightRequest,
        receive: Receive,
        plan: RunPlan,
        *,
        detached: bool = False,
    ) -> None:
        """The request's life in its scope, from the model's lease to its last byte
        (``detached``: a detachable stream's job, whose sends go to its log: a full log
        is the designed pause, never a stall)."""
        state = self.state
        scope = request.asgi
        spec, body, entry, ask = plan.spec, plan.body, plan.entry, plan.ask
        keep_alive = self._keep_alive(scope, spec, body)

        with request.cancel_scope:
            state.add_request(request)
            try:
                stall_timeout = math.inf if state.stall_timeout is None or detached else state.stall_timeout
                async with watched(request, receive, stall_timeout):
                    # the stored conversation it continues (a thread's read)
                    stored = None
                    if ask is not None and state.responses is not None:
                        stored = await state.responses.context(
                            ask.previous_response_id,
                            self.owner(scope),
                            request.exchange.request_id if ask.background else None,
                        )
                    # the model, loaded (a load waits inside this request's
                    # deadline; a disconnect leaves it: docs/models.md)
                    if entry.state != "loaded":
                        request.advance(Phase.LOADING)
                    lease = await state.lease(entry, request, keep_alive)
                    try:
                        # (a pinned model stays whatever the request asks)
                        ttl = None if entry.spec.pinned else keep_alive
                        await self._generate(request, lease.engine, body, spec, stored, ttl)
                    finally:
                        lease.release()
            finally:
                state.remove_request(request)
                if request.reservation is not None:
                    request.reservation.release()  # never reached the queue (idempotent)

        if request.delivered:
            return  # the last byte went out before any cancel could matter
        if request.cancel_scope.cancelled_caught or request.cause is not None:
            request.note_deadline()  # no-op if another cause came first
            await self.writer.cancelled(request)

    def _keep_alive(self, scope: Scope, spec: DialectSpec, body: bytes) -> float | None:
        """The model's TTL after this request: the body's (Ollama's ``keep_alive``), else
        ``X-Keep-Alive``'s. Like the header (checked by the access layer), a body's
        needs an admin key where keys are required (403 naming it)."""
        peek = spec.peek_keep_alive
        given = None if peek is None else peek(body)
        if given is None:
            return _keep_alive(scope)
        check_keep_alive_key(scope, self.access)
        return given
