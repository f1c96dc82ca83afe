"""Many models on one server (docs/models.md), with the real model: copies of the
default GGUF under other names (one with another context), real hypercorn sockets, the
openai SDK and httpx.

A load is held at a known point by a gate in llama.cpp's own progress callback (the
load really runs; the gate only waits, in the loading thread, until the test has seen
what it came to see), so "a client leaves during the load" is a phase reached, not a
sleep."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel

from trioserve import Backend, LlamaBackend, LlamaSettings, Server, ServerSettings
from trioserve._backends._sources import LlamaSource
from trioserve._core._registry import ModelRegistry, ModelSpec

from .._helpers import wait_for

THREADS = min(2, os.cpu_count() or 1)


class GatedSource(LlamaSource):
    """A real GGUF load that stops in llama.cpp's progress callback, past its first
    tensor, until the test opens the gate (or the load is aborted meanwhile)."""

    def __init__(self, settings: LlamaSettings) -> None:
        super().__init__(settings)
        self.gate = threading.Event()
        self.gate.set()  # open unless a test closes it
        self.waiting = threading.Event()  # the loading thread is in the gate
        self.loads_started = 0

    async def load(self, progress: Callable[[float], None]) -> Backend:
        self.loads_started += 1

        def gated(value: float) -> None:
            progress(value)
            if value > 0 and not self.gate.is_set():
                self.waiting.set()
                self.gate.wait(60)

        return await LlamaBackend.aload(self.settings, progress=gated, host_cache=self.host_cache())


def _source(path: Path, *, ctx: int = 1024, slots: int = 2, **settings: Any) -> GatedSource:
    return GatedSource(LlamaSettings(path, n_ctx=ctx, n_threads=THREADS, slots=slots, **settings))


@pytest.fixture(scope="module")
def model_copies(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, Path]:
    """The default GGUF under three names (hard links where the file system allows)."""
    directory = tmp_path_factory.mktemp("models")
    copies = {}
    for name in ("alpha", "beta", "gamma"):
        target = directory / f"{name}.gguf"
        try:
            os.link(model_path, target)
        except OSError:
            import shutil

            shutil.copyfile(model_path, target)
        copies[name] = target
    return copies


async def _serve(nursery: trio.Nursery, registry: ModelRegistry, **settings: Any) -> tuple[Server, str]:
    server = Server(registry, ServerSettings(host="127.0.0.1", port=0, shutdown_grace=0.0, **settings))
    binds = await nursery.start(server.run)
    await server.ready.wait()
    return server, binds[0]


def _load_over_or_aborted(registry: ModelRegistry, name: str) -> bool:
    """No load of ``name`` in flight, or the one in flight told to stop."""
    model = registry.snapshot().model(name)
    return not model.load_in_flight or model.load_aborted


def _load_with_no_waiter(registry: ModelRegistry, name: str) -> bool:
    """A load of ``name`` in flight that no request waits for (a preload)."""
    model = registry.snapshot().model(name)
    return model.load_in_flight and model.load_waiters == 0


async def _models(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    body = (await client.get("/v1/models")).json()
    return {m["id"]: m for m in body["data"]}


async def _complete(
    client: httpx.AsyncClient, model: str, prompt: str = "Once upon a time", **extra: Any
) -> Any:
    # (the end token banned: the token count never depends on which tokens a CPU draws)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {"1": -100},
        **extra,
    }
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[[str], httpx.AsyncClient]]:
    clients: list[httpx.AsyncClient] = []

    def make(url: str) -> httpx.AsyncClient:
        client = httpx.AsyncClient(base_url=url, timeout=120)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


async def test_models_load_on_demand_and_their_states_follow(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    alpha = _source(model_copies["alpha"])
    beta = _source(model_copies["beta"], ctx=512)  # another context
    registry = ModelRegistry(
        [ModelSpec(name="alpha", source=alpha), ModelSpec(name="beta", source=beta, aliases=("b",))]
    )
    server, url = await _serve(nursery, registry)
    client = client_for(url)
    models = await _models(client)
    assert {name: m["status"]["state"] for name, m in models.items()} == {
        "alpha": "unloaded",
        "beta": "unloaded",
        "b": "unloaded",
    }
    beta.gate.clear()
    async with trio.open_nursery() as requests:
        answers: list[Any] = []

        async def ask() -> None:
            answers.append(await _complete(client, "b"))

        requests.start_soon(ask)
        await trio.to_thread.run_sync(beta.waiting.wait, 30)
        loading = (await _models(client))["beta"]["status"]
        assert loading["state"] == "loading"
        assert 0 < loading["progress"] < 1
        router = (await client.get("/models")).json()["data"]
        assert [m["status"]["value"] for m in router] == ["unloaded", "loading"]
        beta.gate.set()
    assert answers[0]["model"] == "beta"  # the alias answers as the model
    models = await _models(client)
    assert models["beta"]["status"]["state"] == "loaded"
    assert models["beta"]["context_length"] == 512
    assert models["alpha"]["status"]["state"] == "unloaded"
    await _complete(client, "alpha")
    models = await _models(client)
    assert models["alpha"]["context_length"] == 1024
    assert {models["alpha"]["status"]["state"], models["beta"]["status"]["state"]} == {"loaded"}
    unloaded = await client.post("/models/unload", json={"model": "alpha"})
    assert unloaded.status_code == 200
    assert unloaded.json()["success"] is True
    assert (await _models(client))["alpha"]["status"]["state"] == "unloaded"
    loaded = await client.post("/models/load", json={"model": "alpha"})
    assert loaded.json()["status"]["state"] == "loaded"
    health = (await client.get("/health")).json()
    assert health["models"]["alpha"]["state"] == "loaded"
    assert health["models"]["beta"]["slots"] == 2
    metrics = (await client.get("/metrics")).text
    assert 'trioserve_model_state{model="alpha",state="loaded"} 1.0' in metrics
    assert 'trioserve_model_loads_total{model="alpha"} 2.0' in metrics
    missing = await client.post("/v1/completions", json={"model": "delta", "prompt": "x"})
    assert missing.status_code == 404
    assert "available: alpha, beta, b" in missing.json()["error"]["message"]
    server.shutdown()


async def test_fifty_requests_alternating_on_one_model_slot_all_complete(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    alpha, beta = _source(model_copies["alpha"]), _source(model_copies["beta"])
    registry = ModelRegistry(
        [ModelSpec(name="alpha", source=alpha), ModelSpec(name="beta", source=beta)], max_loaded=1
    )
    server, url = await _serve(nursery, registry)
    http = client_for(url)
    finishes: list[tuple[str, str | None, int]] = []
    loaded_at_once: list[int] = []

    async def watch_budget() -> None:
        while True:
            loaded_at_once.append(
                sum(e.state in ("loading", "loaded", "unloading") for e in registry.entries)
            )
            await registry.changed()

    async def one(index: int) -> None:
        # (httpx: the openai SDK's async stream leaves its generators open under Trio)
        model = ("alpha", "beta")[index % 2]
        body = {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
        }
        pieces, reason = [], None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    pieces.append(choice["text"])
                    reason = choice["finish_reason"] or reason
                    assert "end_cause" not in line  # not cut
        finishes.append((model, reason, len(pieces)))

    async with trio.open_nursery() as watcher:
        watcher.start_soon(watch_budget)
        limiter = trio.CapacityLimiter(4)  # several concurrent, in an alternating order

        async def limited(index: int) -> None:
            async with limiter:
                await one(index)

        async with trio.open_nursery() as clients:
            for index in range(50):
                clients.start_soon(limited, index)
                await trio.lowlevel.checkpoint()
        watcher.cancel_scope.cancel()
    assert len(finishes) == 50
    assert all(reason in ("length", "stop") for _, reason, _ in finishes), finishes
    assert max(loaded_at_once) == 1  # never two at once
    assert alpha.loads_started + beta.loads_started >= 3  # it did swap
    server.shutdown()


async def test_a_stream_on_a_makes_b_wait_and_never_ends_early(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    registry = ModelRegistry(
        [
            ModelSpec(name="alpha", source=_source(model_copies["alpha"])),
            ModelSpec(name="beta", source=_source(model_copies["beta"])),
        ],
        max_loaded=1,
    )
    server, url = await _serve(nursery, registry)
    client = client_for(url)
    await _complete(client, "alpha")  # alpha loaded
    alpha, beta = registry.entries
    body = {
        "model": "alpha",
        "prompt": "A long story:",
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    b_answer: list[Any] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        first = await anext(lines)
        assert first.startswith("data: ")
        async with trio.open_nursery() as others:

            async def ask_b() -> None:
                b_answer.append(await _complete(client, "beta"))

            others.start_soon(ask_b)
            # B's claim has marked A to go once it is idle, and waits: A streams on
            await wait_for(lambda: alpha.draining)
            assert beta.state == "unloaded"
            assert alpha.state == "loaded"
            events = [first] + [line async for line in lines if line.startswith("data: ")]
            assert beta.state != "loaded"  # (B waited for A's last byte)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("length", "stop")  # A ended on its own, not cut
    assert all("end_cause" not in c.get("trioserve", {}) for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert b_answer
    assert b_answer[0]["model"] == "beta"
    assert alpha.state == "unloaded"
    assert beta.state == "loaded"
    server.shutdown()


async def test_a_client_that_leaves_during_the_load_aborts_it(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    gamma = _source(model_copies["gamma"])
    registry = ModelRegistry([ModelSpec(name="gamma", source=gamma)])
    server, url = await _serve(nursery, registry)
    entry = registry.entries[0]
    before = LlamaBackend.loaded
    gamma.gate.clear()
    async with trio.open_nursery() as requests:
        requests.start_soon(_complete, client_for(url), "gamma")
        await trio.to_thread.run_sync(gamma.waiting.wait, 30)
        assert entry.state == "loading"
        requests.cancel_scope.cancel()  # the client leaves (its connection closes)
    await wait_for(lambda: registry.snapshot().model("gamma").load_aborted)
    gamma.gate.set()  # llama.cpp's callback now returns false
    await wait_for(lambda: entry.state != "loading", limit=30)
    assert entry.state == "unloaded"
    assert entry.error is None
    assert LlamaBackend.loaded == before  # nothing stayed allocated
    # a later request loads it for good
    answer = await _complete(client_for(url), "gamma")
    assert answer["usage"]["completion_tokens"] == 4
    server.shutdown()


async def test_two_clients_wait_for_one_load_and_one_leaves(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    gamma = _source(model_copies["gamma"])
    registry = ModelRegistry([ModelSpec(name="gamma", source=gamma)])
    server, url = await _serve(nursery, registry)
    entry = registry.entries[0]
    gamma.gate.clear()
    stayed: list[Any] = []
    async with trio.open_nursery() as requests:

        async def stays() -> None:
            stayed.append(await _complete(client_for(url), "gamma"))

        leaving = trio.CancelScope()

        async def leaves() -> None:
            with leaving:
                await _complete(client_for(url), "gamma")

        requests.start_soon(stays)
        requests.start_soon(leaves)
        await trio.to_thread.run_sync(gamma.waiting.wait, 30)
        await wait_for(lambda: registry.snapshot().model("gamma").load_waiters == 2)
        leaving.cancel()
        await wait_for(lambda: registry.snapshot().model("gamma").load_waiters == 1)
        gamma.gate.set()
    assert stayed[0]["usage"]["completion_tokens"] == 4
    assert gamma.loads_started == 1  # one load, shared
    assert entry.state == "loaded"
    server.shutdown()


async def test_an_unload_ends_running_streams_with_a_reason_after_the_grace(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    registry = ModelRegistry([ModelSpec(name="alpha", source=_source(model_copies["alpha"]))])
    server, url = await _serve(nursery, registry)
    client = client_for(url)
    await _complete(client, "alpha")
    body = {
        "model": "alpha",
        "prompt": "A story:",
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
        "logit_bias": {"1": -100},  # no end token: it runs until the unload
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        unload = await client.post("/models/unload", json={"model": "alpha", "grace_seconds": 0.2})
        assert unload.json()["status"]["state"] == "unloaded"
        events = [line async for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["trioserve"]["end_cause"] == "unload"
    server.shutdown()


async def test_a_conversation_comes_back_after_a_swap_from_the_host_tier_and_stays_exact(
    nursery: trio.Nursery,
    model_copies: dict[str, Path],
    client_for: Callable[[str], httpx.AsyncClient],
    uncached_backend: LlamaBackend,
) -> None:
    # idle recompute off on both sides, so "as if it had stayed" is one number
    def settings(path: Path) -> GatedSource:
        return _source(path, ctx=2048, slots=1, idle_recompute=False)

    swapped = ModelRegistry(
        [
            ModelSpec(name="alpha", source=settings(model_copies["alpha"])),
            ModelSpec(name="beta", source=settings(model_copies["beta"])),
        ],
        max_loaded=1,
    )
    stayed = ModelRegistry([ModelSpec(name="alpha", source=settings(model_copies["alpha"]))])
    system = "You are a careful assistant. " + " ".join(
        f"Rule {i}: answer briefly and exactly." for i in range(40)
    )
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]

    async def chat(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]]) -> Any:
        body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    results: dict[str, tuple[str, int, int]] = {}
    for label, registry in (("stayed", stayed), ("swapped", swapped)):
        server, url = await _serve(nursery, registry)
        client = client_for(url)
        first = await chat(client, "alpha", turn1)
        reply = first["choices"][0]["message"]["content"]
        if label == "swapped":
            await _complete(client, "beta")  # alpha is evicted (its cells saved to the host tier)
            assert registry.entries[0].state == "unloaded"
        turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Another one?"}]
        second = await chat(client, "alpha", turn2)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        if label == "swapped":  # the cells came back from host memory, not from KV cells
            metrics = (await client.get("/metrics")).text
            assert "\ntrioserve_prompt_cache_restores_total 1.0" in metrics
        results[label] = (
            second["choices"][0]["message"]["content"],
            cached,
            second["usage"]["prompt_tokens"],
        )
        server.shutdown()
        await server.stopped.wait()
    assert results["swapped"][1] == results["stayed"][1] > 128  # the cached prefix, as if it had stayed
    # and the text equals a fresh server's (the prompt cache off)
    async with trio.open_nursery() as fresh_nursery:
        from .._helpers import start_server

        fresh = await start_server(fresh_nursery, uncached_backend)
        async with fresh.client() as client:
            first = await chat(client, uncached_backend.info.id, turn1)
            reply = first["choices"][0]["message"]["content"]
            turn2 = [
                *turn1,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Another one?"},
            ]
            expected = (await chat(client, uncached_backend.info.id, turn2))["choices"][0]["message"][
                "content"
            ]
        fresh.server.shutdown()
    assert results["swapped"][0] == results["stayed"][0] == expected


LOAD_CAUSES = ["close", "non_stream_close", "deadline", "non_stream_deadline", "shutdown", "library", "by_id"]


@pytest.mark.parametrize("cause", LOAD_CAUSES)
async def test_cancel_cell_loading(
    cause: str,
    nursery: trio.Nursery,
    model_copies: dict[str, Path],
    client_for: Callable[[str], httpx.AsyncClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The cancellation matrix's "loading" phase: every cause that ends a request
    waiting for its model's load leaves nothing: the load it alone waited for is
    aborted in llama.cpp's progress callback, and nothing stays allocated."""
    caplog.set_level(logging.INFO, logger="trioserve.requests")
    gamma = _source(model_copies["gamma"])
    registry = ModelRegistry([ModelSpec(name="gamma", source=gamma)])
    server, url = await _serve(nursery, registry)
    entry = registry.entries[0]
    before = LlamaBackend.loaded
    gamma.gate.clear()
    responses: list[httpx.Response] = []
    stream = cause in ("close", "deadline", "shutdown", "by_id")
    headers = {"X-Request-Timeout": "1"} if "deadline" in cause else {}
    headers["X-Request-Id"] = "loading-victim"
    body = {"model": "gamma", "prompt": "Hi", "max_tokens": 4, "stream": stream}
    async with trio.open_nursery() as requests:
        if cause == "library":

            async def hold() -> None:
                async with registry.lease("gamma"):
                    raise AssertionError("the lease cannot be granted: its load is cancelled")

            requests.start_soon(hold)
        else:

            async def ask() -> None:
                responses.append(await client_for(url).post("/v1/completions", json=body, headers=headers))

            requests.start_soon(ask)
        await trio.to_thread.run_sync(gamma.waiting.wait, 30)
        assert entry.state == "loading"
        if cause in ("close", "non_stream_close", "library"):
            requests.cancel_scope.cancel()
        elif cause == "shutdown":
            server.shutdown()
        elif cause == "by_id":  # (POST /v1/requests/{id}/cancel, from another connection)
            answer = await client_for(url).post("/v1/requests/loading-victim/cancel")
            assert answer.status_code == 200, answer.text
            assert answer.json()["phase"] == "loading"
        # (a deadline passes by itself)
    await wait_for(lambda: _load_over_or_aborted(registry, "gamma"), limit=10)
    gamma.gate.set()
    await wait_for(lambda: entry.state != "loading", limit=30)
    assert entry.state == "unloaded"
    assert entry.error is None
    assert LlamaBackend.loaded == before
    if "deadline" in cause:
        assert responses[0].status_code == 504
        assert responses[0].json()["error"]["code"] == "deadline_exceeded"
    elif cause == "shutdown":
        assert responses[0].status_code == 503
    elif cause == "by_id":  # (nothing was sent before the model loaded)
        assert responses[0].status_code == 409
        assert responses[0].json()["error"]["code"] == "request_cancelled"
    if cause != "library":
        await wait_for(lambda: "/v1/completions model=gamma" in caplog.text)
        expected = {"close": "disconnect", "non_stream_close": "disconnect", "by_id": "cancelled"}.get(
            cause, cause.split("_")[-1]
        )
        assert f"cause={expected}" in caplog.text
    server.shutdown()


