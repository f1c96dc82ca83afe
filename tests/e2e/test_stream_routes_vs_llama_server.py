"""llama-server's resumable-stream routes (its PR #23226: ``X-Conversation-Id``,
``GET /v1/stream``, ``POST /v1/streams/lookup``, ``DELETE /v1/stream``) answered by
trioserve as by the real llama-server built from the llama.cpp llama-cpp-python
vendors, on the same model file and the same requests: status codes, content types and
the JSON shapes (keys and the types of their values), and the error messages a client
may match. The differences that are trioserve's design are listed here
(:data:`DIFFERENCES`), each checked, not ignored (docs/resumable-streams.md)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import trio

from benchmarks.harness.servers import LLAMA_SERVER, Server, free_port
from trioserve import HTTPSettings, LlamaBackend, default_model_path

from .._helpers import RunningServer, llama_server_command, start_server

pytestmark = pytest.mark.model

#: where trioserve answers otherwise, on purpose (each is asserted below)
DIFFERENCES = {
    "unknown id": "llama-server's generic 404 says 'File Not Found'; trioserve says 'Stream not found or "
    "expired' (the message its own source has), in the same shape",
    "from past the end": "llama-server answers 200 with an empty body; trioserve 400 \"Invalid 'from' "
    'offset" (an offset no byte of the stream has)',
    "a whole answer with the header": "llama-server answers and keeps nothing; trioserve refuses "
    "(400 naming X-Conversation-Id): what it cannot honour is refused",
    "event ids": "trioserve writes id: on every event (and retry: on the first): Last-Event-ID works; "
    "the data payloads are the same",
}


@pytest.fixture(scope="module")
def llama_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    argv = llama_server_command(default_model_path(progress=False), port, ["--ctx-size", "1024"])
    reference = Server(LLAMA_SERVER, argv, port, tmp_path_factory.mktemp("llama-server"))
    try:
        reference.wait_ready(120)
        yield reference.url
    finally:
        reference.stop()


@pytest.fixture
async def trioserve_url(llama_backend: LlamaBackend, nursery: trio.Nursery) -> AsyncIterator[str]:
    running: RunningServer = await start_server(
        nursery, llama_backend, shutdown_grace=0.0, http=HTTPSettings()
    )
    yield running.url
    running.server.shutdown()


def _shape(value: Any) -> Any:
    """A JSON value's shape: its keys and the types of their values, recursively."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


STREAM = {"prompt": "Hello", "max_tokens": 8, "stream": True, "temperature": 0}


async def _both(urls: list[str], method: str, path: str, **kwargs: Any) -> list[httpx.Response]:
    answers = []
    for url in urls:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            answers.append(await client.request(method, path, **kwargs))
    return answers


