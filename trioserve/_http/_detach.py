"""Detachable streams (issue 48; the design: docs/resumable-streams.md): the registry by
(owner, conversation id), their bounds, the nursery their jobs run in, and the
controller of each one's life while nobody reads it.

A detachable stream is a *job* (an :class:`~._request.InFlightRequest` no connection
holds, run by the generation handler like a background response) writing its response
into a :class:`~._stream_log.StreamLog` that any number of readers follow. The
:class:`DetachController` of a stream watches its log: with no reader, the detach
timer runs (cause ``detach_timeout``); with no reader and a full log (the job paused:
the log's backpressure) it parks the job after ``park_after`` seconds — its lease set
aside until a reader is back (:meth:`~trioserve._core._lease.SlotLease.set_aside`) —
and yields its slot at once to any waiter (parked, or if it cannot park, ended with
cause ``evicted``); while a reader waits on a silent log (the job parked and queued for
a slot again, a long prefill after a resume, a slow model) it writes the dialect's
keep-alive into the log every ``--heartbeat-interval``. Event-driven: it wakes on the
log's changes and its own timers, never on a poll.

A key's entry in the keys file bounds its own streams (``detach_streams``,
``detach_timeout``, ``detach_log_kib``; :func:`keys_refusal` holds a file to the
server's flags); a stream keeps the bounds it was opened with.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import trio

from .._core._exceptions import InvalidRequestError, OverloadedError, PermissionDeniedError
from ._request import Phase
from ._stream_log import StreamLog

if TYPE_CHECKING:
    from .._core._lease import SlotLease
    from ._accounts import Account, KeysFile
    from ._exchange import Message, Send
    from ._request import InFlightRequest

__all__ = [
    "DetachController",
    "DetachSettings",
    "DetachedStream",
    "DetachedStreams",
    "keys_refusal",
    "log_sink",
    "open_detached_streams",
]

logger = logging.getLogger("trioserve.http")

State = Literal["starting", "running", "paused", "parked", "finished"]


@dataclass(frozen=True, kw_only=True)
class DetachSettings:
    """The bounds of detachable streams (``--detach-*``; docs/resumable-streams.md,
    "Bounds, flags and their answers")."""

    #: a stream's log window: events and bytes (≈ 27 s of one stream of the default
    #: model on 2 cores)
    log_events: int = 1280
    log_bytes: int = 1 << 20
    #: seconds a full log nobody reads waits before its job is parked
    park_after: float = 2.0
    #: seconds without a reader before a running stream ends (cause
    #: ``detach_timeout``), and that a finished log is kept after its end
    timeout: float = 300.0
    #: detachable streams at once, server-wide, and per API key (running and kept)
    max_streams: int = 64
    per_key: int = 8

    def of(self, account: Account | None) -> tuple[int, float, int]:
        """``account``'s bounds: its streams at once, its detach timeout (seconds) and
        its log's bytes — its keys-file fields where it has them, else the flags'."""
        if account is None:
            return self.per_key, self.timeout, self.log_bytes
        streams, seconds, kib = account.detach_streams, account.detach_timeout, account.detach_log_kib
        return (
            self.per_key if streams is None else streams,
            self.timeout if seconds is None else min(self.timeout, seconds),
            self.log_bytes if kib is None else min(self.log_bytes, kib * 1024),
        )


def keys_refusal(keys: KeysFile, settings: DetachSettings | None) -> str | None:
    """Why ``keys`` cannot be used with these flags (``None``: it can): a key's
    ``detach_timeout`` or ``detach_log_kib`` over the server's — a key's may only be
    shorter or smaller (the flags bound what one stream may hold, for every key)."""
    if settings is None:
        return None  # (--detach-max 0: nothing is detached, the fields mean nothing)
    entries = [(f"[[key]] #{n} ({a.name})", a) for n, a in enumerate(keys.accounts, 1)]
    for where, account in [("[defaults]", keys.defaults), *entries]:
        if account.detach_timeout is not None and account.detach_timeout > settings.timeout:
            return (
                f"{where}: detach_timeout {account.detach_timeout:g} is over the server's --detach-timeout "
                f"{settings.timeout:g}: a key's may only be shorter (raise the flag, or lower the field)"
            )
        kib = account.detach_log_kib
        if kib is not None and kib * 1024 > settings.log_bytes:
            return (
                f"{where}: detach_log_kib {kib} is over the server's --detach-log-kib "
                f"{settings.log_bytes // 1024}: a key's window may only be smaller"
            )
    return None


class DetachedStream:
    """One detachable stream: its log, its job and whether someone reads it."""

    __slots__ = (
        "background",
        "conversation_id",
        "dropped",
        "job",
        "log",
        "owner",
        "parks",
        "reader_back",
        "state",
        "stopped",
        "timeout",
    )

    def __init__(self, owner: str, conversation_id: str, log: StreamLog, timeout: float = 300.0) -> None:
        self.owner = owner
        self.conversation_id = conversation_id
        self.log = log
        #: the request that generates it (set when it starts)
        self.job: InFlightRequest | None = None
        self.state: State = "starting"
        #: set while a reader is attached (a parked job waits for it)
        self.reader_back = trio.Event()
        self.parks = 0
        self.dropped = False
        #: stopped (``DELETE``): gone from the registry, its log kept only until its
        #: readers have their final event
        self.stopped = False
        #: a background Responses stream (``background`` + ``stream``), keyed by its
        #: response id and resumed by sequence number (``GET /v1/responses/{id}``)
        self.background = False
        #: seconds without a reader before it ends (cause ``detach_timeout``), and that
        #: its log is kept after its end: its key's ``detach_timeout``, else the flag's
        self.timeout = timeout

    @property
    def lease(self) -> SlotLease | None:
        """The lease the job's slots are held by (``None`` before it holds one)."""
        job = self.job
        if job is None or job.events is None:
            return None
        return job.events.progress.lease


