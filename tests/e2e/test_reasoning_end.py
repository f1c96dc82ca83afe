"""Ending a running request's reasoning (docs/dialects.md, "Ending the reasoning"):
llama-server's ``POST /v1/chat/completions/control {"id", "action": "reasoning_end"}``
and trioserve's ``POST /v1/requests/{id}/control``, on a real socket. The scripted
backend plays a reasoning model (its chat template opens ``<think>``; its script
reasons for 100,000 pieces, then closes and answers "Four."): a request answers
"Four." soon only if the control ended its reasoning. Every event is checked against
the dialect's official types (``tests/_openai_validation.py``); the SDKs read them.
The real scheduler's forced tokens: ``test_reasoning_end_llama.py``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from trioserve import ScriptedBackend

from .._helpers import RawStream, RunningServer, start_server, wait_for

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
)
#: a model that would think for a very long time, then answer
THINKING = [b"Let me think.", *[b" Still thinking."] * 100_000, b"</thi", b"nk>", b"\n\n", b"Four", b"."]
#: one that ends its reasoning itself at once, then answers at length
ANSWERING = [b"Quick.", b"</think>", b"\n\n", *[b" word"] * 100_000]
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "2+2?"}]}
NO_COMPLETION = "no active completion for this id"
KEY, OTHER, ADMIN = "key-a", "key-b", "key-admin"
#: a test that fails waits this long at most (the script's reasoning lasts minutes)
LIMIT = 30


def _backend(script: list[bytes], slots: int = 2) -> ScriptedBackend:
    return ScriptedBackend(script, chat_template=TEMPLATE, token_interval=0.001, slots=slots)


@pytest.fixture
async def server(nursery: trio.Nursery) -> AsyncIterator[RunningServer]:
    running = await start_server(nursery, _backend(THINKING), close_backend=True)
    yield running
    running.server.shutdown()


def _control(http: httpx.Client, completion: str) -> dict[str, Any]:
    answer = http.post("/v1/chat/completions/control", json={"id": completion, "action": "reasoning_end"})
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    body: dict[str, Any] = answer.json()
    return body


async def _chat_stream(
    client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed chat completion."""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def test_chat_stream_by_its_completion_id(server: RunningServer) -> None:
    """The llama-server route with the id the chunks carry; two asks at once write one
    marker (the second finds it being written, or written)."""

    def run() -> tuple[str, str, str | None, list[dict[str, Any]]]:
        reasoning, content, finish, answers = "", "", None, []
        with (
            openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as sdk,
            httpx.Client(base_url=server.url, timeout=LIMIT) as http,
            sdk.chat.completions.create(**CHAT, stream=True) as chunks,  # type: ignore[call-overload]
        ):
            for chunk in chunks:
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
                if reasoning and not answers:
                    answers = [_control(http, chunk.id), _control(http, chunk.id)]
        return reasoning, content, finish, answers

    with trio.fail_after(LIMIT):
        reasoning, content, finish, answers = await trio.to_thread.run_sync(run)
    assert answers[0] == {"success": True}
    assert answers[1] in ({"success": True}, {"success": False, "message": "reasoning already ended"})
    assert reasoning.startswith("Let me think.")
    assert "<" not in reasoning  # (one marker: the block closed once, the rest is the answer)
    assert (content, finish) == ("Four.", "stop")


async def test_messages_stream_thinking_block_closes(server: RunningServer) -> None:
    """Anthropic's stream: the llama-server route with the message's ``msg_`` id; the
    thinking block closes (its signature, ``content_block_stop``) and the text follows."""
    request: dict[str, Any] = {**CHAT, "max_tokens": 1000}
    answers = []
    with trio.fail_after(LIMIT):
        async with (
            anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0) as sdk,
            server.client() as http,
            sdk.messages.stream(**request) as stream,
        ):
            message_id = ""
            async for event in stream:
                if event.type == "message_start":
                    message_id = event.message.id
                if event.type == "thinking" and not answers:
                    control = {"id": message_id, "action": "reasoning_end"}
                    answers.append((await http.post("/v1/chat/completions/control", json=control)).json())
            message = await stream.get_final_message()
    assert message_id.startswith("msg_")
    assert answers == [{"success": True}]
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.startswith("Let me think.")  # type: ignore[union-attr]
    assert "<" not in message.content[0].thinking  # type: ignore[union-attr]
    assert message.content[1].text == "Four."  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"


