"""Server-sent events, sans-IO: the encoder turns payloads into the exact bytes on the
wire; the decoder turns bytes split at arbitrary points back into events (multi-line
``data:`` joined with ``\\n``, ``:`` comments such as the heartbeat, any of ``\\r\\n``,
``\\n``, ``\\r`` line ends). Neither touches a socket. The stream's format:
``docs/api.md``, "Streaming format".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DONE",
    "HEARTBEAT",
    "SSEDecoder",
    "ServerSentEvent",
    "encode_comment",
    "encode_data",
    "encode_event",
]

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def _split_lines(value: bytes) -> list[bytes]:
    return _LINE_BREAK.split(value)


def encode_data(payload: bytes) -> bytes:
    """Encode one ``data``-only event.

    The hot path: OpenAI chunks are compact JSON, which never holds a raw newline,
    so the common case is a single concatenation.
    """
    if b"\n" not in payload and b"\r" not in payload:
        return b"data: " + payload + b"\n\n"
    return b"".join(b"data: " + line + b"\n" for line in _split_lines(payload)) + b"\n"


def encode_event(
    data: bytes, *, event: str | None = None, id: str | None = None, retry: int | None = None
) -> bytes:
    """Encode an event with optional ``event``, ``id`` and ``retry`` fields.

    Newlines are stripped from ``event`` and ``id``: a newline there would end the field
    early and let the value inject fields of its own.
    """
    out = bytearray()
    if id is not None:
        out += b"id: " + _strip_newlines(id) + b"\n"
    if event is not None:
        out += b"event: " + _strip_newlines(event) + b"\n"
    if retry is not None:
        out += b"retry: %d\n" % retry
    for line in _split_lines(data):
        out += b"data: " + line + b"\n"
    out += b"\n"
    return bytes(out)


def encode_comment(text: str = "") -> bytes:
    """Encode a comment (ignored by clients; keeps proxies from timing out)."""
    lines = _split_lines(text.encode())
    return b"".join(b": " + line + b"\n" if line else b":\n" for line in lines) + b"\n"


def _strip_newlines(value: str) -> bytes:
    return value.replace("\r", "").replace("\n", "").encode()


#: The sentinel event OpenAI-compatible streams end with.
DONE = encode_data(b"[DONE]")
#: A heartbeat: a comment line clients ignore.
HEARTBEAT = encode_comment("ping")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSentEvent:
    """One decoded event. ``data`` joins multi-line data with ``\\n``."""

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Incremental SSE decoder: feed bytes in any split, get whole events out.

    Comments are dropped; ``comments`` counts them (tests use it to see heartbeats).
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._pending_cr = False
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self.comments = 0

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Feed bytes; return the events they complete, in order."""
        if self._pending_cr and chunk.startswith(b"\n"):
            # the "\n" of a "\r\n" that was split across two chunks
            chunk = chunk[1:]
        self._pending_cr = False
        data = self._buffer + chunk
        lines = _LINE_BREAK.split(data)
        self._buffer = lines.pop()
        if data.endswith(b"\r") and not self._buffer:
            self._pending_cr = True
        events: list[ServerSentEvent] = []
        for line in lines:
            event = self._line(line.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            self.comments += 1
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        elif field == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._data:
            self._event = ""
            return None
        event = ServerSentEvent(
            data="\n".join(self._data),
            event=self._event or "message",
            id=self._id,
            retry=self._retry,
        )
        self._data = []
        self._event = ""
        self._retry = None
        return event
