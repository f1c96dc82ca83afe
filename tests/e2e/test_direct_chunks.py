"""A streamed response's body parts written from hypercorn's ASGI send straight to the
socket (``_hypercorn_patches.patch_hypercorn_chunks``), over a real hypercorn socket and
real clients: the bytes are the chunked HTTP/1.1 that h11 would write (httpx and the
openai SDK read them), every content event of a plain stream goes this way (under the
CORS wrapper too), and what cannot — an HTTP/1.0 client, whose response is not chunked —
goes hypercorn's way with the same text."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import trio

from trioserve import ScriptedBackend
from trioserve._http import _hypercorn_patches

from .._helpers import RunningServer, start_server

WORDS = [f"w{i} ".encode() for i in range(12)]
TEXT = b"".join(WORDS).decode()
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(WORDS)}


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bytes | None]]:
    """Every ``write_chunk``: the data's length and what the kernel did not take
    (``None``: declined, nothing written)."""
    calls: list[tuple[int, bytes | None]] = []
    original: Callable[[Any, bytes], tuple[Any, bytes] | None] = _hypercorn_patches.write_chunk

    def write_chunk(http: Any, data: bytes) -> tuple[Any, bytes] | None:
        result = original(http, data)
        calls.append((len(data), None if result is None else result[1]))
        return result

    monkeypatch.setattr(_hypercorn_patches, "write_chunk", write_chunk)
    return calls


async def _server(nursery: trio.Nursery, **settings: object) -> RunningServer:
    return await start_server(nursery, ScriptedBackend(WORDS, slots=2), close_backend=True, **settings)


async def test_a_streams_events_go_straight_to_the_socket_as_chunks_clients_read(
    nursery: trio.Nursery, written: list[tuple[int, bytes | None]]
) -> None:
    server = await _server(nursery)

    def chat() -> str:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            stream = client.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert await trio.to_thread.run_sync(chat) == TEXT
    # every streamed part (the role chunk, then the content: one a word, or several that
    # came together) went at once, whole
    assert len(written) >= 2
    assert all(r == b"" for _, r in written)


async def test_through_the_cors_wrapper_too(
    nursery: trio.Nursery, written: list[tuple[int, bytes | None]]
) -> None:
    server = await _server(nursery, cors_origins=("https://app.example",))
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
        client.stream(
            "POST",
            "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"Origin": "https://app.example"},
        ) as response,
    ):
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        body = b"".join([part async for part in response.aiter_bytes()])
    assert body.endswith(b"data: [DONE]\n\n")
    assert written
    assert all(r == b"" for _, r in written)


async def test_an_http_1_0_client_gets_hypercorns_way_and_the_same_text(
    nursery: trio.Nursery, written: list[tuple[int, bytes | None]]
) -> None:
    import json

    server = await _server(nursery)
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps({**CHAT, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # (a hang fails, not waits)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while data := await trio.to_thread.run_sync(sock.recv, 65536):
            received += data
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()  # (HTTP/1.0: the body ends with the connection)
    assert body.endswith(b"data: [DONE]\n\n")
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in body.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert "".join(deltas) == TEXT
    assert written
    assert all(r is None for _, r in written)  # asked, and declined: nothing written
