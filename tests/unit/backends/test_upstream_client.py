"""The upstream client against an ``httpx.MockTransport``: what it relays, what it
forwards, and how each answer is mapped (no model, no socket).

The relay reads an upstream trioserve's end: its finish_reason is OpenAI's ("length"
for a stream it cut short), and why it ended is its ``trioserve.end_cause``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio

from trioserve._backends._upstream import UpstreamState
from trioserve._backends._upstream._client import Sink, UpstreamClient
from trioserve._backends._upstream._errors import Retry, UpstreamUnavailable
from trioserve._core._backend import GenerationProgress
from trioserve._core._exceptions import (
    BackendError,
    ContextLengthError,
    InvalidRequestError,
    NotSupportedError,
    OverloadedError,
)

URL = "http://upstream"
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Collected:
    """What a :class:`Sink` hands on (stands in for the engine's channel)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    async def send(self, piece: bytes) -> None:
        self.pieces.append(piece)


def _client(handler: Handler, *, api_key: str | None = None) -> UpstreamClient:
    return UpstreamClient(
        connections=1,
        connect_timeout=1.0,
        read_timeout=1.0,
        receive_buffer_bytes=None,
        api_key=api_key,
        transport=httpx.MockTransport(handler),
    )


def _sse(*chunks: object, done: bool = True) -> bytes:
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    if done:
        events.append("data: [DONE]\n\n")
    return "".join(events).encode()


def _text(text: str, reason: str | None = None, **extra: object) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": reason}], **extra}


async def _streamed(body: bytes) -> AsyncIterator[bytes]:
    """A body as a network answer's is: streamed, not read yet (a ``bytes`` content
    would be)."""
    yield body


def _answer(status: int, body: bytes) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=_streamed(body))

    return handler


async def _stream(handler: Handler) -> tuple[str, Collected, GenerationProgress, list[str]]:
    """Stream one completion: ``(end, collected, progress, answered calls)``."""
    collected = Collected()
    progress = GenerationProgress(prompt_tokens=0)
    sink = Sink(collected, progress)  # type: ignore[arg-type]
    answered: list[str] = []
    client = _client(handler)
    try:
        end = await client.stream(
            UpstreamState(url=URL), {"prompt": "x"}, sink, lambda: answered.append("yes")
        )
    finally:
        await client.aclose()
    return end, collected, progress, answered


async def test_text_is_relayed_in_order_and_the_usage_chunk_counts() -> None:
    body = _sse(
        _text("Hel"),
        _text("lo"),
        _text("", "stop"),
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
    )
    end, collected, progress, answered = await _stream(_answer(200, body))
    assert end == "stop"
    assert collected.pieces == [b"Hel", b"lo"]
    assert (progress.prompt_tokens, progress.completion_tokens) == (7, 2)
    assert answered == ["yes"]


async def test_without_a_usage_chunk_each_text_chunk_counts_as_a_token() -> None:
    _, _, progress, _ = await _stream(_answer(200, _sse(_text("a"), _text("b"), _text("c", "length"))))
    assert progress.completion_tokens == 3


async def test_an_upstream_shutting_down_is_unavailable_not_a_short_success() -> None:
    end = _text("", "length", trioserve={"end_cause": "shutdown", "message": "why"})
    with pytest.raises(UpstreamUnavailable, match="shutting down: why"):
        await _stream(_answer(200, _sse(end)))


async def test_plain_ends_stay_as_they_are() -> None:
    for reason in ("length", "stop"):
        end, *_ = await _stream(_answer(200, _sse(_text("", reason))))
        assert end == reason


async def test_an_unknown_finish_reason_is_reported_as_stop() -> None:
    end, *_ = await _stream(_answer(200, _sse(_text("", "tool_calls"))))
    assert end == "stop"


async def test_an_upstream_error_event_is_retried_elsewhere() -> None:
    with pytest.raises(Retry, match="failed: boom") as caught:
        await _stream(_answer(200, _sse({"error": {"message": "boom", "type": "server_error"}})))
    assert isinstance(caught.value.error, BackendError)


async def test_an_upstream_error_end_is_retried_elsewhere() -> None:
    end = _text("", "length", trioserve={"end_cause": "error", "message": "oops"})
    with pytest.raises(Retry, match="failed: oops"):
        await _stream(_answer(200, _sse(end)))


async def test_a_stream_without_a_finish_reason_is_unavailable() -> None:
    with pytest.raises(UpstreamUnavailable, match="without a finish reason"):
        await _stream(_answer(200, _sse(_text("a"))))


async def test_an_event_that_is_not_json_is_unavailable() -> None:
    with pytest.raises(UpstreamUnavailable, match="not JSON"):
        await _stream(_answer(200, b"data: {nope\n\n"))


async def test_a_stream_broken_off_is_unavailable() -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield _sse(_text("a"), done=False)
        raise httpx.ReadError("connection reset")

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=broken())

    with pytest.raises(UpstreamUnavailable, match="broke off the stream: ReadError: connection reset"):
        await _stream(handler)


async def test_an_upstream_that_cannot_be_reached_is_unavailable() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with pytest.raises(UpstreamUnavailable, match="cannot reach upstream http://upstream: ConnectError"):
        await _stream(handler)


async def test_a_connection_dropped_unanswered_is_sent_again_once() -> None:
    """A server closing an idle keep-alive connection just as a request goes out on it
    answers nothing: the request is sent once more on a new connection (no byte reached
    the client, the upstream is not failed); a second drop is the upstream's failure."""
    calls: list[bytes] = []

    async def drops_once(request: httpx.Request) -> httpx.Response:
        calls.append(request.content)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=_streamed(_sse(_text("hi", "stop"))))

    end, collected, _, answered = await _stream(drops_once)
    assert (end, collected.pieces, answered) == ("stop", [b"hi"], ["yes"])
    assert calls == [b'{"prompt":"x"}'] * 2

    calls.clear()

    async def drops(request: httpx.Request) -> httpx.Response:
        calls.append(request.content)
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    with pytest.raises(UpstreamUnavailable, match="RemoteProtocolError: Server disconnected"):
        await _stream(drops)
    assert len(calls) == 2


