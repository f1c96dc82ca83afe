"""The reasoning tracker (``_backends/_decoding/_reasoning.py``): where a generation's text is,
read from its pieces however they split the markers, and what ending it writes."""

from __future__ import annotations

import pytest

from trioserve._backends._decoding import ReasoningTracker, marker_tokens

START, END = (1, 2), (3, 4, 5)


def _fed(pieces: list[bytes], *, opened: bool) -> ReasoningTracker:
    tracker = ReasoningTracker("<think>", "</think>", opened=opened)
    for piece in pieces:
        tracker.feed(piece)
    return tracker


@pytest.mark.parametrize("split", range(1, 20))
def test_the_end_marker_is_found_however_it_is_split(split: int) -> None:
    text = b"Two and two.</think>Four."
    cut = text.index(b"</think>") + len(b"</think>") - 1  # all but the marker's last byte
    tracker = ReasoningTracker("<think>", "</think>", opened=True)
    for i in range(0, cut, split):
        tracker.feed(text[i : min(i + split, cut)])
    assert tracker.state == "inside"
    assert tracker.to_force(START, END) == END
    tracker.feed(text[cut:])
    assert tracker.state == "answer"
    assert tracker.to_force(START, END) == ()  # never a second marker
    assert tracker.text_to_force() == ""


def test_before_it_opens() -> None:
    waiting = _fed([b"\n", b" "], opened=False)
    assert waiting.state == "start"
    assert waiting.to_force(START, END) == START + END  # an empty reasoning
    assert waiting.text_to_force() == "<think></think>"
    opening = _fed([b"\n<th"], opened=False)
    assert opening.state == "start"
    assert _fed([b"\n<th", b"ink>hm"], opened=False).state == "inside"
    assert _fed([b"Four."], opened=False).state == "answer"  # it answers without reasoning


def test_marker_tokens_prefer_a_special_token_that_reads_as_the_marker() -> None:
    vocabulary = {"<think>": [7], "</think>": [8]}

    def tokenize(text: str, *, add_bos: bool, parse_special: bool) -> list[int]:
        return vocabulary[text] if parse_special else [ord(c) for c in text]

    assert marker_tokens(
        tokenize, lambda t: b"<think>" if t == [7] else b"</think>", "<think>", "</think>"
    ) == (
        (7,),
        (8,),
    )
    # a control token renders as nothing: the marker's text tokens instead
    as_text = marker_tokens(tokenize, lambda t: b"", "<think>", "</think>")
    assert as_text == (tuple(map(ord, "<think>")), tuple(map(ord, "</think>")))
