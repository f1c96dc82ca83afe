"""Requests by id (docs/operations.md, "Requests by id") on a real server with real
inference: ids a client chooses (checked, unique among its key's requests in flight),
``GET /v1/requests`` (a key sees its own, an admin key all), a cancel from another
connection, and sessions where the latest request wins. The cancel in every phase and
dialect is the cancellation matrix's (``test_cancellation.py``, cause ``by_id``)."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend

from .._helpers import RawStream, RunningServer, start_server, wait_for

pytestmark = pytest.mark.model

KEY, OTHER, ADMIN = "key-a", "key-b", "key-admin"
#: a cancel must reach the thread well within this (measured: a few ms; generous)
CANCEL_LATENCY_BOUND_MS = 250.0
LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True}


@pytest.fixture
async def server(batched_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    """Two sequences: a second request runs beside the one in flight."""
    running = await start_server(
        nursery,
        batched_backend,
        api_keys=(KEY, OTHER),
        admin_keys=(ADMIN,),
        shutdown_grace=0.0,
        http=HTTPSettings(),
    )
    yield running
    running.server.shutdown()


async def _idle(server: RunningServer) -> None:
    """Until nothing runs (``/health`` says little without a key: read the engine)."""
    engine = server.engine
    admission = engine.admission
    await wait_for(lambda: not engine.streams and admission.in_use == 0 and not admission.queued)
    assert engine.backend.generations.running == 0


def _client(server: RunningServer, key: str) -> httpx.AsyncClient:
    return server.client(headers={"authorization": f"Bearer {key}"})


async def test_ids_are_listed_by_owner_and_cancelled_from_another_connection(server: RunningServer) -> None:
    stream = await RawStream.post(
        server.url, "/v1/completions", LONG, {"X-Request-Id": "job-1", "authorization": f"Bearer {KEY}"}
    )
    try:
        head = await stream.read_until(b"data: ", 2)
        assert b"x-request-id: job-1" in head.lower()
        async with (
            _client(server, KEY) as mine,
            _client(server, OTHER) as theirs,
            _client(server, ADMIN) as admin,
        ):
            listed = (await mine.get("/v1/requests")).json()["data"]
            (shown,) = listed
            assert shown["id"] == "job-1"
            assert shown["phase"] in ("decode", "paused")
            assert shown["endpoint"] == "text"
            assert shown["completion_tokens"] >= 1
            assert (await theirs.get("/v1/requests")).json()["data"] == []
            assert [r["id"] for r in (await admin.get("/v1/requests")).json()["data"]] == ["job-1"]
            # another key cannot cancel it (as if it did not exist); the owner can
            refused = await theirs.post("/v1/requests/job-1/cancel")
            assert refused.status_code == 404
            assert refused.json()["error"]["param"] == "request_id"
            answer = await mine.post("/v1/requests/job-1/cancel")
            assert answer.status_code == 200, answer.text
            assert answer.json()["cancelled"] is True
            assert answer.json()["end_cause"] == "cancelled"
            assert (await mine.get("/v1/requests")).json()["data"] == []
            gone = await mine.delete("/v1/requests/job-1")
            assert gone.status_code == 404
        with trio.fail_after(5):
            data = await stream.read_to_eof_or(b"0\r\n\r\n")
        assert b'"end_cause":"cancelled"' in data
        assert b"data: [DONE]" in data
    finally:
        await stream.aclose()
    await _idle(server)


async def test_an_id_in_flight_is_taken_and_a_bad_id_is_refused(server: RunningServer) -> None:
    stream = await RawStream.post(
        server.url, "/v1/completions", LONG, {"X-Request-Id": "twice", "authorization": f"Bearer {KEY}"}
    )
    try:
        await stream.read_until(b"data: ", 2)
        async with _client(server, KEY) as mine, _client(server, OTHER) as theirs:
            short = {"prompt": "Hi", "max_tokens": 1}
            taken = await mine.post("/v1/completions", json=short, headers={"X-Request-Id": "twice"})
            assert taken.status_code == 409, taken.text
            assert taken.json()["error"]["param"] == "X-Request-Id"
            # ids are per key: another key may use the same one
            other = await theirs.post("/v1/completions", json=short, headers={"X-Request-Id": "twice"})
            assert other.status_code == 200, other.text
            for bad in ("", "a b", "x" * 129, "semi;colon"):
                refused = await mine.post("/v1/completions", json=short, headers={"X-Request-Id": bad})
                assert refused.status_code == 400, (bad, refused.text)
                assert refused.json()["error"]["param"] == "X-Request-Id"
            refused = await mine.post("/v1/completions", json=short, headers={"X-Session-Id": "a/b"})
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "X-Session-Id"
            # the running one was never touched
            assert [r["id"] for r in (await mine.get("/v1/requests")).json()["data"]] == ["twice"]
    finally:
        await stream.aclose()
    await _idle(server)


async def test_in_a_session_the_latest_request_wins(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Twenty requests of one session, 50 ms apart (an editor's keystrokes): each
    arrival cancels the one before it (cause ``superseded``, the thread out within the
    bound); only the last completes; another session's request is not touched."""
    caplog.set_level(logging.INFO, logger="trioserve.requests")
    headers = {"authorization": f"Bearer {KEY}"}
    bystander = await RawStream.post(
        server.url, "/v1/completions", {**LONG, "max_tokens": 80}, {**headers, "X-Session-Id": "other"}
    )
    results: dict[int, httpx.Response] = {}
    try:
        await bystander.read_until(b"data: ", 2)
        async with _client(server, KEY) as client:

            async def send(i: int) -> None:
                body = {"prompt": f"Keystroke {i}: def fibonacci(n):", "max_tokens": 24, "temperature": 0}
                results[i] = await client.post(
                    "/v1/completions", json=body, headers={"X-Session-Id": "editor", "X-Request-Id": f"k{i}"}
                )

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(send, i)
                    await trio.sleep(0.05)  # (the workload: keystrokes 50 ms apart)
        with trio.fail_after(60):
            data = await bystander.read_to_eof_or(b"0\r\n\r\n")
    finally:
        await bystander.aclose()
    assert results[19].status_code == 200, results[19].text
    for i in range(19):
        assert results[i].status_code in (200, 409), results[i].text
        if results[i].status_code == 409:  # superseded before its response began
            assert results[i].json()["error"]["code"] == "superseded"
    await wait_for(lambda: sum("cause=superseded" in r.getMessage() for r in caplog.records) >= 1)
    superseded = 0
    for i in range(19):
        (line,) = [r.getMessage() for r in caplog.records if f"request k{i} " in r.getMessage()]
        if "cause=superseded" in line:
            superseded += 1
            latency = re.search(r"cancel_latency_ms=([\d.]+)", line)
            if latency is not None:  # (none for one still queued)
                assert float(latency.group(1)) < CANCEL_LATENCY_BOUND_MS, line
        else:  # it ended on its own before the next keystroke arrived
            assert "cause=length" in line or "cause=stop" in line, line
    assert superseded >= 1
    assert b'"end_cause"' not in data  # the other session's stream ended on its own
    await _idle(server)
