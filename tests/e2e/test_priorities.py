"""Priorities, preemption by pause and the keys file on real servers with real
inference (docs/scheduling.md): a better priority pauses a running stream, which
resumes with its text unchanged (batch-invariant: compared); a paused request
cancelled by id leaves nothing; a key's limits answer 429 with OpenAI's headers
through the openai SDK, its priority bound 403, and SIGHUP reloads the file.
Fair shares under load: ``benchmarks/fairness.py`` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import signal
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from trioserve import HTTPSettings, LlamaBackend

from .._helpers import RawStream, RunningServer, ServerProcess, start_server, wait_for

pytestmark = pytest.mark.model

#: Gemma's end of sequence, banned: every stream runs to its token limit
NO_EOS = {"1": -100}
PROMPTS = [
    "The history of Rome",
    "A recipe for bread",
    "The cat sat on",
    "My favourite city is",
    "Once upon a time",
    "The best way to learn",
    "In the year 2050",
    "Water boils at",
]


@pytest.fixture
async def invariant_server(
    invariant_backend: LlamaBackend, nursery: trio.Nursery
) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, invariant_backend, shutdown_grace=0.0, http=HTTPSettings())
    yield running
    running.server.shutdown()


@pytest.fixture
async def server(batched_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, batched_backend, shutdown_grace=0.0, http=HTTPSettings())
    yield running
    running.server.shutdown()


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int, **fields: object) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS, **fields}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


async def test_a_better_priority_pauses_a_running_stream_whose_text_is_unchanged(
    invariant_server: RunningServer,
) -> None:
    """Eight slots decoding priority-5 streams; a priority-0 request arrives: one stream
    is set aside (its cells saved) for it, and resumes after. With --batch-invariant
    every text is the uninterrupted one."""
    server = invariant_server
    admission = server.engine.admission
    tokens = 96
    async with server.client() as client:
        alone: dict[str, str] = {}

        async def reference(prompt: str) -> None:
            alone[prompt] = await _complete(client, prompt, tokens)

        async with trio.open_nursery() as nursery:
            for prompt in PROMPTS:
                nursery.start_soon(reference, prompt)
        urgent_alone = await _complete(client, "Hello, my name is", 8)
        preemptions = admission.preemptions

        paused: dict[str, str] = {}

        async def low(prompt: str) -> None:
            paused[prompt] = await _complete(client, prompt, tokens, priority=5)

        async with trio.open_nursery() as nursery:
            for prompt in PROMPTS:
                nursery.start_soon(low, prompt)

            streams = server.engine.streams
            await wait_for(
                lambda: len(streams) == len(PROMPTS) and all(s.progress.completion_tokens for s in streams),
                limit=60,
            )
            assert admission.in_use == admission.slots
            urgent = await _complete(client, "Hello, my name is", 8, priority=0)
            assert admission.preemptions == preemptions + 1
        assert paused == alone
        assert urgent == urgent_alone
    assert admission.paused == 0
    assert admission.in_use == 0


async def test_a_paused_request_cancelled_by_id_leaves_nothing(server: RunningServer) -> None:
    """The cancellation matrix's cell for a request set aside by preemption: a cancel by
    id reaches it while it waits to resume (the answer says ``paused``); its saved
    state and its place go; the others run on, and the next text is a fresh server's."""
    engine = server.engine
    admission = engine.admission
    fresh_body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    long = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "logit_bias": NO_EOS}
    async with server.client() as client:
        fresh = (await client.post("/v1/completions", json=fresh_body)).json()["choices"][0]["text"]
        streams = []
        try:
            for name, priority in (("low-1", 5), ("low-2", 5)):
                stream = await RawStream.post(
                    server.url, "/v1/completions", {**long, "priority": priority}, {"X-Request-Id": name}
                )
                await stream.read_until(b"data: ", 2)
                streams.append(stream)
            urgent = await RawStream.post(
                server.url, "/v1/completions", {**long, "priority": 0}, {"X-Request-Id": "urgent"}
            )
            streams.append(urgent)
            await urgent.read_until(b"data: ", 2)
            listed = (await client.get("/v1/requests")).json()["data"]
            (set_aside,) = [r for r in listed if r["paused"] == "preempted"]
            assert set_aside["phase"] == "paused"
            assert set_aside["priority"] == 5
            assert admission.paused == 1
            answer = await client.post(f"/v1/requests/{set_aside['id']}/cancel")
            assert answer.status_code == 200, answer.text
            assert answer.json()["phase"] == "paused"
            assert answer.json()["end_cause"] == "cancelled"
            cancelled = streams[0] if set_aside["id"] == "low-1" else streams[1]
            with trio.fail_after(5):
                data = await cancelled.read_to_eof_or(b"0\r\n\r\n")
            assert b'"end_cause":"cancelled"' in data
            assert admission.paused == 0
            # the two running on decode on: cancel them too, and nothing is left
            for request_id in ("urgent", "low-1" if set_aside["id"] == "low-2" else "low-2"):
                assert (await client.post(f"/v1/requests/{request_id}/cancel")).json()["cancelled"]
        finally:
            for stream in streams:
                await stream.aclose()
        await wait_for(lambda: not engine.streams and admission.in_use == 0 and not admission.queued)
        assert engine.backend.generations.running == 0
        assert admission.paused == 0
        again = (await client.post("/v1/completions", json=fresh_body)).json()["choices"][0]["text"]
        assert again == fresh


