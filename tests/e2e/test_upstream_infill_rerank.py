"""Fill in the middle and reranking through the upstream relay, in front of llama.cpp's
own llama-server (docs/deployment.md, "What the relay forwards"):

* ``/infill`` (and ``suffix`` on ``/v1/completions``) through ``--upstream`` gives the
  text, the end and the token counts llama-server gives directly, streamed or not
  (greedy: no verdict depends on a sampled token);
* ``/v1/rerank`` through the relay gives llama-server ``--reranking``'s scores, bit for
  bit, in its order;
* a client that leaves mid-infill closes the upstream request: llama-server's slot
  stops well before its token limit (observed on ``GET /slots``);
* an upstream that cannot do either: a 400 ``infill_not_supported`` /
  ``rerank_not_supported`` naming its answer; ``GET /v1/models`` says what was learnt.

The models: the FIM copy of the default Gemma 3 270M (tests/_models.py) and the tiny
cross-encoder.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import UpstreamBackend

from .._helpers import RawStream, RunningServer, llama_server_command, start_server
from .._models import fim_model, tiny_reranker

pytestmark = pytest.mark.model

CODE_BEFORE = (
    "import math\n\n\n"
    'def area(radius):\n    """The area of a circle."""\n    return math.pi * radius ** 2\n\n\n'
    "def circumference(radius):\n"
)
CODE_AFTER = "\n\n\ndef diameter(radius):\n    return 2 * radius\n"
EXTRA = [
    {"filename": "sphere.py", "text": "def volume(radius):\n    return 4 / 3 * math.pi * radius ** 3\n"},
    {"filename": "main.py", "text": "RADIUS = 2.5\nprint(area(RADIUS))\n"},
]
#: greedy (temperature 0): the same tokens on both sides whatever the seed
INFILL = {
    "input_prefix": CODE_BEFORE,
    "input_suffix": CODE_AFTER,
    "input_extra": EXTRA,
    "prompt": "    ",
    "n_predict": 24,
    "temperature": 0.0,
    "n_indent": 4,
    # each answer evaluated whole: llama-server's prompt cache may change a text
    # ("logits are not guaranteed to be bit-for-bit identical"), and the relayed request
    # repeats the direct one (measured: a different text on this CPU, 0 tokens evaluated)
    "cache_prompt": False,
}
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "the river runs through the old city",
    "def area(radius): return 3.14159 * radius ** 2",
    "london is a large city in england",
    "coffee and tea",
]


def _peer(model: Path, extra: list[str], factory: pytest.TempPathFactory, name: str) -> Iterator[str]:
    port = free_port()
    argv = llama_server_command(model, port, ["--ctx-size", "4096", "--parallel", "1", *extra])
    server = Server(LLAMA_SERVER, argv, port, factory.mktemp(name))
    try:
        server.wait_ready(timeout=120)
        yield server.url
    finally:
        server.stop(grace=10)


@pytest.fixture(scope="module")
def fim_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server on the FIM model, one slot."""
    yield from _peer(fim_model("repo"), [], tmp_path_factory, "llama-server-fim")


