"""Fill in the middle and rerank through the upstream relay, against an
``httpx.MockTransport`` (no model, no socket): what goes to llama-server's ``/infill``
and ``/v1/rerank``, how their answers are read (``/infill``'s stream ends with its
``"stop": true`` object, no ``[DONE]``), how an upstream without either is mapped, and
what the backend learns of its upstreams from their answers.

The bodies of llama-server's answers are the ones it sent (llama.cpp as
``scripts/build-llama-server`` builds it), trimmed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import pytest
import trio

from trioserve._backends._upstream import UpstreamBackend, UpstreamState
from trioserve._backends._upstream._client import Sink, UpstreamClient
from trioserve._backends._upstream._errors import Retry, UpstreamUnavailable
from trioserve._core._backend import GenerationProgress, ModelInfo
from trioserve._core._exceptions import BackendError, InvalidRequestError
from trioserve._core._types import GenerationRequest, Infill, SamplingParams

URL = "http://upstream"
Handler = Callable[[httpx.Request], Coroutine[Any, Any, httpx.Response]]

#: llama-server's 501 for a model without FIM tokens, and without --reranking
NO_FIM = (
    b'{"error":{"code":501,"message":"Infill is not supported by this model: prefix token is missing. '
    b'suffix token is missing. middle token is missing. ","type":"not_supported_error"}}'
)
NO_RERANK = (
    b'{"error":{"code":501,"message":"This server does not support reranking. Start it with '
    b'`--reranking`","type":"not_supported_error"}}'
)


class Collected:
    """What a :class:`Sink` hands on (stands in for the engine's channel)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    async def send(self, piece: bytes) -> None:
        self.pieces.append(piece)


def _client(handler: Handler) -> UpstreamClient:
    return UpstreamClient(
        connections=1,
        connect_timeout=1.0,
        read_timeout=1.0,
        receive_buffer_bytes=None,
        api_key=None,
        transport=httpx.MockTransport(handler),
    )


def _delta(text: str, predicted: int) -> dict[str, object]:
    return {
        "index": 0,
        "content": text,
        "tokens": [1],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": predicted,
    }


def _final(stop_type: str, predicted: int, evaluated: int) -> dict[str, object]:
    return {
        "index": 0,
        "content": "",
        "tokens": [],
        "id_slot": 0,
        "stop": True,
        "tokens_predicted": predicted,
        "tokens_evaluated": evaluated,
        "stop_type": stop_type,
        "timings": {"cache_n": 0, "prompt_n": evaluated, "predicted_n": predicted},
    }


def _sse(*events: object) -> bytes:
    """llama-server's stream: ``data:`` events, and no ``[DONE]``."""
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events).encode()


async def _streamed(body: bytes) -> AsyncIterator[bytes]:
    yield body


def _answer(status: int, body: bytes, seen: list[httpx.Request] | None = None) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status, content=_streamed(body))

    return handler


async def _infill(handler: Handler) -> tuple[str, Collected, GenerationProgress]:
    collected = Collected()
    progress = GenerationProgress(prompt_tokens=0)
    client = _client(handler)
    try:
        sink = Sink(collected, progress)  # type: ignore[arg-type]
        end = await client.infill(UpstreamState(url=URL), {"input_prefix": "a"}, sink, lambda: None)
    finally:
        await client.aclose()
    return end, collected, progress


# ------------------------------------------------------------------- the client


async def test_infill_relays_the_content_and_its_final_object_ends_the_stream(autojump_clock: Any) -> None:
    """The final object (``"stop": true``) ends the read even while the upstream keeps
    the connection open: no ``[DONE]`` is awaited; the counts are the final object's."""
    seen: list[httpx.Request] = []
    closed: list[bool] = []

    async def stays_open() -> AsyncIterator[bytes]:
        try:
            progress = {"index": 0, "content": "", "stop": False, "prompt_progress": {"total": 27}}
            yield _sse(progress, _delta("\n", 1), _delta("    print", 2), _final("limit", 2, 27))
            await trio.sleep_forever()
            yield b""  # pragma: no cover
        finally:
            closed.append(True)

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=stays_open())

    with trio.fail_after(10):
        end, collected, progress = await _infill(handler)
    assert end == "length"
    assert collected.pieces == [b"\n", b"    print"]
    assert (progress.prompt_tokens, progress.completion_tokens) == (27, 2)
    assert seen[0].url.path == "/infill"
    assert seen[0].headers["accept"] == "text/event-stream"
    assert closed == [True]


@pytest.mark.parametrize(("stop_type", "end"), [("eos", "stop"), ("word", "stop"), ("limit", "length")])
async def test_infill_stop_types(stop_type: str, end: str) -> None:
    got, _, _ = await _infill(_answer(200, _sse(_delta("x", 1), _final(stop_type, 1, 5))))
    assert got == end


async def test_an_infill_stream_cut_before_its_final_object_is_unavailable() -> None:
    with pytest.raises(UpstreamUnavailable, match="without a finish reason"):
        await _infill(_answer(200, _sse(_delta("x", 1))))


