"""Requests by id (docs/operations.md, "Requests by id"): list the caller's requests in
flight, cancel one from outside — in any phase, the same teardown as a disconnect.
An API key sees and cancels its own requests; an admin key, everyone's."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import trio
from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import NotFoundError, TrioserveError
from .._wire import encode_json
from ._access import AccessPolicy
from ._detach import DetachedStream, DetachedStreams
from ._exchange import Scope
from ._generation import key_salt, presented_key
from ._lifecycle import FINAL_EVENT_TIMEOUT
from ._request import InFlightRequest, Phase
from ._route_io import error_response
from ._state import ServerState

__all__ = ["add_request_routes", "phase_of"]

logger = logging.getLogger("trioserve.server")

#: how long a cancel waits for the request to end (its final event is bounded by
#: FINAL_EVENT_TIMEOUT; a background response's end is stored after it)
_CANCEL_WAIT = FINAL_EVENT_TIMEOUT + 5.0


def phase_of(request: InFlightRequest) -> str:
    """Where a request is, in words: ``receiving`` (its body), ``loading`` (its model),
    ``queued`` (for a slot), ``prefill``, ``decode``, ``paused`` (set aside for a
    better-ranked request, waiting for a slot again — :func:`paused_by` says
    ``preempted`` — or its reader is slow: the stream's buffer is full, ``reader``),
    ``finishing``, ``done``."""
    phase = request.phase
    if phase is Phase.RECEIVING:
        return "receiving"
    if phase is Phase.LOADING:
        return "loading"
    if phase >= Phase.FINISHING:
        return "finishing" if phase is Phase.FINISHING else "done"
    events = request.events
    if events is None:
        return "queued"
    if paused_by(request) is not None:
        return "paused"
    if events.progress.completion_tokens == 0:
        return "prefill"
    return "decode"


def paused_by(request: InFlightRequest) -> str | None:
    """Why a running request is paused: ``preempted`` (its slot went to a better-ranked
    request), ``reader`` (its client reads slower than it generates); ``None``: it is
    not."""
    events = request.events
    if events is None or request.phase >= Phase.FINISHING:
        return None
    lease = events.progress.preemption
    if lease is not None and lease.paused:
        return "preempted"
    if events.progress.completion_tokens and events.buffered_room == 0:
        return "reader"
    return None


def _describe(request: InFlightRequest, detached: DetachedStreams | None) -> dict[str, Any]:
    events = request.events
    phase, paused = phase_of(request), paused_by(request)
    stream = None if detached is None else detached.of_job(request)
    if stream is not None:
        phase, paused = _detached_phase(stream, phase, paused)
    return {
        "id": request.exchange.request_id,
        "object": "request",
        "model": request.model,
        "endpoint": request.kind,
        "phase": phase,
        "paused": paused,
        # a resumable stream's job (docs/resumable-streams.md): its id (X-Conversation-Id,
        # or a background response's id) and the readers attached to it now
        "conversation_id": None if stream is None else stream.conversation_id,
        "readers": None if stream is None else stream.log.readers,
        "priority": request.ticket.priority if request.ticket is not None else None,
        "key": request.account.name if request.account is not None else None,
        "session": request.session,
        "created": int(request.created_at),
        "elapsed_ms": round((time.perf_counter() - request.started) * 1000.0, 1),
        "prompt_tokens": events.progress.prompt_tokens if events is not None else None,
        "completion_tokens": events.progress.completion_tokens if events is not None else 0,
    }


def _detached_phase(stream: DetachedStream, phase: str, paused: str | None) -> tuple[str, str | None]:
    """A resumable stream's job: ``detached`` while nobody reads it (until it
    finishes), ``paused`` saying ``log_full`` (its log waits for a reader) or
    ``parked`` (its slot and cells given up; with a reader attached, it waits for a slot
    again)."""
    if stream.state == "parked":
        paused = "parked"
    elif stream.state == "paused" and not stream.log.readers:
        paused = "log_full"
    if not stream.log.readers and phase not in ("finishing", "done"):
        return "detached", paused
    return ("paused" if paused == "parked" else phase), paused


def add_request_routes(app: QuartTrio, state: ServerState, access: AccessPolicy | None) -> None:
    """Add ``GET /v1/requests``, ``POST /v1/requests/{id}/cancel`` and
    ``DELETE /v1/requests/{id}`` to ``app``."""

    def caller() -> tuple[str, bool]:
        from quart import request

        scope = cast("Scope", request.scope)
        key = presented_key(scope)
        admin = access is not None and key is not None and access.key_is_admin(key)
        return key_salt(scope, access), admin

    def caller_name() -> str:
        """The caller's key's name (the keys file's; ``default`` for a key without an
        entry), as ``GET /v1/requests`` shows it."""
        from quart import request

        keyed = access is not None and access.requires_key
        key = presented_key(cast("Scope", request.scope)) if keyed else None
        return state.accounts.account(key).name

    def json(body: dict[str, Any], status: int = 200) -> Response:
        return Response(encode_json(body), status=status, content_type="application/json")

    @app.get("/v1/requests")
    async def list_requests() -> Response:
        owner, admin = caller()
        mine = [r for r in state.requests if admin or r.owner == owner]
        mine.sort(key=lambda r: r.started)
        return json({"object": "list", "data": [_describe(r, state.detached) for r in mine]})

    async def cancel(request_id: str) -> Response:
        owner, admin = caller()
        found = state.find_requests(request_id, owner, admin=admin)
        if not found:
            return error_response(
                NotFoundError(
                    f"no request {request_id!r} in flight for this API key (it ended, or never was)",
                    param="request_id",
                )
            )
        phases = [phase_of(r) for r in found]
        first = found[0]
        # whose request it was: an admin may cancel any key's, and says whose it cancelled
        whose = first.account.name if first.account is not None else None
        others = any(r.owner != owner for r in found)
        if others:
            logger.info(
                "request %s of key %r cancelled by id by admin key %r", request_id, whose, caller_name()
            )
        else:
            logger.info("request %s of key %r cancelled by id by its own key", request_id, whose)
        for request in found:
            request.cancel("cancelled")
        with trio.move_on_after(_CANCEL_WAIT):
            for request in found:
                await request.done.wait()
        return json(
            {
                "id": request_id,
                "object": "request",
                # the owner: its key's name (the keys file's; ``default`` without an entry)
                "key": whose,
                # (false: it had ended on its own before the cancel reached it)
                "cancelled": first.cause == "cancelled",
                # the phase it was in when the cancel came
                "phase": phases[0],
                "model": first.model,
                "end_cause": first.cause,
                "done": all(r.done.is_set() for r in found),
            }
        )

    @app.post("/v1/requests/<request_id>/cancel")
    async def cancel_request(request_id: str) -> Response:
        try:
            return await cancel(request_id)
        except TrioserveError as exc:  # (none expected: kept in the error shape)
            return error_response(exc)

    @app.delete("/v1/requests/<request_id>")
    async def delete_request(request_id: str) -> Response:
        return await cancel_request(request_id)
