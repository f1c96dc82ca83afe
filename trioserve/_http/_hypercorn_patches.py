"""Four changes to hypercorn, applied when trioserve serves: the corrected resume rule
of its HTTP/2 ``StreamBuffer.pop`` (so a stream that a client does not read stays
bounded at 32 KiB), a registry of connection sockets that the stall timer shuts
down (:func:`shut_down_connection`), a send that writes at once when it can
(:func:`patch_hypercorn_send`), and a streamed chunk written from the ASGI send straight
to the socket (:func:`patch_hypercorn_chunks`). Each patch checks that the class still
looks as expected and leaves it alone otherwise. The bug and its measurement:
``docs/operations.md``, "Flow control"; the send: docs/benchmarks.md, "The send path".
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

import h11
import trio

__all__ = [
    "patch_hypercorn_chunks",
    "patch_hypercorn_connection_registry",
    "patch_hypercorn_h2_backpressure",
    "patch_hypercorn_send",
    "request_read",
    "shut_down_connection",
    "write_chunk",
]

logger = logging.getLogger("trioserve.server")


def patch_hypercorn_h2_backpressure() -> bool:
    """Apply the fix once; return whether it is in place."""
    try:
        from hypercorn.protocol import h2 as hypercorn_h2
    except ImportError:  # pragma: no cover
        return False
    buffer_class: Any = getattr(hypercorn_h2, "StreamBuffer", None)
    low_water = getattr(hypercorn_h2, "BUFFER_LOW_WATER", None)
    if buffer_class is None or low_water is None or not hasattr(buffer_class, "pop"):
        logger.warning("hypercorn's HTTP/2 StreamBuffer changed; its backpressure fix is not applied")
        return False
    if getattr(buffer_class.pop, "_trioserve_fixed", False):
        return True

    async def pop(self: Any, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < low_water:  # what has drained, not what was taken
            await self._paused.set()
        if len(self.buffer) == 0:
            await self._is_empty.set()
        return data

    pop._trioserve_fixed = True  # type: ignore[attr-defined]
    buffer_class.pop = pop
    return True


# ------------------------------------------------------------------ connections

#: open HTTP connections of hypercorn's trio worker, by (client, server) address as the
#: ASGI scope names them: what trioserve's stall timer shuts down
_CONNECTIONS: dict[tuple[object, object], socket.socket] = {}


def _wrap_tcp_server(name: str, wrap: Callable[[Any], Any], changed: str) -> bool:
    """Replace hypercorn's ``TCPServer.<name>`` with ``wrap(original)``, once; if the
    class no longer has it, leave it alone and log ``changed``."""
    try:
        from hypercorn.trio import tcp_server
    except ImportError:  # pragma: no cover
        return False
    server_class: Any = getattr(tcp_server, "TCPServer", None)
    if server_class is None or not hasattr(server_class, name):  # pragma: no cover
        logger.warning("hypercorn's TCPServer changed; %s", changed)
        return False
    original = getattr(server_class, name)
    if getattr(original, "_trioserve_patched", False):
        return True
    wrapped = wrap(original)
    wrapped._trioserve_patched = True
    setattr(server_class, name, wrapped)
    return True


def patch_hypercorn_connection_registry() -> bool:
    """Record each connection's socket while hypercorn serves it, so that the
    application can end a connection whose client stopped reading (the ASGI ``send``
    of hypercorn's trio worker is shielded: no cancel can interrupt it; shutting the
    socket down can). Wraps ``TCPServer.run`` and nothing else."""
    from hypercorn.utils import parse_socket_addr

    def wrap(original: Any) -> Any:
        async def run(self: Any) -> None:
            key = None
            stream = getattr(self.stream, "transport_stream", self.stream)  # under TLS
            sock = getattr(stream, "socket", None)
            if sock is not None:
                try:
                    key = (
                        parse_socket_addr(sock.family, sock.getpeername()),
                        parse_socket_addr(sock.family, sock.getsockname()),
                    )
                    _CONNECTIONS[key] = sock
                except OSError:  # already gone
                    key = None
            try:
                await original(self)
            finally:
                if key is not None:
                    _CONNECTIONS.pop(key, None)

        return run

    return _wrap_tcp_server("run", wrap, "stalled connections are left to the kernel")


def request_read(server: Any) -> bool:
    """Whether the request on ``server``'s connection (hypercorn's ``TCPServer``) was
    read in full (h11's client side ``DONE`` or after it): from then on a send written at
    once cannot beat the reading of a request body still arriving. (A 401 written at once
    before the body was read made hypercorn close a connection its client was about to
    reuse: measured with httpx, which then failed its next request.) ``False`` for
    anything but HTTP/1.x."""
    connection = getattr(getattr(server.protocol, "protocol", None), "connection", None)
    return type(connection) is h11.Connection and connection.their_state in _READ


#: h11's client-side states once its request was read in full (``MUST_CLOSE``: with
#: ``Connection: close``; ``CLOSED``: the client then shut its side)
_READ = frozenset((h11.DONE, h11.MUST_CLOSE, h11.CLOSED))


def patch_hypercorn_send() -> bool:
    """hypercorn's trio worker sends each event's bytes under a lock, in a shielded
    scope, through ``SocketStream.send_all``: two trips through Trio's scheduler per
    event even when the kernel takes the bytes at once. This writes them at once when
    the request was read in full (:func:`request_read`), the connection is plain TCP, no
    other send holds the lock and the kernel takes it all (a non-blocking ``send``); a
    partial write sends the rest under the lock (:func:`send_rest`); anything else — a
    request still arriving, a full socket (``TCP_NOTSENT_LOWAT``: the back-pressure), an
    error, TLS, HTTP/2 — goes the way it went, under the lock. The bytes, their order and
    the errors are hypercorn's; the caller still checkpoints (the consumer's next
    receive). Wraps ``TCPServer.protocol_send`` and nothing else."""
    from hypercorn.events import RawData

    def wrap(original: Any) -> Any:
        async def protocol_send(self: Any, event: Any) -> None:
            if type(event) is RawData and not self.send_lock.locked() and request_read(self):
                data = event.data
                sent = write_now(self, data)
                if sent == len(data):
                    return
                if sent:
                    await send_rest(self, data[sent:])
                    return
            await original(self, event)

        return protocol_send

    return _wrap_tcp_server("protocol_send", wrap, "its send path is left as it is")


def write_now(server: Any, data: bytes) -> int:
    """Write ``data`` to ``server``'s (hypercorn's ``TCPServer``) plain TCP socket with
    one non-blocking ``send``: how many bytes the kernel took (0: full, an error, or
    not plain TCP — the caller goes hypercorn's way, which says errors as it does)."""
    stream = server.stream
    raw = getattr(stream.socket, "_sock", None) if type(stream) is trio.SocketStream else None
    if raw is None:  # (trio's stdlib socket; if it goes: off)
        return 0
    try:
        return int(raw.send(data))
    except OSError:  # (BlockingIOError: full; other errors: the usual path says them)
        return 0


async def send_rest(server: Any, rest: bytes) -> None:
    """The rest of a partly written event, as hypercorn sends, under its send lock —
    free: the caller checked it and nothing ran since — taken without a cancel point (a
    cancel now would leave the event half written), shielded."""
    from hypercorn.events import Closed

    lock = server.send_lock
    lock.acquire_nowait()
    try:
        try:
            with trio.CancelScope(shield=True):
                await server.stream.send_all(rest)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await server.protocol.handle(Closed())
    finally:
        lock.release()


def write_chunk(http: Any, data: bytes) -> tuple[Any, bytes] | None:
    """Write ``data`` as one HTTP/1.1 chunk of ``http``'s (hypercorn's ``HTTPStream``)
    response straight to its socket, if it can go now: ``None`` if not (nothing
    written), else the connection (hypercorn's ``TCPServer``) and what the kernel did not
    take of the framed chunk (``b""``: all of it), which the caller sends next
    (:func:`send_rest`). It can when the stream is HTTP/1.1 over plain TCP, its request
    was read in full (:func:`request_read`), its response is under way and chunked
    (h11's chunked writer: an HTTP/1.0 client's body, a ``content-length`` one, a HEAD's
    go h11's way), no other send holds the connection's lock, and the kernel takes bytes
    at once. h11's state does not change for a chunk (its chunked writer keeps none), so
    skipping it leaves hypercorn and h11 where their own path would."""
    protocol: Any = getattr(http.send, "__self__", None)
    if type(protocol) is not _Kinds.protocol or not data or http.closed or http.state is not _Kinds.response:
        return None
    connection = protocol.connection
    server: Any = getattr(protocol.send, "__self__", None)
    if (
        connection.our_state is not h11.SEND_BODY
        or connection.their_state not in _READ
        or type(getattr(connection, "_writer", None)) is not _Kinds.chunked
        or type(server) is not _Kinds.server
        or type(server.stream) is not trio.SocketStream  # (TLS: no copy made for nothing)
        or server.send_lock.locked()
    ):
        return None
    framed = b"%x\r\n%b\r\n" % (len(data), data)
    sent = write_now(server, framed)
    return (server, framed[sent:]) if sent else None


class _Kinds:
    """What :func:`write_chunk` compares with, set by :func:`patch_hypercorn_chunks`."""

    protocol: Any = None  # hypercorn's H11Protocol
    response: Any = None  # the state of an HTTPStream whose response started
    chunked: Any = None  # h11's chunked body writer
    server: Any = None  # hypercorn's trio TCPServer


def patch_hypercorn_chunks() -> bool:
    """A streamed body part (``more_body``) goes from hypercorn's ``HTTPStream.app_send``
    straight to the socket as a chunk (:func:`write_chunk`), past
    ``H11Protocol.stream_send`` → h11 → ``TCPServer.protocol_send`` — half of what an
    event cost the event loop beside the ``send()`` itself (docs/benchmarks.md, "Chunks
    straight from the ASGI send"); whatever cannot go at once goes their way. The ASGI
    wrappers above ``app_send`` (a shield, CORS headers, a test's validator) still see
    every message. Wraps ``HTTPStream.app_send`` and nothing else; off if hypercorn's or
    h11's classes no longer look as expected."""
    try:
        from h11._writers import ChunkedWriter
        from hypercorn.protocol.h11 import H11Protocol
        from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:  # pragma: no cover
        logger.warning("hypercorn's or h11's classes changed; streamed chunks go their way")
        return False
    original = getattr(HTTPStream, "app_send", None)
    if original is None:  # pragma: no cover
        logger.warning("hypercorn's HTTPStream changed; streamed chunks go its way")
        return False
    if getattr(original, "_trioserve_patched", False):
        return True
    _Kinds.protocol, _Kinds.response = H11Protocol, ASGIHTTPState.RESPONSE
    _Kinds.chunked, _Kinds.server = ChunkedWriter, TCPServer

    async def app_send(self: Any, message: Any) -> None:
        if (
            message is not None
            and message["type"] == "http.response.body"
            and message.get("more_body", False)
        ):
            written = write_chunk(self, message.get("body", b""))
            if written is not None:
                server, rest = written
                if rest:
                    await send_rest(server, rest)
                return
        await original(self, message)

    app_send._trioserve_patched = True  # type: ignore[attr-defined]
    setattr(HTTPStream, "app_send", app_send)  # noqa: B010  (a method replaced)
    return True


def shut_down_connection(client: object, server: object) -> bool:
    """Shut down the connection of an ASGI scope's ``client``/``server``: its blocked
    send fails at once, hypercorn closes it and the application receives
    ``http.disconnect``. Returns whether the connection was found."""
    key = (
        tuple(client) if isinstance(client, list | tuple) else client,
        tuple(server) if isinstance(server, list | tuple) else server,
    )
    sock = _CONNECTIONS.get(key)
    if sock is None:
        return False
    try:
        # linger 0: the close that follows resets the connection (the client learns that
        # the response was cut, not that it ended), and unsent bytes are dropped
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    return True
