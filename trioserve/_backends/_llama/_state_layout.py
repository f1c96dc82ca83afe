"""A restored sequence state's window cells, put where a fresh evaluation put them
(docs/prompt-cache.md, "Window cells in their places").

A sequence state (``llama_state_seq_get_data``) of a sliding-window model holds two
parts: the full-attention layers' cells for every position, then the window layers'
cells only for the positions its last token still sees (llama.cpp skips the cells the
window masks for the sequence's last position). ``llama_state_seq_set_data`` puts each
part's cells into the first free cells of the sequence's stream, in order: the
full-attention cells land where a fresh evaluation put them (cell *p* holds position
*p*), the window cells *w* cells lower, *w* the first position they hold.

The values are the same; the sums are not. The attention's kernels split a row's work
by the cells a stream uses (a decode step's row over threads, by the count of cells up
to the highest one in use) and add its terms in cell order: with the window cells *w*
lower and their count *w* smaller, a reply's tokens after a restore were drawn from
other logits than the fresh evaluation's — in every run measured, and one conversation
in 12 restored from the disk tier answered another text
(`tests/unit/backends/test_state_layout.py`, `tests/e2e/test_disk_cache.py`).

:func:`aligned` rewrites the window part before the restore: a zero cell for each
position of the full-attention part that it lacks, then its own cells, so every cell
sits at its fresh index. The zero cells are masked for every later token (they were
masked for the state's last position, and the window only moves on), so they add the
exact zeros the fresh evaluation's masked cells add — and the later tokens' sums are the
fresh sums, split as they were. The caller keeps the first real window position (:attr:`Layout.start`):
llama.cpp now reports 0, and a prefix whose next tokens would see a zero cell is never
served from these cells.

The format read is the one ``llama_state_seq_get_data`` writes: ``u32 0xaf143cd8, i32
seq_id``, then ``llama_kv_cache::state_write``'s, per cache (the full-attention one,
then the window one)::

    u32 n_stream, then per stream: u32 cell_count, and when it is not 0:
      cell_count × (i32 pos, u32 n_seq_id = 1, [12-byte ext], i32 seq_id)
      u32 v_trans, u32 n_layer
      n_layer × (i32 k_type, u64 k_row_bytes, cell_count rows)
      v_trans == 0: n_layer × (i32 v_type, u64 v_row_bytes, cell_count rows)
      v_trans == 1: n_layer × (i32 v_type, u32 element_bytes, u32 n_embd_v,
                                n_embd_v lines of cell_count elements)

Anything else — another build's format, a layer without values — parses to ``None``
and the caller does not restore the state (a miss: the prompt is evaluated)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy

from .._cache import StateBuffer

__all__ = ["Layout", "aligned", "restore"]

logger = logging.getLogger("trioserve.llama")
#: a paused request restored with its window cells elsewhere was said once
_said: list[bool] = []

#: the state's header: u32 magic, i32 seq_id
_MAGIC = 0xAF143CD8
_HEADER = 8
#: a cell's metadata: i32 pos, u32 n_seq_id, i32 seq_id; with the ext, 12 bytes more
_CELL = 12
_EXT = 12


@dataclass(frozen=True, slots=True)
class _Rows:
    """One layer's keys or values in a part."""

    #: where its header starts and its rows start
    header: int
    start: int
    #: bytes per cell in one line (a row; an element of a transposed value line)
    width: int
    #: lines: 1, or the value width of a transposed value tensor
    lines: int


