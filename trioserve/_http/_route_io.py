"""The quart routes' reading and answering: a request's body (its limit, its timeout, its
Content-Type; a large one decoded off the event loop), a JSON answer, an error answered
in a route's dialect."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import trio
from quart import Response

from .._core._exceptions import TrioserveError
from .._wire import encode_json
from ._errors import ErrorRenderer, render_error
from ._exchange import Scope, _check_content_type, body_timeout_error
from ._lifecycle import INLINE_PARSE_BYTES, off_the_loop_if

__all__ = ["body_bytes", "error_response", "json_body", "json_response"]


def json_response(
    body: dict[str, object], status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(encode_json(body), status=status, content_type="application/json", headers=headers)


def error_response(exc: TrioserveError, render: ErrorRenderer = render_error) -> Response:
    status, headers, body = render(exc)
    return Response(body, status=status, headers={k.decode(): v.decode() for k, v in headers})


async def body_bytes() -> bytes:
    """The request's body. The body limit is quart's ``MAX_CONTENT_LENGTH`` (413); a
    Content-Type other than JSON is 415; a body not all there within
    ``--body-timeout`` seconds (the app's ``TRIOSERVE_BODY_TIMEOUT``) is 408
    ``request_timeout``."""
    from quart import current_app, request

    _check_content_type(cast("Scope", request.scope))
    timeout: float | None = current_app.config["TRIOSERVE_BODY_TIMEOUT"]
    with trio.move_on_after(math.inf if timeout is None else timeout):
        body = await request.get_data(as_text=False)
        assert isinstance(body, bytes)
        return body
    assert timeout is not None
    raise body_timeout_error(timeout)


async def json_body[T](decode: Callable[[bytes], T]) -> T:
    """The request's body (:func:`body_bytes`), decoded by ``decode`` (bodies over
    64 KiB: in a worker thread, as the generation endpoints do)."""
    body = await body_bytes()
    return await off_the_loop_if(len(body) > INLINE_PARSE_BYTES, decode, body)