class DetachedStreams:
    """The detachable streams of a server, by (owner, conversation id)."""

    def __init__(
        self, settings: DetachSettings, nursery: trio.Nursery, heartbeat_interval: float | None = None
    ) -> None:
        self.settings = settings
        self.nursery = nursery
        #: a reader waiting on a silent log gets a keep-alive this often (the server's
        #: ``--heartbeat-interval``; ``None``: never)
        self.heartbeat_interval = heartbeat_interval
        self.streams: dict[tuple[str, str], DetachedStream] = {}

    def __len__(self) -> int:
        return len(self.streams)

    def get(self, owner: str, conversation_id: str) -> DetachedStream | None:
        return self.streams.get((owner, conversation_id))

    def lookup(self, owner: str, ids: list[str]) -> list[DetachedStream]:
        """``owner``'s streams whose id is one of ``ids`` or starts with ``<id>::``
        (llama-server's router names per-model variants so)."""
        found = []
        for (who, cid), stream in self.streams.items():
            if who == owner and any(cid == i or cid.startswith(i + "::") for i in ids):
                found.append(stream)
        return found

    def of_job(self, job: InFlightRequest) -> DetachedStream | None:
        """The stream ``job`` writes (``GET /v1/requests``; at most ``--detach-max``)."""
        for stream in self.streams.values():
            if stream.job is job:
                return stream
        return None

    def open(
        self,
        owner: str,
        conversation_id: str,
        account: Account | None = None,
        *,
        param: str = "X-Conversation-Id",
    ) -> DetachedStream:
        """A new stream for (owner, id) under ``account``'s bounds: a running one of
        that id is superseded (cancelled, its log dropped). Bounded: per key (its
        ``detach_streams`` or ``--detach-per-key``: its oldest finished log dropped
        first; all running: 429 naming it; 0: 403 naming it and ``param``) and
        server-wide (429)."""
        settings = self.settings
        per_key, timeout, log_bytes = settings.of(account)
        if per_key == 0:
            raise PermissionDeniedError(
                "this API key may keep no resumable stream (detach_streams = 0 in the keys file): "
                f"send the request without {param}",
                param=param,
            )
        previous = self.streams.get((owner, conversation_id))
        if previous is not None and previous.background:
            raise InvalidRequestError(
                f"{conversation_id!r} names a background response's stream (stop it with POST "
                "/v1/responses/{id}/cancel): choose another X-Conversation-Id",
                param="X-Conversation-Id",
            )
        if previous is not None:
            job = previous.job
            if job is not None and not job.done.is_set() and previous.state != "finished":
                # its readers get its final event (superseded), then its log goes
                # (DetachedStreams.keep: a stopped stream is dropped once read)
                previous.stopped = True
                self._forget(previous)
                job.cancel("superseded")
            else:
                self.drop(previous)
        mine = [s for s in self.streams.values() if s.owner == owner]
        # (a loop: a reload may have lowered the key's bound under what it keeps)
        while len(mine) >= per_key:
            keyed = account is not None and account.detach_streams is not None
            named = "detach_streams in the keys file" if keyed else "--detach-per-key"
            mine.remove(self._drop_oldest_finished(mine, "too_many_detached_streams", f"{per_key}: {named}"))
        while len(self.streams) >= settings.max_streams:
            server_wide = f"{settings.max_streams}: --detach-max"
            mine.remove(self._drop_oldest_finished(mine, "detach_capacity", server_wide))
        log = StreamLog(max_events=settings.log_events, max_bytes=log_bytes)
        stream = DetachedStream(owner, conversation_id, log, timeout)
        self.streams[(owner, conversation_id)] = stream
        return stream

    def _drop_oldest_finished(self, mine: list[DetachedStream], code: str, limit: str) -> DetachedStream:
        finished = [s for s in mine if s.state == "finished"]
        if not finished:
            what = "this API key's" if code == "too_many_detached_streams" else "the server's"
            raise OverloadedError(
                f"{what} detachable streams are at their limit ({limit}, all running): stop one "
                "(DELETE /v1/stream?conv_id=…) or wait for one to end",
                code=code,
                retry_after=1,
            )
        oldest = min(finished, key=lambda s: s.log.completed_at)
        self.drop(oldest)
        return oldest

    def drop(self, stream: DetachedStream) -> None:
        """Forget a stream and close its log (its readers end; a job still writing is
        released, and ends on its own cancel)."""
        if stream.dropped:
            return
        stream.dropped = True
        self._forget(stream)
        stream.log.close()

    async def stop(self, stream: DetachedStream, grace: float) -> None:
        """Drop a stopped stream (``DELETE``; its job ended): no longer found at once;
        its log closed once its readers have sent its final event (at most ``grace``
        seconds)."""
        stream.stopped = True
        self._forget(stream)
        with trio.move_on_after(grace):
            while stream.log.readers and not stream.dropped:
                await stream.log.wait_changed()
        self.drop(stream)

    def _forget(self, stream: DetachedStream) -> None:
        key = (stream.owner, stream.conversation_id)
        if self.streams.get(key) is stream:
            del self.streams[key]

    def cancel_unread(self, cause: Literal["shutdown"]) -> None:
        """End every running stream nobody reads (shutdown: nobody waits for them)."""
        for stream in list(self.streams.values()):
            if stream.job is not None and stream.log.readers == 0 and stream.state != "finished":
                stream.job.cancel(cause)

    def counts(self) -> dict[str, int]:
        """For /health and /metrics: streams by state, readers, log bytes."""
        counts = {"streams": len(self.streams), "readers": 0, "log_bytes": 0}
        for state in ("running", "paused", "parked", "finished"):
            counts[state] = 0
        for stream in self.streams.values():
            counts["readers"] += stream.log.readers
            counts["log_bytes"] += stream.log.held_bytes
            if stream.state in counts:
                counts[stream.state] += 1
        return counts

    async def keep(self, stream: DetachedStream) -> None:
        """After its job ended: keep the log ``timeout`` seconds after its end or after
        its last reader left, whichever is later, then drop it. A log whose response
        never started (an error answered to its first reader) is dropped at once."""
        stream.state = "finished"
        log = stream.log
        try:
            if log.status != 200 or stream.stopped:
                # nothing streamed, nothing to resume (or stopped): gone from the
                # registry at once, its bytes kept until its readers have relayed them
                self._forget(stream)
                with trio.move_on_after(stream.timeout):
                    while log.readers and not stream.dropped:
                        await log.wait_changed()
                return
            while not stream.dropped:
                while log.readers and not stream.dropped:
                    await log.wait_changed()
                with trio.move_on_after(stream.timeout) as idle:
                    while not log.readers and not stream.dropped:
                        await log.wait_changed()
                if idle.cancelled_caught:
                    return
        finally:
            self.drop(stream)


