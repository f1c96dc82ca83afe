"""A detachable stream's log (issue 48): the body of one response, its events numbered,
in a bounded window that any number of readers follow, each from an offset of its own.

Addresses: every body byte has an *offset* (from 0; the head, ``http.response.start``,
is kept apart) and every event an *id* (:func:`~trioserve._wire.number_events`). The
ids are written into the bytes before they get an offset, so every reader receives the
same bytes at the same offsets. The window holds the newest ``max_events`` events and
``max_bytes`` bytes; its oldest entry is dropped only while the log is over a bound, a
reader is attached (an internal cursor is none), and every cursor (internal ones
included) is past that entry::

    a reader keeps up     the window slides under it; append never waits
    nobody attached       nothing is dropped; over a bound, append waits: the stream pauses
    a slow reader         it holds the window at its cursor; append waits for it
    the end (last=True)   always taken, over the window by at most that append

An attached reader therefore never loses its place; only a new attach can ask for bytes
that are gone (:class:`OffsetLost`). The design: ``docs/resumable-streams.md``, "The
stream log".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import trio

from .._wire import number_events

__all__ = ["BadOffset", "Cursor", "OffsetLost", "StreamLog"]


class OffsetLost(Exception):
    """An attach asks for bytes the window no longer holds (``stream_offset_lost``)."""


class BadOffset(Exception):
    """An offset past the end of the stream or negative (an event id below -1)."""


class Cursor:
    """One reader's place: ``offset``, the bytes up to which it has been sent.

    An *internal* cursor (the store's persister) holds back trimming as a reader does
    but is not counted in :attr:`StreamLog.readers`.
    """

    __slots__ = ("attached", "internal", "offset")

    def __init__(self, offset: int, internal: bool) -> None:
        self.offset = offset
        self.internal = internal
        self.attached = True

    def __repr__(self) -> str:
        kind = "internal " if self.internal else ""
        return f"<{kind}cursor at {self.offset}{'' if self.attached else ', detached'}>"


class StreamLog:
    """The head and body of one response, as every reader must see them.

    One producer (the job's sink) calls :meth:`append`; keep-alives and ends go in with
    :meth:`append_nowait`. Readers :meth:`attach`, loop on :meth:`read` then
    :meth:`consumed` with what they sent, and :meth:`detach`. Nothing here polls: each
    wait parks until the change it needs.
    """

    def __init__(self, *, max_events: int, max_bytes: int, retry_ms: int | None = 1000) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError("a stream log holds at least one event and one byte")
        self.max_events = max_events
        self.max_bytes = max_bytes
        #: the ``retry:`` field of the first event (an ``EventSource`` reconnects after it)
        self.retry_ms = retry_ms
        #: the head: the job's status and headers (``head_set``: they came, or the log closed)
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_set = trio.Event()
        #: every body byte ever appended (the end offset), dropped ones included
        self.total_bytes = 0
        #: the body bytes held now
        self.held_bytes = 0
        #: the id the next event gets
        self.next_id = 0
        #: the last bytes were appended (``append(last=True)``)
        self.finished = False
        #: the log was dropped (:meth:`close`)
        self.closed = False
        self.started_at = time.time()
        #: when the last bytes were appended; 0.0 while running
        self.completed_at = 0.0
        #: ``trio.current_time()`` of the last append (keep-alives are due after it)
        self.appended_at = 0.0
        #: attached cursors, internal ones not counted
        self.readers = 0
        #: the producer is blocked in :meth:`append`: the window is full and cannot slide
        self.waiting = False
        #: called with each event as it is numbered (its id, its block): a stored
        #: response's events are kept so (``_event_store.EventRecorder.add``)
        self.on_event: Callable[[int, bytes], None] | None = None
        self._entries: deque[tuple[int | None, int, bytes]] = deque()  # (id, offset, bytes)
        self._events = 0  # numbered entries held
        self._first_id = 0  # the oldest id held: the number of events dropped
        self._cursors: set[Cursor] = set()
        self._sse = True
        self._grown = trio.lowlevel.ParkingLot()  # readers: bytes appended, finished, closed
        self._room = trio.lowlevel.ParkingLot()  # the producer: the window may fit now
        self._changed = trio.lowlevel.ParkingLot()  # wait_changed

    @property
    def first_offset(self) -> int:
        """The offset of the oldest byte held (``total_bytes`` when none is)."""
        return self.total_bytes - self.held_bytes

    def set_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Keep the job's ``http.response.start`` (once)."""
        if self.head_set.is_set():
            raise RuntimeError("the stream's head is set already")
        self.status, self.headers = status, headers
        # a stream's events are numbered; a whole answer (an error before the stream
        # began) is kept as it is
        self._sse = any(
            k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers
        )
        self.head_set.set()
        if self._changed:
            self._changed.unpark_all()

    # -- the producer

    async def append(self, data: bytes, *, last: bool = False) -> None:
        """Number ``data``'s events and store them; then, if the window is over a bound
        and cannot slide (nobody attached, or a cursor holds it), wait until a reader's
        progress or attach lets it fit. ``last=True``: the end, never waits.

        The bytes are stored when the call begins, whatever happens to the wait (a
        cancel leaves them in the log), and it does not checkpoint unless it waits: it
        runs per token, and an end is taken in a cancelled scope too. Raises
        ``RuntimeError`` after the end and :class:`trio.BrokenResourceError` once the
        log is closed, also while it waits.
        """
        self.append_nowait(data, last=last)
        if last or self._fits():
            return
        self._set_waiting(True)
        try:
            while not self.closed and not self._fits():
                await self._room.park()
            if self.closed:
                raise trio.BrokenResourceError("the stream was dropped")
        finally:
            self._set_waiting(False)

    def append_nowait(self, data: bytes, *, last: bool = False) -> None:
        """Store ``data`` without waiting, over the window if need be (keep-alives and
        ends; ``last=True`` marks the end). The same errors as :meth:`append`."""
        if self.closed:
            raise trio.BrokenResourceError("the stream was dropped")
        if self.finished:
            raise RuntimeError("the stream's log has ended")
        retry = self.retry_ms if self.next_id == 0 else None
        entries, offset, on_event = self._entries, self.total_bytes, self.on_event
        blocks = (
            number_events(data, self.next_id, retry_ms=retry) if self._sse else [(None, data)] * bool(data)
        )
        for event_id, block in blocks:
            entries.append((event_id, offset, block))
            offset += len(block)
            if event_id is not None:
                self._events += 1
                self.next_id = event_id + 1
                if on_event is not None:
                    on_event(event_id, block)
        self.held_bytes += offset - self.total_bytes
        self.total_bytes = offset
        self.appended_at = trio.current_time()
        if last:
            self.finished = True
            self.completed_at = time.time()
        self._trim()
        if self._grown:
            self._grown.unpark_all()
        if self._changed:
            self._changed.unpark_all()

    # -- readers

    def attach(self, offset: int = 0, *, internal: bool = False) -> Cursor:
        """A cursor at byte ``offset`` (anywhere, inside an event too)."""
        if offset < 0 or offset > self.total_bytes:
            raise BadOffset(f"offset {offset} is not in the stream (0 to {self.total_bytes})")
        if self.closed or offset < self.first_offset:
            raise OffsetLost(f"offset {offset} is no longer held (the oldest is {self.first_offset})")
        cursor = Cursor(offset, internal)
        self._cursors.add(cursor)
        if not internal:
            self.readers += 1
        self._progress()
        return cursor

    def attach_after(self, event_id: int, *, internal: bool = False) -> Cursor:
        """A cursor at the first byte of the event after ``event_id`` (-1: the first
        event; the last id or past it: the end). Keep-alives between the two events are
        skipped."""
        if event_id < -1:
            raise BadOffset(f"event id {event_id} is negative")
        wanted = event_id + 1
        if wanted >= self.next_id:
            return self.attach(self.total_bytes, internal=internal)
        if self.closed or wanted < self._first_id:
            raise OffsetLost(f"event {wanted} is no longer held (the oldest is {self._first_id})")
        for entry_id, offset, _ in reversed(self._entries):
            if entry_id == wanted:
                return self.attach(offset, internal=internal)
        raise AssertionError(f"event {wanted} is held but not found")  # pragma: no cover

    def detach(self, cursor: Cursor) -> None:
        """The reader left (idempotent); the window may slide and the producer go on."""
        if not cursor.attached:
            return
        cursor.attached = False
        self._cursors.discard(cursor)
        if not cursor.internal:
            self.readers -= 1
        self._progress()

    async def read(self, cursor: Cursor) -> bytes:
        """Everything held from the cursor to the end, as one ``bytes``, without
        advancing it (:meth:`consumed` does); waits while there is nothing new. ``b""``:
        the end was read, or the log was closed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.closed:
            offset = cursor.offset
            if offset < self.total_bytes:
                if offset < self.first_offset:
                    raise OffsetLost(f"offset {offset} is no longer held (a detached cursor)")
                return self._bytes_from(offset)
            if self.finished:
                break
            await self._grown.park()
        return b""

    def consumed(self, cursor: Cursor, n: int) -> None:
        """The reader sent ``n`` more bytes: advance its cursor (the window may slide)."""
        if n < 0 or cursor.offset + n > self.total_bytes:
            raise ValueError(f"cannot advance {cursor!r} by {n} bytes (the end is {self.total_bytes})")
        cursor.offset += n
        self._progress()

    async def wait_changed(self) -> None:
        """Return at the next change: bytes appended, a cursor attached, detached or
        advanced, ``waiting`` flipped, the head set, the end, the log closed."""
        await self._changed.park()

    def close(self) -> None:
        """Drop everything (the stream is dropped): a reader blocked in :meth:`read`
        gets ``b""``, the producer blocked in :meth:`append` gets
        :class:`trio.BrokenResourceError`, and ``head_set`` is set (``status`` stays
        ``None`` if no head came). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._entries.clear()
        self.held_bytes = self._events = 0
        self.head_set.set()
        self._grown.unpark_all()
        self._room.unpark_all()
        self._changed.unpark_all()

    # -- the window

    def _fits(self) -> bool:
        return self._events <= self.max_events and self.held_bytes <= self.max_bytes

    def _trim(self) -> None:
        """Drop the oldest entries while over a bound, a reader is attached and every
        cursor is past them."""
        if not self.readers or self._fits():
            return
        low = min(cursor.offset for cursor in self._cursors)
        entries = self._entries
        while entries and not self._fits():
            event_id, offset, block = entries[0]
            if offset + len(block) > low:
                return
            entries.popleft()
            self.held_bytes -= len(block)
            if event_id is not None:
                self._events -= 1
                self._first_id = event_id + 1

    def _progress(self) -> None:
        """A cursor moved, came or went: slide the window, wake a producer it fits."""
        self._trim()
        if self.waiting and self._fits():
            self._room.unpark_all()
        if self._changed:
            self._changed.unpark_all()

    def _set_waiting(self, waiting: bool) -> None:
        self.waiting = waiting
        if self._changed:
            self._changed.unpark_all()

    def _bytes_from(self, offset: int) -> bytes:
        parts: list[bytes] = []
        for _, start, block in reversed(self._entries):
            if start <= offset:
                parts.append(block[offset - start :] if start < offset else block)
                break
            parts.append(block)
        parts.reverse()
        return b"".join(parts)
