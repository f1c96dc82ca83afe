"""What strict clients rely on, on the real model: retry advice they obey, a batch of
prompts as OpenAI serves it, a stable ``created``, bounded metric labels, the text held
in ``auto`` tool mode delivered when a deadline cuts the stream, and a failed choice of
``n`` > 1 that the SDK raises on. (finish_reason's values and the error event: every
response the suite receives is validated by tests/_openai_validation.py.)"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio

from trioserve import BackendError, LlamaBackend

from .._helpers import RunningServer, start_server, wait_for

pytestmark = pytest.mark.model


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_retry_advice_follows_what_a_retry_can_do(llama_server: RunningServer) -> None:
    async with llama_server.client() as client:
        # the request's own deadline: a retry gets the same budget
        late = await client.post(
            "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 2000},
            headers={"X-Request-Timeout": "0.2"},
        )
        assert late.status_code == 504
        assert late.headers["x-should-retry"] == "false"
        # a bad request: the SDKs never retry a 400 anyway; no advice needed
        bad = await client.post("/v1/completions", json={"prompt": ""})
        assert bad.status_code == 400
        assert "x-should-retry" not in bad.headers


async def test_the_sdk_does_not_retry_what_cannot_succeed(llama_server: RunningServer) -> None:
    import httpx

    model = llama_server.engine.backend.info.id
    attempts: list[object] = []

    def with_the_sdk() -> None:
        with (
            httpx.Client(event_hooks={"request": [attempts.append]}) as http,
            openai.OpenAI(
                base_url=llama_server.url + "/v1", api_key="x", max_retries=2, http_client=http
            ) as client,
            pytest.raises(openai.InternalServerError) as info,
        ):
            client.completions.create(
                model=model,
                prompt="Once upon a time",
                max_tokens=2000,
                extra_headers={"X-Request-Timeout": "0.2"},
            )
        assert info.value.status_code == 504

    await trio.to_thread.run_sync(with_the_sdk)
    assert len(attempts) == 1  # x-should-retry: false — without it, 3 attempts


async def test_a_batch_of_prompts_gets_one_choice_each(
    batched_backend: LlamaBackend, nursery: trio.Nursery
) -> None:
    running = await start_server(nursery, batched_backend)
    m = running.engine.backend.info.id
    prompts = ["The capital of France is", "Water boils at"]

    def with_the_sdk() -> None:
        # (the sync client, in a thread: the async one leaves its SSE generators to the
        # garbage collector under Trio)
        with openai.OpenAI(base_url=running.url + "/v1", api_key="x") as client:
            batch = client.completions.create(model=m, prompt=prompts, max_tokens=6, temperature=0)
            assert [c.index for c in batch.choices] == [0, 1]
            singles = [
                client.completions.create(model=m, prompt=p, max_tokens=6, temperature=0).choices[0].text
                for p in prompts
            ]
            # each choice is its own prompt's (batch and single runs: the same greedy text)
            assert [c.text for c in batch.choices] == singles
            alone = [client.completions.create(model=m, prompt=p, max_tokens=1).usage for p in prompts]
            assert batch.usage is not None
            assert batch.usage.prompt_tokens == sum(u.prompt_tokens for u in alone if u is not None)
            # streamed: chunks carry each prompt's index
            texts = ["", ""]
            for chunk in client.completions.create(
                model=m, prompt=prompts, max_tokens=6, temperature=0, stream=True
            ):
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
            assert texts == singles
            # more prompts × n than slots: refused, naming the prompt
            with pytest.raises(openai.BadRequestError, match="needs 4 slots at once") as refused:
                client.completions.create(model=m, prompt=prompts, n=2, max_tokens=2)
            assert refused.value.param == "prompt"

    await trio.to_thread.run_sync(with_the_sdk)
    running.server.shutdown()


async def test_models_created_is_the_load_time(llama_server: RunningServer) -> None:
    async with llama_server.client() as client:
        first = (await client.get("/v1/models")).json()["data"][0]["created"]
        await trio.sleep(1.1)
        second = (await client.get("/v1/models")).json()["data"][0]
        one = (await client.get(f"/v1/models/{second['id']}")).json()
    assert first == second["created"] == one["created"]


async def test_metric_labels_are_the_endpoints_not_the_raw_paths(llama_server: RunningServer) -> None:
    async with llama_server.client() as client:
        for path in ("/v1/completions//", "/v1/completions/", "/v1/completions"):
            response = await client.post(path, json={"prompt": "hi", "max_tokens": 1})
            assert response.status_code == 200
        metrics = (await client.get("/metrics")).text
    endpoints = {
        line.split('endpoint="')[1].split('"')[0]
        for line in metrics.splitlines()
        if line.startswith("trioserve_requests_total{")
    }
    assert endpoints == {"/v1/completions"}


#: a JSON object that cannot end before the deadline (1,000 items at least)
_LONG_OBJECT = {
    "type": "json_schema",
    "json_schema": {
        "name": "long",
        "schema": {
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 1000}},
            "required": ["items"],
        },
    },
}
_TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


async def test_a_deadline_delivers_the_text_held_in_auto_tool_mode(llama_server: RunningServer) -> None:
    """In ``auto`` mode, text that may still become a call (it starts with ``{``) is held;
    a deadline that cuts the stream must send it as content before the finish chunk."""
    body = {
        "messages": [{"role": "user", "content": "Give me a list."}],
        "tools": [_TOOL],
        "response_format": _LONG_OBJECT,
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
    }
    engine = llama_server.engine
    async with llama_server.client() as client, trio.open_nursery() as nursery:
        result: dict[str, str] = {}

        async def run() -> None:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                result["text"] = (await response.aread()).decode()

        nursery.start_soon(run)
        # the model has written at least 12 tokens, all held (they may be a call)
        await wait_for(lambda: any(s.progress.completion_tokens >= 12 for s in engine.streams), limit=60)
        (request,) = llama_server.server.state.requests
        request.cancel_scope.deadline = trio.current_time()  # the deadline passes now
    events = _events(result["text"])
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    content = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert content.startswith('{"items":'), content[:80]
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["trioserve"]["end_cause"] == "deadline"


async def test_a_failed_choice_fails_the_response_for_the_sdk(
    batched_backend: LlamaBackend, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``n`` = 2, the second choice's inference fails mid-stream: the stream ends with an
    error event, which the openai SDK raises (not a short answer that looks complete)."""
    running = await start_server(nursery, batched_backend)
    real = batched_backend.generate
    calls = []

    async def generate(prompt: Any, channel: Any, progress: Any) -> Any:
        calls.append(prompt.choice)
        if prompt.choice == 1:
            await trio.lowlevel.checkpoint()
            raise BackendError("choice 1 broke off")
        return await real(prompt, channel, progress)

    monkeypatch.setattr(batched_backend, "generate", generate)
    m = running.engine.backend.info.id

    def with_the_sdk() -> None:
        with openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0) as client:
            stream = client.chat.completions.create(
                model=m, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=50, stream=True
            )
            with pytest.raises(openai.APIError, match="choice 1 broke off"):
                for _ in stream:
                    pass

    await trio.to_thread.run_sync(with_the_sdk)
    assert sorted(calls) == [0, 1]
    await running.wait_idle()
    running.server.shutdown()
