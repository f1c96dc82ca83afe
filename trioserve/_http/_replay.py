"""Resuming a detachable stream (issue 48; docs/resumable-streams.md, "The routes"):
``GET /v1/stream?conv_id=ID&from=N`` (llama-server's: ``N`` a byte offset of the
stream's body; errors in llama-server's shape and words), ``GET
/v1/responses/{id}?stream=true&starting_after=N`` (OpenAI's: the events of a background
response whose ``sequence_number`` is greater than ``N``; OpenAI's error bodies), and
on both the SSE way, ``Last-Event-ID: K`` (the events after ``K``; it wins over
``from``/``starting_after``, because an ``EventSource`` reconnects to the URL it first
opened).

Served at the ASGI level, as the generation endpoints are: a reader needs a nursery
(its disconnect watcher and stall timer), and a nursery must not span a quart
generator's ``yield``."""

from __future__ import annotations

import urllib.parse
import uuid

from .._core._exceptions import InvalidRequestError, NotFoundError, TrioserveError
from .._wire import encode_json
from ._access import AccessPolicy, key_salt
from ._event_store import replay_log, stored_replay
from ._exchange import Exchange, Receive, Scope, Send, _header
from ._following import follow
from ._request import InFlightRequest
from ._state import ServerState
from ._stored import check_include, missing_response
from ._stream_log import BadOffset, Cursor, OffsetLost, StreamLog

__all__ = ["STREAM_PATH", "ReplayHandler", "ResponsesReplay", "render_llama_error", "response_stream_id"]

STREAM_PATH = "/v1/stream"
_RESPONSES_PREFIX = "/v1/responses/"

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


async def _past_the_end(exchange: Exchange) -> None:
    """A 204 with no body, for a reader past the last event of a finished stream: it
    stops an EventSource's reconnecting (the SSE standard)."""
    await exchange.start(204, [])
    await exchange.body(b"", more=False)


class _LogReaders:
    """What both replay routes share: the server's state and access policy, and the
    request of one reader, owned by its key."""

    def __init__(self, state: ServerState, access: AccessPolicy | None = None) -> None:
        self.state = state
        self.access = access

    def _reader(self, scope: Scope, exchange: Exchange) -> InFlightRequest:
        """The reader's request (a ``stream`` request), owned by the key's salt: it
        reads only its own key's streams."""
        reader = InFlightRequest(scope, exchange, "stream")
        reader.owner = key_salt(scope, self.access)
        return reader

    async def _follow(
        self,
        reader: InFlightRequest,
        receive: Receive,
        log: StreamLog,
        cursor: Cursor,
        head: tuple[int, list[tuple[bytes, bytes]]] | None,
        job_id: str,
    ) -> None:
        """Send ``log`` to ``reader`` from ``cursor`` on (``head``: the status and headers
        to start with; ``None``: the log's own), under the server's stall timeout."""
        await follow(
            reader, log, cursor, receive, stall_timeout=self.state.stall_timeout, head=head, job_id=job_id
        )


