"""One ASGI HTTP exchange, and the request-side helpers: body (and its read timeout),
headers, timeout."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
import trio

from .._core._exceptions import (
    InvalidRequestError,
    PayloadTooLargeError,
    TrioserveError,
    UnsupportedMediaTypeError,
)
from .._wire import decode
from ._errors import JSON_HEADERS, ErrorRenderer, render_error
from ._settings import HTTPSettings

__all__ = ["BodyTimeoutError", "Exchange", "Message", "Receive", "Scope", "Send"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Exchange:
    """The response side of one ASGI HTTP exchange: knows whether headers went out."""

    __slots__ = (
        "ended",
        "extra_headers",
        "last_sent",
        "render",
        "request_id",
        "send",
        "sending_since",
        "started",
        "status",
        "unsent",
    )

    def __init__(self, send: Send, request_id: str, render: ErrorRenderer = render_error) -> None:
        self.send = send
        self.request_id = request_id
        #: how an error response is rendered (OpenAI's body; Anthropic's on its endpoints)
        self.render = render
        self.started = False
        #: headers every response of this exchange carries (a key's ``x-ratelimit-*``)
        self.extra_headers: list[tuple[bytes, bytes]] = []
        #: the last body message (``more_body`` false) went out
        self.ended = False
        self.status = 0
        #: when the send in progress began (``None``: not sending): what the stall
        #: timer watches
        self.sending_since: float | None = None
        #: when the last body bytes went out (for heartbeats)
        self.last_sent = 0.0
        #: the body bytes of a send that a cancel stopped before they went out (the
        #: writer's state already counts them): whatever ends the response sends them
        #: first (:meth:`take_unsent`)
        self.unsent = b""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        self.last_sent = time.perf_counter()
        # Shielded: the headers are a few hundred bytes on a fresh connection (nothing
        # to wait for), and a cancel between hypercorn's protocol state and the socket
        # would leave a response that has neither started nor not.
        with trio.CancelScope(shield=True):
            await self.send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [*headers, *self.extra_headers, (b"x-request-id", self.request_id.encode())],
                }
            )

    async def body(self, data: bytes, *, more: bool = True, keep_unsent: bool = True) -> None:
        """Send body bytes (``keep_unsent``: if a cancel stops them, keep them for
        whatever ends the response; a heartbeat's are not)."""
        # A cancel already delivered: nothing of ``data`` goes out; keep it. (Past this
        # check nothing yields before hypercorn writes, shielded: a cancel that comes
        # later comes after the bytes were written, or while they were being.)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled:
            if keep_unsent:
                self.unsent = data
            raise
        self.sending_since = time.perf_counter()
        try:
            await self.send({"type": "http.response.body", "body": data, "more_body": more})
        finally:
            self.sending_since = None
        self.last_sent = time.perf_counter()
        if not more:
            self.ended = True

    def take_unsent(self) -> bytes:
        """The bytes a cancel kept from going out (see :attr:`unsent`), once."""
        unsent, self.unsent = self.unsent, b""
        return unsent

    async def json(self, status: int, body: bytes, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
        await self.start(status, [*JSON_HEADERS, *extra_headers])
        await self.body(body, more=False)

    async def error(self, exc: TrioserveError) -> None:
        status, headers, body = self.render(exc)
        await self.start(status, headers)
        await self.body(body, more=False)


class _ClientGone(Exception):
    """The client disconnected before the request body was complete."""


class BodyTimeoutError(TrioserveError):
    """The request's body did not arrive in full within ``--body-timeout`` (408): a
    client trickling its body holds a connection, never a request's place (the body is
    read before the request enters its scope or any queue)."""

    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


def body_timeout_error(timeout: float) -> BodyTimeoutError:
    return BodyTimeoutError(
        f"the request body did not arrive in full within {timeout:g} s (--body-timeout); send it at once"
    )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def _read_body(scope: Scope, receive: Receive, limit: int, body_timeout: float | None) -> bytes:
    """The whole body: 413 past ``limit`` bytes, 408 (:class:`BodyTimeoutError`) if it
    has not all arrived within ``body_timeout`` seconds (``None``: no limit), ``_ClientGone``
    if the client leaves first. Cancellation: nothing is kept."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"the request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(math.inf if body_timeout is None else body_timeout):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"the request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    assert body_timeout is not None  # (only the timeout leaves the loop without returning)
    raise body_timeout_error(body_timeout)


def headers_too_large(scope: Scope, limit: int) -> bool:
    return sum(len(name) + len(value) for name, value in scope["headers"]) > limit


def _check_content_type(scope: Scope) -> None:
    content_type = _header(scope, b"content-type")
    if content_type is None:
        return  # curl -d without -H: be lenient, the body is still parsed as JSON
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaTypeError(
            f"Content-Type must be application/json, got {media_type!r}; "
            "send the body as JSON with 'Content-Type: application/json'"
        )


def _request_timeout(scope: Scope, settings: HTTPSettings) -> float | None:
    raw = _header(scope, b"x-request-timeout")
    timeout = settings.default_timeout
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            raise InvalidRequestError(
                f"X-Request-Timeout must be a number of seconds, got {raw!r}", param="X-Request-Timeout"
            ) from None
        if not timeout > 0 or math.isinf(timeout):
            raise InvalidRequestError(
                f"X-Request-Timeout must be a positive, finite number of seconds, got {raw!r}",
                param="X-Request-Timeout",
            )
    if timeout is not None and settings.max_timeout is not None:
        timeout = min(timeout, settings.max_timeout)
    return timeout


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(raw: str) -> float:
    """Ollama's ``keep_alive``: seconds (``300``), a duration (``5m``, ``1h``, ``30s``),
    0 (unload once idle) or a negative number (keep loaded)."""
    text = raw.strip().lower()
    unit = 1.0
    for suffix in ("ms", "s", "m", "h"):
        if text.endswith(suffix):
            text, unit = text[: -len(suffix)], _DURATION_UNITS[suffix]
            break
    try:
        value = float(text) * unit
    except ValueError:
        raise InvalidRequestError(
            f"keep_alive must be seconds or a duration such as 5m, got {raw!r}", param="keep_alive"
        ) from None
    if math.isnan(value):
        raise InvalidRequestError(f"keep_alive must be a number, got {raw!r}", param="keep_alive")
    return math.inf if value < 0 else value


def _keep_alive(scope: Scope) -> float | None:
    """The request's ``X-Keep-Alive`` (docs/models.md), if it sent one."""
    raw = _header(scope, b"x-keep-alive")
    return None if raw is None else parse_keep_alive(raw)


class _HeadFields(msgspec.Struct):
    model: str | None = None
    priority: int | None = None


_peek_decoder = msgspec.json.Decoder(_HeadFields)


def _peek_head(body: bytes) -> _HeadFields:
    """The ``model`` a JSON body names (``None``: none) and its ``priority``: what is
    checked before any work (the model's existence, the key's bound on priorities). A
    body that is not a JSON object, or whose ``model`` is not a string or ``priority``
    not an integer, is refused here (400), before any model is loaded for it."""
    return decode(_peek_decoder, body)
