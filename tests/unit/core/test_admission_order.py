"""Admission's order (priority, fair share, arrival), per-account concurrency and
preemption by pause — against holders that stand in for the engine's producers (no
model: the llama backend's side of a pause is tests/e2e/test_priorities.py)."""

from __future__ import annotations

import trio
import trio.testing

from trioserve._core._admission import Admission, SlotLease, Ticket

A = Ticket(account="A")
B = Ticket(account="B")


class Holder:
    """A request holding a slot until told to finish; pausable if asked."""

    def __init__(
        self, admission: Admission, ticket: Ticket, name: str, log: list[str], *, pausable: bool
    ) -> None:
        self.admission = admission
        self.ticket = ticket
        self.name = name
        self.log = log
        self.pausable = pausable
        self.finish = trio.Event()
        self.lease: SlotLease | None = None
        self.served = 0
        self.pause_asked = trio.Event()
        #: what its saved state would take, and takes once paused
        self.state_bytes = 0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.admission.slot(ticket=self.ticket) as lease:
            self.lease = lease
            lease.usage = lambda: self.served
            if self.pausable:
                lease.enable_pause(lambda: self.pause_asked.set(), state_bytes=lambda: self.state_bytes)
            self.log.append(f"+{self.name}")
            task_status.started()
            while not self.finish.is_set():
                with trio.move_on_at(trio.current_time() + 3600) as scope:
                    async with trio.open_nursery() as nursery:

                        async def stop_on(event: trio.Event) -> None:
                            await event.wait()
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(stop_on, self.finish)
                        nursery.start_soon(stop_on, self.pause_asked)
                assert not scope.cancelled_caught
                if self.pause_asked.is_set() and not self.finish.is_set():
                    self.pause_asked = trio.Event()
                    self.log.append(f"~{self.name}")
                    await lease.pause(self.state_bytes)
                    self.log.append(f"+{self.name}")
            self.log.append(f"-{self.name}")


async def _start(nursery: trio.Nursery, holder: Holder) -> None:
    nursery.start_soon(holder.run)
    await trio.testing.wait_all_tasks_blocked()


async def test_a_better_priority_is_granted_first_and_fifo_holds_within_one() -> None:
    admission = Admission(1, 8)
    log: list[str] = []
    first = Holder(admission, Ticket(priority=5), "first", log, pausable=False)
    late = [
        Holder(admission, Ticket(priority=p), f"p{p}.{i}", log, pausable=False)
        for i, p in enumerate((5, 1, 5, 1))
    ]
    async with trio.open_nursery() as nursery:
        await _start(nursery, first)
        for holder in late:
            await _start(nursery, holder)
        for holder in [first, late[1], late[3], late[0], late[2]]:
            holder.finish.set()
            await trio.testing.wait_all_tasks_blocked()
    assert [entry for entry in log if entry.startswith("+")] == ["+first", "+p1.1", "+p1.3", "+p5.0", "+p5.2"]


async def test_the_account_served_least_goes_first_within_a_priority() -> None:
    admission = Admission(1, 8)
    log: list[str] = []
    a1 = Holder(admission, A, "a1", log, pausable=False)
    queued = [
        Holder(admission, A, "a2", log, pausable=False),
        Holder(admission, A, "a3", log, pausable=False),
    ]
    b1 = Holder(admission, B, "b1", log, pausable=False)
    async with trio.open_nursery() as nursery:
        await _start(nursery, a1)
        for holder in queued:
            await _start(nursery, holder)
        await _start(nursery, b1)  # B arrives after A's queue, and A is served on
        a1.served = 500
        a1.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "+b1"  # ahead of A's earlier arrivals
        for holder in (b1, *queued):
            holder.finish.set()
            await trio.testing.wait_all_tasks_blocked()
    assert [entry for entry in log if entry.startswith("+")] == ["+a1", "+b1", "+a2", "+a3"]


async def test_an_account_at_its_concurrency_waits_without_blocking_others() -> None:
    admission = Admission(2, 8)
    log: list[str] = []
    limited = Ticket(account="A", concurrency=1)
    a1 = Holder(admission, limited, "a1", log, pausable=False)
    a2 = Holder(admission, limited, "a2", log, pausable=False)
    b1 = Holder(admission, B, "b1", log, pausable=False)
    async with trio.open_nursery() as nursery:
        await _start(nursery, a1)
        await _start(nursery, a2)
        assert log == ["+a1"]  # a free slot, but A holds its one
        await _start(nursery, b1)
        assert log == ["+a1", "+b1"]
        a1.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-2:] == ["-a1", "+a2"]
        a2.finish.set()
        b1.finish.set()


