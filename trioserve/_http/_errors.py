"""How every error response is rendered: status, headers and the body of the route's
dialect (its :class:`~trioserve._wire.DialectSpec` says which)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from .._core._exceptions import TrioserveError
from .._wire import OLLAMA, OPENAI, SPECS, DialectSpec, ErrorBody, encode_json, spec_for_path

__all__ = [
    "JSON_HEADERS",
    "ErrorRenderer",
    "render_error",
    "render_for_path",
    "render_ollama",
    "renderer",
]

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
    headers.extend(exc.headers)
    return headers


def _render(error_body: ErrorBody, exc: TrioserveError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, body = error_body(exc)
    return status, _headers(exc), encode_json(body)


def renderer(spec: DialectSpec) -> ErrorRenderer:
    """``(status, headers, body)`` for an error, in ``spec``'s dialect: its error body
    (OpenAI's; Anthropic's ``{"type": "error", "error": {"type", "message"}}``, where a
    full queue is 529), ``Retry-After`` when it says when to retry, ``x-should-retry``
    when it knows whether a retry can succeed, ``WWW-Authenticate`` for a missing or
    wrong API key."""
    return _RENDERERS[spec.kind]


def render_for_path(exc: TrioserveError, path: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``exc`` rendered in the dialect of the route at ``path`` (the routes outside the
    generation handler, and the ones that match no route): Ollama's under ``/api/``."""
    if path.startswith("/api/"):
        return render_ollama(exc)
    return renderer(spec_for_path(path))(exc)


_RENDERERS: dict[str, ErrorRenderer] = {
    spec.kind: functools.partial(_render, spec.error_body) for spec in (OPENAI, OLLAMA, *SPECS.values())
}
#: OpenAI's rendering: every route but the Anthropic ones
render_error = renderer(OPENAI)
#: Ollama's (``{"error": "…"}``): every route under ``/api/``
render_ollama: ErrorRenderer = _RENDERERS[OLLAMA.kind]
