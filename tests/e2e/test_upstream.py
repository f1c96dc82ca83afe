"""trioserve in front of real upstream servers on 127.0.0.1 (:class:`UpstreamBackend`).

* llama-cpp-python's server and llama.cpp's C++ ``llama-server`` as the upstream (the
  ``upstream`` fixture runs each test on both): completions pass through, a client that
  leaves mid-decode makes the upstream's CPU go idle, a deadline ends the stream;
* llama-server only: a client that leaves mid-prefill makes it idle within a batch or
  two, with the settings in docs/deployment.md (``-b 16 -ub 16`` and ``return_progress``);
* two scripted trioserve processes as upstreams, behind ``trioserve serve --upstream``:
  least-outstanding balancing, and one upstream killed mid-run;
* backpressure: a client that stops reading stops the upstream's tokens;
* errors: upstream 4xx, an unreachable upstream, token-id prompts;
* embeddings through the relay (trioserve on the default model as the upstream): the
  upstream's own vectors, a client that leaves mid-batch or a deadline stops the
  upstream's evaluation, the upstream's 400s with its message; 501 and 503.

The llama-server binary: ``$TRIOSERVE_LLAMA_SERVER``, else what ``scripts/build-llama-server``
prints (it builds and caches it the first time, ~5 min). If neither works the llama-server
tests fail, saying why: they are never skipped.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from benchmarks.harness.servers import LLAMA_CPP_PYTHON, LLAMA_SERVER, Server, command, free_port
from trioserve import (
    Backend,
    BackendError,
    ContextLengthError,
    GenerationProgress,
    GenerationRequest,
    LlamaBackend,
    ModelInfo,
    ScriptedBackend,
    ServiceUnavailableError,
    UpstreamBackend,
    default_model_path,
)

from .._helpers import (
    RawStream,
    RunningServer,
    ServerProcess,
    leave_during_the_first_embedding_call,
    llama_server_command,
    start_server,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- helpers


def _cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, in clock ticks (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15; the list starts at field 3


async def _seconds_until_idle(pid: int, since: float, quiet: float = 0.3, limit: float = 15.0) -> float:
    """Seconds from ``since`` (``time.perf_counter()``) to the last time the process used
    CPU, once it has used none for ``quiet`` seconds. Resolution: one clock tick (10 ms)."""
    ticks = _cpu_ticks(pid)
    last_change = since
    with trio.fail_after(limit):
        while True:
            await trio.sleep(0.005)
            now = time.perf_counter()
            current = _cpu_ticks(pid)
            if current != ticks:
                ticks, last_change = current, now
            elif now - last_change >= quiet:
                return last_change - since


def _events(data: bytes) -> list[Any]:
    """The SSE events of a decoded response body: JSON chunks, then ``"[DONE]"``
    (comments and heartbeats left out)."""
    out: list[Any] = []
    for block in re.split(rb"\r?\n\r?\n", data):
        lines = [line[5:].removeprefix(b" ") for line in block.splitlines() if line.startswith(b"data:")]
        if lines:
            text = b"\n".join(lines).decode()
            out.append(text if text == "[DONE]" else json.loads(text))
    return out


async def _stream(
    client: httpx.AsyncClient, body: dict[str, object], **kwargs: Any
) -> tuple[str, dict[str, Any]]:
    """A streaming completion: (text, final chunk)."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}, **kwargs) as response:
        assert response.status_code == 200, await response.aread()
        data = await response.aread()
    events = _events(data)
    assert events[-1] == "[DONE]", data[-300:]
    chunks = events[:-1]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), chunks[-1]


Serve = Callable[[Backend], Awaitable[RunningServer]]


@pytest.fixture
async def serve(nursery: trio.Nursery) -> AsyncIterator[Serve]:
    """Start in-process servers; at the end, stop each gracefully (front first) and wait
    until it has closed its backend (an upstream backend's connection pool)."""
    started: list[RunningServer] = []

    async def start(backend: Backend) -> RunningServer:
        running = await start_server(nursery, backend, close_backend=True)
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        running.server.shutdown()
        with trio.fail_after(15):
            await running.server.stopped.wait()


# ---------------------------------------------------- llama.cpp servers as the upstream


class LlamaUpstream:
    """An upstream server process, and what a front must send it (``extra_body``)."""

    def __init__(self, kind: str, url: str, pid: int, extra_body: dict[str, object]) -> None:
        self.kind = kind
        self.url = url
        self.pid = pid
        self.extra_body = extra_body


