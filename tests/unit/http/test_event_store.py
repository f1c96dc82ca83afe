"""A background stream's events in the response store (issue 48; ``_http/_event_store.py``,
``_response_db.py``), without a server: their bytes in the key's quota, the total and
its eviction, gone with their response; the batches; a restart's end; a replay's end
where the stored events stop short."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

from trioserve._http._event_store import EventRecorder, stored_replay
from trioserve._http._stored import (
    BackgroundJob,
    ResponseStore,
    StoredResponse,
    StoredResponses,
    StoreFullError,
)
from trioserve._wire import number_events
from trioserve._wire._sse import SSEDecoder

from ..._helpers import wait_for

_OPEN: list[ResponseStore] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def _store(**kw: Any) -> ResponseStore:
    store = ResponseStore(None, clock=lambda: 2000.0, **kw)
    _OPEN.append(store)
    return store


def _response(i: int, owner: str = "key:a", status: str = "queued") -> StoredResponse:
    body = {"id": f"resp_{i}", "object": "response", "status": status, "output": []}
    return StoredResponse(
        id=f"resp_{i}",
        owner=owner,
        model="m",
        status=status,
        input_items=[],
        output_items=[],
        body=body,
        created=1500.0 + i,
    )


def _events(first: int, count: int, kind: str = "response.output_text.delta") -> list[bytes]:
    """``count`` numbered event blocks from ``first``, as the stream log makes them."""
    data = b"".join(
        b"event: %s\ndata: %s\n\n"
        % (kind.encode(), json.dumps({"type": kind, "sequence_number": i}).encode())
        for i in range(first, first + count)
    )
    return [block for _, block in number_events(data, first)]


def _scanned_size(store: ResponseStore, response_id: str) -> int:
    """A response's stored JSON plus its events' bytes, by a scan."""
    row = store._db.execute(
        "SELECT LENGTH(input_items) + LENGTH(output_items) + LENGTH(body) FROM responses WHERE id = ?",
        (response_id,),
    ).fetchone()
    events = store._db.execute(
        "SELECT COALESCE(SUM(LENGTH(data)), 0) FROM response_events WHERE response_id = ?", (response_id,)
    ).fetchone()
    return int(row[0]) + int(events[0])


def _event_rows(store: ResponseStore) -> int:
    return int(store._db.execute("SELECT COUNT(*) FROM response_events").fetchone()[0])


def test_events_bytes_count_in_the_key_and_the_total_and_go_with_their_response() -> None:
    store = _store(max_bytes=100_000, max_key_bytes=50_000)
    store.put(_response(1), streamed=True)
    before = store.usage("key:a")[0]
    data = b"".join(_events(0, 10))
    assert store.append_events("resp_1", "key:a", 0, 9, data)
    assert store.usage("key:a") == (before + len(data), 1)
    assert store.usage(None) == (before + len(data), 1)
    assert store.usage("key:a")[0] == _scanned_size(store, "resp_1")
    # a background response's end replaces its row: its events' bytes stay counted
    store.put(_response(1, status="completed"))
    assert store.usage("key:a")[0] == _scanned_size(store, "resp_1") > len(data)
    assert store.delete("resp_1", "key:a")
    assert store.usage("key:a") == (0, 0)
    assert store.usage(None) == (0, 0)
    assert _event_rows(store) == 0  # (gone with it)
    # another key's call cannot add to it, nor a response that is gone
    store.put(_response(2), streamed=True)
    assert not store.append_events("resp_2", "key:b", 0, 9, data)
    assert not store.append_events("resp_1", "key:a", 0, 9, data)


def test_events_evict_their_keys_oldest_and_are_evicted_with_their_response() -> None:
    store = _store(max_bytes=100_000, max_key_bytes=4_000)  # (10 events: about 1,100 bytes)
    store.put(_response(1, owner="key:b"), streamed=True)
    store.append_events("resp_1", "key:b", 0, 9, b"".join(_events(0, 10)))
    store.put(_response(2), streamed=True)
    store.append_events("resp_2", "key:a", 0, 9, b"".join(_events(0, 10)))
    store.put(_response(3), streamed=True)
    # resp_3's events pass key:a's quota: key:a's oldest (resp_2) goes, with its events
    for first in range(0, 30, 10):
        assert store.append_events("resp_3", "key:a", first, first + 9, b"".join(_events(first, 10)))
    assert store.get("resp_2", "key:a") is None
    assert (
        store._db.execute("SELECT COUNT(*) FROM response_events WHERE response_id = 'resp_2'").fetchone()[0]
        == 0
    )
    assert store.usage("key:a")[0] == _scanned_size(store, "resp_3") <= 4_000
    assert store.get("resp_1", "key:b") is not None  # (never another key's)
    # a batch that would pass the quota with nothing older left: refused, nothing changed
    usage = store.usage("key:a")
    rows = _event_rows(store)
    with pytest.raises(StoreFullError, match="one key may store"):
        store.append_events("resp_3", "key:a", 30, 39, b"".join(_events(30, 10)))
    assert store.usage("key:a") == usage
    assert _event_rows(store) == rows


def test_a_restart_ends_a_streamed_responses_events_with_response_incomplete() -> None:
    store = _store()
    store.put(_response(1), streamed=True)  # events kept up to 4
    store.append_events("resp_1", "key:a", 0, 4, b"".join(_events(0, 5)))
    store.put(_response(2), streamed=True)  # no event kept yet
    store.put(_response(3), streamed=True)  # its end kept before the process died
    store.append_events("resp_3", "key:a", 0, 0, b"".join(_events(0, 1, "response.completed")))
    store.put(_response(4), streamed=True)  # its events stopped at the quota
    store.stop_events("resp_4", "key:a", 0, "quota")
    store.put(_response(5))  # not streamed
    assert store.settle_unfinished() == 5
    ends = dict(
        store._db.execute(
            "SELECT response_id, first_seq FROM response_events WHERE note = 'restart'"
        ).fetchall()
    )
    assert ends == {"resp_1": 5, "resp_2": 0}
    data = store._db.execute(
        "SELECT data FROM response_events WHERE response_id = 'resp_1' AND note = 'restart'"
    )
    (event,) = SSEDecoder().feed(bytes(data.fetchone()[0]))
    assert event.id == "5"
    assert event.event == "response.incomplete"
    payload = json.loads(event.data)
    assert payload["sequence_number"] == 5
    assert payload["response"]["status"] == "incomplete"
    assert payload["response"]["trioserve"]["end_cause"] == "shutdown"
    assert store.usage("key:a")[0] == sum(_scanned_size(store, f"resp_{i}") for i in range(1, 6))


@pytest.fixture
async def service(nursery: trio.Nursery) -> StoredResponses:
    store = _store(max_bytes=1 << 20, max_key_bytes=60_000)
    return StoredResponses(store, nursery)


def _ids(body: bytes) -> list[int]:
    return [int(event.id or -1) for event in SSEDecoder().feed(body)]


def _counting(store: ResponseStore) -> list[tuple[int, int]]:
    """The (first, last) of each events write the store is asked for, from now on."""
    writes: list[tuple[int, int]] = []
    append = store.append_events

    def counted(response_id: str, owner: str, first: int, last: int, data: bytes) -> bool:
        writes.append((first, last))
        return append(response_id, owner, first, last, data)

    store.append_events = counted  # type: ignore[method-assign]
    return writes


async def test_events_are_written_in_batches_never_one_write_per_event(
    service: StoredResponses, nursery: trio.Nursery
) -> None:
    store = service.store.store
    store.put(_response(1), streamed=True)
    writes = _counting(store)
    # a batch each 50 ms: 200 events, one a millisecond or so
    recorder = EventRecorder(service, "resp_1", "key:a", interval=0.05)
    nursery.start_soon(recorder.run)
    blocks = _events(0, 200)
    for i, block in enumerate(blocks):
        recorder.add(i, block)
        await trio.sleep(0.001)
    await recorder.close()
    assert 2 <= len(writes) <= 20, writes
    assert writes[0][0] == 0
    assert writes[-1][1] == 199
    assert [first for first, _ in writes[1:]] == [last + 1 for _, last in writes[:-1]]  # contiguous
    replay = await stored_replay(service, "resp_1", "key:a", 149, by_header=False)
    assert replay is not None
    assert replay.body.startswith(b"".join(blocks[150:]))  # as made, from 150


async def test_a_full_batch_is_written_at_once(service: StoredResponses, nursery: trio.Nursery) -> None:
    store = service.store.store
    store.put(_response(1), streamed=True)
    writes = _counting(store)
    recorder = EventRecorder(service, "resp_1", "key:a", batch_events=64, interval=math.inf)
    nursery.start_soon(recorder.run)
    for i, block in enumerate(_events(0, 63)):
        recorder.add(i, block)
    await trio.testing.wait_all_tasks_blocked()
    assert writes == []  # (63: not yet)
    recorder.add(63, _events(63, 1)[0])
    await wait_for(lambda: writes)
    assert writes == [(0, 63)]
    await wait_for(lambda: recorder.next_seq == 64)


async def test_a_batch_over_the_quota_stops_the_keeping_and_a_replay_says_why(
    service: StoredResponses,
) -> None:
    store = service.store.store
    store.put(_response(1), streamed=True)
    recorder = EventRecorder(service, "resp_1", "key:a")
    for i, block in enumerate(_events(0, 10)):
        recorder.add(i, block)
    await recorder.flush()
    big = _events(10, 600)  # (past the key's 60,000 bytes)
    for i, block in enumerate(big, 10):
        recorder.add(i, block)
    await recorder.flush()
    assert recorder.stopped == "quota"
    recorder.add(610, _events(610, 1)[0])  # (its stream goes on; nothing more is kept)
    await recorder.close()
    assert service.failures == 1
    assert store._db.execute("SELECT MAX(last_seq) FROM response_events").fetchone()[0] == 9
    store.put(_response(1, status="completed"))
    replay = await stored_replay(service, "resp_1", "key:a", 5, by_header=False)
    assert replay is not None
    events = SSEDecoder().feed(replay.body)
    assert [int(e.id or -1) for e in events] == [6, 7, 8, 9, 10]
    error = json.loads(events[-1].data)
    assert events[-1].event == "error"
    assert error["type"] == "error"
    assert error["code"] == "store_quota"
    assert "--responses-max-mb-per-key" in error["message"]
    assert error["sequence_number"] == 10


async def test_a_replay_ends_as_the_stream_ended_or_as_the_stored_object_says(
    service: StoredResponses,
) -> None:
    store = service.store.store
    run = service.store.run
    # a completed stream: all of it, or the events after N; past its end, nothing
    await run(store.put, _response(1), streamed=True)
    blocks = _events(0, 5) + _events(5, 1, "response.completed")
    await run(store.append_events, "resp_1", "key:a", 0, 3, b"".join(blocks[:4]))
    await run(store.append_events, "resp_1", "key:a", 4, 5, b"".join(blocks[4:]))
    whole = await stored_replay(service, "resp_1", "key:a", None, by_header=False)
    assert whole is not None
    assert whole.body == b"".join(blocks)
    after = await stored_replay(service, "resp_1", "key:a", 2, by_header=False)
    assert after is not None
    assert _ids(after.body) == [3, 4, 5]
    past = await stored_replay(service, "resp_1", "key:a", 5, by_header=True)
    assert past is not None
    assert past.past_end
    assert past.body == b""
    # a restart's end: where the client is past it (it saw events a SIGKILL lost), it
    # comes numbered after the client's last
    await run(store.put, _response(2), streamed=True)
    await run(store.append_events, "resp_2", "key:a", 0, 4, b"".join(_events(0, 5)))
    await run(store.settle_unfinished)
    resumed = await stored_replay(service, "resp_2", "key:a", 3, by_header=False)
    assert resumed is not None
    assert _ids(resumed.body) == [4, 5]
    beyond = await stored_replay(service, "resp_2", "key:a", 9, by_header=False)
    assert beyond is not None
    (end,) = SSEDecoder().feed(beyond.body)
    assert (end.id, end.event) == ("10", "response.incomplete")
    assert json.loads(end.data)["sequence_number"] == 10
    assert json.loads(end.data)["response"]["trioserve"]["end_cause"] == "shutdown"
    # stored events that stop short of an end the object has: that end, next
    await run(store.put, _response(3), streamed=True)
    await run(store.append_events, "resp_3", "key:a", 0, 2, b"".join(_events(0, 3)))
    await run(store.put, _response(3, status="completed"))
    ended = await stored_replay(service, "resp_3", "key:a", 0, by_header=False)
    assert ended is not None
    events = SSEDecoder().feed(ended.body)
    delta = "response.output_text.delta"
    assert [(e.id, e.event) for e in events] == [("1", delta), ("2", delta), ("3", "response.completed")]
    # not a streamed response, another key's, a missing one: none
    await run(store.put, _response(4, status="completed"))
    assert await stored_replay(service, "resp_4", "key:a", None, by_header=False) is None
    assert await stored_replay(service, "resp_1", "key:b", None, by_header=False) is None
    assert await stored_replay(service, "resp_9", "key:a", None, by_header=False) is None


def test_an_events_write_reads_indexes_never_a_scan() -> None:
    store = _store(max_bytes=100_000, max_key_bytes=4_000)
    for i in range(3):
        store.put(_response(i), streamed=True)
        store.append_events(f"resp_{i}", "key:a", 0, 9, b"".join(_events(0, 10)))
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    store.put(_response(5), streamed=True)
    store.append_events("resp_5", "key:a", 0, 9, b"".join(_events(0, 10)))  # (an eviction)
    store.put(_response(5, status="completed"))
    store.events("resp_5", "key:a", 3)
    store._db.set_trace_callback(None)
    queries = [s for s in statements if s.split()[0].upper() in ("SELECT", "DELETE", "INSERT", "UPDATE")]
    assert any(q.startswith("DELETE FROM responses WHERE id") for q in queries)  # it evicted
    for query in queries:
        plan = " | ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + query))
        assert "SCAN responses" not in plan, (query, plan)
        assert "SCAN response_events" not in plan, (query, plan)


async def test_a_background_response_reads_as_stored_once_its_end_is_stored(service: StoredResponses) -> None:
    """While its job still writes its last events (after its end was stored and its
    last event sent), the response reads as its stored end, not ``in_progress``."""
    store = service.store.store
    queued = _response(1)
    store.put(queued, streamed=True)
    job = BackgroundJob(turn=None, owner="key:a", queued=dict(queued.body))  # type: ignore[arg-type]
    service.jobs["resp_1"] = job
    read = await service.get("resp_1", "key:a")
    assert read is not None
    assert read["status"] == "queued"  # (live)
    store.put(_response(1, status="completed"))
    job.stored = True  # (StoredResponses.record_end: before its last bytes go out)
    read = await service.get("resp_1", "key:a")
    assert read is not None
    assert read["status"] == "completed"
