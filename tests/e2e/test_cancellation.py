"""Cancellation, proven: every cause × every phase, against a real hypercorn server on a
real socket, with real llama.cpp inference on the default model.

For every cell the test asserts:

* what the client saw (nothing more / a final event + ``[DONE]`` / a status code);
* that the inference thread left llama.cpp promptly (the logged cancel latency, and
  ``/health``'s ``generations_running``);
* that the slot, the queue place, the stream and the request are all gone;
* that the next request on the same context gives the text a fresh server gives;
* that the end was recorded with its cause (the request's log line).

Every cell runs against the llama backend with one sequence and with two (the queued
phase occupies both; "inference thread" is "sequence in the batch"), and on each API
dialect: ``/v1/completions`` (the plain matrix), Anthropic's ``/v1/messages``, OpenAI's
``/v1/responses`` and Ollama's ``/api/chat`` (``test_cancel_cell_dialects``).

Causes: TCP close, half-close, HTTP/2 stream reset, close during a non-streaming
request, deadline (``X-Request-Timeout``), server shutdown, and deadline and shutdown
for a non-streaming request (answered with 504 / 503: nothing was sent yet). (The
caller's own cancel scope, for library use, is in ``test_library_cancellation.py``.)
Phases: queued (every slot busy), prefill (a ~1,700-token prompt, a chunk in flight
inside llama.cpp), decode (a token decode in flight), and blocked on a slow consumer
(the client stops reading; its receive buffer is tiny; the sequence is paused on its
full channel). Each phase is reached by waiting on what shows it, never by sleeping.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend, LlamaSettings
from trioserve._http import FINAL_EVENT_TIMEOUT

from .._helpers import H2Stream, RawStream, RunningServer, start_server, verifying, wait_for

pytestmark = pytest.mark.model

CAUSES = [
    "close",
    "half_close",
    "h2_reset",
    "non_stream_close",
    "deadline",
    "shutdown",
    "non_stream_deadline",
    "non_stream_shutdown",
]
#: cancel by id (``POST /v1/requests/{id}/cancel``, docs/operations.md): the plain
#: matrix's and the dialects' cells
ID_CAUSES = ["by_id", "non_stream_by_id"]
PHASES = ["queued", "prefill", "decode", "blocked"]
#: longer than every phase takes to reach, even on a loaded machine: a stall must never
#: come before the cause under test (a cancelled request's blocked send is cut after
#: FINAL_EVENT_TIMEOUT anyway)
STALL_TIMEOUT = 10.0
LONG_PROMPT = "The history of the city is long and varied. " * 170  # ~1,700 tokens, ~2 s prefill
#: a text that invites a copy of itself: the "verify" phase is a speculative verify call
#: (several rows of the stream) inside llama.cpp (docs/speculation.md)
COPY_PROMPT = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
REFERENCE = {"prompt": "The capital of France is", "max_tokens": 40, "temperature": 0}
#: a cancel must reach the thread well within this (measured: ~1 ms; the bound is generous)
CANCEL_LATENCY_BOUND_MS = 250.0


@pytest.fixture(scope="module", params=["one", "two"])
def llama_backend(request: pytest.FixtureRequest, llama_backend: LlamaBackend) -> LlamaBackend:
    """This module's backend: one sequence, and two."""
    if request.param == "two":
        backend: LlamaBackend = request.getfixturevalue("batched_backend")
        return backend
    return llama_backend


def _fresh_reference(backend: LlamaBackend) -> str:
    """What a fresh server on ``backend`` answers to REFERENCE."""

    async def fresh() -> str:
        async with trio.open_nursery() as nursery:
            running = await start_server(nursery, backend)
            async with running.client() as client:
                response = await client.post("/v1/completions", json=REFERENCE)
                text: str = response.json()["choices"][0]["text"]
            running.server.shutdown()
        return text

    return trio.run(fresh)


async def _victims_server(nursery: trio.Nursery, backend: LlamaBackend) -> RunningServer:
    return await start_server(
        nursery,
        backend,
        max_queue=4,
        shutdown_grace=0.0,
        stall_timeout=STALL_TIMEOUT,
        send_buffer_bytes=4096,
        http=HTTPSettings(),
    )


