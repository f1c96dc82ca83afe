"""Reranking (docs/rerank.md) beside llama.cpp's own llama-server, on the same files.

- A cross-encoder: the tiny random-weight BERT reranker of ``tests/_models.py`` (rank
  pooling, the classifier head): trioserve's scores equal llama-server ``--reranking``'s
  within 1e-4 in the same order, with the same tokens counted; the Jina, TEI and
  Cohere (SDK, v1 and v2) shapes.
- A yes/no reranker: the default Gemma 3 270M with ``rerank="yes-no"`` — n documents cost
  one prefix plus the documents (counted in llama.cpp calls and tokens), a score never
  depends on the other documents, and a client that leaves stops the batch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import HTTPSettings, LlamaBackend, LlamaSettings, default_model_path
from trioserve._backends._retrieval import DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE, YesNoTemplate
from trioserve.testing import ScriptedBackend

from .._helpers import RawStream, RunningServer, llama_server_command, start_server, wait_for
from .._models import tiny_reranker

pytestmark = pytest.mark.model

QUERIES = [
    "what is the capital of france",
    "Which animal jumps over the dog?",
    "python code for a circle's area",
]
DOCUMENTS = [
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "def area(radius): return 3.14159 * radius ** 2",
    "Rome is the capital city of Italy, on the river.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Cats and dogs are pets; birds and fish too!",
    "Zebras graze quietly (unknown words: xylophone, quixotic).",
    "London, England: a big old city with bridges and markets.",
]


@pytest.fixture(scope="module")
def reranker_file() -> Path:
    return tiny_reranker()


@pytest.fixture(scope="module")
def cross_backend(reranker_file: Path) -> Iterator[LlamaBackend]:
    backend = LlamaBackend.load(LlamaSettings(str(reranker_file), n_ctx=512, n_threads=2, slots=1))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def peer(reranker_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server ``--reranking`` on the same file, one slot: with its default four it
    evaluates pairs side by side and a pair's score moves with its neighbours (by up to
    1.3e-2 on this model, measured: docs/rerank.md); with one, each pair is evaluated
    alone, as trioserve evaluates every pair."""
    port = free_port()
    argv = llama_server_command(reranker_file, port, ["--reranking", "--parallel", "1"])
    server = Server(LLAMA_SERVER, argv, port, tmp_path_factory.mktemp("llama-server-rerank"))
    try:
        server.wait_ready(timeout=120)
        yield server.url
    finally:
        server.stop(grace=10)


@pytest.fixture
async def cross(cross_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, cross_backend, http=HTTPSettings())
    yield running
    running.server.shutdown()


@pytest.fixture(scope="module")
def yes_no_backend() -> Iterator[LlamaBackend]:
    settings = LlamaSettings(default_model_path(), n_ctx=2048, n_threads=2, slots=2, rerank="yes-no")
    backend = LlamaBackend.load(settings)
    yield backend
    backend.close()


@pytest.fixture
async def yes_no(yes_no_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, yes_no_backend, http=HTTPSettings())
    yield running
    running.server.shutdown()


async def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await client.post(path, json=body)


def assert_same_ranking(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], score: str) -> None:
    assert len(ours) == len(theirs)
    by_index = {item["index"]: item[score] for item in theirs}
    for item in ours:
        assert abs(item[score] - by_index[item["index"]]) <= 1e-4, (item, by_index)
    # the same order, but for neighbours within the tolerance (which either may swap)
    for a, b in zip(ours, theirs, strict=True):
        if a["index"] != b["index"]:
            assert abs(a[score] - b[score]) <= 2e-4, (ours, theirs)


async def test_cross_encoder_scores_equal_llama_servers_within_1e_4_in_the_same_order(
    cross: RunningServer, peer: str
) -> None:
    for query in QUERIES:
        body = {"query": query, "documents": DOCUMENTS}
        ours = await post(cross.url, "/v1/rerank", body)
        theirs = await post(peer, "/v1/rerank", body)
        assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
        mine, peers = ours.json(), theirs.json()
        assert_same_ranking(mine["results"], peers["results"], "relevance_score")
        assert mine["usage"] == peers["usage"]  # the same pairs, the same tokens
        assert mine["trioserve"]["reranker"] == "cross-encoder"
        assert mine["trioserve"]["score"] == "logit"
    # every alias, and TEI's shape (texts in, a list out)
    body = {"query": QUERIES[0], "texts": DOCUMENTS[:3], "return_text": True}
    ours_tei = (await post(cross.url, "/rerank", body)).json()
    peers_tei = (await post(peer, "/rerank", body)).json()
    assert [item.get("text") for item in ours_tei] == [item.get("text") for item in peers_tei]
    assert_same_ranking(ours_tei, peers_tei, "score")
    for path in ("/v1/reranking", "/reranking"):
        response = await post(cross.url, path, {"query": QUERIES[1], "documents": DOCUMENTS[:2], "top_n": 1})
        assert response.status_code == 200
        assert len(response.json()["results"]) == 1


