"""One reader of a detachable stream's log (issue 48; docs/resumable-streams.md): the
``POST`` that started the stream, or a resume (``GET /v1/stream``, ``GET
/v1/responses/{id}?stream=true``, ``Last-Event-ID``).

A reader is an :class:`~._request.InFlightRequest` of its own — its own scope,
disconnect watcher and stall timer — that holds no lease, slot or model: its end (the
client gone, a stalled send) ends *the reader* and never the job, whose log keeps
filling and, when nobody reads, pauses it. Its log line says what it read.
"""

from __future__ import annotations

import logging
import math

import trio

from .._core._exceptions import NotFoundError, RequestCancelledError
from ._exchange import Receive
from ._lifecycle import FINAL_EVENT_TIMEOUT, send_last, watch_disconnect, watch_stall
from ._request import InFlightRequest
from ._stream_log import Cursor, StreamLog

__all__ = ["follow"]

logger = logging.getLogger("trioserve.http")


async def follow(
    reader: InFlightRequest,
    log: StreamLog,
    cursor: Cursor,
    receive: Receive,
    *,
    stall_timeout: float | None,
    head: tuple[int, list[tuple[bytes, bytes]]] | None = None,
    job_id: str = "",
) -> None:
    """Send ``log``'s bytes from ``cursor`` to the end of the stream (or until the
    reader goes away), then detach the cursor. ``head``: the status and headers to
    start with; ``None``: the job's own (the ``POST``'s reader: an error the job
    answered before its stream began is relayed as it is)."""
    exchange = reader.exchange
    start = cursor.offset
    sent = 0
    try:
        with reader.cancel_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_disconnect, receive, reader)
                stall_scope = trio.CancelScope(shield=True)
                timeout = math.inf if stall_timeout is None else stall_timeout
                nursery.start_soon(watch_stall, reader, timeout, stall_scope)
                try:
                    await log.head_set.wait()
                    if log.status is None:
                        # dropped before its job answered (stopped, or replaced by a
                        # newer request of the same id): nothing was ever streamed
                        await exchange.error(
                            RequestCancelledError(
                                "the stream was stopped (DELETE) or replaced by a newer request with "
                                "the same id before its response began",
                                code="superseded",
                            )
                        )
                        reader.end("error")
                        return
                    if head is None:
                        headers = [(k, v) for k, v in log.headers if k.lower() != b"x-request-id"]
                        head = (log.status, headers)
                    elif log.status != 200:
                        # a resume of a stream whose job was refused before it began:
                        # there is nothing to resume (it is being forgotten)
                        await exchange.error(NotFoundError("Stream not found or expired", param="conv_id"))
                        reader.end("error")
                        return
                    await exchange.start(*head)
                    while True:
                        data = await log.read(cursor)
                        if not data:
                            break
                        await exchange.body(data, keep_unsent=False)
                        sent += len(data)
                        log.consumed(cursor, len(data))
                    # the end: stop watching first (hypercorn reports the end of a
                    # response as a disconnect)
                    reader.delivered = True
                    reader.watch_scope.cancel()
                    await send_last(reader, FINAL_EVENT_TIMEOUT, lambda: exchange.body(b"", more=False))
                    reader.end("stop")
                finally:
                    stall_scope.cancel()
                    nursery.cancel_scope.cancel()  # (the watchers: this reader is done)
    finally:
        log.detach(cursor)
        logger.info(
            "reader of %s: %s, from byte %d, %d bytes%s",
            job_id or reader.exchange.request_id,
            reader.cause or "end",
            start,
            sent,
            "" if log.finished else " (the stream goes on)",
        )
