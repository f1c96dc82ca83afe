"""Issue 53: what one event costs to cross from a worker thread to the Trio loop, with no
server around it. N streams, each a worker thread that makes EVENTS events one per
INTERVAL s; process CPU (user + system, all threads) per event, for:

- ``timer``: no thread, a Trio task sleeps the interval (what the floor does);
- ``sleep``: the threads only sleep (a thread's own wake);
- ``soon``: each event wakes the loop with ``TrioToken.run_sync_soon`` (trivial callback);
- ``fd``: each event wakes a task parked on an eventfd of its stream;
- ``channel``: trioserve's bridge, ``PieceChannel`` (``wait_aborted`` + ``put_wait``,
  the consumer in ``receive_batch``): what the scripted backend's producers do.

    python scripts/probes/thread_wake.py [N ...]   (default 16 64 256)
"""

import os
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trioserve._core._channel import PieceChannel

EVENTS, INTERVAL = 300, 0.02


def cpu() -> float:
    t = os.times()
    return t.user + t.system


async def stream(mode: str, limiter: trio.CapacityLimiter) -> None:
    if mode == "timer":
        for _ in range(EVENTS):
            await trio.sleep(INTERVAL)
    elif mode in ("sleep", "soon"):
        token = trio.lowlevel.current_trio_token()

        def produce() -> None:
            for _ in range(EVENTS):
                time.sleep(INTERVAL)
                if mode == "soon":
                    token.run_sync_soon(lambda: None)

        await trio.to_thread.run_sync(produce, limiter=limiter)
    elif mode == "fd":
        fd = os.eventfd(0, os.EFD_NONBLOCK)

        def produce() -> None:
            for _ in range(EVENTS):
                time.sleep(INTERVAL)
                os.eventfd_write(fd, 1)

        async def consume() -> None:
            got = 0
            while got < EVENTS:
                await trio.lowlevel.wait_readable(fd)
                got += os.eventfd_read(fd)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.to_thread.run_sync(produce, limiter=limiter)
        os.close(fd)
    else:
        channel = PieceChannel(8)

        def produce() -> None:
            for _ in range(EVENTS):
                channel.wait_aborted(INTERVAL)
                channel.put_wait(b"x")

        async def run() -> None:
            await trio.to_thread.run_sync(produce, limiter=limiter)
            channel.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while True:
                try:
                    await channel.receive_batch()
                except trio.EndOfChannel:
                    break


async def main(n: int, mode: str) -> float:
    limiter = trio.CapacityLimiter(n)
    start = cpu()
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(stream, mode, limiter)
    return (cpu() - start) / (n * EVENTS) * 1e6


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [16, 64, 256]
    modes = ("timer", "sleep", "soon", "fd", "channel")
    print("streams | " + " | ".join(f"{m} µs/event" for m in modes))
    for n in sizes:
        print(f"{n} | " + " | ".join(f"{trio.run(main, n, mode):.1f}" for mode in modes), flush=True)
