"""What a reader of a resumable stream sees while the stream says nothing (issue 48;
docs/resumable-streams.md, "The stream log"): a stream that holds after its first token
(what a slot wait after a park, or a long prefill after a resume, looks like to its
readers) sends each attached reader the dialect's keep-alive every
``--heartbeat-interval`` — into the log, so every reader gets the same bytes at the
same offsets (a llama-server client resumes by counting them) and none of them is an
event (no id); and ``GET /v1/requests`` shows the job detached while nobody reads it,
and its readers when they come (the parked phase: the model test in
``test_resumable_streams.py``)."""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator, Callable

import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend
from trioserve._backends._scripted import ScriptedBackend
from trioserve._core._backend import GenerationProgress, PreparedPrompt
from trioserve._core._channel import Aborted
from trioserve._core._types import GenerationEnd
from trioserve._http._detach import DetachedStream, DetachSettings
from trioserve._http._request import Phase

from .._helpers import RawStream, RunningServer, read_events_and_close, start_server, wait_for

SETTINGS = DetachSettings(log_events=512, log_bytes=256 * 1024, park_after=0.2, timeout=30.0)
#: a window a stream fills at once: nobody reads it, it is parked
SMALL = DetachSettings(log_events=24, log_bytes=64 * 1024, park_after=0.2, timeout=30.0)
#: the keep-alive interval of these servers (the server's --heartbeat-interval)
INTERVAL = 0.05
ROUTES = {
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 6, "stream": True}, b": ping\n"),
    "messages": (
        "/v1/messages",
        {
            "model": "scripted",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
        },
        b'event: ping\ndata: {"type":"ping"}\n\n',
    ),
}


