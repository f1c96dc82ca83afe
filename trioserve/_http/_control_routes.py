"""Controls on a running request (docs/dialects.md, "Ending the reasoning"): end its model's
reasoning now, so that it answers — llama-server's ``POST /v1/chat/completions/control
{"id", "action": "reasoning_end"}`` (the id its chunks carry, or its ``X-Request-Id``)
and trioserve's ``POST /v1/requests/{id}/control {"action": "reasoning_end"}``. Both
answer in llama-server's shape (``{"success": …, "message"?: …}``, 200). Whose requests
a caller reaches: as cancel by id (``_requests_routes.py``) — its API key's own, an
admin key's anyone's; another key's are as if they did not exist."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

from quart import Response
from quart_trio import QuartTrio

from .._core._backend import ControlOutcome
from .._core._exceptions import TrioserveError
from .._wire import control_answer, decode_chat_control, decode_request_control, encode_json
from ._access import AccessPolicy, key_salt, presented_key
from ._exchange import Scope
from ._request import InFlightRequest, Phase
from ._route_io import error_response
from ._state import ServerState

__all__ = ["add_control_routes", "end_reasoning", "find_completion"]

logger = logging.getLogger("trioserve.server")

#: reads the request's JSON body with a decoder (``_route_io.json_body``)
ReadBody = Callable[[Callable[[bytes], Any]], Awaitable[Any]]


def completion_id(request: InFlightRequest) -> str | None:
    """The id the request's chunks or body carry (``chatcmpl-…``, ``cmpl-…``, ``msg_…``,
    ``resp_…``), once its dialect has picked it."""
    dialect = request.dialect
    if dialect is None:
        return None
    encoders = getattr(dialect, "encoders", None)  # OpenAI's: the first choice's encoder
    found = encoders[0].id if encoders else getattr(dialect, "id", None)
    return found if isinstance(found, str) else None


def find_completion(
    state: ServerState, given: str, owner: str, *, admin: bool = False
) -> list[InFlightRequest]:
    """The requests in flight a control's id names: by ``X-Request-Id``, else by the
    completion id their dialect picked — ``owner``'s, or anyone's for an admin key.
    (A scan of the requests in flight, bounded by the slots and queue places.)"""
    found = state.find_requests(given, owner, admin=admin)
    if found:
        return found
    return [
        request
        for request in state.requests
        if (admin or request.owner == owner) and completion_id(request) == given
    ]


def end_reasoning(request: InFlightRequest) -> list[ControlOutcome]:
    """Ask each running choice of ``request`` to end its reasoning; a request whose
    streams are not open yet (its body, its model's load, its queue) is asked as they
    open (``InFlightRequest.choices``), and that ask is a success."""
    if request.phase >= Phase.FINISHING:
        return ["finished"]
    choices = request.choices
    if not choices:
        request.reasoning_end_asked = True
        return ["forced"]
    return [
        events.end_reasoning() for index, events in enumerate(choices) if index not in request.ended_choices
    ] or ["finished"]


def add_control_routes(
    app: QuartTrio, state: ServerState, access: AccessPolicy | None, read_body: ReadBody
) -> None:
    """Add ``POST /v1/chat/completions/control`` and ``POST /v1/requests/{id}/control``
    to ``app`` (``read_body``: how a route reads its JSON body)."""

    def caller() -> tuple[str, bool]:
        from quart import request

        scope = cast("Scope", request.scope)
        key = presented_key(scope)
        admin = access is not None and key is not None and access.key_is_admin(key)
        return key_salt(scope, access), admin

    def control(given: str) -> Response:
        owner, admin = caller()
        found = find_completion(state, given, owner, admin=admin)
        outcomes = [outcome for request in found for outcome in end_reasoning(request)]
        answer = control_answer(outcomes)
        if found:
            first = found[0]
            whose = first.account.name if first.account is not None else None
            by = "an admin key" if any(r.owner != owner for r in found) else "its own key"
            logger.info(
                "request %s of key %r: reasoning_end by %s: %s",
                first.exchange.request_id,
                whose,
                by,
                "forced" if answer["success"] else answer["message"],
            )
        return Response(encode_json(answer), content_type="application/json")

    @app.post("/v1/chat/completions/control")
    async def chat_control() -> Response:
        try:
            return control(await read_body(decode_chat_control))
        except TrioserveError as exc:
            return error_response(exc)

    @app.post("/v1/requests/<request_id>/control")
    async def request_control(request_id: str) -> Response:
        try:
            await read_body(decode_request_control)
            return control(request_id)
        except TrioserveError as exc:
            return error_response(exc)
