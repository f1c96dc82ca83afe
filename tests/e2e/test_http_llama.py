"""A real hypercorn server on 127.0.0.1, real llama.cpp inference on the default model,
real HTTP clients (httpx over a real socket)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import trio

from trioserve import Backend, LlamaBackend, ScriptedBackend
from trioserve._wire._sse import SSEDecoder

from .._helpers import RawStream, RunningServer

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


async def stream_events(
    client: httpx.AsyncClient, path: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> tuple[httpx.Response, list[dict[str, object] | str], list[float]]:
    """POST a streaming request; return the response, the decoded events and the
    arrival time of each."""
    decoder = SSEDecoder()
    events: list[dict[str, object] | str] = []
    arrivals: list[float] = []
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as response:
        async for chunk in response.aiter_raw():
            for event in decoder.feed(chunk):
                events.append(event.data if event.data == "[DONE]" else json.loads(event.data))
                arrivals.append(time.perf_counter())
    return response, events, arrivals


def text_of(events: list[dict[str, object] | str], kind: str = "text") -> str:
    parts = []
    for event in events:
        if isinstance(event, dict) and event["choices"]:
            choice = event["choices"][0]  # type: ignore[index]
            parts.append(choice["text"] if kind == "text" else choice["delta"].get("content") or "")
    return "".join(parts)


def finish_reason(events: list[dict[str, object] | str]) -> str:
    reasons = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e["choices"]]  # type: ignore[index]
    assert all(r is None for r in reasons[:-1])
    return str(reasons[-1])


async def test_stream_sse_headers_framing_and_incremental_delivery(llama_server: RunningServer) -> None:
    async with llama_server.client() as client:
        request = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0}
        decoder = SSEDecoder()
        raw = b""
        arrivals = []
        async with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache"
            assert response.headers["x-accel-buffering"] == "no"
            assert response.headers["x-request-id"]
            async for chunk in response.aiter_raw():
                raw += chunk
                if decoder.feed(chunk):
                    arrivals.append(time.perf_counter())
    events = [e for e in raw.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    assert raw.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # incremental: the first event arrived long before the last (48 tokens ≈ 0.5 s)
    assert len(arrivals) > 10
    assert arrivals[-1] - arrivals[0] > 0.2


@pytest.mark.parametrize("kind", ["text", "chat"])
async def test_joined_stream_equals_non_streamed_text(llama_server: RunningServer, kind: str) -> None:
    if kind == "text":
        path, body = "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    else:
        path = "/v1/chat/completions"
        body = {
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 40,
            "temperature": 0,
        }
    async with llama_server.client() as client:
        whole = (await client.post(path, json=body)).json()
        _, events, _ = await stream_events(client, path, body)
    if kind == "text":
        expected = whole["choices"][0]["text"]
    else:
        expected = whole["choices"][0]["message"]["content"]
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"  # type: ignore[index]
    assert text_of(events, kind) == expected
    assert len(expected) > 20
    assert finish_reason(events) == whole["choices"][0]["finish_reason"]


async def test_utf8_cjk_and_emoji_split_across_tokens(
    llama_server: RunningServer, llama_backend: LlamaBackend
) -> None:
    # Rare CJK characters are byte-fallback tokens in Gemma's vocabulary: one token per
    # byte, so each character arrives in three pieces.
    prompt = "鼃鼄鼅鼃鼄鼅鼃鼄鼅 🎉🦜 鼃鼄鼅鼃鼄"
    pieces = [llama_backend.piece(t) for t in llama_backend.tokenize(prompt, add_bos=False)]
    assert any(_is_partial(p) for p in pieces), "the test needs tokens that split a character"
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    async with llama_server.client() as client:
        whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        _, events, _ = await stream_events(client, "/v1/completions", body)
    deltas = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]]  # type: ignore[index]
    assert "".join(deltas) == whole
    assert not any("\ufffd" in d for d in deltas)
    # the model continued in kind: the output itself holds split characters
    generated = llama_backend.tokenize(whole, add_bos=False)
    assert any(_is_partial(llama_backend.piece(t)) for t in generated)


def _is_partial(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return True
    return False


async def test_stop_sequence_across_tokens_is_never_leaked(
    llama_server: RunningServer, llama_backend: LlamaBackend
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    async with llama_server.client() as client:
        free = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = "country of"  # " country" and " of" are two tokens
        assert stop in free
        assert len(llama_backend.tokenize(stop, add_bos=False)) >= 2
        stopped = (await client.post("/v1/completions", json={**body, "stop": [stop]})).json()
        _, events, _ = await stream_events(client, "/v1/completions", {**body, "stop": [stop]})
    expected = free[: free.index(stop)]
    assert stopped["choices"][0]["text"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert text_of(events) == expected
    assert finish_reason(events) == "stop"
    assert all(stop not in str(e) for e in events)
    await llama_server.wait_idle()


async def test_aborted_decode_leaves_the_next_request_identical_to_a_fresh_server(
    llama_server: RunningServer,
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0}
    async with llama_server.client() as client:
        fresh = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        # a client that closes its connection mid-decode, after a few chunks
        raw = await RawStream.post(
            llama_server.url,
            "/v1/completions",
            {"prompt": "Once upon a time", "max_tokens": 2000, "stream": True, "temperature": 0},
        )
        await raw.read_until(b"data: ", count=5)
        await raw.aclose()
        await llama_server.wait_idle()
        after = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    assert after == fresh


async def test_aborted_prefill_leaves_the_next_request_identical_to_a_fresh_server(
    llama_server: RunningServer, llama_backend: LlamaBackend
) -> None:
    long_prompt = "The history of the city is long and varied. " * 170  # ~1,700 tokens
    assert len(llama_backend.tokenize(long_prompt)) > 1500
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0}
    async with llama_server.client() as client:
        fresh = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        started = llama_backend.generations.started
        with trio.move_on_after(0.3):  # leaves mid-prefill (prefill takes ~2 s here)
            await client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 5})
        assert llama_backend.generations.started == started + 1
        await llama_server.wait_idle(limit=1.0)  # the abort callback stopped llama_decode
        after = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    assert after == fresh


async def test_models_and_health(llama_server: RunningServer) -> None:
    async with llama_server.client() as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
    assert models["object"] == "list"
    assert models["data"][0]["id"] == llama_server.engine.backend.info.id
    assert health.status_code == 200
    assert health.json()["status"] == "ok"


async def test_health_is_503_while_loading_then_200(nursery: trio.Nursery) -> None:
    release = trio.Event()

    async def slow_load() -> Backend:
        await release.wait()
        return ScriptedBackend([b"ok"])

    from trioserve import Server, ServerSettings

    server = Server(slow_load, ServerSettings(port=0))
    binds = await nursery.start(server.run)
    async with httpx.AsyncClient(base_url=binds[0]) as client:
        loading = await client.get("/health")
        assert loading.status_code == 503
        assert loading.json()["status"] == "loading"
        assert loading.headers["retry-after"] == "1"
        refused = await client.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "loading"
        release.set()
        await server.ready.wait()
        assert (await client.get("/health")).status_code == 200
        done = await client.post("/v1/completions", json={"prompt": "x"})
        assert done.json()["choices"][0]["text"] == "ok"
    server.shutdown()


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        ("GET", "/nope", {}, 404, "not_found"),
        ("GET", "/v1/completions", {}, 405, "method_not_allowed"),
        ("PUT", "/health", {}, 405, "method_not_allowed"),
        (
            "POST",
            "/v1/completions",
            {"content": b"{}", "headers": {"content-type": "text/plain"}},
            415,
            "unsupported_media_type",
        ),
        ("POST", "/v1/completions", {"json": {"prompt": "x", "model": "gpt-4"}}, 404, "model_not_found"),
        (
            "POST",
            "/v1/completions",
            {"json": {"prompt": "x", "max_tokens": 100_000}},
            400,
            "context_length_exceeded",
        ),
        ("POST", "/v1/completions", {"json": {"prompt": "x", "logit_bias": {"999999999": 1}}}, 400, None),
        (
            "POST",
            "/v1/completions",
            {"json": {"prompt": "x"}, "headers": {"x-request-timeout": "soon"}},
            400,
            None,
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    llama_server: RunningServer,
    method: str,
    path: str,
    kwargs: dict[str, object],
    status: int,
    code: str | None,
) -> None:
    async with llama_server.client() as client:
        response = await client.request(method, path, **kwargs)  # type: ignore[arg-type]
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["code"] == code
    assert "Traceback" not in response.text


async def test_body_over_the_limit_gets_413_before_it_is_uploaded(llama_server: RunningServer) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(llama_server.url)
    assert parts.hostname is not None
    assert parts.port is not None
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    # announce 5 MiB, send only the head: the server must answer without waiting for it
    await stream.send_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5242880\r\n\r\n{"
    )
    received = b""
    with trio.fail_after(5):
        while b"}}" not in received:
            received += await stream.receive_some(65536)
    await stream.aclose()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert b'"code":"payload_too_large"' in body
