"""Stored Responses' database (``_http/_stored.py``), without a server: ownership,
chains, pages, bounds, and a file that survives a reopen."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from trioserve._http._stored import (
    MAX_UNSTORED_ENDS,
    AsyncResponseStore,
    ChainError,
    ResponseStore,
    StoredResponse,
    StoredResponses,
    StoreFullError,
)


def _response(
    i: int, owner: str = "key:a", previous: str | None = None, created: float = 1000.0
) -> StoredResponse:
    return StoredResponse(
        id=f"resp_{i}",
        owner=owner,
        model="m",
        status="completed",
        input_items=[{"id": f"in_{i}", "type": "message", "role": "user", "content": f"question {i}"}],
        output_items=[{"id": f"out_{i}", "type": "message", "role": "assistant", "content": f"answer {i}"}],
        body={"id": f"resp_{i}", "object": "response"},
        previous_id=previous,
        created=created + i,
    )


_OPEN: list[ResponseStore] = []


def _store(path: Path | None = None, **kw: object) -> ResponseStore:
    store = ResponseStore(path, clock=lambda: 2000.0, **kw)  # type: ignore[arg-type]
    _OPEN.append(store)
    return store


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def test_a_response_is_its_owners_alone() -> None:
    store = _store()
    store.put(_response(1))
    got = store.get("resp_1", "key:a")
    assert got is not None
    assert got.output_items[0]["content"] == "answer 1"
    assert store.get("resp_1", "key:b") is None  # another key's: as if missing
    assert not store.delete("resp_1", "key:b")
    assert store.delete("resp_1", "key:a")
    assert store.get("resp_1", "key:a") is None


def test_a_chain_is_the_conversation_oldest_first() -> None:
    store = _store()
    store.put(_response(1))
    store.put(_response(2, previous="resp_1"))
    store.put(_response(3, previous="resp_2"))
    assert [r.id for r in store.chain("resp_3", "key:a")] == ["resp_1", "resp_2", "resp_3"]
    store.delete("resp_1", "key:a")
    with pytest.raises(ChainError) as missing:
        store.chain("resp_3", "key:a")
    assert missing.value.missing == "resp_1"
    with pytest.raises(ChainError):
        store.chain("resp_3", "key:b")


def test_a_chain_has_bounds() -> None:
    store = _store()
    store.put(_response(1))
    for i in range(2, 6):
        store.put(_response(i, previous=f"resp_{i - 1}"))
    with pytest.raises(ChainError, match="longer than 3"):
        store.chain("resp_5", "key:a", max_links=3)
    with pytest.raises(ChainError, match="larger than"):
        store.chain("resp_5", "key:a", max_bytes=200)


def test_input_items_come_in_pages() -> None:
    store = _store()
    response = _response(1)
    response.input_items = [{"id": f"in_{k}", "type": "message"} for k in range(5)]
    store.put(response)
    page = store.input_items("resp_1", "key:a", limit=2, order="asc")
    assert page is not None
    assert [item["id"] for item in page[0]] == ["in_0", "in_1"]
    assert page[1] is True
    page = store.input_items("resp_1", "key:a", limit=10, order="asc", after="in_2")
    assert page is not None
    assert [item["id"] for item in page[0]] == ["in_3", "in_4"]
    assert page[1] is False
    page = store.input_items("resp_1", "key:a", limit=1)
    assert page is not None
    assert [item["id"] for item in page[0]] == ["in_4"]
    assert store.input_items("resp_1", "key:b") is None


def test_the_store_is_bounded_by_age_and_size() -> None:
    store = _store(max_age=500.0)
    store.put(_response(1, created=1000.0))  # older than 2000 - 500: expired
    store.put(_response(2, created=1600.0))
    assert store.get("resp_1", "key:a") is None
    assert store.get("resp_2", "key:a") is not None
    small = _store(max_bytes=600)
    for i in range(1, 6):
        small.put(_response(i, created=1900.0))
    kept = [i for i in range(1, 6) if small.get(f"resp_{i}", "key:a") is not None]
    assert 0 < len(kept) < 5
    assert kept == list(range(6 - len(kept), 6))  # the oldest went first


def test_a_file_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "data" / "responses.sqlite3"
    store = _store(path)
    store.put(_response(1))
    store.close()
    again = _store(path)
    got = again.get("resp_1", "key:a")
    assert got is not None
    assert got.body == {"id": "resp_1", "object": "response"}
    again.close()


async def test_the_async_store_runs_in_a_thread() -> None:
    store = AsyncResponseStore(_store())
    await store.run(store.store.put, _response(1))
    got = await store.run(store.store.get, "resp_1", "key:a")
    assert got is not None
    assert got.id == "resp_1"
    with trio.fail_after(5):
        assert await store.run(store.store.delete, "resp_1", "key:a")


def test_background_responses_a_killed_process_left_running_end_incomplete() -> None:
    store = _store()
    running = _response(1)
    running.status, running.body = "queued", {"id": "resp_1", "status": "queued"}
    store.put(running)
    store.put(_response(2))  # completed: untouched
    assert store.settle_unfinished() == 1
    got = store.get("resp_1", "key:a")
    assert got is not None
    assert got.status == got.body["status"] == "incomplete"
    assert got.body["trioserve"]["end_cause"] == "shutdown"
    done = store.get("resp_2", "key:a")
    assert done is not None
    assert done.status == "completed"
    assert store.settle_unfinished() == 0


def test_one_key_never_evicts_another_keys_responses() -> None:
    """Key A writes far past the total: its own oldest go, every one of B's stays
    (before issue 47 the oldest of all keys went: B's first)."""
    store = _store(max_bytes=3000)
    for i in range(3):
        store.put(_response(i, owner="key:b", created=1500.0))
    for i in range(10, 40):
        store.put(_response(i, owner="key:a", created=1600.0))
    assert all(store.get(f"resp_{i}", "key:b") is not None for i in range(3))
    kept = [i for i in range(10, 40) if store.get(f"resp_{i}", "key:a") is not None]
    assert kept == list(range(40 - len(kept), 40))  # A's oldest went
    assert store.usage(None)[0] <= 3000


def test_a_key_fills_its_quota_and_anothers_responses_all_survive() -> None:
    store = _store(max_bytes=100_000, max_key_bytes=1000)
    for i in range(5):
        store.put(_response(i, owner="key:b", created=1500.0))
    for i in range(10, 60):
        store.put(_response(i, owner="key:a", created=1600.0))
    assert all(store.get(f"resp_{i}", "key:b") is not None for i in range(5))
    a_bytes, a_rows = store.usage("key:a")
    assert 0 < a_bytes <= 1000
    assert store.get("resp_59", "key:a") is not None
    assert store.get("resp_10", "key:a") is None
    assert a_rows < 50
    # a server without keys: its one owner ("") has the total
    assert store.quota("") == 100_000
    assert store.quota("key:a") == 1000


def test_a_response_that_cannot_fit_is_refused_and_nothing_changes() -> None:
    store = _store(max_bytes=900, max_key_bytes=800)  # (each response: 194 bytes)
    big = _response(1, owner="key:a")
    big.body = {"text": "x" * 900}
    with pytest.raises(StoreFullError, match="larger than"):
        store.put(big)
    for i in range(2, 6):
        store.put(_response(i, owner="key:b", created=1500.0))
    before = store.usage(None)
    # the total is held by B within its quota: A's response is refused, B's stay
    with pytest.raises(StoreFullError, match="full"):
        store.put(_response(9, owner="key:a"))
    assert store.usage(None) == before
    assert store.get("resp_9", "key:a") is None
    assert all(store.get(f"resp_{i}", "key:b") is not None for i in range(2, 6))


def _scanned(store: ResponseStore) -> tuple[int, int]:
    """(bytes, rows) of every response, by a scan: what the counters must say."""
    row = store._db.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM responses").fetchone()
    return int(row[0]), int(row[1])


def test_the_counters_agree_with_a_scan_after_every_kind_of_change(tmp_path: Path) -> None:
    store = _store(max_age=500.0, max_bytes=5000, max_key_bytes=2000)
    for i in range(12):
        store.put(_response(i, owner=f"key:{i % 3}", created=1600.0))
        assert store.usage(None) == _scanned(store)
    replaced = _response(3, owner="key:0", created=1600.0)
    replaced.body = {"status": "completed", "text": "a longer body than before"}
    store.put(replaced)  # a background response's status moves on: a replace
    assert store.usage(None) == _scanned(store)
    store.delete("resp_4", "key:1")
    store.put(_response(99, owner="key:9", created=1000.0))  # expired at once: the clock is 2000
    assert store.usage(None) == _scanned(store)
    for owner in ("key:0", "key:1", "key:2", "key:9"):
        row = store._db.execute(
            "SELECT COALESCE(SUM(size), 0), COUNT(*) FROM responses WHERE owner = ?", (owner,)
        ).fetchone()
        assert store.usage(owner) == (row[0], row[1])
    # a database made before the counters existed is counted once, at open
    path = tmp_path / "old.sqlite3"
    old = _store(path)
    for i in range(3):
        old.put(_response(i))
    old._db.executescript("DROP TABLE usage; DROP TABLE totals;")
    old.close()
    again = _store(path)
    assert again.usage("key:a") == _scanned(again) == again.usage(None)


def test_a_write_reads_counters_and_indexes_never_a_scan_of_the_table() -> None:
    store = _store(max_bytes=3000, max_key_bytes=1500)
    for i in range(20):
        store.put(_response(i, owner=f"key:{i % 2}", created=1600.0))
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    store.put(_response(50, owner="key:0", created=1700.0))  # over the quota: an eviction
    store._db.set_trace_callback(None)
    queries = [s for s in statements if s.split()[0].upper() in ("SELECT", "DELETE", "INSERT", "UPDATE")]
    assert any(q.startswith("DELETE FROM responses WHERE id") for q in queries)  # it evicted
    for query in queries:
        plan = " | ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + query))
        assert "SCAN responses" not in plan, (query, plan)


async def test_an_end_that_could_not_be_stored_is_remembered_within_a_bound(nursery: trio.Nursery) -> None:
    """A background response's end that no write could keep: its (still ``queued``) row
    answered with the remembered status, its owner's alone; the newest
    ``MAX_UNSTORED_ENDS`` kept; gone with its row."""
    store = _store()
    service = StoredResponses(store, nursery)
    queued = {"id": "resp_0", "status": "queued", "instructions": "be brief", "output": []}
    store.put(dataclasses.replace(_response(0), status="queued", body=queued))
    final = {"id": "resp_0", "status": "failed", "error": {"message": "could not be stored"}, "output": ["x"]}
    service.remember_end("resp_0", "key:a", {**final, "instructions": "be brief", "tools": ["big"]})
    body = await service.get("resp_0", "key:a")
    assert body is not None
    assert (body["status"], body["output"]) == ("failed", [])
    assert body["error"] == {"message": "could not be stored"}
    assert body["instructions"] == "be brief"  # (the row's: not kept in memory)
    assert "tools" not in service.unstored["resp_0"][1]
    assert await service.get("resp_0", "key:b") is None  # another key's: as if missing
    for i in range(1, MAX_UNSTORED_ENDS + 1):
        service.remember_end(f"resp_{i}", "key:a", {"status": "failed"})
    assert len(service.unstored) == MAX_UNSTORED_ENDS
    assert "resp_0" not in service.unstored  # the oldest forgotten
    assert (await service.get("resp_0", "key:a")) == queued
    # its row deleted: what was remembered goes with it
    store.put(dataclasses.replace(_response(5), status="queued", body=queued))
    assert store.delete("resp_5", "key:a")
    assert await service.get("resp_5", "key:a") is None
    assert "resp_5" not in service.unstored
