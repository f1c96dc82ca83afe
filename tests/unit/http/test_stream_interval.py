"""``--stream-interval-ms``: a stream's deltas that arrive within the interval of its last
event go out as one event; the first delta and the end are never held (docs/api.md,
"Streaming format")."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from trioserve import ScriptedBackend
from trioserve._http._server import ServerSettings
from trioserve._http._settings import HTTPSettings
from trioserve._wire._sse import SSEDecoder
from trioserve.testing import open_test_server

SCRIPT = [f" tok{i}".encode() for i in range(6)]
TEXT = "".join(piece.decode() for piece in SCRIPT)


async def content_events(
    url: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The chat chunks of one stream, in order (``[DONE]`` left out)."""
    decoder, chunks = SSEDecoder(), []
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        async for data in response.aiter_bytes():
            chunks += [json.loads(e.data) for e in decoder.feed(data) if e.data != "[DONE]"]
    return chunks


def texts(chunks: list[dict[str, Any]]) -> list[str]:
    return [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]


def settings(interval: float) -> ServerSettings:
    return ServerSettings(http=HTTPSettings(stream_interval=interval))


CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100}


@pytest.mark.parametrize("interval", [0.0, 60.0])
async def test_held_deltas_go_with_the_end_and_the_first_goes_at_once(interval: float) -> None:
    # An interval of a minute: every delta after the first is held; the stream still ends
    # at once (the end is never held: the bound below is a tenth of the interval), with
    # the held text in front of the final chunk, and the first delta went alone.
    async with open_test_server(script=SCRIPT, token_interval=0.002, settings=settings(interval)) as server:
        with trio.fail_after(6):
            chunks = await content_events(server.url, CHAT)
    sent = texts(chunks)
    assert "".join(sent) == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    if interval:
        assert sent == [" tok0", "".join(p.decode() for p in SCRIPT[1:])]
        # (the held text and the finish: one send, two chunks)
        assert chunks[-2]["choices"][0]["delta"]["content"] == sent[-1]
    else:
        assert len(sent) > 2  # (each delta its own event, or a few the reader lagged on)


async def test_a_deadline_sends_the_held_text_before_the_final_event() -> None:
    # Held text has been counted as generated: a cancel (here the request's deadline)
    # must not lose it: it goes out ahead of the final chunk.
    backend = ScriptedBackend(token_interval=0.005)
    async with open_test_server(backend, settings=settings(60.0)) as server:
        with trio.fail_after(10):
            chunks = await content_events(
                server.url, CHAT | {"max_tokens": 2000}, {"X-Request-Timeout": "0.5"}
            )
    sent = texts(chunks)
    assert chunks[-1]["trioserve"]["end_cause"] == "deadline"
    assert sent[0] == " tok0"
    assert len(sent) == 2, sent  # the first delta; then the held ones, sent by the cancel
    completed = chunks[-1]["usage"]["completion_tokens"] if chunks[-1].get("usage") else None
    assert "".join(sent) == "".join(f" tok{i}" for i in range(len("".join(sent).split())))
    if completed is not None:
        assert len("".join(sent).split()) == completed


def test_the_flag_takes_milliseconds_and_names_itself_when_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trioserve._cli._parser import parser as _parser

    assert _parser().parse_args(["serve", "--scripted"]).stream_interval_ms == 0
    assert _parser().parse_args(["serve", "--stream-interval-ms", "50"]).stream_interval_ms == 50
    for bad in ("-1", "nan", "20000"):
        with pytest.raises(SystemExit) as exited:
            _parser().parse_args(["serve", "--stream-interval-ms", bad])
        assert exited.value.code == 2
        assert "--stream-interval-ms: must be between 0 and 10000 ms" in capsys.readouterr().err