def _run_upstream(
    kind: str, argv: list[str], port: int, log_dir: Path, extra_body: dict[str, object]
) -> Iterator[LlamaUpstream]:
    """Run ``argv`` (the harness's :class:`Server`) until it is ready; always end it."""
    server = Server(kind, argv, port, log_dir)
    try:
        server.wait_ready(timeout=120)
        yield LlamaUpstream(kind, server.url, server.pid, extra_body)
    finally:
        server.stop(grace=10)


@pytest.fixture(scope="module")
def llama_cpp_python_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaUpstream]:
    """llama-cpp-python's server on the default model, in a subprocess (always ended)."""
    port = free_port()
    model = default_model_path(progress=False)
    argv = command(LLAMA_CPP_PYTHON, model, port, threads=2, ctx_size=2048)
    log_dir = tmp_path_factory.mktemp("llama-cpp-python")
    # repeat_penalty 1.0 (llama-cpp-python's default is 1.1) to compare with direct requests
    yield from _run_upstream(LLAMA_CPP_PYTHON, argv, port, log_dir, {"repeat_penalty": 1.0})


#: llama-server's settings for a prompt evaluation that stops soon after a cancel
#: (docs/deployment.md, "Upstream llama-server"): small batches. (trioserve asks an
#: upstream that answers llama-server's /props for prompt-progress events itself:
#: ``return_progress``, the only results that wake its HTTP thread to notice a closed
#: connection before the first token.)
LLAMA_SERVER_BATCH = ("-b", "16", "-ub", "16")
LLAMA_SERVER_EXTRA_BODY: dict[str, object] = {}


@pytest.fixture(scope="module")
def llama_server_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaUpstream]:
    """llama.cpp's C++ llama-server on the default model, one slot (always ended)."""
    port = free_port()
    model = default_model_path(progress=False)
    argv = llama_server_command(model, port, ["--ctx-size", "4096", "--parallel", "1", *LLAMA_SERVER_BATCH])
    argv.append("--slots")
    log_dir = tmp_path_factory.mktemp("llama-server")
    yield from _run_upstream(LLAMA_SERVER, argv, port, log_dir, dict(LLAMA_SERVER_EXTRA_BODY))


@pytest.fixture(params=["llama-cpp-python", "llama-server"])
def upstream(request: pytest.FixtureRequest) -> LlamaUpstream:
    """Each upstream test runs against llama-cpp-python's server and llama-server."""
    name = "llama_cpp_python_upstream" if request.param == "llama-cpp-python" else "llama_server_upstream"
    found: LlamaUpstream = request.getfixturevalue(name)
    return found


@pytest.fixture
async def llama_front(upstream: LlamaUpstream, serve: Serve) -> RunningServer:
    return await serve(await UpstreamBackend.aload([upstream.url], extra_body=upstream.extra_body))


#: Gemma 3's end-of-sequence and end-of-turn tokens, banned so that streams run long
_NO_EOS = {"1": -100.0, "106": -100.0}


@pytest.mark.model
async def test_completions_pass_through(upstream: LlamaUpstream, llama_front: RunningServer) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0}
    async with httpx.AsyncClient(base_url=upstream.url, timeout=60) as direct:
        reference = (await direct.post("/v1/completions", json={**body, **upstream.extra_body})).json()
    expected = reference["choices"][0]["text"]
    assert expected

    async with llama_front.client() as client:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        result = response.json()
        assert result["choices"][0]["text"] == expected
        assert result["choices"][0]["finish_reason"] == "length"
        if upstream.kind == "llama-server":
            # its usage chunk gives the exact counts (and its prompt-progress events,
            # which carry no text, add nothing)
            assert result["usage"]["completion_tokens"] == 12
            assert result["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"] > 0
        else:  # no usage chunk from this upstream: text chunks are counted as tokens
            assert 0 < result["usage"]["completion_tokens"] <= 12

        text, final = await _stream(client, {**body, "stream_options": {"include_usage": True}})
        assert text == expected
        assert final["usage"]["completion_tokens"] > 0
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == reference["model"]  # the upstream's model id
    await llama_front.wait_idle()