class DetachController:
    """A running stream's life while nobody reads it (the module docstring): the
    detach timer, the park after a grace, yielding its slot to any waiter."""

    def __init__(self, streams: DetachedStreams, stream: DetachedStream) -> None:
        self.settings = streams.settings
        self.heartbeat_interval = streams.heartbeat_interval
        self.stream = stream

    async def run(self) -> None:
        stream, settings = self.stream, self.settings
        log = stream.log
        job = stream.job
        assert job is not None
        left_at: float | None = trio.current_time()  # (nobody yet: the POST attaches)
        full_since: float | None = None
        try:
            while not log.finished and not stream.dropped:
                now = trio.current_time()
                wake = math.inf
                lease = stream.lease
                if stream.state == "parked" and not _set_aside(lease):
                    # granted again (a reader came and went), or the park was declined:
                    # it holds its slot, and the rules below apply to it again
                    stream.state = "running"
                if log.readers:
                    if left_at is not None:
                        left_at = None
                        stream.reader_back.set()
                    full_since = None
                    self._yield(None)
                    if stream.state != "parked":
                        stream.state = "paused" if log.waiting else "running"
                    wake = self._keep_alive(now)
                else:
                    if left_at is None:
                        left_at = now
                        stream.reader_back = trio.Event()
                    if now >= left_at + stream.timeout:
                        logger.info(
                            "request %s: no reader for %g s: ended (detach_timeout)",
                            job.exchange.request_id,
                            stream.timeout,
                        )
                        job.cancel("detach_timeout")
                        return
                    wake = left_at + stream.timeout
                    if log.waiting and stream.state != "parked":
                        stream.state = "paused"
                        if full_since is None:
                            full_since = now
                        self._yield(lease)
                        if now >= full_since + settings.park_after:
                            self._park(lease)
                        else:
                            wake = min(wake, full_since + settings.park_after)
                    elif not log.waiting and stream.state != "parked":
                        full_since = None
                        self._yield(None)
                        stream.state = "running"
                with trio.move_on_at(wake):
                    await log.wait_changed()
        finally:
            self._yield(None)

    def _keep_alive(self, now: float) -> float:
        """A reader is attached: if the log has been silent ``heartbeat_interval``
        seconds, append the dialect's keep-alive (a comment, or Anthropic's ``ping``:
        no event id, no sequence number). It goes *into* the log, so every reader gets
        the same bytes at the same offsets (a llama-server client counts the bytes it
        received for ``from=``). Before the first token the job's own heartbeat writes
        them; a log that is full (a slow reader has bytes to read) or ended gets none.
        When to look again."""
        interval = self.heartbeat_interval
        log, job = self.stream.log, self.stream.job
        if (
            not interval
            or job is None
            or job.dialect is None
            or not Phase.STREAMING <= job.phase < Phase.FINISHING
            or log.waiting
            or log.finished
            or log.closed
        ):
            return math.inf
        due = log.appended_at + interval
        if now < due:
            return due
        log.append_nowait(job.dialect.heartbeat)
        return now + interval

    def _yield(self, lease: SlotLease | None) -> None:
        """Install (or remove) the hook that gives the job's slot to any waiter."""
        current = self.stream.lease
        if current is None:
            return
        if lease is None:
            current.yielding = None
        elif current.yielding is None:
            current.yielding = self._give_slot

    def _give_slot(self) -> bool:
        """A waiter needs the slot of this stream nobody reads: parked, or ended."""
        lease = self.stream.lease
        if lease is not None and self._park(lease):
            return True
        job = self.stream.job
        if lease is None or job is None:
            return False
        lease.will_end()
        logger.info(
            "request %s: nobody reads it and a waiter needs its slot: ended (evicted)",
            job.exchange.request_id,
        )
        job.cancel("evicted")
        return True

    def _park(self, lease: SlotLease | None) -> bool:
        stream = self.stream
        if stream.state == "parked":
            return True
        if lease is None or not lease.set_aside(stream.reader_back):
            return False
        lease.yielding = None
        stream.state = "parked"
        stream.parks += 1
        return True


