"""A generation request's life around its response: the watchers that end it (the
client gone, a stalled send), the heartbeat of a silent stream, and the bounded, shielded
send of its last bytes. Why every bound: ``docs/cancellation.md``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from .._core._errors import unwrap_group
from ._exchange import Exchange, Message, Receive, Scope, Send
from ._hypercorn_patches import shut_down_connection
from ._request import InFlightRequest

__all__ = [
    "FINAL_EVENT_TIMEOUT",
    "INLINE_PARSE_BYTES",
    "Heartbeat",
    "completing",
    "end_connection",
    "off_the_loop_if",
    "send_last",
    "watch_disconnect",
    "watch_stall",
    "watched",
]

#: how long the final event of a cancelled stream may take to send (shielded)
FINAL_EVENT_TIMEOUT = 1.0
#: request bodies larger than this (bytes) are decoded (and chats rendered) in a worker
#: thread, so one big request cannot stall every stream
INLINE_PARSE_BYTES = 64 * 1024


async def watch_disconnect(receive: Receive, request: InFlightRequest) -> None:
    """Wait for the client to go away, then cancel the request. No polling: after the
    body, the next ASGI message is ``http.disconnect``. (If trioserve's stall timer
    ended the connection, the cause is already ``stall``; the first cause wins.)"""
    with request.watch_scope:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                request.cancel("disconnect")
                return


def end_connection(scope: Scope) -> None:
    if scope.get("http_version") != "2":  # HTTP/2: cancelling ends just this stream
        shut_down_connection(scope.get("client"), scope.get("server"))


async def send_last(
    request: InFlightRequest, bound: float, send: Callable[[], Awaitable[None]], *, watch_cancel: bool = False
) -> bool:
    """Run ``send()`` (the last bytes of a response) shielded from every cancel, and
    bounded: if it has not returned after ``bound`` seconds — or, with ``watch_cancel``,
    ``FINAL_EVENT_TIMEOUT`` after the request is cancelled — the connection is ended
    (HTTP/1.1: hypercorn's shielded send fails at once; HTTP/2: the send is cancelled).
    Returns whether the bytes went out."""
    cut = False
    with trio.CancelScope(shield=True) as shield:
        async with trio.open_nursery() as nursery:

            async def guard() -> None:
                nonlocal cut
                with trio.move_on_after(bound):
                    if watch_cancel:
                        with trio.move_on_at(request.cancel_scope.deadline):
                            await request.cancelled.wait()  # or the deadline passes
                        await trio.sleep(FINAL_EVENT_TIMEOUT)
                    else:
                        await trio.sleep_forever()
                cut = True
                request.connection_cut = True
                end_connection(request.asgi)
                shield.cancel()

            nursery.start_soon(guard)
            await send()
            nursery.cancel_scope.cancel()
    return not cut and not (watch_cancel and request.connection_cut)


@asynccontextmanager
async def watched(
    request: InFlightRequest, receive: Receive, stall_timeout: float | None
) -> AsyncIterator[None]:
    """While the body runs, its watchers: the client's disconnect, and the stall timer
    (:func:`watch_stall`; ``None``: none, for an answer sent whole). The stall timer
    outlives a cancel of the request: a cancelled consumer stuck in hypercorn's
    (shielded) send is freed only by ending the connection. Both stop when the body is
    done; an error group of one error raises that error."""
    with unwrap_group():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, receive, request)
            stall_scope = trio.CancelScope(shield=True)
            if stall_timeout is not None:
                nursery.start_soon(watch_stall, request, stall_timeout, stall_scope)
            try:
                yield
            finally:
                stall_scope.cancel()
            nursery.cancel_scope.cancel()  # the watchers: this request is done


async def watch_stall(request: InFlightRequest, stall_timeout: float, stall_scope: trio.CancelScope) -> None:
    """trioserve's stall timer: a send to this client that has been blocked for
    ``stall_timeout`` seconds ends the request with cause ``stall`` and the connection
    (shut down: the blocked send — shielded inside hypercorn — fails at once). Once the
    request is cancelled (any cause, the deadline included) a blocked send gets only
    ``FINAL_EVENT_TIMEOUT``: a client that is not reading cannot be told why anyway, and
    a cancelled request must not wait a whole stall timeout to let go.

    A timer, not a poll: it wakes when the send in progress would have stalled, when the
    request is cancelled or its deadline passes, or one timeout from now when nothing is
    sending (no send starting later can stall sooner)."""
    exchange = request.exchange
    with stall_scope:
        while True:
            now = time.perf_counter()
            left = request.cancel_scope.deadline - trio.current_time()
            cancelled = request.cause is not None or left <= 0
            limit = min(stall_timeout, FINAL_EVENT_TIMEOUT) if cancelled else stall_timeout
            since = exchange.sending_since
            if since is not None and now - since >= limit:
                request.cancel("stall")  # (a cause that came first is kept)
                request.connection_cut = True
                end_connection(request.asgi)
                return
            wait = (since if since is not None else now) + limit - now
            if cancelled:
                await trio.sleep(wait)
            else:
                with trio.move_on_after(min(wait, left)):
                    await request.cancelled.wait()


class Heartbeat:
    """SSE comments while a started stream is silent before its first token (queued,
    long prefill), so proxies and clients see a live connection.

    One writer per response: the heartbeat task owns the response's ``send`` until the
    consumer's first write, which first calls :meth:`hand_over` — that stops the task
    and waits until it has returned, so two sends never overlap. A timer, not a poll:
    the task sleeps until the next moment a heartbeat is due."""

    def __init__(self, exchange: Exchange, interval: float, beat: Callable[[], bytes]) -> None:
        self.exchange = exchange
        self.interval = interval
        #: the bytes of one beat, made at each beat (a dialect may stamp them)
        self.beat = beat
        self.scope = trio.CancelScope()
        self.done = trio.Event()

    async def run(self) -> None:
        exchange = self.exchange
        try:
            with self.scope:
                while True:
                    await trio.sleep(max(0.0, exchange.last_sent + self.interval - time.perf_counter()))
                    await exchange.body(self.beat(), keep_unsent=False)
        finally:
            self.done.set()

    async def hand_over(self) -> None:
        self.scope.cancel()
        await self.done.wait()


async def off_the_loop_if[T, *Args](large: bool, work: Callable[[*Args], T], *args: *Args) -> T:
    """``work(*args)``, in a worker thread when ``large`` (a body over 64 KiB, a long
    answer). Never abandoned: a cancel waits for the thread to return, so whatever it
    uses (a model, held by a lease around this call) outlives it."""
    if large:
        return await trio.to_thread.run_sync(work, *args)
    return work(*args)


def completing(send: Send) -> Send:
    """``send``, shielded from cancellation (HTTP/1.x). hypercorn ends a response's cycle
    inside the send of its last body message: it feeds the app ``http.disconnect`` there
    (on which quart-trio, and the disconnect watchers, cancel the task that is sending),
    then closes the connection (a body left unread: a 405, a 400 before the body) or
    restarts its keep-alive timer. A cancel at that point left the connection open with
    the client's next request unread, and no timer: it hung until the client gave up
    (found by the schemathesis run, tests/e2e/test_openapi_fuzz.py). hypercorn's HTTP/1.1
    socket writes are shielded already (the stall timer shuts the socket down instead),
    so this waits for nothing new; HTTP/2 sends stay cancellable. Only the messages that
    open and end a response are shielded: a streamed body's events (``more_body``) are
    sent as they are, with no scope per event on the hot path."""

    async def shielded(message: Message) -> None:
        if message.get("more_body", False):
            await send(message)
            return
        with trio.CancelScope(shield=True):
            await send(message)

    return shielded