async def test_paused_requests_count_toward_max_queue(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """``--slots 1 --max-queue 1``: streams of priorities 10 then 9 — the first is set
    aside for the second (its saved state charged to the pause budget) and waits in
    the queue, so a third of priority 8 is answered 429, not paused too."""
    running = await start_server(nursery, llama_backend, shutdown_grace=0.0, max_queue=1, http=HTTPSettings())
    engine = running.engine
    admission = engine.admission
    long = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "logit_bias": NO_EOS}
    streams: list[RawStream] = []
    try:
        for priority in (10, 9):
            stream = await RawStream.post(running.url, "/v1/completions", {**long, "priority": priority})
            streams.append(stream)
            await stream.read_until(b"data: ", 2)
        await wait_for(lambda: admission.paused == 1)
        assert admission.snapshot().queued == 1
        assert admission.snapshot().paused_bytes > 0  # the real size of the saved state
        async with running.client() as client:
            third = await client.post(
                "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "priority": 8}
            )
            assert third.status_code == 429, third.text
            assert "at capacity" in third.json()["error"]["message"]
            assert admission.paused == 1  # nobody else set aside
            metrics = (await client.get("/metrics")).text
            assert "trioserve_paused_state_bytes " in metrics
    finally:
        for stream in streams:
            await stream.aclose()
        running.server.shutdown()
    await wait_for(lambda: not engine.streams and admission.in_use == 0 and not admission.queued)
    assert admission.pause_budget.used == 0


