"""The one bridge from whatever makes tokens to the request's consumer.

A :class:`PieceChannel` holds at most ``capacity`` pieces (token bytes). Contract:

* one consumer task, which takes every waiting piece with :meth:`receive_batch`;
* producers: :meth:`put` (any thread, never blocks: check :attr:`room` first),
  :meth:`put_wait` (a worker thread: blocks while full, raises :class:`Aborted` after
  :meth:`abort`) or :meth:`send` (a Trio task: waits while full);
* :meth:`close` (Trio side): the consumer gets what is left, then ``trio.EndOfChannel``;
  :meth:`close_receiving` (the consumer leaves): sends raise ``trio.BrokenResourceError``,
  waiting threads wake with :class:`Aborted`;
* ``on_room`` is called on the Trio thread when the consumer makes room in a full channel.

Cancellation: :meth:`receive_batch` and :meth:`send` are ordinary Trio checkpoints; a
cancel while parked loses nothing. Why it replaces ``from_thread.run`` per token:
``docs/architecture.md``, "The per-token path".

A worker thread's wake (Linux): the first one goes through ``TrioToken.run_sync_soon``;
it asks for an eventfd, which the consumer then parks on (``trio.lowlevel.wait_readable``),
so each later wake is one ``write`` the loop's epoll hands straight to the consumer — no
trip through Trio's ``run_sync_soon`` task (``scripts/probes/thread_wake.py``). The
descriptor is written and closed only under the channel's lock, and closed once the
consumer has the end, leaves (:meth:`close_receiving`), or the channel is collected.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable

import trio

__all__ = ["Aborted", "PieceChannel"]

#: whether a thread's wake can be an eventfd the consumer parks on (Linux)
_EVENTFD = hasattr(os, "eventfd")


class Aborted(Exception):
    """Raised in a producer thread once its request is being torn down."""


class PieceChannel:
    __slots__ = (
        "_abort_gate",
        "_closed",
        "_condition",
        "_consumer",
        "_fd",
        "_fd_parked",
        "_fd_written",
        "_lock",
        "_pieces",
        "_producer",
        "_receiving_closed",
        "_token",
        "_wake_posted",
        "_want_fd",
        "aborted",
        "capacity",
        "on_room",
    )

    def __init__(self, capacity: int = 8) -> None:
        #: the eventfd a thread's wake writes (-1: none yet, or closed)
        self._fd = -1
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._condition = threading.Condition(self._lock)
        self._pieces: deque[bytes] = deque()
        self._closed = False
        self._receiving_closed = False
        #: set by :meth:`abort`: producer threads read it between steps
        self.aborted = False
        #: held until :meth:`abort` releases it: what :meth:`wait_aborted` waits on
        self._abort_gate = threading.Lock()
        self._abort_gate.acquire()
        self._token = trio.lowlevel.current_trio_token()
        self._consumer: trio.lowlevel.Task | None = None  # parked in receive_batch
        self._producer: trio.lowlevel.Task | None = None  # parked in send
        #: a ``run_sync_soon`` wake is on its way (reset by it alone)
        self._wake_posted = False
        #: the consumer is parked on ``_fd`` (not in ``wait_task_rescheduled``)
        self._fd_parked = False
        #: ``_fd`` was written since the consumer parked on it (read, and reset, by it)
        self._fd_written = False
        #: a thread woke the consumer: its next park makes ``_fd``
        self._want_fd = False
        self.on_room: Callable[[], None] | None = None

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)

    # ------------------------------------------------------------ producers

    @property
    def room(self) -> int:
        """Pieces that fit before the channel is full (read from any thread)."""
        return self.capacity - len(self._pieces)

    def put(self, piece: bytes) -> None:
        """Append ``piece`` (any thread). Never blocks; wakes a parked consumer."""
        with self._lock:
            self._pieces.append(piece)
            post = self._wake_locked()
        if post:
            self._post_wake()

    def _wake_locked(self) -> bool:
        # Under the lock, a piece just added: wake a parked consumer once. Parked on the
        # eventfd: written here (under the lock, so never after it is closed); parked
        # otherwise: True, the caller posts the wake (and the next park gets an eventfd).
        if self._consumer is None:
            return False
        if self._fd_parked:
            self._write_fd_locked()
            return False
        if self._wake_posted:
            return False
        self._wake_posted = True
        self._want_fd = _EVENTFD
        return True

    def _write_fd_locked(self) -> None:
        if not self._fd_written:
            self._fd_written = True
            os.eventfd_write(self._fd, 1)

    def _post_wake(self) -> None:
        # (RunFinishedError: the consumer's Trio run ended without waiting: nobody to wake)
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._posted_wake)

    def _posted_wake(self) -> None:
        with self._lock:
            self._wake_posted = False
        self._wake_consumer()

    def put_wait(self, piece: bytes) -> None:
        """Append ``piece`` from a worker thread, waiting while the channel is full.

        Raises :class:`Aborted` once :meth:`abort` or :meth:`close_receiving` was called."""
        with self._condition:
            while len(self._pieces) >= self.capacity and not self.aborted:
                self._condition.wait()
            if self.aborted:
                raise Aborted
            self._pieces.append(piece)
            post = self._wake_locked()
        if post:
            self._post_wake()

    async def send(self, piece: bytes) -> None:
        """Append ``piece`` from a Trio task, waiting while the channel is full."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._receiving_closed:
                raise trio.BrokenResourceError("the consumer has left")
            if len(self._pieces) < self.capacity:
                break
            self._producer = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._producer = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        with self._lock:
            self._pieces.append(piece)
        self._wake_consumer()
        await trio.lowlevel.cancel_shielded_checkpoint()

    def abort(self) -> None:
        """Tell producer threads to stop (any thread): :meth:`put_wait` raises
        :class:`Aborted`, and :attr:`aborted` is true."""
        with self._condition:
            first = not self.aborted
            self.aborted = True
            self._condition.notify_all()
        if first:
            self._abort_gate.release()

    def wait_aborted(self, seconds: float) -> bool:
        """Block the calling worker thread up to ``seconds``, or until :meth:`abort`;
        whether the channel is aborted. One wake per call, not one per millisecond: a
        paced producer (the scripted backend) waits its step out here, on a lock that
        :meth:`abort` releases (a timed lock wait: no condition's waiter to make per
        step)."""
        if self.aborted:
            return True
        if seconds > 0 and self._abort_gate.acquire(timeout=seconds):
            self._abort_gate.release()  # (open for any other waiter)
            return True
        return self.aborted

    def close(self) -> None:
        """The producer is done (Trio thread): the consumer gets the rest, then the end."""
        self._closed = True
        self._wake_consumer()

    def close_receiving(self) -> None:
        """The consumer is leaving (Trio thread)."""
        self._receiving_closed = True
        self.abort()
        producer, self._producer = self._producer, None
        if producer is not None:
            trio.lowlevel.reschedule(producer)
        with self._lock:
            if self._consumer is None:  # (a consumer parked still: it closes it)
                self._close_fd_locked()

    def _close_fd_locked(self) -> None:
        # Under the lock, no task parked on it: no thread writes it after this.
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    # ------------------------------------------------------------- consumer

    def _wake_consumer(self) -> None:
        # On the Trio thread (directly, or posted by a producer thread).
        with self._lock:
            if self._fd_parked:
                self._write_fd_locked()
                return
            consumer, self._consumer = self._consumer, None
        if consumer is not None:
            trio.lowlevel.reschedule(consumer)

    async def receive_batch(self) -> list[bytes]:
        """Every piece waiting (at least one); ``trio.EndOfChannel`` once closed and empty."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            with self._lock:
                if self._pieces:
                    full = len(self._pieces) >= self.capacity
                    pieces = list(self._pieces)
                    self._pieces.clear()
                    if full:
                        self._condition.notify()
                    break
                if self._closed:
                    self._close_fd_locked()
                    raise trio.EndOfChannel
                if self._want_fd and self._fd < 0:
                    try:
                        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                    except OSError:  # (out of descriptors: the posted wake, as before)
                        self._want_fd = False
                self._consumer = trio.lowlevel.current_task()
                fd = self._fd
                self._fd_parked = fd >= 0
            if fd >= 0:
                await self._park_on_fd(fd)
            else:

                def abort(_: object) -> trio.lowlevel.Abort:
                    with self._lock:
                        self._consumer = None
                    return trio.lowlevel.Abort.SUCCEEDED

                await trio.lowlevel.wait_task_rescheduled(abort)
            parked = True
        producer, self._producer = self._producer, None
        if producer is not None:
            trio.lowlevel.reschedule(producer)
        if full and self.on_room is not None:
            self.on_room()
        if not parked:
            # (a checkpoint yields: pieces that were waiting went without one; a consumer
            # that parked has yielded already, and a second trip through the scheduler
            # per event is what a paced stream would pay for nothing)
            await trio.lowlevel.cancel_shielded_checkpoint()
        return pieces

    async def _park_on_fd(self, fd: int) -> None:
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            with self._lock:
                self._consumer = None
                self._fd_parked = False
                if self._fd_written:
                    self._fd_written = False
                    os.eventfd_read(fd)
                if self._receiving_closed:
                    self._close_fd_locked()
