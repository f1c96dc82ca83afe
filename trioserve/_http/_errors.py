"""How every error response is rendered: status, headers and the OpenAI-style body."""

from __future__ import annotations

import math
from collections.abc import Callable

from .._core._exceptions import TrioserveError
from .._wire import encode_json
from .._wire._anthropic import anthropic_error

__all__ = ["JSON_HEADERS", "ErrorRenderer", "render_anthropic_error", "render_error"]

#: ``(status, headers, body)`` for an error
ErrorRenderer = Callable[[TrioserveError], tuple[int, list[tuple[bytes, bytes]], bytes]]

JSON_HEADERS = [(b"content-type", b"application/json")]


def _headers(exc: TrioserveError) -> list[tuple[bytes, bytes]]:
    headers = list(JSON_HEADERS)
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(math.ceil(exc.retry_after)).encode()))
    if exc.should_retry is not None:
        headers.append((b"x-should-retry", b"true" if exc.should_retry else b"false"))
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers


def render_error(exc: TrioserveError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``(status, headers, body)`` for ``exc``, OpenAI's error body: ``Retry-After`` when
    it says when to retry, ``x-should-retry`` when it knows whether a retry can succeed,
    ``WWW-Authenticate`` for a missing or wrong API key."""
    return exc.status, _headers(exc), encode_json(exc.to_dict())


def render_anthropic_error(exc: TrioserveError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The same for the Anthropic Messages endpoints: Anthropic's error body
    (``{"type": "error", "error": {"type", "message"}}``); a full queue is 529."""
    status, body = anthropic_error(exc)
    return status, _headers(exc), encode_json(body)