@pytest.mark.model
async def test_client_disconnect_makes_the_upstream_go_idle(
    upstream: LlamaUpstream, llama_front: RunningServer
) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "stream": True, "logit_bias": _NO_EOS}
    client = await RawStream.post(llama_front.url, "/v1/completions", body)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.read_to_eof)  # a client that keeps reading
            await wait_for(lambda: client.received.count(b"data: ") >= 8, limit=60)
            before = _cpu_ticks(upstream.pid)
            await trio.sleep(0.3)
            busy_ticks = _cpu_ticks(upstream.pid) - before
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    closed = time.perf_counter()
    ticks_at_close = _cpu_ticks(upstream.pid)
    assert busy_ticks >= 3, f"the upstream was not generating before the disconnect ({busy_ticks} ticks)"

    idle_after = await _seconds_until_idle(upstream.pid, closed)
    cpu_after = (_cpu_ticks(upstream.pid) - ticks_at_close) / os.sysconf("SC_CLK_TCK")
    print(
        f"\n{upstream.kind} upstream: last CPU use {idle_after * 1000:.0f} ms after the client "
        f"disconnected ({cpu_after * 1000:.0f} ms of CPU; busy: {busy_ticks} ticks per 300 ms)"
    )
    # both stop after the token in progress (~20-60 ms here); generous for a shared
    # machine, but far below the seconds that the remaining tokens would take
    assert idle_after < 1.0, (
        f"the upstream kept using CPU for {idle_after * 1000:.0f} ms after the client "
        "disconnected from trioserve: the upstream request was not closed"
    )
    health = await llama_front.wait_idle()
    assert health["generations_running"] == 0  # no upstream request left open


@pytest.mark.model
async def test_a_cancel_by_id_in_the_relay_makes_the_upstream_go_idle(
    upstream: LlamaUpstream, llama_front: RunningServer
) -> None:
    """Cancel by id (``POST /v1/requests/{id}/cancel``) of a relayed stream: the same
    teardown as a disconnect — the upstream connection closed, the upstream idle."""
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "stream": True, "logit_bias": _NO_EOS}
    client = await RawStream.post(llama_front.url, "/v1/completions", body, {"X-Request-Id": "relayed"})
    try:
        with trio.fail_after(60):
            await client.read_until(b"data: ", 8)
        async with llama_front.client() as other:
            listed = (await other.get("/v1/requests")).json()["data"]
            assert [r["phase"] for r in listed] == ["decode"]
            cancelled = time.perf_counter()
            ticks_at_cancel = _cpu_ticks(upstream.pid)
            answer = await other.post("/v1/requests/relayed/cancel")
        assert answer.status_code == 200, answer.text
        with trio.fail_after(10):
            await client.read_to_eof_or(b"0\r\n\r\n")
    finally:
        await client.aclose()
    assert b'"end_cause":"cancelled"' in client.received
    idle_after = await _seconds_until_idle(upstream.pid, cancelled)
    cpu_after = (_cpu_ticks(upstream.pid) - ticks_at_cancel) / os.sysconf("SC_CLK_TCK")
    cpu = f"{cpu_after * 1000:.0f} ms CPU"
    print(f"\n{upstream.kind} upstream: idle {idle_after * 1000:.0f} ms after the cancel ({cpu})")
    assert idle_after < 1.0, f"the upstream kept using CPU for {idle_after * 1000:.0f} ms after the cancel"
    health = await llama_front.wait_idle()
    assert health["generations_running"] == 0


@pytest.mark.model
async def test_deadline_ends_the_stream_and_the_upstream_request(
    upstream: LlamaUpstream, llama_front: RunningServer
) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "logit_bias": _NO_EOS}
    async with llama_front.client() as client:
        started = time.perf_counter()
        text, final = await _stream(client, body, headers={"X-Request-Timeout": "1.0"})
        ended = time.perf_counter()
    assert text
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["trioserve"]["end_cause"] == "deadline"
    assert 0.9 < ended - started < 5.0
    idle_after = await _seconds_until_idle(upstream.pid, ended)
    print(f"\n{upstream.kind} upstream idle {idle_after * 1000:.0f} ms after the deadline's final event")
    assert idle_after < 1.0, f"the upstream kept using CPU for {idle_after * 1000:.0f} ms after the deadline"
    await llama_front.wait_idle()


#: a conversation in each API dialect (docs/dialects.md): the front renders it with the
#: model's chat format and relays the prompt as a /v1/completions stream
DIALECT_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me a story."}]}),
    "responses": ("/v1/responses", {"input": "Tell me a story."}),
}


def _dialect_text(dialect: str, body: dict[str, Any]) -> str:
    if dialect == "chat":
        return str(body["choices"][0]["message"]["content"])
    if dialect == "messages":
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return "".join(
        part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"]
    )


