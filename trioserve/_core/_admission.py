"""Admission: a fixed number of slots and a bounded FIFO queue in front of them.

A request either gets a slot, waits in the queue (first come, first served), or is
refused at once with :class:`OverloadedError` — never queued without bound. Waiting is
an ordinary Trio wait, so a queued request that is cancelled (client gone, deadline,
shutdown) leaves the queue at that instant; nothing polls.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from ._exceptions import OverloadedError

__all__ = ["Admission", "AdmissionSnapshot", "Reservation", "SlotLease"]


@dataclass(frozen=True, kw_only=True)
class AdmissionSnapshot:
    """What an :class:`Admission` holds at one instant (for /health, metrics, tests)."""

    slots: int
    in_use: int
    #: waiting in the queue (reserved places included: they are about to)
    queued: int
    max_queue: int


class Reservation:
    """A place held between :meth:`Admission.reserve` and :meth:`Admission.slot`.
    :meth:`release` is idempotent."""

    __slots__ = ("_admission", "released")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission.reserved -= 1


class SlotLease:
    """Held slots (one, or ``count`` for a request with ``n`` choices). :meth:`release`
    is idempotent, so the holder can give the slots back as soon as inference ends,
    while the ``async with`` guarantees it at exit."""

    __slots__ = ("_admission", "count", "released")

    def __init__(self, admission: Admission, count: int = 1) -> None:
        self._admission = admission
        self.count = count
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._give_back(self.count)


class _Waiter:
    __slots__ = ("count", "granted")

    def __init__(self, count: int) -> None:
        self.count = count
        self.granted = trio.Event()


class Admission:
    """``slots`` concurrent holders; at most ``max_queue`` waiting, served in order.

    A request that needs several slots (``n`` choices) waits for all of them at once,
    in its place in the queue: it never holds some while waiting for the rest, and no
    later request overtakes it (first come, first served, whatever each needs).

    Args:
        slots: how many requests may hold a slot at once (≥ 1).
        max_queue: how many may wait for one (≥ 0); beyond that, requests are refused.
        expected_service_time: a seconds-per-request estimate (the engine keeps it
            updated from measurements) used for ``Retry-After`` and for refusing
            requests whose deadline would pass while they are still queued; 0 means
            unknown, and then nothing is refused on that ground.
    """

    def __init__(self, slots: int, max_queue: int, *, expected_service_time: float = 0.0) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if max_queue < 0:
            raise ValueError("max_queue must be at least 0")
        self.slots = slots
        self.max_queue = max_queue
        self.expected_service_time = expected_service_time
        self._free = slots
        #: the queue, first come first served: the head is granted as soon as its count
        #: of slots is free
        self._waiters: deque[_Waiter] = deque()
        self.queued = 0
        #: places held by requests between the check and the queue (see reserve())
        self.reserved = 0

    @property
    def in_use(self) -> int:
        return self.slots - self._free

    def snapshot(self) -> AdmissionSnapshot:
        return AdmissionSnapshot(
            slots=self.slots, in_use=self.in_use, queued=self.queued + self.reserved, max_queue=self.max_queue
        )

    def _give_back(self, count: int) -> None:
        self._free += count
        self._grant()

    def _grant(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0].count <= self._free:
            waiter = waiters.popleft()
            self._free -= waiter.count
            waiter.granted.set()

    async def _acquire(self, count: int) -> None:
        if not self._waiters and count <= self._free:
            await trio.lowlevel.checkpoint_if_cancelled()
            self._free -= count
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        waiter = _Waiter(count)
        self._waiters.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():
                self._give_back(count)  # granted as the cancel arrived: not taken
            else:
                self._waiters.remove(waiter)
                self._grant()  # the ones behind it may fit now
            raise

    def retry_after(self) -> float:
        """Seconds a refused client should wait before trying again."""
        backlog = (self.queued + self.in_use) / self.slots
        return max(1.0, math.ceil(backlog * self.expected_service_time))

    def check(self) -> None:
        """Raise :class:`OverloadedError` if a request arriving now would be refused:
        ``slots`` running plus ``max_queue`` waiting (and reserved) are taken, or the
        caller's deadline would pass while it waits."""
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
        self, reservation: Reservation | None = None, *, count: int = 1
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
        self.queued += 1
        try:
            await self._acquire(count)
        finally:
            self.queued -= 1
        lease = SlotLease(self, count)
        try:
            yield lease
        finally:
            lease.release()