async def test_a_failed_load_names_the_file_and_the_cause_for_every_waiter(
    nursery: trio.Nursery,
    tmp_path: Path,
    model_copies: dict[str, Path],
    client_for: Callable[[str], httpx.AsyncClient],
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))  # a header, no model
    source = _source(broken)
    registry = ModelRegistry(
        [
            ModelSpec(name="alpha", source=_source(model_copies["alpha"])),
            ModelSpec(name="broken", source=source),
        ]
    )
    server, url = await _serve(nursery, registry)
    answers: list[httpx.Response] = []
    async with trio.open_nursery() as requests:
        for _ in range(2):

            async def ask() -> None:
                body = {"model": "broken", "prompt": "Hi", "max_tokens": 2}
                answers.append(await client_for(url).post("/v1/completions", json=body))

            requests.start_soon(ask)
    assert source.loads_started == 1  # the two waited for one load
    for answer in answers:
        assert answer.status_code == 503
        message = answer.json()["error"]["message"]
        assert str(broken) in message
        assert "unknown model architecture" in message  # llama.cpp's own reason
    router = (await client_for(url).get("/models")).json()["data"]
    assert router[1]["status"] == {"value": "unloaded", "failed": True, "error": registry.entries[1].error}
    # the other model is untouched
    assert (await _complete(client_for(url), "alpha"))["usage"]["completion_tokens"] == 4
    server.shutdown()