async def test_responses_stream_by_response_id(server: RunningServer) -> None:
    """Responses: the llama-server route with the response's ``resp_`` id; the
    reasoning item is done, the message follows."""

    def run() -> tuple[Any, list[dict[str, Any]]]:
        answers: list[dict[str, Any]] = []
        with (
            openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as sdk,
            httpx.Client(base_url=server.url, timeout=LIMIT) as http,
            sdk.responses.stream(model="scripted", input="2+2?") as stream,
        ):
            response_id = ""
            for event in stream:
                if event.type == "response.created":
                    response_id = event.response.id
                if event.type == "response.reasoning_text.delta" and not answers:
                    answers.append(_control(http, response_id))
            return stream.get_final_response(), answers

    with trio.fail_after(LIMIT):
        response, answers = await trio.to_thread.run_sync(run)
    assert response.id.startswith("resp_")
    assert answers == [{"success": True}]
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text.startswith("Let me think.")
    assert "<" not in response.output[0].content[0].text
    assert response.output_text == "Four."


async def test_non_streamed_choices_by_request_id(server: RunningServer) -> None:
    """A non-streamed chat of ``n`` = 2: every choice still reasoning is forced; the
    body has each one's reasoning and answer."""
    async with server.client() as client:
        body: dict[str, Any] = {}

        async def ask() -> None:
            response = await client.post(
                "/v1/chat/completions", json={**CHAT, "n": 2}, headers={"X-Request-Id": "quiet"}
            )
            body.update(response.json())

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                engine = server.engine
                await wait_for(
                    lambda: (
                        len(engine.streams) == 2 and all(s.progress.completion_tokens for s in engine.streams)
                    )
                )
                answer = await client.post("/v1/requests/quiet/control", json={"action": "reasoning_end"})
                assert answer.json() == {"success": True}
    for choice in body["choices"]:
        assert choice["message"]["reasoning_content"].startswith("Let me think.")
        assert choice["message"]["content"] == "Four."
        assert choice["finish_reason"] == "stop"


async def test_asked_while_queued_ends_it_from_its_first_token(nursery: trio.Nursery) -> None:
    """An ask while the request waits for a slot holds: it starts answering (an empty
    reasoning, no ``reasoning_content``)."""
    server = await start_server(nursery, _backend(THINKING, slots=1), close_backend=True)
    holder = await RawStream.post(
        server.url, "/v1/chat/completions", {**CHAT, "stream": True}, {"X-Request-Id": "holder"}
    )
    try:
        await holder.read_until(b"data: ", 2)
        async with server.client() as client:
            reasoning, content = "", ""

            async def queued() -> None:
                nonlocal reasoning, content
                async for chunk in _chat_stream(client, {**CHAT, "stream": True}, {"X-Request-Id": "waiter"}):
                    delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""

            with trio.fail_after(LIMIT):
                async with trio.open_nursery() as inner:
                    inner.start_soon(queued)
                    admission = server.engine.admission
                    await wait_for(lambda: admission.queued == 1)
                    listed = (await client.get("/v1/requests")).json()["data"]
                    assert {r["id"]: r["phase"] for r in listed}["waiter"] == "queued"
                    answer = await client.post(
                        "/v1/requests/waiter/control", json={"action": "reasoning_end"}
                    )
                    assert answer.json() == {"success": True}
                    assert (await client.post("/v1/requests/holder/cancel")).json()["cancelled"]
        assert (reasoning, content) == ("", "Four.")
    finally:
        await holder.aclose()
        server.server.shutdown()


