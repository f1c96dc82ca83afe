"""How every error response is rendered: status, headers and the OpenAI-style body."""

from __future__ import annotations

import math

from .._core._exceptions import TrioserveError
from .._wire._openai import encode_json

__all__ = ["JSON_HEADERS", "render_error"]

JSON_HEADERS = [(b"content-type", b"application/json")]


def render_error(exc: TrioserveError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``(status, headers, body)`` for ``exc``: ``Retry-After`` when it says when to
    retry, ``x-should-retry`` when it knows whether a retry can succeed,
    ``WWW-Authenticate`` for a missing or wrong API key."""
    headers = list(JSON_HEADERS)
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(math.ceil(exc.retry_after)).encode()))
    if exc.should_retry is not None:
        headers.append((b"x-should-retry", b"true" if exc.should_retry else b"false"))
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return exc.status, headers, encode_json(exc.to_dict())
