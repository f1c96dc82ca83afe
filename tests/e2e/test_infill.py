"""Code completion beside llama.cpp's own llama-server, on the same files: ``/infill``
as llama.vim and llama.vscode send it gives the same prompt (the same tokens, counted
and rendered) and the same greedy text; ``suffix`` on ``/v1/completions`` gives the
same prompt as ``/infill``; the editors' warm-up is cached; a client that leaves
mid-completion stops it.

The models: copies of the default Gemma 3 270M whose GGUF metadata names three (and
for the repo-level layout five) of its unused special tokens as FIM tokens
(``gguf``'s ``gguf_new_metadata``), made once and cached: real models with real FIM
plumbing (the default model has none: ``llama_vocab_fim_pre`` is -1).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import GenerationRequest, HTTPSettings, LlamaBackend, LlamaSettings
from trioserve._core._types import Infill

from .._helpers import RawStream, RunningServer, llama_server_command, start_server, wait_for
from .._models import FIM_LAYOUTS
from .._models import fim_model as make_fim_model

pytestmark = pytest.mark.model

N_CTX = 4096
#: both servers evaluate prompts in pieces of this many tokens (see ``fim_backend``)
BATCH = 512
CODE_BEFORE = (
    "import math\n\n\n"
    'def area(radius):\n    """The area of a circle."""\n    return math.pi * radius ** 2\n\n\n'
    "def circumference(radius):\n"
)
CODE_AFTER = "\n\n\ndef diameter(radius):\n    return 2 * radius\n"
EXTRA = [
    {
        "text": "def volume(radius):\n    return 4 / 3 * math.pi * radius ** 3\n",
        "time": [1, 2],
        "filename": "sphere.py",
    },
    {"text": "RADIUS = 2.5\nprint(area(RADIUS))\n", "time": [3, 4], "filename": "main.py"},
]


@pytest.fixture(scope="module", params=list(FIM_LAYOUTS))
def fim_model(request: pytest.FixtureRequest) -> Path:
    return make_fim_model(request.param)


@pytest.fixture(scope="module")
def fim_backend(fim_model: Path) -> Iterator[LlamaBackend]:
    # the prompt evaluated in the pieces llama-server evaluates it in (-b 512: every 512
    # tokens from the start), so both compute the same numbers and greedy draws the same
    # text (trioserve's default cut, at lines and sentences, computes other rounding)
    settings = LlamaSettings(
        str(fim_model),
        n_ctx=N_CTX,
        n_threads=2,
        slots=1,
        piece_rule="aligned",
        prefill_chunk=BATCH,
        n_batch=BATCH,
    )
    backend = LlamaBackend.load(settings)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def peer(fim_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama.cpp's llama-server on the same file: one slot of the same context."""
    port = free_port()
    argv = llama_server_command(
        fim_model, port, ["--ctx-size", str(N_CTX), "--parallel", "1", "-b", str(BATCH), "-ub", str(BATCH)]
    )
    server = Server(LLAMA_SERVER, argv, port, tmp_path_factory.mktemp("llama-server"))
    try:
        server.wait_ready(timeout=120)
        yield server.url
    finally:
        server.stop(grace=10)


@pytest.fixture
async def ours(fim_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, fim_backend, shutdown_grace=0.0, http=HTTPSettings())
    yield running
    running.server.shutdown()


def llama_vim(**override: object) -> dict[str, Any]:
    """A completion request as llama.vim sends it (autoload/llama.vim, ``llama#fim``),
    made greedy (``top_k`` 1) and with time limits that never bind, so the text depends
    only on the model."""
    body: dict[str, Any] = {
        "input_prefix": CODE_BEFORE,
        "input_suffix": CODE_AFTER,
        "input_extra": EXTRA,
        "prompt": "    ",
        "n_predict": 24,
        "n_indent": 4,
        "top_k": 1,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 60000,
        "t_max_predict_ms": 60000,
        "response_fields": [
            "content",
            "timings/prompt_n",
            "timings/prompt_ms",
            "timings/predicted_n",
            "truncated",
            "tokens_cached",
        ],
    }
    return {**body, **override}