@pytest.fixture(scope="module")
def rerank_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server ``--reranking`` on the tiny cross-encoder, one slot."""
    yield from _peer(tiny_reranker(), ["--reranking"], tmp_path_factory, "llama-server-rerank")


Relay = Callable[[str], Awaitable[RunningServer]]


@pytest.fixture
async def relay(nursery: trio.Nursery) -> AsyncIterator[Relay]:
    """trioserve ``--upstream URL``, in process; stopped (and its client closed) at the end."""
    started: list[RunningServer] = []

    async def start(url: str) -> RunningServer:
        running = await start_server(nursery, await UpstreamBackend.aload([url]), close_backend=True)
        started.append(running)
        return running

    yield start
    for running in started:
        running.server.shutdown()
        with trio.fail_after(15):
            await running.server.stopped.wait()


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


async def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return await trio.to_thread.run_sync(_post, url, path, body)


def _stream_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed ``/infill``: its events' data, in order (no ``[DONE]`` is expected)."""
    with httpx.stream("POST", url + "/infill", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        data = response.read().decode()
    events = [block.removeprefix("data: ") for block in data.split("\n\n") if block.startswith("data: ")]
    assert "[DONE]" not in events
    return [json.loads(event) for event in events]


def _usage(answer: dict[str, Any]) -> tuple[str, str, int]:
    """What a relayed answer must share with llama-server's own. Not
    ``tokens_evaluated``: llama-server counts the prompt tokens it evaluated, and the
    relayed request repeats the direct one, so it may find the prompt in its cache
    (measured: 0 of 108 on this CPU; :func:`_evaluated` checks the relay's count)."""
    return answer["content"], answer["stop_type"], answer["tokens_predicted"]


def _evaluated(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert isinstance(mine["tokens_evaluated"], int)
    assert 0 <= mine["tokens_evaluated"] <= theirs["tokens_evaluated"]


async def test_infill_through_the_relay_is_llama_servers_own(fim_peer: str, relay: Relay) -> None:
    front = await relay(fim_peer)
    # an editor's request with samplers (forwarded: the upstream builds the chain)
    for body in (INFILL, {**INFILL, "samplers": ["top_k", "temperature"], "top_k": 1}):
        direct = await post(fim_peer, "/infill", body)
        assert direct.status_code == 200, direct.text
        relayed = await post(front.url, "/infill", body)
        assert relayed.status_code == 200, relayed.text
        theirs, mine = direct.json(), relayed.json()
        assert theirs["content"]
        assert _usage(mine) == _usage(theirs)
        _evaluated(mine, theirs)
        assert mine["timings"]["predicted_n"] == theirs["timings"]["predicted_n"]

        # streamed: the same text in deltas, the same final object's counts (its
        # content: llama-server's is empty, trioserve's repeats the whole text)
        theirs_events = await trio.to_thread.run_sync(_stream_events, fim_peer, body)
        mine_events = await trio.to_thread.run_sync(_stream_events, front.url, body)
        assert mine_events[-1]["stop"] is True
        assert all(event["stop"] is False for event in mine_events[:-1])
        deltas = "".join(e["content"] for e in mine_events[:-1])
        # (the texts of repeated requests are llama-server's to vary: its own stream and
        # its whole answer to one body differed on this CPU; the counts do not)
        assert deltas
        assert "".join(e["content"] for e in theirs_events[:-1])
        assert mine_events[-1]["content"] == deltas
        assert (
            _usage({**mine_events[-1], "content": ""})[1:] == _usage({**theirs_events[-1], "content": ""})[1:]
        )
        _evaluated(mine_events[-1], theirs_events[-1])

    # what the relay learnt: this upstream fills in the middle
    async with front.client() as client:
        capabilities = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
    assert capabilities["infill"] is True
    assert capabilities["rerank"] is None
    health = await front.wait_idle()
    assert health["generations_running"] == 0


async def test_suffix_through_the_relay_is_llama_servers_infill(fim_peer: str, relay: Relay) -> None:
    """``suffix`` on ``/v1/completions`` is forwarded as llama-server's ``/infill`` of
    the same prefix and suffix: its text and counts."""
    front = await relay(fim_peer)
    theirs = (
        await post(
            fim_peer,
            "/infill",
            {"input_prefix": CODE_BEFORE, "input_suffix": CODE_AFTER, "n_predict": 16, "temperature": 0.0},
        )
    ).json()
    completion = await post(
        front.url,
        "/v1/completions",
        {"prompt": CODE_BEFORE, "suffix": CODE_AFTER, "max_tokens": 16, "temperature": 0},
    )
    assert completion.status_code == 200, completion.text
    answer = completion.json()
    assert answer["choices"][0]["text"] == theirs["content"]
    assert answer["choices"][0]["finish_reason"] == ("length" if theirs["stop_type"] == "limit" else "stop")
    assert answer["usage"]["prompt_tokens"] == theirs["tokens_evaluated"]
    assert answer["usage"]["completion_tokens"] == theirs["tokens_predicted"]


async def _slot(client: httpx.AsyncClient) -> dict[str, Any]:
    """llama-server's only slot (``GET /slots``)."""
    slots = (await client.get("/slots")).json()
    assert isinstance(slots, list), slots
    assert len(slots) == 1, slots
    slot: dict[str, Any] = slots[0]
    return slot


async def _wait_slot(client: httpx.AsyncClient, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll llama-server's slot until ``done(slot)`` (tests observe from outside)."""
    with trio.fail_after(60):
        while True:
            slot = await _slot(client)
            if done(slot):
                return slot
            await trio.sleep(0.01)


async def test_a_client_that_leaves_mid_infill_closes_the_upstream_request(
    fim_peer: str, relay: Relay
) -> None:
    front = await relay(fim_peer)
    limit = 2000
    # greedy, no line rule, no stop: this model repeats its lines until the limit
    body = {
        "input_prefix": "def area(radius):\n    ",
        "input_suffix": "\n\ndef f():\n    pass\n",
        "n_predict": limit,
        "temperature": 0.0,
        "stream": True,
        "cache_prompt": False,
    }
    async with httpx.AsyncClient(base_url=fim_peer, timeout=60) as direct:
        client = await RawStream.post(front.url, "/infill", body)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.read_to_eof)  # a client that keeps reading
                # the upstream, observed: its slot is generating this request
                busy = await _wait_slot(
                    direct, lambda s: s["is_processing"] and s["next_token"][0]["n_decoded"] >= 16
                )
                nursery.cancel_scope.cancel()
        finally:
            await client.aclose()
        assert b'"stop":true' not in client.received  # it had not ended on its own
        # the upstream connection closed: the slot stops, far short of its limit (the
        # last count seen while it still generated: an idle slot reports 0)
        seen = [busy["next_token"][0]["n_decoded"]]

        def stopped(slot: dict[str, Any]) -> bool:
            if slot["is_processing"]:
                seen.append(slot["next_token"][0]["n_decoded"])
            return not slot["is_processing"]

        await _wait_slot(direct, stopped)
    print(f"\nllama-server stopped by {seen[-1]} tokens ({seen[0]} when the client left)")
    assert seen[-1] < limit / 4, f"llama-server went on to {seen[-1]} of {limit} tokens after the client left"
    health = await front.wait_idle()
    assert health["generations_running"] == 0


async def test_rerank_through_the_relay_is_llama_servers_own(rerank_peer: str, relay: Relay) -> None:
    front = await relay(rerank_peer)
    body = {"query": QUERY, "documents": DOCUMENTS}
    direct = await post(rerank_peer, "/v1/rerank", body)
    assert direct.status_code == 200, direct.text
    relayed = await post(front.url, "/v1/rerank", body)
    assert relayed.status_code == 200, relayed.text
    theirs, mine = direct.json(), relayed.json()
    # the same scores, bit for bit (a float's JSON round trip is exact), the same order
    assert [(r["index"], r["relevance_score"]) for r in mine["results"]] == [
        (r["index"], r["relevance_score"]) for r in theirs["results"]
    ]
    assert len(mine["results"]) == len(DOCUMENTS)
    assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"] > 0
    # what it can say about them: an upstream's scores, of a kind it was not told
    assert (mine["trioserve"]["reranker"], mine["trioserve"]["score"]) == ("upstream", "unknown")

    # top_n and the other shapes are the relay's own
    top = (await post(front.url, "/v1/rerank", {**body, "top_n": 2, "return_documents": True})).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in theirs["results"][:2]]
    assert top["results"][0]["document"] == {"text": DOCUMENTS[theirs["results"][0]["index"]]}

    # what llama-server would ignore is refused by name
    refused = await post(front.url, "/v1/rerank", {**body, "instruction": "rank by relevance"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "instruction"

    async with front.client() as client:
        capabilities = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
    assert capabilities["rerank"] == "upstream"


async def test_an_upstream_that_cannot_is_a_400_naming_its_answer(
    fim_peer: str, rerank_peer: str, relay: Relay
) -> None:
    """The cross-encoder's llama-server has no FIM tokens; the FIM model's serves no
    rerank (no ``--reranking``): each refusal reaches the client as a 400 with the
    upstream's own words, streamed too."""
    no_fim = await relay(rerank_peer)
    answer = await post(no_fim.url, "/infill", INFILL)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "infill_not_supported"
    assert f"not supported by upstream {rerank_peer}" in error["message"]
    direct = await post(rerank_peer, "/infill", INFILL)
    assert direct.json()["error"]["message"] in error["message"]  # its own words
    # streamed: the stream's error event says the same
    async with no_fim.client() as client:
        streamed = await client.post("/infill", json={**INFILL, "stream": True})
        capabilities = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
    assert b'"code":"infill_not_supported"' in streamed.content, streamed.content
    assert capabilities["infill"] is False

    no_rerank = await relay(fim_peer)
    answer = await post(no_rerank.url, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "rerank_not_supported"
    assert "--reranking" in error["message"]
