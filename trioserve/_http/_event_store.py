"""A stored ``background`` + ``stream`` response's events, kept in the response store
(issue 48; docs/resumable-streams.md, "Across a restart"), and read back when its
in-memory log is gone.

:class:`EventRecorder` keeps them as the stream makes them: the log hands it each
numbered event (:attr:`~._stream_log.StreamLog.on_event`: an append to a list), and
its task writes them in batches — :data:`BATCH_EVENTS` events or :data:`BATCH_SECONDS`
after the first unwritten one, whichever comes first, then the rest at the stream's
end (its last event included: a graceful shutdown's ``response.incomplete`` too) — in
the store's worker thread, never on the event loop. A batch that does not fit its
key's quota (or that the database refuses) stops the keeping of that response's
events, noted in the store; the live stream never notices.

:func:`stored_replay` answers ``GET /v1/responses/{id}?stream=true`` from the store:
the events after a sequence number, ended as the live stream ended, or — where the
stored events stop short of an end — by the end the stored object says (a restart's
``response.incomplete``, cause ``shutdown``), or by an ``error`` event naming why they
stopped (the key's quota).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass

import trio

from .._wire import encode_json
from ._response_db import RESTART, STOPPED, TERMINAL, StoreFullError, event_type, terminal_event
from ._stored import StoredResponses
from ._stream_log import StreamLog

__all__ = ["BATCH_EVENTS", "BATCH_SECONDS", "EventRecorder", "StoredReplay", "replay_log", "stored_replay"]

logger = logging.getLogger("trioserve.responses")

#: a batch is written once it holds this many events…
BATCH_EVENTS = 64
#: …or this many seconds after its first event, whichever comes first (what a SIGKILL
#: loses at most, but for a write in progress)
BATCH_SECONDS = 0.5


class EventRecorder:
    """Keeps one stored response's events in the store, in batches (the module
    docstring). :meth:`add` is the log's ``on_event``; :meth:`run` is a task of the
    stream's job; :meth:`close` writes what is left once the stream has ended."""

    def __init__(
        self,
        service: StoredResponses,
        response_id: str,
        owner: str,
        *,
        batch_events: int = BATCH_EVENTS,
        interval: float = BATCH_SECONDS,
    ) -> None:
        self.service = service
        self.response_id = response_id
        self.owner = owner
        self.batch_events = batch_events
        self.interval = interval
        #: the events not written yet (consecutive), and the first one's sequence number
        self._pending: list[bytes] = []
        self._first = 0
        #: the sequence number the next written event has
        self.next_seq = 0
        #: why its events are no longer kept (``quota``, ``error``, ``gone``: deleted)
        self.stopped: str | None = None
        self._noted = False
        self._waiting = trio.Event()  # an event is pending
        self._full = trio.Event()  # a batch is full

    def add(self, event_id: int, block: bytes) -> None:
        """One event, as the log numbers it (per token: an append)."""
        pending = self._pending
        pending.append(block)
        if len(pending) == 1:
            self._first = event_id
            self._waiting.set()
        elif len(pending) >= self.batch_events:
            self._full.set()

    async def run(self) -> None:
        """Write a batch when it is full or :attr:`interval` after its first event."""
        while True:
            await self._waiting.wait()
            with trio.move_on_after(self.interval):
                await self._full.wait()
            await self.flush()

    async def close(self) -> None:
        """The stream ended (its task is done): write what is left (call it shielded).
        Never raises: its response's end is stored next, whatever happened here."""
        try:
            await self.flush()
            if self.stopped in STOPPED and not self._noted:
                await self._note()
        except Exception:
            logger.exception("response %s: its last events could not be stored", self.response_id)

    async def flush(self) -> None:
        """Write the pending events as one batch (in the store's thread)."""
        batch, self._pending = self._pending, []
        self._waiting, self._full = trio.Event(), trio.Event()
        if not batch or self.stopped is not None:
            return
        first, data = self._first, b"".join(batch)
        last = first + len(batch) - 1
        store = self.service.store
        try:
            kept = await store.run(store.store.append_events, self.response_id, self.owner, first, last, data)
        except StoreFullError as exc:
            self._stop("quota", exc)
            await self._note()
            return
        except (sqlite3.Error, OSError) as exc:
            self._stop("error", exc)
            return
        if not kept:
            self.stopped = "gone"  # (deleted, or evicted by its key's newer responses)
            return
        self.next_seq = last + 1

    def _stop(self, reason: str, exc: Exception) -> None:
        self.stopped = reason
        what = f"its events from sequence_number {self.next_seq} on; its stream goes on"
        self.service.failed(self.response_id, "full" if reason == "quota" else "error", exc, what)

    async def _note(self) -> None:
        """Note in the store why the events stop (a replay's error says it)."""
        assert self.stopped is not None
        store = self.service.store
        try:
            await store.run(
                store.store.stop_events, self.response_id, self.owner, self.next_seq, self.stopped
            )
        except (sqlite3.Error, OSError):
            return  # (a replay ends with a generic error instead)
        self._noted = True