async def test_a_cross_encoder_score_does_not_depend_on_the_other_documents(cross: RunningServer) -> None:
    together = (await post(cross.url, "/v1/rerank", {"query": QUERIES[0], "documents": DOCUMENTS})).json()
    scores = {item["index"]: item["relevance_score"] for item in together["results"]}
    for i in (0, 5):
        alone = (
            await post(cross.url, "/v1/rerank", {"query": QUERIES[0], "documents": [DOCUMENTS[i]]})
        ).json()
        assert alone["results"][0]["relevance_score"] == scores[i]  # bit for bit


async def test_the_cohere_sdk_reranks_through_v1_and_v2(cross: RunningServer, peer: str) -> None:
    import cohere

    def calls() -> tuple[Any, Any, Any]:
        with httpx.Client(timeout=60) as http:
            v1 = cohere.Client(api_key="x", base_url=cross.url, httpx_client=http)
            v2 = cohere.ClientV2(api_key="x", base_url=cross.url, httpx_client=http)
            model = cross.engine.backend.info.id
            first = v1.rerank(
                model=model, query=QUERIES[0], documents=DOCUMENTS, top_n=3, return_documents=True
            )
            second = v2.rerank(
                model=model, query=QUERIES[0], documents=DOCUMENTS, top_n=3, max_tokens_per_doc=4
            )
            uncut = v2.rerank(model=model, query=QUERIES[0], documents=DOCUMENTS, top_n=3)
            return first, second, uncut

    first, second, uncut = await trio.to_thread.run_sync(calls)
    peers = (await post(peer, "/v1/rerank", {"query": QUERIES[0], "documents": DOCUMENTS, "top_n": 3})).json()
    assert [r.index for r in first.results] == [r["index"] for r in peers["results"]]
    for result, peer_result in zip(first.results, peers["results"], strict=True):
        assert abs(result.relevance_score - peer_result["relevance_score"]) <= 1e-4
        assert result.document.text == DOCUMENTS[result.index]
    # max_tokens_per_doc cut the documents: other scores, three of them, best first
    assert len(second.results) == 3
    assert [r.relevance_score for r in second.results] == sorted(
        (r.relevance_score for r in second.results), reverse=True
    )
    assert second.meta.api_version.version == "2"
    assert second.meta.tokens.input_tokens < uncut.meta.tokens.input_tokens


