"""Three changes to hypercorn, applied when trioserve serves: the corrected resume rule
of its HTTP/2 ``StreamBuffer.pop`` (so a stream that a client does not read stays
bounded at 32 KiB), a registry of connection sockets that the stall timer shuts
down (:func:`shut_down_connection`), and a send that writes at once when it can
(:func:`patch_hypercorn_send`). Each patch checks that the class still looks as
expected and leaves it alone otherwise. The bug and its measurement:
``docs/operations.md``, "Flow control"; the send: docs/benchmarks.md, "The send path".
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import trio

__all__ = [
    "patch_hypercorn_connection_registry",
    "patch_hypercorn_h2_backpressure",
    "patch_hypercorn_send",
    "shut_down_connection",
    "streamed_body",
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


#: set while a streamed body part (``more_body``) of trioserve's own writers is sent
#: (``Exchange.body``: generation, follow, speech, heartbeats — each after its request
#: was read): the only sends :func:`patch_hypercorn_send` writes at once (quart's routes
#: send their one-shot bodies as ``more_body`` too, before reading a body they refuse)
streamed_body: ContextVar[bool] = ContextVar("trioserve_streamed_body", default=False)


def patch_hypercorn_send() -> bool:
    """hypercorn's trio worker sends each event's bytes under a lock, in a shielded
    scope, through ``SocketStream.send_all``: two trips through Trio's scheduler per
    streamed event even when the kernel takes the bytes at once. This writes a streamed
    body part of trioserve's writers (:data:`streamed_body`: by then the request was
    read) at once when the connection is plain TCP, no other send holds the lock and the
    kernel takes it all (a non-blocking ``send``); anything else — a response's head or end, a partial
    write, a full socket (``TCP_NOTSENT_LOWAT``: the back-pressure), an error, TLS,
    HTTP/2 — goes the way it went, under the lock. (A head or an end written at once
    could beat the reading of a request body still arriving — a 401 before the body — and
    hypercorn would then close a connection the client is about to reuse: measured with
    httpx, which then fails its next request.) The bytes, their order and the errors are
    hypercorn's; the caller still checkpoints (the consumer's next receive). Wraps
    ``TCPServer.protocol_send`` and nothing else."""
    from hypercorn.events import Closed, RawData

    def wrap(original: Any) -> Any:
        async def protocol_send(self: Any, event: Any) -> None:
            stream = self.stream
            lock = self.send_lock
            if (
                type(event) is RawData
                and type(stream) is trio.SocketStream
                and not lock.locked()
                and streamed_body.get()
            ):
                data = event.data
                raw = getattr(stream.socket, "_sock", None)  # (trio's stdlib socket; if it goes: off)
                try:
                    sent = raw.send(data) if raw is not None else 0
                except OSError:  # (BlockingIOError: full; other errors: the usual path says them)
                    sent = 0
                if sent == len(data):
                    return
                if sent:
                    # the rest as hypercorn sends, under the lock (free: nothing ran since
                    # the check), taken without a cancel point: a cancel now would leave
                    # the event half written
                    lock.acquire_nowait()
                    try:
                        try:
                            with trio.CancelScope(shield=True):
                                await stream.send_all(data[sent:])
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            await self.protocol.handle(Closed())
                    finally:
                        lock.release()
                    return
            await original(self, event)

        return protocol_send

    return _wrap_tcp_server("protocol_send", wrap, "its send path is left as it is")


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