async def test_refusals_in_llama_servers_shapes(server: RunningServer) -> None:
    """The bodies a control refuses (400, naming the field, llama-server's messages)
    and the asks it answers ``success: false`` (200)."""
    async with server.client() as client:
        post = client.post
        route = "/v1/chat/completions/control"
        unknown = await post(route, json={"id": "nope", "action": "reasoning_end"})
        assert (unknown.status_code, unknown.json()) == (200, {"success": False, "message": NO_COMPLETION})
        by_id = await post("/v1/requests/nope/control", json={"action": "reasoning_end"})
        assert (by_id.status_code, by_id.json()) == (200, {"success": False, "message": NO_COMPLETION})
        for path, body, param, message in (
            (route, {"id": "x", "action": "stop"}, "action", "unknown control action"),
            (route, {"id": "x"}, "action", "unknown control action"),
            (route, {"action": "reasoning_end"}, "id", "missing completion id"),
            (route, {"id": "", "action": "reasoning_end"}, "id", "missing completion id"),
            (route, {"id": 5, "action": "reasoning_end"}, "id", None),
            ("/v1/requests/x/control", {"action": "pause"}, "action", "unknown control action"),
        ):
            refused = await post(path, json=body)
            assert refused.status_code == 400, (body, refused.text)
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == param
            if message is not None:
                assert error["message"] == message
        garbled = await post(route, content=b"{not json", headers={"content-type": "application/json"})
        assert garbled.status_code == 400
        # llama-server's field, in each dialect: a boolean
        for path, body in (
            ("/v1/chat/completions", {**CHAT}),
            ("/v1/messages", {**CHAT, "max_tokens": 5}),
            ("/v1/responses", {"model": "scripted", "input": "2+2?"}),
            ("/v1/completions", {"model": "scripted", "prompt": "2+2?"}),
        ):
            refused = await post(path, json={**body, "reasoning_control": "yes"})
            assert refused.status_code == 400, path
            assert "reasoning_control" in refused.text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({**CHAT, "reasoning_control": False}, "reasoning control not enabled for this completion"),
        # (a raw prompt: no reasoning markers)
        ({"model": "scripted", "prompt": "2+2?", "max_tokens": 2000}, "this completion is not reasoning"),
    ],
    ids=["reasoning_control-false", "completions"],
)
async def test_a_request_it_cannot_end(server: RunningServer, body: dict[str, Any], message: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    stream = await RawStream.post(server.url, path, {**body, "stream": True}, {"X-Request-Id": "r"})
    try:
        await stream.read_until(b"data: ", 2)
        async with server.client() as client:
            answer = (await client.post("/v1/requests/r/control", json={"action": "reasoning_end"})).json()
        assert answer["success"] is False
        assert answer["message"].startswith(message)
    finally:
        await stream.aclose()


async def test_after_the_model_ended_it(nursery: trio.Nursery) -> None:
    """Once the model wrote its own marker the control writes none (one marker)."""
    server = await start_server(nursery, _backend(ANSWERING), close_backend=True)
    try:
        async with server.client() as client:
            reasoning, content, answer = "", "", None
            with trio.fail_after(LIMIT):
                async for chunk in _chat_stream(client, {**CHAT, "stream": True, "max_tokens": 40}):
                    delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                    reasoning += delta.get("reasoning_content") or ""
                    content += delta.get("content") or ""
                    if content and answer is None:
                        control = {"id": chunk["id"], "action": "reasoning_end"}
                        answer = (await client.post("/v1/chat/completions/control", json=control)).json()
        assert answer == {"success": False, "message": "reasoning already ended"}
        assert (reasoning, content) == ("Quick.", "word" + " word" * 36)
    finally:
        server.server.shutdown()


async def test_owners(nursery: trio.Nursery) -> None:
    """Another key's requests do not exist for a control (by either id); an admin key
    reaches anyone's."""
    server = await start_server(
        nursery, _backend(THINKING), close_backend=True, api_keys=(KEY, OTHER), admin_keys=(ADMIN,)
    )

    def client(key: str) -> httpx.AsyncClient:
        return server.client(headers={"authorization": f"Bearer {key}"})

    try:
        async with client(KEY) as mine, client(OTHER) as theirs, client(ADMIN) as admin:
            content, answers = "", []
            with trio.fail_after(LIMIT):
                async for chunk in _chat_stream(mine, {**CHAT, "stream": True}, {"X-Request-Id": "mine"}):
                    delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                    content += delta.get("content") or ""
                    if delta.get("reasoning_content") and not answers:
                        completion = chunk["id"]
                        for ask in (
                            theirs.post(
                                "/v1/chat/completions/control",
                                json={"id": completion, "action": "reasoning_end"},
                            ),
                            theirs.post(
                                "/v1/chat/completions/control", json={"id": "mine", "action": "reasoning_end"}
                            ),
                            theirs.post("/v1/requests/mine/control", json={"action": "reasoning_end"}),
                            admin.post(
                                "/v1/chat/completions/control",
                                json={"id": completion, "action": "reasoning_end"},
                            ),
                        ):
                            answers.append((await ask).json())
            async with server.client() as nobody:
                anonymous = await nobody.post("/v1/requests/mine/control", json={"action": "reasoning_end"})
        assert anonymous.status_code == 401
        assert answers == [{"success": False, "message": NO_COMPLETION}] * 3 + [{"success": True}]
        assert content == "Four."
    finally:
        server.server.shutdown()
