"""Text assembly: UTF-8 never broken, stop sequences never leaked, any split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve._core._text import StopMatcher, TextAssembler, Utf8Assembler

SAMPLES = ["你好世界", "🎉🦜🫠", "👩‍👩‍👧 family", "鼃鼄鼅", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "mixed: café ß 東京 🚀"]


@pytest.mark.parametrize("text", SAMPLES)
def test_utf8_every_byte_split_never_emits_a_broken_character(text: str) -> None:
    data = text.encode()
    assembler = Utf8Assembler()
    deltas = [assembler.feed(data[i : i + 1]) for i in range(len(data))]
    deltas.append(assembler.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_utf8_incomplete_tail_is_dropped_at_the_end() -> None:
    assembler = Utf8Assembler()
    assert assembler.feed("a🎉".encode()[:-1]) == "a"
    assert assembler.flush() == ""


def test_utf8_invalid_bytes_become_replacement_characters() -> None:
    assembler = Utf8Assembler()
    assert assembler.feed(b"a\xffb") == "a\ufffdb"


@given(text=st.text(), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_utf8_any_split_equals_whole_decode(text: str, cuts: list[int]) -> None:
    data = text.encode("utf-8", errors="surrogatepass")
    text = data.decode("utf-8", errors="replace")  # lone surrogates are not valid UTF-8
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assembler = Utf8Assembler()
    out = "".join(assembler.feed(p) for p in pieces) + assembler.flush()
    assert out == text


@given(data=st.binary(max_size=64), cuts=st.lists(st.integers(min_value=0, max_value=64), max_size=10))
def test_utf8_arbitrary_bytes_any_split_equals_one_piece(data: bytes, cuts: list[int]) -> None:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assembler = Utf8Assembler()
    out = "".join(assembler.feed(p) for p in pieces) + assembler.flush()
    whole = Utf8Assembler()
    assert out == whole.feed(data) + whole.flush()
    # and it is what a one-shot decode gives, but for a dropped incomplete tail
    reference = data.decode("utf-8", errors="replace")
    assert reference.startswith(out)
    assert set(reference[len(out) :]) <= {"\ufffd"}


def _run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        (["\n\n"], ["a", "\n", "\n", "b"], ("a", True)),
        (["END"], ["xx E", "N", "D yy"], ("xx ", True)),
        (["END"], ["xx E", "N", "d yy"], ("xx ENd yy", False)),
        (["abc", "bcd"], ["a", "b", "c"], ("", True)),
        (["bcd", "abc"], ["xab", "cd"], ("x", True)),  # earliest match wins
        (["</s>"], ["text</", "s>more"], ("text", True)),
        ([], ["a", "b"], ("ab", False)),
        (["x"], ["x"], ("", True)),
        (["ab"], ["a"], ("a", False)),  # held, then released at the end
    ],
)
def test_stop_sequences_across_pieces(
    stops: list[str], pieces: list[str], expected: tuple[str, bool]
) -> None:
    assert _run(stops, pieces) == expected


@given(
    prefix=st.text(alphabet="abcxyz \n", max_size=30),
    stop=st.text(alphabet="abc\n", min_size=1, max_size=5),
    suffix=st.text(alphabet="abcxyz \n", max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=70), max_size=12),
)
def test_stop_matcher_equals_find_on_whole_text(prefix: str, stop: str, suffix: str, cuts: list[int]) -> None:
    text = prefix + stop + suffix
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    emitted, stopped = _run([stop], pieces)
    assert stopped
    assert emitted == text[: text.find(stop)]
    assert stop not in emitted


def test_text_assembler_stop_inside_multibyte_stream() -> None:
    assembler = TextAssembler(stops=["世界"])
    data = "你好世界!".encode()
    out = []
    for i in range(len(data)):
        out.append(assembler.feed(data[i : i + 1]))
        if assembler.stopped:
            break
    assert "".join(out) == "你好"
    assert assembler.stopped


def test_text_assembler_flush_releases_held_text() -> None:
    assembler = TextAssembler(stops=["STOP"])
    assert assembler.feed(b"go ST") == "go "
    assert assembler.flush() == "ST"
    assert not assembler.stopped
