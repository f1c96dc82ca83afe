"""No request holds the event loop: a large body is decoded, validated and rendered in a
worker thread, and the scripted model makes a long text's tokens in one too (issue 53;
the figure: docs/benchmarks.md, "The cost of a streamed event")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from trioserve import ScriptedBackend
from trioserve.testing import open_test_server


@pytest.fixture
def in_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions run by ``trio.to_thread.run_sync`` from here on."""
    names: list[str] = []
    run_sync = trio.to_thread.run_sync

    async def recording(work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        names.append(getattr(work, "__name__", repr(work)))
        return await run_sync(work, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", recording)
    return names


def count_body(text: str) -> dict[str, object]:
    return {"model": "scripted", "messages": [{"role": "user", "content": text}]}


async def test_a_large_count_tokens_body_is_decoded_and_rendered_off_the_loop(in_threads: list[str]) -> None:
    async with open_test_server() as server, httpx.AsyncClient(base_url=server.url) as client:
        small = await client.post("/v1/messages/count_tokens", json=count_body("hi"))
        assert small.status_code == 200
        assert in_threads == []  # (a small body: on the loop, no thread's round trip)
        text = "x" * (300 * 1024)
        large = await client.post("/v1/messages/count_tokens", json=count_body(text))
    assert large.status_code == 200
    assert large.json()["input_tokens"] >= len(text)
    assert "generation_for" in in_threads  # the chat render
    assert len(in_threads) >= 2  # and the body's decode before it


async def test_the_scripted_model_tokenizes_a_long_prompt_in_a_thread(in_threads: list[str]) -> None:
    backend = ScriptedBackend([b"ok"], context_length=1 << 20)
    async with (
        open_test_server(backend) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        prompt = "y" * (200 * 1024)
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200
        assert response.json()["usage"]["prompt_tokens"] == len(prompt)
        assert "_sliced_tokens" in in_threads
        in_threads.clear()
        response = await client.post("/v1/completions", json={"prompt": "short", "max_tokens": 1})
        assert response.status_code == 200
        assert "_sliced_tokens" not in in_threads
