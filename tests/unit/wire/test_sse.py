"""SSE wire format: byte-exact encoding, and decoding that survives any TCP split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve._wire._sse import (
    DONE,
    HEARTBEAT,
    ServerSentEvent,
    SSEDecoder,
    encode_comment,
    encode_data,
    encode_event,
)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"a":1}', b'data: {"a":1}\n\n'),
        (b"[DONE]", b"data: [DONE]\n\n"),
        (b"", b"data: \n\n"),
        (b"line1\nline2", b"data: line1\ndata: line2\n\n"),
        (b"a\r\nb\rc", b"data: a\ndata: b\ndata: c\n\n"),
        (b"trailing\n", b"data: trailing\ndata: \n\n"),
    ],
)
def test_encode_data_is_byte_exact(payload: bytes, expected: bytes) -> None:
    assert encode_data(payload) == expected


def test_encode_event_fields_and_injection() -> None:
    assert (
        encode_event(b"x", event="ping", id="7", retry=1500)
        == b"id: 7\nevent: ping\nretry: 1500\ndata: x\n\n"
    )
    # a newline in id/event must not start a new field
    assert (
        encode_event(b"x", event="a\ndata: evil", id="1\r\n2") == b"id: 12\nevent: adata: evil\ndata: x\n\n"
    )


def test_constants() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert HEARTBEAT == b": ping\n\n"
    assert encode_comment("") == b":\n\n"
    assert encode_comment("a\nb") == b": a\n: b\n\n"


def test_decoder_joins_multiline_data_and_counts_comments() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b": ping\n\ndata: a\ndata: b\nevent: x\nid: 3\n\ndata: [DONE]\n\n")
    assert [(e.data, e.event, e.id) for e in events] == [("a\nb", "x", "3"), ("[DONE]", "message", "3")]
    assert decoder.comments == 1


def test_decoder_handles_crlf_split_between_chunks() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    # "\r\n" split across reads is one line break; the lone "\r" ends the event
    assert [e.data for e in decoder.feed(b"\n\r")] == ["a"]
    # and the "\n" completing that "\r\n" is not a second empty line
    assert decoder.feed(b"\ndata: b\r\n\r\n") == [ServerSentEvent(data="b")]


def test_decoder_keeps_incomplete_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: partial") == []
    assert decoder.feed(b"\n") == []
    assert [e.data for e in decoder.feed(b"\n")] == ["partial"]


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)


@given(
    payloads=st.lists(_text, min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20),
    heartbeats=st.booleans(),
)
def test_round_trip_any_text_any_split(payloads: list[str], cuts: list[int], heartbeats: bool) -> None:
    wire = b""
    for payload in payloads:
        if heartbeats:
            wire += HEARTBEAT
        wire += encode_data(payload.encode())
    points = sorted({min(c, len(wire)) for c in cuts})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    decoder = SSEDecoder()
    events = [event for piece in pieces for event in decoder.feed(piece)]
    # the decoder normalises line breaks in data to "\n", as the SSE spec says
    expected = [p.replace("\r\n", "\n").replace("\r", "\n") for p in payloads]
    assert [e.data for e in events] == expected
