"""``POST /v1/embeddings`` on the default model, on a real socket: the official openai
SDK (float and base64), llama.cpp's llama-server ``--embeddings`` as the reference, bad
input, and a disconnect or deadline mid-batch (docs/embeddings.md). No verdict depends
on sampling: embeddings are deterministic up to the kernels' rounding, compared by
cosine."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import HTTPSettings, LlamaBackend, default_model_path

from .._helpers import (
    RawStream,
    RunningServer,
    leave_during_the_first_embedding_call,
    llama_server_command,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.model

TEXTS = [
    "The cat sat on the mat.",
    "A kitten rests on a rug.",
    "Stock markets fell sharply on Monday.",
    "Investors sold shares as prices dropped.",
    "Photosynthesis turns light into chemical energy.",
    "Plants use sunlight to make sugar.",
    "The train leaves at seven in the morning.",
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "She plays the violin beautifully.",
    "He repaired the bicycle's chain.",
    "Rain is expected over the weekend.",
    "The recipe needs two eggs and flour.",
    "Quantum computers use qubits.",
    "The museum opens at nine.",
    "Dogs are loyal companions.",
    "The river flooded the valley.",
    "A new phone was released today.",
    "Mountains were covered in snow.",
    "The library lends books for free.",
]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


@pytest.fixture
async def server(llama_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, llama_backend, http=HTTPSettings())
    yield running
    running.server.shutdown()


async def test_the_openai_sdk_gets_unit_vectors_in_float_and_base64(
    server: RunningServer, llama_backend: LlamaBackend
) -> None:
    def calls() -> tuple[Any, Any, Any]:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as sdk:
            model = sdk.models.list().data[0].id
            default = sdk.embeddings.create(model=model, input=TEXTS)  # the SDK asks for base64, decodes it
            floats = sdk.embeddings.create(model=model, input=TEXTS, encoding_format="float")
            raw = sdk.embeddings.create(model=model, input=TEXTS[0], encoding_format="base64")
        return default, floats, raw

    default, floats, raw = await trio.to_thread.run_sync(calls)
    size = llama_backend.embedding_size
    assert size is not None
    assert [item.index for item in floats.data] == list(range(len(TEXTS)))
    for a, b in zip(default.data, floats.data, strict=True):
        assert len(b.embedding) == size
        assert abs(math.fsum(x * x for x in b.embedding) - 1.0) < 1e-4  # normalised
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-6
    decoded = struct.unpack(f"<{size}f", base64.b64decode(raw.data[0].embedding))  # type: ignore[arg-type]
    assert max(abs(x - y) for x, y in zip(decoded, floats.data[0].embedding, strict=True)) < 1e-6
    tokens = [len(await llama_backend.tokenize_text(t, add_special=True)) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(tokens)
    # alone or in a batch: the same vector (up to the kernels' rounding)
    async with server.client() as client:
        alone = (await client.post("/v1/embeddings", json={"input": TEXTS[3]})).json()["data"][0]["embedding"]
    assert alone == floats.data[3].embedding  # one input per call: the same bits
    # and they mean something: paraphrases are nearer each other than unrelated texts
    vectors = [item.embedding for item in floats.data]
    assert _cosine(vectors[0], vectors[1]) > _cosine(vectors[0], vectors[2])


@pytest.fixture(scope="module")
def llama_server_embeddings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama.cpp's llama-server with ``--embeddings --pooling mean`` (the default model
    has no pooling of its own; trioserve's default for such a model is mean) and one
    slot: with its default four, it evaluates inputs side by side and their vectors
    move with what they were batched with (one of 20 by a cosine of 4.5e-4, measured);
    with one, each input is evaluated alone, as trioserve's vectors are computed. And
    flash attention off, as trioserve's embedding context runs (docs/embeddings.md:
    with it on, vectors move by up to 1e-3 of cosine on this model). trioserve pads each
    input to whole 16-row tiles (so a call of several is exact), which moves a vector
    by up to 1.2e-4 of cosine from llama-server's unpadded call (measured)."""
    port = free_port()
    model = default_model_path(progress=False)
    argv = llama_server_command(
        model, port, ["--embeddings", "--pooling", "mean", "--parallel", "1", "--flash-attn", "off"]
    )
    server = Server(LLAMA_SERVER, argv, port, tmp_path_factory.mktemp("llama-server-embeddings"))
    try:
        server.wait_ready(timeout=120)
        yield server.url
    finally:
        server.stop(grace=10)