def llama_vscode(**override: object) -> dict[str, Any]:
    """As llama.vscode sends it (its ``createRequestPayload`` with its default request
    parameters), made greedy."""
    body: dict[str, Any] = {
        "input_prefix": CODE_BEFORE,
        "input_suffix": CODE_AFTER,
        "input_extra": EXTRA,
        "prompt": "",
        "n_predict": 24,
        "top_k": 1,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 60000,
        "t_max_predict_ms": 60000,
    }
    return {**body, **override}


def _infill(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + "/infill", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


@pytest.mark.parametrize("client", ["llama.vim", "llama.vscode"])
async def test_infill_gives_llama_servers_prompt_and_text(
    client: str, ours: RunningServer, peer: str, fim_backend: LlamaBackend
) -> None:
    body = llama_vim() if client == "llama.vim" else llama_vscode()
    theirs = await trio.to_thread.run_sync(_infill, peer, {**body, "response_fields": []})
    mine_full = await trio.to_thread.run_sync(_infill, ours.url, {**body, "response_fields": []})
    # the same prompt: counted, and rendered (llama-server's "prompt" is its prompt
    # tokens detokenized with special tokens)
    request = GenerationRequest(
        prompt=body["prompt"],
        infill=Infill(
            prefix=CODE_BEFORE, suffix=CODE_AFTER, extra=tuple((c["filename"], c["text"]) for c in EXTRA)
        ),
    )
    tokens = fim_backend.llama_model.infill_prompt(request)
    rendered = b"".join(fim_backend.llama_model.special_piece(t) for t in tokens).decode()
    assert theirs["prompt"] == rendered
    assert mine_full["tokens_evaluated"] == theirs["tokens_evaluated"] == len(tokens)
    # the same text, and the same way of ending it
    assert mine_full["content"] == theirs["content"]
    assert mine_full["stop_type"] == theirs["stop_type"]
    # the fields asked for, and only those, as llama-server answers them
    if body.get("response_fields"):
        mine = await trio.to_thread.run_sync(_infill, ours.url, body)
        theirs_fields = await trio.to_thread.run_sync(_infill, peer, body)
        assert set(mine) == set(theirs_fields) == set(body["response_fields"])
        assert mine["content"] == theirs_fields["content"]
        assert mine["truncated"] is theirs_fields["truncated"] is False


async def test_suffix_on_completions_is_the_infill_prompt(ours: RunningServer) -> None:
    async with ours.client() as client:
        infill = (
            await client.post(
                "/infill",
                json={"input_prefix": CODE_BEFORE, "input_suffix": CODE_AFTER, "n_predict": 16, "top_k": 1},
            )
        ).json()
        completion = await client.post(
            "/v1/completions",
            json={"prompt": CODE_BEFORE, "suffix": CODE_AFTER, "max_tokens": 16, "temperature": 0},
        )
        assert completion.status_code == 200, completion.text
        body = completion.json()
    assert body["usage"]["prompt_tokens"] == infill["tokens_evaluated"]
    assert body["choices"][0]["text"] == infill["content"]


async def test_the_editors_warm_up_is_evaluated_and_cached(ours: RunningServer) -> None:
    """llama.vim's ring update: the extra context alone, no token asked, 1 ms to
    spend — evaluated in full (it is what the next completion reuses)."""
    # (over one 512-token piece: this server keeps whole pieces of its cut, every 512
    # tokens here — with the default cut, at lines, any chunk boundary is one)
    extra = [{"text": f"def helper_{i}(x):\n    return x * {i}\n", "filename": f"h{i}.py"} for i in range(40)]
    warm = {
        "input_prefix": "",
        "input_suffix": "",
        "input_extra": extra,
        "prompt": "",
        "n_predict": 0,
        "temperature": 0.0,
        "stream": False,
        "samplers": [],
        "cache_prompt": True,
        "t_max_prompt_ms": 1,
        "t_max_predict_ms": 1,
        "response_fields": [""],
    }
    async with ours.client() as client:
        answer = await client.post("/infill", json=warm)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {}  # (response_fields [""]: nothing, as llama-server)
        later = await client.post("/infill", json=llama_vim(input_extra=extra, response_fields=[]))
        assert later.status_code == 200, later.text
    timings = later.json()["timings"]
    assert later.json()["tokens_evaluated"] > BATCH
    # the extra context's whole pieces came from the warm-up
    assert timings["cache_n"] >= BATCH
    assert timings["prompt_n"] == later.json()["tokens_evaluated"] - timings["cache_n"]


async def test_infill_streams_what_it_answers_and_refuses_what_it_cannot(
    ours: RunningServer, nursery: trio.Nursery
) -> None:
    async with ours.client() as client:
        whole = (await client.post("/infill", json=llama_vim(response_fields=[]))).json()
        async with client.stream(
            "POST", "/infill", json=llama_vim(stream=True, response_fields=[])
        ) as streamed:
            data = await streamed.aread()
        chunks = [line[6:] for line in data.decode().split("\n\n") if line.startswith("data: ")]
        events = [json.loads(chunk) for chunk in chunks]
        assert all(event["stop"] is False for event in events[:-1])
        assert events[-1]["stop"] is True
        assert "".join(event["content"] for event in events[:-1]) == whole["content"] == events[-1]["content"]
        assert b"[DONE]" not in data
        for field, value in (
            ("ignore_eos", True),
            ("n_probs", 3),
            ("id_slot", 2),
            ("samplers", ["mirostat"]),
        ):
            refused = await client.post("/infill", json=llama_vim(**{field: value}))
            assert refused.status_code == 400, (field, refused.text)
            assert refused.json()["error"]["param"] == field


async def test_which_models_can_infill_is_said_and_the_others_refuse(
    ours: RunningServer, llama_server: RunningServer
) -> None:
    """``llama_server`` here is conftest's: trioserve on the default model, which has no
    FIM tokens."""
    async with ours.client() as mine, llama_server.client() as plain:
        (fim,) = (await mine.get("/v1/models")).json()["data"]
        (default,) = (await plain.get("/v1/models")).json()["data"]
        assert fim["capabilities"]["infill"] is True
        assert default["capabilities"]["infill"] is False
        refused = await plain.post("/infill", json=llama_vim())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "infill_not_supported"
    assert "FIM" in error["message"]


async def test_a_client_that_leaves_mid_infill_stops_it(
    ours: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The client leaves while its infill prompt is being evaluated inside llama.cpp
    (a long ``input_extra``: seconds of prefill), the phase a verdict cannot depend on
    which tokens the model draws (a greedy infill may end after a token on one CPU and
    run on another)."""
    caplog.set_level("INFO", logger="trioserve.requests")
    engine = ours.engine
    backend = engine.backend
    assert isinstance(backend, LlamaBackend)
    extra = [
        {"text": f"def shape_{i}(radius):\n    return {i} * math.pi * radius ** 2\n", "filename": f"s{i}.py"}
        for i in range(60)
    ]
    stream = await RawStream.post(
        ours.url,
        "/infill",
        llama_vim(stream=True, n_predict=1000, n_indent=0, response_fields=[], input_extra=extra),
        {"X-Request-Id": "leaver"},
    )
    try:
        await wait_for(lambda: engine.streams)
        (leaving,) = list(engine.streams)
        await wait_for(lambda: backend.in_flight(leaving.progress) == "prefill")
    finally:
        await stream.aclose()
    await wait_for(lambda: not engine.streams and engine.admission.in_use == 0)
    assert engine.backend.generations.running == 0
    await wait_for(lambda: any("request leaver " in r.getMessage() for r in caplog.records))
    (line,) = [r.getMessage() for r in caplog.records if "request leaver " in r.getMessage()]
    assert "cause=disconnect" in line, line
    latency = re.search(r"cancel_latency_ms=([\d.]+)", line)
    assert latency is not None, line
    # (the bound of the cancellation matrix; the figures: docs/benchmarks.md)
    assert float(latency.group(1)) < 250.0, line
