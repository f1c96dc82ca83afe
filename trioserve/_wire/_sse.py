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
    "number_events",
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


_PING_EVENT = b"event: ping\n"


def _is_comment(block: bytes) -> bool:
    return block[0] == 0x3A and all(line.startswith(b":") for line in block.split(b"\n"))  # ":"


def number_events(
    data: bytes, next_id: int, *, retry_ms: int | None = None
) -> list[tuple[int | None, bytes]]:
    """Split ``data`` into its blocks and give each event an ``id:`` field.

    ``data`` is whole blocks as trioserve's writers make them: each ends with a blank
    line (a ``ValueError`` if the last does not) and no data line holds a raw newline
    (a blank line inside an event would split it in two). Every event block becomes
    ``(K, b"id: K\\n" + block)``, ``K`` counting from ``next_id``; with ``retry_ms``, the
    first one also carries ``retry: <ms>`` — a field of that event, never a block of its
    own (the openai SDK's decoder takes a ``retry:``-only block for an event with empty
    data and fails on it).

    No id for a keep-alive: Anthropic's ``event: ping`` is ``(None, block)`` as it is;
    a block of comments (the heartbeat ``: ping``) is ``(None, block)`` before the
    stream's first id, and loses its blank line after it (``(None, b": ping\\n")``, a
    comment line the next event's block begins with): the openai and anthropic SDKs'
    decoders keep the last id across blocks, as the SSE standard says, but then
    dispatch an event with empty data at a blank line that ends no field, which the
    openai SDK fails to parse as JSON. Empty blocks (stray blank lines) are dropped. One
    ``split`` per call: this runs per token.
    """
    blocks = data.split(b"\n\n")
    if blocks.pop():
        raise ValueError("SSE data must end with a blank line")
    out: list[tuple[int | None, bytes]] = []
    for block in blocks:
        if not block:
            continue
        if block.startswith(_PING_EVENT):
            out.append((None, block + b"\n\n"))
        elif _is_comment(block):
            out.append((None, block + (b"\n" if next_id else b"\n\n")))
        elif retry_ms is not None:
            out.append((next_id, b"id: %d\nretry: %d\n%b\n\n" % (next_id, retry_ms, block)))
            retry_ms = None
            next_id += 1
        else:
            out.append((next_id, b"id: %d\n%b\n\n" % (next_id, block)))
            next_id += 1
    return out


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
