"""A detachable stream's event ids (docs/resumable-streams.md, "The stream log"):
``number_events`` over the real output of every dialect's writer, keep-alives between
the events, decoded back — by trioserve's ``SSEDecoder`` with the bytes split at every
point, and by the openai and anthropic SDKs' own decoders — to the same events, with
consecutive ids, ``retry:`` on the first event only and no id on a keep-alive."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import anthropic._streaming
import openai._streaming
import pytest

from trioserve._core._exceptions import InvalidRequestError
from trioserve._core._types import Usage
from trioserve._wire import number_events
from trioserve._wire._anthropic_writer import AnthropicDialect
from trioserve._wire._dialect import OpenAIDialect
from trioserve._wire._responses import decode_responses_request
from trioserve._wire._responses_writer import ResponsesDialect
from trioserve._wire._sse import HEARTBEAT, ServerSentEvent, SSEDecoder

USAGE = Usage(prompt_tokens=3, completion_tokens=9)
CALL = '<tool_call>\n{"name":"w","arguments":{"city":"Paris"}}\n</tool_call>'
RETRY = 1000
#: the call's text as a model's tokens would bring it (a few characters each)
CALL_PIECES = [CALL[i : i + 9] for i in range(0, len(CALL), 9)]

#: one stream: the pieces its writer hands the HTTP layer, one per send
Pieces = list[bytes]


def _chat_two_choices() -> Pieces:
    dialect = OpenAIDialect("chat", "m", include_usage=True, choices=2)
    first, second = dialect.writers
    return [
        dialect.heartbeat,  # queued: before the first event
        dialect.opening(3),
        first.delta("Hello", None),
        second.delta("Bonjour", None),
        dialect.heartbeat,  # a keep-alive between events
        dialect.heartbeat,
        first.delta(" world", None),
        first.finish("stop"),
        second.finish("length"),
        dialect.end(USAGE),
    ]


def _chat_tools() -> Pieces:
    dialect = OpenAIDialect("chat", "m", tool_mode="auto", tool_names=["w"])
    (writer,) = dialect.writers
    pieces = [dialect.opening(3)]
    pieces += [writer.delta(c, None) for c in CALL_PIECES]
    return [*pieces, dialect.heartbeat, writer.finish("stop"), dialect.end(USAGE)]


def _completions_error() -> Pieces:
    dialect = OpenAIDialect("text", "m")
    return [
        dialect.opening(3),
        dialect.plain_delta("a"),
        dialect.plain_delta("b\n\nc"),  # a blank line in the text stays inside its JSON string
        dialect.heartbeat,
        dialect.stream_error(InvalidRequestError("bad grammar", param="grammar")),
    ]


def _anthropic() -> Pieces:
    dialect = AnthropicDialect("m", tool_mode="auto", tool_names=["w"], max_tokens=50)
    pieces = [dialect.heartbeat, dialect.opening(3), dialect.heartbeat]
    pieces += [dialect.delta(c, None) for c in CALL_PIECES]
    return [*pieces, dialect.finish("stop"), dialect.end(USAGE)]


def _responses_dialect(reasoning: bool) -> ResponsesDialect:
    body = {"input": "x", "tools": [{"type": "function", "name": "w", "parameters": {}}]}
    request = decode_responses_request(json.dumps(body).encode())
    think = ("<think>", "</think>") if reasoning else None
    return ResponsesDialect("m", request, tool_mode="auto", tool_names=["w"], reasoning=think)


def _responses() -> Pieces:
    dialect = _responses_dialect(reasoning=True)
    pieces = [dialect.heartbeat, dialect.opening(3)]
    pieces += [dialect.delta(p, None) for p in ["<think>", "Hmm", ".</think>", "\n\n"]]
    pieces.append(dialect.heartbeat)
    pieces += [dialect.delta(c, None) for c in CALL_PIECES]
    return [*pieces, dialect.heartbeat, dialect.finish("stop"), dialect.end(USAGE)]


def _responses_failed() -> Pieces:
    dialect = _responses_dialect(reasoning=False)
    pieces = [dialect.opening(3), dialect.delta("Hi", None), dialect.heartbeat]
    return [*pieces, dialect.stream_error(InvalidRequestError("gone"))]


STREAMS: dict[str, Callable[[], Pieces]] = {
    "chat, n=2, usage": _chat_two_choices,
    "chat, a tool call": _chat_tools,
    "completions, an error": _completions_error,
    "anthropic, tool_use and pings": _anthropic,
    "responses, reasoning and a call": _responses,
    "responses, failed": _responses_failed,
}


def _numbered(pieces: Pieces) -> tuple[bytes, list[int | None]]:
    """The pieces numbered one send at a time, as the log numbers them."""
    out, ids, next_id = b"", [], 0
    for piece in pieces:
        blocks = number_events(piece, next_id, retry_ms=RETRY if next_id == 0 else None)
        for event_id, block in blocks:
            out += block
            ids.append(event_id)
            if event_id is not None:
                assert event_id == next_id
                next_id += 1
    return out, ids


def _decode(*chunks: bytes) -> tuple[list[ServerSentEvent], int]:
    decoder = SSEDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events, decoder.comments


def _without_ids(events: list[ServerSentEvent]) -> list[tuple[str, str]]:
    return [(e.event, e.data) for e in events]


@pytest.mark.parametrize("name", list(STREAMS))
def test_events_are_numbered_in_order_and_decode_to_the_same_events(name: str) -> None:
    pieces = STREAMS[name]()
    plain = b"".join(pieces)
    numbered, _ = _numbered(pieces)
    expected, comments = _decode(plain)
    events, numbered_comments = _decode(numbered)
    assert _without_ids(events) == _without_ids(expected)  # the data unchanged
    assert numbered_comments == comments  # keep-alives kept, not numbered
    pings = [e for e in expected if e.event == "ping"]
    assert comments + len(pings) >= 1
    numbered_events = [e for e in events if e.event != "ping"]
    assert [e.id for e in numbered_events] == [str(k) for k in range(len(numbered_events))]
    assert [e.retry for e in numbered_events] == [RETRY] + [None] * (len(numbered_events) - 1)
    for event in pings:  # a ping carries the last id (the SSE rule), never a new one or retry
        assert event.retry is None
        assert event.id is None or int(event.id) < len(numbered_events)
    # any TCP split: the same events
    for cut in range(len(numbered) + 1):
        assert _decode(numbered[:cut], numbered[cut:]) == (events, comments), cut
    assert _decode(*(numbered[i : i + 1] for i in range(len(numbered)))) == (events, comments)


def _sdk_events(
    decoder: openai._streaming.SSEDecoder | anthropic._streaming.SSEDecoder, data: bytes
) -> Iterator[str]:
    for event in decoder.iter_bytes(iter([data])):
        yield event.data


@pytest.mark.parametrize("name", list(STREAMS))
def test_the_sdks_decoders_see_no_empty_event(name: str) -> None:
    """The openai and anthropic SDKs keep the last id and dispatch an event with empty
    data at a blank line that ends no field: a heartbeat block after the first id would
    be one (the openai SDK fails on it: ``json.loads("")``). A heartbeat after the
    first id is a comment line of the next event's block, and ``retry:`` a field of the
    first event: every event the SDKs see has data, the same as without ids."""
    pieces = STREAMS[name]()
    numbered, _ = _numbered(pieces)
    for decoder in (openai._streaming.SSEDecoder, anthropic._streaming.SSEDecoder):
        plain_data = list(_sdk_events(decoder(), b"".join(pieces)))
        data = list(_sdk_events(decoder(), numbered))
        assert data == plain_data
        assert all(data)
        # split anywhere, as a socket would
        for cut in range(0, len(numbered) + 1, 7):
            events = decoder().iter_bytes(iter([numbered[:cut], numbered[cut:]]))
            assert [event.data for event in events] == data, cut


def test_the_old_way_would_fail_the_openai_sdk() -> None:
    """What the heartbeat's blank line after an id does to the openai SDK's decoder (the
    reason ``number_events`` drops it)."""
    events = openai._streaming.SSEDecoder().iter_bytes(iter([b'id: 0\ndata: {"a":1}\n\n' + HEARTBEAT]))
    assert [event.data for event in events] == ['{"a":1}', ""]


@pytest.mark.parametrize("reasoning", [False, True])
def test_responses_ids_are_the_sequence_numbers(reasoning: bool) -> None:
    """Numbered from 0, a Responses stream's ids are its events' ``sequence_number``:
    ``starting_after=N`` and ``Last-Event-ID: N`` name the same place."""
    pieces = _responses() if reasoning else _responses_failed()
    events, _ = _decode(_numbered(pieces)[0])
    assert len(events) > 5
    for event in events:
        assert event.id == str(json.loads(event.data)["sequence_number"])


def test_blocks_and_their_ids() -> None:
    ping = b'event: ping\ndata: {"type":"ping"}\n\n'
    data = HEARTBEAT + b"data: a\n\n" + ping + b": x\n: y\n\n" + b"event: e\ndata: b\n\n"
    assert number_events(data, 0, retry_ms=500) == [
        (None, b": ping\n\n"),
        (0, b"id: 0\nretry: 500\ndata: a\n\n"),
        (None, ping),
        (None, b": x\n: y\n"),  # after an id: a comment line of the next block
        (1, b"id: 1\nevent: e\ndata: b\n\n"),
    ]
    assert number_events(b"data: [DONE]\n\n", 41) == [(41, b"id: 41\ndata: [DONE]\n\n")]
    assert number_events(HEARTBEAT, 41) == [(None, b": ping\n")]
    assert number_events(b"", 3) == []
    # a block that begins with a comment but holds a field is an event
    assert number_events(b": c\ndata: x\n\n", 2) == [(2, b"id: 2\n: c\ndata: x\n\n")]
    with pytest.raises(ValueError, match="blank line"):
        number_events(b"data: a\n", 0)
