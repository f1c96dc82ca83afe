"""A lease of admission's slots, a place held in its queue, and the byte budget of
paused requests' saved states (the parts :class:`~._admission.Admission` hands out;
docs/scheduling.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import trio

__all__ = ["DEFAULT_TICKET", "PauseBudget", "Reservation", "SlotLease", "Ticket", "unbounded_pause_budget"]


class Admitting(Protocol):
    """What a lease or a reservation changes in the :class:`~._admission.Admission`
    that handed it out (its counters, its queue, its grants): a protocol, so that the
    lease names no class of the module that imports it."""

    queued: int
    reserved: int
    paused: int
    parked: int
    _pausing: int

    @property
    def pause_budget(self) -> PauseBudget: ...

    def _give_back(self, lease: SlotLease) -> None: ...

    def _grant(self) -> None: ...

    def _enqueue(self, lease: SlotLease) -> Any: ...  # (its waiter)

    async def _wait(self, waiter: Any) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Ticket:
    """Where a request stands in the queue (the HTTP layer makes it from the body's
    ``priority`` and the API key's entry in the keys file)."""

    #: lower first; any integer (vLLM's ``priority``)
    priority: int = 0
    #: whose share it uses (a hash of the API key; ``""``: the one local user)
    account: str = ""
    #: the account's weight in the fair share (> 0)
    weight: float = 1.0
    #: the most slots the account may hold at once (``None``: no limit)
    concurrency: int | None = None


#: the ticket of a request that names none
DEFAULT_TICKET = Ticket()


class PauseBudget:
    """The bytes that paused requests' saved states may hold at once, shared by every
    model's :class:`Admission` (``--pause-ram``). A pause that would not fit is not
    asked: the better-ranked request waits in the queue as it would without pausing.

    Charged at the ask with the lease's estimate (:meth:`SlotLease.enable_pause`'s
    ``state_bytes``), corrected to the state's real size when the holder pauses, given
    back when the lease runs again, ends, or declines. Used on the event loop only."""

    __slots__ = ("limit", "refused", "used")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("the pause budget must be 0 or more bytes")
        self.limit = limit
        self.used = 0
        #: waiters that found it spent and waited instead of pausing someone (each
        #: counted once however often the queue is ranked again)
        self.refused = 0

    def take(self, estimate: int) -> int | None:
        """Charge ``estimate`` bytes if they fit; return what was charged (``None``, and
        nothing charged, if not). An unknown size (0: the backend has not measured a
        state yet) holds the rest of a bounded budget until the pause reports its real
        size, so a burst of asks before the first measurement cannot overrun it; a
        spent budget refuses it."""
        if estimate <= 0 and self.limit < _UNBOUNDED:
            estimate = self.limit - self.used
        if self.used + max(estimate, 1) > self.limit:
            return None
        self.used += estimate
        return estimate

    def give(self, size: int) -> None:
        self.used -= size


#: no bound on paused states (a library user who builds an Admission alone)
def unbounded_pause_budget() -> PauseBudget:
    return PauseBudget(_UNBOUNDED)


_UNBOUNDED = 1 << 62


class Reservation:
    """A place held between :meth:`Admission.reserve` and :meth:`Admission.slot`.
    :meth:`release` is idempotent."""

    __slots__ = ("_admission", "released")

    def __init__(self, admission: Admitting) -> None:
        self._admission = admission
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission.reserved -= 1


def _nothing() -> None:
    pass


def _no_usage() -> int:
    return 0


class SlotLease:
    """Held slots (one, or ``count`` for a request with ``n`` choices). :meth:`release`
    is idempotent, so the holder can give the slots back as soon as inference ends,
    while the ``async with`` guarantees it at exit.

    Preemption: a holder that can set its work aside calls :meth:`enable_pause` once
    it can act on an ask (its hook installed: never before, or the ask is lost); when
    admission asks (``pause_asked``), it sets the work aside and calls :meth:`pause`
    (or :meth:`decline` if it cannot).

    Setting aside until someone reads (a detached stream whose log is full: docs/
    resumable-streams.md): :meth:`set_aside` asks the same hook, and the :meth:`pause`
    that follows waits for its ``until`` event *outside* the queue (``parked``, not
    counted toward ``max_queue``) before it queues for the slots again. While its holder
    installs :attr:`yielding`, the lease gives its slots to any waiter at once."""

    __slots__ = (
        "_admission",
        "arrival",
        "charged",
        "count",
        "ending",
        "held_bytes",
        "on_pause",
        "pausable",
        "pause_asked",
        "paused",
        "pauses",
        "released",
        "state_bytes",
        "ticket",
        "until",
        "usage",
        "yielding",
    )

    def __init__(self, admission: Admitting, count: int = 1, ticket: Ticket = DEFAULT_TICKET) -> None:
        self._admission = admission
        self.count = count
        self.ticket = ticket
        self.released = False
        #: the arrival order it was queued in (a paused lease keeps it)
        self.arrival = 0
        #: tokens served so far (evaluated + generated), for the fair share; the holder
        #: sets it; ``charged``: the part already counted
        self.usage: Callable[[], int] = _no_usage
        self.charged = 0
        self.pausable = False
        self.on_pause: Callable[[], None] = _nothing
        #: the bytes its saved state would take if paused now (an estimate; 0: unknown)
        self.state_bytes: Callable[[], int] = _no_usage
        #: bytes charged to the pause budget: the estimate once asked, the real size
        #: once paused
        self.held_bytes = 0
        self.pause_asked = False
        #: between :meth:`pause` giving the slots back and getting them again
        self.paused = False
        self.pauses = 0
        #: :meth:`will_end` was called: its slots are counted as coming back until it
        #: is released (a decline on its way out must not uncount them)
        self.ending = False
        #: set by :meth:`set_aside`: the event the next :meth:`pause` waits for before
        #: it queues
        self.until: trio.Event | None = None
        #: installed by a holder whose work nobody waits for (a detached stream with a
        #: full log): admission calls it for any waiter that needs a slot, before
        #: ranking outranked leases; it returns whether the slots will come back (set
        #: aside, or the work ended: :meth:`will_end`)
        self.yielding: Callable[[], bool] | None = None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._give_back(self)

    def enable_pause(
        self, on_pause: Callable[[], None], *, state_bytes: Callable[[], int] = _no_usage
    ) -> None:
        """The holder can now act on an ask to pause (``on_pause``, called on the event
        loop; it must not block). A waiter that already outranks this lease is served
        at once (it may have arrived while the holder was starting). ``state_bytes``:
        an estimate of what a pause would save, for the pause budget."""
        self.on_pause = on_pause
        self.state_bytes = state_bytes
        self.pausable = not self.released
        if self.pausable:
            self._admission._grant()

    def disable_pause(self) -> None:
        """The holder can no longer act on an ask (its work is ending): an ask in
        flight is declined."""
        self.pausable = False
        self.on_pause = _nothing
        if self.pause_asked and not self.released and not self.ending:
            self.decline()

    def set_aside(self, until: trio.Event) -> bool:
        """Ask the holder to set its work aside (its ``on_pause`` hook) and, once it has
        paused, to wait for ``until`` before it queues for its slots again. Charged to
        the pause budget as an ask is; ``False`` (nothing asked) if the lease cannot
        pause now, is asked already, or the budget cannot take its state."""
        admission = self._admission
        if self.released or not self.pausable or self.pause_asked:
            return False
        charged = admission.pause_budget.take(self.state_bytes())
        if charged is None:
            return False
        self.held_bytes = charged
        self.pause_asked = True
        self.until = until
        admission._pausing += self.count
        self.on_pause()
        return True

    def will_end(self) -> None:
        """The holder will end its work and release the lease (e.g. evicted for a
        waiter): its slots are counted as coming back, as a pause's are."""
        if not self.released and not self.pause_asked:
            self.pause_asked = True
            self.ending = True
            self._admission._pausing += self.count

    async def pause(self, saved_bytes: int | None = None) -> None:
        """Give the slots back and wait in the queue (this lease's ticket, its original
        arrival) until they are granted again. The holder has set its work aside;
        ``saved_bytes``: the size of what it saved (charged to the pause budget until
        the lease runs again; default: the estimate charged at the ask).

        A paused lease counts toward the queue's bound (``max_queue``) and keeps its
        account's fair-share counter while it waits.

        Cancellation: cancelled while waiting, the lease stays released (its holder
        ends); nothing is left in the queue."""
        admission = self._admission
        if self.released:
            raise RuntimeError("a released lease cannot pause")
        if saved_bytes is not None:
            admission.pause_budget.give(self.held_bytes)
            admission.pause_budget.used += saved_bytes
            self.held_bytes = saved_bytes
        self.pauses += 1
        self.released = True
        self.paused = True
        until, self.until = self.until, None
        try:
            if until is not None and not until.is_set():
                # set aside: the slots go back, and it waits outside the queue
                admission.parked += 1
                admission._give_back(self)
                try:
                    await until.wait()
                finally:
                    admission.parked -= 1
                admission.paused += 1
                admission.queued += 1
                waiter = admission._enqueue(self)
                admission._grant()
            else:
                admission.paused += 1
                admission.queued += 1
                # into the queue before the slots go back: its account stays active
                # (its fair-share counter kept), and the grant that follows ranks it
                waiter = admission._enqueue(self)
                admission._give_back(self)
            try:
                await admission._wait(waiter)
            finally:
                admission.paused -= 1
                admission.queued -= 1
        finally:
            self.paused = False
            admission.pause_budget.give(self.held_bytes)
            self.held_bytes = 0
        self.released = False

    def decline(self) -> None:
        """The holder cannot pause (its work ended, or cannot be set aside): admission
        looks for another way."""
        self.until = None
        if self.ending:
            return  # (its slots come back with its release: _give_back settles them)
        if self.pause_asked:
            self.pause_asked = False
            self._admission._pausing -= self.count
            self._admission.pause_budget.give(self.held_bytes)
            self.held_bytes = 0
        self.pausable = False
        self._admission._grant()