async def test_a_cross_encoder_refuses_what_it_cannot_do(cross: RunningServer) -> None:
    long_document = " ".join(["the city river bridge market"] * 150)  # > 512 tokens with the query
    response = await post(cross.url, "/v1/rerank", {"query": "q", "documents": ["a", long_document]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("documents[1]", "document_too_long")
    assert "max_tokens_per_doc" in error["message"]
    cut = await post(
        cross.url, "/v1/rerank", {"query": "q", "documents": [long_document], "max_tokens_per_doc": 64}
    )
    assert cut.status_code == 200
    instruction = await post(cross.url, "/v1/rerank", {"query": "q", "documents": ["a"], "instruction": "x"})
    assert instruction.status_code == 400
    assert instruction.json()["error"]["param"] == "instruction"
    # an encoder does not generate: a 400 that says so, not garbage
    completion = await post(cross.url, "/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert completion.status_code == 400
    assert completion.json()["error"]["code"] == "generation_not_supported"
    models = (await post_get(cross.url, "/v1/models"))["data"][0]["capabilities"]
    assert models["rerank"] == "cross-encoder"
    assert models["completion"] is False


async def post_get(url: str, path: str) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return (await client.get(path)).json()


async def test_a_model_that_cannot_rerank_says_how_to_make_one(nursery: trio.Nursery) -> None:
    running = await start_server(nursery, ScriptedBackend([b"ok"]), close_backend=True, api_keys=["k"])
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking", "/v2/rerank"):
                body = {"query": "q", "documents": ["a"]}
                assert (await client.post(path, json=body)).status_code == 401, path  # keys required
                response = await client.post(path, json=body, headers={"Authorization": "Bearer k"})
                assert response.status_code == 400, path
                assert response.json()["error"]["code"] == "rerank_not_supported"
    finally:
        running.server.shutdown()


def expected_tokens(backend: LlamaBackend, query: str, documents: list[str]) -> tuple[int, list[int]]:
    """The yes/no layout counted independently: (prefix tokens, each document's) — the
    template's text with its special tokens read, the user's as plain text, BOS first."""
    model = backend.llama_model
    template = YesNoTemplate.parse(DEFAULT_TEMPLATE)
    prefix = 1  # BOS (Gemma adds it)
    for text, is_template in template.prefix_segments(query, DEFAULT_INSTRUCTION):
        prefix += len(model.tokenize(text, add_bos=False, parse_special=is_template))
    tail = model.tokenize(template.tail, add_bos=False, parse_special=True)
    return prefix, [len(model.tokenize(d, add_bos=False, parse_special=False)) + len(tail) for d in documents]


async def test_n_documents_cost_one_prefix_plus_the_documents(
    yes_no: RunningServer, yes_no_backend: LlamaBackend
) -> None:
    query = "What is the capital of France?"
    reranker = yes_no_backend.reranker
    body = {"query": query, "documents": DOCUMENTS}
    first = (await post(yes_no.url, "/v1/rerank", body)).json()  # (makes the context)
    context = reranker.context
    assert context is not None
    prefix, documents = expected_tokens(yes_no_backend, query, DOCUMENTS)
    # another query: its prefix evaluated once, then each document after it
    other = "Where does the fox jump?"
    before = (context.evaluated, context.calls, context.prefix_evaluations)
    answer = (await post(yes_no.url, "/v1/rerank", {"query": other, "documents": DOCUMENTS})).json()
    other_prefix, _ = expected_tokens(yes_no_backend, other, DOCUMENTS)
    evaluated = context.evaluated - before[0]
    assert evaluated == other_prefix + sum(documents) == answer["usage"]["prompt_tokens"]
    assert context.calls - before[1] == 1 + len(DOCUMENTS)
    assert context.prefix_evaluations - before[2] == 1
    assert answer["trioserve"] == {
        "request_id": answer["id"],
        "reranker": "yes-no",
        "score": "probability",
        "prefix_tokens": other_prefix,
    }
    assert all(0.0 < item["relevance_score"] < 1.0 for item in answer["results"])
    # the same query again: its prefix is still in sequence 0, only the documents run
    again = (await post(yes_no.url, "/v1/rerank", {"query": other, "documents": DOCUMENTS[:2]})).json()
    assert again["trioserve"]["prefix_tokens"] == 0
    assert again["usage"]["prompt_tokens"] == sum(documents[:2])
    # and a score never depends on the other documents, nor on the prefix being kept
    scores = {item["index"]: item["relevance_score"] for item in answer["results"]}
    kept = {item["index"]: item["relevance_score"] for item in again["results"]}
    assert kept == {0: scores[0], 1: scores[1]}
    assert first["usage"]["prompt_tokens"] == prefix + sum(documents)


async def test_a_client_that_leaves_mid_rerank_stops_the_batch(
    yes_no: RunningServer, yes_no_backend: LlamaBackend
) -> None:
    reranker = yes_no_backend.reranker
    await post(yes_no.url, "/v1/rerank", {"query": "warm", "documents": ["up"]})  # (the context exists)
    context = reranker.context
    assert context is not None
    documents = [f"{DOCUMENTS[i % len(DOCUMENTS)]} ({i})" for i in range(200)]
    before = context.calls
    client = await RawStream.post(yes_no.url, "/v1/rerank", {"query": "Which city?", "documents": documents})
    # the prefix evaluated and a document's call running
    await wait_for(lambda: context.calls >= before + 2, limit=60)
    await client.aclose()
    at_close = context.calls
    left = trio.current_time()
    await wait_for(lambda: not reranker.busy, limit=5)
    stopped_after = trio.current_time() - left
    made = context.calls - before
    print(
        f"\nthe client left mid-rerank: {made} of 201 calls made, stopped {stopped_after * 1000:.0f} ms after"
    )
    assert context.calls <= at_close + 1  # the one in flight (at most the next, started as the flag rose)
    assert made < 201
    assert stopped_after < 1.0
    health = await yes_no.wait_idle()
    assert health["status"] == "ok"
    # the next request is answered; its prefix evaluated anew (the aborted state is gone)
    after = (
        await post(yes_no.url, "/v1/rerank", {"query": "Which city?", "documents": DOCUMENTS[:1]})
    ).json()
    assert after["trioserve"]["prefix_tokens"] > 0


async def test_a_deadline_mid_rerank_is_504_and_stops_the_batch(
    yes_no: RunningServer, yes_no_backend: LlamaBackend
) -> None:
    reranker = yes_no_backend.reranker
    documents = [f"{DOCUMENTS[i % len(DOCUMENTS)]} [{i}]" for i in range(300)]
    context = reranker.context
    before = context.calls if context is not None else 0
    async with yes_no.client() as client:
        response = await client.post(
            "/v1/rerank",
            json={"query": "Which river?", "documents": documents},
            headers={"X-Request-Timeout": "0.5"},
        )
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    await wait_for(lambda: not reranker.busy, limit=5)
    assert reranker.context is not None
    assert reranker.context.calls - before < 150  # stopped, not all 301 calls made
