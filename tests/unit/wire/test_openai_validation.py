"""The validation layer every generation response goes through (tests/_openai_validation.py)
can fail, and the streaming-error contract it pins: openai-python raises on an SSE error
object."""

from __future__ import annotations

import base64
import copy
import json
import struct
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletionChunk
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice

from trioserve._core._exceptions import BackendError
from trioserve._core._types import Usage
from trioserve._wire._anthropic_writer import AnthropicDialect
from trioserve._wire._responses import decode_responses_request
from trioserve._wire._responses_writer import ResponsesDialect
from trioserve.testing import open_test_server

from ... import _openai_validation as validation
from ..._helpers import ServerProcess

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


def test_embeddings_bodies() -> None:
    """``/v1/embeddings``: its 200 body is the openai SDK's ``CreateEmbeddingResponse``;
    it is never a stream."""
    good = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
        "model": "m",
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    assert check(json.dumps(good).encode(), "embeddings", JSON_HEADERS) == []
    bad = {**good, "data": [{"object": "vector", "index": 0, "embedding": [0.6, 0.8]}]}
    (problem, *_) = [v.problem for v in check(json.dumps(bad).encode(), "embeddings", JSON_HEADERS)]
    assert "'vector'" in problem
    missing = {key: value for key, value in good.items() if key != "usage"}
    assert check(json.dumps(missing).encode(), "embeddings", JSON_HEADERS)
    assert "server-sent events" in check(b"data: {}\n\n", "embeddings")[0].problem
    packed = base64.b64encode(struct.pack("<2f", 0.6, 0.8)).decode()  # encoding_format base64
    as_base64 = {**good, "data": [{"object": "embedding", "index": 0, "embedding": packed}]}
    assert check(json.dumps(as_base64).encode(), "embeddings", JSON_HEADERS) == []
    broken = {**good, "data": [{"object": "embedding", "index": 0, "embedding": "AAA"}]}
    assert check(json.dumps(broken).encode(), "embeddings", JSON_HEADERS)


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
        await client.post("/v1/tokenize", json={})  # not a generation path: not checked
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
            ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}),
            ("/v1/responses", {"input": "x"}),
        ]:
            assert (await client.post(path, json=body)).status_code == 200
            assert (await client.post(path, json={**body, "stream": True})).status_code == 200
        # an Anthropic refusal is checked too (its error shape)
        assert (await client.post("/v1/messages", json={"messages": []})).status_code == 400
    assert openai_validation_collector.responses - before == 9
    assert openai_validation_collector.violations == []


def test_server_processes_are_checked(openai_validation_collector: validation.Collector) -> None:
    before = openai_validation_collector.responses
    with ServerProcess("--scripted", "--scripted-interval", "0") as server:
        url = server.wait_ready()
        with httpx.Client(base_url=url, timeout=30) as client:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert client.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200
            assert client.post("/v1/messages", json={**body, "stream": True}).status_code == 200
            assert client.post("/v1/responses", json={"input": "x", "stream": True}).status_code == 200
    assert openai_validation_collector.responses - before == 4
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


# --- Anthropic Messages ---------------------------------------------------------------


def named_sse(*events: dict | tuple[str | None, dict] | bytes) -> bytes:
    """SSE events named by their ``type`` (a tuple: the name to give, ``None`` for none)."""
    out = b""
    for event in events:
        if isinstance(event, bytes):
            out += event
            continue
        name, payload = event if isinstance(event, tuple) else (event.get("type"), event)
        head = b"" if name is None else b"event: " + name.encode() + b"\n"
        out += head + b"data: " + json.dumps(payload).encode() + b"\n\n"
    return out


def anthropic_events(stop_reason: str = "tool_use") -> list[dict]:
    """A good Messages stream: a text block, then a tool_use block."""
    return [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "m",
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 3, "output_tokens": 0},
            },
        },
        {"type": "ping"},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"c'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '":1}'},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": 5},
            "trioserve": {"end_cause": "stop"},  # extra fields are accepted
        },
        {"type": "message_stop"},
    ]


ANTHROPIC_ERROR = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}


def anthropic_problems(*events: dict | tuple[str | None, dict] | bytes, status: int = 200) -> list[str]:
    return [v.problem for v in check(named_sse(*events), "messages", status=status)]


