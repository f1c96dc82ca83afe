"""PieceChannel, the one bridge between producers (a thread, a scheduler, a Trio task)
and a request's consumer: bounded, ordered, woken without polling, and torn down
cleanly from either end."""

from __future__ import annotations

import os
import threading

import pytest
import trio
import trio.testing

from trioserve import Aborted, PieceChannel

from ..._helpers import wait_for


async def test_a_thread_producer_is_bounded_and_every_piece_arrives_in_order() -> None:
    channel = PieceChannel(4)
    blocked = threading.Event()

    def produce() -> None:
        for i in range(100):
            if channel.room == 0:
                blocked.set()  # the next put_wait blocks: the consumer has not read yet
            channel.put_wait(str(i).encode())

    received: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, produce)
        await trio.to_thread.run_sync(blocked.wait)
        assert channel.room == 0  # full, and it stays full: the producer waits
        while len(received) < 100:
            batch = await channel.receive_batch()
            assert 1 <= len(batch) <= 4
            received += batch
    assert received == [str(i).encode() for i in range(100)]


async def test_close_delivers_what_is_left_then_the_end() -> None:
    channel = PieceChannel(8)
    channel.put(b"a")
    channel.put(b"b")
    channel.close()
    assert await channel.receive_batch() == [b"a", b"b"]
    with pytest.raises(trio.EndOfChannel):
        await channel.receive_batch()


async def test_a_parked_consumer_is_woken_by_a_thread_put_and_by_close() -> None:
    channel = PieceChannel(2)
    async with trio.open_nursery() as nursery:
        got: list[list[bytes]] = []

        async def consume() -> None:
            got.append(await channel.receive_batch())
            with pytest.raises(trio.EndOfChannel):
                await channel.receive_batch()
            got.append([])

        nursery.start_soon(consume)
        await wait_for(lambda: channel._consumer is not None)  # parked, no piece yet
        await trio.to_thread.run_sync(channel.put, b"x")
        await wait_for(lambda: got == [[b"x"]])
        await wait_for(lambda: channel._consumer is not None)
        channel.close()
    assert got == [[b"x"], []]


async def test_a_consumer_cancelled_while_parked_loses_nothing() -> None:
    channel = PieceChannel(2)
    with trio.move_on_after(0.01):
        await channel.receive_batch()  # nothing to take: cancelled while parked
    channel.put(b"kept")
    assert await channel.receive_batch() == [b"kept"]


async def test_abort_wakes_a_blocked_thread_with_aborted() -> None:
    channel = PieceChannel(1)
    channel.put(b"full")
    outcome: list[str] = []

    def produce() -> None:
        try:
            channel.put_wait(b"never")
        except Aborted:
            outcome.append("aborted")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, produce)
        await wait_for(lambda: channel._condition._waiters)  # type: ignore[attr-defined]
        channel.abort()
    assert outcome == ["aborted"]
    assert channel.aborted


async def test_a_trio_producer_waits_for_room_and_breaks_when_the_consumer_leaves() -> None:
    channel = PieceChannel(1)
    await channel.send(b"one")
    async with trio.open_nursery() as nursery:
        done: list[str] = []

        async def send_more() -> None:
            await channel.send(b"two")  # waits: the channel is full
            done.append("sent")
            with pytest.raises(trio.BrokenResourceError):
                await channel.send(b"three")  # waits again, then the consumer leaves
            done.append("broken")

        nursery.start_soon(send_more)
        await wait_for(lambda: channel._producer is not None)
        assert await channel.receive_batch() == [b"one"]
        await wait_for(lambda: done == ["sent"])
        await wait_for(lambda: channel._producer is not None)
        channel.close_receiving()
    assert done == ["sent", "broken"]


async def test_on_room_is_called_when_the_consumer_drains_a_full_channel() -> None:
    channel = PieceChannel(2)
    calls: list[int] = []
    channel.on_room = lambda: calls.append(channel.room)
    channel.put(b"a")
    assert await channel.receive_batch() == [b"a"]
    assert calls == []  # it was not full: nobody can be paused on it
    channel.put(b"b")
    channel.put(b"c")
    assert await channel.receive_batch() == [b"b", b"c"]
    assert calls == [2]


