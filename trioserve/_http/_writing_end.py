"""How a generation response ends, whichever its dialect: its last bytes sent whole
(shielded, bounded by the stall timeout; the request delivered before they go), or, cut
short, the client told why (bounded by ``FINAL_EVENT_TIMEOUT``); and a response's usage.
The base of :class:`~trioserve._http._writing.ResponseWriter`."""

from __future__ import annotations

import math

import trio

from .._core._engine import EventStream
from .._core._exceptions import DeadlineExceededError, RequestCancelledError, ServiceUnavailableError
from .._core._types import Finished, Usage
from ._lifecycle import FINAL_EVENT_TIMEOUT, send_last
from ._request import InFlightRequest, Phase
from ._state import ServerState

__all__ = ["ResponseEnd", "usage_of"]


def usage_of(choices: list[EventStream]) -> Usage:
    """The usage of a response: each prompt once (the first choice of each ``n``; the
    others shared its evaluation), the completions of every choice."""
    first = choices[0].usage
    if len(choices) == 1:
        return first
    prompts = [events for events in choices if events.choice_index == 0]
    return Usage(
        prompt_tokens=sum(events.usage.prompt_tokens for events in prompts),
        completion_tokens=sum(events.usage.completion_tokens for events in choices),
        cached_tokens=sum(events.usage.cached_tokens for events in prompts),
        cached_host_tokens=sum(events.usage.cached_host_tokens for events in prompts),
        cached_disk_tokens=sum(events.usage.cached_disk_tokens for events in prompts),
    )


class ResponseEnd:
    """The end of each generation response of a server: sent whole, or cut short."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def _end(
        self, request: InFlightRequest, data: bytes, event: Finished, *, json: bool = False
    ) -> None:
        """Send the end of a response that ended on its own (stop, length, error).

        The end is sent shielded — a deadline or shutdown that fires now must not cut
        the body short while the log says it ended well — and bounded by the stall
        timeout: if the client takes no bytes for that long, the connection is shut
        down and the log says ``stall``."""
        exchange = request.exchange
        request.advance(Phase.FINISHING)
        request.end(event.reason)
        if request.on_end is not None:
            # (shielded: what is stored is what is sent; one small write, in a thread)
            with trio.CancelScope(shield=True):
                await request.on_end()
        # Delivered before the last send: hypercorn reports the end of the response as
        # a disconnect, and that must not rewrite why it ended.
        request.delivered = True
        # Stop watching before the last send: hypercorn delivers http.disconnect from
        # inside it, and cancelling the request then would cancel hypercorn's own
        # end-of-response work (closing HTTP/1.0 and Connection: close connections,
        # starting the keep-alive timer).
        request.watch_scope.cancel()
        bound = math.inf if self.state.stall_timeout is None else self.state.stall_timeout

        async def send() -> None:
            if json:
                await exchange.json(200, data)
            else:
                await exchange.body(data, more=False)

        if not await send_last(request, bound, send, watch_cancel=True):
            # not delivered: the client took no bytes for the stall timeout (or, once
            # the request was cancelled, for FINAL_EVENT_TIMEOUT)
            request.end("stall")
            request.delivered = False

    async def cancelled(self, request: InFlightRequest) -> None:
        """Tell the client why its request ended early (unless it is the one who left)."""
        exchange, cause = request.exchange, request.cause
        if cause in ("disconnect", "stall") or exchange.ended:
            return  # (or the end went out before the cancel could matter)
        assert cause is not None
        assert cause != "overloaded"
        request.advance(Phase.FINISHING)
        dialect = request.dialect if exchange.started else None
        choices = request.choices

        async def send() -> None:
            if dialect is not None:
                usage = usage_of(choices) if choices else Usage(prompt_tokens=0, completion_tokens=0)
                # through the choice writers: text held in auto tool mode goes out
                # before the finish
                writers = dialect.writers
                left = [i for i in range(len(writers)) if i not in request.ended_choices]
                finals = b"".join(writers[i].finish(cause) for i in left)
                # (first what a cancel kept from going out: the writers' state counts it)
                await exchange.body(exchange.take_unsent() + finals + dialect.end(usage), more=False)
            elif cause == "deadline":
                await exchange.error(
                    DeadlineExceededError("the request's deadline passed before the response was complete")
                )
            elif cause == "cancelled":
                await exchange.error(
                    RequestCancelledError(
                        "the request was cancelled by its id (POST /v1/requests/{id}/cancel) before its "
                        "response began"
                    )
                )
            elif cause == "superseded":
                await exchange.error(
                    RequestCancelledError(
                        "a newer request of the same session (X-Session-Id) replaced this one before its "
                        "response began",
                        code="superseded",
                    )
                )
            elif cause == "unload":
                await exchange.error(
                    ServiceUnavailableError(
                        f"the model {request.model!r} was unloaded (POST /models/unload) before the "
                        "response was complete; retry to load it again",
                        code="model_unloaded",
                    )
                )
            else:
                await exchange.error(
                    ServiceUnavailableError("the server is shutting down; retry on another instance")
                )

        # (a half-sent event must not stay open: past the bound, the connection is ended)
        await send_last(request, FINAL_EVENT_TIMEOUT, send)