def test_a_good_anthropic_stream_passes() -> None:
    events = anthropic_events()
    assert anthropic_problems(*events) == []
    assert anthropic_problems(*events[:2], ANTHROPIC_ERROR) == []  # an error ends it
    body = named_sse(*events)
    assert check([body[i : i + 7] for i in range(0, len(body), 7)], "messages") == []
    text_only = [*events[:5], *events[9:]]
    text_only[-2] = {**text_only[-2], "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    assert anthropic_problems(*text_only) == []
    # cut short: the call's JSON may be incomplete, the stop reason is max_tokens
    cut = [*events[:7], *events[8:]]
    cut[-2] = {**cut[-2], "delta": {"stop_reason": "max_tokens", "stop_sequence": None}}
    assert anthropic_problems(*cut) == []


def _replace(events: list[dict], at: int, /, **fields: object) -> list[dict]:
    events = copy.deepcopy(events)
    events[at].update(fields)
    return events


def _moved(events: list[dict], source: int, target: int) -> list[dict]:
    events = list(events)
    events.insert(target, events.pop(source))
    return events


GOOD = anthropic_events()


@pytest.mark.parametrize(
    ("events", "flagged"),
    [
        # the event: name
        ([("message_start", GOOD[0]), (None, GOOD[1]), *GOOD[2:]], "event 2 has no event: name"),
        (
            [*GOOD[:2], ("content_block_delta", GOOD[2]), *GOOD[3:]],
            "event 3: its event: name 'content_block_delta' is not its data's type 'content_block_start'",
        ),
        # the types
        (_replace(GOOD, 0, message={"type": "message"}), "message_start.message.id\n        Field required"),
        (
            _replace(GOOD, 9, delta={"stop_reason": "deadline", "stop_sequence": None}),
            "event 10: RawMessageDeltaEvent.delta.stop_reason is 'deadline'",
        ),
        (
            _replace(GOOD, 2, content_block={"type": "image", "text": ""}),
            "event 3: RawContentBlockStartEvent.content_block.type is 'image'",
        ),
        (_replace(GOOD, 3, index=None), "content_block_delta.index\n        Input should be a valid integer"),
        # (strict=False: "0" is an integer to pydantic, not to the SDK's content[index])
        (_replace(GOOD, 3, index="0"), "event 4 is a delta for block '0'; the open block is 0"),
        (_replace(GOOD, 4, type="content_block_end"), "does not match any of the expected tags"),
        (_replace(GOOD, 10, type="message_end"), "does not match any of the expected tags"),
        # the order
        (_moved(GOOD, 1, 0), "event 1 is 'ping': a stream starts with message_start"),
        (GOOD[1:], "event 1 is 'ping': a stream starts with message_start"),
        ([*GOOD[:2], GOOD[0], *GOOD[2:]], "event 3 is a second message_start"),
        ([*GOOD[:4], *GOOD[5:9], GOOD[4], *GOOD[9:]], "event 5 starts block 1 while block 0 is open"),
        (_replace(GOOD, 2, index=1), "event 3 starts block 1; the next block's index is 0"),
        (
            [*_replace(GOOD, 5, index=2)[:6], *[{**e, "index": 2} for e in GOOD[6:9]], *GOOD[9:]],
            "event 6 starts block 2; the next block's index is 1",
        ),
        (_replace(GOOD, 3, index=1), "event 4 is a delta for block 1; the open block is 0"),
        ([*GOOD[:3], *GOOD[4:5], GOOD[3], *GOOD[5:]], "event 5 is a delta for block 0, but no block is open"),
        (
            _replace(GOOD, 3, delta={"type": "input_json_delta", "partial_json": "{}"}),
            "event 4 is a 'input_json_delta' in a 'text' block",
        ),
        (
            _replace(GOOD, 6, delta={"type": "text_delta", "text": "{}"}),
            "event 7 is a 'text_delta' in a 'tool_use' block",
        ),
        (_replace(GOOD, 4, index=1), "event 5 stops block 1; the open block is 0"),
        ([*GOOD[:5], GOOD[4], *GOOD[5:]], "event 6 stops block 0, but no block is open"),
        ([*GOOD[:8], *GOOD[9:]], "event 9 is message_delta while block 1 is open"),
        ([*GOOD[:9], GOOD[9], GOOD[9], GOOD[10]], "event 11 is a second message_delta"),
        ([*GOOD[:9], GOOD[9], *GOOD[2:5], GOOD[10]], "event 11 starts a block after message_delta"),
        ([*GOOD[:9], GOOD[10]], "event 10 is message_stop with no message_delta before it"),
        ([*GOOD[:8], GOOD[10]], "event 9 is message_stop while block 1 is open"),
        ([*GOOD, GOOD[1]], "event 12 follows message_stop: nothing may"),
        ([*GOOD[:4], ANTHROPIC_ERROR, *GOOD[4:]], "event 6 follows an error event: nothing may"),
        (GOOD[:-1], "the stream ended without message_stop"),
        (GOOD[:4], "the stream ended without message_stop"),
        # an error event's shape
        (
            [*GOOD[:2], {"type": "error", "error": {"type": "api_error", "message": ""}}],
            "event 3: an Anthropic error's error.message is a non-empty string, not ''",
        ),
        (
            [*GOOD[:2], ("error", {"error": {"message": "x", "type": "server_error"}})],
            "an Anthropic error's type is 'error', not None",
        ),
        # the stop reason and the calls
        (anthropic_events("end_turn"), "a turn with a tool_use block ended with stop_reason 'end_turn'"),
        (anthropic_events("stop_sequence"), "ended with stop_reason 'stop_sequence', not 'tool_use'"),
        (
            [*GOOD[:5], *_replace(GOOD, 9)[9:]],
            "event 6: stop_reason is 'tool_use', but no content block is a tool_use",
        ),
        (
            _replace(GOOD, 7, delta={"type": "input_json_delta", "partial_json": '":1'}),
            "a tool_use block's input is not a JSON object: '{\"c\":1'",
        ),
    ],
)
def test_each_anthropic_stream_rule_catches_its_violation(events: list, flagged: str) -> None:
    problems = anthropic_problems(*events)
    assert any(flagged in problem for problem in problems), problems


def test_anthropic_stream_text_that_is_not_an_event() -> None:
    assert "event 2 is not JSON" in anthropic_problems(GOOD[0], b"event: ping\ndata: {\n\n")[0]
    assert "inside an event" in anthropic_problems(*GOOD, b"event: ping\n")[0]


def anthropic_message(**fields: object) -> dict:
    body: dict[str, object] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi"}],
        "model": "m",
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    body.update(fields)
    return body


TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": 1}}


@pytest.mark.parametrize(
    ("body", "flagged"),
    [
        (anthropic_message(), None),
        (anthropic_message(content=[TOOL_USE], stop_reason="tool_use"), None),
        (anthropic_message(content=[], stop_reason="max_tokens"), None),
        (anthropic_message(stop_reason="model_context_window_exceeded"), None),
        (anthropic_message(stop_reason="deadline"), "Message.stop_reason is 'deadline'"),
        (anthropic_message(type="chat.completion"), "Message.type is 'chat.completion'"),
        (anthropic_message(role="user"), "Message.role is 'user'"),
        (anthropic_message(content=[{"type": "output_text", "text": "x"}]), "Message.content[0].type"),
        (anthropic_message(usage={"input_tokens": 3}), "output_tokens"),
        (anthropic_message(content=[TOOL_USE]), "ended with stop_reason 'end_turn', not 'tool_use'"),
        (anthropic_message(stop_reason="tool_use"), "no content block is a tool_use"),
        (
            anthropic_message(content=[{**TOOL_USE, "input": "{"}], stop_reason="tool_use"),
            "not a JSON object",
        ),
    ],
)
def test_anthropic_bodies(body: dict, flagged: str | None) -> None:
    problems = [v.problem for v in check(json.dumps(body).encode(), "messages", JSON_HEADERS)]
    if flagged is None:
        assert problems == []
    else:
        assert problems
        assert flagged in problems[0]


@pytest.mark.parametrize(
    ("body", "flagged"),
    [
        (json.dumps(ANTHROPIC_ERROR).encode(), None),
        (b'{"type":"error","error":{"type":"request_too_large","message":"too big"}}', None),
        (
            b'{"error": {"message": "no", "type": "invalid_request_error"}}',
            "error's type is 'error', not None",
        ),
        (b'{"type":"error","error":{"type":"api_error"}}', "error.message is a non-empty string, not None"),
        (b'{"type":"error","error":{"message":"x"}}', "error.type is a non-empty string, not None"),
        (b'{"type":"error","error":"x"}', "error is an object, not 'x'"),
        (b"Internal Server Error", "the 500 body is not JSON"),
    ],
)
def test_anthropic_error_bodies(body: bytes, flagged: str | None) -> None:
    problems = [v.problem for v in check(body, "messages", JSON_HEADERS, status=500)]
    if flagged is None:
        assert problems == []
    else:
        assert problems
        assert flagged in problems[0]
    # on the OpenAI endpoints, refusals are not checked here
    assert check(body, "chat", JSON_HEADERS, status=500) == []


# --- OpenAI Responses -----------------------------------------------------------------


def response_object(status: str = "completed", output: list | None = None) -> dict:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1700000000,
        "status": status,
        "error": {"code": "server_error", "message": "x"} if status == "failed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "metadata": {},
        "model": "m",
        "output": output or [],
        "parallel_tool_calls": True,
        "temperature": None,
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
    }