@pytest.mark.model
@pytest.mark.parametrize("dialect", ["messages", "responses"])
async def test_the_dialects_through_the_relay(
    dialect: str, llama_server_upstream: LlamaUpstream, serve: Serve
) -> None:
    """Anthropic Messages and OpenAI Responses in front of llama-server, relayed as
    completions: the same text as the front's chat completion of the same conversation
    (the same render, the same prompt relayed); a deadline ends the stream with its
    reason and the upstream request; a client that leaves mid-stream makes the upstream
    go idle. (llama-server's /props names the architecture: the front renders Gemma's
    turns, whose end markers are special tokens that the logit bias bans — with an
    upstream that names none, the ChatML fallback's markers are plain text the model can
    write.)"""
    upstream = llama_server_upstream
    # EOS and the turn markers banned on every relayed request: the stream outlasts the test
    no_turn_end = {**_NO_EOS, "105": -100.0}
    front = await serve(
        await UpstreamBackend.aload(
            [upstream.url], extra_body={**upstream.extra_body, "logit_bias": no_turn_end}
        )
    )
    path, conversation = DIALECT_BODIES[dialect]
    limit = {"max_tokens": 12} if dialect != "responses" else {"max_output_tokens": 12}
    async with front.client() as client:
        chat_path, chat = DIALECT_BODIES["chat"]
        expected = (await client.post(chat_path, json={**chat, "max_tokens": 12, "temperature": 0})).json()
        response = await client.post(path, json={**conversation, **limit, "temperature": 0})
        assert response.status_code == 200, response.text
        text = _dialect_text(dialect, response.json())
        assert text  # (the turn's end is banned: 12 tokens of text)
        assert text == _dialect_text("chat", expected)

        long = {"max_tokens": 1500} if dialect != "responses" else {"max_output_tokens": 1500}
        started = time.perf_counter()
        async with client.stream(
            "POST", path, json={**conversation, **long, "stream": True}, headers={"X-Request-Timeout": "1.0"}
        ) as streamed:
            data = await streamed.aread()
        ended = time.perf_counter()
    events = _events(data)
    final = events[-2] if dialect == "messages" else events[-1]
    assert isinstance(final, dict), data[-500:]
    assert (final.get("trioserve") or final["response"]["trioserve"])["end_cause"] == "deadline"
    assert 0.9 < ended - started < 5.0
    assert await _seconds_until_idle(upstream.pid, ended) < 1.0

    client_stream = await RawStream.post(front.url, path, {**conversation, **long, "stream": True})
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client_stream.read_to_eof)
            await wait_for(lambda: client_stream.received.count(b"data: ") >= 10, limit=60)
            nursery.cancel_scope.cancel()
    finally:
        await client_stream.aclose()
    closed = time.perf_counter()
    idle_after = await _seconds_until_idle(upstream.pid, closed)
    print(f"\n{upstream.kind} upstream idle {idle_after * 1000:.0f} ms after a {dialect} client left")
    assert idle_after < 1.0, f"the upstream kept using CPU for {idle_after * 1000:.0f} ms"
    health = await front.wait_idle()
    assert health["generations_running"] == 0


async def _slot(client: httpx.AsyncClient) -> dict[str, Any]:
    """llama-server's only slot (``GET /slots``; answered between two batches)."""
    slots = (await client.get("/slots")).json()
    assert isinstance(slots, list), slots
    assert len(slots) == 1, slots
    slot: dict[str, Any] = slots[0]
    return slot


