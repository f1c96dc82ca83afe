"""What the hypercorn send-path tests share: a socket pair with small buffers (a
partial write, a full socket), a server's h11 connection at a chosen point of its
request, and an exact read that fails rather than hangs."""

from __future__ import annotations

import socket

import h11
import trio


def small_socket_pair() -> tuple[socket.socket, socket.socket]:
    """(ours, theirs): 4 KiB buffers; ``theirs`` non-blocking."""
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    theirs.setblocking(False)
    return ours, theirs


def server_h11(*, read: bool, close: bool = False) -> h11.Connection:
    """A server's h11 connection that has read a whole request (``read``; ``close``:
    one that said ``Connection: close``) or only the head of one whose body is still
    arriving."""
    connection = h11.Connection(h11.SERVER)
    if read:
        said = b"Connection: close\r\n" if close else b""
        connection.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n" + said + b"\r\n")
    else:
        connection.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    while connection.next_event() not in (h11.NEED_DATA, h11.PAUSED):
        pass
    return connection


async def read_exactly(theirs: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``theirs`` (bytes lost: the test fails within 30 s, no hang)."""
    out = bytearray()
    with trio.fail_after(30):
        while len(out) < n:
            await trio.lowlevel.wait_readable(theirs)
            out += theirs.recv(65536)
    return bytes(out)