MESSAGE_ITEM = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
CALL_ITEM = {
    "id": "fc_1",
    "type": "function_call",
    "status": "in_progress",
    "call_id": "call_1",
    "name": "w",
    "arguments": "",
}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def responses_events(terminal: str = "response.completed") -> list[dict]:
    """A good Responses stream: a message, then a function call (numbered by
    :func:`numbered`)."""
    message_done = {**MESSAGE_ITEM, "status": "completed", "content": [_part("Hi there")]}
    call_done = {**CALL_ITEM, "status": "completed", "arguments": '{"c":1}'}
    ids = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    call = {"item_id": "fc_1", "output_index": 1}
    status = terminal.removeprefix("response.")
    return [
        {"type": "response.created", "response": response_object("in_progress")},
        {"type": "response.in_progress", "response": response_object("in_progress")},
        {"type": "response.output_item.added", "output_index": 0, "item": MESSAGE_ITEM},
        {"type": "response.content_part.added", **ids, "part": _part("")},
        {"type": "response.output_text.delta", **ids, "delta": "Hi", "logprobs": []},
        {"type": "response.output_text.delta", **ids, "delta": " there", "logprobs": []},
        {"type": "response.output_text.done", **ids, "text": "Hi there", "logprobs": []},
        {"type": "response.content_part.done", **ids, "part": _part("Hi there")},
        {"type": "response.output_item.done", "output_index": 0, "item": message_done},
        {"type": "response.output_item.added", "output_index": 1, "item": CALL_ITEM},
        {"type": "response.function_call_arguments.delta", **call, "delta": '{"c":'},
        {"type": "response.function_call_arguments.delta", **call, "delta": "1}"},
        {"type": "response.function_call_arguments.done", **call, "name": "w", "arguments": '{"c":1}'},
        {"type": "response.output_item.done", "output_index": 1, "item": call_done},
        {"type": terminal, "response": response_object(status, [message_done, call_done])},
    ]


