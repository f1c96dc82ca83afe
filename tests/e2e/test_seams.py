"""Where a Trio program meets trioserve, on the real model: exceptions come out as
themselves, a backend failure's message reaches the client, a cancel is never an
error, leaving an Engine cancels its streams before the model is freed, and nothing
leaks on the library path (reservations, a cancelled load)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from trioserve import (
    Engine,
    GenerationRequest,
    InvalidRequestError,
    LlamaBackend,
    LlamaSettings,
    SamplingParams,
    ServiceUnavailableError,
    TextDelta,
)
from trioserve._backends._llama import LlamaModel

from .._helpers import start_server, wait_for

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0)
ENDLESS = GenerationRequest(prompt="Once upon a time", max_tokens=3000, sampling=GREEDY)


async def test_an_exception_in_the_stream_body_comes_out_as_itself(llama_backend: LlamaBackend) -> None:
    engine = Engine(llama_backend)
    raised = ValueError("the caller's own bug")
    with pytest.raises(ValueError, match="the caller's own bug") as caught:  # noqa: PT012
        async with engine.stream(ENDLESS) as events:
            async for event in events:
                assert isinstance(event, TextDelta)
                raise raised
    assert caught.value is raised
    assert caught.value.__context__ is None  # not chained to an exception group
    assert llama_backend.generations.running == 0
    assert engine.admission.in_use == 0


async def test_an_exception_inside_open_test_server_comes_out_as_itself() -> None:
    from trioserve.testing import open_test_server

    with pytest.raises(KeyError):  # noqa: PT012
        async with open_test_server(script=[b"x"]) as server:
            assert server.url.startswith("http://127.0.0.1:")
            raise KeyError("from the test body")


class _FailingLib:
    """llama_cpp with ``llama_decode`` failing (code -1) once armed: a real llama.cpp
    failure path, without a broken model file."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        if self.armed:
            return -1
        result: int = self._lib.llama_decode(ctx, batch)
        return result


@pytest.fixture
def failing_decode(llama_backend: LlamaBackend) -> Iterator[_FailingLib]:
    real = llama_backend.lib
    failing = _FailingLib(real)
    llama_backend.lib = failing
    try:
        yield failing
    finally:
        llama_backend.lib = real


async def test_a_backend_failure_reaches_the_client_with_its_message(
    llama_backend: LlamaBackend, failing_decode: _FailingLib, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, llama_backend)
    failing_decode.armed = True
    async with running.client() as client:
        response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
        assert response.status_code == 500
        message = response.json()["error"]["message"]
        assert "llama_decode failed with code -1" in message
        assert "Exceptions from Trio nursery" not in message
        # streamed: an error event with the same message (the SDKs raise on it), then [DONE]
        body = {"prompt": "Hello", "max_tokens": 5, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as streamed:
            text = (await streamed.aread()).decode()
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "llama_decode failed with code -1" in error["message"]
    assert error["type"] == "server_error"
    assert '"finish_reason"' not in text
    failing_decode.armed = False
    await running.wait_idle()
    running.server.shutdown()


@pytest.mark.parametrize("after_tokens", [0, 1, 2, 5, 9, 17])
async def test_a_cancel_is_never_reported_as_an_error(llama_backend: LlamaBackend, after_tokens: int) -> None:
    """Cancel at many points (before the first token, mid-decode, as a piece is handed
    over): the caller always sees its own cancel, never a BackendError or an error event."""
    engine = Engine(llama_backend)
    finals = []
    with trio.CancelScope() as scope:
        async with engine.stream(ENDLESS) as events:
            progress = events.progress

            async def cancel_at_token() -> None:
                await wait_for(lambda: progress.completion_tokens >= after_tokens)
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_at_token)
                async for event in events:
                    if not isinstance(event, TextDelta):
                        finals.append(event)
    assert scope.cancelled_caught
    assert finals == []
    assert llama_backend.generations.running == 0
    assert engine.admission.in_use == 0