@pytest.mark.model
async def test_client_disconnect_mid_prefill_makes_llama_server_go_idle(
    llama_server_upstream: LlamaUpstream, serve: Serve
) -> None:
    """With ``-b 16`` and ``return_progress`` (which trioserve sends to a llama-server
    on its own), llama-server notices the closed upstream connection at the next batch's
    progress event and drops the slot at the batch after: idle within ~2 batches
    (~50-100 ms here) instead of the rest of the prompt (seconds)."""
    upstream = llama_server_upstream
    backend = await UpstreamBackend.aload([upstream.url])
    assert backend.upstreams[0].request_fields == {"return_progress": True}
    front = await serve(backend)
    # a prompt it has never seen (the tag first: no cached prefix), ~1,500 tokens
    prompt = f"[document {uuid.uuid4().hex}] " + "The history of the city is long and varied. " * 150
    async with httpx.AsyncClient(base_url=upstream.url, timeout=60) as direct:
        total = len((await direct.post("/tokenize", json={"content": prompt})).json()["tokens"])
        assert total > 1000

        body = {"prompt": prompt, "max_tokens": 5, "stream": True, "temperature": 0.0}
        client = await RawStream.post(front.url, "/v1/completions", body)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.read_to_eof)
                # the phase, observed: its slot is evaluating this prompt
                with trio.fail_after(60):
                    while True:
                        slot = await _slot(direct)
                        if slot["is_processing"] and slot["n_prompt_tokens_processed"] >= 64:
                            break
                        await trio.sleep(0.005)
                nursery.cancel_scope.cancel()
        finally:
            await client.aclose()
        closed = time.perf_counter()
        ticks_at_close = _cpu_ticks(upstream.pid)
        processed = slot["n_prompt_tokens_processed"]
        assert slot["next_token"][0]["n_decoded"] == 0
        assert processed < total / 2, f"too late for the test: {processed} of {total} prompt tokens evaluated"
        assert b'"text":"' not in client.received.replace(b'"text":""', b"")  # no token yet

        idle_after = await _seconds_until_idle(upstream.pid, closed)
        cpu_after = (_cpu_ticks(upstream.pid) - ticks_at_close) / os.sysconf("SC_CLK_TCK")
        print(
            f"\nllama-server: last CPU use {idle_after * 1000:.0f} ms after the client left mid-prefill "
            f"({processed} of {total} prompt tokens evaluated; {cpu_after * 1000:.0f} ms of CPU after)"
        )
        # the rest of the prompt would take seconds; one batch of 16 is ~50 ms here, and
        # the bound is two batches (docs/deployment.md): 0.5 s leaves room for a loaded
        # machine. Without return_progress this is ~1 s (its HTTP thread's poll).
        assert idle_after < 0.5, (
            f"llama-server kept evaluating the prompt for {idle_after * 1000:.0f} ms after the client left"
        )
        assert not (await _slot(direct))["is_processing"]
    health = await front.wait_idle()
    assert health["generations_running"] == 0


# ------------------------------------------------------- two scripted trioserve upstreams