def numbered(events: list) -> list:
    """``events`` with their sequence_number (0, 1, 2, …) where they have none."""
    out = []
    for number, event in enumerate(events):
        if isinstance(event, tuple):
            out.append((event[0], {"sequence_number": number, **event[1]}))
        else:
            out.append({"sequence_number": number, **event})
    return out


def responses_problems(events: list) -> list[str]:
    return [v.problem for v in check(named_sse(*events), "responses")]


def test_a_good_responses_stream_passes() -> None:
    events = responses_events()
    assert responses_problems(numbered(events)) == []
    incomplete = responses_events("response.incomplete")
    assert responses_problems(numbered(incomplete)) == []
    # failed: an item may be left open
    failed = {"type": "response.failed", "response": response_object("failed")}
    assert responses_problems(numbered([*events[:5], failed])) == []
    body = named_sse(*numbered(events))
    assert check([body[i : i + 5] for i in range(0, len(body), 5)], "responses") == []


R_GOOD = responses_events()


def _r_replace(index: int, /, **fields: object) -> list:
    events = copy.deepcopy(R_GOOD)
    events[index].update(fields)
    return numbered(events)


def _r_item(index: int, /, **fields: object) -> list:
    events = copy.deepcopy(R_GOOD)
    events[index]["item"].update(fields)
    return numbered(events)


def _r_final_output(output: list) -> list:
    events = copy.deepcopy(R_GOOD)
    events[-1]["response"]["output"] = output
    return numbered(events)


