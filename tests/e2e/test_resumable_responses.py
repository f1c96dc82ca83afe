"""Resumable streams, OpenAI Responses' way (issue 48; docs/resumable-streams.md): a
``background`` + ``stream`` response streams on its ``POST``; dropping that connection
does not stop the work; ``GET /v1/responses/{id}?stream=true&starting_after=N`` (or
``Last-Event-ID``) reads on from the events after ``N``; cancel and ``DELETE`` stop
it; another key's id is a 404. With the official openai SDK as the client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend
from trioserve._backends._scripted import ScriptedBackend
from trioserve._http._detach import DetachedStream, DetachSettings
from trioserve._wire._sse import SSEDecoder

from .._helpers import RawStream, RunningServer, read_events_and_close, start_server, wait_for

#: a window of 512 events: a stream of 400 tokens fits while nobody reads
ROOMY = DetachSettings(log_events=512, log_bytes=256 * 1024, park_after=0.2, timeout=30.0)
STORED = HTTPSettings(responses_db="memory")

KEYS = """
[[key]]
name = "one"
key = "sk-one"

[[key]]
name = "two"
key = "sk-two"
"""


@pytest.fixture
async def scripted(nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    backend = ScriptedBackend(token_interval=0.01)
    running = await start_server(nursery, backend, detach=ROOMY, shutdown_grace=0.0, http=STORED)
    yield running
    running.server.shutdown()


def _sdk(running: RunningServer, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=running.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _stream_of(running: RunningServer, response_id: str, owner: str = "") -> DetachedStream:
    detached = running.server.state.detached
    assert detached is not None
    stream = detached.get(owner, response_id)
    assert stream is not None
    assert stream.background
    return stream


def _events(body: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    return [(event.id, json.loads(event.data)) for event in SSEDecoder().feed(body)]


async def _read_until(stream: Any, last: int | None = None) -> list[Any]:
    """An SDK stream's events up to sequence number ``last`` (then its connection is
    closed), or to its end."""
    events = []
    async with contextlib.aclosing(stream.__aiter__()) as iterator:
        async for event in iterator:
            events.append(event)
            if last is not None and event.sequence_number >= last:
                break
    await stream.close()
    return events


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def _post_some(running: RunningServer, body: dict[str, object], events: int) -> bytes:
    """POST a background stream on a raw socket, read its body until ``events`` events,
    then close the connection; return the body bytes received (whole events)."""
    raw = await RawStream.post(running.url, "/v1/responses", {**body, "background": True, "stream": True})
    head, received = await read_events_and_close(raw, events)
    assert head.status_code == 200
    return received[: received.rindex(b"\n\n") + 2]


async def test_the_sdk_resumes_a_background_stream_after_its_connection_dropped(
    scripted: RunningServer,
) -> None:
    async with _sdk(scripted) as client:
        whole = await client.responses.create(model="scripted", input="hi", max_output_tokens=400)
        first = await client.responses.create(
            model="scripted", input="hi", max_output_tokens=400, background=True, stream=True
        )
        events = await _read_until(first, 10)
        response_id = events[0].response.id
        assert events[0].response.background is True
        stream = _stream_of(scripted, response_id)
        job = stream.job
        assert job is not None
        assert not job.done.is_set()  # (dropped mid-stream: 390 tokens to go, 10 ms each)
        # nobody reads; the work goes on to its end (the window holds the stream)
        await wait_for(lambda: stream.log.readers == 0)
        with trio.fail_after(30):
            await job.done.wait()
        assert job.cause == "length"
        resumed = await client.responses.retrieve(response_id, stream=True, starting_after=10)
        events += await _read_until(resumed)
        stored = await client.responses.retrieve(response_id)
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(numbers)))  # no event duplicated or missing
    kinds = [event.type for event in events]
    assert kinds.count("response.created") == 1
    assert kinds[-1] == "response.incomplete"  # (max_output_tokens reached, as uninterrupted)
    assert kinds.count("response.incomplete") == 1
    assert _text(events) == whole.output_text
    assert stored.status == whole.status == "incomplete"
    assert stored.output_text == whole.output_text
    await scripted.wait_idle()


async def test_a_completed_background_stream_is_read_whole_from_its_start(nursery: trio.Nursery) -> None:
    """``response.completed`` exactly once, read by the POST and by a second reader
    from the start; the stored object is the last event's."""
    backend = ScriptedBackend([b"The", b" answer", b" is", b" forty", b"-two", b"."], token_interval=0.01)
    running = await start_server(nursery, backend, detach=ROOMY, shutdown_grace=0.0, http=STORED)
    try:
        async with _sdk(running) as client:
            first = await client.responses.create(model="scripted", input="hi", background=True, stream=True)
            on_post = await _read_until(first)
            response_id = on_post[0].response.id
            again = await client.responses.retrieve(response_id, stream=True)
            replayed = await _read_until(again)
            stored = await client.responses.retrieve(response_id)
    finally:
        running.server.shutdown()
    for events in (on_post, replayed):
        assert [e.sequence_number for e in events] == list(range(len(on_post)))
        assert _text(events) == "The answer is forty-two."
        assert [e.type for e in events].count("response.completed") == 1
    assert [e.type for e in on_post] == [e.type for e in replayed]
    assert on_post[-1].type == "response.completed"
    assert stored.status == "completed"
    assert stored.output_text == "The answer is forty-two."


