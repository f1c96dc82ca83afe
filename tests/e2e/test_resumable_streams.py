"""Resumable streams (issue 48; docs/resumable-streams.md): a client that opted in
(``X-Conversation-Id``) drops its connection and reads on from where it was — by byte
offset (llama-server's ``GET /v1/stream?from=N``) or by event id (``Last-Event-ID``);
nobody reading pauses the stream (its log full) and parks it (its slot to others);
``DELETE /v1/stream`` stops it; the detach timeout ends it; without the header a
disconnect stops the work as always (the cancellation matrix)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend
from trioserve._backends._scripted import ScriptedBackend
from trioserve._http._detach import DetachedStream, DetachSettings
from trioserve._wire._sse import SSEDecoder

from .._helpers import RawStream, RunningServer, read_events_and_close, start_server, wait_for

#: a window of 512 events (a stream of 200 fits), and one of 24 (a stream fills it)
ROOMY = DetachSettings(log_events=512, log_bytes=256 * 1024, park_after=0.2, timeout=30.0)
SMALL = DetachSettings(log_events=24, log_bytes=64 * 1024, park_after=0.2, timeout=30.0)


def _events(body: bytes) -> list[tuple[str | None, str]]:
    return [(event.id, event.data) for event in SSEDecoder().feed(body)]


def _text(body: bytes) -> str:
    text = []
    for _, data in _events(body):
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        for choice in chunk.get("choices", []):
            text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def _stream_of(running: RunningServer, conversation: str) -> DetachedStream:
    detached = running.server.state.detached
    assert detached is not None
    stream = detached.get("", conversation)
    assert stream is not None
    return stream


@pytest.fixture
async def scripted(nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    backend = ScriptedBackend(token_interval=0.002)
    running = await start_server(nursery, backend, detach=ROOMY, shutdown_grace=0.0, http=HTTPSettings())
    yield running
    running.server.shutdown()


async def _read_some(
    client: httpx.AsyncClient, body: dict[str, object], conversation: str, events: int
) -> bytes:
    """POST a detachable stream on a raw socket, read its body until ``events``
    events, then close the connection; return the body bytes received."""
    url = str(client.base_url).rstrip("/")
    raw = await RawStream.post(url, "/v1/completions", body, {"X-Conversation-Id": conversation})
    head, received = await read_events_and_close(raw, events)
    assert head.status_code == 200
    assert dict(head.headers)[b"x-conversation-id"] == conversation.encode()
    return received


async def test_a_dropped_stream_resumes_from_a_byte_offset_inside_an_event(scripted: RunningServer) -> None:
    body = {"prompt": "hi", "max_tokens": 200, "stream": True}
    async with scripted.client() as client:
        received = await _read_some(client, body, "conv-a", 10)
        # resume from the middle of an event: the bytes go on exactly from there
        offset = len(received) - 7
        response = await client.get("/v1/stream", params={"conv_id": "conv-a", "from": offset})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        whole = received[:offset] + response.content
        # a second reader from the start gets the same bytes (the window holds the
        # whole stream)
        again = await client.get("/v1/stream", params={"conv_id": "conv-a", "from": 0})
    assert again.content == whole
    events = _events(whole)
    numbered = [int(event_id) for event_id, _ in events if event_id is not None]
    assert numbered == list(range(len(numbered)))  # no event duplicated or missing
    assert [data for _, data in events].count("[DONE]") == 1
    assert _text(whole) == "".join(f" tok{i}" for i in range(200))
    stream = _stream_of(scripted, "conv-a")
    assert stream.job is not None
    assert stream.job.cause == "length"


async def test_last_event_id_resumes_after_that_event_and_wins_over_from(scripted: RunningServer) -> None:
    body = {"prompt": "hi", "max_tokens": 60, "stream": True}
    async with scripted.client() as client:
        received = await _read_some(client, body, "conv-b", 5)
        numbered = [event_id for event_id, _ in _events(received[: received.rindex(b"\n\n") + 2]) if event_id]
        last = numbered[-1]
        assert last is not None
        response = await client.get(
            "/v1/stream", params={"conv_id": "conv-b", "from": 0}, headers={"Last-Event-ID": last}
        )
        assert response.status_code == 200
        resumed = _events(response.content)
        assert resumed[0][0] == str(int(last) + 1)
        complete = received[: received.rindex(b"\n\n") + 2] + response.content
        assert _text(complete) == "".join(f" tok{i}" for i in range(60))
        # past the last event of a finished stream: 204 (an EventSource stops reconnecting)
        final = resumed[-1][0]
        assert final is not None
        done = await client.get("/v1/stream", params={"conv_id": "conv-b"}, headers={"Last-Event-ID": final})
        assert done.status_code == 204


async def test_nobody_reading_pauses_the_stream_when_its_log_is_full(scripted: RunningServer) -> None:
    backend = scripted.engine.backend
    body = {"prompt": "hi", "max_tokens": 4000, "stream": True}
    async with scripted.client() as client:
        await _read_some(client, body, "conv-c", 2)
        stream = _stream_of(scripted, "conv-c")
        await wait_for(lambda: stream.state == "paused")
        job = stream.job
        assert job is not None
        assert job.events is not None
        made = job.events.progress.completion_tokens
        assert made < 600  # (a window of 512 events, the channel's few)
        # a reader takes it on to its end
        response = await client.get("/v1/stream", params={"conv_id": "conv-c"})
        assert response.status_code == 200
    assert job.cause == "length"
    assert job.events.progress.completion_tokens == 4000
    assert backend.generations.running == 0


async def test_delete_stops_the_stream_and_lookup_lists_the_callers_streams(scripted: RunningServer) -> None:
    body = {"prompt": "hi", "max_tokens": 4000, "stream": True}
    async with scripted.client() as client:
        await _read_some(client, body, "conv-d", 2)
        found = (
            await client.post("/v1/streams/lookup", json={"conversation_ids": ["conv-d", "nope"]})
        ).json()
        assert [entry["conversation_id"] for entry in found] == ["conv-d"]
        assert found[0]["is_done"] is False
        assert found[0]["completed_at"] == 0
        assert found[0]["total_bytes"] > 0
        stream = _stream_of(scripted, "conv-d")
        response = await client.delete("/v1/stream", params={"conv_id": "conv-d"})
        assert response.status_code == 204
        assert stream.job is not None
        assert stream.job.done.is_set()
        assert stream.job.cause == "cancelled"
        assert (await client.post("/v1/streams/lookup", json={"conversation_ids": ["conv-d"]})).json() == []
        gone = await client.get("/v1/stream", params={"conv_id": "conv-d"})
        assert gone.status_code == 404
        assert gone.json() == {
            "error": {"code": 404, "message": "Stream not found or expired", "type": "not_found_error"}
        }
        # an unknown id: 204 all the same (llama-server's)
        assert (await client.delete("/v1/stream", params={"conv_id": "never"})).status_code == 204
    await scripted.wait_idle()


async def test_refusals_name_what_to_fix(scripted: RunningServer) -> None:
    async with scripted.client() as client:
        whole = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers={"X-Conversation-Id": "x"}
        )
        assert whole.status_code == 400
        assert whole.json()["error"]["param"] == "X-Conversation-Id"
        bad = await client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 3, "stream": True},
            headers={"X-Conversation-Id": "no spaces"},
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "X-Conversation-Id"
        resume_header = await client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 3, "stream": True},
            headers={"Last-Event-ID": "3"},
        )
        assert resume_header.status_code == 400
        assert resume_header.json()["error"]["param"] == "Last-Event-ID"
        missing = await client.get("/v1/stream")
        assert missing.status_code == 400
        assert missing.json()["error"]["message"] == "Missing conversation id in path"
        await _read_some(client, {"prompt": "hi", "max_tokens": 10, "stream": True}, "conv-e", 1)
        for offset in ("-1", "x", "999999999"):
            wrong = await client.get("/v1/stream", params={"conv_id": "conv-e", "from": offset})
            assert wrong.status_code == 400, offset
            assert wrong.json()["error"]["message"] == "Invalid 'from' offset"
        lookup = await client.post("/v1/streams/lookup", content=b"{not json")
        assert lookup.status_code == 400
        # refused by the job before its stream began: the error as it is, nothing kept
        refused = await client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 100_000, "stream": True},
            headers={"X-Conversation-Id": "conv-too-long"},
        )
        assert refused.status_code == 400
        assert "max_tokens is 100000" in refused.json()["error"]["message"]
        assert (
            await client.post("/v1/streams/lookup", json={"conversation_ids": ["conv-too-long"]})
        ).json() == []


async def test_without_the_header_a_disconnect_still_stops_the_work(scripted: RunningServer) -> None:
    backend = scripted.engine.backend
    raw = await RawStream.post(
        scripted.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4000, "stream": True}
    )
    await raw.read_until(b"\n\n")
    await raw.aclose()
    await scripted.wait_idle()
    assert backend.generations.running == 0
    detached = scripted.server.state.detached
    assert detached is not None
    assert len(detached) == 0


async def test_the_detach_timeout_ends_a_stream_nobody_reads(nursery: trio.Nursery) -> None:
    backend = ScriptedBackend(token_interval=0.002)
    settings = DetachSettings(log_events=24, log_bytes=64 * 1024, park_after=0.2, timeout=0.5)
    running = await start_server(nursery, backend, detach=settings, shutdown_grace=0.0, http=HTTPSettings())
    try:
        async with running.client() as client:
            await _read_some(client, {"prompt": "hi", "max_tokens": 4000, "stream": True}, "conv-f", 2)
            stream = _stream_of(running, "conv-f")
            job = stream.job
            assert job is not None
            with trio.fail_after(10):
                await job.done.wait()
            assert job.cause == "detach_timeout"
            # its log ends with the final event that says why, kept for a reader
            response = await client.get("/v1/stream", params={"conv_id": "conv-f"})
            assert response.status_code == 200
            assert b'"end_cause":"detach_timeout"' in response.content
            assert response.content.endswith(b"data: [DONE]\n\n")
        await running.wait_idle()
    finally:
        running.server.shutdown()


# ------------------------------------------------------------- on the real model


@pytest.mark.model
async def test_a_parked_stream_frees_its_slot_and_resumes_with_the_same_text(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """One slot. A stream nobody reads fills its log, pauses and is parked (its state
    saved, its slot free); a second request is served meanwhile; a reader comes back
    and the stream ends with the text of an uninterrupted run."""
    running = await start_server(
        nursery, llama_backend, detach=SMALL, shutdown_grace=0.0, http=HTTPSettings()
    )
    body = {
        "prompt": "The history of the printing press",
        "max_tokens": 96,
        "stream": True,
        "temperature": 0,
        # (no end of sequence before the log is full: whichever tokens this CPU draws)
        "logit_bias": {"1": -100, "106": -100},
    }
    try:
        async with running.client() as client:
            uninterrupted = await client.post("/v1/completions", json=body)
            await running.wait_idle()
            received = await _read_some(client, body, "conv-p", 3)
            stream = _stream_of(running, "conv-p")
            await wait_for(lambda: stream.state == "parked", limit=60)
            await wait_for(lambda: running.engine.admission.snapshot().parked == 1, limit=60)
            assert running.engine.admission.in_use == 0
            other = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert other.status_code == 200  # served while the first is parked
            response = await client.get("/v1/stream", params={"conv_id": "conv-p", "from": len(received)})
            assert response.status_code == 200
        whole = received + response.content
        assert _text(whole) == _text(uninterrupted.content)
        assert stream.parks >= 1
        assert stream.job is not None
        assert stream.job.cause == "length"
        await running.wait_idle()
    finally:
        running.server.shutdown()


#: the window of each detached phase's server: a window a stream does not fill soon
#: (running), a small one it fills and is never parked from (paused), and parked at once
PHASE_SETTINGS = {
    "running": ROOMY,
    "paused": DetachSettings(log_events=24, log_bytes=64 * 1024, park_after=3600.0, timeout=60.0),
    "parked": SMALL,
}
#: a long stream whose end of sequence is banned: it runs whichever tokens are drawn
LONG_BODY = {
    "prompt": "A long story about the sea",
    "max_tokens": 2000,
    "stream": True,
    "logit_bias": {"1": -100, "106": -100},
}

#: a Stop must reach the thread well within this (the cancel-by-id bound: measured a
#: few ms; generous for a loaded CI machine)
STOP_BOUND_S = 0.25


@pytest.mark.model
@pytest.mark.parametrize("phase", ["running", "paused", "parked"])
async def test_stop_while_detached_frees_everything_at_once(
    llama_backend: LlamaBackend, nursery: trio.Nursery, phase: str
) -> None:
    """``DELETE /v1/stream`` in each detached phase: the job ends (cause
    ``cancelled``), no thread, slot, queue place or parked state is left, and the
    answer comes once the work has stopped."""
    settings = PHASE_SETTINGS[phase]
    running = await start_server(
        nursery, llama_backend, detach=settings, shutdown_grace=0.0, http=HTTPSettings()
    )
    body = dict(LONG_BODY)
    try:
        async with running.client() as client:
            await _read_some(client, body, "conv-stop", 2)
            stream = _stream_of(running, "conv-stop")
            job = stream.job
            assert job is not None
            if phase == "running":
                await wait_for(lambda: job.events is not None and job.events.progress.completion_tokens > 4)
                assert stream.state == "running"
            else:
                await wait_for(lambda: stream.state == phase, limit=60)
            started = trio.current_time()
            response = await client.delete("/v1/stream", params={"conv_id": "conv-stop"})
            took = trio.current_time() - started
            assert response.status_code == 204
            assert job.done.is_set()
            assert job.cause == "cancelled"
            assert took < STOP_BOUND_S, f"the Stop took {took * 1000:.0f} ms"
            assert llama_backend.generations.running == 0
            snapshot = running.engine.admission.snapshot()
            assert (snapshot.in_use, snapshot.queued, snapshot.parked, snapshot.paused_bytes) == (0, 0, 0, 0)
            detached = running.server.state.detached
            assert detached is not None
            assert len(detached) == 0
        await running.wait_idle()
    finally:
        running.server.shutdown()


#: the detached phases' cells of the cancellation matrix (docs/cancellation.md): each
#: cause that stops work × each phase a stream nobody reads can be in, and the end cause
#: each is recorded with
DETACHED_CAUSES = {
    "by_id": "cancelled",
    "deadline": "deadline",
    "shutdown": "shutdown",
    "superseded": "superseded",
}
DETACHED_PHASES = ("running", "paused", "parked")
REFERENCE = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}


@pytest.mark.model
@pytest.mark.parametrize("phase", DETACHED_PHASES)
@pytest.mark.parametrize("cause", sorted(DETACHED_CAUSES))
async def test_cancel_cell_detached(
    llama_backend: LlamaBackend, nursery: trio.Nursery, cause: str, phase: str
) -> None:
    """A stream nobody reads, in ``phase``, ended by ``cause``: recorded with its end
    cause, its log's last event says it (but shutdown's, whose log goes with the
    server), nothing is left (thread, slot, queue place, parked state), and the next
    request's text equals the one before."""
    settings = PHASE_SETTINGS[phase]
    running = await start_server(
        nursery, llama_backend, detach=settings, shutdown_grace=5.0, http=HTTPSettings()
    )
    body = dict(LONG_BODY)
    stopped = False
    try:
        async with running.client() as client:
            before = (await client.post("/v1/completions", json=REFERENCE)).json()["choices"][0]["text"]
            await _read_some(client, body, "conv-cell", 2)
            stream = _stream_of(running, "conv-cell")
            job = stream.job
            assert job is not None
            if phase == "running":
                await wait_for(lambda: job.events is not None and job.events.progress.completion_tokens > 4)
            else:
                await wait_for(lambda: stream.state == phase, limit=60)
            assert stream.state == phase
            if cause == "by_id":
                answer = await client.post(f"/v1/requests/{job.exchange.request_id}/cancel")
                assert answer.status_code == 200
                assert answer.json()["done"] is True
            elif cause == "deadline":
                job.cancel_scope.deadline = trio.current_time()  # (its X-Request-Timeout passing)
            elif cause == "superseded":
                await _read_some(client, {**body, "max_tokens": 8}, "conv-cell", 1)
            else:
                running.server.shutdown()
                stopped = True
            with trio.fail_after(10):
                await job.done.wait()
            assert job.cause == DETACHED_CAUSES[cause]
            if cause in ("by_id", "deadline"):
                # the log keeps the end, for a reader that comes back
                log = await client.get("/v1/stream", params={"conv_id": "conv-cell"})
                assert f'"end_cause":"{job.cause}"'.encode() in log.content
                assert log.content.endswith(b"data: [DONE]\n\n")
            if stopped:
                with trio.fail_after(10):
                    await running.server.stopped.wait()
            if cause == "superseded":  # (the new stream of that id runs its 8 tokens)
                await wait_for(lambda: running.engine.admission.in_use == 0)
            assert llama_backend.generations.running == 0
            snapshot = running.engine.admission.snapshot()
            assert (snapshot.in_use, snapshot.queued, snapshot.parked, snapshot.paused_bytes) == (0, 0, 0, 0)
        if stopped:
            return
        await running.wait_idle()
        async with running.client() as client:
            after = (await client.post("/v1/completions", json=REFERENCE)).json()["choices"][0]["text"]
        assert after == before
    finally:
        running.server.shutdown()