def _r_numbers(*numbers: object) -> list:
    return [{**event, "sequence_number": n} for event, n in zip(R_GOOD, numbers, strict=False)] + numbered(
        R_GOOD
    )[len(numbers) :]


@pytest.mark.parametrize(
    ("events", "flagged"),
    [
        # the event: name
        (
            [(None, e) if i == 1 else e for i, e in enumerate(numbered(R_GOOD))],
            "event 2: its event: name None",
        ),
        (
            [("response.done", e) if i == 14 else e for i, e in enumerate(numbered(R_GOOD))],
            "event 15: its event: name 'response.done' is not its data's type 'response.completed'",
        ),
        # the types
        (_r_replace(4, item_id=None), "event 5: TypeAdapter(ResponseStreamEvent).validate_python"),
        (_r_replace(4, type="response.text.delta"), "does not match any of the expected tags"),
        (_r_item(2, status="done"), "event 3: ResponseOutputItemAddedEvent.item.status is 'done'"),
        (_r_item(2, type="output_message"), "ResponseOutputItemAddedEvent.item.type is 'output_message'"),
        (_r_item(2, role="user"), "item.role is 'user'"),
        # the sequence numbers
        (_r_numbers(1), "event 1: sequence_number 1; the next is 0"),
        (_r_numbers(0, 1, 1), "event 3: sequence_number 1; the next is 2"),
        (_r_numbers(0, 1, 3), "event 3: sequence_number 3; the next is 2"),
        (_r_numbers(0, "1"), "event 2: sequence_number '1'; the next is 1"),
        (
            [{k: v for k, v in e.items() if k != "sequence_number"} for e in numbered(R_GOOD)],
            "sequence_number None",
        ),
        # response.created first, the terminal event last and once
        (numbered(R_GOOD[1:]), "event 1 is 'response.in_progress': a stream starts with response.created"),
        (numbered([R_GOOD[0], *R_GOOD]), "event 2 is a second response.created"),
        (numbered([*R_GOOD, R_GOOD[-1]]), "event 16 follows response.completed: nothing may"),
        (numbered([*R_GOOD[:5], R_GOOD[-1], *R_GOOD[5:-1]]), "event 7 follows response.completed"),
        (numbered(R_GOOD[:-1]), "the stream ended without response.completed, response.incomplete or"),
        (
            numbered([*R_GOOD[:-1], {**R_GOOD[-1], "type": "response.incomplete"}]),
            "event 15 is response.incomplete, but its response's status is 'completed'",
        ),
        (
            _r_replace(1, response={**response_object("in_progress"), "id": "resp_2"}),
            "event 2: response id 'resp_2'; response.created's is 'resp_1'",
        ),
        # output items: added in order, one at a time, done once
        (
            numbered([{**e, "output_index": 1} if "output_index" in e else e for e in R_GOOD[:9]]),
            "event 3 adds output item 1; the next item's index is 0",
        ),
        (
            numbered([*R_GOOD[:8], *R_GOOD[9:10], R_GOOD[8], *R_GOOD[10:]]),
            "event 9 adds output item 1 while item 0 is not done",
        ),
        (numbered([*R_GOOD[:9], R_GOOD[2], *R_GOOD[9:]]), "event 10 adds output item 0 a second time"),
        (numbered([*R_GOOD[:9], R_GOOD[8], *R_GOOD[9:]]), "event 10 is about output item 0, which is done"),
        (_r_replace(8, output_index=5), "event 9 is about output item 5, which is never added"),
        (
            _r_item(8, id="msg_2"),
            "output item 0 is done as 'message' 'msg_2'; it was added as 'message' 'msg_1'",
        ),
        (
            numbered([*R_GOOD[:13], R_GOOD[-1]]),
            "event 14 is response.completed while output item(s) [1] are not",
        ),
        (_r_final_output([]), "its response's output is the items []; the items done are ['msg_1', 'fc_1']"),
        # events about an item name an open item of their kind
        (_r_replace(4, item_id="msg_9"), "event 5: item_id 'msg_9'; output item 0 is 'msg_1'"),
        (_r_replace(10, output_index=0), "event 11 is about output item 0, which is done"),
        (
            numbered([*R_GOOD[:10], {**R_GOOD[4], "item_id": "fc_1", "output_index": 1}, *R_GOOD[10:]]),
            "event 11 is about output item 1, a 'function_call', not a 'message'",
        ),
        (
            numbered([*R_GOOD[:3], R_GOOD[4], *R_GOOD[3:]]),
            "event 4 is about content part 0, which is never added",
        ),
        (_r_replace(3, content_index=1), "event 4 adds content part 1; the next is 0"),
        (
            numbered([*R_GOOD[:8], R_GOOD[4], *R_GOOD[8:]]),
            "event 9 is about content part 0, which is done",
        ),
        # the texts the deltas join to
        (
            _r_replace(6, text="Hi  there"),
            "output_text.done's text is 'Hi  there'; the deltas join to 'Hi there'",
        ),
        (_r_replace(5, delta=" you"), "the deltas join to 'Hi you'"),
        (_r_replace(7, part=_part("Hi")), "event 8: the part's text is 'Hi'; its deltas join to 'Hi there'"),
        (
            _r_item(8, content=[_part("Hello")]),
            "event 9: content part 0's text is 'Hello'; its deltas join to 'Hi there'",
        ),
        (
            numbered([*R_GOOD[:7], *R_GOOD[8:]]),
            "event 8: content part 0 of item 0 is not done",
        ),
        (
            _r_replace(12, arguments='{"c":2}'),
            "function_call_arguments.done's arguments are '{\"c\":2}'; the deltas join to '{\"c\":1}'",
        ),
        (
            _r_item(13, arguments="{}"),
            "event 14: the call's arguments are '{}'; its deltas join to '{\"c\":1}'",
        ),
    ],
)
def test_each_responses_stream_rule_catches_its_violation(events: list, flagged: str) -> None:
    problems = responses_problems(events)
    assert any(flagged in problem for problem in problems), problems