@dataclass(frozen=True, slots=True)
class _Part:
    """One cache's part of a sequence state."""

    start: int
    #: the offset of the cell count of the stream holding the sequence
    count_at: int
    count: int
    #: the cells' metadata: its offset and bytes per cell
    meta: int
    cell: int
    positions: numpy.ndarray
    #: the offset of ``v_trans``
    data: int
    rows: tuple[_Rows, ...]
    #: where the stream's rows end, and the part
    stream_end: int
    end: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A state to restore: ``buffer`` (``size`` bytes) for ``llama_state_seq_set_data``;
    ``start``, the first position whose window cells it really holds."""

    buffer: Any
    size: int
    start: int


def aligned(buffer: Any, size: int) -> Layout | None:
    """The state in ``buffer`` (``size`` bytes; a ctypes array or any byte buffer) with
    its window cells at the full-attention cells' indices — itself when they are
    already; ``None`` when it is not a two-part state of one sequence as described."""
    view = memoryview(buffer).cast("B")[:size]
    if size < _HEADER or _u32(view, 0) != _MAGIC:
        return None
    base = _part(view, _HEADER)
    if base is None:
        return None
    window = _part(view, base.end)
    if window is None or window.end != size or window.cell != base.cell:
        return None
    pad = base.count - window.count
    if pad < 0 or not numpy.array_equal(base.positions[pad:], window.positions):
        return None
    start = int(window.positions[0])  # (a part holds cells: _part found its stream)
    if pad == 0:
        return Layout(buffer, size, start)
    # the full-attention part's cells: the same positions, the same sequence
    meta = _bytes_at(view, base.meta, base.count * base.cell)

    def place(held: numpy.ndarray, whole: numpy.ndarray) -> None:
        # (the zero cells first: the mapping's pages are zero until written)
        whole[:, pad:, :] = held

    array, out_size = _rewrite(view, size, window, base.count, meta, place)
    return Layout(array, out_size, start)


def _bytes_at(view: memoryview, at: int, n: int) -> numpy.ndarray:
    """``n`` bytes of ``view`` from ``at``, as a uint8 array (no copy)."""
    return numpy.frombuffer(view, dtype=numpy.uint8, count=n, offset=at)


def _rewrite(
    view: memoryview,
    size: int,
    window: _Part,
    count: int,
    meta: numpy.ndarray,
    place: Callable[[numpy.ndarray, numpy.ndarray], None],
) -> tuple[Any, int]:
    """A copy of the state in ``view`` whose window part holds ``count`` cells: their
    metadata ``meta`` (bytes), and each layer's keys and values as ``place`` puts the
    part's own rows (``lines × cells × width``) among them (zero rows elsewhere)."""
    out_size = size + (count - window.count) * (window.cell + sum(r.width * r.lines for r in window.rows))
    out = StateBuffer(out_size)
    dst = numpy.ctypeslib.as_array(out.array)
    src = numpy.frombuffer(view, dtype=numpy.uint8)
    # the header, any full-attention part, the window part up to its cell count
    dst[: window.count_at] = src[: window.count_at]
    o = window.count_at
    dst[o : o + 4] = numpy.frombuffer(numpy.uint32(count).tobytes(), dtype=numpy.uint8)
    o += 4
    dst[o : o + len(meta)] = meta
    o += len(meta)
    dst[o : o + 8] = src[window.data : window.data + 8]  # (v_trans, n_layer)
    o += 8
    for rows in window.rows:
        dst[o : o + rows.start - rows.header] = src[rows.header : rows.start]
        o += rows.start - rows.header
        held = src[rows.start : rows.start + window.count * rows.width * rows.lines]
        n = count * rows.width * rows.lines
        place(
            held.reshape(rows.lines, window.count, rows.width),
            dst[o : o + n].reshape(rows.lines, count, rows.width),
        )
        o += n
    # the other streams' cell counts (0) after the sequence's stream
    tail = window.end - window.stream_end
    dst[o : o + tail] = src[window.stream_end : window.end]
    o += tail
    assert o == out_size
    return out.array, out_size