@pytest.fixture(scope="module")
def reference_text(llama_backend: LlamaBackend) -> str:
    return _fresh_reference(llama_backend)


@pytest.fixture
async def server(llama_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await _victims_server(nursery, llama_backend)
    yield running
    running.server.shutdown()


#: the API dialects: endpoint, and the body of a prompt (docs/dialects.md)
DIALECT_PATHS = {
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
    "ollama": "/api/chat",
}


def _dialect_body(dialect: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    if dialect == "messages":
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    if dialect == "responses":
        return {"input": prompt, "max_output_tokens": max_tokens}
    if dialect == "ollama":
        return {"messages": [{"role": "user", "content": prompt}], "options": {"num_predict": max_tokens}}
    return {"prompt": prompt, "max_tokens": max_tokens}


class Victim:
    """The request that gets cancelled, over the transport the cause needs (``extra``:
    more body fields — a constraint, ``n``), in an API dialect."""

    def __init__(
        self, cause: str, phase: str, extra: dict[str, Any] | None = None, dialect: str = "completions"
    ) -> None:
        self.streaming = not cause.startswith("non_stream_")
        self.cause = cause.removeprefix("non_stream_") if cause != "non_stream_close" else cause
        self.phase = phase
        self.dialect = dialect
        self.path = DIALECT_PATHS[dialect]
        self.request_id = uuid.uuid4().hex
        self.raw: RawStream | None = None
        self.h2: H2Stream | None = None
        prompt = {"prefill": LONG_PROMPT, "verify": COPY_PROMPT}.get(phase, "Once upon a time")
        self.body: dict[str, Any] = {
            **_dialect_body(dialect, prompt, 40 if phase == "prefill" else 3000),
            "temperature": 0,
            "stream": self.streaming,
            **(extra or {}),
        }
        if dialect == "ollama":  # (its sampling is in options)
            self.body["options"]["temperature"] = self.body.pop("temperature")
        self.headers = {"X-Request-Id": self.request_id}
        if self.cause == "deadline":
            self.headers["X-Request-Timeout"] = {
                "queued": "0.5",
                "prefill": "0.3",
                "decode": "1.0",
                "blocked": "6.0",  # the pause comes first: measured 1–3 s
            }[phase]

    async def send(self, url: str) -> None:
        if self.cause == "h2_reset":
            window = 256 if self.phase == "blocked" else None
            self.h2 = await H2Stream.post(url, self.path, self.body, self.headers, window=window)
        else:
            self.raw = await RawStream.post(
                url,
                self.path,
                self.body,
                self.headers,
                receive_buffer=1024 if self.phase == "blocked" else None,
            )

    async def read_events(self, count: int) -> None:
        """Read ``count`` text events (after the events a dialect opens its stream with;
        Ollama's are NDJSON lines)."""
        count += {"messages": 2, "responses": 4}.get(self.dialect, 0)
        marker = b'"done":false}\n' if self.dialect == "ollama" else b"data: "
        if self.h2 is not None:
            await self.h2.read_until(marker, count, acknowledge=self.phase != "blocked")
        else:
            assert self.raw is not None
            await self.raw.read_until(marker, count)

    async def apply_disconnect(self) -> None:
        if self.cause == "h2_reset":
            assert self.h2 is not None
            await self.h2.reset()
        elif self.cause == "half_close":
            assert self.raw is not None
            await self.raw.stream.send_eof()
        else:
            assert self.raw is not None
            await self.raw.aclose()

    async def received(self) -> bytes:
        """Everything the client got, reading to the end of the response."""
        if self.h2 is not None:
            with trio.move_on_after(STALL_TIMEOUT + 3):
                await self.h2.read_until(b"data: [DONE]")
            return self.h2.data
        assert self.raw is not None
        with trio.fail_after(STALL_TIMEOUT + 5):
            return await self.raw.read_to_eof_or(b"0\r\n\r\n")

    async def aclose(self) -> None:
        for transport in (self.raw, self.h2):
            if transport is not None:
                with trio.CancelScope(shield=True):
                    await transport.aclose()


async def _occupy_the_slots(server: RunningServer) -> list[RawStream]:
    occupiers = []
    for _ in range(server.engine.backend.slots):
        occupier = await RawStream.post(
            server.url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True}
        )
        occupiers.append(occupier)
        await occupier.read_until(b"data: ", 2)
    return occupiers


async def _wait_queued(server: RunningServer, count: int = 1) -> None:
    await wait_for(lambda: server.engine.admission.queued >= count)


def _only_stream(server: RunningServer) -> Any:
    """The victim's stream (its first choice, when it has several)."""
    streams = list(server.engine.streams)
    assert streams
    return min(streams, key=lambda s: s.choice_index)


async def _wait_inference_paused(server: RunningServer, backend: LlamaBackend) -> int:
    """Wait until every stream of the victim is paused: its channel is full (the
    consumer is blocked sending to the slow client) and no decode of it is in flight;
    return the first one's token count."""
    await wait_for(lambda: server.engine.streams)
    streams = list(server.engine.streams)
    await wait_for(
        lambda: all(s.buffered_room == 0 and backend.in_flight(s.progress) is None for s in streams), limit=30
    )
    return int(_only_stream(server).progress.completion_tokens)


def _has_log_line(caplog: pytest.LogCaptureFixture, request_id: str) -> bool:
    return any(r.name == "trioserve.requests" and request_id in r.getMessage() for r in caplog.records)


def _log_line(caplog: pytest.LogCaptureFixture, request_id: str) -> str:
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "trioserve.requests" and request_id in r.getMessage()
    ]
    assert len(lines) == 1, lines
    return lines[0]


