"""Stored Responses' database (``_http/_stored.py``), without a server: ownership,
chains, pages, bounds, and a file that survives a reopen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from trioserve._http._stored import AsyncResponseStore, ChainError, ResponseStore, StoredResponse


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