async def test_the_vectors_equal_llama_servers(server: RunningServer, llama_server_embeddings: str) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        ours = (await client.post(server.url + "/v1/embeddings", json={"input": TEXTS})).json()
        theirs = (await client.post(llama_server_embeddings + "/v1/embeddings", json={"input": TEXTS})).json()
    assert len(ours["data"]) == len(theirs["data"]) == len(TEXTS)
    cosines = [
        _cosine(a["embedding"], b["embedding"]) for a, b in zip(ours["data"], theirs["data"], strict=True)
    ]
    print(f"\ncosine with llama-server's: min {min(cosines):.7f} over {len(cosines)} inputs")
    assert min(cosines) >= 0.9998, cosines
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]


async def test_a_vector_is_the_same_bits_alone_and_in_any_batch(
    server: RunningServer, llama_backend: LlamaBackend
) -> None:
    """Inputs of 1 to ~90 tokens, sent together, shuffled, and one by one: every vector
    the same bits (docs/embeddings.md, "Batched, and still exact"). On a CPU where the
    probe found a batched layout exact, the request made fewer calls than inputs; where
    it found none, one call each — the bits are the same either way."""
    words = ["river", "stone", "über", "東京", "light", ",", "market", "!", "22", "naïve"]
    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(1 + (i * 7) % 60)) for i in range(40)]
    order = [(i * 17) % len(texts) for i in range(len(texts))]  # (a permutation: 17 and 40 are coprime)
    async with server.client() as client:
        together = (await client.post("/v1/embeddings", json={"input": texts})).json()["data"]
        context = llama_backend.embedder.context
        assert context is not None
        calls = context.calls
        shuffled = (await client.post("/v1/embeddings", json={"input": [texts[i] for i in order]})).json()[
            "data"
        ]
        calls = context.calls - calls
        alone = [
            (await client.post("/v1/embeddings", json={"input": text})).json()["data"][0]["embedding"]
            for text in texts
        ]
    print(f"\n{len(texts)} inputs in {calls} call(s): width {context.width}, tile {context.tile}")
    assert [item["embedding"] for item in together] == alone
    assert [item["embedding"] for item in shuffled] == [alone[i] for i in order]
    if context.width > 1:
        assert calls < len(texts)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["ok", ""]}, 400, "input"),
        ({"input": "x", "dimensions": 3}, 400, "dimensions"),
        ({"input": [[1, 2, 10**9]]}, 400, "input"),
        ({"input": "word " * 600}, 400, "input"),  # longer than the batch size
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "model": "nope"}, 404, "model"),
    ],
)
async def test_bad_input_is_refused_by_name(
    server: RunningServer, body: dict[str, Any], status: int, param: str
) -> None:
    async with server.client() as client:
        response = await client.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["message"]


LONG_INPUTS = [f"Input number {i}: " + "the history of the city is long and varied. " * 5 for i in range(256)]


async def test_a_client_that_leaves_mid_batch_stops_the_evaluation(
    server: RunningServer, llama_backend: LlamaBackend
) -> None:
    """256 inputs (dozens of llama_decode calls): the client leaves once the first call
    is running; the call in flight is aborted inside llama.cpp, no further call is made,
    and the embedding lock is free again at once."""
    embedder = llama_backend.embedder
    calls, stopped_after = await leave_during_the_first_embedding_call(server.url, embedder, LONG_INPUTS)
    print(
        f"\nthe client left during the first call: {calls} call(s) made, "
        f"stopped {stopped_after * 1000:.0f} ms after"
    )
    assert calls <= 2  # the one in flight (and at most the next, started before the flag was read)
    assert stopped_after < 1.0
    health = await server.wait_idle()
    assert health["status"] == "ok"
    # the next request is answered, the same as before
    async with server.client() as http:
        again = (await http.post("/v1/embeddings", json={"input": TEXTS[:2]})).json()
    assert len(again["data"]) == 2