def _events(data: bytes) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    for match in re.finditer(rb"data: (.*?)\n\n", data, re.S):
        payload = match.group(1)
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


#: every cell but three: a non-streaming response sends nothing until it is complete, so
#: it cannot be blocked on a slow reader
CELLS = [
    (c, p) for c in CAUSES + ID_CAUSES for p in PHASES if not (c.startswith("non_stream") and p == "blocked")
]


@pytest.mark.parametrize(("cause", "phase"), CELLS, ids=[f"{c}-{p}" for c, p in CELLS])
async def test_cancel_cell(
    cause: str,
    phase: str,
    server: RunningServer,
    llama_backend: LlamaBackend,
    reference_text: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await _cancel_cell(cause, phase, server, llama_backend, reference_text, caplog)


#: a JSON Schema whose shortest valid text is longer than any phase needs: the decode
#: under the constraint's mask is still running whenever the cause comes
LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 1000}},
    "required": ["items"],
}
CONSTRAINED = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG_SCHEMA}}
}
#: the cells of constrained decoding and of n > 1: every cause, the phases with inference
#: in flight (queued is the plain matrix's: nothing of the request has started)
EXTRA_CELLS = [(c, p) for c in CAUSES for p in ("prefill", "decode", "blocked") if (c, p) in CELLS]
#: what GET /v1/requests and the cancel's answer call each phase
PHASE_NAMES = {"queued": "queued", "prefill": "prefill", "decode": "decode", "blocked": "paused"}
#: the end cause each cause is recorded with
END_CAUSE = {"deadline": "deadline", "shutdown": "shutdown", "by_id": "cancelled"}