class ReplayHandler(_LogReaders):
    """``GET /v1/stream``: one reader of a detachable stream, from an offset."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(send, uuid.uuid4().hex, render_llama_error)
        reader = self._reader(scope, exchange)
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
                        await _past_the_end(exchange)
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
        job_id = job.exchange.request_id if job is not None else ""
        await self._follow(reader, receive, log, cursor, (200, headers), job_id)


def _query(scope: Scope) -> dict[str, list[str]]:
    return urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)


def response_stream_id(scope: Scope) -> str | None:
    """The response id of a ``GET /v1/responses/{id}?stream=true`` (served here), or
    ``None`` (the route without ``stream``: the stored object, answered by quart)."""
    path: str = scope["path"]
    if scope["method"] != "GET" or not path.startswith(_RESPONSES_PREFIX):
        return None
    response_id = path[len(_RESPONSES_PREFIX) :].rstrip("/")
    if not response_id or "/" in response_id:
        return None
    streamed = _query(scope).get("stream", ["false"])[0]
    return None if streamed.lower() in ("false", "0", "") else response_id


def _sequence_number(text: str, name: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise InvalidRequestError(
            f"{name} must be a whole number ≥ 0 (the sequence_number of the last event received); "
            f"got {text!r}",
            param=name,
        )
    return int(text)


class ResponsesReplay(_LogReaders):
    """``GET /v1/responses/{id}?stream=true``: one reader of a background response's
    stream (``background`` + ``stream``), after a sequence number. The events come from
    its in-memory log while it runs and ``--detach-timeout`` seconds after its end; once
    the log is gone (dropped, or the server restarted), from the store
    (:func:`~._event_store.stored_replay`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send, response_id: str) -> None:
        exchange = Exchange(send, uuid.uuid4().hex)  # (OpenAI's error bodies)
        reader = self._reader(scope, exchange)
        try:
            self.state.serving_registry()  # (503 while shutting down)
            service = self.state.responses
            if service is None:
                raise NotFoundError(
                    "this server stores no responses (start it with --responses-db)", param="response_id"
                )
            query = _query(scope)
            check_include(query.get("include[]", []) + query.get("include", []))
            last_event = _header(scope, b"last-event-id")
            after: int | None = None
            if last_event is not None:
                after = _sequence_number(last_event, "Last-Event-ID")
            elif "starting_after" in query:
                after = _sequence_number(query["starting_after"][0], "starting_after")
            # (include_obfuscation is accepted: there is no obfuscation to add)
            detached = self.state.detached
            stream = None if detached is None else detached.get(reader.owner, response_id)
            if stream is None or not stream.background:
                # no live log (it was dropped after its end, or the server restarted):
                # its events as the store keeps them
                if await service.get(response_id, reader.owner) is None:
                    raise missing_response(response_id)
                by_header = last_event is not None
                replay = await stored_replay(service, response_id, reader.owner, after, by_header=by_header)
                if replay is None:
                    raise InvalidRequestError(
                        f"the response {response_id!r} has no stream to resume: only a response created "
                        "with background: true and stream: true can be streamed again; read it whole "
                        "without stream",
                        param="stream",
                    )
                if replay.past_end and by_header:
                    await _past_the_end(exchange)
                    return
                log = replay_log(replay.body)
                cursor: Cursor | None = log.attach(0)
                head: tuple[int, list[tuple[bytes, bytes]]] | None = (200, list(_SSE_HEADERS))
            else:
                head = None  # (the job's own: a response refused before its stream began relays its error)
                log, cursor = await self._live(exchange, stream.log, after, last_event)
                if cursor is None:
                    return
        except TrioserveError as exc:
            await exchange.error(exc)
            return
        assert cursor is not None
        await self._follow(reader, receive, log, cursor, head, response_id)

    @staticmethod
    async def _live(
        exchange: Exchange, log: StreamLog, after: int | None, last_event: str | None
    ) -> tuple[StreamLog, Cursor | None]:
        """A cursor on the live log after ``after`` (``None``: a 204 went out)."""
        last = log.next_id - 1
        if after is not None and after >= last and log.finished and last_event is not None:
            await _past_the_end(exchange)
            return log, None
        if after is not None and after > last and not log.finished:
            name = "Last-Event-ID" if last_event is not None else "starting_after"
            raise InvalidRequestError(
                f"{name} {after} is past the stream's last event so far ({last})", param=name
            )
        try:
            return log, log.attach(0) if after is None else log.attach_after(after)
        except (OffsetLost, BadOffset):
            raise InvalidRequestError(
                f"the events after sequence_number {after} are no longer kept (a stream keeps its "
                f"last {log.max_events} events once read): resume from a later one, or read the "
                "response whole without stream",
                param="Last-Event-ID" if last_event is not None else "starting_after",
            ) from None