async def test_leaving_the_engine_cancels_streams_in_an_outer_nursery_then_frees_the_model(
    model_path: str,
) -> None:
    backend = LlamaBackend.load(LlamaSettings(model_path, n_ctx=4096, n_threads=2, slots=2))
    loaded = LlamaModel.loaded
    seen_at_free: list[tuple[int, bool]] = []
    real_close = backend.close

    def close() -> None:
        # what is still running when the model is freed
        seen_at_free.append((backend.generations.running, backend.snapshot().thread_started))
        real_close()

    backend.close = close  # type: ignore[method-assign]
    outcomes: list[BaseException] = []
    streaming = trio.Event()

    async def outer_stream(engine: Engine) -> None:
        try:
            async with engine.stream(ENDLESS) as events:
                async for _ in events:
                    streaming.set()
        except ServiceUnavailableError as exc:
            outcomes.append(exc)

    async with trio.open_nursery() as outer:
        async with Engine(backend) as engine:
            outer.start_soon(outer_stream, engine)
            outer.start_soon(outer_stream, engine)
            await streaming.wait()
            await wait_for(lambda: backend.generations.running == 2)
        # the engine is closed: both streams were cancelled and their sequences removed
        # before the model was freed
        assert seen_at_free == [(0, True)]
        assert LlamaModel.loaded == loaded - 1
    assert len(outcomes) == 2
    assert all(exc.code == "engine_closed" for exc in outcomes)  # type: ignore[attr-defined]
    after = backend.snapshot()
    assert after.thread_started
    assert not after.thread_alive


async def test_a_reservation_is_released_when_the_request_is_invalid_or_cancelled(
    llama_backend: LlamaBackend,
) -> None:
    engine = Engine(llama_backend)
    reservation = engine.admission.reserve()
    assert engine.admission.reserved == 1
    too_long = GenerationRequest(prompt="word " * 5000, max_tokens=5)  # over the context
    with pytest.raises(InvalidRequestError):
        async with engine.stream(too_long, reservation=reservation):
            pytest.fail("an invalid request must not start")
    assert engine.admission.reserved == 0
    # cancelled while its (long, so threaded) prompt is being tokenized
    reservation = engine.admission.reserve()
    with trio.CancelScope() as scope:
        scope.cancel()
        async with engine.stream(GenerationRequest(prompt="word " * 2000), reservation=reservation):
            pytest.fail("a cancelled request must not start")
    assert scope.cancelled_caught
    assert engine.admission.reserved == 0
    assert engine.admission.queued == 0


async def test_a_load_cancelled_midway_frees_the_model(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = LlamaModel.loaded
    in_load = threading.Event()
    release = threading.Event()
    real_load = LlamaBackend.load.__func__  # type: ignore[attr-defined]

    def load(cls: type[LlamaBackend], settings: LlamaSettings, **options: Any) -> LlamaBackend:
        backend: LlamaBackend = real_load(cls, settings, **options)
        in_load.set()  # loaded; the caller is cancelled before load() returns
        release.wait()
        return backend

    monkeypatch.setattr(LlamaBackend, "load", classmethod(load))
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def cancel_during_load() -> None:
                await trio.to_thread.run_sync(in_load.wait)
                scope.cancel()
                release.set()

            nursery.start_soon(cancel_during_load)
            await LlamaBackend.aload(LlamaSettings(model_path, n_ctx=512, n_threads=2, slots=1))
            pytest.fail("aload must raise the cancel")
    assert scope.cancelled_caught
    assert LlamaModel.loaded == loaded


async def test_the_greedy_fast_path_picks_the_tokens_llama_cpps_greedy_sampler_picks(
    llama_backend: LlamaBackend,
) -> None:
    """temperature 0 without logit_bias takes the argmax in the scheduler; a logit_bias
    of 0 (which changes no logit) forces llama.cpp's own sampler chain: same text."""
    engine = Engine(llama_backend)
    texts = []
    for sampling in (GREEDY, SamplingParams(temperature=0, logit_bias={0: 0.0})):
        parts = []
        request = GenerationRequest(prompt="The three laws of robotics are", max_tokens=80, sampling=sampling)
        async with engine.stream(request) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
        texts.append("".join(parts))
    assert len(texts[0]) > 100
    assert texts[0] == texts[1]