class _HeldAfterItsFirstPiece(ScriptedBackend):
    """Emits its first piece, then says nothing until ``release`` is set (``holding``:
    it holds now)."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = threading.Event()
        self.release = threading.Event()

    def _infer(
        self,
        prompt: PreparedPrompt,
        emit: Callable[[bytes], None],
        aborted: Callable[[], bool],
        progress: GenerationProgress,
        **control: object,
    ) -> GenerationEnd:
        def held(piece: bytes) -> None:
            emit(piece)
            if not self.holding.is_set():
                self.holding.set()
                while not self.release.wait(0.001):
                    if aborted():
                        raise Aborted

        return super()._infer(prompt, held, aborted, progress, **control)  # type: ignore[arg-type]


@pytest.fixture
async def held(nursery: trio.Nursery) -> AsyncIterator[tuple[RunningServer, _HeldAfterItsFirstPiece]]:
    backend = _HeldAfterItsFirstPiece()
    running = await start_server(
        nursery, backend, detach=SETTINGS, shutdown_grace=0.0, http=HTTPSettings(heartbeat_interval=INTERVAL)
    )
    yield running, backend
    backend.release.set()
    running.server.shutdown()


def _stream_of(running: RunningServer, conversation: str) -> DetachedStream:
    detached = running.server.state.detached
    assert detached is not None
    stream = detached.get("", conversation)
    assert stream is not None
    return stream


async def _start_and_drop(
    running: RunningServer, path: str, body: dict[str, object], conversation: str
) -> None:
    """POST the stream, read its first event, drop the connection; return once its
    job has written its first token and nobody reads it."""
    raw = await RawStream.post(running.url, path, body, {"X-Conversation-Id": conversation})
    head, _ = await read_events_and_close(raw, 1)
    assert head.status_code == 200
    stream = _stream_of(running, conversation)
    job = stream.job
    assert job is not None
    await wait_for(lambda: job.phase is Phase.STREAMING and stream.log.readers == 0)


async def _raw_get(running: RunningServer, target: str) -> RawStream:
    """A reader on a raw socket: it reads what the test asks, and closes when told."""
    host, port = running.url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return RawStream(stream)


@pytest.mark.parametrize("dialect", sorted(ROUTES))
async def test_a_reader_waiting_on_a_silent_stream_gets_keep_alives_in_the_log(
    held: tuple[RunningServer, _HeldAfterItsFirstPiece], dialect: str
) -> None:
    running, backend = held
    path, body, beat = ROUTES[dialect]
    await _start_and_drop(running, path, body, "ka")
    await wait_for(backend.holding.is_set)
    stream = _stream_of(running, "ka")
    first_token_at = stream.log.total_bytes  # (the log up to the first token: the job now holds)
    async with (
        running.client() as client,
        client.stream("GET", "/v1/stream", params={"conv_id": "ka"}) as reader,
    ):
        assert reader.status_code == 200
        received = b""
        chunks = reader.aiter_bytes()
        with trio.fail_after(10):
            while received[first_token_at:].count(beat) < 3:
                received += await anext(chunks)
        # (before the fix: nothing after the first token until the model spoke again)
        backend.release.set()
        async for chunk in chunks:
            received += chunk
    assert received.endswith(b"data: [DONE]\n\n" if dialect == "completions" else b'message_stop"}\n\n')
    # keep-alives are no events: every id belongs to an event, in order, none skipped
    ids = [int(i) for i in re.findall(rb"^id: (\d+)$", received, re.MULTILINE)]
    assert ids == list(range(len(ids)))
    events = [
        block for block in received.split(b"\n\n") if b"data:" in block and b'"type":"ping"' not in block
    ]
    assert len(ids) == len(events)
    assert not re.search(rb"id: \d+\n(: ping|event: ping)", received)
    # they are in the log: every reader gets the same bytes at the same offsets, so a
    # client that counted what it received resumes exactly where it was
    async with running.client() as client:
        again = await client.get("/v1/stream", params={"conv_id": "ka"})
        assert again.content == received
        after_a_beat = received.index(beat, first_token_at) + len(beat)
        resumed = await client.get("/v1/stream", params={"conv_id": "ka", "from": after_a_beat})
        assert resumed.content == received[after_a_beat:]
        (found,) = (await client.post("/v1/streams/lookup", json={"conversation_ids": ["ka"]})).json()
    assert found["total_bytes"] == len(received)
    job = stream.job
    assert job is not None
    assert job.cause == "length"


async def test_no_keep_alive_goes_into_a_log_nobody_reads(
    held: tuple[RunningServer, _HeldAfterItsFirstPiece],
) -> None:
    running, backend = held
    path, body, _ = ROUTES["completions"]
    await _start_and_drop(running, path, body, "quiet")
    await wait_for(backend.holding.is_set)
    stream = _stream_of(running, "quiet")
    size = stream.log.total_bytes
    await trio.sleep(10 * INTERVAL)  # (what is measured: ten intervals with nobody reading add nothing)
    assert stream.log.total_bytes == size


async def test_get_requests_shows_a_detached_stream_and_its_readers(
    held: tuple[RunningServer, _HeldAfterItsFirstPiece],
) -> None:
    running, backend = held
    path, body, _ = ROUTES["completions"]
    await _start_and_drop(running, path, body, "listed")
    await wait_for(backend.holding.is_set)
    stream = _stream_of(running, "listed")
    job = stream.job
    assert job is not None
    async with running.client() as client:
        (entry,) = (await client.get("/v1/requests")).json()["data"]
        assert entry["id"] == job.exchange.request_id
        assert (entry["phase"], entry["paused"]) == ("detached", None)
        assert (entry["conversation_id"], entry["readers"]) == ("listed", 0)
        reader = await _raw_get(running, "/v1/stream?conv_id=listed")
        await reader.read_until(b"\r\n\r\n")
        await wait_for(lambda: stream.log.readers == 1)
        (entry,) = (await client.get("/v1/requests")).json()["data"]
        assert (entry["phase"], entry["paused"], entry["readers"]) == ("decode", None, 1)
        await reader.aclose()
        await wait_for(lambda: stream.log.readers == 0)
        # a request that is not a resumable stream's job
        plain = await RawStream.post(
            running.url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}
        )
        await wait_for(lambda: len(running.server.state.requests) == 2)
        entries = (await client.get("/v1/requests")).json()["data"]
        assert [(e["conversation_id"], e["readers"]) for e in entries] == [("listed", 0), (None, None)]
        await plain.aclose()


async def _entry(client: object, conversation: str) -> dict[str, object]:
    import httpx

    assert isinstance(client, httpx.AsyncClient)
    entries = (await client.get("/v1/requests")).json()["data"]
    (entry,) = [e for e in entries if e["conversation_id"] == conversation]
    return dict(entry)


@pytest.mark.model
async def test_a_reader_of_a_parked_stream_waiting_for_its_slot_gets_keep_alives(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """One slot. A stream nobody reads is parked; another request takes the slot; a
    reader comes back (``from=`` the end): the stream queues for its slot, saying
    nothing (once the tokens its channel held are out), and the reader gets
    keep-alives meanwhile (GET /v1/requests: ``paused``,
    ``parked``, one reader); the slot comes back, and the stream goes on to its end."""
    running = await start_server(
        nursery,
        llama_backend,
        detach=SMALL,
        shutdown_grace=0.0,
        http=HTTPSettings(heartbeat_interval=INTERVAL),
    )
    body = {
        "prompt": "A long story about the sea",
        "max_tokens": 64,
        "stream": True,
        "logit_bias": {"1": -100, "106": -100},  # (no end before the log is full)
    }
    try:
        async with running.client() as client:
            raw = await RawStream.post(running.url, "/v1/completions", body, {"X-Conversation-Id": "parked"})
            await read_events_and_close(raw, 2)
            stream = _stream_of(running, "parked")
            await wait_for(lambda: stream.state == "parked", limit=60)
            assert (await _entry(client, "parked"))["phase"] == "detached"
            assert (await _entry(client, "parked"))["paused"] == "parked"
            admission = running.engine.admission
            occupier = await RawStream.post(running.url, "/v1/completions", {**body, "max_tokens": 400})
            await wait_for(lambda: admission.in_use == 1, limit=30)
            end = stream.log.total_bytes  # (parked: nothing is written)
            reader = await _raw_get(running, f"/v1/stream?conv_id=parked&from={end}")
            await wait_for(lambda: admission.snapshot().queued == 1, limit=30)
            entry = await _entry(client, "parked")
            assert (entry["phase"], entry["paused"], entry["readers"]) == ("paused", "parked", 1)
            # (the tokens its channel held go out first; then it says nothing until
            # its slot comes back: keep-alives only)
            with trio.fail_after(30):
                while reader.received[reader.received.rfind(b"data:") :].count(b": ping\n") < 3:
                    chunk = await reader.stream.receive_some(65536)
                    assert chunk
                    reader.received += chunk
            assert admission.snapshot().queued == 1  # (still waiting for its slot)
            await occupier.aclose()  # (the slot goes back to the stream)
            with trio.fail_after(60):
                received = await reader.read_until(b"data: [DONE]")
            await reader.aclose()
        ids = [int(i) for i in re.findall(rb"^id: (\d+)$", received, re.MULTILINE)]
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        job = stream.job
        assert job is not None
        assert job.cause == "length"
        assert stream.parks >= 1
        await running.wait_idle()
    finally:
        running.server.shutdown()