@pytest.mark.parametrize(("cause", "phase"), EXTRA_CELLS, ids=[f"{c}-{p}" for c, p in EXTRA_CELLS])
async def test_cancel_cell_constrained(
    cause: str,
    phase: str,
    server: RunningServer,
    llama_backend: LlamaBackend,
    reference_text: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Constrained decoding (a JSON Schema's mask on every token) in every cell."""
    await _cancel_cell(cause, phase, server, llama_backend, reference_text, caplog, extra=CONSTRAINED)


@pytest.fixture(scope="module")
def choices_reference(batched_backend: LlamaBackend) -> str:
    return _fresh_reference(batched_backend)


@pytest.fixture
async def choices_server(
    batched_backend: LlamaBackend, nursery: trio.Nursery
) -> AsyncIterator[RunningServer]:
    running = await _victims_server(nursery, batched_backend)
    yield running
    running.server.shutdown()


@pytest.mark.parametrize(("cause", "phase"), EXTRA_CELLS, ids=[f"{c}-{p}" for c, p in EXTRA_CELLS])
async def test_cancel_cell_choices(
    cause: str,
    phase: str,
    choices_server: RunningServer,
    batched_backend: LlamaBackend,
    choices_reference: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``n=2`` on two sequences (one evaluation of the prompt, shared): one cause ends both."""
    extra = {"n": 2, "temperature": 1.0, "seed": 7}
    await _cancel_cell(cause, phase, choices_server, batched_backend, choices_reference, caplog, extra=extra)


@pytest.mark.parametrize(("cause", "phase"), EXTRA_CELLS, ids=[f"{c}-{p}" for c, p in EXTRA_CELLS])
async def test_cancel_cell_batch(
    cause: str,
    phase: str,
    choices_server: RunningServer,
    batched_backend: LlamaBackend,
    choices_reference: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A batch of two prompts on /v1/completions (two sequences, two slots taken at
    once): one cause ends both."""
    prompt = LONG_PROMPT if phase == "prefill" else "Once upon a time"
    extra = {"prompt": [prompt, prompt]}
    await _cancel_cell(cause, phase, choices_server, batched_backend, choices_reference, caplog, extra=extra)


#: speculative decoding (docs/speculation.md): every cause but the deadline (its timer
#: starts with the request, before the phase can be reached), while a verify call of the
#: stream is inside llama.cpp — on one sequence and on two (the victim decodes alone there
#: too: only a stream alone in its step speculates)
VERIFY_CAUSES = [c for c in CAUSES if "deadline" not in c]


@pytest.fixture(scope="module")
def verify_backend(llama_backend: LlamaBackend, model_path: str) -> Iterator[LlamaBackend]:
    """The backend of the verify cells: this module's where a verify call is exact on this
    CPU, else the same sequences on ``--speculate fast`` (``verifying``)."""
    settings = llama_backend.settings
    fast = LlamaSettings(
        model_path, n_ctx=4096, n_threads=settings.n_threads, slots=settings.slots, speculate="fast"
    )
    yield from verifying(llama_backend, fast)


@pytest.fixture(scope="module")
def verify_reference(verify_backend: LlamaBackend) -> str:
    return _fresh_reference(verify_backend)


@pytest.fixture
async def verify_server(verify_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await _victims_server(nursery, verify_backend)
    yield running
    running.server.shutdown()


@pytest.mark.parametrize("cause", VERIFY_CAUSES)
async def test_cancel_cell_verify(
    cause: str,
    verify_server: RunningServer,
    verify_backend: LlamaBackend,
    verify_reference: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await _cancel_cell(cause, "verify", verify_server, verify_backend, verify_reference, caplog)


#: the dialects' cells: every cause but the two transport variants (half-close and an
#: HTTP/2 reset end the request through the same watcher as a close), every phase
DIALECT_CELLS = [
    (d, c, p)
    for d in ("messages", "responses", "ollama")
    for c, p in CELLS
    if c not in ("half_close", "h2_reset")
]


@pytest.mark.parametrize(
    ("dialect", "cause", "phase"), DIALECT_CELLS, ids=[f"{d}-{c}-{p}" for d, c, p in DIALECT_CELLS]
)
async def test_cancel_cell_dialects(
    dialect: str,
    cause: str,
    phase: str,
    server: RunningServer,
    llama_backend: LlamaBackend,
    reference_text: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anthropic Messages, OpenAI Responses and Ollama's /api/chat (docs/dialects.md) in
    every cell."""
    await _cancel_cell(cause, phase, server, llama_backend, reference_text, caplog, dialect=dialect)


async def _cancel_cell(
    cause: str,
    phase: str,
    server: RunningServer,
    llama_backend: LlamaBackend,
    reference_text: str,
    caplog: pytest.LogCaptureFixture,
    extra: dict[str, Any] | None = None,
    dialect: str = "completions",
) -> None:
    caplog.set_level(logging.INFO, logger="trioserve.requests")
    occupiers = await _occupy_the_slots(server) if phase == "queued" else []
    threads_started = llama_backend.generations.started
    victim = Victim(cause, phase, extra, dialect)
    if dialect == "ollama":  # (Ollama requires it)
        victim.body["model"] = server.engine.backend.info.id
    sent_at = trio.current_time()
    await victim.send(server.url)
    try:
        # --- bring the victim into its phase
        if phase == "queued":
            await _wait_queued(server)
        elif phase == "prefill":
            await wait_for(lambda: server.engine.streams)
            streams = list(server.engine.streams)
            if victim.cause != "deadline":  # (its 0.3 s deadline is already ticking)
                # a prompt chunk is being evaluated inside llama.cpp right now (a batch's
                # prompts are evaluated one after the other: one of them)
                await wait_for(lambda: any(llama_backend.in_flight(s.progress) == "prefill" for s in streams))
        elif phase == "decode":
            if victim.streaming:
                await victim.read_events(3)
            else:
                await wait_for(lambda: server.engine.streams)
                stream = _only_stream(server)
                await wait_for(lambda: stream.progress.completion_tokens >= 3)
            if victim.cause != "deadline":
                stream = _only_stream(server)
                await wait_for(lambda: llama_backend.in_flight(stream.progress) == "decode")
        elif phase == "verify":
            await wait_for(lambda: server.engine.streams)
            stream = _only_stream(server)
            # (a verify call needs a guess: the text copies itself, but a CPU may take
            # a while to start doing so)
            await wait_for(lambda: llama_backend.rows_in_flight(stream.progress) > 1, limit=60, step=0.0005)
        elif phase == "blocked":
            await victim.read_events(1)
            paused_at = await _wait_inference_paused(server, llama_backend)
            assert paused_at < 3000, "the producer must be paused by the slow client"

        # --- apply the cause
        if victim.cause == "deadline":
            pass  # it is already ticking
        elif victim.cause == "shutdown":
            server.server.shutdown()
        elif victim.cause == "by_id":
            async with server.client() as client:
                listed = (await client.get("/v1/requests")).json()["data"]
                (shown,) = [r for r in listed if r["id"] == victim.request_id]
                assert shown["phase"] == PHASE_NAMES[phase], shown
                answer = await client.post(f"/v1/requests/{victim.request_id}/cancel")
            assert answer.status_code == 200, answer.text
            assert answer.json()["phase"] == PHASE_NAMES[phase]
            assert answer.json()["end_cause"] == "cancelled"
            assert answer.json()["done"] is True  # answered once the request has ended
        else:
            await victim.apply_disconnect()

        # --- what the client saw
        if victim.cause in ("deadline", "shutdown", "by_id") and phase != "blocked":
            data = await victim.received()
            _check_final_event(victim, data)
        if victim.cause != "shutdown":
            for occupier in occupiers:
                await occupier.aclose()
            occupiers = []

        # --- everything released
        if victim.cause == "shutdown":
            with trio.fail_after(5):
                await server.server.stopped.wait()
        else:
            # blocked: a cancelled request whose send is stuck is cut after FINAL_EVENT_TIMEOUT,
            # not after the stall timeout
            limit = 5.0 if phase == "blocked" else 3.0
            if victim.cause == "deadline":
                # its deadline counts from the send, not from here: a fast CPU pauses the
                # blocked victim well before it (measured 1–3 s of its 6 s on one
                # machine, under 1 s on another); then the stuck send's cut, then slack
                ends_at = sent_at + float(victim.headers["X-Request-Timeout"]) + FINAL_EVENT_TIMEOUT
                limit = max(limit, ends_at + 3.0 - trio.current_time())
            health = await server.wait_idle(limit=limit)
            assert health["status"] == "ok"
        assert llama_backend.generations.running == 0
        assert server.engine.admission.in_use == 0
        assert server.engine.admission.queued == 0
        assert not server.engine.streams
        if phase == "queued":
            # the victim never reached inference: only the occupiers' threads ran
            assert llama_backend.generations.started == threads_started
    finally:
        for occupier in occupiers:
            await occupier.aclose()
        await victim.aclose()

    # --- recorded with its cause; the thread left llama.cpp promptly
    # (the line is written after the final event went out, which can be after /health
    # shows the server idle: wait for it)
    await wait_for(lambda: _has_log_line(caplog, victim.request_id))
    line = _log_line(caplog, victim.request_id)
    expected_cause = END_CAUSE.get(victim.cause, "disconnect")
    assert f"cause={expected_cause}" in line
    if phase != "queued":
        latency = re.search(r"cancel_latency_ms=([\d.]+)", line)
        assert latency is not None, line
        assert float(latency.group(1)) < CANCEL_LATENCY_BOUND_MS, line
    if phase == "prefill":
        assert "completion_tokens=0" in line, "cancelled during prefill: no token yet"

    # --- the next request matches a fresh server
    async with trio.open_nursery() as nursery:
        after = server if victim.cause != "shutdown" else await start_server(nursery, llama_backend)
        async with after.client() as client:
            text = (await client.post("/v1/completions", json=REFERENCE)).json()["choices"][0]["text"]
        if after is not server:
            after.server.shutdown()
    assert text == reference_text


def _check_final_event(victim: Victim, data: bytes) -> None:
    """Deadline, shutdown, a cancel by id: the client is told why its request ended."""
    cause = END_CAUSE[victim.cause]
    if not victim.streaming:
        # nothing was sent yet: an HTTP error status instead of a stream
        status = victim.h2.headers.get(b":status") if victim.h2 else data.split(b" ", 2)[1]
        assert status == {"deadline": b"504", "shutdown": b"503", "cancelled": b"409"}[cause], data[:200]
        assert b'"error"' in data
        if victim.dialect == "messages":  # Anthropic's error body
            assert b'"type":"error"' in data, data[-300:]
        return
    events = _events(data)
    if victim.dialect == "messages":
        # the open block closed, then message_delta (a stop reason strict clients accept)
        # with trioserve's cause, then message_stop
        assert events[-1] == {"type": "message_stop"}, data[-300:]
        final = events[-2]
        assert isinstance(final, dict)
        assert final["type"] == "message_delta"
        assert final["delta"]["stop_reason"] == "max_tokens"
        assert final["trioserve"]["end_cause"] == cause
        return
    if victim.dialect == "ollama":
        # NDJSON: a last line done, with a done_reason clients accept and the cause
        lines = [
            json.loads(line) for line in data.split(b"\r\n\r\n", 1)[-1].splitlines() if line.startswith(b"{")
        ]
        final = lines[-1]
        assert final["done"] is True, data[-300:]
        assert final["done_reason"] == "length"
        assert final["trioserve"]["end_cause"] == cause
        return
    if victim.dialect == "responses":
        final = events[-1]
        assert isinstance(final, dict), data[-300:]
        assert final["type"] == "response.incomplete"
        assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
        assert final["response"]["trioserve"]["end_cause"] == cause
        return
    assert events[-1] == "[DONE]", data[-300:]
    final = events[-2]
    assert isinstance(final, dict)
    assert final["choices"][0]["finish_reason"] == "length"  # OpenAI's value: the text was cut
    assert final["trioserve"]["end_cause"] == cause


async def test_deadline_half_a_second_ends_the_stream_and_frees_the_server(server: RunningServer) -> None:
    """X-Request-Timeout: 0.5 on a 2,000-token stream: the client gets the deadline
    event and [DONE] soon after 0.5 s (measured ≈ 0.51 s; docs/benchmarks.md), and the
    server is idle right after."""
    sent = time.perf_counter()
    raw = await RawStream.post(
        server.url,
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 2000, "stream": True},
        {"X-Request-Timeout": "0.5"},
    )
    with trio.fail_after(5):
        data = await raw.read_to_eof_or(b"0\r\n\r\n")
    elapsed = time.perf_counter() - sent
    await raw.aclose()
    events = _events(data)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert isinstance(final, dict)
    assert final["choices"][0]["finish_reason"] == "length"  # OpenAI's value
    assert final["trioserve"]["end_cause"] == "deadline"
    assert len(events) > 5  # it streamed text before the deadline
    assert 0.5 <= elapsed < 1.0  # generous; the benchmark reports the real figure
    health = await server.wait_idle(limit=0.5)
    assert health["generations_running"] == 0


async def test_a_queued_request_that_leaves_never_touches_the_running_ones(
    server: RunningServer, llama_backend: LlamaBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """Every slot busy with a /v1/messages stream, one more queued behind them: the queued
    client leaves (a cancel cascade would end a running stream too, ik_llama.cpp #1929).
    Every running stream ends on its own (``max_tokens``), with the text the same request
    gets afterwards, and its log line says so."""
    caplog.set_level(logging.INFO, logger="trioserve.requests")
    body = {
        "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
    }
    ids = [uuid.uuid4().hex for _ in range(llama_backend.slots)]
    running = [
        await RawStream.post(server.url, "/v1/messages", body, {"X-Request-Id": request_id})
        for request_id in ids
    ]
    for stream in running:
        await stream.read_until(b"content_block_delta")  # decoding
    queued = await RawStream.post(server.url, "/v1/messages", body)
    await _wait_queued(server)
    await queued.aclose()
    await wait_for(lambda: server.engine.admission.queued == 0)
    texts = []
    for stream in running:
        with trio.fail_after(60):
            data = await stream.read_to_eof_or(b"0\r\n\r\n")
        await stream.aclose()
        events = [e for e in _events(data) if isinstance(e, dict)]
        assert events[-1] == {"type": "message_stop"}, data[-300:]
        assert events[-2]["delta"]["stop_reason"] in ("max_tokens", "end_turn")
        texts.append(
            "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        )
    async with server.client() as client:
        again = (await client.post("/v1/messages", json={**body, "stream": False})).json()
    assert texts == [again["content"][0]["text"]] * len(running)
    for request_id in ids:
        await wait_for(lambda request_id=request_id: _has_log_line(caplog, request_id))  # type: ignore[misc]
        line = _log_line(caplog, request_id)
        assert "cause=length" in line or "cause=stop" in line, line


@pytest.fixture
async def stored_server(llama_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    """The victims' server, storing Responses in memory (background responses run)."""
    running = await start_server(
        nursery,
        llama_backend,
        max_queue=4,
        shutdown_grace=0.0,
        stall_timeout=STALL_TIMEOUT,
        http=HTTPSettings(responses_db="memory"),
    )
    yield running
    running.server.shutdown()


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode"])
async def test_cancel_cell_background(
    phase: str,
    stored_server: RunningServer,
    llama_backend: LlamaBackend,
    reference_text: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cancel by id (``POST /v1/responses/{id}/cancel``): a background response — a
    request scope no connection holds — in each phase with inference in flight or
    queued. The same teardown as a disconnect: the thread leaves llama.cpp within the
    bound, everything is released, the next request matches a fresh server's, and the
    stored response says ``cancelled``."""
    server = stored_server
    caplog.set_level(logging.INFO, logger="trioserve.requests")
    occupiers = await _occupy_the_slots(server) if phase == "queued" else []
    threads_started = llama_backend.generations.started
    prompt = LONG_PROMPT if phase == "prefill" else "Once upon a time"
    body = {"input": prompt, "max_output_tokens": 40 if phase == "prefill" else 3000, "temperature": 0}
    try:
        async with server.client() as client:
            created = await client.post("/v1/responses", json={**body, "background": True})
            assert created.status_code == 200, created.text
            response_id = created.json()["id"]
            assert created.json()["status"] == "queued"
            if phase == "queued":
                await _wait_queued(server)
            elif phase == "prefill":
                await wait_for(lambda: server.engine.streams)
                streams = list(server.engine.streams)
                await wait_for(lambda: any(llama_backend.in_flight(s.progress) == "prefill" for s in streams))
            else:
                await wait_for(lambda: server.engine.streams)
                stream = _only_stream(server)
                await wait_for(lambda: stream.progress.completion_tokens >= 3)
                await wait_for(lambda: llama_backend.in_flight(stream.progress) == "decode")
            running = (await client.get(f"/v1/responses/{response_id}")).json()
            assert running["status"] == ("queued" if phase == "queued" else "in_progress")
            cancelled = await client.post(f"/v1/responses/{response_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "cancelled"
            assert cancelled.json()["trioserve"]["end_cause"] == "cancelled"
            stored = (await client.get(f"/v1/responses/{response_id}")).json()
            assert stored["status"] == "cancelled"
        for occupier in occupiers:
            await occupier.aclose()
        occupiers = []
        health = await server.wait_idle(limit=3.0)
        assert health["status"] == "ok"
        assert llama_backend.generations.running == 0
        assert server.engine.admission.in_use == 0
        assert server.engine.admission.queued == 0
        assert not server.engine.streams
        if phase == "queued":
            assert llama_backend.generations.started == threads_started
    finally:
        for occupier in occupiers:
            await occupier.aclose()

    # (the cancel answers once the background request has ended: its line is written)
    line = _log_line(caplog, response_id)
    assert "cause=cancelled" in line
    if phase != "queued":
        latency = re.search(r"cancel_latency_ms=([\d.]+)", line)
        assert latency is not None, line
        assert float(latency.group(1)) < CANCEL_LATENCY_BOUND_MS, line
    if phase == "prefill":
        assert "completion_tokens=0" in line, "cancelled during prefill: no token yet"
    async with server.client() as client:
        text = (await client.post("/v1/completions", json=REFERENCE)).json()["choices"][0]["text"]
    assert text == reference_text


@pytest.mark.parametrize("cause", ["deadline", "shutdown"])
async def test_a_background_response_cut_short_is_stored_incomplete(
    cause: str, llama_backend: LlamaBackend, nursery: trio.Nursery, tmp_path: Any
) -> None:
    """A background response in decode when its deadline (the creating request's
    ``X-Request-Timeout``) passes, or the server shuts down (grace 0): it ends with that
    cause, and the store — a file, read again after the server stopped — says
    ``incomplete`` with the cause."""
    from trioserve._http._stored import ResponseStore

    database = tmp_path / "responses.sqlite3"
    server = await start_server(
        nursery, llama_backend, shutdown_grace=0.0, http=HTTPSettings(responses_db=str(database))
    )
    # (a count, greedy: it goes on past the deadline whatever this CPU's kernels draw —
    # a free story at temperature 1 sometimes ended before it)
    count = ", ".join(str(i) for i in range(1, 40)) + ","
    body = {"input": count, "max_output_tokens": 3000, "background": True, "temperature": 0}
    headers = {"X-Request-Timeout": "1.0"} if cause == "deadline" else {}
    async with server.client() as client:
        created = await client.post("/v1/responses", json=body, headers=headers)
        assert created.status_code == 200, created.text
        response_id = created.json()["id"]
        await wait_for(lambda: server.engine.streams)
        stream = _only_stream(server)
        await wait_for(lambda: stream.progress.completion_tokens >= 3)
        if cause == "shutdown":
            server.server.shutdown()
            with trio.fail_after(5):
                await server.server.stopped.wait()
        else:
            await server.wait_idle(limit=5.0)
            responses = server.server.state.responses
            assert responses is not None
            # (its end is stored once the task is done with it)
            await wait_for(lambda: response_id not in responses.jobs)
            assert (await client.get(f"/v1/responses/{response_id}")).json()["status"] == "incomplete"
            server.server.shutdown()
            with trio.fail_after(5):
                await server.server.stopped.wait()
    store = ResponseStore(database)
    try:
        stored = store.get(response_id, "")
    finally:
        store.close()
    assert stored is not None
    assert stored.status == "incomplete"
    assert stored.body["trioserve"]["end_cause"] == cause
    assert llama_backend.generations.running == 0
