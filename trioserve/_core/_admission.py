"""Admission: a fixed number of slots and a bounded queue in front of them, ordered by
priority, then by fair share, then by arrival — and preemption by pause.

A request either gets a slot, waits in the queue, or is refused at once with
:class:`OverloadedError` — never queued without bound. Waiting is an ordinary Trio
wait, so a queued request that is cancelled (client gone, deadline, shutdown, a cancel
by id) leaves the queue at that instant; nothing polls.

Each request carries a :class:`Ticket`: its ``priority`` (lower first, vLLM's
semantics), its ``account`` (whose share it uses: the API key) with a ``weight`` and an
optional ``concurrency`` limit. A free slot goes to the waiter of the best priority;
among those, to the account with the fewest tokens served per unit of weight (the
virtual token counter: tokens evaluated and generated, counted live while a request
runs; an account that arrives after being idle starts at the lowest counter of the
active ones, so idling earns no credit); within an account, first come, first served.
A waiter whose account holds ``concurrency`` slots waits without blocking the others.

Preemption: when the best waiter cannot be granted and a running lease is *pausable*
(its backend can set its sequence aside with its state kept) and outranked by the
waiter — a worse priority, or the same priority on an account over its share of the
slots while the waiter's account is under its own — the lease is asked to pause
(:attr:`SlotLease.on_pause`). Its holder gives the slot back with
:meth:`SlotLease.pause`, which then waits in the queue with the lease's ticket and
original arrival until the lease is granted again. The design: docs/scheduling.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from ._exceptions import OverloadedError
from ._lease import DEFAULT_TICKET, PauseBudget, Reservation, SlotLease, Ticket, unbounded_pause_budget

__all__ = [
    "DEFAULT_TICKET",
    "Admission",
    "AdmissionSnapshot",
    "PauseBudget",
    "Reservation",
    "SlotLease",
    "Ticket",
]


@dataclass(frozen=True, kw_only=True)
class AdmissionSnapshot:
    """What an :class:`Admission` holds at one instant (for /health, metrics, tests)."""

    slots: int
    in_use: int
    #: waiting in the queue (reserved places included: they are about to)
    queued: int
    max_queue: int
    #: leases set aside by preemption, waiting to be granted again (among ``queued``)
    paused: int = 0
    #: preemptions asked for since start
    preemptions: int = 0
    #: bytes of paused requests' saved states (the server's :class:`PauseBudget`,
    #: shared by every model's admission)
    paused_bytes: int = 0
    #: the budget for them (``--pause-ram``)
    pause_budget_bytes: int = 0
    #: requests that waited in the queue instead of pausing a stream because the
    #: budget was spent (each counted once)
    pauses_refused: int = 0
    #: leases set aside until someone reads them (detached streams: not among
    #: ``queued``, not counted toward ``max_queue``)
    parked: int = 0


class _Waiter:
    __slots__ = ("arrival", "count", "granted", "lease", "refused", "ticket")

    def __init__(self, lease: SlotLease) -> None:
        self.lease = lease
        #: a pause for it was refused by the spent pause budget (counted once)
        self.refused = False
        self.count = lease.count
        self.ticket = lease.ticket
        self.arrival = lease.arrival
        self.granted = trio.Event()


class FairShares:
    """The fair-share accounting of one :class:`Admission`: each active account's
    virtual token counter (tokens served per unit of weight) and its share of the slots.

    It reads the admission's holders and waiters (the same set and list, never copies)
    and keeps only what ended or paused leases served; running leases are counted live.
    """

    __slots__ = ("_leases", "_served", "_slots", "_waiters")

    def __init__(self, slots: int, leases: set[SlotLease], waiters: list[_Waiter]) -> None:
        self._slots = slots
        self._leases = leases
        self._waiters = waiters
        #: per active account (holding or waiting): tokens served per unit of weight,
        #: of leases that have ended or paused (the running ones are counted live)
        self._served: dict[str, float] = {}

    def active(self) -> set[str]:
        return {lease.ticket.account for lease in self._leases} | {w.ticket.account for w in self._waiters}

    def counter(self, account: str) -> float:
        """The account's virtual token counter: tokens served per unit of weight."""
        live = 0.0
        for lease in self._leases:
            if lease.ticket.account == account:
                live += (lease.usage() - lease.charged) / lease.ticket.weight
        return self._served.get(account, 0.0) + live

    def activate(self, account: str) -> None:
        """An account with nothing held or queued arrives: it starts at the lowest
        counter of the active accounts (no credit for idling, no debt either)."""
        active = self.active()
        if account in active:
            return
        others = [self.counter(a) for a in active]
        self._served[account] = min(others) if others else 0.0

    def settle(self, lease: SlotLease) -> None:
        """Count what a lease that stops holding served."""
        used = lease.usage()
        account = lease.ticket.account
        self._served[account] = self._served.get(account, 0.0) + (used - lease.charged) / lease.ticket.weight
        lease.charged = used

    def forget_idle(self) -> None:
        active = self.active()
        for account in [a for a in self._served if a not in active]:
            del self._served[account]

    def held_by(self, account: str) -> int:
        return sum(lease.count for lease in self._leases if lease.ticket.account == account)

    def shares(self) -> dict[str, float]:
        """Each active account's fair share of the slots, by weight."""
        weights: dict[str, float] = {}
        for lease in self._leases:
            weights[lease.ticket.account] = lease.ticket.weight
        for waiter in self._waiters:
            weights[waiter.ticket.account] = waiter.ticket.weight
        total = sum(weights.values())
        return {account: self._slots * weight / total for account, weight in weights.items()}