async def test_an_infill_error_event_is_retried_elsewhere() -> None:
    with pytest.raises(Retry, match="failed: boom"):
        await _infill(_answer(200, _sse({"error": {"code": 500, "message": "boom"}})))


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (501, NO_FIM, "answered 501: Infill is not supported by this model: prefix token is missing"),
        (404, b'{"detail":"Not Found"}', "answered 404: Not Found"),  # vLLM: no such route
        (
            400,
            b'{"error":{"message":"infill is not supported by this model"}}',
            "answered 400: infill is not",
        ),
    ],
)
async def test_an_upstream_without_infill_is_infill_not_supported(
    status: int, body: bytes, message: str
) -> None:
    with pytest.raises(Retry, match=message) as caught:
        await _infill(_answer(status, body))
    error = caught.value.error
    assert type(error) is InvalidRequestError
    assert (error.code, error.param, error.status) == ("infill_not_supported", "input_prefix", 400)
    assert "is not supported by upstream http://upstream" in error.message


async def test_the_upstreams_other_refusals_stay_the_clients() -> None:
    with pytest.raises(InvalidRequestError, match="top_k is wrong") as caught:
        await _infill(_answer(400, b'{"error":{"message":"top_k is wrong","param":"top_k"}}'))
    assert caught.value.code is None
    with pytest.raises(UpstreamUnavailable, match="answered 503"):
        await _infill(_answer(503, b'{"error":{"message":"Loading model"}}'))


async def test_a_cancel_mid_infill_closes_the_upstream_response(autojump_clock: Any) -> None:
    """The promise of the completion stream: text sent before more is read, and a
    cancel closes the upstream response before ``Cancelled`` propagates; the time
    left goes upstream as ``X-Request-Timeout``."""
    closed: list[bool] = []
    seen: list[httpx.Request] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            yield _sse(_delta("a", 1))
            await trio.sleep_forever()
            yield b""  # pragma: no cover
        finally:
            closed.append(True)

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=endless())

    collected = Collected()
    client = _client(handler)
    sink = Sink(collected, GenerationProgress(prompt_tokens=0))  # type: ignore[arg-type]
    with trio.move_on_after(0.5) as scope:
        await client.infill(UpstreamState(url=URL), {}, sink, lambda: None)
    assert scope.cancelled_caught
    assert closed == [True]  # (before the client is closed)
    await client.aclose()
    assert collected.pieces == [b"a"]
    assert sink.sent
    assert 0.0 < float(seen[0].headers["x-request-timeout"]) <= 0.5


async def test_a_rerank_is_read_whole_in_the_documents_order() -> None:
    seen: list[httpx.Request] = []
    answer = {
        "model": "m",
        "object": "list",
        "usage": {"prompt_tokens": 19, "total_tokens": 19},
        "results": [
            {"index": 0, "relevance_score": 5.539217948913574},
            {"index": 2, "relevance_score": 4.366196632385254},
            {"index": 1, "relevance_score": 2.779794454574585},
        ],
    }
    client = _client(_answer(200, json.dumps(answer).encode(), seen))
    body = {"query": "q", "documents": ["a", "b", "c"], "top_n": 3}
    _, scores, tokens = await client.rerank(UpstreamState(url=URL), body, lambda: None)
    await client.aclose()
    assert scores == [5.539217948913574, 2.779794454574585, 4.366196632385254]
    assert tokens == 19
    assert seen[0].url.path == "/v1/rerank"
    assert json.loads(seen[0].content) == body


async def test_a_rerank_answer_without_every_score_is_retried() -> None:
    client = _client(_answer(200, b'{"results":[{"index":0,"relevance_score":1.0}]}'))
    with pytest.raises(Retry, match=r"one score per document \(2\)"):
        await client.rerank(UpstreamState(url=URL), {"documents": ["a", "b"]}, lambda: None)
    await client.aclose()


async def test_an_upstream_without_rerank_is_rerank_not_supported() -> None:
    client = _client(_answer(501, NO_RERANK))
    with pytest.raises(Retry, match="Start it with `--reranking`") as caught:
        await client.rerank(UpstreamState(url=URL), {"documents": ["a"]}, lambda: None)
    await client.aclose()
    assert caught.value.error.code == "rerank_not_supported"
    assert caught.value.error.status == 400


# ------------------------------------------------------------------ the backend

URLS = ["http://a", "http://b"]


def _backend(handler: Handler) -> UpstreamBackend:
    backend = UpstreamBackend(URLS, info=ModelInfo(id="m", context_length=100, infill=None))
    backend._relay.client = _client(handler)
    return backend


async def _generate(backend: UpstreamBackend, request: GenerationRequest) -> tuple[str, Collected]:
    prepared = await backend.prepare(request)
    collected = Collected()
    end = await backend.generate(prepared, collected, GenerationProgress(0))  # type: ignore[arg-type]
    return end, collected


INFILL = GenerationRequest(
    prompt="",
    max_tokens=8,
    sampling=SamplingParams(temperature=0.0, samplers=("top_k", "temperature")),
    infill=Infill(prefix="def f():\n    ", suffix="\n"),
)


