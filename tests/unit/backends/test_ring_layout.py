"""The window layers' ring laid out as a fresh evaluation leaves it
(``_backends/_llama/_ring_layout.py``; docs/prompt-cache.md, "The window's ring, exact"),
on states written in llama.cpp's format by hand: which position each cell holds, whose
rows it gets, the filler where the fresh head is, and the states it refuses. The real
model's bits: ``tests/e2e/test_swa_window.py`` and ``scripts/probes/ring_exact.py``."""

from __future__ import annotations

import struct

import numpy
import pytest

from trioserve._backends._llama._ring_layout import WindowRing, ring_layout, ring_size

MAGIC = 0xAF143CD8
K_WIDTH = 4  # bytes of a cell's key row
V_WIDTH = 3  # a transposed value: elements of 2 bytes a cell, in V_WIDTH lines
LAYERS = 2


def _window_state(positions: list[int], *, transposed: bool, seq_id: int = 3) -> bytes:
    """A window-only sequence state of one stream (of two) holding ``positions`` in this
    order; a cell's key bytes are its position (mod 256) and the layer, its value
    elements the position and the line."""
    out = struct.pack("<Ii", MAGIC, seq_id)
    out += struct.pack("<I", 2)  # two streams: the sequence's first, then an empty one
    out += struct.pack("<I", len(positions))
    for pos in positions:
        out += struct.pack("<iIi", pos, 1, seq_id)
    out += struct.pack("<II", int(transposed), LAYERS)
    for layer in range(LAYERS):
        out += struct.pack("<iQ", 1, K_WIDTH)
        out += b"".join(bytes([pos % 256, layer, 7, 9]) for pos in positions)
    for layer in range(LAYERS):
        if transposed:
            out += struct.pack("<iII", 1, 2, V_WIDTH)
            for line in range(V_WIDTH):
                out += b"".join(struct.pack("<H", 1000 * (layer + 1) + 10 * pos + line) for pos in positions)
        else:
            out += struct.pack("<iQ", 1, 2 * V_WIDTH)
            out += b"".join(
                struct.pack("<" + "H" * V_WIDTH, *(1000 * (layer + 1) + 10 * pos + i for i in range(V_WIDTH)))
                for pos in positions
            )
    out += struct.pack("<I", 0)  # the other stream: no cells
    return out


def _cells(state: bytes, count: int) -> list[tuple[int, int, int]]:
    at = 8 + 4 + 4
    assert struct.unpack_from("<I", state, 12)[0] == count
    return [struct.unpack_from("<iIi", state, at + 12 * i) for i in range(count)]


def _keys(state: bytes, count: int, layer: int) -> list[bytes]:
    at = 8 + 4 + 4 + 12 * count + 8 + layer * (12 + count * K_WIDTH) + 12
    return [state[at + K_WIDTH * i : at + K_WIDTH * (i + 1)] for i in range(count)]


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed-values"])
def test_each_cell_holds_what_a_fresh_ring_holds_there_and_the_head_cell_a_filler(transposed: bool) -> None:
    """Ring of 8, window of 4, 13 positions evaluated: a fresh ring holds 8–12 in cells
    0–4 and 5–7 in cells 5–7, its head at cell 5. The state holds 9–12 (the window of
    the last position), in any order; laid out, cell *i* holds its fresh position, with
    that position's own rows where the state had them and zero rows for the older ones;
    cell 5 (the head) carries a position past the end, 13 + 8, to remove after."""
    state = _window_state([11, 12, 9, 10], transposed=transposed)
    laid = ring_layout(state, len(state), ring=8, window=4, partial=True)
    assert laid is not None
    assert (laid.end, laid.start, laid.filler) == (13, 9, 21)
    out = bytes(laid.buffer)[: laid.size]
    assert [pos for pos, _, _ in _cells(out, 8)] == [8, 9, 10, 11, 12, 21, 6, 7]
    assert {(n, seq) for _, n, seq in _cells(out, 8)} == {(1, 3)}
    for layer in range(LAYERS):
        keys = _keys(out, 8, layer)
        assert keys[1:5] == [bytes([pos, layer, 7, 9]) for pos in (9, 10, 11, 12)]
        assert keys[0] == keys[5] == keys[6] == keys[7] == bytes(K_WIDTH)
    # the values: the last layer's, element by element
    values = numpy.frombuffer(out, dtype="<u2", offset=laid.size - 4 - 2 * V_WIDTH * 8, count=V_WIDTH * 8)
    grid = values.reshape(V_WIDTH, 8) if transposed else values.reshape(8, V_WIDTH).T
    for line in range(V_WIDTH):
        assert grid[line, 1:5].tolist() == [2000 + 10 * pos + line for pos in (9, 10, 11, 12)]
        assert grid[line, [0, 5, 6, 7]].tolist() == [0, 0, 0, 0]
    assert out[-4:] == struct.pack("<I", 0)  # (the empty stream after it)


