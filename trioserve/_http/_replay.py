"""Resuming a detachable stream (issue 48; docs/resumable-streams.md, "The routes"):
``GET /v1/stream?conv_id=ID&from=N`` (llama-server's: ``N`` a byte offset of the
stream's body) and the SSE way, ``Last-Event-ID: K`` (the events after ``K``; it wins
over ``from``, because an ``EventSource`` reconnects to the URL it first opened).

Served at the ASGI level, as the generation endpoints are: a reader needs a nursery
(its disconnect watcher and stall timer), and a nursery must not span a quart
generator's ``yield``. Errors in llama-server's shape and words."""

from __future__ import annotations

import urllib.parse
import uuid

from .._core._exceptions import InvalidRequestError, NotFoundError, TrioserveError
from .._wire import encode_json
from ._access import AccessPolicy, key_salt
from ._exchange import Exchange, Receive, Scope, Send, _header
from ._following import follow
from ._request import InFlightRequest
from ._state import ServerState
from ._stream_log import BadOffset, OffsetLost

__all__ = ["STREAM_PATH", "ReplayHandler", "render_llama_error"]

STREAM_PATH = "/v1/stream"

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def render_llama_error(exc: TrioserveError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """llama-server's error body on its stream routes: ``{"error": {"code": <status>,
    "message", "type"}}``."""
    kind = "not_found_error" if exc.status == 404 else exc.error_type
    body = encode_json({"error": {"code": exc.status, "message": exc.message, "type": kind}})
    return exc.status, [(b"content-type", b"application/json")], body


def conversation_of(scope: Scope) -> str:
    """The ``conv_id`` of the query (400 in llama-server's words without one)."""
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    found: str = query.get("conv_id", [""])[0]
    if not found:
        raise InvalidRequestError("Missing conversation id in path", param="conv_id")
    return found


def _non_negative(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or not text.strip().isdigit():
        raise InvalidRequestError(f"Invalid {what}", param=what.strip("'"))
    return value


class ReplayHandler:
    """``GET /v1/stream``: one reader of a detachable stream, from an offset."""

    def __init__(self, state: ServerState, access: AccessPolicy | None = None) -> None:
        self.state = state
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(send, uuid.uuid4().hex, render_llama_error)
        reader = InFlightRequest(scope, exchange, "stream")
        reader.owner = key_salt(scope, self.access)
        try:
            detached = self.state.detached
            conversation = conversation_of(scope)
            stream = None if detached is None else detached.get(reader.owner, conversation)
            if stream is None:
                raise NotFoundError("Stream not found or expired", param="conv_id")
            log = stream.log
            last_event = _header(scope, b"last-event-id")
            try:
                if last_event is not None:
                    after = _non_negative(last_event, "'Last-Event-ID'")
                    if log.finished and after >= log.next_id - 1:
                        # past the last event of a finished stream: 204 stops an
                        # EventSource's reconnecting (the SSE standard)
                        await exchange.start(204, [])
                        await exchange.body(b"", more=False)
                        return
                    cursor = log.attach_after(after)
                else:
                    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
                    offset = _non_negative(query.get("from", ["0"])[0], "'from' offset")
                    cursor = log.attach(offset)
            except OffsetLost:
                raise InvalidRequestError("Stream offset lost, please restart", param="from") from None
            except BadOffset:
                raise InvalidRequestError("Invalid 'from' offset", param="from") from None
        except TrioserveError as exc:
            await exchange.error(exc)
            return
        job = stream.job
        headers = [*_SSE_HEADERS, (b"x-conversation-id", conversation.encode())]
        await follow(
            reader,
            log,
            cursor,
            receive,
            stall_timeout=self.state.stall_timeout,
            head=(200, headers),
            job_id=job.exchange.request_id if job is not None else "",
        )