async def _health(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    health: dict[str, Any] = (await client.get(url + "/health")).json()
    return health


async def test_two_upstreams_balance_and_survive_one_killed() -> None:
    scripted = ("--scripted", "--scripted-interval", "0.02", "--slots", "4")
    with ServerProcess(*scripted) as first, ServerProcess(*scripted) as second:
        a = await trio.to_thread.run_sync(first.wait_ready)
        b = await trio.to_thread.run_sync(second.wait_ready)
        front_args = ("--upstream", a, "--upstream", b + "/v1", "--slots", "4", "--upstream-cooldown", "0.5")
        with ServerProcess(*front_args) as front:
            url = await trio.to_thread.run_sync(front.wait_ready)
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                health = await _health(client, url)
                assert health["slots"] == 8  # 4 per upstream
                assert (await client.get("/v1/models")).json()["data"][0]["id"] == "scripted"

                # four concurrent streams: least outstanding puts two on each upstream
                results: list[tuple[str, dict[str, Any]]] = []
                seen = [0] * 4

                async def one(i: int) -> None:
                    body = {"prompt": "hi", "max_tokens": 100, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        data = b""
                        async for chunk in response.aiter_bytes():
                            data += chunk
                            seen[i] = data.count(b"data: ")
                    events = _events(data)
                    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
                    results.append((text, events[-2]))

                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
                    await wait_for(lambda: min(seen) >= 3, limit=30)  # every stream has text
                    counts = [(await _health(client, u))["active_streams"] for u in (a, b)]
                    assert counts == [2, 2], f"streams per upstream: {counts}"
                    first.process.kill()  # SIGKILL, mid-stream
                finals = [final for _, final in results]
                # a failure mid-stream is an error event (the SDKs raise on it)
                reasons = sorted(
                    "error" if "error" in f else f["choices"][0]["finish_reason"] for f in finals
                )
                assert reasons == ["error", "error", "length", "length"], finals
                for final in finals:
                    if "error" in final:
                        assert a in final["error"]["message"]  # names the upstream
                        assert "broke off" in final["error"]["message"]

                # new requests are all served: by the survivor, or by a probe of the dead
                # upstream once its cooldown is over, retried on the survivor
                async def short() -> None:
                    response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
                    assert response.status_code == 200, response.text
                    assert response.json()["choices"][0]["text"] == " tok0 tok1 tok2 tok3 tok4"

                async with trio.open_nursery() as nursery:
                    for _ in range(6):
                        nursery.start_soon(short)
                await trio.sleep(0.6)  # another cooldown over: probed again
                for _ in range(3):
                    await short()
            assert front.stop() == 0
    log = "".join(front.log)
    assert "retrying on another upstream" in log  # a probe of the dead upstream, retried
    assert f"cannot reach upstream {a}" in log


# -------------------------------------------------------------------------- backpressure


async def test_a_client_that_stops_reading_stops_the_upstream(serve: Serve) -> None:
    upstream = await serve(ScriptedBackend(token_interval=0.001, context_length=10**7))
    front = await serve(await UpstreamBackend.aload([upstream.url]))

    def upstream_tokens() -> int:
        streams = list(upstream.engine.streams)
        return streams[0].progress.completion_tokens if streams else -1

    body = {"prompt": "hi", "max_tokens": 5_000_000, "stream": True}
    client = await RawStream.post(
        front.url, "/v1/completions", body, {"X-Request-Timeout": "60"}, receive_buffer=4096
    )
    try:
        await client.read_until(b"data: ", 5)
        # the deadline went upstream with the request
        (request,) = upstream.server.state.requests
        assert 40 < request.cancel_scope.deadline - trio.current_time() <= 60.001

        # the client reads nothing more: the upstream's generation must stop advancing
        previous = -2
        with trio.fail_after(30):
            while (current := upstream_tokens()) != previous:
                previous = current
                await trio.sleep(0.5)
        await trio.sleep(1.0)
        assert upstream_tokens() == previous, "the upstream kept generating for a client that stopped reading"
        async with upstream.client() as probe:
            health = (await probe.get("/health")).json()
        assert health["slots_in_use"] == 1
        assert health["generations_running"] == 1  # paused in emit(), not finished
        read = client.received.count(b"data: ")
        print(f"\nupstream paused after {previous} tokens; the client had read {read} events")
        assert previous < 20_000  # bounded: a few KiB in each buffer, not megabytes

        # reading again resumes the upstream
        await client.read_until(b"data: ", read + 300)
        await wait_for(lambda: upstream_tokens() > previous, limit=10)
    finally:
        await client.aclose()
    closed = time.perf_counter()
    await wait_for(lambda: not upstream.server.state.requests, limit=10)
    print(f"upstream request ended {(time.perf_counter() - closed) * 1000:.0f} ms after the client left")
    await front.wait_idle()
    await upstream.wait_idle()


# -------------------------------------------------------------------------------- errors


async def test_errors_are_mapped_once(serve: Serve) -> None:
    upstream = await serve(ScriptedBackend(context_length=4096))
    backend = await UpstreamBackend.aload([upstream.url])
    front = await serve(backend)
    async with front.client() as client:
        # token ids: refused here, before any upstream is asked
        response = await client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert response.status_code == 400
        assert "token-id prompts are not supported" in response.json()["error"]["message"]

        # the upstream's 400 reaches the client with the upstream's message
        _, final = await _stream(client, {"prompt": "hi", "max_tokens": 5000})
        assert final["error"]["code"] == "context_length_exceeded"
        assert "max_tokens is 5000 but only" in final["error"]["message"]

    # ... and the backend raises it as the matching trioserve error
    prepared = await backend.prepare(GenerationRequest(prompt="hi", max_tokens=5000))
    send, receive = trio.open_memory_channel[bytes](0)
    async with send, receive:
        with pytest.raises(ContextLengthError, match="max_tokens is 5000 but only"):
            await backend.generate(prepared, send, GenerationProgress(0))
    assert backend.upstreams[0].failures == 0  # a refused request is not a failed upstream

    # an upstream that cannot be reached: BackendError naming it, then a cooldown (503)
    dead = f"http://127.0.0.1:{free_port()}"
    unreachable = UpstreamBackend([dead], info=ModelInfo(id="m", context_length=100), cooldown=30)
    try:
        prepared = await unreachable.prepare(GenerationRequest(prompt="hi"))
        send, receive = trio.open_memory_channel[bytes](0)
        async with send, receive:
            with pytest.raises(BackendError, match=f"cannot reach upstream {dead}"):
                await unreachable.generate(prepared, send, GenerationProgress(0))
        with pytest.raises(ServiceUnavailableError, match="every upstream failed recently"):
            await unreachable.prepare(GenerationRequest(prompt="hi"))
    finally:
        await unreachable.aclose()
    with pytest.raises(BackendError, match="no upstream answered"):
        await UpstreamBackend.aload([dead], load_timeout=0.5)
    await front.wait_idle()


# ---------------------------------------------------------------------------- embeddings

EMBED_TEXTS = [
    "The cat sat on the mat.",
    "Stock markets fell sharply on Monday.",
    "Paris is the capital of France.",
    "Plants use sunlight to make sugar.",
]
#: dozens of embedding calls upstream: a client can leave while they run
LONG_INPUTS = [f"Input number {i}: " + "the history of the city is long and varied. " * 5 for i in range(256)]


@pytest.fixture
async def embeddings_upstream(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> AsyncIterator[RunningServer]:
    """trioserve on the default model (the session's backend: left open here)."""
    running = await start_server(nursery, llama_backend)
    yield running
    running.server.shutdown()
    with trio.fail_after(15):
        await running.server.stopped.wait()


@pytest.fixture
async def embeddings_relay(embeddings_upstream: RunningServer, serve: Serve) -> RunningServer:
    """A relay in front of ``embeddings_upstream`` (stopped first: set up after it)."""
    return await serve(await UpstreamBackend.aload([embeddings_upstream.url]))


def _relayed_upstream(relay: RunningServer) -> UpstreamBackend:
    backend = relay.engine.backend
    assert isinstance(backend, UpstreamBackend)
    return backend


@pytest.mark.model
async def test_embeddings_through_the_relay_are_the_upstreams(
    embeddings_upstream: RunningServer, embeddings_relay: RunningServer, llama_backend: LlamaBackend
) -> None:
    """A text, a list of texts, token-id lists and a token-id list, as floats and as
    base64 (the SDK's default, which it decodes): the relay's answers are the
    upstream's own, bit for bit (floats pass through as the upstream wrote them), with
    its token counts."""
    token_ids = [await llama_backend.tokenize_text(text, add_special=True) for text in EMBED_TEXTS[:2]]
    cases: list[Any] = [EMBED_TEXTS[0], EMBED_TEXTS, token_ids, token_ids[1]]
    size = llama_backend.embedding_size
    assert size is not None

    def calls(url: str) -> list[tuple[Any, Any]]:
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as sdk:
            model = sdk.models.list().data[0].id
            return [
                (
                    sdk.embeddings.create(model=model, input=case, encoding_format="float"),
                    sdk.embeddings.create(model=model, input=case),  # base64, decoded by the SDK
                )
                for case in cases
            ]

    direct = await trio.to_thread.run_sync(calls, embeddings_upstream.url)
    relayed = await trio.to_thread.run_sync(calls, embeddings_relay.url)
    for case, (direct_floats, direct_default), (floats, default) in zip(cases, direct, relayed, strict=True):
        expected = 1 if isinstance(case, str) or isinstance(case[0], int) else len(case)
        assert [item.index for item in floats.data] == list(range(expected))
        assert [item.embedding for item in floats.data] == [item.embedding for item in direct_floats.data]
        assert [item.embedding for item in default.data] == [item.embedding for item in direct_default.data]
        assert all(len(item.embedding) == size for item in floats.data)
        assert (
            floats.usage.prompt_tokens == floats.usage.total_tokens == direct_floats.usage.prompt_tokens > 0
        )
        assert default.usage.prompt_tokens == direct_default.usage.prompt_tokens
    assert relayed[2][0].usage.prompt_tokens == sum(len(ids) for ids in token_ids)
    # the base64 text itself: the same bytes (float32 of the same floats)
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"input": EMBED_TEXTS[:2], "encoding_format": "base64"}
        ours = (await client.post(embeddings_relay.url + "/v1/embeddings", json=body)).json()
        theirs = (await client.post(embeddings_upstream.url + "/v1/embeddings", json=body)).json()
    assert [item["embedding"] for item in ours["data"]] == [item["embedding"] for item in theirs["data"]]
    assert len(base64.b64decode(ours["data"][0]["embedding"])) == 4 * size
    (upstream,) = _relayed_upstream(embeddings_relay).upstreams
    assert upstream.outstanding == 0
    assert upstream.failures == 0
    await embeddings_relay.wait_idle()


@pytest.mark.model
async def test_a_client_that_leaves_the_relay_mid_batch_stops_the_upstream(
    embeddings_upstream: RunningServer, embeddings_relay: RunningServer, llama_backend: LlamaBackend
) -> None:
    """256 inputs through the relay: the client leaves once the upstream's first
    embedding call runs; the relay closes its upstream request, the upstream aborts the
    call in flight and makes no more. A deadline does the same (504)."""
    embedder = llama_backend.embedder
    calls, stopped_after = await leave_during_the_first_embedding_call(
        embeddings_relay.url, embedder, LONG_INPUTS
    )
    context = embedder.context
    assert context is not None
    print(
        f"\nthe client left the relay during the upstream's first call: {calls} call(s) made, "
        f"the upstream stopped {stopped_after * 1000:.0f} ms after"
    )
    assert calls <= 2  # the one in flight (and at most the next, started before the flag was read)
    assert stopped_after < 1.0
    await embeddings_relay.wait_idle()
    await embeddings_upstream.wait_idle()
    (upstream,) = _relayed_upstream(embeddings_relay).upstreams
    assert upstream.outstanding == 0

    # the deadline: it went upstream too; the relay answers 504 and the upstream stops
    before = context.calls
    async with embeddings_relay.client() as http:
        started = trio.current_time()
        response = await http.post(
            "/v1/embeddings", json={"input": LONG_INPUTS}, headers={"X-Request-Timeout": "0.5"}
        )
        elapsed = trio.current_time() - started
        assert response.status_code == 504, response.text
        assert 0.5 <= elapsed < 2.0
        await wait_for(lambda: not embedder.busy, limit=5)
        assert context.calls - before < len(LONG_INPUTS) // 2
        assert upstream.failures == 0  # a deadline is not a failed upstream
        # and the next request is answered
        again = await http.post("/v1/embeddings", json={"input": EMBED_TEXTS[:2]})
        assert again.status_code == 200, again.text
        assert len(again.json()["data"]) == 2
    await embeddings_relay.wait_idle()


@pytest.mark.model
async def test_the_upstreams_embeddings_errors_come_back_with_its_message(
    embeddings_upstream: RunningServer, embeddings_relay: RunningServer, serve: Serve
) -> None:
    bad = [
        {"input": "x", "dimensions": 3},  # the relay does not know the size: the upstream checks it
        {"input": [[1, 2, 10**9]]},  # not a token id of the upstream's model
        {"input": "word " * 600},  # longer than the upstream's batch size
    ]
    async with httpx.AsyncClient(timeout=60) as client:
        for body in bad:
            direct = await client.post(embeddings_upstream.url + "/v1/embeddings", json=body)
            relayed = await client.post(embeddings_relay.url + "/v1/embeddings", json=body)
            assert direct.status_code == 400, direct.text
            assert relayed.status_code == 400, relayed.text
            assert relayed.json()["error"]["message"] == direct.json()["error"]["message"]
            assert relayed.json()["error"]["param"] == direct.json()["error"]["param"]
        # an empty list: refused by the relay itself, in the same words
        empty = await client.post(embeddings_relay.url + "/v1/embeddings", json={"input": []})
        direct = await client.post(embeddings_upstream.url + "/v1/embeddings", json={"input": []})
        assert empty.status_code == direct.status_code == 400
        assert empty.json()["error"] == direct.json()["error"]
    (upstream,) = _relayed_upstream(embeddings_relay).upstreams
    assert upstream.failures == 0  # a refused request is not a failed upstream

    # an unreachable upstream beside it (no cooldown: picked in turn): each request
    # that tries it first is retried on the other
    dead = f"http://127.0.0.1:{free_port()}"
    both = await UpstreamBackend.aload([dead, embeddings_upstream.url], cooldown=0.0)
    front = await serve(both)
    async with front.client() as client:
        for _ in range(3):
            response = await client.post("/v1/embeddings", json={"input": EMBED_TEXTS[0]})
            assert response.status_code == 200, response.text
    assert both.upstreams[0].failures >= 1  # (its turn came at least once)
    assert both.upstreams[1].requests == 3
    await front.wait_idle()


async def test_relayed_embeddings_from_an_upstream_without_them_or_none_reachable(serve: Serve) -> None:
    upstream = await serve(ScriptedBackend(context_length=4096))
    backend = await UpstreamBackend.aload([upstream.url])
    front = await serve(backend)
    async with front.client() as client:
        response = await client.post("/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 501, response.text
    assert response.json()["error"]["code"] == "no_embeddings"
    assert upstream.url in response.json()["error"]["message"]
    assert backend.upstreams[0].failures == 0  # it answered: up, just not an embedding model

    # none reachable: 503 naming the upstream, then 503 for its cooldown, Retry-After
    dead = f"http://127.0.0.1:{free_port()}"
    front = await serve(UpstreamBackend([dead], info=ModelInfo(id="m", context_length=100), cooldown=30))
    async with front.client() as client:
        first = await client.post("/v1/embeddings", json={"input": "hi"})
        assert first.status_code == 503, first.text
        assert f"cannot reach upstream {dead}" in first.json()["error"]["message"]
        assert first.json()["error"]["code"] == "upstream_unavailable"
        second = await client.post("/v1/embeddings", json={"input": "hi"})
        assert second.status_code == 503, second.text
        assert "every upstream failed recently" in second.json()["error"]["message"]
        assert 25 <= float(second.headers["retry-after"]) <= 30
    await front.wait_idle()


def test_cli_refuses_upstream_with_a_local_model() -> None:
    command = [sys.executable, "-m", "trioserve", "serve", "--upstream", "http://127.0.0.1:1", "--scripted"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "drop --model / --scripted" in done.stderr
