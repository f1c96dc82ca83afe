"""Engine faults stay contained: an exception in the scheduler's cache bookkeeping or
around a decode call fails the request it belongs to (or drops a cache entry), never
the server; a llama.cpp that refuses a partial removal of cells (recurrent state) leaves
no cells recorded that are not there. Each fault is injected into the real scheduler on
the real model; the next request must succeed, with the text a fresh server gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from trioserve import LlamaBackend

from .._helpers import start_server

pytestmark = pytest.mark.model

PROMPT = "The history of the printing press begins in " + "the city of Mainz, " * 60
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}


class _FaultyLib:
    """llama_cpp with one function made to fail while armed (raise, or return a value)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.fail: dict[str, Any] = {}
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._lib, name)
        if name not in self.fail:
            return real

        def wrapped(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            outcome = self.fail[name](*args)
            if outcome is _REAL:
                return real(*args)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return wrapped


_REAL = object()


@pytest.fixture
def faulty(llama_backend: LlamaBackend) -> Iterator[_FaultyLib]:
    real = llama_backend.lib
    faulty = _FaultyLib(real)
    llama_backend.lib = faulty
    try:
        yield faulty
    finally:
        llama_backend.lib = real


@pytest.fixture(autouse=True)
def empty_cache(llama_backend: LlamaBackend) -> None:
    """Start with nothing cached (the backend is shared by the session's tests), so the
    first request's cells are the ones each fault meets."""
    llama_backend.clear_cache()


async def _reference(llama_backend: LlamaBackend, nursery: trio.Nursery) -> str:
    """The text a fresh server gives: the same prompt with the cache neither used nor left."""
    running = await start_server(nursery, llama_backend)
    async with running.client() as client:
        response = await client.post("/v1/completions", json={**BODY, "cache_prompt": False})
    running.server.shutdown()
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


async def _healthy(client: Any) -> dict[str, Any]:
    health = (await client.get("/health")).json()
    assert health["status"] == "ok", health
    assert health["generations_running"] == 0
    return health  # type: ignore[no-any-return]


async def test_a_fault_preparing_cached_cells_fails_one_request(
    llama_backend: LlamaBackend, nursery: trio.Nursery, request: pytest.FixtureRequest
) -> None:
    expected = await _reference(llama_backend, nursery)
    faults = []

    def prepare_once() -> None:
        if not faults:
            faults.append(True)
            raise MemoryError("copying a large sequence state")

    llama_backend.inject_fault(prepare_once)
    request.addfinalizer(lambda: llama_backend.inject_fault(None))
    running = await start_server(nursery, llama_backend)
    async with running.client() as client:
        failed = await client.post("/v1/completions", json=BODY)
        assert failed.status_code == 500
        assert "MemoryError" in failed.json()["error"]["message"]
        await _healthy(client)
        # streamed, the next one succeeds, with the fresh server's text
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as streamed:
            data = (await streamed.aread()).decode()
        events = [e.removeprefix("data: ") for e in data.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == expected
        assert llama_backend.failure is None
        await _healthy(client)
    running.server.shutdown()


async def test_a_fault_keeping_cells_drops_that_cache_entry_only(
    llama_backend: LlamaBackend, faulty: _FaultyLib, nursery: trio.Nursery
) -> None:
    expected = await _reference(llama_backend, nursery)
    running = await start_server(nursery, llama_backend)
    # the removal of the reply's cells at the end of the request raises once
    state = {"armed": True}

    def seq_rm(memory: Any, seq_id: int, p0: int, p1: int) -> Any:
        if state["armed"] and p0 > 0:
            state["armed"] = False
            return RuntimeError("bookkeeping fault")
        return _REAL

    faulty.fail["llama_memory_seq_rm"] = seq_rm
    async with running.client() as client:
        first = await client.post("/v1/completions", json=BODY)
        # the text went out whole: only the cache entry is lost
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["text"] == expected
        assert not state["armed"]
        health = await _healthy(client)
        assert health["batch"]["cache"]["tokens"] == 0  # the entry was dropped, not kept half-true
        second = await client.post("/v1/completions", json=BODY)
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["text"] == expected
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await _healthy(client)
    running.server.shutdown()


async def test_a_fault_around_a_decode_call_fails_its_request_only(
    llama_backend: LlamaBackend, faulty: _FaultyLib, nursery: trio.Nursery
) -> None:
    expected = await _reference(llama_backend, nursery)
    running = await start_server(nursery, llama_backend)
    state = {"armed": True}

    def logits(*args: Any) -> Any:
        if state["armed"]:
            state["armed"] = False
            return MemoryError("reading the logits")
        return _REAL

    faulty.fail["llama_get_logits_ith"] = logits
    async with running.client() as client:
        failed = await client.post("/v1/completions", json=BODY)
        assert failed.status_code == 500
        assert "MemoryError" in failed.json()["error"]["message"]
        await _healthy(client)
        ok = await client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == expected
        assert llama_backend.failure is None
    running.server.shutdown()


async def test_a_refused_partial_removal_records_no_cells(
    llama_backend: LlamaBackend, faulty: _FaultyLib, nursery: trio.Nursery
) -> None:
    """llama.cpp's recurrent memory answers ``false`` to a partial ``llama_memory_seq_rm``:
    the scheduler must then clear the whole sequence and record nothing cached, so the
    next answer is still the fresh server's (before, the cache recorded cells that were
    not there)."""
    expected = await _reference(llama_backend, nursery)
    running = await start_server(nursery, llama_backend)
    refused = []

    def seq_rm(memory: Any, seq_id: int, p0: int, p1: int) -> Any:
        if p0 > 0:
            refused.append(p0)
            return False
        return _REAL

    faulty.fail["llama_memory_seq_rm"] = seq_rm
    async with running.client() as client:
        for _ in range(2):
            response = await client.post("/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            health = await _healthy(client)
            assert health["batch"]["cache"]["tokens"] == 0
    assert refused  # the partial removals were asked for, and refused
    running.server.shutdown()


def test_a_llama_cpp_that_cannot_decode_fails_at_load_with_a_message(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up decode at load: a build that cannot run here fails at startup, naming
    the system info, and leaves nothing loaded (not a crash at a user's first request)."""
    import llama_cpp

    from trioserve import BackendError, LlamaSettings
    from trioserve._backends._llama import LlamaModel

    monkeypatch.setattr(llama_cpp, "llama_decode", lambda ctx, batch: -1)
    loaded = LlamaModel.loaded
    with pytest.raises(BackendError, match=r"warm-up decode failed \(llama_decode returned -1\)") as info:
        LlamaBackend.load(LlamaSettings(model_path, n_ctx=512, n_threads=2, slots=1))
    assert "system info: CPU :" in info.value.message
    assert LlamaModel.loaded == loaded