async def test_the_stream_routes_answer_as_llama_servers(trioserve_url: str, llama_server_url: str) -> None:
    urls = [trioserve_url, llama_server_url]
    # a stream opted in, read to its end on its own connection
    posted = await _both(urls, "POST", "/v1/completions", json=STREAM, headers={"X-Conversation-Id": "cmp-1"})
    for answer in posted:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.content.endswith(b"data: [DONE]\n\n")

    # lookup: exact id, an unknown one
    ours, theirs = await _both(urls, "POST", "/v1/streams/lookup", json={"conversation_ids": ["cmp-1", "zz"]})
    assert ours.status_code == theirs.status_code == 200
    assert _shape(ours.json()) == _shape(theirs.json())
    assert [e["conversation_id"] for e in ours.json()] == [e["conversation_id"] for e in theirs.json()]
    assert ours.json()[0]["is_done"] is theirs.json()[0]["is_done"] is True
    # each counts the bytes of its own stream (trioserve's carry ids)
    assert ours.json()[0]["total_bytes"] == len(posted[0].content)
    assert theirs.json()[0]["total_bytes"] == len(posted[1].content)
    # a body without ids; one that is not JSON
    ours, theirs = await _both(urls, "POST", "/v1/streams/lookup", json={})
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()) == (200, [])
    ours, theirs = await _both(urls, "POST", "/v1/streams/lookup", content=b"{not json")
    assert ours.status_code == theirs.status_code == 400
    assert _shape(ours.json()) == _shape(theirs.json())
    assert ours.json()["error"]["type"] == theirs.json()["error"]["type"] == "invalid_request_error"

    # GET /v1/stream: no id, a bad offset, an unknown id
    for params in ({}, {"conv_id": "cmp-1", "from": "x"}):
        ours, theirs = await _both(urls, "GET", "/v1/stream", params=params)
        assert ours.status_code == theirs.status_code == 400
        assert ours.json() == theirs.json(), params
    ours, theirs = await _both(urls, "GET", "/v1/stream", params={"conv_id": "never"})
    assert ours.status_code == theirs.status_code == 404
    assert _shape(ours.json()) == _shape(theirs.json())
    assert theirs.json()["error"]["message"] == "File Not Found"  # (DIFFERENCES["unknown id"])
    assert ours.json()["error"]["message"] == "Stream not found or expired"

    # a replay from the middle of an event: the same payloads from there on
    replays = []
    for url, whole in zip(urls, posted, strict=True):
        offset = whole.content.index(b"data: ", 10) + 3  # inside the first data line after 10 bytes
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            replay = await client.get("/v1/stream", params={"conv_id": "cmp-1", "from": offset})
        assert replay.status_code == 200
        assert replay.headers["content-type"].startswith("text/event-stream")
        assert replay.content == whole.content[offset:]
        replays.append(replay)
    payloads = [
        [json.loads(line[6:]) for line in whole.content.split(b"\n") if line.startswith(b"data: {")]
        for whole in posted
    ]
    for chunks in payloads:
        assert {chunk["object"] for chunk in chunks} == {"text_completion"}
        assert all({"choices", "created", "model", "id"} <= set(chunk) for chunk in chunks)
    assert _shape(payloads[0][0]["choices"][0]) == _shape(payloads[1][0]["choices"][0])
    # (DIFFERENCES["event ids"]): every event of ours has an id, none of theirs
    assert posted[0].content.startswith(b"id: 0\nretry: 1000\n")
    assert b"\nid: " not in posted[1].content

    # read from the end of a finished stream: nothing, and done
    for url, whole in zip(urls, posted, strict=True):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            end = await client.get("/v1/stream", params={"conv_id": "cmp-1", "from": len(whole.content)})
        assert end.status_code == 200
        assert end.content == b""
    # past the end (DIFFERENCES["from past the end"])
    ours, theirs = await _both(urls, "GET", "/v1/stream", params={"conv_id": "cmp-1", "from": 10**8})
    assert (theirs.status_code, theirs.content) == (200, b"")
    assert ours.status_code == 400
    assert ours.json()["error"]["message"] == "Invalid 'from' offset"

    # DELETE: an unknown id, no id
    ours, theirs = await _both(urls, "DELETE", "/v1/stream", params={"conv_id": "never"})
    assert ours.status_code == theirs.status_code == 204
    ours, theirs = await _both(urls, "DELETE", "/v1/stream")
    assert ours.status_code == theirs.status_code == 400
    assert ours.json() == theirs.json()
    # DELETE of the finished stream: gone from both
    await _both(urls, "DELETE", "/v1/stream", params={"conv_id": "cmp-1"})
    ours, theirs = await _both(urls, "POST", "/v1/streams/lookup", json={"conversation_ids": ["cmp-1"]})
    assert ours.json() == theirs.json() == []

    # a whole answer with the header (DIFFERENCES["a whole answer with the header"])
    whole_body = {**STREAM, "stream": False}
    ours, theirs = await _both(
        urls, "POST", "/v1/completions", json=whole_body, headers={"X-Conversation-Id": "w"}
    )
    assert theirs.status_code == 200
    assert ours.status_code == 400
    assert ours.json()["error"]["param"] == "X-Conversation-Id"
