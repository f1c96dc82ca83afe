"""A detachable stream's log (issue 48; docs/resumable-streams.md, "The stream log"):
the body bytes of one response as every reader sees them, in a bounded window.

Every body byte has an *offset* (from 0); every SSE event that is not a comment or a
keep-alive has an *id* (from 0, written into its bytes as ``id: K``, so offsets, ids
and what readers receive are one and the same). The log keeps the newest events, at
most ``max_events`` and ``max_bytes``; the oldest is dropped only when every cursor is
past it. So a reader that keeps up lets the window slide; with **nobody attached,
nothing is dropped**: the log fills and :meth:`StreamLog.append` waits — the job's
backpressure, the same pause a slow reader causes. The last bytes of a response are
always taken (a job never waits for a reader to end). Event-driven: every change sets
an event readers and the controller wait on; nothing polls.
"""

from __future__ import annotations

import collections
import time

import trio

from .._wire._sse import number_events

__all__ = ["BadOffset", "Cursor", "OffsetLost", "StreamLog"]


class OffsetLost(Exception):
    """An attach asks for bytes the log no longer holds."""


class BadOffset(Exception):
    """An offset before 0 or past the end."""


class Cursor:
    """One reader's place: the offset up to which its bytes were sent."""

    __slots__ = ("internal", "offset")

    def __init__(self, offset: int, *, internal: bool = False) -> None:
        self.offset = offset
        #: held back trimming but not counted as a reader (a persister)
        self.internal = internal


class StreamLog:
    """The window of one stream's body (the module docstring)."""

    def __init__(self, *, max_events: int, max_bytes: int, retry_ms: int | None = 1000) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.retry_ms = retry_ms
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_set = trio.Event()
        #: (id or None, offset, bytes) of each block held, oldest first
        self._entries: collections.deque[tuple[int | None, int, bytes]] = collections.deque()
        self.total_bytes = 0
        self.first_offset = 0
        self.held_bytes = 0
        self._held_events = 0
        self.next_id = 0
        self.finished = False
        self.closed = False
        self.started_at = time.time()
        self.completed_at = 0.0
        self.waiting = False
        self._sse = True
        self._cursors: set[Cursor] = set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ state

    @property
    def readers(self) -> int:
        return sum(1 for cursor in self._cursors if not cursor.internal)

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Return at the next change: an append, an attach or detach, a read sent, the
        producer starting or ending a wait, the end, the close."""
        await self._changed.wait()

    def set_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers
        # a stream's events are numbered; a whole answer (an error) is kept as it is
        self._sse = any(
            k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers
        )
        self.head_set.set()
        self._change()

    # ------------------------------------------------------------------ writing

    def _add(self, data: bytes) -> None:
        if not self._sse:
            self._entries.append((None, self.total_bytes, data))
            self.total_bytes += len(data)
            self.held_bytes += len(data)
            return
        retry = self.retry_ms if self.next_id == 0 else None
        for event_id, block in number_events(data, self.next_id, retry_ms=retry):
            self._entries.append((event_id, self.total_bytes, block))
            self.total_bytes += len(block)
            self.held_bytes += len(block)
            if event_id is not None:
                self._held_events += 1
                self.next_id = event_id + 1

    def _over(self) -> bool:
        return self._held_events > self.max_events or self.held_bytes > self.max_bytes

    def _trim(self) -> None:
        """Drop the oldest blocks while over a bound and every cursor is past them."""
        lowest = min((cursor.offset for cursor in self._cursors), default=None)
        while self._entries and self._over():
            event_id, offset, block = self._entries[0]
            if lowest is None or lowest < offset + len(block):
                return  # nobody attached, or someone still needs it: nothing dropped
            self._entries.popleft()
            self.held_bytes -= len(block)
            if event_id is not None:
                self._held_events -= 1
            self.first_offset = offset + len(block)

    async def append(self, data: bytes, *, last: bool = False) -> None:
        """Append ``data`` (whole SSE blocks); then, unless it is the ``last``, wait while
        the window is over its bounds and cannot slide. Cancelled while waiting, the
        bytes stay appended. After :meth:`close`: the bytes are dropped, no wait."""
        if self.finished:
            raise RuntimeError("the stream's log has ended")
        if self.closed:
            return
        if data:
            self._add(data)
        self._trim()
        if last:
            self.finished = True
            self.completed_at = time.time()
            self._change()
            return
        self._change()
        if not self._over():
            return
        self.waiting = True
        self._change()
        try:
            while self._over() and not self.closed:
                await self._changed.wait()
                self._trim()
        finally:
            self.waiting = False
            self._change()

    def append_nowait(self, data: bytes) -> None:
        """Append without waiting (keep-alives): may go over the window."""
        if not self.finished and not self.closed:
            self._add(data)
            self._trim()
            self._change()

    def close(self) -> None:
        """Drop everything: readers waiting get the end; a waiting producer is
        released (its later appends are dropped)."""
        self.closed = True
        self._entries.clear()
        self.held_bytes = 0
        self._held_events = 0
        self._change()

    # ------------------------------------------------------------------ reading

    def attach(self, offset: int = 0, *, internal: bool = False) -> Cursor:
        if offset < 0 or offset > self.total_bytes:
            raise BadOffset(offset)
        if offset < self.first_offset or self.closed:
            raise OffsetLost(offset)
        cursor = Cursor(offset, internal=internal)
        self._cursors.add(cursor)
        self._change()
        return cursor

    def attach_after(self, event_id: int) -> Cursor:
        """A cursor at the first event whose id is greater than ``event_id``."""
        if event_id < -1:
            raise BadOffset(event_id)
        if event_id >= self.next_id - 1:
            return self.attach(self.total_bytes)
        for entry_id, offset, _ in self._entries:
            if entry_id is not None and entry_id > event_id:
                return self.attach(offset)
        raise OffsetLost(event_id)

    def detach(self, cursor: Cursor) -> None:
        if cursor in self._cursors:
            self._cursors.discard(cursor)
            self._trim()
            self._change()

    async def read(self, cursor: Cursor) -> bytes:
        """Everything held from the cursor to the end (not advancing it); waits while
        there is nothing new; ``b""`` at the end of a finished (or closed) log."""
        while cursor.offset >= self.total_bytes and not self.finished and not self.closed:
            await self._changed.wait()
        if self.closed or cursor.offset >= self.total_bytes:
            return b""
        # from the newest back: a reader that keeps up needs the last few blocks
        parts = []
        for _, offset, block in reversed(self._entries):
            if offset <= cursor.offset:
                parts.append(block[cursor.offset - offset :])
                break
            parts.append(block)
        parts.reverse()
        return b"".join(parts)

    def consumed(self, cursor: Cursor, n: int) -> None:
        cursor.offset += n
        self._trim()
        self._change()