async def test_health_and_metrics_count_the_detached_streams(scripted: RunningServer) -> None:
    async with scripted.client() as client:
        await _read_some(client, {"prompt": "hi", "max_tokens": 4000, "stream": True}, "conv-m", 2)
        stream = _stream_of(scripted, "conv-m")
        await wait_for(lambda: stream.state == "paused")
        health = (await client.get("/health")).json()
        assert health["detached"]["paused"] == 1
        assert health["detached"]["readers"] == 0
        assert health["detached"]["log_bytes"] > 0
        metrics = (await client.get("/metrics")).text
        assert 'trioserve_detached_streams{state="paused"} 1.0' in metrics
        assert "trioserve_detach_log_bytes" in metrics
        assert (await client.delete("/v1/stream", params={"conv_id": "conv-m"})).status_code == 204
        metrics = (await client.get("/metrics")).text
        assert 'trioserve_detached_streams{state="paused"} 0.0' in metrics


async def test_a_stream_nobody_reads_that_cannot_park_gives_its_slot_to_a_waiter(
    scripted: RunningServer,
) -> None:
    """The scripted backend cannot set a sequence aside: a paused stream nobody reads
    is ended (``evicted``) the moment another request needs its one slot; its log
    keeps what it made, ending with why."""
    async with scripted.client() as client:
        await _read_some(client, {"prompt": "hi", "max_tokens": 4000, "stream": True}, "conv-ev", 2)
        stream = _stream_of(scripted, "conv-ev")
        await wait_for(lambda: stream.state == "paused")
        other = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert other.status_code == 200
        assert stream.job is not None
        assert stream.job.cause == "evicted"
        log = await client.get("/v1/stream", params={"conv_id": "conv-ev"})
        assert b'"end_cause":"evicted"' in log.content
        assert log.content.endswith(b"data: [DONE]\n\n")


