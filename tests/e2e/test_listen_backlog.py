"""The listening socket's backlog (``--backlog``, default 2048): hypercorn's own default,
100, made the 101st connection of a burst wait for the client's SYN retransmit — a
second — before trioserve saw it (docs/benchmarks.md, "A second for the 101st
connection")."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import trio

from trioserve import ScriptedBackend

from .._helpers import start_server


def _listen_backlog(port: int) -> int:
    """The backlog the kernel keeps for the socket listening on ``port`` (``ss``: a
    listening socket's Send-Q is its backlog)."""
    ss = shutil.which("ss")
    assert ss is not None, "ss (iproute2) is needed: scripts/test installs it"
    out = subprocess.run(
        [ss, "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[2])  # State Recv-Q Send-Q Local Peer


def _somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


@pytest.mark.parametrize("backlog", [None, 300])
async def test_the_listening_socket_queues_the_backlog_asked_for(backlog: int | None) -> None:
    settings = {} if backlog is None else {"backlog": backlog}
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, ScriptedBackend(), close_backend=True, **settings)
        port = int(server.url.rsplit(":", 1)[1])
        assert _listen_backlog(port) == min(backlog or 2048, _somaxconn())
        server.server.shutdown()


async def test_a_burst_of_400_connections_is_accepted_without_a_syn_retransmit() -> None:
    # 400 connections opened at once (fewer where the kernel caps every backlog lower:
    # net.core.somaxconn, 4096 since Linux 5.4): each is established by the kernel's
    # handshake; past the backlog the kernel drops the SYN and the client sends it again a
    # second later. Every one established well under that second.
    burst = min(400, _somaxconn() - 8)
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, ScriptedBackend(), close_backend=True)
        port = int(server.url.rsplit(":", 1)[1])
        times: list[float] = []
        streams: list[trio.SocketStream] = []

        async def connect() -> None:
            start = trio.current_time()
            streams.append(await trio.open_tcp_stream("127.0.0.1", port))
            times.append(trio.current_time() - start)

        async with trio.open_nursery() as nursery_burst:
            for _ in range(burst):
                nursery_burst.start_soon(connect)
        for stream in streams:
            await stream.aclose()
        assert len(times) == burst
        assert max(times) < 0.9, sorted(times)[-5:]
        server.server.shutdown()
