"""Flow control and admission over HTTP: bounded queue with 429, FIFO order, queue
places freed on disconnect, stalled readers cut off, heartbeats, concurrent slots."""

from __future__ import annotations

import json
import logging
import time
from functools import partial

import httpx
import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend, ScriptedBackend

from .._helpers import RawStream, start_server, wait_for

pytestmark = pytest.mark.model


async def test_slots_1_queue_2_ten_simultaneous_requests(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    server = await start_server(nursery, llama_backend, max_queue=2)
    body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    async with server.client() as client:
        solo = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        responses: list[httpx.Response] = []

        async def one() -> None:
            responses.append(await client.post("/v1/completions", json=body))

        async with trio.open_nursery() as burst:
            for _ in range(10):
                burst.start_soon(one)
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(served) == 3
    assert len(refused) == 7
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "overloaded"
        assert "at capacity" in error["message"]
    assert all(r.json()["choices"][0]["text"] == solo for r in served)
    await server.wait_idle()
    server.server.shutdown()


async def test_queued_requests_are_served_in_arrival_order(nursery: trio.Nursery) -> None:
    backend = ScriptedBackend([b"x"] * 5, token_interval=0.1)  # 0.5 s per request
    server = await start_server(nursery, backend, close_backend=True, max_queue=8)
    finished: list[str] = []
    async with server.client() as client:

        async def request(name: str) -> None:
            await client.post("/v1/completions", json={"prompt": name, "max_tokens": 5})
            finished.append(name)

        admission = server.engine.admission
        async with trio.open_nursery() as clients:
            for index in range(6):
                clients.start_soon(request, f"request-{index}")
                # wait until it is running or queued, so the arrival order is well defined
                await wait_for(lambda n=index + 1: admission.in_use + admission.queued == n)
    assert finished == [f"request-{i}" for i in range(6)]
    server.server.shutdown()


async def test_disconnect_while_queued_frees_the_place_at_once(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    server = await start_server(nursery, llama_backend, max_queue=1)
    occupier = await RawStream.post(
        server.url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True}
    )
    await occupier.read_until(b"data: ", 2)
    queued = await RawStream.post(server.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 5})
    await wait_for(lambda: server.engine.admission.queued == 1)
    async with server.client() as client:
        full = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        assert full.status_code == 429  # the one queue place is taken
        await queued.aclose()
        await wait_for(lambda: server.engine.admission.queued == 0, limit=0.5)
        # the freed place is usable right away
        async with trio.open_nursery() as inner:
            inner.start_soon(partial(client.post, "/v1/completions", json={"prompt": "Hi", "max_tokens": 5}))
            await wait_for(lambda: server.engine.admission.queued == 1, limit=2)
            await occupier.aclose()
    await server.wait_idle()
    server.server.shutdown()


async def test_a_client_that_never_reads_is_cut_off_after_the_stall_timeout(
    llama_backend: LlamaBackend, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trioserve.requests")
    stall = 3.0
    # a small unsent-bytes bound, so the server's send blocks soon after the client's
    # window closes, even when a loaded machine generates slowly
    server = await start_server(nursery, llama_backend, stall_timeout=stall, send_buffer_bytes=512)
    client = await RawStream.post(
        server.url,
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True},
        {"X-Request-Id": "never-reads"},
        receive_buffer=1024,
    )
    # it never reads: the server fills what the client's window allows, then stalls
    await wait_for(lambda: server.engine.streams, limit=5)
    started = time.perf_counter()
    health = await server.wait_idle(limit=stall + 10)
    elapsed = time.perf_counter() - started
    assert health["requests_in_flight"] == 0
    assert llama_backend.generations.running == 0
    assert server.engine.admission.in_use == 0
    assert elapsed < stall + 1 + 5.0  # + the time the buffers took to fill (generous)
    # the connection is gone: the client sees a reset (or EOF) once it reads
    with trio.fail_after(5):
        reset = await _read_until_reset(client)
    assert reset, "the server must have reset the stalled connection"
    await client.aclose()
    lines = [r.getMessage() for r in caplog.records if "never-reads" in r.getMessage()]
    assert len(lines) == 1
    assert "cause=stall" in lines[0]
    server.server.shutdown()


