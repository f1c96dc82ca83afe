"""The stored Responses' own routes (docs/dialects.md, "Stored responses"): read one
back, list its input items, delete it, cancel a background one. Each answers only the
API key that created the response (another key's is a 404, as a missing one)."""

from __future__ import annotations

from typing import Any, cast

import trio
from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import InvalidRequestError, NotFoundError, TrioserveError
from .._wire import encode_json
from ._access import AccessPolicy
from ._exchange import Scope
from ._generation import key_salt
from ._lifecycle import FINAL_EVENT_TIMEOUT
from ._route_io import error_response
from ._state import ServerState
from ._stored import StoredResponses, check_include, missing_response

__all__ = ["add_stored_routes"]

#: how long a cancel waits for the background response to stop and be stored
_CANCEL_WAIT = FINAL_EVENT_TIMEOUT + 5.0


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(encode_json(body), status=status, content_type="application/json")


def add_stored_routes(app: QuartTrio, state: ServerState, access: AccessPolicy | None) -> None:
    """Add ``GET``/``DELETE /v1/responses/{id}``, ``GET …/input_items`` and
    ``POST …/cancel`` to ``app``."""

    def service() -> StoredResponses:
        state.serving_registry()  # (503 while shutting down)
        if state.responses is None:
            raise NotFoundError(
                "this server stores no responses (start it with --responses-db)", param="response_id"
            )
        return state.responses

    def owner() -> str:
        from quart import request

        return key_salt(cast("Scope", request.scope), access)

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        from quart import request

        try:
            responses = service()
            # (stream=true is served before quart: _replay.ResponsesReplay)
            if "starting_after" in request.args:
                raise InvalidRequestError(
                    "starting_after resumes a stream: send it with stream=true (or leave it out to "
                    "read the response whole)",
                    param="starting_after",
                )
            check_include(request.args.getlist("include[]") + request.args.getlist("include"))
            body = await responses.get(response_id, owner())
            if body is None:
                raise missing_response(response_id)
        except TrioserveError as exc:
            return error_response(exc)
        return _json(body)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        try:
            responses = service()
            who = owner()
            job = responses.jobs.get(response_id)
            if job is not None and job.owner == who and job.request is not None:
                job.request.cancel("cancelled")  # (a running background response stops first)
                with trio.move_on_after(_CANCEL_WAIT):
                    await job.done.wait()
            detached = state.detached
            if detached is not None:
                stream = detached.get(who, response_id)
                if stream is not None and stream.background:
                    detached.drop(stream)  # (its events go with it)
            deleted = await responses.store.run(responses.store.store.delete, response_id, who)
            if not deleted:
                raise missing_response(response_id)
        except TrioserveError as exc:
            return error_response(exc)
        return _json({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/<response_id>/input_items")
    async def input_items(response_id: str) -> Response:
        from quart import request

        try:
            responses = service()
            args = request.args
            try:
                limit = int(args.get("limit", "20"))
            except ValueError:
                limit = 0
            if not 1 <= limit <= 100:
                raise InvalidRequestError(
                    f"limit must be a whole number from 1 to 100, got {args.get('limit')!r}", param="limit"
                )
            order = args.get("order", "desc")
            if order not in ("asc", "desc"):
                raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
            check_include(args.getlist("include[]") + args.getlist("include"))
            page = await responses.store.run(
                responses.store.store.input_items,
                response_id,
                owner(),
                limit=limit,
                order=order,
                after=args.get("after"),
            )
            if page is None:
                raise missing_response(response_id)
        except TrioserveError as exc:
            return error_response(exc)
        items, more = page
        return _json(
            {
                "object": "list",
                "data": items,
                "first_id": items[0].get("id") if items else None,
                "last_id": items[-1].get("id") if items else None,
                "has_more": more,
            }
        )

    @app.post("/v1/responses/<response_id>/cancel")
    async def cancel_response(response_id: str) -> Response:
        """Cancel a background response: its scope is cancelled (the same teardown as a
        disconnect, in any phase), and the answer is the response object, stored with
        ``status: "cancelled"``, once it has stopped."""
        try:
            responses = service()
            who = owner()
            job = responses.jobs.get(response_id)
            if job is not None and job.owner == who and job.request is not None:
                job.request.cancel("cancelled")
                with trio.move_on_after(_CANCEL_WAIT):
                    await job.done.wait()
            body = await responses.get(response_id, who)
            if body is None:
                raise missing_response(response_id)
            if not body.get("background"):
                raise InvalidRequestError(
                    "only a background response can be cancelled (this one ran in the foreground: "
                    "its client stops it by leaving)",
                    param="response_id",
                )
        except TrioserveError as exc:
            return error_response(exc)
        return _json(body)