async def test_samplers_are_forwarded_with_infill_and_refused_without() -> None:
    backend = _backend(_answer(200, b""))
    try:
        await backend.prepare(INFILL)  # (an empty middle start, samplers: both fine)
        with pytest.raises(InvalidRequestError, match=r"samplers .* not supported outside /infill") as caught:
            await backend.prepare(
                GenerationRequest(prompt="hi", sampling=SamplingParams(samplers=("top_k",)))
            )
        assert caught.value.param == "samplers"
    finally:
        await backend.aclose()


async def test_infill_goes_to_the_upstream_that_has_it_and_the_model_says_so_once_learnt() -> None:
    """One upstream without FIM tokens (501), one with: the request is served by the
    second (nothing had reached the client), and ``info.infill`` goes from unknown to
    known."""
    bodies: dict[str, Any] = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        bodies[request.url.host] = json.loads(request.content)
        if request.url.host == "a":
            return httpx.Response(501, content=_streamed(NO_FIM))
        return httpx.Response(200, content=_streamed(_sse(_delta("pass", 1), _final("eos", 1, 9))))

    backend = _backend(handler)
    try:
        assert backend.info.infill is None
        for _ in URLS:  # (ties go in turn: each upstream is tried first once)
            end, collected = await _generate(backend, INFILL)
            assert (end, collected.pieces) == ("stop", [b"pass"])
        assert backend.info.infill is True
        assert [u.capabilities for u in backend.upstreams] == [{"infill": False}, {"infill": True}]
        sent = bodies["b"]
        assert sent["model"] == "m"
        assert (sent["input_prefix"], sent["input_suffix"], sent["prompt"]) == ("def f():\n    ", "\n", "")
        assert (sent["samplers"], sent["n_predict"], sent["stream"]) == (["top_k", "temperature"], 8, True)
    finally:
        await backend.aclose()


async def test_infill_nowhere_is_the_clients_400_naming_each_upstreams_answer() -> None:
    backend = _backend(_answer(501, NO_FIM))
    try:
        with pytest.raises(InvalidRequestError) as caught:
            await _generate(backend, INFILL)
        error = caught.value
        assert (error.status, error.code, error.param) == (400, "infill_not_supported", "input_prefix")
        for url in URLS:
            assert (
                f"not supported by upstream {url}: it answered 501: Infill is not supported" in error.message
            )
        assert backend.info.infill is False
        assert all(u.failures == 0 for u in backend.upstreams)  # up, only unable
    finally:
        await backend.aclose()


RANKED = {
    "results": [{"index": 1, "relevance_score": 0.25}, {"index": 0, "relevance_score": 2.5}],
    "usage": {"prompt_tokens": 11},
}


async def test_rerank_forwards_and_says_what_it_cannot_know() -> None:
    seen: list[httpx.Request] = []
    backend = _backend(_answer(200, json.dumps(RANKED).encode(), seen))
    try:
        assert backend.info.rerank is None
        ranking = await backend.rerank("q", ["d0", "d1"], max_tokens=10)
        assert (ranking.scores, ranking.prompt_tokens) == ([2.5, 0.25], 11)
        # a llama-server cross-encoder sends a logit, vLLM a probability; neither says
        assert (ranking.kind, ranking.score) == ("upstream", "unknown")
        assert backend.info.rerank == "upstream"
        assert json.loads(seen[0].content) == {
            "model": "m",
            "query": "q",
            "documents": ["d0", "d1"],
            "top_n": 2,
        }
        with pytest.raises(InvalidRequestError, match="instruction is not supported") as caught:
            await backend.rerank("q", ["d"], instruction="be brief")
        assert caught.value.param == "instruction"
        with pytest.raises(InvalidRequestError, match="max_tokens_per_doc is not supported") as caught:
            await backend.rerank("q", ["d"], max_tokens_per_doc=5)
        assert caught.value.param == "max_tokens_per_doc"
        assert len(seen) == 1  # (refused before any upstream is asked)
    finally:
        await backend.aclose()


async def test_an_upstream_trioserve_says_what_its_scores_are() -> None:
    said = {**RANKED, "trioserve": {"reranker": "yes-no", "score": "probability", "prefix_tokens": 4}}
    backend = _backend(_answer(200, json.dumps(said).encode()))
    try:
        ranking = await backend.rerank("q", ["d0", "d1"])
        assert (ranking.kind, ranking.score) == ("yes-no", "probability")
    finally:
        await backend.aclose()


async def test_rerank_nowhere_is_the_clients_400_and_a_bad_answer_a_500() -> None:
    backend = _backend(_answer(501, NO_RERANK))
    try:
        with pytest.raises(InvalidRequestError) as caught:
            await backend.rerank("q", ["d"])
        assert (caught.value.status, caught.value.code) == (400, "rerank_not_supported")
        assert caught.value.message.count("--reranking") == 2  # each upstream's answer
        assert backend.info.rerank is None
    finally:
        await backend.aclose()
    backend = _backend(_answer(200, b'{"results": []}'))
    try:
        with pytest.raises(BackendError, match="one score per document"):
            await backend.rerank("q", ["d"])
    finally:
        await backend.aclose()