async def test_a_newer_request_of_the_same_id_ends_the_old_stream_and_its_readers_hear_why(
    scripted: RunningServer,
) -> None:
    body = {"prompt": "hi", "max_tokens": 4000, "stream": True}
    async with scripted.client() as client:
        await _read_some(client, body, "conv-sup", 2)
        old = _stream_of(scripted, "conv-sup")
        await wait_for(lambda: old.log.readers == 0)  # (the POST's reader noticed the close)
        answers: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:

            async def follow_old() -> None:
                answers.append(await client.get("/v1/stream", params={"conv_id": "conv-sup"}))

            nursery.start_soon(follow_old)
            await wait_for(lambda: old.log.readers == 1)
            await _read_some(client, {**body, "max_tokens": 5}, "conv-sup", 1)
        assert old.job is not None
        assert old.job.cause == "superseded"
        (answer,) = answers
        assert answer.status_code == 200
        assert b'"end_cause":"superseded"' in answer.content
        assert answer.content.endswith(b"data: [DONE]\n\n")
        # the id names the new stream
        assert _stream_of(scripted, "conv-sup") is not old


@pytest.mark.model
async def test_a_parked_stream_whose_reader_leaves_before_its_slot_comes_parks_again(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """Parked; a reader comes back while another request holds the one slot (the
    stream queues for it) and leaves before the slot comes: granted with nobody
    reading, the stream fills its log again and is parked again — never left holding
    its slot until the detach timeout."""
    running = await start_server(
        nursery, llama_backend, detach=SMALL, shutdown_grace=0.0, http=HTTPSettings()
    )
    body = dict(LONG_BODY)
    try:
        async with running.client() as client:
            await _read_some(client, body, "conv-again", 2)
            stream = _stream_of(running, "conv-again")
            await wait_for(lambda: stream.state == "parked", limit=60)
            admission = running.engine.admission
            occupier = await RawStream.post(running.url, "/v1/completions", {**body, "max_tokens": 400})
            await wait_for(lambda: admission.in_use == 1, limit=30)
            # a reader comes (the stream queues behind the occupier) and leaves
            raw = trio.socket.socket()
            await raw.connect(("127.0.0.1", int(running.url.rsplit(":", 1)[1])))
            await raw.send(b"GET /v1/stream?conv_id=conv-again&from=0 HTTP/1.1\r\nHost: x\r\n\r\n")
            await wait_for(lambda: admission.snapshot().queued == 1, limit=30)
            raw.close()
            await wait_for(lambda: stream.log.readers == 0, limit=30)
            await occupier.aclose()  # (the occupier leaves: the slot goes to the stream)
            await wait_for(lambda: stream.parks == 2, limit=60)
            assert stream.state == "parked"
            await wait_for(lambda: admission.in_use == 0, limit=30)
            assert (await client.delete("/v1/stream", params={"conv_id": "conv-again"})).status_code == 204
        await running.wait_idle()
    finally:
        running.server.shutdown()