def test_a_responses_stream_has_no_done_marker() -> None:
    (problem,) = [v.problem for v in check(named_sse(*numbered(R_GOOD)) + DONE, "responses")]
    assert problem == "event 16 follows response.completed: nothing may"


@pytest.mark.parametrize(
    ("body", "flagged"),
    [
        (response_object(), None),
        (response_object("incomplete", [{**MESSAGE_ITEM, "content": [_part("x")]}]), None),
        (response_object("done"), "Response.status is 'done'"),
        ({**response_object(), "object": "chat.completion"}, "Response.object is 'chat.completion'"),
        (
            response_object(output=[{**CALL_ITEM, "type": "tool_call"}]),
            "Response.output[0].type is 'tool_call'",
        ),
        ({k: v for k, v in response_object().items() if k != "created_at"}, "created_at"),
    ],
)
def test_responses_bodies(body: dict, flagged: str | None) -> None:
    problems = [v.problem for v in check(json.dumps(body).encode(), "responses", JSON_HEADERS)]
    if flagged is None:
        assert problems == []
    else:
        assert problems
        assert flagged in problems[0]


# --- the dialects' own output passes ----------------------------------------------------


def test_the_dialects_streams_pass() -> None:
    """What trioserve's Messages and Responses dialects write (sans-IO): text and calls,
    each way a stream ends (stop, length, a deadline, a failure)."""
    call = '{"name":"w","arguments":{"c":1}}'
    usage = Usage(prompt_tokens=3, completion_tokens=9)
    tools = json.dumps({"input": "x", "tools": [{"type": "function", "name": "w", "parameters": {}}]})
    for mode in ("none", "auto", "forced"):
        text = call if mode != "none" else "Hello"
        for cause in ("stop", "length", "deadline", "failed"):
            for cut in (len(text), len(text) // 2):
                if cause == "stop" and cut < len(text) and mode == "forced":
                    continue  # (the constraint ends a forced call only once it is whole)
                anthropic = AnthropicDialect("m", tool_mode=mode, tool_names=["w"], max_tokens=9)
                responses = ResponsesDialect(
                    "m",
                    decode_responses_request(tools.encode()),
                    tool_mode=mode,
                    tool_names=["w"],
                )
                for dialect, kind in ((anthropic, "messages"), (responses, "responses")):
                    data = dialect.opening(3) + b"".join(dialect.delta(c, None) for c in text[:cut])
                    if cause == "failed":
                        data += dialect.stream_error(BackendError("inference failed"))
                    else:
                        data += dialect.finish(cause) + dialect.end(usage)  # type: ignore[arg-type]
                    assert check(data, kind) == [], (mode, cause, cut, kind)  # type: ignore[arg-type]
