"""What the routes served at the ASGI level share (generation, embeddings and rerank,
speech): the checks of a request's head, and — for those outside the generation
pipeline's :class:`~trioserve._http._request_scope.RequestScope` — how a request that
failed ends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from .._core._exceptions import HeadersTooLargeError, MethodNotAllowedError, OverloadedError, TrioserveError
from ._exchange import Receive, Scope, _check_content_type, _ClientGone, _read_body, headers_too_large
from ._request import InFlightRequest, Phase
from ._settings import HTTPSettings

__all__ = ["errors_answered", "read_json_body", "refuse_large_headers", "refuse_unless_post"]


def refuse_large_headers(scope: Scope, limit: int) -> None:
    """Raise :class:`HeadersTooLargeError` (431) for headers past ``limit`` bytes
    (``--max-header-bytes``)."""
    if headers_too_large(scope, limit):
        raise HeadersTooLargeError(f"the request headers exceed the limit of {limit} bytes")


def refuse_unless_post(scope: Scope) -> None:
    """Raise :class:`MethodNotAllowedError` (405) for a method other than ``POST``."""
    if scope["method"] != "POST":
        raise MethodNotAllowedError(f"{scope['path']} accepts POST only, not {scope['method']}")


async def read_json_body(
    scope: Scope, receive: Receive, settings: HTTPSettings, limit: int | None = None
) -> bytes:
    """A JSON request's whole body: its content type checked (415), at most ``limit``
    bytes (``None``: ``--max-body-bytes``; 413 past it), all of it within
    ``--body-timeout`` (408)."""
    _check_content_type(scope)
    return await _read_body(
        scope, receive, settings.max_body_bytes if limit is None else limit, settings.body_timeout
    )


@contextlib.asynccontextmanager
async def errors_answered(request: InFlightRequest) -> AsyncIterator[None]:
    """Serve ``request`` in the block: a client gone ends it as a disconnect; an error
    ends it with its cause (one recorded already, else ``overloaded`` for a 429, else
    ``error``) and is answered while nothing has gone out. However it ends, the request
    is done."""
    try:
        yield
    except _ClientGone:
        request.end("disconnect")
    except TrioserveError as exc:
        request.end(
            request.cause or ("overloaded" if isinstance(exc, OverloadedError) else "error"), exc.message
        )
        if not request.exchange.started:
            await request.exchange.error(exc)
    finally:
        request.advance(Phase.DONE)
