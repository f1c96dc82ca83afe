"""Setting a lease aside until someone reads it (issue 48, docs/resumable-streams.md,
"Parking reuses preemption"): its slots go back at once, it waits outside the queue
(``parked``: not among ``queued``, not counted toward ``max_queue``), then queues with
its ticket and original arrival; the pause budget is charged while it is parked and
given back on resume, on cancel and on a refused ask; a lease whose holder installed
``yielding`` gives its slot to any waiter, whatever the priorities."""

from __future__ import annotations

import trio
import trio.testing

from trioserve._core._admission import Admission, PauseBudget, Ticket

from .test_admission_order import Holder, _start


async def test_a_lease_set_aside_waits_outside_the_queue_until_its_reader() -> None:
    admission = Admission(1, 1)
    log: list[str] = []
    detached = Holder(admission, Ticket(priority=0), "detached", log, pausable=True)
    detached.state_bytes = 100
    reader_back = trio.Event()
    async with trio.open_nursery() as nursery:
        await _start(nursery, detached)
        assert detached.lease is not None
        assert detached.lease.set_aside(reader_back)
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["+detached", "~detached"]
        snapshot = admission.snapshot()
        assert (snapshot.in_use, snapshot.queued, snapshot.parked) == (0, 0, 1)
        assert snapshot.paused_bytes == 100
        # its slot serves others, and the queue's whole bound is theirs
        others = [Holder(admission, Ticket(priority=9), f"other{i}", log, pausable=False) for i in range(2)]
        for holder in others:
            await _start(nursery, holder)
        assert log[-1] == "+other0"
        assert admission.snapshot().queued == 1
        # a grant never goes to a lease waiting for its reader
        others[0].finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-2:] == ["-other0", "+other1"]
        # the reader is back: it queues (its better priority first) and runs again
        reader_back.set()
        await trio.testing.wait_all_tasks_blocked()
        assert admission.snapshot().parked == 0
        assert admission.snapshot().paused == 1
        others[1].finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-2:] == ["-other1", "+detached"]
        assert admission.snapshot().paused_bytes == 0  # given back on resume
        detached.finish.set()
    assert admission.snapshot().in_use == 0


async def test_a_parked_lease_cancelled_leaves_nothing_behind() -> None:
    budget = PauseBudget(1000)
    admission = Admission(1, 4, pause_budget=budget)
    log: list[str] = []
    detached = Holder(admission, Ticket(), "detached", log, pausable=True)
    detached.state_bytes = 300
    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_in, scope, detached)
        await trio.testing.wait_all_tasks_blocked()
        assert detached.lease is not None
        assert detached.lease.set_aside(trio.Event())
        await trio.testing.wait_all_tasks_blocked()
        assert admission.snapshot().parked == 1
        assert budget.used == 300
        scope.cancel()
    snapshot = admission.snapshot()
    assert (snapshot.parked, snapshot.queued, snapshot.paused, snapshot.in_use) == (0, 0, 0, 0)
    assert budget.used == 0


async def _run_in(scope: trio.CancelScope, holder: Holder) -> None:
    with scope:
        await holder.run()


async def test_set_aside_is_refused_when_the_budget_cannot_take_the_state() -> None:
    budget = PauseBudget(100)
    admission = Admission(1, 1, pause_budget=budget)
    log: list[str] = []
    holder = Holder(admission, Ticket(), "big", log, pausable=True)
    holder.state_bytes = 500
    unpausable = Holder(admission, Ticket(), "plain", log, pausable=False)
    async with trio.open_nursery() as nursery:
        await _start(nursery, holder)
        assert holder.lease is not None
        assert not holder.lease.set_aside(trio.Event())
        assert budget.used == 0
        assert not holder.lease.pause_asked
        holder.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        await _start(nursery, unpausable)
        assert unpausable.lease is not None
        assert not unpausable.lease.set_aside(trio.Event())  # its holder cannot pause
        unpausable.finish.set()
    assert budget.used == 0


async def test_a_yielding_lease_gives_its_slot_to_any_waiter() -> None:
    """A detached stream whose log is full yields to a waiter of a worse priority (no
    ordinary preemption would pause it): set aside when it can, else it ends."""
    admission = Admission(1, 4)
    log: list[str] = []
    detached = Holder(admission, Ticket(priority=0), "detached", log, pausable=True)
    reader_back = trio.Event()
    asked: list[str] = []
    async with trio.open_nursery() as nursery:
        await _start(nursery, detached)
        lease = detached.lease
        assert lease is not None

        def yielding() -> bool:
            asked.append("yield")
            return lease.set_aside(reader_back)

        lease.yielding = yielding
        worse = Holder(admission, Ticket(priority=50), "worse", log, pausable=False)
        await _start(nursery, worse)
        assert asked == ["yield"]
        assert log == ["+detached", "~detached", "+worse"]
        assert admission.snapshot().parked == 1
        worse.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert admission.snapshot().in_use == 0  # still nobody reads it: it stays parked
        reader_back.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "+detached"
        lease.yielding = None
        detached.finish.set()


async def test_a_yielding_lease_that_cannot_park_ends_and_its_slot_is_counted_once() -> None:
    admission = Admission(1, 4)
    log: list[str] = []
    detached = Holder(admission, Ticket(priority=0), "detached", log, pausable=False)
    waiters = [Holder(admission, Ticket(priority=9), f"w{i}", log, pausable=False) for i in range(2)]
    async with trio.open_nursery() as nursery:
        await _start(nursery, detached)
        lease = detached.lease
        assert lease is not None
        calls: list[int] = []

        def yielding() -> bool:
            calls.append(1)
            lease.will_end()
            detached.finish.set()  # (the job is cancelled, cause "evicted")
            return True

        lease.yielding = yielding
        for holder in waiters:
            await _start(nursery, holder)
        assert calls == [1]  # asked once, though two waiters came
        assert log == ["+detached", "-detached", "+w0"]
        for holder in waiters:
            holder.finish.set()
    assert admission.snapshot().in_use == 0


async def test_an_ending_lease_is_counted_once_though_its_holder_declines_on_the_way_out() -> None:
    """A stream evicted for a waiter (``will_end``) whose holder then gives up its pause
    hook (the llama backend's ``disable_pause`` before the slot goes back): its slot is
    still counted as coming, so no second stream is evicted for the same waiter."""
    admission = Admission(2, 4)
    log: list[str] = []
    first = Holder(admission, Ticket(), "first", log, pausable=False)
    second = Holder(admission, Ticket(), "second", log, pausable=False)
    asked: list[str] = []
    async with trio.open_nursery() as nursery:
        await _start(nursery, first)
        await _start(nursery, second)
        lease_a, lease_b = first.lease, second.lease
        assert lease_a is not None
        assert lease_b is not None

        def evict_first() -> bool:
            asked.append("first")
            lease_a.will_end()
            return True

        lease_a.yielding = evict_first
        waiter = Holder(admission, Ticket(), "waiter", log, pausable=False)
        await _start(nursery, waiter)
        assert asked == ["first"]
        lease_a.disable_pause()  # (on its way out, before its slot is released)

        def evict_second() -> bool:
            asked.append("second")
            lease_b.will_end()
            return True

        lease_b.yielding = evict_second
        admission._grant()
        assert asked == ["first"]  # the waiter's slot is still the first's, on its way
        first.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-2:] == ["-first", "+waiter"]
        lease_b.yielding = None
        second.finish.set()
        waiter.finish.set()
    assert admission.snapshot().in_use == 0