async def test_receive_batch_is_a_checkpoint_whether_pieces_wait_or_it_parks() -> None:
    # (parked: the wait was the yield, and the wake-up takes no second trip through the
    # scheduler; pieces already waiting: it yields before it returns them)
    channel = PieceChannel(4)
    channel.put(b"a")
    with trio.testing.assert_checkpoints():
        assert await channel.receive_batch() == [b"a"]

    async def put_later() -> None:
        await trio.testing.wait_all_tasks_blocked()
        channel.put(b"b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(put_later)
        with trio.testing.assert_checkpoints():
            assert await channel.receive_batch() == [b"b"]


async def test_wait_aborted_waits_out_its_step_or_wakes_at_the_abort() -> None:
    channel = PieceChannel(4)
    assert not await trio.to_thread.run_sync(channel.wait_aborted, 0.01)  # the step, waited out
    assert not channel.wait_aborted(0)
    with trio.fail_after(30):  # (the waits below are an hour: only the abort ends them)
        async with trio.open_nursery() as nursery:
            results: list[bool] = []
            threads: list[int] = []

            def wait_in_thread() -> bool:
                threads.append(threading.get_native_id())
                return channel.wait_aborted(3600.0)

            async def wait() -> None:
                # (abandoned if the abort never wakes it: the fail_after then fails the test)
                results.append(await trio.to_thread.run_sync(wait_in_thread, abandon_on_cancel=True))

            nursery.start_soon(wait)
            nursery.start_soon(wait)
            # both threads blocked in their wait (the kernel says so) before the abort
            await wait_for(lambda: len(threads) == 2 and all(_sleeping(t) for t in threads))
            channel.abort()
    assert results == [True, True]
    assert channel.wait_aborted(3600.0)  # (and every later wait, at once)


def _sleeping(native_id: int) -> bool:
    """Whether this process's thread ``native_id`` is blocked (``S``), per ``/proc``."""
    with open(f"/proc/self/task/{native_id}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] == "S"


class _CountingToken:
    """The channel's Trio token, counting the wakes posted through ``run_sync_soon``."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token, self.posted = token, 0

    def run_sync_soon(self, fn: object, *args: object) -> None:
        self.posted += 1
        self.token.run_sync_soon(fn, *args)  # type: ignore[arg-type]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="the eventfd wake is Linux's")
async def test_a_threads_later_wakes_go_through_the_eventfd_and_it_is_closed_at_the_end() -> None:
    fds = _open_fds()
    channel = PieceChannel(4)
    token = _CountingToken(channel._token)
    channel._token = token  # type: ignore[assignment]
    parked_on_fd: list[bool] = []
    received: list[bytes] = []

    def produce() -> None:
        for i in range(20):
            # each piece put once the last was taken and the consumer parked again
            while True:
                with channel._lock:
                    if len(received) == i and channel._consumer is not None:
                        parked_on_fd.append(channel._fd_parked)
                        break
                threading.Event().wait(0.0005)  # (a thread, polling the test's state)
            channel.put(str(i).encode())

    async with trio.open_nursery() as nursery:

        async def run() -> None:
            await trio.to_thread.run_sync(produce)
            channel.close()

        nursery.start_soon(run)
        with trio.fail_after(30):
            while True:
                try:
                    received += await channel.receive_batch()
                except trio.EndOfChannel:
                    break
    assert received == [str(i).encode() for i in range(20)]
    # the first wake was posted through Trio and asked for the eventfd; every later one
    # found the consumer parked on it
    assert token.posted == 1
    assert parked_on_fd == [False] + [True] * 19
    assert channel._fd == -1
    assert _open_fds() == fds


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="the eventfd wake is Linux's")
async def test_a_consumer_cancelled_on_the_eventfd_loses_nothing_and_leaving_closes_it() -> None:
    fds = _open_fds()
    channel = PieceChannel(4)
    async with trio.open_nursery() as nursery:

        async def take() -> None:
            assert await channel.receive_batch() == [b"a"]

        nursery.start_soon(take)
        await wait_for(lambda: channel._consumer is not None)
        await trio.to_thread.run_sync(channel.put, b"a")  # a thread's wake: asks for the fd
    assert channel._want_fd
    assert channel._fd == -1
    with trio.move_on_after(0.01):
        await channel.receive_batch()  # parked on the new eventfd, then cancelled
    assert channel._fd >= 0
    assert not channel._fd_parked
    assert channel._consumer is None
    await trio.to_thread.run_sync(channel.put, b"kept")  # nobody parked: no write
    assert await channel.receive_batch() == [b"kept"]
    async with trio.open_nursery() as nursery:

        async def take_woken() -> None:
            assert await channel.receive_batch() == [b"woken"]

        nursery.start_soon(take_woken)
        await wait_for(lambda: channel._fd_parked)
        channel.put(b"woken")  # (from the Trio thread: the fd is written all the same)
    assert not channel._fd_written  # read back by the consumer it woke
    channel.close_receiving()
    assert channel._fd == -1
    assert _open_fds() == fds


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="the eventfd wake is Linux's")
async def test_out_of_descriptors_the_wake_is_posted_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = PieceChannel(4)

    def no_fd(*_: object) -> int:
        raise OSError(24, "Too many open files")

    async with trio.open_nursery() as nursery:

        async def take(expected: bytes) -> None:
            assert await channel.receive_batch() == [expected]

        nursery.start_soon(take, b"a")
        await wait_for(lambda: channel._consumer is not None)
        await trio.to_thread.run_sync(channel.put, b"a")  # asks for the fd
    monkeypatch.setattr(os, "eventfd", no_fd)
    for piece in (b"b", b"c"):  # no descriptor to be had: each wake posted, none lost
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, piece)
            await wait_for(lambda: channel._consumer is not None)
            assert channel._fd == -1
            assert not channel._fd_parked
            await trio.to_thread.run_sync(channel.put, piece)
    assert channel._consumer is None
