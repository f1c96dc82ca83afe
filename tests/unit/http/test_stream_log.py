"""A detachable stream's log (docs/resumable-streams.md, "The stream log"): the window
slides under a reader that keeps up, holds everything while nobody reads (the producer
waits: the stream pauses), is held by a slow cursor, always takes the end; offsets and
ids address the same bytes for every reader. No server: the log is pure Trio, and every
wait is reached by waiting on the log's own changes (``wait_changed``), never a sleep
(the mock clock turns a hang into a ``TooSlowError``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from trioserve._http._stream_log import BadOffset, Cursor, OffsetLost, StreamLog
from trioserve._wire._sse import HEARTBEAT, SSEDecoder, encode_data


def _event(n: int) -> bytes:
    return encode_data(b'{"n":%d}' % n)


def _numbered(n: int) -> bytes:
    """Event ``n`` as the log holds it (no ``retry:``)."""
    return b"id: %d\n" % n + _event(n)


async def _until(log: StreamLog, done: Callable[[], bool]) -> None:
    with trio.fail_after(5):
        while not done():
            await log.wait_changed()


async def _append_now(log: StreamLog, data: bytes) -> None:
    """Append, and show it did not wait (it does not checkpoint unless it waits)."""
    with trio.testing.assert_no_checkpoints():
        await log.append(data)


async def _drain(log: StreamLog, cursor: Cursor) -> bytes:
    out = b""
    while data := await log.read(cursor):
        out += data
        log.consumed(cursor, len(data))
    return out


async def _waiting_append(nursery: trio.Nursery, log: StreamLog, data: bytes) -> trio.Event:
    """Start an append that must wait; return the event set when it returns."""
    returned = trio.Event()

    async def append() -> None:
        await log.append(data)
        returned.set()

    nursery.start_soon(append)
    await _until(log, lambda: log.waiting)
    return returned


async def test_the_window_slides_under_a_reader_that_keeps_up(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=4, max_bytes=1 << 20, retry_ms=None)
    cursor = log.attach()
    for n in range(20):
        await _append_now(log, _event(n))
        data = await log.read(cursor)
        assert data == _numbered(n)
        log.consumed(cursor, len(data))
        kept = range(max(0, n - 3), n + 1)  # the last four events, never more
        assert log.held_bytes == sum(len(_numbered(k)) for k in kept)
        assert (
            log.first_offset
            == log.total_bytes - log.held_bytes
            == sum(len(_numbered(k)) for k in range(kept[0]))
        )
    assert (log.next_id, log.readers, log.waiting) == (20, 1, False)


@pytest.mark.parametrize("bound", ["events", "bytes"])
async def test_nothing_is_dropped_while_nobody_reads_and_the_producer_waits_past_the_bound(
    autojump_clock: trio.abc.Clock, bound: str
) -> None:
    size = len(_numbered(0))
    log = StreamLog(max_events=3, max_bytes=1 << 20, retry_ms=None)
    if bound == "bytes":
        log = StreamLog(max_events=1000, max_bytes=3 * size, retry_ms=None)
    early = log.attach()
    await _append_now(log, _event(0))
    assert await log.read(early) == _numbered(0)
    log.consumed(early, size)
    log.detach(early)  # it read event 0, then left: event 0 stays
    for n in (1, 2):
        await _append_now(log, _event(n))  # up to the bound: no wait
    assert log.held_bytes == log.total_bytes == 3 * size
    async with trio.open_nursery() as nursery:
        returned = await _waiting_append(nursery, log, _event(3))  # past it: the stream pauses
        assert log.held_bytes == log.total_bytes == 4 * size  # stored, nothing dropped
        assert log.first_offset == 0
        # a reader from the start: attaching alone lets nothing go
        cursor = log.attach(0)
        await trio.testing.wait_all_tasks_blocked()
        assert log.waiting
        assert not returned.is_set()
        data = await log.read(cursor)
        assert data == b"".join(_numbered(n) for n in range(4))
        log.consumed(cursor, size - 1)
        await trio.testing.wait_all_tasks_blocked()
        assert log.waiting  # not yet past event 0
        log.consumed(cursor, 1)
        await returned.wait()
    assert not log.waiting
    assert (log.held_bytes, log.first_offset) == (3 * size, size)  # event 0 dropped, at last


async def test_a_reader_attached_at_the_end_releases_a_waiting_producer(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = StreamLog(max_events=2, max_bytes=1 << 20, retry_ms=None)
    async with trio.open_nursery() as nursery:
        await _append_now(log, _event(0) + _event(1))
        returned = await _waiting_append(nursery, log, _event(2))
        log.attach(log.total_bytes)  # nothing to read: the window slides at once
        await returned.wait()
    assert log.first_offset == len(_numbered(0))


async def test_a_slow_cursor_holds_the_window(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=2, max_bytes=1 << 20, retry_ms=None)
    slow, fast = log.attach(), log.attach()
    async with trio.open_nursery() as nursery:
        await _append_now(log, _event(0))
        await _append_now(log, _event(1))
        returned = await _waiting_append(nursery, log, _event(2))
        log.consumed(fast, len(await log.read(fast)))  # the fast one read everything
        await trio.testing.wait_all_tasks_blocked()
        assert log.waiting
        assert log.first_offset == 0
        log.consumed(slow, 3)  # inside event 0: still held
        await trio.testing.wait_all_tasks_blocked()
        assert log.waiting
        log.consumed(slow, len(_numbered(0)) - 3)  # past event 0: it goes
        await returned.wait()
        assert log.first_offset == slow.offset == len(_numbered(0))
        # the slow reader leaves: the fast one alone lets the window slide
        returned = await _waiting_append(nursery, log, _event(3))
        log.detach(slow)
        log.detach(slow)  # idempotent
        await returned.wait()
    assert log.readers == 1
    assert await log.read(fast) == _numbered(3)


async def test_the_end_is_always_taken_and_readers_then_get_nothing(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=1, max_bytes=1 << 20, retry_ms=None)
    await _append_now(log, _event(0))
    with trio.testing.assert_no_checkpoints():
        log.append_nowait(HEARTBEAT)  # a keep-alive never waits either
        await log.append(_event(1) + encode_data(b"[DONE]"), last=True)  # over the window
    assert log.finished
    assert log.completed_at >= log.started_at > 0
    assert log.held_bytes == log.total_bytes  # nobody reads: all kept
    cursor = log.attach()
    assert await _drain(log, cursor) == _numbered(0) + b": ping\n" + _numbered(1) + b"id: 2\ndata: [DONE]\n\n"
    assert await log.read(cursor) == b""
    with pytest.raises(RuntimeError, match="ended"):
        await log.append(_event(3))
    with pytest.raises(RuntimeError, match="ended"):
        log.append_nowait(HEARTBEAT)


async def test_a_reader_waiting_at_the_end_gets_nothing_when_the_stream_ends(
    autojump_clock: trio.abc.Clock,
) -> None:
    log = StreamLog(max_events=8, max_bytes=1 << 20)
    cursor = log.attach()
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _collect(log, cursor, got))
        await trio.testing.wait_all_tasks_blocked()
        await log.append(_event(0))
        await _until(log, lambda: cursor.offset == log.total_bytes)
        await log.append(b"", last=True)  # an end with no bytes of its own
    assert got == [b"id: 0\nretry: 1000\n" + _event(0)]


async def _collect(log: StreamLog, cursor: Cursor, got: list[bytes]) -> None:
    while data := await log.read(cursor):
        got.append(data)
        log.consumed(cursor, len(data))


async def test_offsets_ids_and_the_window_agree(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=3, max_bytes=1 << 20, retry_ms=1500)
    reader = log.attach()
    log.append_nowait(HEARTBEAT)  # queued: a keep-alive before the first event, no id
    for n in range(5):
        log.append_nowait(_event(n) + (HEARTBEAT if n == 2 else b""))
    everything = await log.read(reader)
    assert log.total_bytes == len(everything)
    decoder = SSEDecoder()
    events = decoder.feed(everything)
    assert [(e.id, e.data, e.retry) for e in events] == [
        (str(n), f'{{"n":{n}}}', 1500 if n == 0 else None) for n in range(5)
    ]
    assert decoder.comments == 2
    assert log.held_bytes == log.total_bytes  # the reader has not sent anything yet
    # bad offsets, and an attach inside an event (a byte count from /v1/stream)
    with pytest.raises(BadOffset):
        log.attach(-1)
    with pytest.raises(BadOffset):
        log.attach(log.total_bytes + 1)
    middle = everything.index(b'{"n":1}')
    assert await log.read(log.attach(middle)) == everything[middle:]
    log.detach(reader)  # its offset 0 no longer holds the window; the one in the middle does
    assert log.first_offset == everything.index(b"id: 1\n")
    with pytest.raises(OffsetLost):
        log.attach(0)
    assert log.attach(log.total_bytes).offset == log.total_bytes
    assert log.readers == 2


async def test_attach_after_an_event_id(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=4, max_bytes=1 << 20, retry_ms=None)
    cursors: list[Cursor] = []

    def after(event_id: int) -> int:
        cursors.append(log.attach_after(event_id))
        return cursors[-1].offset

    assert after(-1) == 0  # no event yet: the end
    log.append_nowait(HEARTBEAT)
    assert after(-1) == log.total_bytes
    for n in range(4):
        log.append_nowait(_event(n) + HEARTBEAT)
    cursors.append(log.attach())
    data = await log.read(cursors[-1])
    start = {n: data.index(b"id: %d\n" % n) for n in range(4)}
    assert after(-1) == start[0]  # from the start: the first event (keep-alives skipped)
    assert after(1) == start[2]
    assert after(3) == log.total_bytes  # the last id: the end
    assert after(99) == log.total_bytes  # past it: the end too
    with pytest.raises(BadOffset):
        log.attach_after(-2)
    # every cursor moves to the end; one more event: event 0 is dropped
    for cursor in cursors:
        log.consumed(cursor, log.total_bytes - cursor.offset)
    log.append_nowait(_event(4))
    assert log.first_offset == start[0] + len(_numbered(0))  # the keep-alive after it is held
    assert log.attach_after(0).offset == start[1]  # after 0: event 1, still held
    with pytest.raises(OffsetLost):
        log.attach_after(-1)


async def test_two_readers_from_different_offsets_read_the_same_bytes(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=4, max_bytes=1 << 20)
    first = log.attach()
    results: dict[str, bytes] = {}

    async def read(name: str, cursor: Cursor) -> None:
        results[name] = await _drain(log, cursor)

    async def produce() -> None:
        for n in range(40):
            await log.append(_event(n))
            if n % 7 == 0:
                log.append_nowait(HEARTBEAT)
        await log.append(encode_data(b"[DONE]"), last=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, "first", first)
        nursery.start_soon(produce)
        await _until(log, lambda: log.next_id >= 10)
        second = log.attach(log.first_offset + 5)  # a byte inside the oldest event held
        offset = second.offset
        nursery.start_soon(read, "second", second)
    assert results["first"][offset:] == results["second"]
    events = SSEDecoder().feed(results["first"])
    assert [e.id for e in events] == [str(n) for n in range(41)]
    assert log.held_bytes <= log.total_bytes


async def test_an_internal_cursor_holds_the_window_but_is_no_reader(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=2, max_bytes=1 << 20, retry_ms=None)
    persister = log.attach(internal=True)
    assert log.readers == 0
    async with trio.open_nursery() as nursery:
        log.append_nowait(_event(0) + _event(1))
        log.consumed(persister, len(_numbered(0)))  # it stored event 0
        # an internal cursor alone lets nothing go: nobody reads
        returned = await _waiting_append(nursery, log, _event(2))
        reader = log.attach(log.total_bytes)
        assert log.readers == 1
        await returned.wait()  # a reader at the end and the persister past event 0: it goes
        assert log.first_offset == persister.offset
        returned = await _waiting_append(nursery, log, _event(3))
        log.consumed(reader, len(await log.read(reader)))
        await trio.testing.wait_all_tasks_blocked()
        assert log.waiting  # the persister holds event 1
        log.consumed(persister, len(await log.read(persister)))
        await returned.wait()
        log.detach(persister)
        assert log.readers == 1


async def test_close_releases_the_producer_and_the_readers(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=1, max_bytes=1 << 20)
    holder = log.attach(internal=True)
    reader = log.attach()
    outcome: dict[str, object] = {}

    async def produce() -> None:
        try:
            await log.append(_event(0) + _event(1))
        except trio.BrokenResourceError:
            outcome["producer"] = "broken"

    async def read() -> None:
        await _drain(log, reader)
        outcome["reader"] = await log.read(reader)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        nursery.start_soon(read)
        await _until(log, lambda: log.waiting and reader.offset == log.total_bytes)
        await trio.testing.wait_all_tasks_blocked()
        assert holder.offset == 0  # it holds the window: the producer waits, the reader waits for more
        log.close()
        log.close()
    assert outcome == {"producer": "broken", "reader": b""}
    assert log.head_set.is_set()
    assert log.status is None
    assert (log.held_bytes, log.first_offset) == (0, log.total_bytes)
    with pytest.raises(trio.BrokenResourceError):
        log.append_nowait(HEARTBEAT)
    with pytest.raises(OffsetLost):
        log.attach(log.total_bytes)


async def test_a_cancelled_wait_leaves_the_bytes_in_the_log(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=1, max_bytes=1 << 20, retry_ms=None)
    log.append_nowait(_event(0))
    with trio.move_on_after(1):
        await log.append(_event(1))
    assert not log.waiting
    assert await log.read(log.attach()) == _numbered(0) + _numbered(1)


async def test_the_head_is_kept_apart(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=1, max_bytes=64)
    log.set_head(200, [(b"content-type", b"text/event-stream")])
    assert log.head_set.is_set()
    assert log.status == 200
    assert log.total_bytes == 0
    with pytest.raises(RuntimeError, match="head"):
        log.set_head(400, [])


@pytest.mark.parametrize("change", ["append", "attach", "consumed", "detach", "end", "close"])
async def test_wait_changed_returns_at_each_change(autojump_clock: trio.abc.Clock, change: str) -> None:
    log = StreamLog(max_events=8, max_bytes=1 << 20)
    log.append_nowait(_event(0))
    cursor = log.attach()
    actions: dict[str, Callable[[], object]] = {
        "append": lambda: log.append_nowait(HEARTBEAT),
        "attach": lambda: log.attach(),
        "consumed": lambda: log.consumed(cursor, 1),
        "detach": lambda: log.detach(cursor),
        "end": lambda: log.append_nowait(b"", last=True),
        "close": log.close,
    }
    returned = trio.Event()

    async def wait() -> None:
        await log.wait_changed()
        returned.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not returned.is_set()
        actions[change]()
        await trio.testing.wait_all_tasks_blocked()
        assert returned.is_set()


async def test_waiting_flips_are_changes(autojump_clock: trio.abc.Clock) -> None:
    log = StreamLog(max_events=1, max_bytes=1 << 20)
    seen: list[bool] = []

    async def watch() -> None:
        while True:
            await log.wait_changed()
            seen.append(log.waiting)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await trio.testing.wait_all_tasks_blocked()
        log.append_nowait(_event(0))
        await trio.testing.wait_all_tasks_blocked()
        assert seen == [False]
        returned = await _waiting_append(nursery, log, _event(1))
        await trio.testing.wait_all_tasks_blocked()
        assert seen == [False, True]
        log.attach(log.total_bytes)
        await returned.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    # released: the attach, then the flip (the watcher may see both at once, or each)
    assert seen[-1] is False


async def test_an_answer_that_is_not_a_stream_is_kept_as_it_is() -> None:
    """An error before the stream began (a JSON body, no blank line): its bytes as they
    are, no ids — the POST's reader relays them with the job's status."""
    log = StreamLog(max_events=4, max_bytes=1024)
    log.set_head(400, [(b"content-type", b"application/json")])
    body = b'{"error":{"message":"bad","type":"invalid_request_error"}}'
    await log.append(body, last=True)
    cursor = log.attach(0)
    assert await log.read(cursor) == body
    assert log.next_id == 0