async def test_a_better_priority_pauses_the_worst_running_and_it_resumes_after() -> None:
    admission = Admission(2, 8)
    log: list[str] = []
    low = [Holder(admission, Ticket(priority=p), f"low{p}", log, pausable=True) for p in (3, 5)]
    urgent = Holder(admission, Ticket(priority=0), "urgent", log, pausable=False)
    async with trio.open_nursery() as nursery:
        for holder in low:
            await _start(nursery, holder)
        await _start(nursery, urgent)
        # the worst priority (5) paused, its slot to the urgent one
        assert log[-2:] == ["~low5", "+urgent"]
        assert admission.snapshot().paused == 1
        assert admission.preemptions == 1
        urgent.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-2:] == ["-urgent", "+low5"]
        for holder in low:
            holder.finish.set()
    assert admission.in_use == 0
    assert admission.snapshot().paused == 0


async def test_an_equal_priority_never_pauses_and_unpausable_leases_are_left_alone() -> None:
    admission = Admission(1, 8)
    log: list[str] = []
    running = Holder(admission, Ticket(priority=5), "running", log, pausable=False)
    same = Holder(admission, Ticket(priority=5, account="other"), "same", log, pausable=False)
    better = Holder(admission, Ticket(priority=0), "better", log, pausable=False)
    async with trio.open_nursery() as nursery:
        await _start(nursery, running)
        await _start(nursery, same)
        await _start(nursery, better)
        assert admission.preemptions == 0  # not pausable: the better one waits its turn
        running.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "+better"
        better.finish.set()
        same.finish.set()


async def test_an_account_under_its_share_pauses_one_of_an_account_over_it() -> None:
    admission = Admission(4, 16)
    log: list[str] = []
    a = [Holder(admission, A, f"a{i}", log, pausable=True) for i in range(6)]
    b = [Holder(admission, B, f"b{i}", log, pausable=False) for i in range(3)]
    async with trio.open_nursery() as nursery:
        for holder in a:
            await _start(nursery, holder)
        assert log == ["+a0", "+a1", "+a2", "+a3"]
        await _start(nursery, b[0])
        # A holds 4 of 4 slots, B 0 of its share of 2: one of A's pauses
        assert log[-2:] == ["~a3", "+b0"]
        await _start(nursery, b[1])
        assert log[-2:] == ["~a2", "+b1"]
        await _start(nursery, b[2])
        # B holds its share (2): its third waits like anyone
        assert log[-1] == "+b1"
        assert admission.preemptions == 2
        b[0].finish.set()
        await trio.testing.wait_all_tasks_blocked()
        # B's waiter has served least: it goes first (A's paused ones wait)
        assert log[-2:] == ["-b0", "+b2"]
        for holder in (*b, *a):
            holder.finish.set()
            await trio.testing.wait_all_tasks_blocked()
    assert admission.in_use == 0
    assert admission.snapshot().paused == 0


async def test_a_paused_lease_cancelled_while_waiting_leaves_nothing() -> None:
    admission = Admission(1, 8)
    log: list[str] = []
    low = Holder(admission, Ticket(priority=5), "low", log, pausable=True)
    urgent = Holder(admission, Ticket(priority=0), "urgent", log, pausable=False)
    low_scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_in_scope, low_scope, low)
        await trio.testing.wait_all_tasks_blocked()
        await _start(nursery, urgent)
        assert log[-2:] == ["~low", "+urgent"]
        assert admission.snapshot().paused == 1
        low_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert admission.snapshot().paused == 0
        urgent.finish.set()
    assert admission.in_use == 0
    assert admission.queued == 0


async def _in_scope(scope: trio.CancelScope, holder: Holder) -> None:
    with scope:
        await holder.run()


async def test_a_declined_pause_asks_another() -> None:
    admission = Admission(2, 8)
    log: list[str] = []
    low = [Holder(admission, Ticket(priority=5), f"low{i}", log, pausable=True) for i in range(2)]
    urgent = Holder(admission, Ticket(priority=0), "urgent", log, pausable=False)
    async with trio.open_nursery() as nursery:
        for holder in low:
            await _start(nursery, holder)
        # the first asked declines (its work cannot be set aside): the other is asked
        for holder in low:
            assert holder.lease is not None
        declining = low[1]
        assert declining.lease is not None
        declining.lease.on_pause = lambda: declining.lease.decline()  # type: ignore[union-attr]
        await _start(nursery, urgent)
        assert log[-2:] == ["~low0", "+urgent"]
        for holder in (urgent, *low):
            holder.finish.set()
            await trio.testing.wait_all_tasks_blocked()
    assert admission.in_use == 0