async def test_last_event_id_resumes_after_that_event_and_wins_over_starting_after(
    scripted: RunningServer,
) -> None:
    body = {"model": "scripted", "input": "hi", "max_output_tokens": 60}
    received = await _post_some(scripted, body, 6)
    events = _events(received)
    assert [int(event_id or -1) for event_id, _ in events] == [e["sequence_number"] for _, e in events]
    response_id = events[0][1]["response"]["id"]
    last = events[-1][0]
    assert last is not None
    async with scripted.client() as client:
        response = await client.get(
            f"/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": 0, "include_obfuscation": "false"},
            headers={"Last-Event-ID": last},
        )
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        resumed = _events(response.content)
        assert resumed[0][0] == str(int(last) + 1)
        complete = events + resumed
        assert [e["sequence_number"] for _, e in complete] == list(range(len(complete)))
        assert [e["type"] for _, e in complete].count("response.incomplete") == 1
        text = "".join(e["delta"] for _, e in complete if e["type"] == "response.output_text.delta")
        assert text == "".join(f" tok{i}" for i in range(60))
        # past the last event of a finished stream: 204 (an EventSource stops reconnecting)
        final = resumed[-1][0]
        assert final is not None
        done = await client.get(
            f"/v1/responses/{response_id}", params={"stream": "true"}, headers={"Last-Event-ID": final}
        )
        assert done.status_code == 204


async def test_refusals_name_what_to_fix(scripted: RunningServer) -> None:
    async with scripted.client() as client:
        short = {"input": "hi", "max_output_tokens": 3}
        foreground = (await client.post("/v1/responses", json=short)).json()
        polled = (await client.post("/v1/responses", json={**short, "background": True})).json()
        for made in (foreground, polled):
            refused = await client.get(f"/v1/responses/{made['id']}", params={"stream": "true"})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "stream"
            assert "background: true and stream: true" in error["message"]
            # without stream: the object, as before
            assert (await client.get(f"/v1/responses/{made['id']}")).status_code == 200
        unknown = await client.get("/v1/responses/resp_nope", params={"stream": "true"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "response_id"  # (OpenAI's shape)
        assert unknown.json()["error"]["type"] == "invalid_request_error"
        received = await _post_some(scripted, {"input": "hi", "max_output_tokens": 30}, 3)
        response_id = _events(received)[0][1]["response"]["id"]
        for bad in ("x", "-1", "1.5"):
            wrong = await client.get(
                f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": bad}
            )
            assert wrong.status_code == 400, bad
            assert wrong.json()["error"]["param"] == "starting_after"
        header = await client.get(
            f"/v1/responses/{response_id}", params={"stream": "true"}, headers={"Last-Event-ID": "x"}
        )
        assert header.status_code == 400
        assert header.json()["error"]["param"] == "Last-Event-ID"
        # (its id is not a conversation id another stream may take over)
        clash = await client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 3, "stream": True},
            headers={"X-Conversation-Id": response_id},
        )
        assert clash.status_code == 400
        assert clash.json()["error"]["param"] == "X-Conversation-Id"
        unstreamed = await client.get(f"/v1/responses/{response_id}", params={"starting_after": 3})
        assert unstreamed.status_code == 400
        assert unstreamed.json()["error"]["param"] == "starting_after"
        both = await client.post(
            "/v1/responses",
            json={"input": "hi", "background": True, "stream": True},
            headers={"X-Conversation-Id": "conv-x"},
        )
        assert both.status_code == 400
        assert both.json()["error"]["param"] == "X-Conversation-Id"
    await scripted.wait_idle()


async def test_without_detachable_streams_background_with_stream_is_refused(nursery: trio.Nursery) -> None:
    running = await start_server(nursery, ScriptedBackend(), detach=None, shutdown_grace=0.0, http=STORED)
    try:
        async with running.client() as client:
            refused = await client.post(
                "/v1/responses", json={"input": "hi", "background": True, "stream": True}
            )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "stream"
        assert "--detach-max 0" in refused.json()["error"]["message"]
    finally:
        running.server.shutdown()


