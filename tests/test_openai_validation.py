"""The validation layer every generation response goes through (tests/_openai_validation.py)
can fail, and the streaming-error contract it pins: openai-python raises on an SSE error
object."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice

from trioserve.testing import open_test_server

from . import _openai_validation as validation
from ._helpers import ServerProcess

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"
ERROR_STREAM = b'data: {"error": {"message": "x", "type": "server_error"}}\n\ndata: [DONE]\n\n'


def chunk(
    content: str | None = "hi", finish_reason: str | None = None, index: int = 0, **fields: object
) -> dict:
    delta = {"content": content} if content is not None else {}
    body: dict[str, object] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    body.update(fields)
    return body


def text_chunk(text: str = "hi", finish_reason: str | None = None) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def sse(*events: dict | bytes) -> bytes:
    return b"".join(
        b"data: " + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n\n"
        for event in events
    )


def check(
    body: bytes | list[bytes], kind: validation.Kind = "chat", headers: list = SSE_HEADERS, status: int = 200
) -> list[validation.Violation]:
    """The violations of one response whose body is ``body`` (a list: one send each)."""
    response = validation.ResponseCheck(kind, "test", lambda violation: None)
    response.observe({"type": "http.response.start", "status": status, "headers": headers})
    parts = body if isinstance(body, list) else [body]
    for i, part in enumerate(parts):
        response.observe({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})
    return response.violations


def event_problems(violations: list[validation.Violation], number: int) -> list[str]:
    return [v.problem for v in violations if v.problem.startswith(f"event {number}:")]


# --- which events are flagged ---------------------------------------------------------


def test_the_literals_are_read_from_the_types() -> None:
    assert "stop" in validation.declared_literals(ChunkChoice, "finish_reason")
    assert None in validation.declared_literals(ChunkChoice, "finish_reason")
    assert "deadline" not in validation.declared_literals(ChunkChoice, "finish_reason")
    assert validation.declared_literals(ChatCompletionChunk, "object") == ("chat.completion.chunk",)
    assert validation.declared_literals(Completion, "object") == ("text_completion",)
    # the legacy stream: the same values, and null before the last chunk
    stream_choice = validation.CompletionStreamChunk.model_fields["choices"].annotation.__args__[0]
    assert validation.declared_literals(stream_choice, "finish_reason") == (
        *validation.declared_literals(CompletionChoice, "finish_reason"),
        None,
    )


def test_a_stream_flags_the_bad_chunks_and_only_them() -> None:
    good = chunk("hi")
    deadline = chunk(None, "deadline", index=1)
    missing = chunk("x", index=2)
    del missing["created"]
    error = {"error": {"message": "x", "type": "server_error"}}
    violations = check(sse(good, deadline, missing, error) + DONE)

    assert event_problems(violations, 1) == []
    (finish,) = event_problems(violations, 2)  # one violation per event, its problems inside
    assert "choices[0].finish_reason is 'deadline'" in finish
    for allowed in validation.declared_literals(ChunkChoice, "finish_reason"):
        if allowed is not None:
            assert repr(allowed) in finish  # the message says what the type allows
    assert "model_validate" in finish  # pydantic agrees
    (missing_problem,) = event_problems(violations, 3)
    assert "created" in missing_problem
    assert "Field required" in missing_problem
    assert event_problems(violations, 4) == []  # the error event is the mid-stream failure form
    # (nothing else: an error ends the stream, so unfinished choices are no violation)
    assert [v.problem.split(":")[0] for v in violations] == ["event 2", "event 3"]
    assert [v.data for v in violations] == [sse(deadline).rstrip(b"\n"), sse(missing).rstrip(b"\n")]


@pytest.mark.parametrize(
    ("event", "flagged"),
    [
        (text_chunk(), None),
        (text_chunk("", "stop"), None),
        (text_chunk("", "shutdown"), "finish_reason is 'shutdown'"),
        (text_chunk("", "error"), "finish_reason is 'error'"),
        ({**text_chunk(), "object": "text_completion.chunk"}, "object is 'text_completion.chunk'"),
        ({**text_chunk(), "choices": [{"index": 0, "text": "x"}]}, "finish_reason"),
    ],
)
def test_completions_stream_events(event: dict, flagged: str | None) -> None:
    problems = event_problems(check(sse(event) + DONE, "text"), 1)
    if flagged is None:
        assert problems == []
    else:
        assert problems
        assert flagged in problems[0]


@pytest.mark.parametrize(
    ("error", "flagged"),
    [
        ({"message": "x", "type": "server_error"}, False),
        ({"message": "inference failed", "type": "server_error", "code": "backend_error"}, False),
        ({"type": "server_error"}, True),
        ({"message": "", "type": "server_error"}, True),
        ("just a string", True),
    ],
)
def test_an_error_event_needs_a_message(error: object, flagged: bool) -> None:
    violations = check(sse(chunk("hi"), {"error": error}) + DONE)
    assert bool(violations) is flagged
    if flagged:
        assert "without a message" in violations[0].problem


def test_the_stream_as_a_whole() -> None:
    finished = [chunk("hi"), chunk(None, "stop")]
    assert check(sse(*finished) + DONE) == []
    assert [v.problem for v in check(sse(*finished))] == ["the stream ended without data: [DONE]"]
    assert "after data: [DONE]" in check(sse(*finished) + DONE + sse(chunk("more")))[0].problem
    after_error = check(sse({"error": {"message": "x"}}, chunk("more")) + DONE)
    assert "follows an error event" in after_error[0].problem
    assert "never got a finish_reason" in check(sse(chunk("hi")) + DONE)[0].problem
    assert "after its finish_reason" in check(sse(chunk(None, "stop"), chunk("late")) + DONE)[0].problem
    assert "event name" in check(b"event: error\n" + sse({"error": {"message": "x"}}) + DONE)[0].problem
    assert "inside an event" in check(sse(*finished) + DONE + b"data: {")[0].problem
    # n = 2: each choice finishes on its own; usage last, with no choices
    two = [chunk("a"), chunk("b", index=1), chunk(None, "length"), chunk(None, "stop", index=1)]
    usage = {
        **chunk(),
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    assert check(sse(*two, usage) + DONE) == []


def test_events_split_anywhere_read_the_same() -> None:
    body = b": ping\r\n\r\n" + sse(chunk("h\u00e9"), chunk(None, "stop")).replace(b"\n", b"\r\n") + DONE
    assert check(body) == []
    assert check([body[i : i + 1] for i in range(len(body))]) == []
    bad = sse(chunk(None, "deadline")) + DONE
    assert len(check([bad[i : i + 1] for i in range(len(bad))])) == len(check(bad)) > 0


def test_non_streamed_bodies() -> None:
    good = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    assert check(json.dumps(good).encode(), headers=JSON_HEADERS) == []
    good["choices"][0]["finish_reason"] = "deadline"  # type: ignore[index]
    (problem, *_) = [v.problem for v in check(json.dumps(good).encode(), headers=JSON_HEADERS)]
    assert "finish_reason is 'deadline'" in problem
    assert "deadline" not in validation.declared_literals(ChatChoice, "finish_reason")
    assert "deadline" not in validation.declared_literals(CompletionChoice, "finish_reason")
    assert "not JSON" in check(b"{", headers=JSON_HEADERS)[0].problem
    text = {**text_chunk("hi", "length"), "usage": good["usage"]}
    assert check(json.dumps(text).encode(), "text", JSON_HEADERS) == []
    # refusals are not generation responses: not checked here
    assert check(b'{"error": {"message": "no"}}', headers=JSON_HEADERS, status=400) == []
    assert "Content-Type 'text/plain'" in check(b"hi", headers=[(b"content-type", b"text/plain")])[0].problem


# --- the contract with openai-python --------------------------------------------------


def _sdk(body: bytes) -> openai.OpenAI:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    http = httpx.Client(transport=httpx.MockTransport(answer))
    return openai.OpenAI(
        base_url="http://trioserve.test/v1", api_key="unused", http_client=http, max_retries=0
    )


def test_openai_python_raises_on_an_error_event_mid_stream() -> None:
    assert check(sse(chunk("hi")) + ERROR_STREAM) == []  # the layer accepts the form
    with _sdk(sse(chunk("hi")) + ERROR_STREAM) as sdk:
        stream = sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        events = iter(stream)
        assert next(events).choices[0].delta.content == "hi"  # what came before
        with pytest.raises(openai.APIError, match=r"^x$") as raised:
            next(events)
        assert raised.value.body == {"message": "x", "type": "server_error"}
    with _sdk(ERROR_STREAM) as sdk, pytest.raises(openai.APIError, match=r"^x$"):
        list(sdk.completions.create(model="m", prompt="hi", stream=True))


def test_openai_python_alone_accepts_what_the_layer_flags() -> None:
    """Why the layer exists: the SDK builds chunks without validating them, so a
    non-OpenAI finish_reason or a truncated stream goes unnoticed by its users."""
    for body in (sse(chunk(None, "deadline")) + DONE, sse(chunk("hi"))):
        assert check(body)
        with _sdk(body) as sdk:
            chunks = list(
                sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], stream=True
                )
            )
        assert len(chunks) == 1


# --- the seams: every response the tests receive goes through the layer ---------------


async def test_a_wrapped_app_reports_what_it_sends_and_changes_nothing() -> None:
    seen: list[validation.Violation] = []
    done: list[validation.ResponseCheck] = []
    body = sse(chunk("hi"), chunk(None, "deadline")) + DONE

    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})  # type: ignore[operator]
        for part in (body[:10], body[10:]):
            await send({"type": "http.response.body", "body": part, "more_body": True})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"", "more_body": False})  # type: ignore[operator]

    wrapped = validation.validating_app(app, seen.append, done.append)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(wrapped), base_url="http://t") as client:  # type: ignore[arg-type]
        response = await client.post("/v1/chat/completions", json={})
        assert response.content == body
        await client.post("/v1/embeddings", json={})  # not a generation path: not checked
    assert len(done) == 1
    assert [v.problem.split(":")[0] for v in seen] == ["event 2"]
    assert "x-request-id" not in seen[0].where
    assert seen[0].where.startswith("POST /v1/chat/completions")


async def test_in_process_servers_are_checked(openai_validation_collector: validation.Collector) -> None:
    before = openai_validation_collector.responses
    async with (
        open_test_server(script=[b"Hello", b" world"]) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        assert (await client.get("/health")).status_code == 200
        for path, body in [
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ]:
            assert (await client.post(path, json=body)).status_code == 200
            assert (await client.post(path, json={**body, "stream": True})).status_code == 200
    assert openai_validation_collector.responses - before == 4
    assert openai_validation_collector.violations == []


def test_server_processes_are_checked(openai_validation_collector: validation.Collector) -> None:
    before = openai_validation_collector.responses
    with ServerProcess("--scripted", "--scripted-interval", "0") as server:
        url = server.wait_ready()
        with httpx.Client(base_url=url, timeout=30) as client:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert client.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200
    assert openai_validation_collector.responses - before == 2
    assert openai_validation_collector.violations == []


def test_a_process_log_is_read_on_from_where_it_stopped(tmp_path: Path) -> None:
    path = tmp_path / "checks.jsonl"
    log = validation.ProcessLog(path)
    assert log.drain() == (0, [])
    violation = validation.Violation("POST /v1/completions", "bad", b"data: \xff\n\n")
    with path.open("w") as out:
        out.write(json.dumps({"violation": violation.to_json()}) + "\n")
        out.write(json.dumps({"response": "POST /v1/completions"}) + "\n")
        out.write('{"response": "half a li')
    assert log.drain() == (1, [violation])
    with path.open("a") as out:
        out.write('ne"}\n')
    assert log.drain() == (1, [])


@pytest.mark.no_openai_validation("shows that the marker lets a test receive a flagged response")
def test_the_marker_opts_out(openai_validation_collector: validation.Collector) -> None:
    assert openai_validation_collector.exempt
    openai_validation_collector.report(validation.Violation("here", "flagged on purpose", b""))
    assert openai_validation_collector.failure() is None


def test_a_collector_fails_with_the_bytes() -> None:
    collector = validation.Collector("t")
    collector.report(validation.Violation("POST /v1/completions", "finish_reason is 'deadline'", b"data: {}"))
    failure = collector.failure()
    assert failure is not None
    assert "finish_reason is 'deadline'" in failure
    assert "b'data: {}'" in failure
    assert validation.MARKER in failure
