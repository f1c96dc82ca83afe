"""A window layer's ring of cells put back as a fresh evaluation leaves it, with the
window layers kept to their window (``--no-swa-full``; docs/prompt-cache.md, "The
window's ring, exact").

There the window layers have a ring of ``R`` cells (llama.cpp: the window plus a batch,
padded to 256; Gemma 3 with 512-token batches: 1,024). A fresh evaluation of a sequence
from an empty stream, in pieces of at most ``R - window + 1`` tokens, leaves position
*p* in cell ``p mod R`` — each piece starts at the head and the cells it takes hold
positions one lap older, which its first token no longer sees — and the head at
``end mod R``: after ``end`` tokens, cell *i* holds the last position below ``end`` that
is *i* modulo ``R``. Every later call's placement, the count of cells the attention
covers and the order it adds them in follow from that picture alone.

A reused prefix breaks the picture: cells trimmed off leave holes where a fresh
evaluation keeps older (masked) cells, and llama.cpp's search then starts elsewhere
(it goes back to cell 0 when the head is far above the cells in use); a restored state
goes into the first free cells in order. The values are right, the sums are not.

:func:`ring_layout` rewrites a sequence state (whole, or the window layers' part only)
so that ``llama_state_seq_set_data`` restores the fresh picture: its window part becomes
``min(end, R)`` cells in cell order, each holding the position a fresh evaluation keeps
there — the state's own rows for the positions the window still sees, zero rows for the
older ones (masked for every later token: the exact zeros a fresh evaluation's masked
cells add). The caller first puts the stream's search head at cell 0 (llama.cpp sets it
there when a shift finds no cell to move), so the cells land at 0, 1, 2…; the head then
sits after the last one, and where a fresh evaluation's head is inside the ring, the
cell there carries a position past the end (:attr:`Ring.filler`) whose removal puts the
head on it — a free cell where the fresh ring holds a masked one, which the next call
overwrites first either way.

The state format is :mod:`._state_layout`'s; the window part's cells come in cell order,
so after a wrap their positions are not ascending."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from .._cache import StateBuffer
from ._state_layout import HEADER, MAGIC, part, u32

__all__ = ["Ring", "ring_layout", "ring_size"]


@dataclass(frozen=True, slots=True)
class Ring:
    """A state to restore (``buffer``, ``size`` bytes) whose window cells land as a fresh
    evaluation of its ``end`` positions leaves them; ``filler``: the position to remove
    after the restore (its cell is where the fresh head is), ``None`` when there is none."""

    buffer: Any
    size: int
    end: int
    filler: int | None


def ring_size(n_ctx_seq: int, window: int, n_ubatch: int) -> int:
    """The window layers' cells per sequence (llama.cpp's ``llama_kv_cache_iswa``, one
    stream a sequence): the window and a batch, at most the context, padded to 256."""
    return -(-min(n_ctx_seq, window + n_ubatch) // 256) * 256


def ring_layout(buffer: Any, size: int, *, ring: int, window: int, partial: bool) -> Ring | None:
    """The state in ``buffer`` (``size`` bytes; whole, or the window layers' part only when
    ``partial``) with its window part laid out as a fresh evaluation's ring of ``ring``
    cells (``window``: the model's sliding window). ``None`` when it is not a state of one
    sequence in the format described, or it lacks a cell the next token attends to."""
    view = memoryview(buffer).cast("B")[:size]
    if size < HEADER or u32(view, 0) != MAGIC:
        return None
    at = HEADER
    if not partial:
        base = part(view, at)
        if base is None:
            return None
        at = base.end
    win = part(view, at, ordered=False)
    if win is None or win.end != size:
        return None
    positions = win.positions
    end = int(positions.max()) + 1
    if not partial and int(base.positions[-1]) + 1 != end:
        return None
    count = min(end, ring)
    index = numpy.arange(count, dtype=numpy.int64)
    wanted = index + ring * ((end - 1 - index) // ring)
    order = numpy.argsort(positions, kind="stable")
    ranked = positions[order].astype(numpy.int64)
    if (numpy.diff(ranked) <= 0).any() or ranked[0] < wanted.min():
        return None  # (a position twice, or one older than a lap)
    loc = numpy.minimum(numpy.searchsorted(ranked, wanted), len(ranked) - 1)
    found = ranked[loc] == wanted
    if int(found.sum()) != len(ranked):
        return None
    # every position the next token sees: the last ``window - 1``, all held
    seen = wanted >= end - window + 1
    if not found[seen].all():
        return None
    source = order[loc]
    filler: int | None = None
    final = wanted.astype(numpy.int32)
    if end > ring and end % ring:
        filler = end + ring
        final[end % ring] = filler
    cell = win.cell
    out_size = size + (count - win.count) * (cell + sum(r.width * r.lines for r in win.rows))
    out = StateBuffer(out_size)
    dst = numpy.ctypeslib.as_array(out.array)
    src = numpy.frombuffer(view, dtype=numpy.uint8)
    # the header, any full-attention part, the window part up to its cell count
    dst[: win.count_at] = src[: win.count_at]
    o = win.count_at
    dst[o : o + 4] = numpy.frombuffer(numpy.uint32(count).tobytes(), dtype=numpy.uint8)
    o += 4
    # the cells: (pos, n_seq_id, [ext], seq_id) — the kept cells' own, zero ext for the rest
    words = cell // 4
    held = numpy.frombuffer(view, dtype="<i4", count=win.count * words, offset=win.meta).reshape(-1, words)
    meta = numpy.zeros((count, words), dtype="<i4")
    meta[found] = held[source[found]]
    meta[:, 0] = final
    meta[:, 1] = 1
    meta[:, -1] = held[0, -1]
    n = count * cell
    dst[o : o + n] = meta.view(numpy.uint8).reshape(-1)
    o += n
    dst[o : o + 8] = src[win.data : win.data + 8]  # (v_trans, n_layer)
    o += 8
    for rows in win.rows:
        dst[o : o + rows.start - rows.header] = src[rows.header : rows.start]
        o += rows.start - rows.header
        width = rows.width
        lines = src[rows.start : rows.start + win.count * width * rows.lines].reshape(rows.lines, win.count, width)
        target = dst[o : o + count * width * rows.lines].reshape(rows.lines, count, width)
        # (the zero rows: the mapping's pages are zero until written)
        target[:, found, :] = lines[:, source[found], :]
        o += count * width * rows.lines
    tail = win.end - win.stream_end
    dst[o : o + tail] = src[win.stream_end : win.end]
    o += tail
    assert o == out_size
    return Ring(out.array, out_size, end, filler)