class Admission:
    """``slots`` concurrent holders; at most ``max_queue`` waiting, served by priority,
    fair share and arrival (the module docstring).

    A request that needs several slots (``n`` choices) waits for all of them at once,
    in its place in the queue: it never holds some while waiting for the rest, and no
    waiter ranked after it overtakes it.

    Args:
        slots: how many requests may hold a slot at once (≥ 1).
        max_queue: how many may wait for one (≥ 0); beyond that, requests are refused.
        expected_service_time: a seconds-per-request estimate (the engine keeps it
            updated from measurements) used for ``Retry-After`` and for refusing
            requests whose deadline would pass while they are still queued; 0 means
            unknown, and then nothing is refused on that ground.
        pause_budget: the bytes paused requests' saved states may hold (shared by the
            server's admissions; default: no bound).
    """

    def __init__(
        self,
        slots: int,
        max_queue: int,
        *,
        expected_service_time: float = 0.0,
        pause_budget: PauseBudget | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if max_queue < 0:
            raise ValueError("max_queue must be at least 0")
        self.slots = slots
        self.max_queue = max_queue
        self.expected_service_time = expected_service_time
        self._free = slots
        #: the queue (ranked at each grant: few entries, never sorted per token)
        self._waiters: list[_Waiter] = []
        self._arrivals = itertools.count()
        self.queued = 0
        #: places held by requests between the check and the queue (see reserve())
        self.reserved = 0
        #: the leases holding slots
        self._leases: set[SlotLease] = set()
        #: the virtual token counters and shares of the accounts above
        self._fair = FairShares(slots, self._leases, self._waiters)
        #: slots of leases asked to pause that have not yet given them back
        self._pausing = 0
        self.paused = 0
        #: set aside until an event (:meth:`SlotLease.set_aside`): outside the queue
        self.parked = 0
        self.preemptions = 0
        self.pause_budget = pause_budget if pause_budget is not None else unbounded_pause_budget()

    @property
    def in_use(self) -> int:
        return self.slots - self._free

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(
            slots=self.slots,
            in_use=self.in_use,
            queued=self.queued + self.reserved,
            max_queue=self.max_queue,
            paused=self.paused,
            preemptions=self.preemptions,
            paused_bytes=self.pause_budget.used,
            pause_budget_bytes=self.pause_budget.limit,
            pauses_refused=self.pause_budget.refused,
            parked=self.parked,
        )

    def counter(self, account: str) -> float:
        """The account's virtual token counter: tokens served per unit of weight."""
        return self._fair.counter(account)

    # ---------------------------------------------------------- granting

    def _give_back(self, lease: SlotLease) -> None:
        if lease in self._leases:
            self._leases.discard(lease)
            self._fair.settle(lease)
        if lease.pause_asked:
            lease.pause_asked = False
            self._pausing -= lease.count
            if not lease.paused:  # it ended instead of pausing
                self.pause_budget.give(lease.held_bytes)
                lease.held_bytes = 0
        self._free += lease.count
        self._grant()
        self._fair.forget_idle()

    def _eligible(self, waiter: _Waiter) -> bool:
        limit = waiter.ticket.concurrency
        return limit is None or self._fair.held_by(waiter.ticket.account) + waiter.count <= limit

    def _best(self) -> _Waiter | None:
        """The waiter to grant next: the best priority; then an account under its share
        of the slots before one at or over it; then the account served least; then
        the earliest arrival."""
        best: _Waiter | None = None
        best_key: tuple[int, bool, float, int] | None = None
        counters: dict[str, float] = {}
        shares = self._fair.shares() if len(self._fair.active()) > 1 else None
        for waiter in self._waiters:
            if not self._eligible(waiter):
                continue
            account = waiter.ticket.account
            if account not in counters:
                counters[account] = self._fair.counter(account)
            over = shares is not None and self._fair.held_by(account) + waiter.count > shares[account]
            key = (waiter.ticket.priority, over, counters[account], waiter.arrival)
            if best_key is None or key < best_key:
                best, best_key = waiter, key
        return best

    def _grant(self) -> None:
        while True:
            waiter = self._best()
            if waiter is None:
                return
            if waiter.count > self._free:
                self._preempt_for(waiter)
                return
            self._waiters.remove(waiter)
            self._free -= waiter.count
            lease = waiter.lease
            lease.charged = lease.usage()
            self._leases.add(lease)
            waiter.granted.set()

    def _outranks(self, waiter: _Waiter, lease: SlotLease, shares: dict[str, float]) -> bool:
        mine, theirs = waiter.ticket, lease.ticket
        if theirs.priority != mine.priority:
            return theirs.priority > mine.priority
        if theirs.account == mine.account:
            return False
        # the same priority: a waiter's account under its share takes a slot from an
        # account over its own (and never so far that the roles swap)
        return (
            self._fair.held_by(mine.account) + waiter.count <= shares[mine.account]
            and self._fair.held_by(theirs.account) - lease.count >= shares[theirs.account]
        )

    def _preempt_for(self, waiter: _Waiter) -> None:
        """Ask outranked pausable leases to pause until ``waiter`` would fit."""
        need = waiter.count - self._free - self._pausing
        if need <= 0:
            return
        # work nobody waits for (a detached stream with a full log) yields first, to
        # any waiter, whatever the priorities
        for lease in [held for held in self._leases if held.yielding is not None]:
            if need <= 0:
                return
            if lease.yielding is not None and not lease.pause_asked and lease.yielding():
                need -= lease.count
        if need <= 0:
            return
        shares = self._fair.shares()
        victims = [
            lease
            for lease in self._leases
            if lease.pausable and not lease.pause_asked and self._outranks(waiter, lease, shares)
        ]
        # the worst priority first; then the account furthest over its share; then the
        # one that has served least (least set aside), the latest arrival
        victims.sort(
            key=lambda lease: (
                -lease.ticket.priority,
                -(self._fair.held_by(lease.ticket.account) - shares[lease.ticket.account]),
                lease.usage() - lease.charged,
                -lease.arrival,
            )
        )
        for lease in victims:
            if need <= 0:
                break
            charged = self.pause_budget.take(lease.state_bytes())
            if charged is None:
                # the budget is spent: the waiter waits as without pausing
                if not waiter.refused:
                    waiter.refused = True
                    self.pause_budget.refused += 1
                continue
            lease.held_bytes = charged
            lease.pause_asked = True
            self._pausing += lease.count
            self.preemptions += 1
            need -= lease.count
            lease.on_pause()

    def _enqueue(self, lease: SlotLease) -> _Waiter:
        self._fair.activate(lease.ticket.account)
        waiter = _Waiter(lease)
        self._waiters.append(waiter)
        return waiter

    async def _acquire(self, lease: SlotLease) -> None:
        """Wait until ``lease``'s slots are granted (it then holds them)."""
        waiter = self._enqueue(lease)
        self._grant()
        await self._wait(waiter)

    async def _wait(self, waiter: _Waiter) -> None:
        lease = waiter.lease
        at_once = waiter.granted.is_set()
        try:
            if at_once:
                await trio.lowlevel.checkpoint_if_cancelled()
            else:
                await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():
                # granted as the cancel arrived: not taken
                self._leases.discard(lease)
                self._free += lease.count
            else:
                self._waiters.remove(waiter)
            self._grant()  # the ones behind it may fit now
            self._fair.forget_idle()
            raise
        if at_once:
            await trio.lowlevel.cancel_shielded_checkpoint()  # (a schedule point all the same)

    def retry_after(self) -> float:
        """Seconds a refused client should wait before trying again."""
        backlog = (self.queued + self.in_use) / self.slots
        return max(1.0, math.ceil(backlog * self.expected_service_time))

    def check(self) -> None:
        """Raise :class:`OverloadedError` if a request arriving now would be refused:
        ``slots`` running plus ``max_queue`` waiting (and reserved; paused requests
        wait too) are taken, or the caller's deadline would pass while it waits."""
        taken = self.in_use + self.queued + self.reserved
        if taken >= self.slots + self.max_queue:
            raise OverloadedError(
                f"server is at capacity ({self.in_use} running, {self.queued + self.reserved} queued); "
                "retry later",
                retry_after=self.retry_after(),
            )
        ahead = taken - self.slots + 1
        if ahead <= 0:
            return
        expected_wait = ahead * self.expected_service_time / self.slots
        if trio.current_time() + expected_wait > trio.current_effective_deadline():
            raise OverloadedError(
                f"the request's deadline would pass while it is queued "
                f"({ahead} ahead, about {expected_wait:.1f} s); retry later or allow more time",
                retry_after=self.retry_after(),
                code="deadline_unreachable",
            )

    def reserve(self) -> Reservation:
        """Check, and hold a place until :meth:`slot` takes it (or it is released).

        For callers that must commit to something between the check and the wait — the
        HTTP layer sends a stream's headers there — so that no other request can take
        the place meanwhile."""
        self.check()
        self.reserved += 1
        return Reservation(self)

    @asynccontextmanager
    async def slot(
        self,
        reservation: Reservation | None = None,
        *,
        count: int = 1,
        ticket: Ticket = DEFAULT_TICKET,
    ) -> AsyncIterator[SlotLease]:
        """Hold one slot (``count`` slots) for the body of the ``async with`` (or until
        the lease is released, if that comes first).

        Raises:
            OverloadedError: the queue is full, or the caller's deadline (the effective
                deadline of its cancel scopes) will pass before a slot frees up — unless
                ``reservation`` already holds a place.

        Cancellation: if cancelled while queued, the request leaves the queue at once
        and no slot is taken. The slot is released when the block exits, however it exits.
        """
        if reservation is None:
            self.check()
        else:
            reservation.release()  # becomes a queue place, with no checkpoint in between
        if not 1 <= count <= self.slots:
            raise ValueError(f"count must be in [1, {self.slots}], got {count}")
        lease = SlotLease(self, count, ticket)
        lease.arrival = next(self._arrivals)
        self.queued += 1
        try:
            await self._acquire(lease)
        finally:
            self.queued -= 1
        try:
            yield lease
        finally:
            lease.release()