@pytest.mark.parametrize("how", ["cancel", "delete"])
async def test_cancel_or_delete_stops_a_detached_background_stream(scripted: RunningServer, how: str) -> None:
    backend = scripted.engine.backend
    received = await _post_some(scripted, {"input": "hi", "max_output_tokens": 4000}, 3)
    response_id = _events(received)[0][1]["response"]["id"]
    stream = _stream_of(scripted, response_id)
    job = stream.job
    assert job is not None
    await wait_for(lambda: stream.log.readers == 0)  # detached
    assert not job.done.is_set()
    async with scripted.client() as client:
        if how == "cancel":
            answer = await client.post(f"/v1/responses/{response_id}/cancel")
            assert answer.status_code == 200, answer.text
            assert answer.json()["status"] == "cancelled"
            # its events stay readable to their end, the last one says why
            rest = await client.get(f"/v1/responses/{response_id}", params={"stream": "true"})
            assert rest.status_code == 200
            final = _events(rest.content)[-1][1]
            assert final["response"]["trioserve"]["end_cause"] == "cancelled"
        else:
            answer = await client.delete(f"/v1/responses/{response_id}")
            assert answer.status_code == 200, answer.text
            assert answer.json()["deleted"] is True
            gone = await client.get(f"/v1/responses/{response_id}", params={"stream": "true"})
            assert gone.status_code == 404
    assert job.done.is_set()
    assert job.cause == "cancelled"
    await scripted.wait_idle()
    assert backend.generations.running == 0


async def test_another_keys_background_stream_does_not_exist_for_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    running = await start_server(
        nursery,
        ScriptedBackend(token_interval=0.01),
        detach=ROOMY,
        shutdown_grace=0.0,
        http=STORED,
        keys_file=keys,
    )
    try:
        async with _sdk(running, "sk-one") as one:
            first = await one.responses.create(
                model="scripted", input="hi", max_output_tokens=4000, background=True, stream=True
            )
            response_id = (await _read_until(first, 0))[0].response.id
        mine = {"Authorization": "Bearer sk-one"}
        theirs = {"Authorization": "Bearer sk-two"}
        async with running.client() as client:
            params = {"stream": "true", "starting_after": "0"}
            other = await client.get(f"/v1/responses/{response_id}", params=params, headers=theirs)
            assert other.status_code == 404
            assert other.json()["error"]["param"] == "response_id"
            for method, path in (("POST", "/cancel"), ("DELETE", "")):
                denied = await client.request(method, f"/v1/responses/{response_id}{path}", headers=theirs)
                assert denied.status_code == 404, (method, denied.text)
            detached = running.server.state.detached
            assert detached is not None
            (stream,) = [s for (_, name), s in detached.streams.items() if name == response_id]
            assert stream.owner != ""  # (its key's)
            job = stream.job
            assert job is not None
            assert not job.done.is_set()  # (still running: theirs cannot stop it)
            stopped = await client.post(f"/v1/responses/{response_id}/cancel", headers=mine)
            assert stopped.json()["status"] == "cancelled"
        assert job.cause == "cancelled"
        backend = running.engine.backend
        assert isinstance(backend, ScriptedBackend)
        await wait_for(lambda: backend.generations.running == 0)
    finally:
        running.server.shutdown()


# ------------------------------------------------------------- on the real model


@pytest.mark.model
async def test_a_background_stream_resumed_by_the_sdk_has_the_uninterrupted_text(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, llama_backend, detach=ROOMY, shutdown_grace=0.0, http=STORED)
    model = llama_backend.info.id
    ask: dict[str, Any] = {
        "model": model,
        "input": "Write a long story about the history of the printing press.",
        "max_output_tokens": 64,
        "temperature": 0,
    }
    try:
        async with _sdk(running) as client:
            whole = await client.responses.create(**ask)
            await running.wait_idle()
            first = await client.responses.create(**ask, background=True, stream=True)
            events = await _read_until(first, 6)
            response_id = events[0].response.id
            last = events[-1].sequence_number
            resumed = await client.responses.retrieve(response_id, stream=True, starting_after=last)
            events += await _read_until(resumed)
        numbers = [event.sequence_number for event in events]
        assert numbers == list(range(len(numbers)))
        assert [event.type for event in events].count(f"response.{whole.status}") == 1
        assert _text(events) == whole.output_text
        await running.wait_idle()
    finally:
        running.server.shutdown()
