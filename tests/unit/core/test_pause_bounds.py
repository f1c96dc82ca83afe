"""Bounds on preemption by pause (issue 47): paused requests count toward the queue's
bound, their saved states toward a byte budget (a spent budget refuses the pause, not
the request), an account keeps its fair-share counter across a pause, and an ask to
pause cannot be lost while a holder installs its hook (the engine with a backend that
takes its time to start)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trioserve._backends._scripted import ScriptedBackend
from trioserve._core._admission import Admission, PauseBudget, Ticket
from trioserve._core._backend import GenerationProgress, PreparedPrompt
from trioserve._core._channel import PieceChannel
from trioserve._core._engine import Engine
from trioserve._core._exceptions import OverloadedError
from trioserve._core._types import GenerationEnd, GenerationRequest

from .test_admission_order import Holder, _start


async def test_paused_requests_count_toward_max_queue() -> None:
    """``--slots 1 --max-queue 1``: priorities 10, 9, 8 one after another — the first is
    paused for the second and waits in the queue, so the third is refused."""
    admission = Admission(1, 1)
    log: list[str] = []
    first = Holder(admission, Ticket(priority=10), "p10", log, pausable=True)
    second = Holder(admission, Ticket(priority=9), "p9", log, pausable=True)
    async with trio.open_nursery() as nursery:
        await _start(nursery, first)
        await _start(nursery, second)
        assert log == ["+p10", "~p10", "+p9"]
        assert admission.snapshot().paused == 1
        assert admission.snapshot().queued == 1  # the paused one waits in the queue
        with pytest.raises(OverloadedError, match="at capacity"):
            admission.check()
        second.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "+p10"
        admission.check()  # a place again
        first.finish.set()
    assert admission.snapshot().queued == 0


async def test_a_spent_pause_budget_refuses_the_pause_not_the_request() -> None:
    budget = PauseBudget(1000)
    admission = Admission(2, 8, pause_budget=budget)
    log: list[str] = []
    low = [Holder(admission, Ticket(priority=5), f"low{i}", log, pausable=True) for i in range(2)]
    for holder in low:
        holder.state_bytes = 600
    urgent = [Holder(admission, Ticket(priority=0), f"urgent{i}", log, pausable=False) for i in range(2)]
    async with trio.open_nursery() as nursery:
        for holder in low:
            await _start(nursery, holder)
        await _start(nursery, urgent[0])
        assert log[-2:] == ["~low1", "+urgent0"]
        assert admission.snapshot().paused_bytes == 600
        # a second pause would hold 1200 bytes of 1000: not asked; the urgent request
        # waits in the queue (admitted, not refused)
        await _start(nursery, urgent[1])
        assert log[-1] == "+urgent0"
        snapshot = admission.snapshot()
        assert snapshot.paused == 1
        assert snapshot.queued == 2
        assert snapshot.pauses_refused == 1  # (one request, counted once)
        assert snapshot.paused_bytes == 600
        urgent[0].finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-2:] == ["-urgent0", "+urgent1"]  # the better priority before the paused
        urgent[1].finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "+low1"
        assert budget.used == 0  # given back when the paused one runs again
        for holder in low:
            holder.finish.set()
    assert admission.in_use == 0
    assert budget.used == 0


async def test_a_budget_of_zero_never_pauses() -> None:
    admission = Admission(1, 8, pause_budget=PauseBudget(0))
    log: list[str] = []
    low = Holder(admission, Ticket(priority=5), "low", log, pausable=True)
    urgent = Holder(admission, Ticket(priority=0), "urgent", log, pausable=False)
    async with trio.open_nursery() as nursery:
        await _start(nursery, low)
        await _start(nursery, urgent)
        assert log == ["+low"]
        assert admission.preemptions == 0
        low.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "+urgent"
        urgent.finish.set()


async def test_a_pause_keeps_the_paused_accounts_fair_share_counter() -> None:
    """A has served 100 tokens when it is paused for a better priority; D, an account
    that arrives after, starts at the lowest counter (0) and so goes before A's
    resumption at the same priority. (Were A's counter reset by the pause, A and D would
    tie at 0 and A's earlier arrival would win.)"""
    admission = Admission(2, 8)
    log: list[str] = []
    a = Holder(admission, Ticket(priority=5, account="A"), "a", log, pausable=True)
    c = Holder(admission, Ticket(priority=0, account="C"), "c", log, pausable=False)
    b = Holder(admission, Ticket(priority=0, account="B"), "b", log, pausable=False)
    d = Holder(admission, Ticket(priority=5, account="D"), "d", log, pausable=False)
    async with trio.open_nursery() as nursery:
        await _start(nursery, a)
        await _start(nursery, c)
        a.served = 100
        await _start(nursery, b)
        assert log[-2:] == ["~a", "+b"]
        assert admission.counter("A") == 100
        await _start(nursery, d)
        assert admission.counter("D") == 0
        b.finish.set()
        await trio.testing.wait_all_tasks_blocked()
        assert log[-2:] == ["-b", "+d"]
        assert admission.counter("A") == 100
        for holder in (d, c, a):
            holder.finish.set()
            await trio.testing.wait_all_tasks_blocked()
        assert log[-1] == "-a"


class _SlowStartPausable(ScriptedBackend):
    """A pausable backend that takes its time between the grant and installing its pause
    hook (the llama backend makes its sampler and submits the sequence there)."""

    pausable = True

    def __init__(self) -> None:
        super().__init__(slots=1)
        self.started = trio.Event()
        self.hook_may_install = trio.Event()
        self.asks = 0
        self.finish: dict[int, trio.Event] = {}

    async def generate(
        self, prompt: PreparedPrompt, channel: PieceChannel, progress: GenerationProgress
    ) -> GenerationEnd:
        lease = progress.preemption
        assert lease is not None
        finish = self.finish.setdefault(len(prompt.tokens), trio.Event())
        self.started.set()
        await self.hook_may_install.wait()
        wake = [trio.Event()]

        def asked() -> None:
            self.asks += 1
            wake[0].set()

        lease.enable_pause(asked)
        try:
            while not finish.is_set():
                async with trio.open_nursery() as nursery:

                    async def stop_on(event: trio.Event, nursery: trio.Nursery = nursery) -> None:
                        await event.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(stop_on, finish)
                    nursery.start_soon(stop_on, wake[0])
                if wake[0].is_set() and not finish.is_set():
                    wake[0] = trio.Event()
                    await lease.pause()
        finally:
            lease.disable_pause()
        return "stop"


async def _run(engine: Engine, prompt: str, priority: int, log: list[str]) -> None:
    async with engine.stream(
        GenerationRequest(prompt=prompt, max_tokens=4), ticket=Ticket(priority=priority)
    ) as events:
        log.append(f"+{prompt}")
        async for _ in events:
            pass
    log.append(f"-{prompt}")


async def test_a_pause_asked_while_the_holder_starts_is_not_lost() -> None:
    """A better priority arrives between the grant of a running request and its backend's
    pause hook: the ask waits for the hook (the lease is not pausable before it), and
    is made the moment it is installed — the better request does not wait for the
    whole generation."""
    backend = _SlowStartPausable()
    log: list[str] = []
    async with Engine(backend, max_queue=4) as engine:
        admission = engine.admission
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_run, engine, "low", 5, log)
            await backend.started.wait()
            nursery.start_soon(_run, engine, "urgent", 0, log)
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["+low"]
            assert backend.asks == 0  # nothing to ask yet: no hook
            backend.hook_may_install.set()
            await trio.testing.wait_all_tasks_blocked()
            assert backend.asks == 1
            assert admission.paused == 1
            assert log[-1] == "+urgent"
            backend.finish[len("urgent")].set()
            await trio.testing.wait_all_tasks_blocked()
            assert admission.paused == 0
            backend.finish[len("low")].set()
        assert log == ["+low", "+urgent", "-urgent", "-low"]
        assert admission.in_use == 0
        assert admission.pause_budget.used == 0


async def test_a_pause_of_unknown_size_holds_the_rest_of_the_budget_until_measured() -> None:
    """Before the backend has measured a state (its estimate is 0), a pause asked holds
    the whole rest of the budget: a request with ``n`` = 2 that would need two pauses in
    one pass gets one, not two of unknown size; the pause's real size then takes the
    rest's place."""
    budget = PauseBudget(1000)
    admission = Admission(2, 8, pause_budget=budget)
    log: list[str] = []
    low = [Holder(admission, Ticket(priority=5), f"low{i}", log, pausable=True) for i in range(2)]
    granted = trio.Event()

    async def urgent() -> None:
        async with admission.slot(ticket=Ticket(priority=0), count=2):
            granted.set()

    async with trio.open_nursery() as nursery:
        for holder in low:
            await _start(nursery, holder)
            # (the holders do not act on an ask: it stays in flight, its size unknown)
            holder.pause_asked = trio.Event()
        nursery.start_soon(urgent)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.preemptions == 1  # one pause asked, holding the rest
        assert budget.used == 1000
        assert admission.snapshot().pauses_refused == 1
        for holder in low:
            holder.finish.set()
        await granted.wait()
    assert budget.used == 0
