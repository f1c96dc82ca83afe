"""Admission: slots, a bounded FIFO queue, early refusal, cancel frees the place."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trioserve import OverloadedError
from trioserve._core._admission import Admission


async def hold_slot(admission: Admission, release: trio.Event) -> None:
    """Occupy one slot until ``release`` is set."""
    async with admission.slot():
        await release.wait()


async def test_queue_full_is_refused_with_retry_after() -> None:
    admission = Admission(slots=1, max_queue=1)
    async with trio.open_nursery() as nursery:
        holding = trio.Event()
        release = trio.Event()

        async def hold() -> None:
            async with admission.slot():
                holding.set()
                await release.wait()

        async def wait_in_queue() -> None:
            async with admission.slot():
                pass

        nursery.start_soon(hold)
        await holding.wait()
        nursery.start_soon(wait_in_queue)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.queued == 1
        with pytest.raises(OverloadedError) as info:
            async with admission.slot():
                pass  # pragma: no cover
        assert info.value.retry_after >= 1
        assert info.value.status == 429
        release.set()
    assert admission.in_use == 0
    assert admission.queued == 0


async def test_fifo_order() -> None:
    admission = Admission(slots=1, max_queue=10)
    order: list[int] = []
    release = trio.Event()
    async with trio.open_nursery() as nursery:

        async def holder() -> None:
            async with admission.slot():
                await release.wait()

        async def waiter(i: int) -> None:
            async with admission.slot():
                order.append(i)

        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(5):
            nursery.start_soon(waiter, i)
            await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert order == [0, 1, 2, 3, 4]


async def test_cancel_while_queued_frees_the_place_at_once() -> None:
    admission = Admission(slots=1, max_queue=1)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold_slot, admission, release)
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as queued_scope:

            async def cancel_soon() -> None:
                await trio.testing.wait_all_tasks_blocked()
                assert admission.queued == 1
                queued_scope.cancel()

            nursery.start_soon(cancel_soon)
            async with admission.slot():
                pytest.fail("should have been cancelled while queued")
        assert admission.queued == 0
        assert admission.in_use == 1
        release.set()
    assert admission.in_use == 0


async def test_deadline_that_cannot_be_met_is_refused_early(autojump_clock: trio.abc.Clock) -> None:
    admission = Admission(slots=1, max_queue=5, expected_service_time=10.0)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold_slot, admission, release)
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1.0), pytest.raises(OverloadedError) as info:
            async with admission.slot():
                pass  # pragma: no cover
        assert info.value.code == "deadline_unreachable"
        release.set()


async def test_a_reservation_holds_its_place_until_the_queue_takes_it() -> None:
    admission = Admission(slots=1, max_queue=1)
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold_slot, admission, release)
        await trio.testing.wait_all_tasks_blocked()
        reservation = admission.reserve()  # the one queue place
        with pytest.raises(OverloadedError):
            admission.check()  # nobody else can take it meanwhile
        entered = trio.Event()

        async def reserved_request() -> None:
            async with admission.slot(reservation):
                entered.set()

        nursery.start_soon(reserved_request)
        await trio.testing.wait_all_tasks_blocked()
        assert (admission.queued, admission.reserved) == (1, 0)
        release.set()
        await entered.wait()
    assert (admission.in_use, admission.queued, admission.reserved) == (0, 0, 0)
    unused = admission.reserve()
    unused.release()
    unused.release()  # idempotent
    assert admission.reserved == 0


async def test_several_slots_are_taken_at_once_in_the_requests_place() -> None:
    """A request for n slots waits for all of them together, in its place in the queue:
    it holds none while it waits, and a later one-slot request does not overtake it."""
    admission = Admission(slots=2, max_queue=10)
    order: list[str] = []
    release_first = trio.Event()
    release_all = trio.Event()
    async with trio.open_nursery() as nursery:

        async def take(name: str, count: int, release: trio.Event) -> None:
            async with admission.slot(count=count):
                order.append(name)
                await release.wait()

        nursery.start_soon(take, "one", 1, release_first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "pair", 2, release_all)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "later", 1, release_all)
        await trio.testing.wait_all_tasks_blocked()
        # one slot is free, but the pair (first in the queue) needs two: nobody overtakes it
        assert order == ["one"]
        assert admission.in_use == 1
        assert admission.queued == 2
        release_first.set()
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["one", "pair"]
        assert admission.in_use == 2
        release_all.set()
    assert order == ["one", "pair", "later"]
    assert admission.in_use == 0
    assert admission.queued == 0


async def test_a_cancelled_multi_slot_request_lets_the_ones_behind_it_through() -> None:
    admission = Admission(slots=2, max_queue=10)
    order: list[str] = []
    release = trio.Event()

    async def take(name: str, count: int) -> None:
        async with admission.slot(count=count):
            order.append(name)
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "one", 1)
        await trio.testing.wait_all_tasks_blocked()
        pair_scope = trio.CancelScope()

        async def pair() -> None:
            with pair_scope:
                await take("pair", 2)

        nursery.start_soon(pair)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "later", 1)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["one"]  # "later" waits behind the pair, though a slot is free
        pair_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["one", "later"]  # the pair left the queue: the one behind it fits
        assert admission.in_use == 2
        assert admission.queued == 0
        release.set()
    assert admission.in_use == 0