async def _read_until_reset(client: RawStream) -> bool:
    """Drain what the kernel holds; True if the connection ends in a reset."""
    try:
        while await client.stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        return True
    return False


@pytest.mark.parametrize("phase", ["queued", "prefill"])
async def test_heartbeats_keep_a_silent_stream_alive(
    phase: str, llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    server = await start_server(nursery, llama_backend, http=HTTPSettings(heartbeat_interval=0.1))
    occupier = None
    if phase == "queued":
        # (greedy, its end tokens banned: it holds the slot until it is closed, whatever it draws)
        occupier_body = {
            "prompt": "Once upon a time",
            "max_tokens": 3000,
            "stream": True,
            "temperature": 0,
            "logit_bias": {"1": -100, "106": -100},
        }
        occupier = await RawStream.post(server.url, "/v1/completions", occupier_body)
        await occupier.read_until(b"data: ", 2)
        prompt = "Hi"
    else:
        prompt = "The history of the city is long and varied. " * 170  # ~2 s of prefill
    client = await RawStream.post(
        server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "stream": True}
    )
    try:
        await client.read_until(b": ping\n\n", 3)
        assert b"data: {" not in client.received  # three heartbeats before any token
        if occupier is not None:
            await occupier.aclose()
        data = await client.read_to_eof_or(b"0\r\n\r\n")
        assert b"data: [DONE]" in data
    finally:  # (a failure must not leave sockets for a later test's garbage collection)
        await client.aclose()
        if occupier is not None:
            await occupier.aclose()
    server.server.shutdown()


async def test_four_concurrent_streams_run_at_once_each_as_alone_in_invariant_mode(
    invariant_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    server = await start_server(nursery, invariant_backend)
    prompts = [
        "Once upon a time",
        "The capital of France is",
        "In a distant galaxy",
        "The recipe begins with",
    ]
    async with server.client() as client:
        solo = {}
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 32, "temperature": 0}
            solo[prompt] = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        together: dict[str, str] = {}
        peak = 0

        async def stream(prompt: str) -> None:
            nonlocal peak
            parts = []
            body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        parts.append(json.loads(line[6:])["choices"][0]["text"])
                        peak = max(peak, server.engine.admission.in_use)
            together[prompt] = "".join(parts)

        async with trio.open_nursery() as streams:
            for prompt in prompts:
                streams.start_soon(stream, prompt)
    assert peak == 4  # all four ran at once, each a sequence of the one context
    assert together == solo
    await server.wait_idle()
    server.server.shutdown()


async def test_a_full_queue_is_529_overloaded_error_on_the_anthropic_endpoint(nursery: trio.Nursery) -> None:
    """Anthropic's clients retry on 529 ``overloaded_error``: a full queue says so on
    ``/v1/messages`` (with ``retry-after``), and stays OpenAI's 429 elsewhere."""
    backend = ScriptedBackend(token_interval=0.01, slots=1)
    server = await start_server(nursery, backend, close_backend=True, max_queue=0)
    running = await RawStream.post(
        server.url,
        "/v1/messages",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000, "stream": True},
    )
    await running.read_until(b"content_block_delta")
    async with server.client() as client:
        messages = await client.post(
            "/v1/messages", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
        )
        chat = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
    await running.aclose()
    assert messages.status_code == 529
    assert int(messages.headers["retry-after"]) >= 1
    body = messages.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert "at capacity" in body["error"]["message"]
    assert chat.status_code == 429
    assert chat.json()["error"]["code"] == "overloaded"
    await server.wait_idle()
    server.server.shutdown()