async def test_a_spent_pause_budget_makes_the_better_priority_wait(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """``--pause-ram 0``: a better priority is queued behind the running stream (no
    pause is asked, nobody is refused) and runs once it ends."""
    running = await start_server(
        nursery, llama_backend, shutdown_grace=0.0, pause_ram_bytes=0, http=HTTPSettings()
    )
    engine = running.engine
    admission = engine.admission
    low = await RawStream.post(
        running.url,
        "/v1/completions",
        {
            "prompt": "Once upon a time",
            "max_tokens": 3000,
            "stream": True,
            "priority": 10,
            "logit_bias": NO_EOS,
        },
    )
    try:
        await low.read_until(b"data: ", 2)
        async with running.client() as client, trio.open_nursery() as inner:
            answers: list[httpx.Response] = []

            async def urgent() -> None:
                answers.append(
                    await client.post(
                        "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "priority": 0}
                    )
                )

            inner.start_soon(urgent)
            await wait_for(lambda: admission.queued == 1)
            assert admission.snapshot().pauses_refused >= 1
            assert admission.preemptions == 0
            # the running stream was never set aside: it keeps streaming while the better
            # priority waits; once its client leaves, the waiting request runs
            seen = low.received.count(b"data: ")
            assert b"[DONE]" not in await low.read_until(b"data: ", seen + 4)
            assert (admission.queued, admission.paused) == (1, 0)
            await low.aclose()
        assert answers[0].status_code == 200, answers[0].text
    finally:
        await low.aclose()
        running.server.shutdown()
    assert admission.paused == 0


KEYS_FILE = """
[defaults]
priority = 3

[[key]]
name = "editor"
key = "sk-editor"
priority = 0
weight = 4

[[key]]
name = "batch"
key = "sk-batch"
priority = 10
requests_per_minute = 2
"""


def test_the_keys_file_sets_priorities_and_limits_and_is_reloaded_on_sighup(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    with ServerProcess("--threads", "2", "--slots", "2", "--keys-file", str(keys)) as server:
        url = server.wait_ready() + "/v1"
        batch = openai.OpenAI(base_url=url, api_key="sk-batch", max_retries=0)
        editor = openai.OpenAI(base_url=url, api_key="sk-editor", max_retries=0)
        model = editor.models.list().data[0].id
        raw = batch.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == "1"
        batch.completions.create(model=model, prompt="Hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as limited:
            batch.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
        error = limited.value
        assert error.code == "rate_limit_exceeded"
        assert "requests per minute (2)" in error.message
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(error.response.headers["retry-after"]) >= 1
        # a key may ask for a worse priority than its own, not a better one
        editor.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"priority": 7})
        with pytest.raises(openai.PermissionDeniedError) as denied:
            batch.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"priority": 0})
        assert "at best 10" in denied.value.message
        # a key not in the file is refused; after SIGHUP with it added, it works
        newcomer = openai.OpenAI(base_url=url, api_key="sk-new", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            newcomer.models.list()
        keys.write_text(textwrap.dedent(KEYS_FILE) + '\n[[key]]\nname = "new"\nkey = "sk-new"\n')
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not any("reloaded: 3 key(s)" in line for line in server.log):
            assert time.monotonic() < deadline, "".join(server.log[-20:])
            time.sleep(0.02)  # (the reload is logged: what shows it happened)
        newcomer.completions.create(model=model, prompt="Hi", max_tokens=1)
        # a file that fails to parse keeps the keys in force
        keys.write_text("[[key]]\nkey = 'sk-other'\nweight = 0\n")
        server.process.send_signal(signal.SIGHUP)
        while not any("not reloaded" in line for line in server.log):
            assert time.monotonic() < deadline + 10, "".join(server.log[-20:])
            time.sleep(0.02)
        newcomer.completions.create(model=model, prompt="Hi", max_tokens=1)
        assert server.stop() == 0


async def test_a_stream_paused_after_its_prompt_keeps_no_row_on_the_id_it_resumes_under(
    invariant_server: RunningServer,
) -> None:
    """Full hits (docs/prompt-cache.md) draw from the row an id kept for its prompt. A
    stream paused after its prompt resumes under another id, which holds another
    prompt's row: it must not claim it. Eight chat prompts (each ends on a cut) at
    priority 5, one set aside for a priority-0 request; then each prompt again: every
    text equals its text alone (batch-invariant), the paused one's too."""
    server = invariant_server
    admission = server.engine.admission
    backend = server.engine.backend
    assert isinstance(backend, LlamaBackend)
    tokens = 48
    chats = [f"<start_of_turn>user\n{p}<end_of_turn>\n<start_of_turn>model\n" for p in PROMPTS]
    async with server.client() as client:
        backend.clear_cache()
        alone: dict[str, str] = {}
        for chat in chats:  # (one at a time: each its own evaluation)
            alone[chat] = await _complete(client, chat, tokens)
        backend.clear_cache()
        preemptions = admission.preemptions

        async def low(chat: str) -> None:
            await _complete(client, chat, tokens, priority=5)

        async with trio.open_nursery() as nursery:
            for chat in chats:
                nursery.start_soon(low, chat)
            streams = server.engine.streams
            await wait_for(
                lambda: len(streams) == len(chats) and all(s.progress.completion_tokens for s in streams),
                limit=60,
            )
            await _complete(client, "Hello, my name is", 8, priority=0)
            assert admission.preemptions == preemptions + 1
        hits = backend.cache_stats()["whole_hits"]
        again = {chat: await _complete(client, chat, tokens) for chat in chats}
    assert again == alone
    # full hits were drawn (how many: a prompt that is not one takes the least recently
    # used id, another prompt's, which then is not one either)
    assert backend.cache_stats()["whole_hits"] > hits  # type: ignore[operator]


async def _streamed(
    client: httpx.AsyncClient, body: dict[str, object], decoding: trio.Event | None = None
) -> tuple[str, list[object]]:
    """A streamed completion's text and its tokens' log-probabilities; ``decoding`` is
    set once 8 tokens have come."""
    text: list[str] = []
    logprobs: list[object] = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["text"])
                    logprobs.extend((choice.get("logprobs") or {}).get("token_logprobs") or ())
            if decoding is not None and len(logprobs) >= 8:
                decoding.set()
    return "".join(text), logprobs


async def test_a_stream_paused_past_the_sliding_window_resumes_with_the_same_logprobs(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """One slot; a stream whose context is past Gemma 3's 512-token window is set aside
    for a priority-0 request and resumed from its saved state. Its window cells come
    back where a fresh evaluation put them (docs/prompt-cache.md, "Window cells in their
    places"), so every token's log-probability is the uninterrupted run's, bit for bit
    (restored as llama.cpp writes the state, they differ from the first token after the
    resume)."""
    server = await start_server(nursery, llama_backend, shutdown_grace=0.0, http=HTTPSettings())
    admission = server.engine.admission
    prompt = "The history of the old harbor town, told by its oldest inhabitant. " * 50
    assert len(llama_backend.tokenize(prompt)) > 600
    body = {
        "prompt": prompt,
        "max_tokens": 96,  # (the priority-0 request arrives after 8: ample time left to pause it)
        "temperature": 0,
        "logit_bias": {"1": -100, "106": -100},
        "logprobs": 1,
    }
    try:
        async with server.client() as client:
            alone = await _streamed(client, body)
            preemptions = admission.preemptions
            paused: list[tuple[str, list[object]]] = []

            decoding = trio.Event()

            async def low() -> None:
                paused.append(await _streamed(client, {**body, "priority": 5}, decoding))

            async with trio.open_nursery() as requests:
                requests.start_soon(low)
                with trio.fail_after(60):
                    await decoding.wait()
                await _complete(client, "Hello, my name is", 4, priority=0)
                assert admission.preemptions == preemptions + 1
        assert len(alone[1]) == 96
        assert paused == [alone]
    finally:
        server.server.shutdown()
