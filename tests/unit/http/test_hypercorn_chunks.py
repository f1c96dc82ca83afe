"""hypercorn's ASGI send, patched (``_hypercorn_patches.patch_hypercorn_chunks``): a
streamed part of an HTTP/1.1 chunked response whose request was read goes straight to
the socket, framed as h11 frames it; a request whose body is still arriving, another
send holding the connection's lock, a ``content-length`` body go hypercorn's way; a
partial write sends the rest under the lock, every byte in order. hypercorn's own
objects (``HTTPStream``, ``H11Protocol``, ``TCPServer``) around a real h11 connection
and a socket pair."""

from __future__ import annotations

import socket
from typing import Any

import h11
import pytest
import trio
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio.tcp_server import TCPServer

from trioserve._http import _hypercorn_patches
from trioserve._http._hypercorn_patches import patch_hypercorn_chunks, patch_hypercorn_send, write_chunk

from ._wire_doubles import read_exactly, server_h11, small_socket_pair


class _Wrapper:
    """hypercorn's ``ProtocolWrapper``: what the connection tells it."""

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        self.events: list[object] = []

    async def handle(self, event: object) -> None:
        self.events.append(event)


_OPEN: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _closed() -> Any:
    yield
    while _OPEN:
        _OPEN.pop().close()


def _stream(*, read: bool = True, length: int | None = None) -> tuple[Any, Any, socket.socket]:
    """An ``HTTPStream`` whose response started (chunked, or ``length`` bytes long),
    its ``TCPServer``, and the client's end of the socket (both ends closed after the
    test)."""
    ours, theirs = small_socket_pair()
    _OPEN.extend((ours, theirs))
    connection = server_h11(read=read)
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    connection.send(h11.Response(status_code=200, headers=headers))  # (the head: sent)
    server: Any = object.__new__(TCPServer)
    server.stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    server.send_lock = trio.Lock()
    protocol: Any = object.__new__(H11Protocol)
    protocol.connection = connection
    protocol.send = server.protocol_send
    server.protocol = _Wrapper(protocol)
    http: Any = object.__new__(HTTPStream)
    http.send = protocol.stream_send
    http.closed = False
    http.state = ASGIHTTPState.RESPONSE
    http.scope, http.response, http.stream_id = {"method": "GET"}, {"status": 200}, 1
    return http, server, theirs


@pytest.fixture
def chunks(monkeypatch: pytest.MonkeyPatch) -> list[bytes | None]:
    """Every ``write_chunk`` of the patched send: what the kernel did not take (``None``:
    declined)."""
    assert patch_hypercorn_send()
    assert patch_hypercorn_chunks()
    seen: list[bytes | None] = []

    def spy(http: Any, data: bytes) -> tuple[Any, bytes] | None:
        result = write_chunk(http, data)
        seen.append(None if result is None else result[1])
        return result

    monkeypatch.setattr(_hypercorn_patches, "write_chunk", spy)
    return seen


def _part(data: bytes, *, more: bool = True) -> dict[str, object]:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def test_a_streamed_part_goes_straight_to_the_socket_as_h11_frames_it(
    chunks: list[bytes | None],
) -> None:
    http, server, theirs = _stream()
    await HTTPStream.app_send(http, _part(b"data: one\n\n"))
    framed = b"b\r\ndata: one\n\n\r\n"  # (what h11's chunked writer writes for it)
    assert await read_exactly(theirs, len(framed)) == framed
    assert chunks == [b""]
    assert not server.send_lock.locked()
    assert http.send.__self__.connection.our_state is h11.SEND_BODY  # (h11 where its own path leaves it)


async def test_a_request_still_arriving_goes_hypercorns_way(chunks: list[bytes | None]) -> None:
    http, _, theirs = _stream(read=False)
    await HTTPStream.app_send(http, _part(b"data: one\n\n"))
    assert await read_exactly(theirs, 16) == b"b\r\ndata: one\n\n\r\n"
    assert chunks == [None]


async def test_another_send_holding_the_lock_or_a_content_length_body_is_declined(
    chunks: list[bytes | None],
) -> None:
    http, server, _ = _stream()
    server.send_lock.acquire_nowait()
    assert write_chunk(http, b"data: one\n\n") is None
    server.send_lock.release()
    http, _, theirs = _stream(length=11)
    await HTTPStream.app_send(http, _part(b"data: one\n\n"))
    assert await read_exactly(theirs, 11) == b"data: one\n\n"  # (no chunk framing: h11's length writer)
    assert chunks == [None]


async def test_a_partial_write_sends_the_rest_under_the_lock_in_order(chunks: list[bytes | None]) -> None:
    http, server, theirs = _stream()
    payload = bytes(range(251)) * 400  # ~100 KiB: more than the socket's buffers take at once
    framed = b"%x\r\n%b\r\n" % (len(payload), payload)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(HTTPStream.app_send, http, _part(payload))
        received = await read_exactly(theirs, len(framed))
    assert received == framed
    assert len(chunks) == 1
    assert chunks[0]  # (partly written: the rest went under the lock)
    assert not server.send_lock.locked()
