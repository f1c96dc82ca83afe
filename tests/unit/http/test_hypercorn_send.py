"""hypercorn's send, patched (``_hypercorn_patches.patch_hypercorn_send``): once the
request was read in full, bytes the kernel takes at once are written at once; a partial
write, a full socket (the back-pressure), a closed peer, a request still arriving and
any stream but plain TCP go hypercorn's way — the bytes whole and in order, the errors
what hypercorn makes of them."""

from __future__ import annotations

import socket
import types
from typing import Any

import pytest
import trio
import trio.testing
from hypercorn.events import Closed, RawData
from hypercorn.trio.tcp_server import TCPServer

from trioserve._http._hypercorn_patches import patch_hypercorn_send, request_read

from ._wire_doubles import read_exactly, server_h11, small_socket_pair


class _Protocol:
    """hypercorn's ``ProtocolWrapper``: what it is told, and its HTTP/1.1 protocol's h11
    connection."""

    def __init__(self, *, read: bool = True, close: bool = False) -> None:
        self.events: list[object] = []
        self.protocol = types.SimpleNamespace(connection=server_h11(read=read, close=close))

    async def handle(self, event: object) -> None:
        self.events.append(event)


class _Connection:
    """What ``TCPServer.protocol_send`` reads of its connection: the stream, the lock,
    the protocol."""

    def __init__(self, stream: Any, *, read: bool = True, close: bool = False) -> None:
        self.stream = stream
        self.send_lock = trio.Lock()
        self.protocol = _Protocol(read=read, close=close)


def _pair() -> tuple[trio.SocketStream, socket.socket]:
    ours, theirs = small_socket_pair()
    return trio.SocketStream(trio.socket.from_stdlib_socket(ours)), theirs


async def _send(connection: _Connection, data: bytes) -> None:
    await TCPServer.protocol_send(connection, RawData(data=data))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _patched() -> None:
    assert patch_hypercorn_send()
    assert getattr(TCPServer.protocol_send, "_trioserve_patched", False)


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
async def test_bytes_the_kernel_takes_are_written_at_once_without_the_lock(close: bool) -> None:
    stream, theirs = _pair()
    connection = _Connection(stream, close=close)
    assert request_read(connection)
    taken: list[bool] = []
    real = connection.send_lock

    class _Watched:
        def locked(self) -> bool:
            return real.locked()

        async def __aenter__(self) -> None:
            taken.append(True)
            await real.acquire()

        async def __aexit__(self, *exc: object) -> None:
            real.release()

    connection.send_lock = _Watched()  # type: ignore[assignment]
    await _send(connection, b"data: one\n\n")
    assert theirs.recv(100) == b"data: one\n\n"
    assert taken == []  # (hypercorn's own way takes the lock for every event)
    theirs.close()
    await stream.aclose()


async def test_a_response_to_a_request_still_arriving_goes_hypercorns_way_under_the_lock() -> None:
    # (written at once, a 401 could beat the reading of the request's body, and hypercorn
    # would close a connection the client is about to reuse)
    stream, theirs = _pair()
    connection = _Connection(stream, read=False)
    assert not request_read(connection)
    taken: list[bool] = []
    acquire = connection.send_lock.acquire

    async def watched() -> None:
        taken.append(True)
        await acquire()

    connection.send_lock.acquire = watched  # type: ignore[method-assign]
    await _send(connection, b"HTTP/1.1 401 Unauthorized\r\n\r\n")
    assert theirs.recv(100) == b"HTTP/1.1 401 Unauthorized\r\n\r\n"
    assert taken == [True]
    theirs.close()
    await stream.aclose()


async def test_a_full_socket_waits_for_the_reader_and_every_byte_arrives_in_order() -> None:
    stream, theirs = _pair()
    connection = _Connection(stream)
    filler = b"f" * 1024
    sent_before = 0
    raw = stream.socket._sock  # type: ignore[attr-defined]
    while True:  # fill the kernel's buffers: the next send cannot go at once
        try:
            sent_before += raw.send(filler)
        except BlockingIOError:
            break
    payload = bytes(range(256)) * 64  # 16 KiB, more than the buffers hold
    done = trio.Event()

    async def send() -> None:
        await _send(connection, payload)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()  # waiting for room: the back-pressure holds
        assert connection.send_lock.locked()  # hypercorn's way, under its lock
        received = await read_exactly(theirs, sent_before + len(payload))
    assert done.is_set()
    assert received == b"f" * sent_before + payload
    assert connection.protocol.events == []
    theirs.close()
    await stream.aclose()


async def test_a_partial_write_sends_the_rest_in_order() -> None:
    stream, theirs = _pair()
    connection = _Connection(stream)
    payload = bytes(range(251)) * 400  # ~100 KiB: the kernel takes a part at once
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_send, connection, payload)
        received = await read_exactly(theirs, len(payload))
    assert received == payload
    assert not connection.send_lock.locked()
    theirs.close()
    await stream.aclose()


async def test_a_closed_peer_is_told_to_the_protocol_as_hypercorn_tells_it() -> None:
    stream, theirs = _pair()
    connection = _Connection(stream)
    theirs.close()
    await _send(connection, b"data: lost\n\n")
    assert [type(e) for e in connection.protocol.events] == [Closed]
    await stream.aclose()


async def test_another_kind_of_stream_goes_hypercorns_way() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    connection = _Connection(ours)
    await _send(connection, b"data: tls-like\n\n")
    assert await theirs.receive_some() == b"data: tls-like\n\n"