async def test_a_deadline_mid_batch_is_504_and_stops_the_evaluation(
    server: RunningServer, llama_backend: LlamaBackend
) -> None:
    embedder = llama_backend.embedder
    async with server.client() as client:
        started = trio.current_time()
        response = await client.post(
            "/v1/embeddings", json={"input": LONG_INPUTS}, headers={"X-Request-Timeout": "0.5"}
        )
        elapsed = trio.current_time() - started
    assert response.status_code == 504, response.text
    assert 0.5 <= elapsed < 2.0
    assert not embedder.busy


async def test_a_backend_without_embeddings_says_so(nursery: trio.Nursery) -> None:
    from trioserve import ScriptedBackend

    running = await start_server(nursery, ScriptedBackend([b"x"]), close_backend=True)
    async with running.client() as client:
        response = await client.post("/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 501, response.text
    assert response.json()["error"]["code"] == "no_embeddings"
    running.server.shutdown()


async def test_shutdown_mid_batch_is_503_and_stops_the_evaluation(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """Shutdown (grace 0) reaches an embeddings request as it reaches a generation: the
    call in flight is aborted, the client is told 503, the server stops."""
    running = await start_server(nursery, llama_backend, shutdown_grace=0.0)
    embedder = llama_backend.embedder
    before = embedder.context.calls if embedder.context is not None else 0
    client = await RawStream.post(running.url, "/v1/embeddings", {"input": LONG_INPUTS})
    try:
        await wait_for(lambda: embedder.context is not None and embedder.context.calls > before, limit=60)
        running.server.shutdown()
        with trio.fail_after(10):
            data = await client.read_to_eof()
            await running.server.stopped.wait()
    finally:
        await client.aclose()
    assert data.startswith(b"HTTP/1.1 503"), data[:200]
    assert not embedder.busy
    context = embedder.context
    assert context is not None
    assert context.calls - before <= 2


# ------------------------------------------------------------------ admission and limits


async def test_a_full_embeddings_queue_is_429_with_retry_after(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """One request evaluates, ``max_queue`` (here 1) wait; the next is refused at once
    with 429 and ``Retry-After``, and evaluates nothing."""
    running = await start_server(nursery, llama_backend, max_queue=1)
    embedder = llama_backend.embedder
    admission = running.server.state.embeddings_admission(running.engine)
    before = embedder.context.calls if embedder.context is not None else 0
    first = await RawStream.post(running.url, "/v1/embeddings", {"input": LONG_INPUTS})
    second = await RawStream.post(running.url, "/v1/embeddings", {"input": LONG_INPUTS})
    try:
        await wait_for(
            lambda: admission.snapshot().in_use == 1 and admission.snapshot().queued == 1, limit=60
        )
        async with running.client() as client:
            refused = await client.post("/v1/embeddings", json={"input": TEXTS})
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "overloaded"
        snapshot = admission.snapshot()
        assert (snapshot.in_use, snapshot.queued) == (1, 1)  # the refused one never took a place
        # the admitted one evaluates (its first decode call may come after the 429)
        await wait_for(lambda: embedder.context is not None and embedder.context.calls > before, limit=60)
    finally:
        await first.aclose()
        await second.aclose()
    await wait_for(lambda: admission.snapshot().in_use == 0 and admission.snapshot().queued == 0, limit=10)
    running.server.shutdown()


async def test_a_deadline_passed_in_the_embeddings_queue_is_504_before_any_byte(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    """A request queued behind a long one, whose ``X-Request-Timeout`` passes while it
    waits: 504, the whole response, and no evaluation of its inputs."""
    running = await start_server(nursery, llama_backend)
    embedder = llama_backend.embedder
    admission = running.server.state.embeddings_admission(running.engine)
    first = await RawStream.post(running.url, "/v1/embeddings", {"input": LONG_INPUTS})
    try:
        await wait_for(lambda: admission.snapshot().in_use == 1, limit=60)
        late = await RawStream.post(
            running.url, "/v1/embeddings", {"input": TEXTS}, headers={"X-Request-Timeout": "0.5"}
        )
        try:
            await wait_for(lambda: admission.snapshot().queued == 1)
            with trio.fail_after(10):
                data = await late.read_to_eof_or(b"}")
        finally:
            await late.aclose()
        assert admission.snapshot().in_use == 1  # the first one still runs: nothing of the late one did
    finally:
        await first.aclose()
    assert data.startswith(b"HTTP/1.1 504"), data[:200]
    assert b'"deadline_exceeded"' in data
    await wait_for(lambda: admission.snapshot().in_use == 0 and admission.snapshot().queued == 0)
    assert not embedder.busy
    running.server.shutdown()


async def test_more_embedding_tokens_than_the_cap_is_400_naming_both_before_any_evaluation(
    llama_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, llama_backend, http=HTTPSettings(max_embedding_tokens=50))
    embedder = llama_backend.embedder
    total = sum(len(llama_backend.tokenize(text, add_bos=True, parse_special=True)) for text in TEXTS)
    assert total > 50
    before = embedder.context.inputs if embedder.context is not None else 0
    async with running.client() as client:
        refused = await client.post("/v1/embeddings", json={"input": TEXTS})
        accepted = await client.post("/v1/embeddings", json={"input": TEXTS[:2]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "input"
    assert f"{total} tokens" in error["message"]
    assert "at most 50" in error["message"]
    assert accepted.status_code == 200, accepted.text
    assert embedder.context is not None
    assert embedder.context.inputs - before == 2  # the accepted request's two inputs only
    running.server.shutdown()


async def test_a_large_response_is_encoded_the_same(server: RunningServer) -> None:
    """Above ``_INLINE_ENCODE_FLOATS`` numbers the body is encoded in a worker thread:
    the same vectors come back as from small requests of the same inputs."""
    inputs = [TEXTS[i % len(TEXTS)] for i in range(120)]  # 120 × 640 floats: above the threshold
    async with server.client() as client:
        large = (await client.post("/v1/embeddings", json={"input": inputs})).json()
        small = (await client.post("/v1/embeddings", json={"input": TEXTS})).json()
    assert len(large["data"]) == 120
    for i, item in enumerate(large["data"]):
        assert item["index"] == i
        assert item["embedding"] == small["data"][i % len(TEXTS)]["embedding"]


# ------------------------------------------------------------------ CpuTurns (no model)


def _until(predicate: Any) -> None:
    """Wait (in a plain thread's world) until ``predicate()``: at most 10 s."""
    import time

    limit = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < limit, "timed out"
        time.sleep(0.001)


def test_cpu_turns_alternate_in_the_order_asked() -> None:
    """The holder that asks again while another waits goes behind it: a busy
    generation scheduler and an embedding call take turns."""
    import threading

    from trioserve._backends._retrieval import CpuTurns

    turns = CpuTurns()
    order: list[str] = []
    assert turns.acquire()  # the scheduler's call
    waiting = threading.Thread(target=lambda: (turns.acquire(), order.append("embedding"), turns.release()))
    waiting.start()
    _until(lambda: turns.waits == 1)  # the embedding call is waiting
    asked_again = threading.Thread(
        target=lambda: (turns.acquire(), order.append("scheduler"), turns.release())
    )
    asked_again.start()
    _until(lambda: turns.waits == 2)  # the scheduler's next call is waiting too
    turns.release()
    waiting.join(10)
    asked_again.join(10)
    assert order == ["embedding", "scheduler"]


def test_a_call_waiting_for_its_turn_leaves_when_aborted() -> None:
    import threading

    from trioserve._backends._retrieval import CpuTurns

    turns = CpuTurns()
    aborted = threading.Event()
    results: list[bool] = []
    assert turns.acquire()
    waiter = threading.Thread(target=lambda: results.append(turns.acquire(abort=aborted.is_set)))
    waiter.start()
    _until(lambda: turns.waits == 1)
    aborted.set()
    turns.wake()
    waiter.join(10)
    assert results == [False]
    turns.release()
    assert turns.acquire()  # the queue is empty again: no one holds the turn
    turns.release()