def test_no_filler_where_the_fresh_head_is_the_ring_start_or_the_ring_never_went_round() -> None:
    """16 positions in a ring of 8: the head is back at cell 0 — the cells land at 0…7
    and the head after the last, with no filler. 6 positions: cells 0–5, no lap."""
    state = _window_state([12, 13, 14, 15], transposed=False)
    laid = ring_layout(state, len(state), ring=8, window=4, partial=True)
    assert laid is not None
    assert laid.filler is None
    assert [pos for pos, _, _ in _cells(bytes(laid.buffer)[: laid.size], 8)] == [8, 9, 10, 11, 12, 13, 14, 15]
    state = _window_state([2, 3, 4, 5], transposed=False)
    laid = ring_layout(state, len(state), ring=8, window=4, partial=True)
    assert laid is not None
    assert (laid.filler, laid.end) == (None, 6)
    assert [pos for pos, _, _ in _cells(bytes(laid.buffer)[: laid.size], 6)] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("positions", "why"),
    [
        ([9, 11, 12], "position 10, which the next token sees, is missing"),
        ([9, 10, 10, 11, 12], "a position twice"),
        ([3, 10, 11, 12], "a position older than a lap"),
    ],
)
def test_a_state_it_cannot_lay_out_is_refused(positions: list[int], why: str) -> None:
    state = _window_state(positions, transposed=False)
    assert ring_layout(state, len(state), ring=8, window=4, partial=True) is None, why


def test_a_state_of_another_format_is_refused() -> None:
    state = _window_state([9, 10, 11, 12], transposed=False)
    assert ring_layout(b"\0" + state[1:], len(state), ring=8, window=4, partial=True) is None
    assert ring_layout(state[:-3], len(state) - 3, ring=8, window=4, partial=True) is None


def test_the_ring_is_the_window_and_a_batch_padded_to_256_at_most_the_context() -> None:
    assert ring_size(32768, 512, 512) == 1024
    assert ring_size(32768, 512, 300) == 1024
    assert ring_size(32768, 1024, 512) == 1536
    assert ring_size(700, 512, 512) == 768


class _Lib:
    """The two llama.cpp calls a relay starts with, counted (the window state read back
    is empty: nothing is laid out, so only the decision shows)."""

    def __init__(self) -> None:
        self.reads = 0

    def llama_state_seq_get_size_ext(self, ctx: object, seq_id: int, flags: int) -> int:
        self.reads += 1
        return 16

    def llama_state_seq_get_data_ext(
        self, ctx: object, array: object, size: int, seq_id: int, flags: int
    ) -> int:
        return 0


class _Model:
    def __init__(self) -> None:
        self.lib = _Lib()


def test_a_trim_is_laid_out_again_only_where_its_holes_reach_the_rings_last_cell() -> None:
    """Ring of 8. Holes from the head up to cell 6 change nothing (no relay); to cell 7,
    or round the end, they do. Holes a trim left and no call filled count with the next
    trim's, and so do the cells of a call that failed — llama.cpp removed them itself
    before the trim looked (``note``, taken before the call)."""
    model = _Model()
    ring = WindowRing(model, None, None, ring=8, window=4)
    lib = model.lib
    assert ring.trimmed(0, held=7, keep=5) == 0  # never gone round
    assert ring.trimmed(0, held=12, keep=9) == 0  # holes at cells 1–3
    assert lib.reads == 0
    assert ring.trimmed(0, held=9, keep=9) == 0  # nothing removed, but holes up to 12 remain…
    assert ring.trimmed(0, held=9, keep=8) == 0  # …cells 0–3: still short of the last
    assert lib.reads == 0
    assert ring.trimmed(1, held=16, keep=10) == 0  # cells 2–7: the last cell emptied
    assert lib.reads == 1
    assert ring.trimmed(2, held=18, keep=14) == 0  # cells 6, 7, 0, 1: round the end
    assert lib.reads == 2
    # a call about to write sequence 3 up to 24 fails: llama.cpp removes its cells, so
    # the trim sees only 20 held — the noted reach says where the holes go
    ring.note(3, 24)
    assert ring.trimmed(3, held=20, keep=20) == 0  # (nothing removed by this trim…)
    assert lib.reads == 3  # (…but cells 4–7 are holes: laid out again)
    ring.note(4, 21)
    assert ring.trimmed(4, held=20, keep=20) == 0  # cell 4 only
    assert lib.reads == 3
