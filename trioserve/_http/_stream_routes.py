"""The routes around resumable streams besides the reader (issue 48;
docs/resumable-streams.md, "The routes"): llama-server's ``POST /v1/streams/lookup``
(which of these streams are live) and ``DELETE /v1/stream?conv_id=`` (the Stop: it
answers once the work has stopped). An API key sees only its own streams."""

from __future__ import annotations

import logging
from typing import Annotated, cast

import msgspec
import trio
from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import InvalidRequestError, TrioserveError
from .._wire import decode, encode_json
from ._access import AccessPolicy, key_salt
from ._exchange import Scope
from ._lifecycle import FINAL_EVENT_TIMEOUT
from ._replay import conversation_of, render_llama_error
from ._route_io import error_response
from ._state import ServerState

__all__ = ["LOOKUP_MAX_IDS", "add_stream_routes"]

logger = logging.getLogger("trioserve.server")

#: the most ids one lookup may ask about
LOOKUP_MAX_IDS = 256
_STOP_WAIT = FINAL_EVENT_TIMEOUT + 5.0


class _Lookup(msgspec.Struct, forbid_unknown_fields=True):
    #: (llama-server answers ``[]`` to a body without it: so does trioserve)
    conversation_ids: Annotated[list[str], msgspec.Meta(max_length=LOOKUP_MAX_IDS)] = []


_lookup_decoder = msgspec.json.Decoder(_Lookup)


def add_stream_routes(app: QuartTrio, state: ServerState, access: AccessPolicy | None) -> None:
    """Add ``POST /v1/streams/lookup`` and ``DELETE /v1/stream`` to ``app``."""

    def owner() -> str:
        from quart import request

        return key_salt(cast("Scope", request.scope), access)

    @app.post("/v1/streams/lookup")
    async def lookup() -> Response:
        from quart import request

        try:
            asked = decode(_lookup_decoder, cast("bytes", await request.get_data(as_text=False)))
        except TrioserveError as exc:
            # (llama-server's words and shape for a body it cannot read: no code)
            refusal = {"error": {"message": f"invalid body: {exc.message}", "type": exc.error_type}}
            return Response(encode_json(refusal), status=exc.status, content_type="application/json")
        detached = state.detached
        found = [] if detached is None else detached.lookup(owner(), asked.conversation_ids)
        body = [
            {
                "conversation_id": stream.conversation_id,
                "is_done": stream.log.finished,
                "total_bytes": stream.log.total_bytes,
                "started_at": int(stream.log.started_at),
                "completed_at": int(stream.log.completed_at),
            }
            for stream in found
        ]
        return Response(encode_json(body), status=200, content_type="application/json")

    @app.delete("/v1/stream")
    async def stop() -> Response:
        from quart import request

        try:
            conversation = conversation_of(cast("Scope", request.scope))
        except InvalidRequestError as exc:
            return error_response(exc, render_llama_error)
        detached = state.detached
        stream = None if detached is None else detached.get(owner(), conversation)
        if stream is None or detached is None:
            logger.info("DELETE /v1/stream: no stream %r for this key", conversation)
            return Response(b"", status=204)
        job = stream.job
        if job is not None and not job.done.is_set():
            logger.info("stream %r (request %s) stopped by DELETE", conversation, job.exchange.request_id)
            job.cancel("cancelled")
            with trio.move_on_after(_STOP_WAIT):
                await job.done.wait()
        # (its readers get the final event that says it was stopped, then it is dropped)
        await detached.stop(stream, FINAL_EVENT_TIMEOUT)
        return Response(b"", status=204)