def log_sink(log: StreamLog) -> Send:
    """An ASGI ``send`` into ``log``: the job's ``http.response.start`` is its head;
    its body messages are appended (the last one, ``more_body`` false, never waits)."""

    async def send(message: Message) -> None:
        if log.closed:
            return  # the stream was dropped (stopped, superseded): nobody can read it
        if message["type"] == "http.response.start":
            log.set_head(message["status"], list(message.get("headers", ())))
            return
        try:
            await log.append(message.get("body", b""), last=not message.get("more_body", False))
        except trio.BrokenResourceError:
            return  # dropped while it waited

    return send


def _set_aside(lease: SlotLease | None) -> bool:
    """Whether the lease is parked or about to be (asked, not yet given back)."""
    return lease is not None and (lease.paused or lease.pause_asked)


@contextlib.asynccontextmanager
async def open_detached_streams(
    settings: DetachSettings, heartbeat_interval: float | None = None
) -> AsyncIterator[DetachedStreams]:
    """The server's detachable streams and the nursery their jobs and kept logs live
    in; on the way out (after the drain ended every job) the kept logs are dropped."""
    async with trio.open_nursery() as nursery:
        streams = DetachedStreams(settings, nursery, heartbeat_interval)
        try:
            yield streams
        finally:
            for stream in list(streams.streams.values()):
                streams.drop(stream)
            nursery.cancel_scope.cancel()