def restore(
    lib: Any, ctx: Any, buffer: Any, size: int, seq_id: int, *, in_place: bool, strict: bool
) -> int | None:
    """``llama_state_seq_set_data`` of the state in ``buffer`` into ``seq_id``, its
    window cells put in their places first when ``in_place`` (:func:`aligned`). The
    first position whose window cells it really holds (0 when not placed), or ``None``
    when nothing was restored: llama.cpp refused, or (``strict``) the layout is not one
    this build writes."""
    start = 0
    if in_place:
        layout = aligned(buffer, size)
        if layout is not None:
            buffer, size, start = layout.buffer, layout.size, layout.start
        elif strict:
            logger.warning("a saved state's layout is not the one this build writes; it is not restored")
            return None
        elif not _said:
            _said.append(True)
            logger.warning(
                "a paused request's state has a layout this build does not know: it resumes "
                "with its window cells elsewhere, and its text may differ from an unpaused run"
            )
    if not lib.llama_state_seq_set_data(ctx, buffer, size, seq_id):
        return None
    return start


def _u32(view: memoryview, at: int) -> int:
    return int.from_bytes(view[at : at + 4], "little")


def _u64(view: memoryview, at: int) -> int:
    return int.from_bytes(view[at : at + 8], "little")


def _part(view: memoryview, at: int, *, ordered: bool = True) -> _Part | None:
    size = len(view)
    start = at
    if at + 4 > size:
        return None
    n_stream = _u32(view, at)
    at += 4
    if not 0 < n_stream <= 65536:
        return None
    found: tuple[int, int, int, int, numpy.ndarray, int, tuple[_Rows, ...], int] | None = None
    for _ in range(n_stream):
        if at + 4 > size:
            return None
        count_at = at
        count = _u32(view, at)
        at += 4
        if count == 0:
            continue
        if found is not None:
            return None  # (one sequence's cells live in one stream)
        cells = _cells(view, at, count, ordered=ordered)
        if cells is None:
            return None
        cell, positions = cells
        meta = at
        at += count * cell
        data = at
        rows = _data(view, at, count)
        if rows is None:
            return None
        layers, at = rows
        found = (count_at, count, meta, cell, positions, data, layers, at)
    if found is None:
        return None
    count_at, count, meta, cell, positions, data, layers, stream_end = found
    return _Part(start, count_at, count, meta, cell, positions, data, layers, stream_end, at)


def _cells(view: memoryview, at: int, count: int, *, ordered: bool) -> tuple[int, numpy.ndarray] | None:
    for cell in (_CELL, _CELL + _EXT):
        if at + count * cell > len(view):
            continue
        words = numpy.frombuffer(view, dtype="<i4", count=count * cell // 4, offset=at)
        table = words.reshape(count, cell // 4)
        positions = table[:, 0]
        if (
            (table[:, 1] == 1).all()
            and (table[:, -1] == table[0, -1]).all()
            and positions[0] >= 0
            and (positions >= 0).all()
            and (not ordered or (numpy.diff(positions) > 0).all())
        ):
            return cell, positions.copy()
    return None


def _data(view: memoryview, at: int, count: int) -> tuple[tuple[_Rows, ...], int] | None:
    size = len(view)
    if at + 8 > size:
        return None
    v_trans, n_layer = _u32(view, at), _u32(view, at + 4)
    at += 8
    if v_trans not in (0, 1) or not 0 < n_layer <= 4096:
        return None
    rows: list[_Rows] = []
    for _ in range(n_layer):  # keys
        header = at
        at += 12
        width = _u64(view, header + 4)
        rows.append(_Rows(header, at, width, 1))
        at += count * width
        if at > size or width == 0:
            return None
    for _ in range(n_layer):  # values (every layer has them: else the length is off)
        header = at
        at += 12  # (i32 type, then u64 row bytes or u32 element bytes + u32 width)
        if v_trans:
            width, lines = _u32(view, header + 4), _u32(view, header + 8)
        else:
            width, lines = _u64(view, header + 4), 1
        rows.append(_Rows(header, at, width, lines))
        at += count * width * lines
        if at > size or width == 0 or lines == 0:
            return None
    return tuple(rows), at


#: for :mod:`._ring_layout`, which reads the same format
HEADER, MAGIC, part, rewrite, u32 = _HEADER, _MAGIC, _part, _rewrite, _u32