async def test_keep_alive_zero_unloads_the_model_after_the_request(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    registry = ModelRegistry([ModelSpec(name="alpha", source=_source(model_copies["alpha"]))])
    server, url = await _serve(nursery, registry)
    client = client_for(url)
    body = {"model": "alpha", "prompt": "Hi", "max_tokens": 2}
    response = await client.post("/v1/completions", json=body, headers={"X-Keep-Alive": "0"})
    assert response.status_code == 200
    await wait_for(lambda: registry.entries[0].state == "unloaded")
    # the header was that request's: the next one, without it, leaves the model loaded
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert registry.entries[0].state == "loaded"
    # no timer: the server's keep-alive is forever
    assert registry.snapshot().model("alpha").idle_deadline is None
    bad = await client.post("/v1/completions", json=body, headers={"X-Keep-Alive": "soon"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "keep_alive"
    response = await client.post("/v1/completions", json=body, headers={"X-Keep-Alive": "-1"})
    assert response.status_code == 200
    assert registry.entries[0].state == "loaded"  # and stays: no timer
    server.shutdown()


async def test_a_startup_load_is_not_aborted_when_a_waiter_leaves(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    alpha = _source(model_copies["alpha"])
    alpha.gate.clear()
    registry = ModelRegistry([ModelSpec(name="alpha", source=alpha, preload=True)])
    server = Server(registry, ServerSettings(host="127.0.0.1", port=0, shutdown_grace=0.0))
    url = (await nursery.start(server.run))[0]  # (not ready: its startup load is held)
    entry = registry.entries[0]
    await trio.to_thread.run_sync(alpha.waiting.wait, 30)
    async with trio.open_nursery() as requests:
        requests.start_soon(_complete, client_for(url), "alpha")
        await wait_for(lambda: registry.snapshot().model("alpha").load_waiters == 1)
        requests.cancel_scope.cancel()
    await wait_for(lambda: _load_with_no_waiter(registry, "alpha"))
    alpha.gate.set()
    await wait_for(lambda: entry.state != "loading", limit=30)
    assert entry.state == "loaded"  # the server's own load: nobody's leaving cancels it
    server.shutdown()


async def test_an_unload_before_the_response_started_is_a_503_that_says_so(
    nursery: trio.Nursery, model_copies: dict[str, Path], client_for: Callable[[str], httpx.AsyncClient]
) -> None:
    registry = ModelRegistry([ModelSpec(name="alpha", source=_source(model_copies["alpha"]))])
    server, url = await _serve(nursery, registry)
    client = client_for(url)
    await _complete(client, "alpha")
    entry = registry.entries[0]
    engine = entry.engine
    assert engine is not None
    await wait_for(lambda: entry.leases == 0 and engine.active_streams == 0)  # that one is over
    body = {"model": "alpha", "prompt": "A story:", "max_tokens": 1000, "logit_bias": {"1": -100}}
    answers: list[httpx.Response] = []
    async with trio.open_nursery() as requests:

        async def ask() -> None:
            answers.append(await client_for(url).post("/v1/completions", json=body))

        requests.start_soon(ask)
        await wait_for(lambda: engine.active_streams == 1)
        unload = await client.post("/models/unload", json={"model": "alpha", "grace_seconds": 0})
        assert unload.json()["status"]["state"] == "unloaded"
    assert answers[0].status_code == 503, answers[0].text
    assert answers[0].json()["error"]["code"] == "model_unloaded"
    server.shutdown()