#: status, error body → what the client raises, and whether the upstream counts as up
REFUSALS: list[tuple[int, dict[str, object], type[Exception], type[Exception] | None, str, bool]] = [
    (
        400,
        {"error": {"message": "bad", "param": "top_p", "code": "x"}},
        InvalidRequestError,
        None,
        "bad",
        True,
    ),
    (
        400,
        {"error": {"message": "too long", "code": "context_length_exceeded"}},
        ContextLengthError,
        None,
        "too long",
        True,
    ),
    (
        422,
        {"detail": [{"loc": ["body", "top_p"], "msg": "bad value"}]},
        InvalidRequestError,
        None,
        "bad value",
        True,
    ),
    (401, {"error": {"message": "key"}}, Retry, BackendError, "answered 401: key", True),
    (404, {"message": "no route"}, Retry, BackendError, "answered 404: no route", True),
    (429, {"error": "busy"}, Retry, OverloadedError, "overloaded: busy", True),
    (500, {"detail": "crash"}, Retry, BackendError, "answered 500: crash", True),
    (501, {"error": {"message": "no"}}, Retry, BackendError, "answered 501: no", True),
    (502, {}, UpstreamUnavailable, None, "answered 502", False),
    (503, {"error": {"message": "loading"}}, UpstreamUnavailable, None, "answered 503: loading", False),
    (504, {}, UpstreamUnavailable, None, "answered 504", False),
]


@pytest.mark.parametrize(("status", "body", "raised", "error", "message", "up"), REFUSALS)
async def test_the_error_mapping_per_status(
    status: int,
    body: dict[str, object],
    raised: type[Exception],
    error: type[Exception] | None,
    message: str,
    up: bool,
) -> None:
    answered: list[str] = []
    client = _client(_answer(status, json.dumps(body).encode()))
    sink = Sink(Collected(), GenerationProgress(prompt_tokens=0))  # type: ignore[arg-type]
    with pytest.raises(raised, match=message) as caught:
        await client.stream(UpstreamState(url=URL), {}, sink, lambda: answered.append("yes"))
    await client.aclose()
    if error is not None:
        assert isinstance(caught.value, Retry)
        assert type(caught.value.error) is error
    assert answered == (["yes"] if up else [])
    if status == 400 and raised is InvalidRequestError:
        assert (caught.value.param, caught.value.code) == ("top_p", "x")  # type: ignore[attr-defined]


async def test_the_deadline_and_the_key_go_upstream() -> None:
    seen: list[httpx.Headers] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, content=_streamed(_sse(_text("", "stop"))))

    client = _client(handler, api_key="secret")
    sink = Sink(Collected(), GenerationProgress(prompt_tokens=0))  # type: ignore[arg-type]
    await client.stream(UpstreamState(url=URL), {}, sink, lambda: None)
    with trio.fail_after(30):
        await client.stream(UpstreamState(url=URL), {}, sink, lambda: None)
    await client.aclose()
    without, with_deadline = seen
    assert "x-request-timeout" not in without
    assert without["authorization"] == "Bearer secret"
    assert 29.0 < float(with_deadline["x-request-timeout"]) <= 30.0
    assert with_deadline["accept"] == "text/event-stream"


async def test_a_cancel_mid_stream_raises_cancelled_after_the_text_sent(autojump_clock: Any) -> None:
    async def endless() -> AsyncIterator[bytes]:
        yield _sse(_text("a"), done=False)
        await trio.sleep_forever()
        yield b""  # pragma: no cover

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=endless())

    collected = Collected()
    client = _client(handler)
    sink = Sink(collected, GenerationProgress(prompt_tokens=0))  # type: ignore[arg-type]
    with trio.move_on_after(0.5) as scope:
        await client.stream(UpstreamState(url=URL), {}, sink, lambda: None)
    await client.aclose()
    assert scope.cancelled_caught
    assert collected.pieces == [b"a"]
    assert sink.sent


# ---------------------------------------------------------------------- embeddings


async def _embeddings(handler: Handler, inputs: int = 2) -> tuple[list[list[float]], int]:
    client = _client(handler)
    try:
        body = {"input": ["x"] * inputs}
        return await client.embeddings(UpstreamState(url=URL), body, lambda: None)
    finally:
        await client.aclose()


async def test_embeddings_come_back_in_input_order() -> None:
    answer = {
        "data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}],
        "usage": {"prompt_tokens": 4},
    }
    assert await _embeddings(_answer(200, json.dumps(answer).encode())) == ([[1.0], [2.0]], 4)


async def test_embeddings_of_the_wrong_count_are_retried() -> None:
    answer = {"data": [{"index": 0, "embedding": [1.0]}]}
    with pytest.raises(Retry, match=r"one embedding per input \(2\)"):
        await _embeddings(_answer(200, json.dumps(answer).encode()))


async def test_an_upstream_without_embeddings_is_not_supported() -> None:
    with pytest.raises(Retry, match="computes no embeddings: off") as caught:
        await _embeddings(_answer(501, b'{"error": {"message": "off"}}'))
    assert isinstance(caught.value.error, NotSupportedError)


async def test_a_silent_embeddings_upstream_is_retried_without_cooldown() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow")

    with pytest.raises(Retry, match="did not answer within its read timeout"):
        await _embeddings(handler)