@dataclass(slots=True)
class StoredReplay:
    """What a replay from the store sends: ``body`` (whole events), and whether the
    asked sequence number is at or past the stream's end (an ``EventSource``'s
    reconnect there gets 204)."""

    body: bytes
    past_end: bool


def _error_event(sequence: int, code: str, message: str) -> bytes:
    payload = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": sequence}
    return b"id: %d\nevent: error\ndata: %s\n\n" % (sequence, encode_json(payload))


_STOP_WORDS = {
    "quota": (
        "store_quota",
        "its key's response store quota (--responses-max-mb-per-key; without keys, --responses-max-mb) "
        "was reached",
    ),
    "error": ("store_error", "the response store could not write them (see /health)"),
}


async def stored_replay(
    service: StoredResponses, response_id: str, owner: str, after: int | None, *, by_header: bool
) -> StoredReplay | None:
    """The stored events of ``response_id`` (``owner``'s) after sequence number
    ``after`` (``None``: all), ended (the module docstring); ``None`` if it has none
    (no such response, or not a streamed one). ``by_header``: asked by
    ``Last-Event-ID`` (a reconnecting ``EventSource``: an end it is past is a 204,
    never a new event)."""
    n = -1 if after is None else after
    found = await service.store.run(service.store.store.events, response_id, owner, n)
    if found is None or not found.batches:
        return None
    batches = [b for b in found.batches if b.data]
    stopped = next((b.note for b in found.batches if b.note in STOPPED), None)
    last_seq = max((b.last for b in batches), default=-1)
    out: list[bytes] = []
    last_block = b""
    for batch in batches:
        blocks = batch.blocks()
        if blocks:
            last_block = blocks[-1]
        out += blocks[max(0, n + 1 - batch.first) :] if batch.last > n else []
    kind = event_type(last_block)
    restarted = bool(batches) and batches[-1].note == RESTART
    if kind in TERMINAL and not (restarted and n >= last_seq and not by_header):
        return StoredReplay(b"".join(out), past_end=n >= last_seq)
    if by_header and n > last_seq:
        return StoredReplay(b"", past_end=True)
    # the stored events stop short of an end: the end they lack, numbered after both
    # the last one kept and the one the client had (events a SIGKILL lost included)
    sequence = max(last_seq, n) + 1
    response = found.response
    if kind in TERMINAL:  # (a restart's end, the client past it)
        event = json.loads(last_block.split(b"\ndata: ", 1)[1])
        out = [terminal_event(str(kind), event["response"], sequence)]
    elif stopped is not None:
        code, why = _STOP_WORDS[stopped]
        message = (
            f"the events of {response_id!r} after sequence_number {last_seq} were not stored: {why}; "
            "read the response whole without stream"
        )
        out.append(_error_event(sequence, code, message))
    elif response.status in ("queued", "in_progress"):
        message = f"the events of {response_id!r} after sequence_number {last_seq} are not kept"
        out.append(_error_event(sequence, "stream_not_kept", message))
    else:
        status = response.status if response.status in ("completed", "failed") else "incomplete"
        out.append(terminal_event(f"response.{status}", response.body, sequence))
    return StoredReplay(b"".join(out), past_end=False)


def replay_log(body: bytes) -> StreamLog:
    """A finished log holding ``body`` as it is (already numbered): a reader follows
    it as it follows a live one (its watchers, stall timer and log line)."""
    log = StreamLog(max_events=1, max_bytes=max(1, len(body)), retry_ms=None)
    log.set_head(200, [])  # (no content type: the bytes are kept as they are)
    log.append_nowait(body, last=True)
    return log
